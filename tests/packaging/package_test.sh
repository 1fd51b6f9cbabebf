#!/usr/bin/env bash
# Packaging test: builds the .deb and .rpm packages of a configured and built hpshard
# build tree with CPack and checks their names, dependencies, maintainer scripts and
# file lists in both layouts (Debian; Fedora/RHEL for the RPMs). Then:
#  - the .deb packages are installed for real into a scratch root (dpkg --root, maintainer
#    scripts run chrootless with DPKG_ROOT, no container), and every language is used
#    from the installed files only: C (pkg-config and find_package(hpshard)), Python
#    (byte-compiled on install), Java, Rust (an offline cargo build from the installed
#    crates) and the tools; then they are purged and nothing may be left behind;
#  - the .rpm packages are unpacked into another root (rpm2cpio | cpio) and the C program
#    and the Python import run from the Fedora layout there.
#
# Usage: package_test.sh --build-dir DIR [--cmake CMAKE] [--cpack CPACK] [--cc CC]
#                        [--generator GEN]
# Everything it writes goes to DIR/packaging-test, removed on exit
# (set HPS_PACKAGING_KEEP=1 to keep it for inspection).
# Needs: dpkg-deb, dpkg-shlibdeps, rpmbuild (Debian package rpm), rpm2cpio, cpio,
# pkg-config, readelf, a C compiler.
set -euo pipefail
# Under pipefail a `producer | grep -q` fails when grep exits at its first match while the
# producer still writes (SIGPIPE): the checks read their input from here-strings instead.

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

for tool in dpkg-deb dpkg-shlibdeps dpkg rpmbuild rpm rpm2cpio cpio pkg-config readelf python3 "$cc_bin" "$cmake_bin" "$cpack_bin"; do
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
    tools) echo "$HPS_PKG_TOOLS" ;;
    python) echo "$HPS_PKG_PYTHON" ;; java) echo "$HPS_PKG_JAVA" ;;
    rust_sys) echo "$HPS_PKG_RUST_SYS_DEB" ;; rust) echo "$HPS_PKG_RUST_DEB" ;;
    *) fail "unknown component '$1'" ;;
  esac
}
rpm_name() {  # component -> RPM package name
  case "$1" in
    runtime) echo "$HPS_PKG_RUNTIME" ;; dev) echo "$HPS_PKG_DEV_RPM" ;;
    tools) echo "$HPS_PKG_TOOLS" ;;
    python) echo "$HPS_PKG_PYTHON" ;; java) echo "$HPS_PKG_JAVA" ;;
    rust_sys) echo "$HPS_PKG_RUST_SYS_RPM" ;; rust) echo "$HPS_PKG_RUST_RPM" ;;
    *) fail "unknown component '$1'" ;;
  esac
}
is_source_crate() { [[ "$1" == rust || "$1" == rust_sys ]]; }
deb_file() {
  local arch="$deb_arch"
  if is_source_crate "$1"; then arch=all; fi
  echo "$scratch/pkg-DEB/$(deb_name "$1")_${full_version}_${arch}.deb"
}
rpm_file() {
  local arch="$rpm_arch"
  if is_source_crate "$1"; then arch=noarch; fi
  echo "$scratch/pkg-RPM/$(rpm_name "$1")-${full_version}.${arch}.rpm"
}

# ---- 2. the expected package files, and nothing else -----------------------------------
read -r -a components <<<"$HPS_COMPONENTS"
for required in runtime dev tools; do
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
# Reproducible: the library names no path of the machine that built it (__FILE__ in its
# log lines, its debug information).
src_root="$(cd "$here/../.." && pwd)"
unpacked="$scratch/unpacked-runtime"
dpkg-deb -x "$(deb_file runtime)" "$unpacked"
lib="$(find "$unpacked" -name 'libhpshard.so.*.*' -type f | head -1)"
[[ -n "$lib" ]] || fail "$(basename "$(deb_file runtime)") holds no libhpshard.so.X.Y.Z"
if grep -qaF "$src_root/" "$lib"; then
  fail "$(basename "$lib") holds the build machine's source path $src_root/"
fi
runtime_deps="$(dpkg-deb -f "$(deb_file runtime)" Depends)"
[[ -n "$runtime_deps" ]] || fail "runtime package has no Depends (dpkg-shlibdeps did not run?)"
while read -r dep; do
  name="${dep%% *}"
  case "$name" in
    # libgloo0: the CPU communicator (Debian's Gloo); libssl3: HMAC for the TCP store's token
    libc6|libstdc++6|libgcc-s1|libgloo0|libssl3) ;;
    *) fail "runtime package depends on '$dep' (expected only libc6, libstdc++6, libgcc-s1, libgloo0, libssl3)" ;;
  esac
done < <(tr ',|' '\n' <<<"$runtime_deps" | sed 's/^ *//; /^$/d')
grep -qE "(^|, )$HPS_PKG_RUNTIME \(= $full_version\)" <<<"$(dpkg-deb -f "$(deb_file dev)" Depends)" \
  || fail "dev package does not depend on $HPS_PKG_RUNTIME (= $full_version)"
grep -qx "$HPS_PKG_RUNTIME = $full_version" <<<"$(rpm -qpR "$(rpm_file dev)" 2>/dev/null)" \
  || fail "dev rpm does not require $HPS_PKG_RUNTIME = $full_version"
# hpshard.h includes <dlpack/dlpack.h>.
grep -q "libdlpack-dev" <<<"$(dpkg-deb -f "$(deb_file dev)" Depends)" \
  || fail "dev package does not depend on libdlpack-dev"
grep -qx "dlpack-devel" <<<"$(rpm -qpR "$(rpm_file dev)" 2>/dev/null)" || fail "dev rpm does not require dlpack-devel"
grep -qE "(^|, )$HPS_PKG_RUNTIME \(= $full_version\)" <<<"$(dpkg-deb -f "$(deb_file tools)" Depends)" \
  || fail "tools package does not depend on $HPS_PKG_RUNTIME (= $full_version)"
# hpshard-bench's torch family and --plot need these (a clear message when they are absent;
# CPack 3.25 does not write RPM Suggests with Debian's rpmbuild).
for s in "$HPS_PKG_PYTHON" python3-torch python3-matplotlib; do
  grep -qE "(^|, )$s(,|$)" <<<"$(dpkg-deb -f "$(deb_file tools)" Suggests)" \
    || fail "tools package does not suggest $s"
done
# The RPM runtime refreshes the linker cache on install and removal.
scripts="$(rpm -qp --scripts "$(rpm_file runtime)" 2>/dev/null)"
for phase in postinstall postuninstall; do
  grep -q "/sbin/ldconfig" <<<"$(grep -A3 "^$phase scriptlet" <<<"$scripts")" \
    || fail "$(basename "$(rpm_file runtime)") has no $phase ldconfig scriptlet: $scripts"
done
# The Debian runtime refreshes the linker cache through the ldconfig trigger, not by hand.
ctl="$scratch/ctl-runtime"
dpkg-deb -e "$(deb_file runtime)" "$ctl"
grep -qx "activate-noawait ldconfig" "$ctl/triggers" 2>/dev/null \
  || fail "$(basename "$(deb_file runtime)") has no ldconfig trigger"
if grep -qs "ldconfig" "$ctl/postinst" "$ctl/postrm"; then
  fail "$(basename "$(deb_file runtime)")'s maintainer scripts call ldconfig (the trigger does)"
fi
# The JNI library lies where the linker does not look: the Java package calls no ldconfig.
if has_component java; then
  ctl="$scratch/ctl-java"
  dpkg-deb -e "$(deb_file java)" "$ctl"
  [[ -f "$ctl/postinst" && -f "$ctl/postrm" ]] || fail "$(basename "$(deb_file java)") lacks its own scripts"
  if grep -q "ldconfig" <<<"$(sed 's/#.*//' "$ctl/postinst" "$ctl/postrm")"; then
    fail "$(basename "$(deb_file java)")'s maintainer scripts call ldconfig"
  fi
fi
# The Debian python package byte-compiles on install and cleans up on removal.
if has_component python; then
  ctl="$scratch/ctl-python"
  dpkg-deb -e "$(deb_file python)" "$ctl"
  grep -q "compileall" "$ctl/postinst" || fail "python3-hpshard's postinst does not byte-compile"
  grep -q "__pycache__" "$ctl/prerm" || fail "python3-hpshard's prerm does not remove __pycache__"
  grep -q "__pycache__" "$ctl/postrm" || fail "python3-hpshard's postrm does not remove __pycache__"
  # hpshard.torch needs PyTorch.
  [[ "$(dpkg-deb -f "$(deb_file python)" Suggests)" == *python3-torch* ]] \
    || fail "python3-hpshard does not suggest python3-torch"
fi

# ---- 4. file lists, in both layouts --------------------------------------------------------
prefix="${HPS_INSTALL_PREFIX%/}"
rel() {  # install dir (relative to the prefix, or absolute) -> absolute path
  if [[ "$1" == /* ]]; then echo "$1"; else echo "$prefix/$1"; fi
}
incdir="$(rel "$HPS_INSTALL_INCLUDEDIR")"
deb_libdir="$(rel "$HPS_INSTALL_LIBDIR")"
rpm_libdir="$(rel "$HPS_RPM_LIBDIR")"
deb_pydir="$(rel "$HPS_INSTALL_PYTHONDIR")/hpshard"
rpm_pydir="$(rel "$HPS_RPM_PYTHONDIR")/hpshard"
registry="$prefix/share/cargo/registry"

deb_files() { dpkg-deb --fsys-tarfile "$1" | tar -tv | awk '$1 !~ /^d/ {print $6}' | sed 's|^\./|/|'; }
rpm_files() { rpm -qp --qf '[%{FILEMODES:perms} %{FILENAMES}\n]' "$1" 2>/dev/null | awk '$1 !~ /^d/ {print $2}' | grep -v '/\.build-id/'; }

# expected LAYOUT COMPONENT: the package's files, one per line (a trailing * matches any
# suffix: the Python extension's ABI tag, hpshard-bench which needs Gloo).
expected() {
  local layout="$1" c="$2" lib py jni
  if [[ "$layout" == deb ]]; then lib="$deb_libdir"; py="$deb_pydir"; jni="$deb_libdir/jni"
  else lib="$rpm_libdir"; py="$rpm_pydir"; jni="$rpm_libdir/hpshard"; fi
  # Every package carries the licence: Debian's copyright file (and changelog.Debian.gz),
  # the RPM's %license text.
  if [[ "$layout" == deb ]]; then
    printf '%s\n' "$prefix/share/doc/$(deb_name "$c")/copyright" \
      "$prefix/share/doc/$(deb_name "$c")/changelog.Debian.gz"
  else printf '%s\n' "$prefix/share/licenses/$(rpm_name "$c")/LICENSE"; fi
  case "$c" in
    runtime) printf '%s\n' "$lib/libhpshard.so.$HPS_VERSION_MAJOR" "$lib/libhpshard.so.$HPS_VERSION" ;;
    dev) printf '%s\n' "$incdir/hpshard/hpshard.h" "$incdir/hpshard/version.h" "$lib/libhpshard.so" \
           "$lib/pkgconfig/hpshard.pc" "$lib/cmake/hpshard/hpshardConfig.cmake" \
           "$lib/cmake/hpshard/hpshardConfigVersion.cmake" "$lib/cmake/hpshard/hpshardTargets.cmake" \
           "$lib/cmake/hpshard/hpshardTargets-*.cmake" ;;
    tools) printf '%s\n' "$prefix/bin/hpshard-run" "$prefix/bin/hpshard-bench*" "$prefix/bin/hpshard-ckpt*" "$prefix/bin/hpshard-trace*" \
             "$prefix/share/hpshard/bench/*.py" "$prefix/share/man/man1/hpshard-run.1.gz" \
             "$prefix/share/man/man1/hpshard-*.1.gz*"
      # The guides to the bench's figures and to the checkpoint format.
      local doc
      if [[ "$layout" == deb ]]; then doc="$prefix/share/doc/$(deb_name "$c")"
      else doc="$prefix/share/doc/$(rpm_name "$c")"; fi
      printf '%s\n' "$doc/benchmarks.md" "$doc/checkpoints.md" "$doc/img/coll.png" "$doc/img/clip.png" \
        "$doc/img/clip-avx512.png" "$doc/img/step.png" "$doc/img/scale.png" ;;
    python) printf '%s\n' "$py/__init__.py" "$py/__init__.pyi" "$py/_errors.py" "$py/capi.py" \
              "$py/py.typed" "$py/torch.py" "$py/_capi*.so"
      # The RPM ships the bytecode of each module, levels 0 and 1 (Fedora's way).
      if [[ "$layout" == rpm ]]; then
        local m
        for m in __init__ _errors capi torch; do
          printf '%s\n' "$py/__pycache__/$m.cpython-*.pyc"
        done
      fi ;;
    java) printf '%s\n' "$prefix/share/java/hpshard.jar" "$prefix/share/java/hpshard-$HPS_VERSION.jar" \
            "$jni/libhpshard_jni.so" ;;
    rust_sys) local d="$registry/hpshard-sys-$HPS_VERSION"
      printf '%s\n' "$d/Cargo.toml" "$d/.cargo-checksum.json" "$d/build.rs" "$d/src/lib.rs" \
        "$d/src/bindings.rs" ;;
    rust) local d="$registry/hpshard-$HPS_VERSION"
      printf '%s\n' "$d/Cargo.toml" "$d/.cargo-checksum.json" "$d/src/*.rs" ;;
  esac
}

# Every file of the package matches an expected entry, and every entry without * is there.
for layout in deb rpm; do
  for c in "${components[@]}"; do
    f="$(${layout}_file "$c")"
    mapfile -t have < <(${layout}_files "$f")
    mapfile -t want < <(expected "$layout" "$c")
    for file in "${have[@]}"; do
      ok=0
      for w in "${want[@]}"; do
        # shellcheck disable=SC2053  # the expected entry is a glob pattern
        if [[ "$file" == $w ]]; then ok=1; break; fi
      done
      [[ $ok == 1 ]] || fail "[$layout] $(basename "$f") holds unexpected $file (expected: ${want[*]})"
    done
    for w in "${want[@]}"; do
      [[ "$w" == *'*'* ]] && continue
      grep -qxF "$w" <<<"$(printf '%s\n' "${have[@]}")" || fail "[$layout] $(basename "$f") lacks $w; holds: ${have[*]}"
    done
  done
  log "[$layout] file lists OK (${components[*]})"
done

# The licence: one for every package, Apache-2.0 as the crates say; the Debian copyright
# file is machine-readable (DEP-5), the RPM's is its %license file and the full text.
license_text="$(cd "$here/../.." && pwd)/LICENSE"
for c in "${components[@]}"; do
  copyright="$(dpkg-deb --fsys-tarfile "$(deb_file "$c")" | tar -xO "./usr/share/doc/$(deb_name "$c")/copyright")"
  head -1 <<<"$copyright" | grep -q '^Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/' \
    || fail "[deb] $(deb_name "$c")'s copyright file is not machine-readable"
  grep -qx 'License: Apache-2.0' <<<"$copyright" || fail "[deb] $(deb_name "$c")'s copyright names no Apache-2.0"
  # changelog.Debian.gz (policy 12.7): this version first, gzip without a name or a time
  # stamp (gzip -9n), so that it is reproducible.
  changelog="$scratch/changelog-$c.gz"
  dpkg-deb --fsys-tarfile "$(deb_file "$c")" \
    | tar -xO "./usr/share/doc/$(deb_name "$c")/changelog.Debian.gz" >"$changelog"
  head -1 <(gzip -dc "$changelog") | grep -qx "hpshard ($full_version) unstable; urgency=medium" \
    || fail "[deb] $(deb_name "$c")'s changelog.Debian.gz starts '$(gzip -dc "$changelog" | head -1)'"
  [[ "$(od -An -tx1 -j3 -N5 "$changelog" | tr -d ' ')" == 0000000000 ]] \
    || fail "[deb] $(deb_name "$c")'s changelog.Debian.gz holds a name or a time stamp"
  [[ "$(rpm -qp --qf '%{LICENSE}' "$(rpm_file "$c")" 2>/dev/null)" == Apache-2.0 ]] \
    || fail "[rpm] $(rpm_name "$c")'s License is '$(rpm -qp --qf '%{LICENSE}' "$(rpm_file "$c")" 2>/dev/null)'"
  [[ "$(rpm -qpL "$(rpm_file "$c")" 2>/dev/null)" == "$prefix/share/licenses/$(rpm_name "$c")/LICENSE" ]] \
    || fail "[rpm] $(rpm_name "$c") marks no %license file: $(rpm -qpL "$(rpm_file "$c")" 2>&1)"
  (rpm2cpio "$(rpm_file "$c")" | cpio -i --quiet --to-stdout ".$prefix/share/licenses/$(rpm_name "$c")/LICENSE") \
    | cmp -s - "$license_text" || fail "[rpm] $(rpm_name "$c")'s LICENSE is not the tree's LICENSE"
done
log "licence: a DEP-5 copyright and a changelog in every .deb, Apache-2.0 and the LICENSE text in every .rpm"

# Every tool packaged has its manual page (from its --help), a page man reads.
for layout in deb rpm; do
  f="$(${layout}_file tools)"
  mapfile -t have < <(${layout}_files "$f")
  for file in "${have[@]}"; do
    [[ "$file" == "$prefix/bin/"* ]] || continue
    tool="$(basename "$file")"
    grep -qx "$prefix/share/man/man1/$tool.1.gz" <<<"$(printf '%s\n' "${have[@]}")" \
      || fail "[$layout] $(basename "$f") has $tool without its manual page"
  done
done
page="$scratch/hpshard-run.1.gz"
dpkg-deb --fsys-tarfile "$(deb_file tools)" | tar -xO "./usr/share/man/man1/hpshard-run.1.gz" >"$page"
grep -q '^\.TH HPSHARD-RUN 1 ' <<<"$(gzip -dc "$page" | head -1)" || fail "hpshard-run.1.gz is not a manual page"
grep -q -- '--nproc' <<<"$(gzip -dc "$page")" || fail "hpshard-run.1.gz does not hold its --help"
log "manual pages: one per packaged tool, from its --help"

# ---- 5. the RPMs unpacked into a root; the .debs installed into another -------------------
root_rpm="$scratch/root-rpm"
mkdir -p "$root_rpm"
for c in "${components[@]}"; do
  (cd "$root_rpm" && rpm2cpio "$(rpm_file "$c")" | cpio -idm --quiet)
done
# The RPM's bytecode is this interpreter's and current: an import (as root, writing
# allowed) leaves its __pycache__ as the package made it, so nothing outlives rpm -e.
if has_component python && [[ -x /usr/bin/python3 ]]; then
  cache="$root_rpm$rpm_pydir/__pycache__"
  for m in __init__ _errors capi torch; do
    for level in "" ".opt-1"; do
      compgen -G "$cache/$m.cpython-*$level.pyc" >/dev/null \
        || fail "[rpm/python] the package holds no $m.cpython-*$level.pyc"
    done
  done
  before="$(cd "$cache" && sha256sum -- * | sort)"
  out="$(cd "$scratch" && PYTHONPATH="$root_rpm$(dirname "$rpm_pydir")" \
         LD_LIBRARY_PATH="$root_rpm$rpm_libdir" /usr/bin/python3 -s -c \
         'import hpshard, hpshard.capi; print(hpshard.__file__)' 2>&1)" \
    || fail "[rpm/python] import hpshard failed: $out"
  after="$(cd "$cache" && sha256sum -- * | sort)"
  [[ "$before" == "$after" ]] || fail "[rpm/python] an import rewrote or added bytecode: $after"
  log "[rpm/python] the packaged bytecode serves the import ($(wc -l <<<"$after") files)"
fi

# dpkg --root installs into a scratch root with its own package database. The maintainer
# scripts run chrootless (the root holds no shell or Python), with DPKG_ROOT set to the
# root, which they honour; the root holds none of the dependencies (libc6, python3, ...),
# the host's serve, hence --force-depends.
root_deb="$scratch/root-deb"
admin="$root_deb/var/lib/dpkg"
mkdir -p "$admin/info" "$admin/updates" "$admin/triggers"
touch "$admin/status" "$admin/available"
dpkg_root() {
  dpkg --root="$root_deb" --force-script-chrootless --force-depends --force-not-root \
       --log="$scratch/dpkg.log" "$@"
}
deb_all=()
for c in "${components[@]}"; do deb_all+=("$(deb_file "$c")"); done
dpkg_root -i "${deb_all[@]}" >"$scratch/dpkg-install.log" 2>&1 \
  || { cat "$scratch/dpkg-install.log" >&2; fail "dpkg --root -i failed"; }
names=()
for c in "${components[@]}"; do names+=("$(deb_name "$c")"); done
for n in "${names[@]}"; do
  status="$(dpkg --root="$root_deb" -s "$n" 2>/dev/null | sed -n 's/^Status: //p')"
  [[ "$status" == "install ok installed" ]] || fail "[deb] $n is '$status' after dpkg -i"
done
log "[deb] installed into $root_deb: ${names[*]}"

# ---- 6. in each root: the library, then the outside C program twice -----------------------
consumer_src="$here/consumer"
gen_args=()
if [[ -n "$generator" ]]; then gen_args=(-G "$generator"); fi

check_root() {
  local kind="$1" root="$2" libdir="$3" pydir="$4"
  local rlib="$root$libdir" work="$scratch/consumer-$kind"
  local so_major="$libdir/libhpshard.so.$HPS_VERSION_MAJOR" so_full="$libdir/libhpshard.so.$HPS_VERSION"
  mkdir -p "$work"
  log "[$kind] root $root"

  [[ -f "$root$so_full" && -L "$root$so_major" ]] || fail "[$kind] $so_full / $so_major not there"
  local needed
  needed="$(readelf -d "$root$so_full" | awk '/NEEDED/ {print $NF}' | tr -d '[]' | tr '\n' ' ')"
  log "[$kind] libhpshard NEEDED: $needed"
  if grep -qiE "$forbidden|libcu" <<<"$needed"; then fail "[$kind] libhpshard.so needs a CUDA library: $needed"; fi
  grep -q "SONAME.*\[libhpshard.so.$HPS_VERSION_MAJOR\]" <<<"$(readelf -d "$root$so_full")" \
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

  # (b) CMake find_package(hpshard 0.1 REQUIRED), linking hpshard::hpshard. A Fedora
  # CMake searches lib64 (FIND_LIBRARY_USE_LIB64_PATHS); Debian's does not unless told.
  local lib64_args=()
  if [[ "$libdir" == */lib64 ]]; then
    echo 'set_property(GLOBAL PROPERTY FIND_LIBRARY_USE_LIB64_PATHS TRUE)' >"$work/lib64.cmake"
    lib64_args=(-DCMAKE_PROJECT_INCLUDE="$work/lib64.cmake")
  fi
  if ! "$cmake_bin" -S "$consumer_src" -B "$work/cmake-build" "${gen_args[@]}" \
        -DCMAKE_BUILD_TYPE=Release -DCMAKE_C_COMPILER="$cc_bin" \
        -DCMAKE_PREFIX_PATH="$root$prefix" "${lib64_args[@]}" \
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
    local py=/usr/bin/python3 site="$root$(dirname "$pydir")" out
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

check_root deb "$root_deb" "$deb_libdir" "$deb_pydir"
check_root rpm "$root_rpm" "$rpm_libdir" "$rpm_pydir"

# ---- 7. every language from the installed .deb files only -----------------------------------
rlib="$root_deb$deb_libdir"
work="$scratch/languages"
mkdir -p "$work"
export LD_LIBRARY_PATH="$rlib"

# Python: byte-compiled by the postinst (as root, once), then used.
if has_component python; then
  pyc="$(find "$root_deb$deb_pydir/__pycache__" -name '__init__.*.pyc' 2>/dev/null | head -n 1)"
  [[ -n "$pyc" ]] || fail "[deb/python] the postinst did not byte-compile $deb_pydir"
  out="$(cd "$work" && PYTHONPATH="$root_deb$(dirname "$deb_pydir")" /usr/bin/python3 -s \
         "$consumer_src/consumer.py" 2>&1)" || fail "[deb/python] the consumer failed: $out"
  [[ "$out" == *"from $root_deb$deb_pydir/__init__.py"* ]] || fail "[deb/python] hpshard came from elsewhere: $out"
  log "[deb/python] $out (byte-compiled: $(basename "$pyc"))"
  # A byte-compiled file of another interpreter, as an import by root would leave: the
  # removal must take it too.
  touch "$root_deb$deb_pydir/__pycache__/capi.cpython-399.pyc"
fi

# Java: the installed jar, the JNI library from its installed directory.
if has_component java; then
  command -v javac >/dev/null 2>&1 && command -v java >/dev/null 2>&1 \
    || fail "[deb/java] no javac/java (tools/setup.sh installs a JDK)"
  jar="$root_deb$prefix/share/java/hpshard.jar"
  javac -d "$work/java" -cp "$jar" "$consumer_src/java/Consumer.java" \
    || fail "[deb/java] compiling the consumer against $jar failed"
  out="$(java -Djava.library.path="$root_deb$deb_libdir/jni" -cp "$jar:$work/java" Consumer 2>&1)" \
    || fail "[deb/java] the consumer failed: $out"
  log "[deb/java] $out"
fi

# Rust: an offline cargo build of the consumer from the installed crates, the way Debian
# builds Rust: crates.io replaced by the installed registry directory.
if has_component rust; then
  cargo_bin="$(command -v cargo || echo "$HOME/.cargo/bin/cargo")"
  [[ -x "$cargo_bin" ]] || fail "[deb/rust] no cargo"
  rust_src="$work/rust"
  cp -r "$consumer_src/rust" "$rust_src"
  mkdir -p "$rust_src/.cargo"
  printf '[source.crates-io]\nreplace-with = "installed"\n[source.installed]\ndirectory = "%s"\n' \
    "$root_deb$registry" >"$rust_src/.cargo/config.toml"
  if ! (cd "$rust_src" && HPSHARD_LIB_DIR="$rlib" CARGO_TARGET_DIR="$rust_src/target" \
        "$cargo_bin" build --offline --quiet) >"$work/cargo.log" 2>&1; then
    cat "$work/cargo.log" >&2
    fail "[deb/rust] cargo build --offline of the consumer from the installed crates failed"
  fi
  out="$("$rust_src/target/debug/hpshard-package-consumer" 2>&1)" || fail "[deb/rust] the consumer failed: $out"
  log "[deb/rust] $out"
fi

# The tools.
out="$("$root_deb$prefix/bin/hpshard-run" -n 2 -- /bin/sh -c 'echo rank $HPS_RANK of $HPS_WORLD_SIZE' 2>&1)" \
  || fail "[deb/tools] hpshard-run failed: $out"
[[ "$out" == *"rank 1 of 2"* ]] || fail "[deb/tools] hpshard-run printed: $out"
log "[deb/tools] hpshard-run OK"
for tool in hpshard-run hpshard-ckpt hpshard-trace hpshard-bench; do
  [[ -x "$root_deb$prefix/bin/$tool" ]] || continue
  out="$("$root_deb$prefix/bin/$tool" --version 2>&1)" || fail "[deb/tools] $tool --version failed: $out"
  [[ "$out" == "$tool $HPS_VERSION" ]] || fail "[deb/tools] $tool --version printed: $out"
done
log "[deb/tools] every tool's --version is $HPS_VERSION"
# An installed hpshard-bench runs its installed scripts (the build machine's sources are
# not there): torch_peer.py's own argument parser answers.
if [[ -x "$root_deb$prefix/bin/hpshard-bench" ]]; then
  # (PYTHONDONTWRITEBYTECODE unset: whether bytecode is written is the bench's choice.)
  out="$(env -u PYTHONDONTWRITEBYTECODE "$root_deb$prefix/bin/hpshard-bench" torch --no-such-option 2>&1)" || true
  [[ "$out" == *"usage: torch_peer.py"* && "$out" == *"--no-such-option"* ]] \
    || fail "[deb/tools] the installed hpshard-bench did not run its installed torch_peer.py: $out"
  [[ -f "$root_deb$prefix/share/hpshard/bench/gpt.py" ]] || fail "[deb/tools] no gpt.py for hpshard-bench torch"
  # torch_peer.py imported torch_ranks.py: no byte-compiled file of it beside the scripts.
  [[ ! -e "$root_deb$prefix/share/hpshard/bench/__pycache__" ]] \
    || fail "[deb/tools] hpshard-bench wrote $prefix/share/hpshard/bench/__pycache__"
  log "[deb/tools] hpshard-bench finds its installed scripts and writes no bytecode there"
  # A user's own run of them as root writes one: the removal must take it.
  mkdir "$root_deb$prefix/share/hpshard/bench/__pycache__"
  touch "$root_deb$prefix/share/hpshard/bench/__pycache__/gpt.cpython-311.pyc"
fi
unset LD_LIBRARY_PATH

# ---- 8. purge: nothing may be left behind --------------------------------------------------
dpkg_root --purge "${names[@]}" >"$scratch/dpkg-purge.log" 2>&1 \
  || { cat "$scratch/dpkg-purge.log" >&2; fail "dpkg --root --purge failed"; }
left="$(cd "$root_deb" && find . -mindepth 1 -not -path './var/lib/dpkg*' -not -path './var/lib' \
          -not -path './var' | sort)"
[[ -z "$left" ]] || fail "[deb] left behind after purge: $(tr '\n' ' ' <<<"$left")"
log "[deb] purged: nothing left in $root_deb"

log "PASS in $((SECONDS - start)) s: ${components[*]} as .deb and .rpm"
