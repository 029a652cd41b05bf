#!/bin/sh
# Inside the VM: N "nodes" as the network namespaces n1..nN, each joined by a veth pair to one
# bridge in the root namespace, with an rxe device on its own end; etcd runs in the root
# namespace on the bridge's address, so every node reaches it and every other node on one subnet:
#
#   root: br0 10.77.3.254/24 (etcd, client port 2379), ports bn1..bnN
#   node I (netns nI): vnI 10.77.3.I/24, rxe_nI   <-veth->  bnI
#
# Needs a kernel whose rxe follows network namespaces (7.x) and the bridge module. The RDMA
# subsystem shares every device with every namespace (as two-nodes.sh's default); rdma_cm picks
# each node's own from the route in its namespace.
# Usage: n-nodes.sh N BIN [RUNS [TTL_MS]]  -> sets the nodes up, then runs BIN
# (tests/membership_nodes.rs: it starts etcd and one process per node) with the topology in its
# environment, RUNS bench rounds (default 7) and a lease TTL of TTL_MS (default 2000); exits with
# BIN's status (1 when the setup failed).
IP=/usr/sbin/ip      # iproute2: busybox's ip applet has no netns support
set -u
N=${1:-}; BIN=${2:-}; RUNS=${3:-7}; TTL_MS=${4:-2000}
fail() { echo "N-NODES: $*"; exit 1; }
case $N in [3-9]) ;; *) fail "usage: n-nodes.sh N BIN (N from 3 to 9)";; esac
[ -x "/usr/bin/$BIN" ] || fail "no binary $BIN"
[ -x /usr/bin/etcd ] || fail "no etcd in the VM"
[ -d /sys/module/veth ] || fail "the veth module is not loaded"
[ -d /sys/module/bridge ] || fail "the bridge module is not loaded"
t0=$(cut -d' ' -f1 /proc/uptime)
mkdir -p /run/netns
$IP link add br0 mtu 9000 type bridge forward_delay 0 stp_state 0 || fail "ip link add br0"
$IP addr add 10.77.3.254/24 dev br0 && $IP link set br0 up || fail "br0 up"
nodes=
for i in $(seq 1 "$N"); do
  $IP netns add n$i || fail "ip netns add n$i"
  $IP -n n$i link set lo up
  $IP link add bn$i mtu 9000 type veth peer name vn$i netns n$i mtu 9000 || fail "veth pair $i"
  $IP link set bn$i master br0 && $IP link set bn$i up || fail "bn$i on br0"
  $IP -n n$i addr add 10.77.3.$i/24 dev vn$i && $IP -n n$i link set vn$i up || fail "vn$i up"
  # Created in the root RDMA namespace whatever the caller's; the netdev is looked up in the
  # caller's network namespace (hence ip netns exec).
  $IP netns exec n$i rdma link add rxe_n$i type rxe netdev vn$i || fail "rdma link add rxe_n$i"
  nodes="$nodes n$i:rxe_n$i:10.77.3.$i"
done
# Every node reaches etcd's address and node 1 (which fills the neighbour tables), and each rxe
# device has its IPv4 GID.
for i in $(seq 1 "$N"); do
  $IP netns exec n$i ping -c 1 -W 5 10.77.3.254 >/dev/null || fail "node $i does not reach 10.77.3.254"
  [ $i = 1 ] || $IP netns exec n$i ping -c 1 -W 5 10.77.3.1 >/dev/null || fail "node $i does not reach node 1"
  gid=$(printf ':0a4d:03%02x' $i); ok=
  for k in 1 2 3 4 5 6 7 8 9 10; do
    grep -qs "$gid" /sys/class/infiniband/rxe_n$i/ports/1/gids/* && { ok=1; break; }
    sleep 0.5
  done
  [ -n "$ok" ] || fail "rxe_n$i has no IPv4 GID for 10.77.3.$i"
done
echo "N-NODES: $N nodes up in $(awk -v a=$t0 -v b=$(cut -d' ' -f1 /proc/uptime) 'BEGIN{printf "%.1f", b-a}')s:$nodes; etcd on 10.77.3.254:2379"
export GPUDIRECT_TEST_NODES="${nodes# }" GPUDIRECT_TEST_ETCD_BIN=/usr/bin/etcd \
  GPUDIRECT_TEST_ETCD_ADDR=10.77.3.254 GPUDIRECT_TEST_NETNS_EXEC="$IP netns exec" \
  GPUDIRECT_TEST_BENCH_RUNS=$RUNS GPUDIRECT_TEST_TTL_MS=$TTL_MS
# Each node's process bounds its own waits; this bounds the whole.
timeout 1200 /usr/bin/$BIN --exact n_nodes --nocapture --test-threads=1
rc=$?
# What the nodes' devices sent (each node's share of the traffic).
for i in $(seq 1 "$N"); do
  printf 'rxe_n%s=%s ' $i "$(rdma statistic show link rxe_n$i/1 2>/dev/null | sed -n 's/.* sent_bytes \([0-9]*\).*/\1/p')"
done | sed 's/^/N-NODES: bytes sent: /'; echo
exit $rc
