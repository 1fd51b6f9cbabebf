#!/usr/bin/env bash
# Builds the checkpoint reader's libFuzzer target with clang 14 (libFuzzer, ASan, UBSan)
# and runs it for a bounded time from the seed corpus; any crash, leak, sanitizer report or
# timeout fails. Skipped (77) without clang++-14 and its libFuzzer runtime.
# Usage: checkpoint_fuzz.sh SOURCE_DIR GENERATED_DIR WORK_DIR [SECONDS]
set -uo pipefail
src="$1"
generated="$2"
work="$3"
seconds="${4:-10}"
clangxx="$(command -v clang++-14 || true)"
if [ -z "$clangxx" ]; then
  echo "skipped: no clang++-14 (tools/setup.sh installs clang-14 and libfuzzer-14-dev)"
  exit 77
fi
mkdir -p "$work/corpus"
binary="$work/checkpoint_fuzz"
sources=(
  "$src/tests/fuzz/checkpoint_fuzz.cc"
  "$src/core/checkpoint/manifest.cc" "$src/core/checkpoint/safetensors.cc"
  "$src/core/checkpoint/reshard.cc" "$src/core/checkpoint/format.cc"
  "$src/core/checkpoint/file_io.cc" "$src/core/common/status.cc" "$src/core/common/dtype.cc"
)
# Rebuilt only when a source or header changed.
stale=0
[ -x "$binary" ] || stale=1
for f in "${sources[@]}" "$src"/core/checkpoint/*.h; do
  [ "$f" -nt "$binary" ] && stale=1
done
if [ "$stale" = 1 ]; then
  echo "== building $binary"
  "$clangxx" -std=c++20 -O1 -g -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all \
    -I"$src" -I"$generated" "${sources[@]}" -o "$binary" || { echo "the fuzz target does not build"; exit 1; }
fi
# A fresh copy of the seeds each run: the fuzzer adds what it finds to its corpus.
cp "$src"/tests/fuzz/checkpoint_corpus/* "$work/corpus/"
echo "== fuzzing for $seconds s"
UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 ASAN_OPTIONS=detect_leaks=1 \
  "$binary" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -max_len=65536 \
  -artifact_prefix="$work/" "$work/corpus" 2>&1 | tail -n 25
rc=${PIPESTATUS[0]}
[ "$rc" -eq 0 ] || echo "the fuzzer found a failing input (see $work/crash-* and the report above)"
exit "$rc"
