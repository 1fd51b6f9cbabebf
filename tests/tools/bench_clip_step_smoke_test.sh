#!/usr/bin/env bash
# Smoke test of hpshard-bench clip and step: tiny sizes exit 0 and write one JSON object
# with the expected keys. No performance assertion (benchmarks print figures; they are
# never timed tests).
# Usage: bench_clip_step_smoke_test.sh HPSHARD_BENCH clip|step|step-device
set -euo pipefail
bench="$1"
family="$2"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
case "$family" in
  clip)
    "$bench" clip --sizes 64K,64K:mixed --iters 2 --warmup 1 --no-torch --quiet \
      --json "$out/bench.json" >"$out/stdout.txt"
    grep -q '^summary: clip: median clip/copy bandwidth' "$out/stdout.txt" \
      || { cat "$out/stdout.txt"; exit 1; }
    ;;
  step)
    "$bench" step --ranks 1,2 --width 32 --depth 3 --batch 2 --steps 2 --reps 2 --no-torch \
      --quiet --json "$out/bench.json" >"$out/stdout.txt"
    for line in 'stage2 / unsharded time' 'stage3 / unsharded time'; do
      grep -q "^summary: step 2 ranks: $line" "$out/stdout.txt" \
        || { cat "$out/stdout.txt"; exit 1; }
    done
    ;;
  step-device)
    # The runtime's own step at world size 1 on the CPU: no host sync in a steady step, and
    # the two engines end with the same parameters.
    "$bench" step --device cpu --width 64 --depth 3 --steps 2 --reps 2 --warmup 1 \
      --json "$out/bench.json" >"$out/stdout.txt"
    /usr/bin/python3 - "$out/bench.json" <<'PY' || { cat "$out/stdout.txt"; exit 1; }
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["device"] == "cpu" and doc["parameters"] == 3 * (64 * 64 + 64), doc
assert doc["stage2_host_syncs_max"] == 0 and doc["stage3_host_syncs_max"] == 0, doc
assert doc["stage2_vs_stage3_max_diff"] < 1e-6, doc
for key in ("stage2_seconds", "stage3_seconds", "optimizer_seconds"):
    assert doc[key] > 0, key
PY
    exit 0
    ;;
  *) echo "usage: $0 HPSHARD_BENCH clip|step|step-device" >&2; exit 2 ;;
esac
/usr/bin/python3 - "$family" "$out/bench.json" <<'PY'
import json, sys
family, path = sys.argv[1], sys.argv[2]
doc = json.load(open(path))
for key in ("tool", "family", "command", "date", "machine", "config", "units", "reference",
            "targets", "torch", "results"):
    assert key in doc, f"missing top-level key {key}"
assert doc["family"] == family, doc["family"]
assert doc["torch"]["ran"] is False
if family == "clip":
    assert [m["mixed"] for m in doc["config"]["models"]] == [False, True]
    assert len(doc["results"]) == 2
    for row in doc["results"]:
        for key in ("model", "bytes", "fp32_bytes", "mixed", "tensors", "iters", "copy_seconds",
                    "copy_bandwidth", "clip_seconds", "clip_bandwidth", "clip_copy_ratio",
                    "deterministic_seconds", "deterministic_cost", "adamw_seconds",
                    "adamw_clip_seconds", "fold_ratio", "torch_seconds", "torch_speedup"):
            assert key in row, f"missing row key {key}"
        assert row["bytes"] == 65536 and row["copy_seconds"] > 0 and row["clip_seconds"] > 0
    assert doc["results"][0]["adamw_seconds"] > 0 and doc["results"][0]["fold_ratio"] > 0
    assert doc["results"][1]["adamw_seconds"] is None  # AdamW runs on fp32 models only
    for key in ("median_clip_copy_ratio", "meets_copy_target", "median_fold_ratio",
                "meets_fold_target", "median_deterministic_cost", "median_torch_speedup"):
        assert key in doc["summary"], f"missing summary key {key}"
else:
    assert doc["config"]["ranks"] == [1, 2] and doc["config"]["width"] == 32
    assert [r["ranks"] for r in doc["results"]] == [1, 2]
    for row in doc["results"]:
        for key in ("parameters", "transport", "stage2_seconds", "unsharded_seconds", "ratio",
                    "meets_target", "compute_seconds", "torch_seconds", "torch_speedup",
                    "stage2_resident_bytes", "unsharded_resident_bytes",
                    "stage2_host_syncs_per_step_max", "unsharded_host_syncs_per_step_max",
                    "dependency_waits_per_step", "dependency_wait_seconds_per_step",
                    "max_param_diff", "stage3_seconds", "stage3_ratio", "stage3_meets_target",
                    "stage3_torch_speedup", "stage3_meets_torch_target", "stage3_resident_bytes",
                    "stage3_host_syncs_per_step_max", "stage3_dependency_waits_per_step",
                    "stage3_dependency_wait_seconds_per_step", "stage3_max_param_diff"):
            assert key in row, f"missing row key {key}"
        assert row["parameters"] == 3 * (32 * 32 + 32)
        assert row["stage2_seconds"] > 0 and row["unsharded_seconds"] > 0
        assert row["stage3_seconds"] > 0 and row["stage3_resident_bytes"] > 0
        # Not a timing: the engines must not block the host in a steady step, and stage 2
        # and stage 3 must train the same parameters as the unsharded reference.
        assert row["stage2_host_syncs_per_step_max"] == 0, row
        assert row["stage3_host_syncs_per_step_max"] == 0, row
        assert row["max_param_diff"] < 1e-4, row
        assert row["stage3_max_param_diff"] < 1e-4, row
print(f"bench {family} smoke OK:", len(doc["results"]), "rows")
PY
