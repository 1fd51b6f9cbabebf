#!/bin/sh
# Regenerate src/bindings.rs from capi/include/hpshard/hpshard.h with bindgen.
# This script is the single place the bindgen command lives; the ctest
# rust_sys_bindings_current runs it into a temporary file and diffs the result
# against the checked-in src/bindings.rs.
#
# Usage: regenerate.sh <include-dir-with-generated-hpshard/version.h> [output]
#   e.g. bindings/rust/hpshard-sys/regenerate.sh build/generated
# The default output is src/bindings.rs next to this script.
#
# Environment: BINDGEN (default: bindgen on PATH; bindgen 0.60.1 is the reference),
# RUSTFMT (default: rustfmt on PATH or in $HOME/.cargo/bin). bindgen's own rustfmt
# call is disabled; the script runs rustfmt itself (edition 2021, default style) so
# the checked-in file is readable. Without rustfmt the output is left unformatted
# (valid Rust, but it will not match the checked-in file).
set -eu

if [ $# -lt 1 ] || [ $# -gt 2 ]; then
  echo "usage: $0 <include-dir-with-generated-hpshard/version.h> [output]" >&2
  exit 2
fi

here=$(cd "$(dirname "$0")" && pwd)
gen_include=$1
out=${2:-$here/src/bindings.rs}
capi_include=$here/../../../capi/include
header=$capi_include/hpshard/hpshard.h
bindgen=${BINDGEN:-bindgen}
rustfmt=${RUSTFMT:-}
if [ -z "$rustfmt" ]; then
  if command -v rustfmt >/dev/null 2>&1; then
    rustfmt=rustfmt
  elif [ -x "${HOME:-/nonexistent}/.cargo/bin/rustfmt" ]; then
    rustfmt=$HOME/.cargo/bin/rustfmt
  fi
fi

if [ ! -f "$gen_include/hpshard/version.h" ]; then
  echo "$0: $gen_include/hpshard/version.h not found (configure the CMake build first)" >&2
  exit 2
fi
if ! command -v "$bindgen" >/dev/null 2>&1; then
  echo "$0: '$bindgen' not found (apt-get install bindgen)" >&2
  exit 2
fi

tmp=$out.tmp.$$
trap 'rm -f "$tmp" "$tmp.fmt"' EXIT INT TERM
"$bindgen" "$header" \
  --output "$tmp" \
  --no-rustfmt-bindings \
  --rust-target 1.47 \
  --size_t-is-usize \
  --newtype-enum 'hps_.*' \
  --allowlist-function 'hps_.*' \
  --allowlist-type 'hps_.*' \
  --allowlist-var 'HPS_.*' \
  -- -I"$capi_include" -I"$gen_include"
if [ -n "$rustfmt" ]; then
  # Format from stdin inside this directory, so no rustfmt.toml of the caller's
  # working directory or of the output's directory changes the result.
  (cd "$here" && "$rustfmt" --edition 2021 <"$tmp" >"$tmp.fmt")
  mv "$tmp.fmt" "$tmp"
else
  echo "$0: warning: rustfmt not found; $out is left unformatted" >&2
fi
mv "$tmp" "$out"
trap - EXIT INT TERM
