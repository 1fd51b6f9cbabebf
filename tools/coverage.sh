#!/usr/bin/env bash
# Line coverage of core/ and capi/ by the CPU tests: builds hpshard with gcc's --coverage
# (Debug, no CUDA, no bindings, no packaging: the C++ and C suites, the launcher and bench
# smoke runs), runs every test but the sanitizer, gpu and fuzz ones, and prints lcov's table
# for core/ and capi/ and, for the engine's own folders (sharding, storage, clip, flow,
# checkpoint, kernels/cpu), every line no test ran. Needs lcov (apt-get install lcov).
#
#   tools/coverage.sh [--build-dir DIR] [--jobs N]
#     --build-dir DIR  where the instrumented build goes (default build/coverage)
# Writes DIR/coverage.info (lcov's tracefile, core/ and capi/) and DIR/uncovered.txt.
# Exit status: 0 when the tests passed (whatever the coverage), 1 when one failed.
set -uo pipefail
cd "$(dirname "$0")/.."
build_dir=build/coverage
jobs=2
while (($#)); do
  case $1 in
    --build-dir) build_dir=$2; shift 2 ;;
    --jobs) jobs=$2; shift 2 ;;
    -h | --help) sed -n '2,11p' "$0"; exit 0 ;;
    *) echo "coverage.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
command -v lcov >/dev/null || { echo "coverage.sh: needs lcov (apt-get install lcov)" >&2; exit 2; }
source_dir=$(pwd)

generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
cmake -S . -B "$build_dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Debug -DHPS_WITH_CUDA=OFF \
  -DHPS_BUILD_PYTHON=OFF -DHPS_BUILD_JAVA=OFF -DHPS_BUILD_RUST=OFF -DHPS_BUILD_EXAMPLES=OFF \
  -DHPS_PACKAGING_TESTS=OFF -DHPS_WERROR=OFF -DCMAKE_CXX_FLAGS="--coverage -O0" \
  -DCMAKE_C_FLAGS=--coverage -DCMAKE_EXE_LINKER_FLAGS=--coverage \
  -DCMAKE_SHARED_LINKER_FLAGS=--coverage >/dev/null || exit 1
cmake --build "$build_dir" --parallel "$jobs" || exit 1
find "$build_dir" -name '*.gcda' -delete  # counts of this run only

status=0
ctest --test-dir "$build_dir" -LE "sanitizer|gpu|fuzz" -E format_check -j "$jobs" \
  --output-on-failure || status=1

lcov --capture --directory "$build_dir" --output-file "$build_dir/all.info" --quiet \
  --ignore-errors gcov,source 2>&1 | grep -v "redefined at" || true
lcov --extract "$build_dir/all.info" "$source_dir/core/*" "$source_dir/capi/*" --output-file \
  "$build_dir/coverage.info" --quiet || exit 1
lcov --list "$build_dir/coverage.info"

# The engine's own lines no test ran, as FILE:LINE: source.
python3 - "$build_dir/coverage.info" "$source_dir" >"$build_dir/uncovered.txt" <<'EOF'
import re, sys
info, root = sys.argv[1], sys.argv[2] + "/core/"
engine = ("sharding/", "storage/", "clip/", "flow/", "checkpoint/", "kernels/cpu/")
for record in open(info).read().split("end_of_record"):
    match = re.search(r"^SF:(.*)$", record, re.M)
    if not match or not match.group(1).startswith(root):
        continue
    path = match.group(1)
    if not path[len(root):].startswith(engine):
        continue
    lines = open(path).read().split("\n")
    for number, count in re.findall(r"^DA:(\d+),(\d+)", record, re.M):
        if count == "0":
            print(f"core/{path[len(root):]}:{number}: {lines[int(number) - 1].strip()}")
EOF
echo "== engine lines no CPU test ran ($(wc -l <"$build_dir/uncovered.txt")), in $build_dir/uncovered.txt"
cat "$build_dir/uncovered.txt"
exit $status
