#!/usr/bin/env bash
# Smoke test of hpshard-bench clip and step: tiny sizes exit 0, write one JSON object with
# the expected keys and draw the family's chart. No performance assertion (benchmarks print
# figures; they are never timed tests).
# Usage: bench_clip_step_smoke_test.sh HPSHARD_BENCH clip|step|step-scale|step-device
set -euo pipefail
bench="$1"
family="$2"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
case "$family" in
  clip)
    "$bench" clip --sizes 64K,64K:mixed --iters 2 --warmup 1 --kernel-bytes 64K --no-torch \
      --quiet --json "$out/bench.json" --plot "$out/bench.png" >"$out/stdout.txt"
    grep -q '^summary: clip: median clip/copy bandwidth' "$out/stdout.txt" \
      || { cat "$out/stdout.txt"; exit 1; }
    # The baseline variant runs everywhere; an unknown one is a usage error.
    "$bench" clip --sizes 64K --iters 1 --warmup 0 --kernel-bytes 0 --no-torch --quiet \
      --isa baseline | grep -q '^# cpu kernels: baseline' || { echo "--isa baseline"; exit 1; }
    set +e
    "$bench" clip --isa avx1024 >/dev/null 2>&1
    rc=$?
    set -e
    [ "$rc" -eq 2 ] || { echo "--isa avx1024 exited $rc, expected 2"; exit 1; }
    # A max_norm that is not a finite number is a usage error too (nan passed the range
    # check, every comparison with it being false, and failed in the engine with exit 1).
    for v in nan inf -nan; do
      rc=0
      "$bench" clip --sizes 4K --kernel-bytes 0 --iters 1 --no-torch --quiet --max-norm "$v" \
        >/dev/null 2>&1 || rc=$?
      [ "$rc" -eq 2 ] || { echo "--max-norm $v exited $rc, expected 2"; exit 1; }
    done
    ;;
  step)
    "$bench" step --ranks 1,2 --width 32 --depth 3 --batch 2 --steps 2 --reps 2 --no-torch \
      --quiet --json "$out/bench.json" --plot "$out/bench.png" >"$out/stdout.txt"
    for line in 'stage2 / unsharded time' 'stage3 / unsharded time'; do
      grep -q "^summary: step 2 ranks: $line" "$out/stdout.txt" \
        || { cat "$out/stdout.txt"; exit 1; }
    done
    for v in nan inf -nan; do  # as --max-norm of clip: not a finite number, exit 2
      rc=0
      "$bench" step --ranks 1 --width 8 --depth 1 --steps 1 --reps 1 --warmup 0 --no-torch \
        --quiet --clip "$v" >/dev/null 2>&1 || rc=$?
      [ "$rc" -eq 2 ] || { echo "--clip $v exited $rc, expected 2"; exit 1; }
    done
    ;;
  step-scale)
    # The scaling sweep: widths x1 x2 x4 at 1, 2 and 4 ranks, time per parameter per cell.
    "$bench" step --scale --width 16 --depth 2 --batch 2 --steps 1 --reps 1 --warmup 0 \
      --no-torch --quiet --json "$out/bench.json" --plot "$out/bench.png" >"$out/stdout.txt"
    [ -s "$out/bench.png" ] || { echo "no chart"; exit 1; }
    /usr/bin/python3 - "$out/bench.json" <<'PY' || { cat "$out/stdout.txt"; exit 1; }
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["config"]["scale"] is True
cells = sorted((r["width"], r["ranks"]) for r in doc["results"])
assert cells == [(w, n) for w in (16, 32, 64) for n in (1, 2, 4)], cells
for r in doc["results"]:
    assert r["parameters"] == 2 * (r["width"] ** 2 + r["width"]), r
    for key in ("stage2_ns_per_parameter", "stage3_ns_per_parameter",
                "unsharded_ns_per_parameter", "ratio", "stage3_ratio"):
        assert r[key] > 0, (key, r)
    assert r["stage3_max_param_diff"] < 1e-4 and r["max_param_diff"] < 1e-4, r
PY
    exit 0
    ;;
  step-device)
    # The runtime's own step at world size 1 on the CPU: no host sync in a steady step, and
    # the two engines end with the same parameters.
    "$bench" step --device cpu --width 64 --depth 3 --steps 2 --reps 2 --warmup 1 \
      --json "$out/bench.json" >"$out/stdout.txt"
    grep -q '^# cpu kernels: .*load average' "$out/stdout.txt" || { cat "$out/stdout.txt"; exit 1; }
    # --plot has no chart here: refused before the run (plot.py failed after it, exit 1).
    rc=0
    "$bench" step --device cpu --width 8 --depth 1 --steps 1 --reps 1 --warmup 0 --quiet \
      --plot "$out/device.png" >/dev/null 2>&1 || rc=$?
    [ "$rc" -eq 2 ] || { echo "step --device --plot exited $rc, expected 2"; exit 1; }
    /usr/bin/python3 - "$out/bench.json" <<'PY' || { cat "$out/stdout.txt"; exit 1; }
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["device"] == "cpu" and doc["parameters"] == 3 * (64 * 64 + 64), doc
# The header of every family's JSON (it had none of these).
for key in ("tool", "command", "date", "machine", "cpu_kernels", "load_average"):
    assert key in doc, f"missing top-level key {key}"
assert doc["family"] == "step" and doc["cpu_kernels"]["isa"], doc
assert doc["stage2_host_syncs_max"] == 0 and doc["stage3_host_syncs_max"] == 0, doc
assert doc["stage2_vs_stage3_max_diff"] < 1e-6, doc
for key in ("stage2_seconds", "stage3_seconds", "optimizer_seconds"):
    assert doc[key] > 0, key
PY
    exit 0
    ;;
  *) echo "usage: $0 HPSHARD_BENCH clip|step|step-scale|step-device" >&2; exit 2 ;;
esac
[ -s "$out/bench.png" ] || { echo "no chart"; exit 1; }
/usr/bin/python3 - "$family" "$out/bench.json" <<'PY'
import json, sys
family, path = sys.argv[1], sys.argv[2]
doc = json.load(open(path))
for key in ("tool", "family", "command", "date", "machine", "cpu_kernels", "load_average",
            "config", "units", "reference", "targets", "torch", "results"):
    assert key in doc, f"missing top-level key {key}"
assert doc["family"] == family, doc["family"]
assert doc["torch"]["ran"] is False
if family == "clip":
    assert [m["mixed"] for m in doc["config"]["models"]] == [False, True]
    assert len(doc["results"]) == 2
    for row in doc["results"]:
        for key in ("model", "bytes", "fp32_bytes", "mixed", "tensors", "iters", "copy_seconds",
                    "copy_bandwidth", "clip_seconds", "clip_bandwidth", "clip_copy_ratio",
                    "deterministic_seconds", "deterministic_cost", "step_seconds",
                    "step_clip_seconds", "fold_ratio", "copy_cpu_seconds", "clip_cpu_seconds",
                    "clip_copy_ratio_cpu", "step_cpu_seconds", "step_clip_cpu_seconds",
                    "fold_ratio_cpu", "torch_seconds", "torch_speedup"):
            assert key in row, f"missing row key {key}"
        assert row["bytes"] == 65536 and row["copy_seconds"] > 0 and row["clip_seconds"] > 0
        # The folded clip runs on every model (the unscale pass widens bf16 gradients).
        assert row["step_seconds"] > 0 and row["step_clip_seconds"] > 0 and row["fold_ratio"] > 0
        assert row["clip_cpu_seconds"] > 0 and row["fold_ratio_cpu"] > 0, row
    kernels = {(k["kernel"], k["dtype"]) for k in doc["kernels"]}
    for dtype in ("float32", "bfloat16", "float16"):
        for kernel in ("sum_of_squares", "scale", "unscale+partial"):
            assert (kernel, dtype) in kernels, (kernel, dtype)
    assert ("cast from fp32", "bfloat16") in kernels and ("adamw", "float32") in kernels
    for k in doc["kernels"]:
        assert k["count"] == 16384 and k["seconds"] > 0 and k["copy_ratio"] > 0, k
        assert k["cpu_seconds"] >= 0 and "copy_ratio_cpu" in k, k
    for key in ("median_clip_copy_ratio", "lowest_clip_copy_ratio", "meets_copy_target",
                "median_fold_ratio", "highest_fold_ratio", "meets_fold_target",
                "median_clip_copy_ratio_cpu", "median_fold_ratio_cpu",
                "median_deterministic_cost", "median_torch_speedup"):
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
                    "stage3_dependency_wait_seconds_per_step", "stage3_max_param_diff",
                    "unsharded_wait_seconds_per_step", "unsharded_optimizer_seconds_per_step",
                    "split"):
            assert key in row, f"missing row key {key}"
        for contender in ("stage2", "stage3", "unsharded"):
            split = row["split"][contender]
            parts = split["compute"] + split["communication_waits"] + split["optimizer"]
            assert split["total"] > 0 and parts + split["rest"] >= split["total"] * 0.999, split
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
