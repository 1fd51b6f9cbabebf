#!/usr/bin/env bash
# Builds the libFuzzer targets of tests/fuzz (clang 14: apt-get install clang-14
# libclang-rt-14-dev) and runs each for a while, starting from its seeds in
# tests/fuzz/corpus/NAME. New inputs that reach new code go to BUILD_DIR/corpus/NAME (never
# into the source tree); a crash leaves its input in BUILD_DIR/crashes/NAME and fails the run.
#
#   tools/fuzz.sh [--seconds N] [--build-dir DIR] [--jobs N] [TARGET...]
#     --seconds N     per target (default 60; the test suite's `fuzz` test runs 5)
#     --build-dir DIR where the fuzz project is built (default build/fuzz)
#     TARGET          tcp_store_frames_fuzz, ... (default: every tests/fuzz/*_fuzz.cc)
# Exit status: 0 when no target found a bug, 1 when one did, 77 when clang/libFuzzer is
# missing (the test suite reports that as skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
seconds=60
build_dir=build/fuzz
jobs=2
targets=()
while (($#)); do
  case $1 in
    --seconds) seconds=$2; shift 2 ;;
    --build-dir) build_dir=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    -h | --help) sed -n '2,13p' "$0"; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1" >&2; exit 2 ;;
    *) targets+=("$1"); shift ;;
  esac
done
if ((${#targets[@]} == 0)); then
  for f in tests/fuzz/*_fuzz.cc; do targets+=("$(basename "$f" .cc)"); done
fi

cxx=$(command -v clang++-14 || command -v clang++ || true)
if [ -z "$cxx" ]; then
  echo "fuzz.sh: skipped: no clang++ (apt-get install clang-14 libclang-rt-14-dev)"
  exit 77
fi
if ! echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' |
  "$cxx" -x c++ -fsanitize=fuzzer - -o /dev/null 2>/dev/null; then
  echo "fuzz.sh: skipped: $cxx cannot link libFuzzer (apt-get install libclang-rt-14-dev)"
  exit 77
fi

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S tests/fuzz -B "$build_dir" "${generator[@]}" -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null || exit 1
cmake --build "$build_dir" --parallel "$jobs" --target "${targets[@]}" || exit 1

failed=0
for t in "${targets[@]}"; do
  corpus="$build_dir/corpus/$t"
  crashes="$build_dir/crashes/$t"
  mkdir -p "$corpus" "$crashes"
  seeds=()
  [ -d "tests/fuzz/corpus/$t" ] && seeds=("tests/fuzz/corpus/$t")
  echo "== $t: ${seconds} s"
  if ! "$build_dir/$t" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
    -print_final_stats=1 -artifact_prefix="$crashes/" "$corpus" "${seeds[@]}" \
    >"$build_dir/$t.log" 2>&1; then
    echo "fuzz.sh: $t FAILED; input in $crashes, log $build_dir/$t.log:"
    tail -40 "$build_dir/$t.log"
    failed=1
  else
    grep -E "^stat::number_of_executed_units|^stat::new_units_added" "$build_dir/$t.log"
  fi
done
exit $failed
