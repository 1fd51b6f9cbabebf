#!/usr/bin/env bash
# Runs the disk-full checkpoint tests (disk_full_test.cc) on a 256 KiB tmpfs of 512 inodes, mounted in a private mount
# namespace of an unprivileged user namespace (unshare -rm), so nothing outside sees it.
# Exit 77 (skipped) where the kernel or the container refuses the namespace or the mount.
set -uo pipefail
test_binary="$1"
mnt="$(mktemp -d)"
trap 'rmdir "$mnt" 2>/dev/null' EXIT
if ! unshare -rm true 2>/dev/null; then
  echo "skipped: unshare -rm is not allowed here"
  exit 77
fi
output="$(unshare -rm bash -c '
  mount -t tmpfs -o size=256k,nr_inodes=512 tmpfs "$1" || { echo "skipped: cannot mount a tmpfs"; exit 77; }
  HPS_CKPT_TEST_SMALL_FS="$1" "$2"
' bash "$mnt" "$test_binary" 2>&1)"
rc=$?
echo "$output"
[ $rc -ne 0 ] && exit $rc
# Skipped only where the build has no CPU communicators (no Gloo); otherwise it must run.
grep -q '^\[  SKIPPED \] 2 tests' <<<"$output" && exit 77
grep -q '^\[  PASSED  \] 2 tests' <<<"$output" || { echo "the disk-full cases did not run"; exit 1; }
