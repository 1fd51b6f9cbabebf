#!/usr/bin/env bash
# Two "hosts": network namespaces joined by a veth pair (10.231.0.1/24 and 10.231.0.2/24).
# Rank 0 serves the TCP store on 10.231.0.1 in one, rank 1 connects from the other; both run
# rank_probe directly with the HPS_* variables set here. Rank 1 starts first: its connect
# must retry until rank 0 listens. Exits 77 (skipped) when namespaces cannot be made.
# usage: two_hosts_test.sh RANK_PROBE
set -uo pipefail
probe=$1
skip() {
  echo "SKIPPED: $*"
  exit 77
}
[ "$EUID" -eq 0 ] || skip "needs root to create network namespaces (running as uid $EUID)"
command -v ip >/dev/null || skip "ip (iproute2) is not installed: apt-get install -y iproute2"

# Names unique to this run (interface names are at most 15 characters).
tag=$$
ns0=hps-host0-$tag
ns1=hps-host1-$tag
veth0=hpsv0-$tag
veth1=hpsv1-$tag
work=$(mktemp -d)
pids=()
cleanup() {
  for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null; done
  # Deleting a namespace deletes its end of the veth pair, and with it the other end.
  ip netns del "$ns0" 2>/dev/null
  ip netns del "$ns1" 2>/dev/null
  ip link del "$veth0" 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
trap 'exit 1' INT TERM

ip netns add "$ns0" 2>"$work/ip.err" || skip "ip netns add failed: $(cat "$work/ip.err")"
ip netns add "$ns1" 2>"$work/ip.err" || skip "ip netns add failed: $(cat "$work/ip.err")"
ip link add "$veth0" type veth peer name "$veth1" 2>"$work/ip.err" ||
  skip "cannot create a veth pair: $(cat "$work/ip.err")"
ip netns exec "$ns0" true 2>"$work/ip.err" || skip "ip netns exec failed: $(cat "$work/ip.err")"
set -e
ip link set "$veth0" netns "$ns0"
ip link set "$veth1" netns "$ns1"
ip -n "$ns0" addr add 10.231.0.1/24 dev "$veth0"
ip -n "$ns1" addr add 10.231.0.2/24 dev "$veth1"
for ns in "$ns0" "$ns1"; do ip -n "$ns" link set lo up; done
ip -n "$ns0" link set "$veth0" up
ip -n "$ns1" link set "$veth1" up
set +e

store=tcp://10.231.0.1:29531
HPS_RANK=1 HPS_WORLD_SIZE=2 HPS_LOCAL_RANK=0 HPS_STORE=$store \
  timeout 60 ip netns exec "$ns1" "$probe" meet >"$work/out1" 2>"$work/err1" &
pids+=($!)
sleep 0.5
HPS_RANK=0 HPS_WORLD_SIZE=2 HPS_LOCAL_RANK=0 HPS_STORE=$store \
  timeout 60 ip netns exec "$ns0" "$probe" meet >"$work/out0" 2>"$work/err0" &
pids+=($!)
wait "${pids[0]}"
rc1=$?
wait "${pids[1]}"
rc0=$?
pids=()
for r in 0 1; do
  echo "--- rank $r stdout"
  cat "$work/out$r"
  echo "--- rank $r stderr"
  cat "$work/err$r"
done
[ $rc0 -eq 0 ] || { echo "FAIL: rank 0 exited $rc0"; exit 1; }
[ $rc1 -eq 0 ] || { echo "FAIL: rank 1 exited $rc1"; exit 1; }
grep -qxF "rank 0 of 2 met every rank" "$work/out0" || { echo "FAIL: rank 0 did not meet"; exit 1; }
grep -qxF "rank 1 of 2 met every rank" "$work/out1" || { echo "FAIL: rank 1 did not meet"; exit 1; }
echo "PASS: ranks in $ns0 (10.231.0.1) and $ns1 (10.231.0.2) met over TCP"
