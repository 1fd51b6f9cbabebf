#!/usr/bin/env bash
# Fails when a C or C++ source of the project differs from the repo's .clang-format.
set -euo pipefail
cd "$1"
files=$(git ls-files 'core/*.h' 'core/*.cc' 'capi/*.h' 'capi/*.cc' 'tests/*.cc' 'tests/*.c' \
  'examples/*.c' 2>/dev/null || find core capi tests examples -name '*.h' -o -name '*.cc' -o -name '*.c')
clang-format --dry-run --Werror $files
echo "clang-format: $(echo "$files" | wc -w) files clean"
