#!/usr/bin/env bash
# Crash safety of checkpoints: a 2-rank job (hpshard-run) saves checkpoint "a", then while
# it saves "b" one of its ranks is killed with SIGKILL at a random moment (the first run at
# once, the last after "b" is published, the others spread over the measured duration of a
# save). After every run, in a fresh process: "a" verifies and loads, "b" is absent or
# complete (verifies and loads), and latest names one of them and loads.
# Then a model cut into two parts (mp 2, each rank a part with its own root): one part
# publishes "b" while the other is killed before saving it, leaving their latest apart; a
# fresh 2-rank job's load of latest takes "a" on both parts (the newest both hold), equal to
# what each saved.
# Usage: ckpt_crash_test.sh HPSHARD_RUN CKPT_PROBE [RUNS]
set -uo pipefail
run="$1"
probe="$2"
runs="${3:-20}"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT

"$run" -n 2 --timeout 60 -- "$probe" save "$work/calibrate" 0 -1 >"$work/calibrate.log" 2>&1 \
  || { cat "$work/calibrate.log"; echo "the calibration run failed"; exit 1; }
save_us="$(sed -n 's/.*b published after \([0-9]*\) us.*/\1/p' "$work/calibrate.log" | head -1)"
[ -n "$save_us" ] || { cat "$work/calibrate.log"; exit 1; }
echo "a save takes ${save_us} us here"
RANDOM=4242
complete=0
absent=0
for ((i = 0; i < runs; i++)); do
  root="$work/run$i"
  if ((i == 0)); then delay=0; elif ((i == runs - 1)); then delay=-2; else
    delay=$(((RANDOM * 32768 + RANDOM) % (save_us * 3 / 2 + 1)))
  fi
  rank=$((RANDOM % 2))
  "$run" -n 2 --timeout 90 --grace 2 -- "$probe" save "$root" "$rank" "$delay" >"$work/run.log" 2>&1
  if ! grep -q "a published" "$work/run.log"; then
    cat "$work/run.log"
    echo "run $i: the job failed before its first checkpoint"
    exit 1
  fi
  grep -q "killed by signal 9" "$work/run.log" || { cat "$work/run.log"; echo "run $i: no rank was killed"; exit 1; }
  if ! result="$("$probe" check "$root" 2>&1)"; then
    cat "$work/run.log"
    echo "run $i (rank $rank killed $delay us into the save): $result"
    exit 1
  fi
  echo "run $i: rank $rank killed after $delay us: $result"
  case "$result" in
    "b complete"*) complete=$((complete + 1)) ;;
    "b absent"*) absent=$((absent + 1)) ;;
  esac
  rm -rf "$root"
done
echo "$runs runs: b complete $complete times, absent $absent times; a always intact"
((complete > 0 && absent > 0)) || { echo "expected both outcomes"; exit 1; }

for kill in 0 1; do
  root="$work/parts$kill"
  "$run" -n 2 --timeout 90 --grace 2 -- "$probe" save-parts "$root" "$kill" >"$work/parts.log" 2>&1
  grep -q "killed by signal 9" "$work/parts.log" || { cat "$work/parts.log"; echo "parts: no rank was killed"; exit 1; }
  survivor=$((1 - kill))
  if [ "$(cat "$root/part$survivor/latest")" != b ] || [ "$(cat "$root/part$kill/latest")" != a ]; then
    cat "$work/parts.log"
    echo "parts: expected part $survivor at b and part $kill at a"
    exit 1
  fi
  if ! "$run" -n 2 --timeout 60 -- "$probe" resume-parts "$root" >"$work/resume.log" 2>&1; then
    cat "$work/resume.log"
    echo "parts (part $kill killed): the load of latest failed"
    exit 1
  fi
  [ "$(grep -c "loaded a$" "$work/resume.log")" = 2 ] \
    || { cat "$work/resume.log"; echo "parts: both parts should load a"; exit 1; }
  echo "parts: part $kill killed before saving b, part $survivor published it; latest loads a on both"
done
