#!/usr/bin/env bash
# hpshard-gpu-bench refuses a bad option value before it looks for a device (so this runs
# on any machine the CUDA build ran on): decimal digits only, in the option's range.
set -u
bench="$1"

refused() {
  local expect="$1"
  shift
  local text
  if text=$("$bench" "$@" 2>&1); then
    echo "accepted: $*"
    exit 1
  fi
  [[ "$text" == *"$expect"* ]] || { echo "$text"; echo "for: $*"; exit 1; }
}

refused "--iters '12abc': not a decimal integer in 1..10000" --iters 12abc
refused "--iters '010': not a decimal integer" --iters 010
refused "--mib '99999999999999999999': not a decimal integer" --mib 99999999999999999999
refused "--mib '0': not a decimal integer in 1..1048576" --mib 0
refused "--width '0x10': not a decimal integer" --step --width 0x10
refused "--depth '2048': not a decimal integer in 1..1024" --step --depth 2048
refused "--reps '-1': not a decimal integer" --ckpt --reps -1
refused "--compute-passes ' 5': not a decimal integer" --ckpt --compute-passes " 5"
refused "--iters needs a value" --iters

# A good value passes the parse: the run, or 77 where no CUDA device is usable.
"$bench" --ckpt --compute-passes 0 --reps 1 --steps 1 --mib 1 --dir "$(mktemp -d)" >/dev/null 2>&1
rc=$?
[[ $rc == 0 || $rc == 77 ]] || { echo "a good value: rc $rc"; exit 1; }
echo "ok"
