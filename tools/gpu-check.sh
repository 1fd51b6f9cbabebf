#!/usr/bin/env bash
# The one prepared GPU run. In order, each step bounded by a timeout (the whole fits in
# 8 minutes on a machine like the lent one: one H200, 16 cores):
#   1. the machine: GPU, driver and nvcc (nvidia-smi);
#   2. a Release build of the CUDA parts in build-gpu/ (CUDA on; no Gloo, no bindings: the
#      GPU machine has neither Gloo nor Debian packages; GoogleTest from .gpu-carry/);
#   3. what the run depends on, before anything runs: the CUDA driver and runtime, the
#      stream-ordered allocator's support, the NCCL that is loaded and from where
#      (hpshard-gpu-bench --info); no usable device ends the run here, with a message;
#   4. the tests labelled gpu, once (the CUDA kernel table against the CPU table, the
#      host-sync interposer, streams, NCCL at world size 1, the clip, the engines'
#      CUDA cases and a CUDA engine's checkpoints), communicator timeouts (30 s) below
#      ctest's;
#   5. the GPU benchmarks: hpshard-gpu-bench (the kernel table beside a device-to-device
#      copy), hpshard-gpu-bench --step: the engines' step at world size 1 (the same code as
#      hpshard-bench step --device cuda, in the binary that needs no Gloo), and
#      hpshard-gpu-bench --ckpt: a CUDA engine's save and load beside plain file I/O and its
#      step beside a save in flight (hpshard-bench ckpt --device cuda --ranks 1's code).
# It writes gpu-check.log, gpu-tests.xml, gpu-bench.json, step-cuda.json, ckpt-cuda.json and
# a summary, gpu-check.json, under $OUT (else build-gpu/out), and exits non-zero unless every step
# ran and passed: a skipped gpu test, a benchmark that found no device (exit 77) or a step
# that could not run counts as a failure, never as success.
#
# On this (CPU) machine, prepare the carried GoogleTest sources once:
#   mkdir -p .gpu-carry && cp -r /usr/src/googletest .gpu-carry/ && echo /.gpu-carry/ >> .git/info/exclude
#   mkdir -p .gpu-carry/include && cp -r /usr/include/nlohmann /usr/include/xxhash.h .gpu-carry/include/
# (the header-only JSON and XXH3 of the checkpoints, the timeline and the benchmarks;
#  cmake/HpsHeaderDeps.cmake looks there)
# then, with the device tool:  run(command="tools/gpu-check.sh", carry=[".gpu-carry"], timeout_s=540)
# Here, without a GPU, it builds (step 2) and stops at step 3 with a non-zero exit
# (HPS_GPU_CHECK_BUDGET_S=3600 gives this 2-core machine's build the time it needs).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/build-gpu/out}"
mkdir -p "$out"
exec > >(tee "$out/gpu-check.log") 2>&1
export PATH="/usr/local/cuda/bin:$PATH"
export HPS_COMM_TIMEOUT_MS=30000  # below ctest's per-test timeouts (60..300 s)
start_s=$SECONDS
jobs=$(nproc)
# The whole run, with the device tool's 540 s around it. HPS_GPU_CHECK_BUDGET_S replaces it
# (and the steps' own caps) where the build is slower, e.g. on a 2-core machine without GPU.
budget_s=${HPS_GPU_CHECK_BUDGET_S:-470}
[[ "$budget_s" =~ ^[0-9]+$ ]] || { echo "HPS_GPU_CHECK_BUDGET_S must be a number of seconds"; exit 2; }

# A step's timeout: its own cap, or what is left of the budget when that is less.
cap() {
  local left=$((budget_s - (SECONDS - start_s)))
  [ "$left" -lt 5 ] && left=5
  if [ -n "${HPS_GPU_CHECK_BUDGET_S:-}" ] || [ "$1" -ge "$left" ]; then echo "$left"; else echo "$1"; fi
}

declare -A result
summary() {  # writes gpu-check.json and exits with $1
  local rc=$1 first=1
  {
    printf '{"tool": "gpu-check", "seconds": %d, "exit": %d' $((SECONDS - start_s)) "$rc"
    for key in "${!result[@]}"; do printf ', "%s": "%s"' "$key" "${result[$key]}"; done
    printf '}\n'
  } >"$out/gpu-check.json"
  echo "== summary ($((SECONDS - start_s)) s)"
  for key in "${!result[@]}"; do echo "  $key: ${result[$key]}"; done
  [ "$rc" -eq 0 ] && echo "gpu-check: PASSED" || echo "gpu-check: FAILED (exit $rc)"
  exit "$rc"
}

echo "== machine"
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv
  arch=$(timeout 30 nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null |
    head -1 | tr -d ' .')
else
  echo "nvidia-smi: not found (no NVIDIA driver on this machine)"
  arch=""
fi
nvcc --version 2>&1 | tail -1
# Kernels for the GPU that is here (one architecture builds twice as fast), else the
# project's default list.
arch_args=()
[[ "$arch" =~ ^[0-9]+$ ]] && arch_args=(-DCMAKE_CUDA_ARCHITECTURES="$arch")
gtest_args=()
[ -d .gpu-carry/googletest ] && gtest_args=(-DHPS_GTEST_SOURCE_DIR="$PWD/.gpu-carry/googletest")
export PATH="/usr/local/cuda/bin:$PATH"

echo "== configure"
# Warnings stay warnings there (CI here enforces them): an unknown compiler's new warning
# must not cost the only run on a GPU.
if ! timeout "$(cap 150)" cmake -S . -B build-gpu -DCMAKE_BUILD_TYPE=Release -DHPS_WITH_CUDA=ON \
  -DHPS_WITH_GLOO=OFF -DHPS_WERROR=OFF -DHPS_BUILD_PYTHON=OFF -DHPS_BUILD_JAVA=OFF \
  -DHPS_BUILD_RUST=OFF -DHPS_BUILD_EXAMPLES=OFF -DHPS_PACKAGING_TESTS=OFF \
  -DHPS_NO_SANITIZER_SUBBUILD=ON "${arch_args[@]}" "${gtest_args[@]}"; then
  result[build]="configure failed"
  summary 2
fi
echo "== build"
if ! timeout "$(cap 330)" cmake --build build-gpu --parallel "$jobs"; then
  result[build]="failed or timed out"
  summary 2
fi
result[build]="ok ($((SECONDS - start_s)) s)"

echo "== device"
timeout 60 build-gpu/tools/hpshard-gpu-bench --info
info_rc=$?
if [ "$info_rc" -ne 0 ]; then
  if [ "$info_rc" -eq 77 ]; then
    echo "gpu-check: no usable CUDA device here: nothing GPU-related can run (the build above is all this machine can check)"
    result[device]="none"
  else
    echo "gpu-check: the device query failed (exit $info_rc)"
    result[device]="query failed ($info_rc)"
  fi
  summary 3
fi
result[device]="ok"

failed=0
echo "== gpu tests"
tests_log="$out/gpu-tests.log"
timeout "$(cap 240)" ctest --test-dir build-gpu -L '^gpu$' --output-on-failure --timeout 240 \
  --no-tests=error --output-junit "$out/gpu-tests.xml" 2>&1 | tee "$tests_log"
tests_rc=${PIPESTATUS[0]}
skipped=$(grep -c '\*\*\*Skipped' "$tests_log")
ran=$(grep -Eo 'tests passed, [0-9]+ tests failed out of [0-9]+' "$tests_log" | grep -Eo '[0-9]+$')
if [ "$tests_rc" -ne 0 ]; then
  result[gpu_tests]="failed (ctest exit $tests_rc; $skipped skipped of ${ran:-?})"
  failed=1
elif [ "$skipped" -ne 0 ]; then
  # A skipped gpu test on a GPU machine is a test that did not run: never a pass.
  result[gpu_tests]="$skipped of ${ran:-?} skipped: did not run"
  failed=1
else
  result[gpu_tests]="passed (${ran:-?})"
fi

# What a benchmark's exit status says, into result[$1].
bench_result() {
  case "$2" in
    0) result[$1]="ran" ;;
    77) result[$1]="found no device (77): did not run"; failed=1 ;;
    *) result[$1]="failed ($2)"; failed=1 ;;
  esac
}

echo "== gpu benchmarks: the kernel table beside a device-to-device copy"
timeout "$(cap 90)" build-gpu/tools/hpshard-gpu-bench --mib 256 --iters 20 --json "$out/gpu-bench.json"
bench_result gpu_bench $?

echo "== gpu benchmarks: the engines' step on the GPU, world size 1 (hpshard-gpu-bench --step)"
timeout "$(cap 120)" build-gpu/tools/hpshard-gpu-bench --step --json "$out/step-cuda.json"
bench_result step_bench $?

echo "== gpu benchmarks: a CUDA engine's checkpoints, world size 1 (hpshard-gpu-bench --ckpt)"
timeout "$(cap 90)" build-gpu/tools/hpshard-gpu-bench --ckpt --dir "$PWD/build-gpu/ckpt-bench" \
  --json "$out/ckpt-cuda.json"
bench_result ckpt_bench $?
rm -rf build-gpu/ckpt-bench

summary "$failed"
