#!/usr/bin/env bash
# Installs what building and testing hpshard needs on Debian 12 (only what is missing),
# then configures and builds into ./build. Used by tools/run-demo and tools/run-tests.
set -euo pipefail
cd "$(dirname "$0")/.."

packages=(
  build-essential cmake ninja-build pkg-config binutils file git clang-format
  libgtest-dev libgmock-dev libgloo-dev iproute2
  swig python3-dev python3-numpy python3-pytest
  default-jdk-headless junit5
  bindgen rpm rpm2cpio cpio
  libdlpack-dev abigail-tools
  clang-14 libclang-rt-14-dev libfuzzer-14-dev libssl-dev
  nlohmann-json3-dev libxxhash-dev libcli11-dev
  python3-torch python3-matplotlib
  libopenmpi-dev openmpi-bin
  ccache
)
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
# Rust: the rustup toolchain when present, else Debian's cargo.
export PATH="$PATH:$HOME/.cargo/bin"
command -v cargo >/dev/null 2>&1 || missing+=(cargo)
if ((${#missing[@]})); then
  echo "== installing: ${missing[*]}"
  sudo_cmd=""
  [ "$(id -u)" -eq 0 ] || sudo_cmd="sudo"
  $sudo_cmd apt-get update -q
  DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -q --no-install-recommends "${missing[@]}"
fi

build_dir="${HPS_BUILD_DIR:-build}"
# ccache for the build and (through the launcher they inherit) the sanitizer sub-builds;
# paths under the checkout hash relative to it, so another clone reuses the cache.
export CCACHE_BASEDIR="${CCACHE_BASEDIR:-$PWD}"
cmake -S . -B "$build_dir" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo \
  -DCMAKE_C_COMPILER_LAUNCHER=ccache -DCMAKE_CXX_COMPILER_LAUNCHER=ccache ${HPS_CMAKE_ARGS:-}
cmake --build "$build_dir" --parallel "${HPS_BUILD_JOBS:-$(nproc)}"
