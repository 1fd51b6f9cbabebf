#!/usr/bin/env bash
# Runs hpshard-run over rank_probe and checks exit codes, output prefixes and cleanup.
# usage: launcher_test.sh CASE HPSHARD_RUN RANK_PROBE
#   CASE: meet-tcp | meet-file | fail | fail-stubborn | fail-outside-kill | signal | forward |
#         forward-stubborn | launcher-killed | timeout | early-exit | usage | store-fd |
#         shm-cleanup | closed-fds | long-line | fd-limit | failed-rank-children | split-exit |
#         group-killed | group-killed-early | stop-continue | terminal-input | blocked-output |
#         line-64k | partial-line | reopen-tcp | reopen-file | killed-after-fork |
#         succeeded-rank-children
#   killed-after-fork needs HPS_FORK_PAUSE_LIB (fork_pause.c built as a shared library).
set -uo pipefail
case_name=$1 run=$2 probe=$3
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

fail() {
  echo "FAIL ($case_name): $*"
  echo "--- stdout"; cat "$work/out" 2>/dev/null
  echo "--- stderr"; cat "$work/err" 2>/dev/null
  exit 1
}
now_ms() { echo $(($(date +%s%N) / 1000000)); }
# Whether a process runs whose whole command line is "$1" (read from /proc: no procps
# needed); with "kill", those are killed too.
running_command() {
  local d found=1
  for d in /proc/[0-9]*; do
    [ "$(tr '\0' ' ' <"$d/cmdline" 2>/dev/null)" = "$1 " ] || continue
    found=0
    [ "${2:-}" = kill ] && kill -9 "${d#/proc/}" 2>/dev/null
  done
  return $found
}

# Every line a rank wrote carries its prefix; the launcher's own lines start "hpshard-run: ".
check_prefixes() {
  local bad
  bad=$(grep -v -E '^\[rank [0-9]+\] |^hpshard-run: ' "$1") && fail "unprefixed lines in $1: $bad"
  return 0
}

case $case_name in
  split-exit)
    # Rank 0 serves the TCP store and is no member of the split: done at once, it leaves
    # while the members still make theirs. They failed ("cannot reach the server") in most
    # runs when its store stopped serving at once.
    for i in 1 2 3 4 5; do
      "$run" -n 4 --timeout 60 -- "$probe" split-exit >"$work/out" 2>"$work/err"
      rc=$?
      [ $rc -eq 0 ] || fail "run $i: exit code $rc"
      for r in 0 1 2 3; do
        grep -qxF "[rank $r] rank $r made its side of the split" "$work/out" ||
          fail "run $i: rank $r did not make its side"
      done
    done
    ;;
  reopen-tcp | reopen-file)
    # Every rank closes the job's store and world and opens them again, ranks 1 and 2 before
    # rank 0 has closed its own. They were refused ("has joined the store already") with
    # the file store; with the TCP store, rank 0's close waited for their new connections
    # until its timeout while they waited for its next server.
    store=${case_name#reopen-}
    start=$(date +%s)
    "$run" -n 3 --store "$store" --timeout 60 -- "$probe" reopen >"$work/out" 2>"$work/err"
    rc=$?
    [ $rc -eq 0 ] || fail "exit code $rc, expected 0"
    for r in 0 1 2; do
      for phase in 0 1; do
        grep -qxF "[rank $r] rank $r phase $phase summed 6" "$work/out" ||
          fail "rank $r did not sum in phase $phase"
      done
    done
    [ $(($(date +%s) - start)) -lt 8 ] || fail "took $(($(date +%s) - start)) s"
    ;;
  meet-tcp | meet-file)
    store=${case_name#meet-}
    "$run" -n 3 --store "$store" --timeout 60 -- "$probe" meet >"$work/out" 2>"$work/err"
    rc=$?
    [ $rc -eq 0 ] || fail "exit code $rc, expected 0"
    for r in 0 1 2; do
      grep -qxF "[rank $r] rank $r of 3 met every rank" "$work/out" || fail "rank $r did not meet"
      grep -qxF "[rank $r] HPS_RANK=$r" "$work/out" || fail "rank $r: HPS_RANK"
      grep -qxF "[rank $r] HPS_WORLD_SIZE=3" "$work/out" || fail "rank $r: HPS_WORLD_SIZE"
      grep -qxF "[rank $r] HPS_LOCAL_RANK=$r" "$work/out" || fail "rank $r: HPS_LOCAL_RANK"
      # stdout and stderr stay apart
      grep -qxF "[rank $r] probe stderr from rank $r" "$work/err" || fail "rank $r: stderr line"
      grep -qF "probe stderr" "$work/out" && fail "stderr lines leaked into stdout"
    done
    check_prefixes "$work/out"
    check_prefixes "$work/err"
    url=$(sed -n 's/^\[rank 0\] HPS_STORE=//p' "$work/out")
    [ "$(grep -c "HPS_STORE=$url\$" "$work/out")" -eq 3 ] || fail "ranks got different stores"
    job=$(sed -n 's/^\[rank 0\] HPS_JOB_ID=//p' "$work/out")
    [[ $job =~ ^hpshard-run-[0-9a-f]{24}$ ]] || fail "unexpected job id '$job'"
    [ "$(grep -c "HPS_JOB_ID=$job\$" "$work/out")" -eq 3 ] || fail "ranks got different job ids"
    # A 64-hex-digit token for every rank (the TCP store asks for it; a file store ignores it).
    [ "$(grep -c "token bytes=64\$" "$work/out")" -eq 3 ] || fail "a rank got no token"
    if [ "$store" = tcp ]; then
      [[ $url =~ ^tcp://127\.0\.0\.1:[0-9]+$ ]] || fail "unexpected tcp store URL '$url'"
      grep -qxF "[rank 1] a client without the token was refused" "$work/out" ||
        fail "a client without the token was not refused"
    else
      [[ $url =~ ^file:///.+ ]] || fail "unexpected file store URL '$url'"
      [ -e "${url#file://}" ] && fail "store directory ${url#file://} was not removed"
    fi
    ;;
  fail | fail-stubborn)
    extra=()
    [ "$case_name" = fail-stubborn ] && extra=(stubborn)
    start=$(now_ms)
    "$run" -n 3 --grace 1 -- "$probe" fail 1 3 "${extra[@]}" >"$work/out" 2>"$work/err"
    rc=$?
    took=$(($(now_ms) - start))
    [ $rc -eq 3 ] || fail "exit code $rc, expected 3"
    [ "$took" -lt 8000 ] || fail "took ${took} ms: the sleeping ranks were not stopped"
    grep -qF "hpshard-run: rank 1 exited with code 3; stopping the other ranks" "$work/err" ||
      fail "no message naming the failed rank"
    grep -qxF "[rank 1] rank 1 exiting with 3" "$work/out" || fail "rank 1's last line missing"
    grep -qF "slept 60 s" "$work/out" && fail "a sleeping rank was not stopped"
    for pid in $(sed -n 's/^\[rank [02]\] pid=//p' "$work/out"); do
      kill -0 "$pid" 2>/dev/null && fail "rank process $pid still alive"
    done
    check_prefixes "$work/out"
    echo "launcher exited 3 after ${took} ms"
    ;;
  fail-outside-kill)
    # Rank 1 fails; ranks 0 and 2 ignore the launcher's SIGTERM. Rank 0 is then SIGKILLed
    # from outside (as the OOM killer would) within the grace period: the launcher names that
    # too, and not rank 2's end by its own SIGKILL after the grace period.
    "$run" -n 3 --grace 2 -- "$probe" fail 1 3 stubborn >"$work/out" 2>"$work/err" &
    launcher=$!
    pid0=""
    for _ in $(seq 200); do
      pid0=$(sed -n 's/^\[rank 0\] pid=//p' "$work/out")
      [ -n "$pid0" ] && grep -qF "stopping the other ranks" "$work/err" && break
      sleep 0.05
    done
    [ -n "$pid0" ] || fail "rank 0 printed no pid"
    kill -KILL "$pid0"
    wait $launcher
    rc=$?
    [ $rc -eq 3 ] || fail "exit code $rc, expected 3"
    grep -qF "hpshard-run: rank 1 exited with code 3; stopping the other ranks" "$work/err" ||
      fail "no message naming the failed rank"
    grep -qF "rank 0 also was killed by signal 9 (Killed), a signal hpshard-run did not send" \
      "$work/err" || fail "the rank killed from outside was not named"
    grep -qF "rank 2 also" "$work/err" && fail "rank 2, stopped by the launcher, was named"
    grep -qF "sending SIGKILL" "$work/err" || fail "rank 2 was not killed after the grace period"
    ;;
  signal)
    "$run" -n 3 --grace 1 -- "$probe" signal 2 9 >"$work/out" 2>"$work/err"
    rc=$?
    [ $rc -eq 137 ] || fail "exit code $rc, expected 137 (128 + SIGKILL)"
    grep -qF "rank 2 was killed by signal 9" "$work/err" || fail "no message naming the signal"
    ;;
  forward)
    # Every rank sleeps (no rank 99); SIGTERM to the launcher reaches them all.
    "$run" -n 3 --grace 1 -- "$probe" fail 99 1 >"$work/out" 2>"$work/err" &
    launcher=$!
    for _ in $(seq 100); do
      [ "$(grep -c 'sleeping' "$work/out")" -eq 3 ] && break
      sleep 0.05
    done
    start=$(now_ms)
    kill -TERM $launcher
    wait $launcher
    rc=$?
    took=$(($(now_ms) - start))
    [ $rc -eq 143 ] || fail "exit code $rc, expected 143 (128 + SIGTERM)"
    [ "$took" -lt 5000 ] || fail "took ${took} ms to stop"
    grep -qF "forwarding it to the ranks" "$work/err" || fail "no message about the signal"
    for pid in $(sed -n 's/^\[rank [0-9]\] pid=//p' "$work/out"); do
      kill -0 "$pid" 2>/dev/null && fail "rank process $pid still alive"
    done
    ;;
  forward-stubborn)
    # The ranks ignore SIGTERM (a handler that saves first, say): SIGTERM to the launcher is
    # forwarded, they are SIGKILLed after the grace period, and the launcher exits 128 +
    # SIGTERM without blaming a rank for the SIGKILL it sent itself.
    "$run" -n 2 --grace 1 -- "$probe" fail 99 1 stubborn >"$work/out" 2>"$work/err" &
    launcher=$!
    for _ in $(seq 100); do
      [ "$(grep -c 'sleeping' "$work/out")" -eq 2 ] && break
      sleep 0.05
    done
    kill -TERM $launcher
    wait $launcher
    rc=$?
    [ $rc -eq 143 ] || fail "exit code $rc, expected 143 (128 + SIGTERM)"
    grep -qF "sending SIGKILL" "$work/err" || fail "the stubborn ranks were not killed"
    grep -qF "stopping the other ranks" "$work/err" && fail "a rank was blamed for the launcher's SIGKILL"
    grep -qF "after the signal hpshard-run forwarded" "$work/err" || fail "the ranks' ends were not told"
    ;;
  launcher-killed)
    # SIGKILL to the launcher (no code of its own runs): its ranks die with it (even those
    # that ignore SIGTERM) and the file store's directory goes.
    "$run" -n 2 --store file -- "$probe" fail 99 1 stubborn >"$work/out" 2>"$work/err" &
    launcher=$!
    for _ in $(seq 100); do
      [ "$(grep -c 'sleeping' "$work/out")" -eq 2 ] && break
      sleep 0.05
    done
    dir=$(sed -n 's|^\[rank 0\] HPS_STORE=file://||p' "$work/out")
    [ -n "$dir" ] && [ -d "$dir" ] || fail "no store directory '$dir' while running"
    kill -KILL $launcher
    wait $launcher 2>/dev/null
    pids=$(sed -n 's/^\[rank [0-9]\] pid=//p' "$work/out")
    [ "$(wc -w <<<"$pids")" -eq 2 ] || fail "the ranks printed no pids"
    for _ in $(seq 100); do
      alive=0
      for pid in $pids; do
        # A zombie (reaped by init shortly) counts as gone.
        state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)
        [ -n "$state" ] && [ "$state" != Z ] && alive=1
      done
      [ $alive -eq 0 ] && [ ! -e "$dir" ] && break
      sleep 0.1
    done
    for pid in $pids; do
      state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)
      if [ -n "$state" ] && [ "$state" != Z ]; then
        kill -KILL "$pid"
        fail "rank process $pid outlived the launcher"
      fi
    done
    [ -e "$dir" ] && { rm -rf "$dir"; fail "store directory $dir was left"; }
    ;;
  terminal-input)
    # Rank 0 reads the launcher's input, the others /dev/null. From a terminal (a pty here,
    # as from an interactive shell) the line typed reaches rank 0: a rank reading the
    # terminal itself was stopped (SIGTTIN, its process group is not the foreground one)
    # and the job never ended. In the background the launcher reads nothing (it would be
    # stopped itself) and its job runs on.
    command -v python3 >/dev/null || { echo "SKIP: no python3"; exit 0; }
    printf 'piped\n' | "$run" -n 2 --timeout 60 -- sh -c 'read x; echo "rank $HPS_RANK got:$x"' \
      >"$work/out" 2>"$work/err" || fail "input from a pipe: exit code $?"
    grep -qxF "[rank 0] rank 0 got:piped" "$work/out" || fail "rank 0 did not read the pipe"
    grep -qxF "[rank 1] rank 1 got:" "$work/out" || fail "rank 1 did not read /dev/null"
    python3 - "$run" >"$work/out" 2>"$work/err" <<'PY' || fail "on a terminal"
import os, pty, select, sys, time
run = sys.argv[1]
rank = "read x; echo rank $HPS_RANK got:$x"


def on_pty(child, typed):
    """Runs child() on a new pty, types `typed`; the output and exit code (None: hung)."""
    pid, fd = pty.fork()
    if pid == 0:
        child()
    time.sleep(0.5)
    os.write(fd, typed)
    out, end = b"", time.time() + 15
    while time.time() < end:
        if select.select([fd], [], [], 0.1)[0]:
            try:
                out += os.read(fd, 4096)
            except OSError:
                pass
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return out.decode(errors="replace"), os.waitstatus_to_exitcode(status)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return out.decode(errors="replace"), None


def foreground():
    os.execv(run, [run, "-n", "2", "--", "sh", "-c", rank])


def background():
    launcher = os.fork()
    if launcher == 0:
        os.setpgid(0, 0)  # a job of its own, not the terminal's foreground one
        os.execv(run, [run, "-n", "1", "--", "sh", "-c", "sleep 1; echo done"])
    os._exit(os.waitstatus_to_exitcode(os.waitpid(launcher, 0)[1]) & 255)


out, code = on_pty(foreground, b"typed\n")
print(out)
if code != 0 or "[rank 0] rank 0 got:typed" not in out or "[rank 1] rank 1 got:\r" not in out:
    sys.exit("foreground: exit code %s" % code)
out, code = on_pty(background, b"for the shell\n")
print(out)
if code != 0 or "[rank 0] done" not in out:
    sys.exit("background: exit code %s" % code)
PY
    ;;
  blocked-output)
    # The launcher's stdout is a FIFO this shell holds open and never reads. The timeout, a
    # forwarded SIGTERM and a failed rank act on time all the same (each stalled for as long
    # as nothing read: the loop that handles them was blocked writing), and the launcher then
    # exits after a bounded wait for its reader. The ranks write more than the launcher holds:
    # it stops reading their pipes, so they block on their own output (they never finish).
    mkfifo "$work/fifo"
    exec 3<>"$work/fifo"
    export HPS_TEST_DIR=$work
    # shellcheck disable=SC2016  # expanded by the ranks' shells
    flood='echo $$ >"$HPS_TEST_DIR/pid.$HPS_RANK"; yes "line of rank $HPS_RANK" | head -c 20000000
      touch "$HPS_TEST_DIR/wrote.$HPS_RANK"; sleep 60'
    # Waits at most $1 s for the launcher: its exit code in rc, the time since start in took.
    wait_launcher() {
      local _
      for _ in $(seq $(($1 * 10))); do
        kill -0 "$launcher" 2>/dev/null || break
        sleep 0.1
      done
      if kill -0 "$launcher" 2>/dev/null; then
        kill -KILL "$launcher"
        wait "$launcher"
        for f in "$work"/pid.*; do kill -KILL -- "-$(cat "$f")" 2>/dev/null; done
        fail "$2: the launcher was still running after $1 s"
      fi
      wait "$launcher"
      rc=$?
      took=$(($(now_ms) - start))
    }
    ranks_gone() {
      local f
      for f in "$work"/pid.*; do kill -0 "$(cat "$f")" 2>/dev/null && return 1; done
      return 0
    }
    start=$(now_ms)
    "$run" -n 2 --timeout 2 --grace 1 -- sh -c "$flood" >"$work/fifo" 2>"$work/err" &
    launcher=$!
    wait_launcher 20 "--timeout 2"
    [ $rc -eq 124 ] || fail "--timeout 2: exit code $rc, expected 124"
    [ "$took" -lt 8000 ] || fail "--timeout 2: took ${took} ms"
    ranks_gone || fail "--timeout 2: a rank outlived the launcher"
    ls "$work"/wrote.* >/dev/null 2>&1 && fail "a rank wrote 20 MB that nothing read"
    grep -qF "bytes of the ranks' output not written: its reader took none for 2 s" \
      "$work/err" || fail "--timeout 2: the output given up is not said"
    echo "--timeout 2: exit 124 after ${took} ms"

    rm -f "$work"/pid.*
    "$run" -n 2 --grace 1 -- sh -c "$flood" >"$work/fifo" 2>"$work/err" &
    launcher=$!
    for _ in $(seq 200); do
      [ -e "$work/pid.0" ] && [ -e "$work/pid.1" ] && break
      sleep 0.05
    done
    sleep 0.5
    start=$(now_ms)
    kill -TERM "$launcher"
    wait_launcher 20 "SIGTERM"
    [ $rc -eq 143 ] || fail "SIGTERM: exit code $rc, expected 143"
    [ "$took" -lt 6000 ] || fail "SIGTERM: took ${took} ms"
    ranks_gone || fail "SIGTERM: a rank outlived the launcher"
    echo "SIGTERM: exit 143 after ${took} ms"

    rm -f "$work"/pid.*
    start=$(now_ms)
    "$run" -n 2 --grace 1 -- sh -c \
      "if [ \$HPS_RANK = 1 ]; then echo \$\$ >$work/pid.1; sleep 1; exit 3; fi; $flood" \
      >"$work/fifo" 2>"$work/err" &
    launcher=$!
    stopped=""
    for _ in $(seq 100); do
      if [ -e "$work/pid.0" ] && ! kill -0 "$(cat "$work/pid.0")" 2>/dev/null; then
        stopped=$(($(now_ms) - start))
        break
      fi
      sleep 0.1
    done
    [ -n "$stopped" ] || { kill -KILL "$launcher"; fail "rank 0 not stopped after rank 1 failed"; }
    [ "$stopped" -lt 5000 ] || fail "rank 0 was stopped after ${stopped} ms"
    wait_launcher 30 "a failed rank"
    [ $rc -eq 3 ] || fail "a failed rank: exit code $rc, expected 3"
    [ "$took" -lt 20000 ] || fail "a failed rank: took ${took} ms"
    grep -qF "rank 1 exited with code 3; stopping the other ranks" "$work/err" ||
      fail "the failed rank is not named"
    echo "a failed rank: rank 0 stopped after ${stopped} ms, exit 3 after ${took} ms"
    exec 3>&-
    ;;
  line-64k)
    # A line of exactly 64 KiB is one line (it got an empty "[rank 0] " line after it); a
    # longer one goes out in 64 KiB pieces. The newline comes in the same write as the line
    # (python) or in a write of its own (printf after tr), which the launcher may read apart.
    for n in 65535 65536 65537 131072; do
      expected="$n 0 4"
      [ $n -eq 65537 ] && expected="65536 1 0 4"
      [ $n -eq 131072 ] && expected="65536 65536 0 4"
      writers=("head -c $n /dev/zero | tr '\\0' x; printf '\\n\\nnext\\n'")
      command -v python3 >/dev/null &&
        writers+=("python3 -c \"import sys; sys.stdout.write('x' * $n + '\\n\\nnext\\n')\"")
      for writer in "${writers[@]}"; do
        "$run" -n 1 --timeout 60 -- sh -c "$writer" >"$work/out" 2>"$work/err" ||
          fail "$n bytes: exit code $?"
        check_prefixes "$work/out"
        lengths=$(sed 's/^\[rank 0\] //' "$work/out" | awk '{ printf "%s%d", (NR > 1 ? " " : ""), length($0) }')
        [ "$lengths" = "$expected" ] || fail "a line of $n bytes ($writer): lines of $lengths, expected $expected"
      done
    done
    ;;
  partial-line)
    # A partial line (a prompt) on a terminal goes out, with its prefix, once the rank has
    # written nothing more for 100 ms: rank 0's "name? " was held until its newline, after
    # the user had to answer it blind. What the rank writes next continues the line without a
    # second prefix, unless another rank's line came first: that one ends it. Written to a
    # file, a partial line waits for its newline as before (log lines stay whole).
    command -v python3 >/dev/null || { echo "SKIP: no python3"; exit 0; }
    # shellcheck disable=SC2016  # expanded by the ranks' shells
    parts='if [ $HPS_RANK = 0 ]; then printf a; sleep 0.5; printf b; sleep 1; echo c
      else sleep 1; echo mid; fi'
    "$run" -n 2 --timeout 60 -- sh -c "$parts" >"$work/out" 2>"$work/err" ||
      fail "to a file: exit code $?"
    grep -qxF "[rank 0] abc" "$work/out" || fail "to a file: rank 0's line was not kept whole"
    python3 - "$run" "$parts" >"$work/out" 2>"$work/err" <<'PY' || fail "on a terminal"
import os, pty, select, sys, time
run, parts = sys.argv[1], sys.argv[2]


def start(args):
    pid, fd = pty.fork()
    if pid == 0:
        os.execv(run, [run] + args)
    return pid, fd


def read_until(fd, out, want, seconds):
    end = time.time() + seconds
    while want not in out and time.time() < end:
        if select.select([fd], [], [], 0.1)[0]:
            try:
                out += os.read(fd, 4096)
            except OSError:
                break
    return out


def finish(pid, fd, out):
    out = read_until(fd, out, b"\0", 3)  # the rest, until the launcher is gone
    return out.decode(errors="replace"), os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


pid, fd = start(["-n", "1", "--timeout", "60", "--", "sh", "-c",
                 'printf "name? "; read x; echo "hi $x"'])
out = read_until(fd, b"", b"[rank 0] name? ", 10)
print(out)
if not out.endswith(b"[rank 0] name? "):
    os.kill(pid, 9)
    sys.exit("the prompt was not shown before the answer")
os.write(fd, b"bob\n")
text, code = finish(pid, fd, out)
print(text)
# The terminal's echo of the answer ended the prompt's line: the next line has its prefix.
if code != 0 or "[rank 0] name? bob\r\n[rank 0] hi bob\r\n" not in text:
    sys.exit("prompt: exit code %s" % code)

pid, fd = start(["-n", "2", "--timeout", "60", "--", "sh", "-c", parts])
text, code = finish(pid, fd, read_until(fd, b"", b"[rank 0] c", 15))
print(text)
if code != 0 or "[rank 0] ab\r\n[rank 1] mid\r\n[rank 0] c\r\n" not in text:
    sys.exit("parts: exit code %s" % code)
PY
    ;;
  group-killed)
    # SIGKILL to the launcher's whole process group (what `timeout -s KILL` sends): the
    # clean-up process is not in that group, so what the ranks started is killed and the file
    # store's directory removed all the same.
    mkdir -p "$work/tmp"
    TMPDIR="$work/tmp" setsid "$run" -n 2 --store file -- \
      sh -c 'sleep 26.5 & echo "child $!"; sleep 25.5' >"$work/out" 2>"$work/err" &
    launcher=$!
    for _ in $(seq 100); do
      [ "$(grep -c 'child' "$work/out")" -eq 2 ] && break
      sleep 0.05
    done
    [ "$(grep -c 'child' "$work/out")" -eq 2 ] || fail "the ranks did not start their children"
    [ -n "$(ls -A "$work/tmp")" ] || fail "no store directory while running"
    kill -KILL -- -$launcher
    wait $launcher 2>/dev/null
    children=$(sed -n 's/^\[rank [0-9]\] child //p' "$work/out")
    for _ in $(seq 100); do
      alive=0
      for pid in $children; do
        # A zombie (reaped by init shortly) counts as gone.
        state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)
        [ -n "$state" ] && [ "$state" != Z ] && alive=1
      done
      [ $alive -eq 0 ] && break
      sleep 0.1
    done
    running_command "sleep 25.5" kill
    if [ $alive -ne 0 ]; then
      kill -KILL $children 2>/dev/null
      fail "a rank's child outlived the killed group"
    fi
    for _ in $(seq 50); do
      [ -z "$(ls -A "$work/tmp")" ] && break
      sleep 0.1
    done
    [ -z "$(ls -A "$work/tmp")" ] || fail "left in TMPDIR: $(ls -A "$work/tmp")"
    ;;
  group-killed-early)
    # The same SIGKILL to the whole group at moments across the launcher's start: whenever a
    # store directory or a rank exists, the clean-up process has left the group already.
    mkdir -p "$work/tmp"
    for i in $(seq 0 39); do
      TMPDIR="$work/tmp" setsid "$run" -n 2 --store file -- \
        sh -c 'sleep 27.5 & sleep 26.5' >"$work/out" 2>"$work/err" &
      launcher=$!
      sleep "0.$(printf '%03d' $((i * 3 / 2)))"
      kill -KILL -- -$launcher 2>/dev/null
      wait $launcher 2>/dev/null
    done
    for _ in $(seq 100); do
      running_command "sleep 27.5" || [ -n "$(ls -A "$work/tmp")" ] || break
      sleep 0.1
    done
    running_command "sleep 27.5" kill && fail "a rank's child outlived its killed group"
    running_command "sleep 26.5" kill && fail "a rank outlived its killed group"
    [ -z "$(ls -A "$work/tmp")" ] || fail "left in TMPDIR: $(ls -A "$work/tmp")"
    ;;
  killed-after-fork)
    # The launcher killed right after forking a rank, before it did anything more (a
    # preloaded fork() pauses the launcher there): the rank must not run its command, which
    # would start a child that nothing knows of to kill.
    mkdir -p "$work/tmp"
    HPS_FORK_PAUSE_MARK="$work/mark" LD_PRELOAD="$HPS_FORK_PAUSE_LIB" TMPDIR="$work/tmp" \
      setsid "$run" -n 2 --store file -- sh -c 'sleep 27.25 & sleep 26.25' \
      >"$work/out" 2>"$work/err" &
    launcher=$!
    for _ in $(seq 200); do
      [ -s "$work/mark" ] && break
      sleep 0.05
    done
    [ -s "$work/mark" ] || fail "the launcher did not pause after forking a rank"
    rank=$(cat "$work/mark")
    [ "$(cat "/proc/$rank/stat" 2>/dev/null | awk '{print $5}')" = "$rank" ] ||
      fail "the paused fork's child $rank is not a rank in a process group of its own"
    # Time for the rank to start its child, were it running its command.
    for _ in $(seq 40); do
      running_command "sleep 27.25" && break
      sleep 0.05
    done
    kill -KILL -- -$launcher
    wait $launcher 2>/dev/null
    for _ in $(seq 100); do
      running_command "sleep 27.25" || running_command "sleep 26.25" ||
        [ -n "$(ls -A "$work/tmp")" ] || break
      sleep 0.1
    done
    running_command "sleep 27.25" kill && fail "a rank's child outlived the killed launcher"
    running_command "sleep 26.25" kill && fail "a rank outlived the killed launcher"
    [ -z "$(ls -A "$work/tmp")" ] || fail "left in TMPDIR: $(ls -A "$work/tmp")"
    ;;
  stop-continue)
    # ^Z (SIGTSTP to the launcher) stops every rank's process group and then the launcher;
    # SIGCONT continues them all and the job ends as it would have. The ranks and their
    # children run until a file appears (at most 60 s), which the test makes while they are
    # stopped: a rank that ran on would finish then. No step depends on how fast a loaded
    # machine runs them.
    go="$work/go"
    # shellcheck disable=SC2016  # expanded by the ranks' shells
    wait_go='i=0; while [ ! -e "$HPS_TEST_GO" ] && [ $i -lt 1200 ]; do i=$((i + 1)); sleep 0.05; done'
    HPS_TEST_GO="$go" setsid "$run" -n 2 -- sh -c "echo \"pid \$\$\"; ($wait_go) &
      echo \"child \$!\"; $wait_go; wait; echo finished" >"$work/out" 2>"$work/err" &
    launcher=$!
    for _ in $(seq 600); do
      [ "$(grep -c 'child' "$work/out")" -eq 2 ] && break
      sleep 0.05
    done
    [ "$(grep -c 'child' "$work/out")" -eq 2 ] || fail "the ranks did not start"
    pids=$(sed -n 's/^\[rank [0-9]\] \(pid\|child\) //p' "$work/out")
    state() { awk '{print $3}' "/proc/$1/stat" 2>/dev/null; }
    # Stopped, or about to be: a process in uninterruptible sleep (D, seen under heavy disk
    # load) with SIGSTOP or SIGTSTP pending stops before it next runs its own code.
    held() {
      case "$(state "$1")" in
        T) return 0 ;;
        D)
          local pending
          for pending in $(sed -n 's/^\(SigPnd\|ShdPnd\):[[:space:]]*//p' "/proc/$1/status" 2>/dev/null); do
            (((0x$pending & 0xc0000) != 0)) && return 0
          done
          return 1
          ;;
        *) return 1 ;;
      esac
    }
    kill -TSTP $launcher
    stopped=0
    for _ in $(seq 600); do
      stopped=1
      for pid in $pids $launcher; do held "$pid" || stopped=0; done
      [ $stopped -eq 1 ] && break
      sleep 0.05
    done
    if [ $stopped -ne 1 ]; then
      for pid in $pids $launcher; do echo "pid $pid: $(state $pid)"; done
      touch "$go"
      kill -CONT $launcher $pids 2>/dev/null
      fail "SIGTSTP did not stop the launcher, the ranks and their children"
    fi
    touch "$go"
    sleep 1  # stopped, the ranks do not see the file and do not end
    grep -q finished "$work/out" && fail "ranks ran on while stopped"
    for pid in $pids $launcher; do
      held "$pid" || fail "pid $pid is $(state $pid) while the job is stopped"
    done
    kill -CONT $launcher
    wait $launcher
    rc=$?
    [ $rc -eq 0 ] || fail "exit code $rc after SIGCONT, expected 0"
    [ "$(grep -c 'finished' "$work/out")" -eq 2 ] || fail "the ranks did not finish"
    ;;
  timeout)
    start=$(now_ms)
    "$run" -n 2 --timeout 0.5 --grace 1 -- "$probe" fail 99 1 >"$work/out" 2>"$work/err"
    rc=$?
    took=$(($(now_ms) - start))
    [ $rc -eq 124 ] || fail "exit code $rc, expected 124"
    [ "$took" -lt 5000 ] || fail "took ${took} ms"
    grep -qF "timeout of" "$work/err" || fail "no message about the timeout"
    ;;
  early-exit)
    # A rank that ends with code 0 while its peers run is named when the job then times out
    # (its peers would wait for it until their own timeouts); a job whose ranks all end
    # with code 0 says nothing of the kind.
    "$run" -n 3 --timeout 4 --grace 1 -- "$probe" fail 1 0 >"$work/out" 2>"$work/err"
    rc=$?
    [ $rc -eq 124 ] || fail "exit code $rc, expected 124"
    grep -qE "^hpshard-run: timeout of 4 s expired; stopping the ranks; rank 1 had exited with code 0 after [0-9.]+ s while the others ran" \
      "$work/err" || fail "the early exit of rank 1 is not named"
    "$run" -n 3 --timeout 60 -- "$probe" meet >"$work/out" 2>"$work/err"
    rc=$?
    [ $rc -eq 0 ] || fail "meet: exit code $rc"
    grep -q "had exited" "$work/err" && fail "a job that ended normally named an early exit"
    ;;
  usage)
    "$run" >"$work/out" 2>"$work/err"
    [ $? -eq 2 ] || fail "no arguments: expected exit 2"
    grep -qF "usage: hpshard-run" "$work/err" || fail "no usage text"
    # Help asked for goes to stdout (exit 0), as hpshard-ckpt's; an unknown option is named
    # as such, with or without a word after it (it was "option --bogus needs a value").
    "$run" --help >"$work/out" 2>"$work/err"
    [ $? -eq 0 ] || fail "--help: expected exit 0"
    grep -qF "usage: hpshard-run" "$work/out" || fail "--help: no usage text on stdout"
    [ -s "$work/err" ] && fail "--help wrote to stderr"
    for bogus in "--bogus" "--bogus x" "-x" "--bogus=1"; do
      # shellcheck disable=SC2086  # the words are the options
      "$run" $bogus >"$work/out" 2>"$work/err"
      [ $? -eq 2 ] || fail "'$bogus': expected exit 2"
      grep -qF "unknown option ${bogus%% *}" "$work/err" || fail "'$bogus': $(head -1 "$work/err")"
    done
    "$run" -n 0 -- "$probe" >"$work/out" 2>"$work/err"
    [ $? -eq 2 ] || fail "-n 0: expected exit 2"
    "$run" -n 2 --store nfs -- "$probe" >"$work/out" 2>"$work/err"
    [ $? -eq 2 ] || fail "--store nfs: expected exit 2"
    # An option given twice is a mistake, whichever spelling: not the last one winning.
    for twice in "-n 2 -n 3" "-n 2 --nproc=3" "-n2 --timeout 5 --timeout 9"; do
      # shellcheck disable=SC2086  # the words are the options
      "$run" $twice -- "$probe" >"$work/out" 2>"$work/err"
      [ $? -eq 2 ] || fail "'$twice': expected exit 2"
      grep -qF "given twice" "$work/err" || fail "'$twice': no 'given twice' in $(cat "$work/err")"
    done
    # Durations that would overflow the clock are refused, not run.
    # Numbers are plain decimals: no sign, space, exponent or hexadecimal.
    for t in 1e308 inf nan 99999999999 0x1p0 " 1" 1e0 +1 1. .5; do
      "$run" -n 1 --timeout "$t" -- "$probe" >"$work/out" 2>"$work/err"
      [ $? -eq 2 ] || fail "--timeout '$t': expected exit 2"
      "$run" -n 1 --grace "$t" -- "$probe" >"$work/out" 2>"$work/err"
      [ $? -eq 2 ] || fail "--grace '$t': expected exit 2"
    done
    for n in " 2" 0x2 1e0 +2 2.5 -1; do
      "$run" -n "$n" -- "$probe" >"$work/out" 2>"$work/err"
      [ $? -eq 2 ] || fail "-n '$n': expected exit 2"
    done
    "$run" -n 1 -- /nonexistent/program >"$work/out" 2>"$work/err"
    rc=$?
    [ $rc -eq 127 ] || fail "missing program: exit $rc, expected 127"
    grep -qF "[rank 0] hpshard-run: cannot run '/nonexistent/program'" "$work/err" ||
      fail "no message for a missing program"
    # Ranks stopped before their exec do not hand the launcher's signal back to it (they
    # kept its handlers, and its SIGTERM went to its own pipe, as if it had been sent one).
    for _ in 1 2 3; do
      "$run" -n 3 -- /nonexistent/program >"$work/out" 2>"$work/err"
      [ $? -eq 127 ] || fail "missing program at 3 ranks: expected exit 127"
      grep -qF "received" "$work/err" && fail "the launcher took its own SIGTERM for one sent to it"
    done
    ;;
  store-fd)
    # The store's socket is bound by the launcher and handed to rank 0 alone: no port is
    # released for another process to take before rank 0 listens on it.
    "$run" -n 3 --timeout 60 -- "$probe" store-fd >"$work/out" 2>"$work/err"
    rc=$?
    [ $rc -eq 0 ] || fail "exit code $rc, expected 0"
    grep -qxF "[rank 0] rank 0 holds the store's listening socket" "$work/out" ||
      fail "rank 0 did not get the listening socket"
    for r in 0 1 2; do
      grep -qxF "[rank $r] rank $r of 3 met every rank" "$work/out" || fail "rank $r did not meet"
    done
    ;;
  shm-cleanup)
    # Every rank is killed while its segment's name exists: the launcher removes them.
    "$run" -n 3 --grace 1 -- "$probe" leak-shm >"$work/out" 2>"$work/err"
    rc=$?
    [ $rc -eq 137 ] || fail "exit code $rc, expected 137"
    segments=$(sed -n 's/^\[rank [0-9]\] segment //p' "$work/out")
    [ "$(wc -w <<<"$segments")" -ge 1 ] || fail "no rank made a segment"
    for s in $segments; do
      [ -e "$s" ] && { rm -f "$s"; fail "segment $s was left in /dev/shm"; }
    done
    grep -qF "shared-memory segment(s) the job left" "$work/err" || fail "no message about them"
    ;;
  closed-fds)
    # Started with standard descriptors closed, the launcher neither reads output as signals
    # (its signal pipe took the free numbers) nor loses the ranks' output to them.
    "$run" -n 2 --timeout 60 -- sh -c 'echo "out $HPS_RANK"; echo "err $HPS_RANK" >&2' \
      <&- >"$work/out" 2>&-
    rc=$?
    [ $rc -eq 0 ] || fail "stdin and stderr closed: exit code $rc, expected 0"
    for r in 0 1; do grep -qxF "[rank $r] out $r" "$work/out" || fail "rank $r's stdout lost"; done
    "$run" -n 2 --timeout 60 -- sh -c 'echo "err $HPS_RANK" >&2; echo "out $HPS_RANK"' \
      >&- 2>"$work/err"
    rc=$?
    # A rank whose stdout is a closed pipe end may die of SIGPIPE writing to it; what must
    # hold is that no byte of output was taken for a signal.
    grep -q "received" "$work/err" && fail "output read as a signal: $(cat "$work/err")"
    for r in 0 1; do grep -qxF "[rank $r] err $r" "$work/err" || fail "rank $r's stderr lost"; done
    ;;
  long-line)
    # A line longer than 64 KiB goes out in 64 KiB pieces, each with the prefix: every byte
    # kept, in order; the launcher holds no more than a piece however long the line.
    "$run" -n 1 --timeout 60 -- sh -c "head -c 200000 /dev/zero | tr '\\0' x; echo end; echo next" \
      >"$work/out" 2>"$work/err"
    rc=$?
    [ $rc -eq 0 ] || fail "exit code $rc, expected 0"
    check_prefixes "$work/out"
    [ "$(wc -l <"$work/out")" -eq 5 ] || fail "expected 5 lines, got $(wc -l <"$work/out")"
    longest=$(awk '{ if (length($0) > n) n = length($0) } END { print n }' "$work/out")
    [ "$longest" -eq $((9 + 65536)) ] || fail "longest line $longest, expected $((9 + 65536))"
    joined=$(sed 's/^\[rank 0\] //' "$work/out" | head -4 | tr -d '\n')
    [ "$joined" = "$(head -c 200000 /dev/zero | tr '\0' x)end" ] || fail "bytes lost or reordered"
    tail -1 "$work/out" | grep -qxF "[rank 0] next" || fail "the next line is not its own"
    # A line larger than the launcher's address space limit passes through it.
    (ulimit -v 200000 && exec "$run" -n 1 --timeout 60 -- \
      sh -c "head -c 300000000 /dev/zero | tr '\\0' x") >/dev/null 2>"$work/err" ||
      fail "a 300 MB line under a 200 MB address space limit: exit code $?"
    ;;
  fd-limit)
    # Out of descriptors while starting the ranks: exit 1 naming the cause, the started ranks
    # reaped and the file store's directory removed (its removal needs descriptors too).
    mkdir -p "$work/tmp"
    (ulimit -n 40 && TMPDIR="$work/tmp" exec "$run" -n 30 --store file -- sleep 29.5) \
      >"$work/out" 2>"$work/err"
    rc=$?
    [ $rc -eq 1 ] || fail "exit code $rc, expected 1"
    grep -qF "Too many open files" "$work/err" || fail "the cause is not named"
    [ -z "$(ls -A "$work/tmp")" ] || fail "left in TMPDIR: $(ls -A "$work/tmp")"
    running_command "sleep 29.5" kill && fail "a started rank is still running"
    ;;
  failed-rank-children)
    # What a failed rank started is stopped with the job, as what the others started: the
    # failed rank's process group too, though its leader has ended.
    "$run" -n 2 --timeout 60 --grace 1 -- sh -c \
      'if [ "$HPS_RANK" = 1 ]; then sleep 28.5 & sleep 0.3; exit 3; fi; sleep 27.5' \
      >"$work/out" 2>"$work/err"
    rc=$?
    [ $rc -eq 3 ] || fail "exit code $rc, expected 3"
    sleep 0.5
    running_command "sleep 28.5" kill && fail "the failed rank's child outlived the job"
    running_command "sleep 27.5" kill && fail "a rank's child outlived the job"
    ;;
  succeeded-rank-children)
    # After a job that succeeded, what its ranks left running is stopped too: rank 0's
    # child ends on SIGTERM, rank 1's ignores it and gets SIGKILL after the grace period
    # (both outlived the job before).
    start=$(now_ms)
    "$run" -n 2 --grace 1 -- sh -c \
      'if [ "$HPS_RANK" = 1 ]; then trap "" TERM; sleep 26.75 >/dev/null 2>&1 & else
         sleep 26.25 >/dev/null 2>&1 & fi; exit 0' >"$work/out" 2>"$work/err"
    rc=$?
    elapsed=$(($(now_ms) - start))
    [ $rc -eq 0 ] || fail "exit code $rc, expected 0"
    grep -qF "stopping what ranks 0, 1 left running" "$work/err" || fail "the stop is not said"
    [ $elapsed -lt 10000 ] || fail "took ${elapsed} ms"
    sleep 0.3
    running_command "sleep 26.25" kill && fail "rank 0's child outlived the job"
    running_command "sleep 26.75" kill && fail "rank 1's child, ignoring SIGTERM, outlived the job"
    # A job that left nothing ends as before, without a word about it.
    "$run" -n 2 -- sh -c 'exit 0' >"$work/out" 2>"$work/err" || fail "a plain job failed"
    grep -qF "left running" "$work/err" && fail "a job that left nothing was said to"
    ;;
  *)
    echo "unknown case $case_name"
    exit 2
    ;;
esac
echo "PASS ($case_name)"
