#!/usr/bin/env bash
# Smoke test of hpshard-bench coll: a tiny sweep exits 0 and writes one JSON object with
# the expected keys. No performance assertion (benchmarks print figures; they are never
# timed tests).
# Usage: bench_smoke_test.sh HPSHARD_BENCH
set -euo pipefail
bench="$1"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$bench" coll --ranks 2 --max-bytes 65536 --iters 2 --no-torch --quiet --json "$out/coll.json" \
  >"$out/stdout.txt"
grep -q '^## all_reduce, 2 ranks' "$out/stdout.txt" || { cat "$out/stdout.txt"; exit 1; }
/usr/bin/python3 - "$out/coll.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
for key in ("tool", "family", "command", "date", "machine", "config", "reference", "targets",
            "torch", "results"):
    assert key in doc, f"missing top-level key {key}"
assert doc["config"]["ranks"] == [2] and doc["config"]["check_arguments"] is True
ops = sorted(r["op"] for r in doc["results"])
assert ops == ["all_gather", "all_reduce", "broadcast", "reduce_scatter"], ops
for result in doc["results"]:
    assert result["ranks"] == 2 and "summary" in result
    sizes = [row["bytes"] for row in result["rows"]]
    assert sizes == [4096, 8192, 16384, 32768, 65536], sizes
    for row in result["rows"]:
        for key in ("count", "iters", "hpshard_seconds", "hpshard_algbw", "hpshard_busbw",
                    "gloo_seconds", "gloo_busbw", "ratio", "torch_busbw"):
            assert key in row, f"missing row key {key}"
        assert row["hpshard_seconds"] > 0 and row["gloo_seconds"] > 0
print("bench smoke OK:", len(doc["results"]), "tables")
PY
