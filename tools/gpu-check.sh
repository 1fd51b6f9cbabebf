#!/usr/bin/env bash
# The prepared GPU check: builds the CUDA parts and runs the gpu-labelled tests and the
# GPU benchmark (hpshard-gpu-bench: the CUDA clip and AdamW kernels beside a device-to-device
# copy) in a few minutes, writing logs and gpu-bench.json under $OUT.
#
# On this (CPU) machine, prepare the carried GoogleTest sources once:
#   mkdir -p .gpu-carry/json && cp -r /usr/src/googletest .gpu-carry/ && echo /.gpu-carry/ >> .git/info/exclude
#   cp -r /usr/include/nlohmann .gpu-carry/json/   # the timeline's JSON headers
# then, with the device tool:  run(command="tools/gpu-check.sh", carry=[".gpu-carry"], timeout_s=540)
# The GPU machine has CUDA and NCCL but no Debian packages (no Gloo, maybe no GTest), so
# the CPU communicator is left out there and GoogleTest is built from the carried copy.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/build-gpu/out}"
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -3
nvcc --version 2>&1 | tail -1
gtest_args=()
[ -d .gpu-carry/googletest ] && gtest_args=(-DHPS_GTEST_SOURCE_DIR="$PWD/.gpu-carry/googletest")
[ -d .gpu-carry/json ] && gtest_args+=(-DHPS_JSON_INCLUDE_DIR="$PWD/.gpu-carry/json")
export PATH="/usr/local/cuda/bin:$PATH"

echo "== configure"
# Warnings stay warnings there (CI here enforces them): an unknown compiler's new warning
# must not cost the only run on a GPU.
cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DHPS_WITH_CUDA=ON -DHPS_WERROR=OFF \
  -DHPS_BUILD_PYTHON=OFF -DHPS_BUILD_JAVA=OFF -DHPS_BUILD_RUST=OFF -DHPS_PACKAGING_TESTS=OFF \
  -DHPS_NO_SANITIZER_SUBBUILD=ON "${gtest_args[@]}" || exit 1
echo "== build"
cmake --build build-gpu --parallel "$(nproc)" || exit 1

echo "== gpu tests"
ctest --test-dir build-gpu -L gpu --output-on-failure --output-junit "$out/gpu-tests.xml"
gpu_rc=$?
echo "== all C and C++ tests that can run there"
ctest --test-dir build-gpu -L '^(cpp|c)$' --output-on-failure --parallel 8
all_rc=$?
echo "== gpu benchmarks"
bench_rc=0
if [ -x build-gpu/tools/hpshard-gpu-bench ]; then
  build-gpu/tools/hpshard-gpu-bench --mib 256 --iters 20 --json "$out/gpu-bench.json"
  bench_rc=$?
  [ "$bench_rc" -eq 77 ] && bench_rc=0  # no usable device: said so above
else
  echo "hpshard-gpu-bench was not built (no CUDA found?)"
fi
echo "gpu tests rc=$gpu_rc, cpp/c tests rc=$all_rc, gpu bench rc=$bench_rc"
exit $((gpu_rc | all_rc | bench_rc))
