#!/bin/sh
# Inside the VM: two "nodes" as the network namespaces a and b, joined by two veth pairs (two
# rails), one rxe device on each end:
#
#   rail 0: a: va0 10.77.1.1/24 rxe_a0  <-veth->  b: vb0 10.77.1.2/24 rxe_b0
#   rail 1: a: va1 10.77.2.1/24 rxe_a1  <-veth->  b: vb1 10.77.2.2/24 rxe_b1
#
# Needs a kernel whose rxe follows network namespaces (7.x; on 6.12 its UDP socket lives in the
# root namespace only and RDMA traffic between namespaces times out).
# RDMA netns mode: NETNS=shared (default) keeps every rxe device visible in every namespace; rdma_cm
# picks the device from the route in the caller's namespace. NETNS=exclusive moves each device into
# its node's namespace (rdma dev set ... netns), so each node lists only its own; on 7.3 rxe then
# cannot recreate its QP1 (the kernel logs "Couldn't create ib_mad QP1") and rdma_cm connections
# fail with EINVAL, while verbs-only traffic (perftest without -R) still works.
# Usage: two-nodes.sh up   -> prints the topology, exit status 0 when both rails carry IP traffic.
IP=/usr/sbin/ip      # iproute2: busybox's ip applet has no netns support
NETNS=${NETNS:-shared}
set -u
fail() { echo "TWO-NODES: $*"; exit 1; }
[ "${1:-}" = up ] || fail "usage: two-nodes.sh up"
[ -d /sys/module/veth ] || fail "the veth module is not loaded"
case $NETNS in
  shared) ;;
  exclusive) rdma system set netns exclusive || fail "rdma system set netns exclusive failed";;
  *) fail "NETNS must be shared or exclusive";;
esac
mkdir -p /run/netns
$IP netns add a || fail "ip netns add a"
$IP netns add b || fail "ip netns add b"
for n in a b; do $IP -n $n link set lo up; done
for r in 0 1; do
  $IP link add va$r netns a mtu 9000 type veth peer name vb$r netns b mtu 9000 || fail "veth pair $r"
  $IP -n a addr add 10.77.$((r + 1)).1/24 dev va$r && $IP -n b addr add 10.77.$((r + 1)).2/24 dev vb$r \
    || fail "addresses on rail $r"
  $IP -n a link set va$r up && $IP -n b link set vb$r up || fail "links up on rail $r"
  # The device is created in the root RDMA namespace whatever the caller's network namespace; the
  # netdev is looked up in the caller's (hence ip netns exec).
  $IP netns exec a rdma link add rxe_a$r type rxe netdev va$r || fail "rdma link add rxe_a$r"
  $IP netns exec b rdma link add rxe_b$r type rxe netdev vb$r || fail "rdma link add rxe_b$r"
done
if [ "$NETNS" = exclusive ]; then
  for d in rxe_a0 rxe_a1; do rdma dev set $d netns a || fail "rdma dev set $d netns a"; done
  for d in rxe_b0 rxe_b1; do rdma dev set $d netns b || fail "rdma dev set $d netns b"; done
fi
# Both rails up: one ping each way (also fills the neighbour tables), and an IPv4 GID on each device.
for r in 0 1; do
  $IP netns exec a ping -c 1 -W 5 10.77.$((r + 1)).2 >/dev/null || fail "no IP traffic on rail $r"
done
for n in a b; do
  for r in 0 1; do
    ok=; for i in 1 2 3 4 5 6 7 8 9 10; do
      $IP netns exec $n sh -c "grep -qs ':0a4d:0$((r + 1))0' /sys/class/infiniband/rxe_$n$r/ports/1/gids/*" && { ok=1; break; }
      sleep 0.5
    done
    [ -n "$ok" ] || fail "rxe_$n$r has no IPv4 GID for 10.77.$((r + 1)).0/24"
  done
done
echo "TWO-NODES: netns mode $(rdma system show | sed -n 's/.*netns \([a-z]*\).*/\1/p') (asked: $NETNS)"
for n in a b; do
  echo "TWO-NODES: node $n: $($IP -n $n -4 -o addr show | awk '$2!="lo"{printf "%s %s  ", $2, $4}')"
  echo "TWO-NODES: node $n sees: $($IP netns exec $n rdma link show | awk '{printf "%s%s ", $2, ($NF ~ /^v[ab][01]$/ ? "("$NF")" : "")}')"
done
exit 0
