#!/usr/bin/env bash
# Packaging test: builds the .deb and .rpm packages of a configured and built hpshard
# build tree with CPack, checks their names, dependencies and contents, unpacks them
# into two scratch roots (dpkg-deb -x, rpm2cpio | cpio) and, in each root, builds and
# runs an outside C program (tests/packaging/consumer) against the unpacked package
# twice: with pkg-config and with CMake's find_package(hpshard).
#
# Usage: package_test.sh --build-dir DIR [--cmake CMAKE] [--cpack CPACK] [--cc CC]
#                        [--generator GEN]
# Everything it writes goes to DIR/packaging-test, removed on exit
# (set HPS_PACKAGING_KEEP=1 to keep it for inspection).
# Needs: dpkg-deb, dpkg-shlibdeps, rpmbuild (Debian package rpm), rpm2cpio, cpio,
# pkg-config, readelf, a C compiler.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
build_dir=""
cmake_bin="cmake"
cpack_bin="cpack"
cc_bin="${CC:-cc}"
generator=""

log() { printf '[package_test] %s\n' "$*"; }
fail() { printf '[package_test] FAIL: %s\n' "$*" >&2; exit 1; }
usage() { sed -n '8,11p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }

while [[ $# -gt 0 ]]; do
  case "$1" in
    --build-dir) build_dir="$2"; shift 2 ;;
    --cmake) cmake_bin="$2"; shift 2 ;;
    --cpack) cpack_bin="$2"; shift 2 ;;
    --cc) cc_bin="$2"; shift 2 ;;
    --generator) generator="$2"; shift 2 ;;
    -h|--help) usage ;;
    *) echo "unknown argument: $1" >&2; usage ;;
  esac
done
[[ -n "$build_dir" ]] || usage
build_dir="$(cd "$build_dir" && pwd)"

manifest="$build_dir/packaging/hps_packages.env"
[[ -f "$build_dir/CPackConfig.cmake" ]] || fail "no CPackConfig.cmake in $build_dir (configure first)"
[[ -f "$manifest" ]] || fail "no $manifest (written by packaging/PackageSetup.cmake)"
# shellcheck source=/dev/null
source "$manifest"

for tool in dpkg-deb dpkg-shlibdeps dpkg rpmbuild rpm rpm2cpio cpio pkg-config readelf "$cc_bin" "$cmake_bin" "$cpack_bin"; do
  command -v "$tool" >/dev/null 2>&1 || fail "required tool '$tool' not found (apt-get install dpkg-dev rpm cpio pkg-config binutils)"
done

# The environment must not point the consumer builds anywhere else.
unset CMAKE_PREFIX_PATH hpshard_DIR hpshard_ROOT PKG_CONFIG_PATH PKG_CONFIG_LIBDIR \
      PKG_CONFIG_SYSROOT_DIR LD_LIBRARY_PATH CPATH C_INCLUDE_PATH LIBRARY_PATH || true

scratch="$build_dir/packaging-test"
cleanup() {
  local rc=$?
  if [[ "${HPS_PACKAGING_KEEP:-0}" == 1 ]]; then
    log "kept $scratch"
  else
    rm -rf "$scratch"
  fi
  if [[ $rc -ne 0 ]]; then
    log "FAILED (rc=$rc); rerun with HPS_PACKAGING_KEEP=1 to keep $scratch"
  fi
}
rm -rf "$scratch"
mkdir -p "$scratch"
trap cleanup EXIT

start=$SECONDS
forbidden='cuda|nccl|nvidia|cudnn|cublas|cufft|curand|cusparse|cusolver|nvrtc'

# ---- 1. build the packages ---------------------------------------------------------
for gen in DEB RPM; do
  out="$scratch/pkg-$gen"
  log "cpack -G $gen -> $out"
  if ! (cd "$build_dir" && "$cpack_bin" --config CPackConfig.cmake -G "$gen" -B "$out") \
      >"$scratch/cpack-$gen.log" 2>&1; then
    tail -n 40 "$scratch/cpack-$gen.log" >&2
    fail "cpack -G $gen failed (log above)"
  fi
done

deb_arch="$(dpkg --print-architecture)"
rpm_arch="$(uname -m)"
full_version="$HPS_VERSION-$HPS_PKG_RELEASE"

deb_name() {  # component -> Debian package name
  case "$1" in
    runtime) echo "$HPS_PKG_RUNTIME" ;; dev) echo "$HPS_PKG_DEV_DEB" ;;
    python) echo "$HPS_PKG_PYTHON" ;; java) echo "$HPS_PKG_JAVA" ;;
    *) fail "unknown component '$1'" ;;
  esac
}
rpm_name() {  # component -> RPM package name
  case "$1" in
    runtime) echo "$HPS_PKG_RUNTIME" ;; dev) echo "$HPS_PKG_DEV_RPM" ;;
    python) echo "$HPS_PKG_PYTHON" ;; java) echo "$HPS_PKG_JAVA" ;;
    *) fail "unknown component '$1'" ;;
  esac
}
deb_file() { echo "$scratch/pkg-DEB/$(deb_name "$1")_${full_version}_${deb_arch}.deb"; }
rpm_file() { echo "$scratch/pkg-RPM/$(rpm_name "$1")-${full_version}.${rpm_arch}.rpm"; }

# ---- 2. the expected package files, and nothing else -----------------------------------
read -r -a components <<<"$HPS_COMPONENTS"
for required in runtime dev; do
  [[ " ${components[*]} " == *" $required "* ]] || fail "component '$required' is not packaged (CPACK_COMPONENTS_ALL='$HPS_COMPONENTS')"
done
log "components: ${components[*]}"
has_component() { [[ " ${components[*]} " == *" $1 "* ]]; }
for c in "${components[@]}"; do
  [[ -f "$(deb_file "$c")" ]] || fail "missing $(deb_file "$c"); have: $(ls "$scratch/pkg-DEB")"
  [[ -f "$(rpm_file "$c")" ]] || fail "missing $(rpm_file "$c"); have: $(ls "$scratch/pkg-RPM")"
  log "built $(basename "$(deb_file "$c")") and $(basename "$(rpm_file "$c")")"
done
n_deb=$(find "$scratch/pkg-DEB" -maxdepth 1 -name '*.deb' | wc -l)
n_rpm=$(find "$scratch/pkg-RPM" -maxdepth 1 -name '*.rpm' | wc -l)
[[ $n_deb -eq ${#components[@]} ]] || fail "expected ${#components[@]} .deb files, found $n_deb: $(ls "$scratch/pkg-DEB")"
[[ $n_rpm -eq ${#components[@]} ]] || fail "expected ${#components[@]} .rpm files, found $n_rpm: $(ls "$scratch/pkg-RPM")"

# ---- 3. dependencies: nothing on CUDA/NCCL; the runtime only on the C/C++ runtime ----
for c in "${components[@]}"; do
  f="$(deb_file "$c")"
  deps="$(dpkg-deb -f "$f" Pre-Depends Depends Recommends Suggests | tr '\n' ' ')" \
    || fail "dpkg-deb -f $(basename "$f") failed"
  log "$(basename "$f"): $deps"
  if grep -qiE "$forbidden" <<<"$deps"; then fail "$(basename "$f") depends on CUDA/NCCL: $deps"; fi
  f="$(rpm_file "$c")"
  reqs="$(rpm -qpR "$f" 2>/dev/null)" || fail "rpm -qpR $(basename "$f") failed"
  log "$(basename "$f"): Requires: $(grep -v '^rpmlib(' <<<"$reqs" \
      | grep -vE '\((GLIBC|GCC|CXXABI|GLIBCXX)_' | sort -u | paste -sd' ')"
  if grep -qiE "$forbidden" <<<"$reqs"; then fail "$(basename "$f") requires CUDA/NCCL: $reqs"; fi
done
runtime_deps="$(dpkg-deb -f "$(deb_file runtime)" Depends)"
[[ -n "$runtime_deps" ]] || fail "runtime package has no Depends (dpkg-shlibdeps did not run?)"
while read -r dep; do
  name="${dep%% *}"
  case "$name" in
    libc6|libstdc++6|libgcc-s1|libgloo0) ;;  # libgloo0: the CPU communicator (Debian's Gloo)
    *) fail "runtime package depends on '$dep' (expected only libc6, libstdc++6, libgcc-s1, libgloo0)" ;;
  esac
done < <(tr ',|' '\n' <<<"$runtime_deps" | sed 's/^ *//; /^$/d')
grep -qE "(^|, )$HPS_PKG_RUNTIME \(= $full_version\)" <<<"$(dpkg-deb -f "$(deb_file dev)" Depends)" \
  || fail "dev package does not depend on $HPS_PKG_RUNTIME (= $full_version)"
rpm -qpR "$(rpm_file dev)" 2>/dev/null | grep -qx "$HPS_PKG_RUNTIME = $full_version" \
  || fail "dev rpm does not require $HPS_PKG_RUNTIME = $full_version"

# ---- 4. contents ---------------------------------------------------------------------
prefix="${HPS_INSTALL_PREFIX%/}"
rel() {  # install dir (relative to the prefix, or absolute) -> absolute path
  if [[ "$1" == /* ]]; then echo "$1"; else echo "$prefix/$1"; fi
}
libdir="$(rel "$HPS_INSTALL_LIBDIR")"
incdir="$(rel "$HPS_INSTALL_INCLUDEDIR")"
cmakedir="$(rel "$HPS_INSTALL_CMAKEDIR")"
so_major="$libdir/libhpshard.so.$HPS_VERSION_MAJOR"
so_full="$libdir/libhpshard.so.$HPS_VERSION"
dev_files=("$incdir/hpshard/hpshard.h" "$incdir/hpshard/version.h" "$libdir/libhpshard.so"
           "$libdir/pkgconfig/hpshard.pc" "$cmakedir/hpshardConfig.cmake"
           "$cmakedir/hpshardConfigVersion.cmake" "$cmakedir/hpshardTargets.cmake")

deb_list() { dpkg-deb --fsys-tarfile "$1" | tar -t | sed 's|^\./|/|; s|/$||' | grep -v '^$' ; }
rpm_list() { rpm -qpl "$1" 2>/dev/null; }
deb_files() { dpkg-deb --fsys-tarfile "$1" | tar -tv | awk '$1 !~ /^d/ {print $6}' | sed 's|^\./|/|'; }
rpm_files() { rpm -qp --qf '[%{FILEMODES:perms} %{FILENAMES}\n]' "$1" 2>/dev/null | awk '$1 !~ /^d/ {print $2}' | grep -v '/\.build-id/'; }

for kind in deb rpm; do
  rt="$(${kind}_file runtime)"; dv="$(${kind}_file dev)"
  mapfile -t rt_files < <(${kind}_files "$rt")
  # The runtime holds the versioned library, the launcher, the benchmark and the timeline
  # merger, nothing else.
  launcher="$prefix/bin/hpshard-run"; bench="$prefix/bin/hpshard-bench"
  tracer="$prefix/bin/hpshard-trace"
  [[ ${#rt_files[@]} -eq 5 ]] || fail "$(basename "$rt") should hold exactly $so_major, $so_full, $launcher, $bench and $tracer, holds: ${rt_files[*]}"
  for f in "${rt_files[@]}"; do
    [[ "$f" == "$so_major" || "$f" == "$so_full" || "$f" == "$launcher" || "$f" == "$bench" || "$f" == "$tracer" ]] || fail "$(basename "$rt") holds unexpected file $f"
  done
  all_dev="$(${kind}_list "$dv")"
  for f in "${dev_files[@]}"; do
    grep -qxF "$f" <<<"$all_dev" || fail "$(basename "$dv") lacks $f; it holds: $(tr '\n' ' ' <<<"$all_dev")"
  done
  if grep -q "libhpshard\.so\.$HPS_VERSION_MAJOR" <<<"$all_dev"; then
    fail "$(basename "$dv") holds the versioned library (belongs to $HPS_PKG_RUNTIME)"
  fi
  if has_component python; then
    all_py="$(${kind}_list "$(${kind}_file python)")"
    for pat in "^$prefix/lib/python3/dist-packages/hpshard/__init__\.py\$" \
               "^$prefix/lib/python3/dist-packages/hpshard/_capi[^/]*\.so\$"; do
      grep -qE "$pat" <<<"$all_py" || fail "$(basename "$(${kind}_file python)") has no file matching $pat"
    done
  fi
  if has_component java; then
    all_java="$(${kind}_list "$(${kind}_file java)")"
    grep -qE '\.jar$' <<<"$all_java" || fail "$(basename "$(${kind}_file java)") holds no .jar"
    grep -qE '/libhpshard_jni[^/]*\.so$' <<<"$all_java" || fail "$(basename "$(${kind}_file java)") holds no JNI library"
  fi
  log "$kind contents OK: runtime = ${rt_files[*]}; dev = ${#dev_files[@]} required files present"
done

# ---- 5. unpack into scratch roots ------------------------------------------------------
root_deb="$scratch/root-deb"
root_rpm="$scratch/root-rpm"
mkdir -p "$root_deb" "$root_rpm"
for c in "${components[@]}"; do
  dpkg-deb -x "$(deb_file "$c")" "$root_deb"
  (cd "$root_rpm" && rpm2cpio "$(rpm_file "$c")" | cpio -idm --quiet)
done

# ---- 6. in each root: the library, then the outside program twice -------------------------
consumer_src="$here/consumer"
gen_args=()
if [[ -n "$generator" ]]; then gen_args=(-G "$generator"); fi

check_root() {
  local kind="$1" root="$2"
  local rlib="$root$libdir" work="$scratch/consumer-$kind"
  mkdir -p "$work"
  log "[$kind] root $root"

  [[ -f "$root$so_full" && -L "$root$so_major" ]] || fail "[$kind] $so_full / $so_major not unpacked"
  local needed
  needed="$(readelf -d "$root$so_full" | awk '/NEEDED/ {print $NF}' | tr -d '[]' | tr '\n' ' ')"
  log "[$kind] libhpshard NEEDED: $needed"
  if grep -qiE "$forbidden|libcu" <<<"$needed"; then fail "[$kind] libhpshard.so needs a CUDA library: $needed"; fi
  readelf -d "$root$so_full" | grep -q "SONAME.*\[libhpshard.so.$HPS_VERSION_MAJOR\]" \
    || fail "[$kind] SONAME is not libhpshard.so.$HPS_VERSION_MAJOR"
  grep -qx "prefix=$prefix" "$rlib/pkgconfig/hpshard.pc" \
    || fail "[$kind] hpshard.pc does not say prefix=$prefix: $(grep '^prefix=' "$rlib/pkgconfig/hpshard.pc")"

  # (a) pkg-config, with the sysroot so -I/-L point into the root
  local pc_env=(env PKG_CONFIG_LIBDIR="$rlib/pkgconfig" PKG_CONFIG_PATH= PKG_CONFIG_SYSROOT_DIR="$root"
                PKG_CONFIG_ALLOW_SYSTEM_CFLAGS=1 PKG_CONFIG_ALLOW_SYSTEM_LIBS=1)
  local pc_version cflags libs
  pc_version="$("${pc_env[@]}" pkg-config --modversion hpshard)" || fail "[$kind] pkg-config cannot find hpshard"
  [[ "$pc_version" == "$HPS_VERSION" ]] || fail "[$kind] pkg-config version $pc_version != $HPS_VERSION"
  cflags="$("${pc_env[@]}" pkg-config --cflags hpshard)"
  libs="$("${pc_env[@]}" pkg-config --libs hpshard)"
  log "[$kind] pkg-config: $cflags $libs"
  [[ "$cflags" == *"-I$root$incdir"* ]] || fail "[$kind] pkg-config --cflags does not point into the root: $cflags"
  [[ "$libs" == *"-L$rlib"* ]] || fail "[$kind] pkg-config --libs does not point into the root: $libs"
  # shellcheck disable=SC2086  # word splitting of the flags is intended
  "$cc_bin" -std=c99 -Wall -Wextra -Werror -o "$work/consumer-pc" "$consumer_src/main.c" $cflags $libs \
    || fail "[$kind] compiling the consumer with pkg-config flags failed"
  run_consumer "$kind/pkg-config" "$work/consumer-pc" "$rlib" "$root"

  # (b) CMake find_package(hpshard 0.1 REQUIRED), linking hpshard::hpshard
  if ! "$cmake_bin" -S "$consumer_src" -B "$work/cmake-build" "${gen_args[@]}" \
        -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER="$cc_bin" \
        -DCMAKE_PREFIX_PATH="$root$prefix" \
        -DCMAKE_FIND_USE_PACKAGE_REGISTRY=OFF -DCMAKE_FIND_USE_SYSTEM_PACKAGE_REGISTRY=OFF \
        >"$work/cmake-configure.log" 2>&1; then
    cat "$work/cmake-configure.log" >&2
    fail "[$kind] configuring the consumer with find_package(hpshard) failed"
  fi
  local found_dir
  found_dir="$(sed -n 's/^hpshard_DIR:[A-Z]*=//p' "$work/cmake-build/CMakeCache.txt")"
  [[ "$found_dir" == "$root"/* ]] || fail "[$kind] find_package found hpshard outside the root: $found_dir"
  log "[$kind] find_package: hpshard_DIR=$found_dir"
  if ! "$cmake_bin" --build "$work/cmake-build" >"$work/cmake-build.log" 2>&1; then
    cat "$work/cmake-build.log" >&2
    fail "[$kind] building the consumer with find_package(hpshard) failed"
  fi
  run_consumer "$kind/cmake" "$work/cmake-build/hpshard_consumer" "$rlib" "$root"

  # (c) the Python package imports from the root (with the Debian python3 of the binding)
  if has_component python; then
    local py=/usr/bin/python3 site="$root$prefix/lib/python3/dist-packages" out
    if [[ -x "$py" ]]; then
      out="$(cd "$work" && PYTHONPATH="$site" LD_LIBRARY_PATH="$rlib" PYTHONDONTWRITEBYTECODE=1 \
             "$py" -s -c 'import sys, hpshard; print(hpshard.__file__)' 2>&1)" \
        || fail "[$kind] import hpshard from the python package failed: $out"
      [[ "$out" == "$site"/* ]] || fail "[$kind] imported hpshard from $out, not from $site"
      log "[$kind/python] import hpshard OK ($out)"
    else
      log "[$kind/python] $py not found: import check skipped"
    fi
  fi
}

run_consumer() {
  local what="$1" exe="$2" rlib="$3" root="$4" resolved
  resolved="$(LD_LIBRARY_PATH="$rlib" ldd "$exe" | awk '/libhpshard/ {print $3}')"
  [[ "$resolved" == "$root"/* ]] || fail "[$what] libhpshard resolves to '$resolved', not into $root"
  LD_LIBRARY_PATH="$rlib" "$exe" >"$exe.out" 2>&1 || { cat "$exe.out" >&2; fail "[$what] the consumer failed"; }
  log "[$what] consumer OK ($(head -n 1 "$exe.out"))"
}

check_root deb "$root_deb"
check_root rpm "$root_rpm"

log "PASS in $((SECONDS - start)) s: ${components[*]} as .deb and .rpm"
