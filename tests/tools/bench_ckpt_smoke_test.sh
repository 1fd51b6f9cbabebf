#!/usr/bin/env bash
# Smoke test of hpshard-bench ckpt: a tiny model exits 0 (the loaded state equals the saved
# one), prints its summary and writes one JSON object with the expected keys; the steps
# that overlapped a save counted no host sync. Then the same at one rank with the compute
# passes on the engine's compute stream (--kernel-passes: the path a GPU run takes, which
# hpshard-gpu-bench --ckpt runs there). No timing is asserted.
# Usage: bench_ckpt_smoke_test.sh HPSHARD_BENCH
set -euo pipefail
bench="$1"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$bench" ckpt --bytes 256K --tensors 4 --reps 2 --steps 3 --dir "$out" --quiet \
  --json "$out/bench.json" >"$out/stdout.txt" || { cat "$out/stdout.txt"; exit 1; }
grep -q '^summary: ckpt: save .* plain write .* plain read of its files .* a read of the plain file.* the step right after save() .* steps from save() on .* loaded state bitwise equal' "$out/stdout.txt" \
  || { cat "$out/stdout.txt"; exit 1; }
grep -q '^# cpu kernels: .*load average' "$out/stdout.txt" || { cat "$out/stdout.txt"; exit 1; }
/usr/bin/python3 - "$out/bench.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
for key in ("tool", "family", "command", "date", "machine", "cpu_kernels", "load_average",
            "config", "units", "reference", "targets", "results"):
    assert key in doc, f"missing top-level key {key}"
assert doc["family"] == "ckpt"
row = doc["results"][0]
for key in ("ranks", "saved_bytes", "save_seconds", "write_seconds", "save_ratio", "load_seconds",
            "read_seconds", "load_ratio", "read_plain_file_seconds", "load_ratio_plain_file",
            "first_step_seconds", "first_step_with_save_seconds", "first_step_ratio",
            "first_step_overlapped", "step_seconds", "step_with_save_seconds", "step_ratio",
            "overlapped_steps", "host_syncs_in_overlapped_steps_max", "loaded_equal"):
    assert key in row, f"missing result key {key}"
# AdamW: parameters, exp_avg and exp_avg_sq of 256 KiB each, in the data files.
assert row["saved_bytes"] >= 3 * 256 * 1024, row
assert row["loaded_equal"] is True
assert row["read_seconds"] > 0 and row["read_plain_file_seconds"] > 0, row
assert row["host_syncs_in_overlapped_steps_max"] == 0, row
print("bench ckpt smoke OK")
PY
"$bench" ckpt --bytes 256K --tensors 3 --reps 2 --steps 2 --ranks 1 --kernel-passes \
  --dir "$out/kernels" --quiet --json "$out/kernels.json" >"$out/kernels.txt" \
  || { cat "$out/kernels.txt"; exit 1; }
grep -q "Stage2Engine on cpu, AdamW, 1 ranks as threads.*by the kernel table's accumulate" \
  "$out/kernels.txt" || { cat "$out/kernels.txt"; exit 1; }
/usr/bin/python3 - "$out/kernels.json" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
assert doc["config"]["kernel_passes"] is True and doc["config"]["device"] == "cpu", doc["config"]
row = doc["results"][0]
assert row["loaded_equal"] is True and row["host_syncs_in_overlapped_steps_max"] == 0, row
print("bench ckpt --kernel-passes smoke OK")
PY
# More tensors than a rank's share holds: one rank holds no shard and writes no data file.
# The bench measured one file per rank ("the saved data file: not found") and left its
# temporary directory (no --dir) when it failed.
mkdir "$out/tmp"
TMPDIR="$out/tmp" "$bench" ckpt --ranks 2 --bytes 4K --tensors 16 --reps 1 --steps 1 \
  --compute-passes 0 --quiet >"$out/tensors.txt" 2>&1 || { cat "$out/tensors.txt"; exit 1; }
grep -q 'loaded state bitwise equal' "$out/tensors.txt" || { cat "$out/tensors.txt"; exit 1; }
[ -z "$(ls -A "$out/tmp")" ] || { echo "left in TMPDIR: $(ls -A "$out/tmp")"; exit 1; }
echo "bench ckpt with a rank holding no shard OK"
