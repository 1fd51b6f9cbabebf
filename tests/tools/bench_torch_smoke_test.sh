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
/usr/bin/python3 - "$out/torch.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
for key in ("tool", "family", "command", "date", "machine", "config", "results", "targets"):
    assert key in doc, f"missing top-level key {key}"
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
echo "bench torch smoke: ok"
