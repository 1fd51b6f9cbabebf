#!/usr/bin/env bash
# Smoke test of hpshard-bench torch: a tiny run of every contender at 2 ranks exits 0 and
# writes one JSON object with each contender's step time, resident bytes and (hpshard's)
# host syncs, which must be 0. No performance assertion. Exit 77 (skipped) without torch.
# Usage: bench_torch_smoke_test.sh HPSHARD_BENCH
set -euo pipefail
bench="$1"
if ! /usr/bin/python3 -c 'import torch.distributed' 2>/dev/null; then
  echo "skipped: torch is not installed (tools/setup.sh installs python3-torch)"
  exit 77
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$bench" torch --ranks 2 --width 32 --layers 1 --heads 2 --context 8 --batch 1 --steps 1 \
  --reps 1 --warmup 0 --quiet --json "$out/torch.json" >"$out/stdout.txt"
grep -q '^## GPT width 32, 1 blocks' "$out/stdout.txt" || { cat "$out/stdout.txt"; exit 1; }
# The header every family's report has, once.
[ "$(grep -c '^# hpshard-bench torch — ' "$out/stdout.txt")" -eq 1 ] &&
  grep -q '^# cpu kernels: .*load average' "$out/stdout.txt" || { cat "$out/stdout.txt"; exit 1; }
/usr/bin/python3 - "$out/torch.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
# The header every family's JSON has (the bench adds it to torch_peer.py's figures).
for key in ("tool", "family", "command", "date", "machine", "cpu_kernels", "load_average",
            "config", "results", "targets"):
    assert key in doc, f"missing top-level key {key}"
assert doc["cpu_kernels"]["isa"] and doc["load_average"]["end"] is not None, doc
assert doc["family"] == "torch"
(world,) = doc["results"]
assert world["ranks"] == 2
names = set(world["contenders"])
assert {"hpshard stage 2", "hpshard stage 3", "torch ZeRO", "torch DDP",
        "compute alone"} <= names, names
for name, c in world["contenders"].items():
    assert c["seconds"] > 0 and c["resident_bytes"] > 0, (name, c)
    if name.startswith("hpshard"):
        assert c["host_syncs_per_step"] == 0, (name, c)
PY
# SIGTERM or SIGINT to the bench ends torch_peer.py and the ranks it spawned with it (exit
# 128 + the signal): SIGTERM left them running under pid 1, SIGINT was ignored, and SIGINT
# while rank 0 waited in torch's rendezvous for rank 1 (which SIGINT had ended) left the
# script waiting for rank 0 for 30 minutes. The bench runs in a session of its own, whose
# processes are listed after it ends. SIGINT comes at several moments of the ranks' start.
session_left() {
  /usr/bin/python3 - "$1" <<'PY'
import os, sys
for pid in filter(str.isdigit, os.listdir("/proc")):
    try:
        stat = open(f"/proc/{pid}/stat").read()
        cmd = open(f"/proc/{pid}/cmdline").read().replace("\0", " ").strip()
    except OSError:
        continue
    fields = stat[stat.rindex(")") + 2:].split()
    if fields[3] == sys.argv[1] and fields[0] != "Z":
        print(f"{pid}:{cmd[:60].replace(' ', '_')}")
PY
}
for case in TERM:1 INT:0 INT:1 INT:2 INT:3; do
  sig=${case%%:*}
  setsid "$bench" torch --ranks 2 --width 16 --layers 1 --heads 1 --context 4 --vocab 16 \
    --batch 1 --steps 200 --reps 50 --warmup 0 >"$out/signal.txt" 2>&1 &
  pid=$!
  for _ in $(seq 300); do  # until both ranks run: the bench, the script, its tracker, 2 ranks
    [ "$(session_left $pid | wc -l)" -ge 5 ] && break
    sleep 0.1
  done
  sleep "${case#*:}"
  kill -$sig $pid
  if ! timeout 60 tail --pid=$pid -f /dev/null; then  # this test ends, whatever happens
    kill -KILL -$pid 2>/dev/null || true
    cat "$out/signal.txt"
    echo "SIG$sig ${case#*:} s after the ranks started: the bench did not end within 60 s"
    exit 1
  fi
  rc=0
  wait $pid || rc=$?
  expected=$((128 + $(kill -l $sig)))
  [ $rc -eq $expected ] || { cat "$out/signal.txt"; echo "SIG$sig: exit $rc, not $expected"; exit 1; }
  sleep 1
  left=$(session_left $pid)
  if [ -n "$left" ]; then
    for p in $left; do kill -KILL "${p%%:*}" 2>/dev/null || true; done
    echo "SIG$sig to the bench left processes running:$left"; exit 1
  fi
done
# Options torch_peer.py cannot use are refused before anything runs, with exit 2 as the C++
# families do: --json naming a directory ran the whole benchmark, then a traceback, and left
# DIR.tmp; --width 0 gave a rank's traceback; --ranks 1,1 ran the sweep twice.
mkdir "$out/dir"
for bad in "--json $out/dir" "--json $out/nowhere/x.json" "--width 0" "--width 30 --heads 4" \
           "--steps -1" "--clip nan" "--ranks 1,1"; do
  rc=0
  # shellcheck disable=SC2086  # the words are the options
  timeout 60 "$bench" torch --ranks 1 --width 16 --layers 1 --heads 1 --context 4 --vocab 16 \
    --steps 1 --reps 1 --warmup 0 --quiet $bad >"$out/bad.txt" 2>&1 || rc=$?
  [ $rc -eq 2 ] || { cat "$out/bad.txt"; echo "'$bad': exit $rc, not 2"; exit 1; }
  grep -q Traceback "$out/bad.txt" && { cat "$out/bad.txt"; echo "'$bad': a traceback"; exit 1; }
done
[ -z "$(ls -A "$out/dir")" ] && ! compgen -G "$out/dir.tmp*" >/dev/null ||
  { echo "a temporary was left: $(ls -d "$out"/dir*)"; exit 1; }
echo "bench torch smoke: ok"
