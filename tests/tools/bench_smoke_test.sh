#!/usr/bin/env bash
# Smoke test of hpshard-bench coll: a tiny sweep exits 0, writes one JSON object with the
# expected keys (the Open MPI column too where hpshard-bench-mpi was built) and draws its
# chart. No performance assertion (benchmarks print figures; they are never timed tests).
# Usage: bench_smoke_test.sh HPSHARD_BENCH
set -euo pipefail
bench="$1"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$bench" coll --ranks 2 --max-bytes 65536 --iters 2 --no-torch --quiet --json "$out/coll.json" \
  --plot "$out/coll.png" >"$out/stdout.txt"
[ -s "$out/coll.png" ] || { echo "no chart"; exit 1; }
mpi_built=0
[ -x "$(dirname "$bench")/hpshard-bench-mpi" ] && command -v mpirun >/dev/null && mpi_built=1
grep -q '^## all_reduce, 2 ranks' "$out/stdout.txt" || { cat "$out/stdout.txt"; exit 1; }
/usr/bin/python3 - "$out/coll.json" "$mpi_built" <<'PY'
import json, sys
doc = json.load(open(sys.argv[1]))
mpi_built = sys.argv[2] == "1"
for key in ("tool", "family", "command", "date", "machine", "cpu_kernels", "load_average",
            "config", "reference", "targets", "mpi", "torch", "results"):
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
                    "gloo_seconds", "gloo_busbw", "ratio", "mpi_seconds", "mpi_busbw",
                    "mpi_ratio", "torch_busbw"):
            assert key in row, f"missing row key {key}"
        assert row["hpshard_seconds"] > 0 and row["gloo_seconds"] > 0
        # Open MPI ran (its results checked on known inputs) wherever its helper was built.
        assert (row["mpi_seconds"] is not None and row["mpi_seconds"] > 0) == mpi_built, row
assert doc["mpi"]["ran"] == mpi_built, doc["mpi"]
print("bench smoke OK:", len(doc["results"]), "tables")
PY
# Option values are refused before any run: integers that CLI11 alone would read as octal
# or hex (010 was 8 ranks), switches other than 0 and 1, and a --json that is no regular
# file (a FIFO blocked the write forever, after the whole run).
mkfifo "$out/fifo"
refused() {
  local expect="$1"
  shift
  if timeout 20 "$bench" "$@" --no-torch --quiet >"$out/refused.txt" 2>&1; then
    echo "accepted: $*"
    exit 1
  fi
  grep -qF -- "$expect" "$out/refused.txt" || { cat "$out/refused.txt"; echo "for: $*"; exit 1; }
}
refused "'010' is not a decimal integer" step --ranks 010 --steps 1
refused "'0x10' is not a decimal integer" coll --ranks 0x10 --no-mpi
refused "'08' is not a decimal integer" ckpt --reps 08
refused "--check-arguments" coll --check-arguments 5 --no-mpi
refused "--shm-direct" coll --shm-direct -1 --no-mpi
refused "not a regular file" coll --ranks 2 --no-mpi --json "$out/fifo"
refused "not a regular file" clip --plot "$out"
# A value given twice in a list is refused (exit 2), naming the option and the value:
# --ops all_reduce,all_reduce printed its table twice, each with both runs' rows, and
# --ranks 2,2 ran the sweep twice.
tiny_coll="coll --min-bytes 8 --max-bytes 8 --iters 1 --warmup 0 --no-mpi"
tiny_step="step --width 8 --depth 1 --steps 1 --reps 1 --warmup 0"
tiny_clip="clip --iters 1 --warmup 0 --kernel-bytes 0"
for dup in "$tiny_coll --ranks 2 --ops all_reduce,all_reduce|--ops: 'all_reduce' is given twice" \
           "$tiny_coll --ranks 2,3,2 --ops all_reduce|--ranks: 2 is given twice" \
           "$tiny_step --ranks 2,2|--ranks: 2 is given twice" \
           "$tiny_clip --sizes 64K,65536|--sizes: '64K' and '65536' are one value" \
           "$tiny_clip --sizes 64K:mixed,64k:mixed|--sizes: '64K:mixed' and '64k:mixed' are one"; do
  args="${dup%%|*}"
  expect="${dup#*|}"
  rc=0
  # shellcheck disable=SC2086  # the words are the options
  timeout 60 "$bench" $args --no-torch --quiet >"$out/dup.txt" 2>&1 || rc=$?
  [ $rc -eq 2 ] || { cat "$out/dup.txt"; echo "'$args': exit $rc, not 2"; exit 1; }
  grep -qF -- "$expect" "$out/dup.txt" || { cat "$out/dup.txt"; echo "for: $args"; exit 1; }
done
echo "bench option refusals OK"
# Sizes that give an operation no message at a world size (below one element, per rank for
# all_gather) are refused (exit 2): they gave an empty table with exit 0, or a plot.py
# traceback. The upper bound is the one --help names (2^31 was accepted).
for sizes in "--min-bytes 3 --max-bytes 3 --ops all_reduce" \
             "--min-bytes 4 --max-bytes 4 --ops all_gather --plot $out/tiny.png" \
             "--max-bytes 268435457" "--max-bytes 2147483648"; do
  rc=0
  # shellcheck disable=SC2086  # the words are the options
  "$bench" coll --ranks 2 $sizes --iters 1 --warmup 0 --no-mpi --no-torch --quiet \
    >"$out/tiny.txt" 2>&1 || rc=$?
  [ $rc -eq 2 ] || { cat "$out/tiny.txt"; echo "'$sizes': exit $rc, expected 2"; exit 1; }
done
"$bench" coll --help | grep -q -- '--max-bytes.*268435456' || { echo "--help: no bound"; exit 1; }
# The smallest sizes that give a message are measured and charted.
"$bench" coll --ranks 2 --min-bytes 8 --max-bytes 8 --ops all_gather --iters 1 --warmup 0 \
  --no-mpi --no-torch --quiet --plot "$out/tiny.png" >"$out/tiny.txt" 2>&1 ||
  { cat "$out/tiny.txt"; exit 1; }
[ -s "$out/tiny.png" ] || { echo "no chart of the smallest all_gather"; exit 1; }
echo "bench coll tiny sizes OK"
