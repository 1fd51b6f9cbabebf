#!/usr/bin/env bash
# The main job, short: the GPT example's unsharded run, then its stage 3 run over 4 process
# ranks started by hpshard-run (through hpshard.torch), which compares its losses with the
# unsharded ones, counts 0 host syncs per step, draws the loss curves and, with HPS_TRACE,
# leaves every rank's timeline for hpshard-trace to merge. Exit 77 (skipped) without torch.
# Usage: train_gpt_test.sh HPSHARD_RUN HPSHARD_TRACE EXAMPLE_DIR
set -euo pipefail
run="$1"
tool="$2"
example="$3/train_gpt.py"
if ! /usr/bin/python3 -c 'import torch, matplotlib' 2>/dev/null; then
  echo "skipped: torch or matplotlib is not installed (tools/setup.sh installs them)"
  exit 77
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
args=(--steps 12 --exact-steps 5 --min-fall 0.1 --out "$out")
/usr/bin/python3 "$example" --reference-only "${args[@]}" >"$out/reference.txt"
HPS_TRACE="$out/trace" "$run" -n 4 --timeout 300 -- /usr/bin/python3 "$example" "${args[@]}" \
  | tee "$out/log.txt"
grep -q "stage 3 over 4 CPU ranks" "$out/log.txt"
# Every step: 0 host syncs (the last column).
steps=$(grep -cE '^\[rank 0\] +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.e+-]+ +[0-9]+ +0$' "$out/log.txt")
[ "$steps" -eq 12 ] || { echo "expected 12 step lines with 0 host syncs, got $steps"; exit 1; }
[ -s "$out/loss.png" ] || { echo "no loss.png"; exit 1; }
file "$out/loss.png" | grep -q "PNG image"
"$tool" merge -o "$out/timeline.json" "$out/trace"
/usr/bin/python3 - "$out/timeline.json" <<'PY'
import json, sys
events = json.load(open(sys.argv[1]))["traceEvents"]
ranks = {e["pid"] for e in events if e.get("cat") == "collective"}
assert ranks == {0, 1, 2, 3}, ranks
compute = {e["pid"] for e in events if e.get("cat") == "compute"}
assert compute == {0, 1, 2, 3}, compute
print("timeline of 4 ranks: ok")
PY
