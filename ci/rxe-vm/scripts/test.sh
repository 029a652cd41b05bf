#!/bin/sh
# Inside the VM: run what /etc/gpudirect-tests lists, one entry a line:
#   test NAME | example NAME | bench NAME   a project binary on rxe0, with GPUDIRECT_REQUIRE=rdma
#   bench-loopback RUNS [SIZES...]   perftest baselines beside rdma_pingpong, on rxe0
#   pair LABEL [NAME=VALUE...] BIN SERVER-ARGS... -- CLIENT-ARGS...   BIN as two nodes
#                      (namespaces b and a), with those environment variables on both sides
#   bench-pair RUNS [PARTS]  between the two nodes: pingpong (ib_write_bw and rdma_pingpong on
#                      both rails), transfer (the transfer engine beside perftest; connect
#                      time with the key and without), mooncake (Mooncake's bench beside both),
#                      RUNS rounds a cell (default: pingpong transfer)
#   nodes N BIN [RUNS [TTL_MS]]   BIN as the conductor of N nodes with etcd (n-nodes.sh)
# Prints "RXE-RESULT name PASS|FAIL", "RXE-BENCH ..." lines and finally "N passed, N failed".
export GPUDIRECT_REQUIRE=rdma RUST_BACKTRACE=1
IP=/usr/sbin/ip      # iproute2 by full path: busybox's ip applet would shadow it
pass=0; fail=0
result() { if [ "$2" = 0 ]; then echo "RXE-RESULT $1 PASS"; pass=$((pass+1)); else echo "RXE-RESULT $1 FAIL (exit $2)"; fail=$((fail+1)); fi; }
now() { cut -d' ' -f1 /proc/uptime; }
# The transfer engine's key for the entries and benches that use one (owner-only, as it must be).
head -c 32 /dev/urandom > /tmp/transfer.key && chmod 600 /tmp/transfer.key
for g in 0 1 2 3; do
  f=/sys/class/infiniband/rxe0/ports/1/gids/$g; [ -r $f ] && echo "GID[$g] $(cat $f) $(cat /sys/class/infiniband/rxe0/ports/1/gid_attrs/types/$g 2>/dev/null)"
done

# --- two nodes (see two-nodes.sh): set up on the first pair entry
nodes=    # "" not yet, "up", "broken"
nodes_up() {
  [ -z "$nodes" ] || { [ "$nodes" = up ]; return; }
  t=$(now)
  if NETNS=$(cat /etc/gpudirect-netns 2>/dev/null || echo shared) /two-nodes.sh up; then nodes=up; else nodes=broken; fi
  echo "TWO-NODES: setup $nodes in $(awk -v a=$t -v b=$(now) 'BEGIN{printf "%.1f", b-a}')s"
  [ "$nodes" = up ]
}
# node_env NODE ROLE PORT: what a test binary learns about the topology (README: "Two nodes").
node_env() {
  if [ $1 = a ]; then me=a; peer=b; mine=1; theirs=2; else me=b; peer=a; mine=2; theirs=1; fi
  export GPUDIRECT_TEST_NODE=$me GPUDIRECT_TEST_ROLE=$2 GPUDIRECT_TEST_PORT=$3 \
    GPUDIRECT_TEST_RAILS=rxe_${me}0,rxe_${me}1 GPUDIRECT_TEST_ADDRS=10.77.1.$mine,10.77.2.$mine \
    GPUDIRECT_TEST_PEER=10.77.1.$theirs GPUDIRECT_TEST_PEER_ADDRS=10.77.1.$theirs,10.77.2.$theirs \
    GPUDIRECT_TEST_PEER_RAILS=rxe_${peer}0,rxe_${peer}1
}
# subst NODE ROLE PORT ARGS...: the @NAME@ placeholders of a pair entry, for one side.
subst() {
  (node_env $1 $2 $3; shift 3
   echo "$*" | sed -e "s/@PORT@/$GPUDIRECT_TEST_PORT/g" -e "s/@PEER@/$GPUDIRECT_TEST_PEER/g" \
     -e "s/@PEER0@/10.77.1.$theirs/g" -e "s/@PEER1@/10.77.2.$theirs/g" \
     -e "s/@ADDR0@/10.77.1.$mine/g" -e "s/@ADDR1@/10.77.2.$mine/g" \
     -e "s/@DEV0@/rxe_${me}0/g" -e "s/@DEV1@/rxe_${me}1/g" \
     -e "s/@PEER_DEV0@/rxe_${peer}0/g" -e "s/@PEER_DEV1@/rxe_${peer}1/g")
}
# Bytes each rxe device of the two nodes has sent so far: "rxe_a0=N rxe_a1=N rxe_b0=N rxe_b1=N".
sent_bytes() {
  for d in rxe_a0 rxe_a1 rxe_b0 rxe_b1; do
    n=${d#rxe_}; n=${n%?}   # asked in the device's own namespace (exclusive mode hides it elsewhere)
    printf '%s=%s ' $d "$($IP netns exec $n rdma statistic show link $d/1 2>/dev/null | sed -n 's/.* sent_bytes \([0-9]*\).*/\1/p')"
  done
}
traffic() {  # traffic BEFORE AFTER: per-device difference
  for kv in $2; do
    d=${kv%%=*}; b=$(echo "$1" | tr ' ' '\n' | sed -n "s/^$d=//p")
    printf '%s=+%s ' $d $(( ${kv#*=} - ${b:-0} ))
  done
}
# wait_listen NS PORT PID: until a listener on PORT exists (an rdma_cm ID or a TCP socket in NS),
# the process PID died, or 60 s passed.
wait_listen() {
  hex=$(printf ':%04X ' $2)
  for i in $(seq 1 120); do
    kill -0 $3 2>/dev/null || return 1
    $IP netns exec $1 rdma resource show cm_id 2>/dev/null | grep 'LISTEN' | grep -q ":$2 " && return 0
    $IP netns exec $1 cat /proc/net/tcp /proc/net/tcp6 2>/dev/null | awk -v p="$hex" '$4=="0A" && index($2" ", p)' | grep -q . && return 0
    sleep 0.5
  done
  return 0
}
pairs=0
# run_pair LABEL BIN ARGS: the server side in namespace b, then the client side in namespace a;
# both must exit 0. Each side is bounded by 300 s (GPUDIRECT_PAIR_TIMEOUT=S among the entry's
# NAME=VALUE words: S); the server gets 60 s after the client.
run_pair() {
  label=$1; shift
  penv=
  while case $1 in *=*) true;; *) false;; esac; do penv="$penv $1"; shift; done
  bin=$1; shift
  sargs=; cargs=; side=s
  for w in "$@"; do
    if [ "$side" = s ] && [ "$w" = -- ]; then side=c; continue; fi
    if [ $side = s ]; then sargs="$sargs $w"; else cargs="$cargs $w"; fi
  done
  pairs=$((pairs + 1)); port=$((7400 + pairs))
  nodes_up || { echo "the two nodes could not be set up"; return 1; }
  [ -x /usr/bin/$bin ] || { echo "no binary $bin"; return 1; }
  t=$(now); before=$(sent_bytes)
  sa=$(subst b server $port $sargs); ca=$(subst a client $port $cargs)
  echo "[b] $bin $sa"
  [ -n "$penv" ] && echo "[env]$penv"
  (node_env b server $port; [ -z "$penv" ] || export $penv; exec $IP netns exec b timeout ${GPUDIRECT_PAIR_TIMEOUT:-300} /usr/bin/$bin $sa) > /tmp/pair-b.log 2>&1 &
  spid=$!
  wait_listen b $port $spid
  echo "[a] $bin $ca"
  rm -f /tmp/pair-a.rc
  (node_env a client $port; [ -z "$penv" ] || export $penv; $IP netns exec a timeout ${GPUDIRECT_PAIR_TIMEOUT:-300} /usr/bin/$bin $ca; echo $? > /tmp/pair-a.rc) 2>&1 | sed 's/^/[a] /'
  crc=$(cat /tmp/pair-a.rc 2>/dev/null || echo 1)
  ( sleep 60; kill $spid 2>/dev/null ) & wd=$!
  wait $spid; src=$?
  kill $wd 2>/dev/null; wait $wd 2>/dev/null
  sed 's/^/[b] /' /tmp/pair-b.log
  echo "RXE-PAIR $label traffic $(traffic "$before" "$(sent_bytes)")time=$(awk -v a=$t -v b=$(now) 'BEGIN{printf "%.1f", b-a}')s client=$crc server=$src"
  [ "$crc" = 0 ] && [ "$src" = 0 ]
}
best() { awk -v a="$1" -v b="$2" -v m="$3" 'BEGIN{ if (a=="") {print b; exit} if (b=="") {print a; exit} if ((m=="max") == (a+0 > b+0)) print a; else print b }'; }
ours_get() { awk -v t=$1 -v s=$2 '$1=="REPORT" && $2==t && $3=="size="s {split($5,a,"="); print a[2]; exit}' /tmp/one.log; }

# --- the library's own figures beside perftest baselines, loopback on rxe0
#
# Per size, the runs go in a chain of slots, a perftest run between every two others:
#   P ours P placebo P [base1 P ...] ours P placebo P ...
# (the order of the others rotating round by round). The placebo is perftest again, in the place
# ours takes: perftest against itself. Each run of ours, the placebo or a base is compared with
# the mean of the two perftest runs beside it, so that a change of the shared host's load between
# rounds falls on both sides. A cell's ratio is the median of ours' paired ratios; perftest's own
# spread is the placebo's paired ratios (median [min-max]). Both are "above 1 is faster" (MB/s,
# or perftest's usec over ours for latency).

# stats "V1 V2 ..." -> "median min max n" of the finite positive numbers among them.
stats() {
  echo "$1" | awk '{ n = 0
    for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$/ && $i + 0 > 0) v[++n] = $i + 0
    if (!n) { print "? ? ? 0"; exit }
    for (i = 2; i <= n; i++) { x = v[i]; j = i - 1; while (j > 0 && v[j] > x) { v[j + 1] = v[j]; j-- } v[j + 1] = x }
    m = (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
    print m, v[1], v[n], n }'
}
# paired V BEFORE AFTER UNIT -> V against the mean of the perftest runs beside it ("" when a
# figure is missing); MBps: V/mean, usec: mean/V. (The guest's awk has no sqrt.)
paired() {
  awk -v v="$1" -v a="$2" -v b="$3" -v u="$4" 'BEGIN {
    if (v + 0 <= 0 || a + 0 <= 0 || b + 0 <= 0 || v !~ /^[0-9.]+$/ || a !~ /^[0-9.]+$/ || b !~ /^[0-9.]+$/) exit
    g = (a + b) / 2; printf "%.4f", (u == "MBps") ? v / g : g / v }'
}
# cell NAME SIZE UNIT OP: one RXE-BENCH line from the lists V_<who>_OP (figures) and R_<who>_OP
# (paired ratios), who = perftest, ours, placebo, base1.., OP = w, r or l.
# Verdict: "ok" at a ratio of 0.95 or more; below, "FINDING" when the ratio is also below every
# paired ratio of the placebo (outside perftest's spread against itself) over at least 7 pairs
# each (for two equal programs, about a 4% chance), "below perftest's spread" with fewer pairs (a
# hint: rerun with BENCH_RUNS=7 to decide), else "within noise".
cell() {
  op=$4
  eval "p=\$V_perftest_$op o=\$V_ours_$op ro=\$R_ours_$op rq=\$R_placebo_$op"
  echo "RXE-RUNS $1 size=$2 $3 perftest:$p ours:$o ours_ratios:$ro placebo_ratios:$rq"
  extra=
  for bn in $bases; do
    eval "b=\$V_${bn}_$op rb=\$R_${bn}_$op"
    echo "RXE-RUNS $1 size=$2 $3 $bn:$b ${bn}_ratios:$rb"
    extra="$extra $(awk -v bn=$bn -v u=$3 -v b="$(stats "$b")" -v rb="$(stats "$rb")" 'BEGIN {
      split(b, B, " "); split(rb, R, " ")
      if (R[4] > 0) printf "%s_%s=%.2f %s_ratio=%.2f [%.2f-%.2f]", bn, u, B[1], bn, R[1], R[2], R[3] }')"
  done
  awk -v name="$1" -v sz="$2" -v u="$3" -v p="$(stats "$p")" -v o="$(stats "$o")" -v ro="$(stats "$ro")" \
      -v rq="$(stats "$rq")" -v extra="$extra" -v lost="$(echo "$ro" | awk '{for (i = 1; i <= NF; i++) if ($i < 1) n++; print n + 0 "/" NF}')" 'BEGIN {
    split(p, P, " "); split(o, O, " "); split(ro, R, " "); split(rq, Q, " ")
    if (R[4] == 0 || Q[4] == 0) { v = "?" }
    else if (R[1] >= 0.95) v = "ok"
    else if (R[1] < Q[2] && R[4] >= 7 && Q[4] >= 7) v = sprintf("FINDING: below 0.95x and below perftest against itself (%.2f-%.2f)", Q[2], Q[3])
    else if (R[1] < Q[2]) v = sprintf("below perftest'"'"'s spread (%.2f-%.2f) in %d rounds: BENCH_RUNS=7 decides", Q[2], Q[3], R[4] < Q[4] ? R[4] : Q[4])
    else v = "within noise"
    printf "RXE-BENCH %s size=%s perftest_%s=%s [%s-%s] ours_%s=%s ratio=%s [%s-%s] perftest_self=%s [%s-%s] slower_rounds=%s%s verdict: %s\n",
      name, sz, u, fmt(P[1]), fmt(P[2]), fmt(P[3]), u, fmt(O[1]), fmt(R[1]), fmt(R[2]), fmt(R[3]), fmt(Q[1]), fmt(Q[2]), fmt(Q[3]), lost, extra, v
  }
  function fmt(x) { return (x == "?" || x == "") ? "?" : sprintf("%.2f", x) }'
}
# wait_port PORT PID: until a TCP listener on PORT exists here (15 s at most) or PID died.
wait_port() {
  hex=$(printf ':%04X' $1)
  for i in $(seq 1 150); do
    kill -0 $2 2>/dev/null || return 1
    awk -v p="$hex" '$4=="0A" && substr($2, length($2)-4)==p {f=1} END {exit !f}' /proc/net/tcp /proc/net/tcp6 2>/dev/null && return 0
    sleep 0.1
  done
  return 0
}
# pt TOOL SIZE ITERS -> the average MB/s (bw) or t_avg usec (lat) of one perftest run
pt() {
  timeout 120 $1 -d rxe0 -x $GIDX -s $2 -n $3 -F > /tmp/srv.log 2>&1 &
  sp=$!
  wait_port 18515 $sp
  timeout 120 $1 -d rxe0 -x $GIDX -s $2 -n $3 -F 127.0.0.1 > /tmp/cli.log 2>&1; r=$?
  wait $sp; s=$?
  [ $r = 0 ] && [ $s = 0 ] || { cat /tmp/cli.log /tmp/srv.log >&2; return 1; }
  case $1 in
    *_lat) awk -v s=$2 '$1==s && NF>=6 {print $6; exit}' /tmp/cli.log ;;   # t_avg (usec)
    *)     awk -v s=$2 '$1==s && NF>=4 {print $4; exit}' /tmp/cli.log ;;   # BW average (MB/s)
  esac
}
# run_one WHO SIZE ITERS: one slot; sets w_ r_ l_ (write MB/s, read MB/s, 8 B latency usec).
run_one() {
  w_=; r_=; l_=
  case $1 in
    perftest|placebo)
      w_=$(pt ib_write_bw $2 $3) || ptok=1
      r_=$(pt ib_read_bw $2 $3) || ptok=1
      if [ $2 = 8 ]; then l_=$(pt ib_write_lat 8 2000) || ptok=1; fi ;;
    procs)
      # Ours as perftest runs: server and client in two processes (rdma_cm on rxe0's address).
      timeout 300 /usr/bin/rdma_pingpong_procs --server --port 7599 > /tmp/srv2.log 2>&1 &
      sp=$!
      for i in $(seq 1 100); do grep -q listening /tmp/srv2.log && break; sleep 0.1; done
      if ! timeout 300 /usr/bin/rdma_pingpong_procs --connect 10.77.0.1 --port 7599 --only $2 --bytes 33554432 > /tmp/one.log 2>&1; then
        cat /tmp/one.log /tmp/srv2.log; echo "RXE-WARN rdma_pingpong_procs --only $2 failed"
      fi
      wait $sp
      w_=$(ours_get write_bw $2); r_=$(ours_get read_bw $2)
      if [ $2 = 8 ]; then l_=$(ours_get write_lat 8); fi ;;
    *)
      prog=rdma_pingpong; [ $1 = ours ] || prog=rdma_pingpong_$1
      # 32 MiB per run, as perftest's ITERS.
      if ! timeout 300 /usr/bin/$prog --only $2 --bytes 33554432 > /tmp/one.log 2>&1; then
        cat /tmp/one.log
        if [ $1 = ours ]; then ptok=1; else echo "RXE-WARN $prog --only $2 failed"; fi
      fi
      w_=$(ours_get write_bw $2); r_=$(ours_get read_bw $2)
      if [ $2 = 8 ]; then l_=$(ours_get write_lat 8); fi ;;
  esac
}

# bench_loopback [RUNS [SIZES...]]: perftest against rdma_pingpong, RUNS rounds per size (default
# 3). Without SIZES, first the whole `rdma_pingpong --report` (a pass/fail entry of its own).
bench_loopback() {
  runs=${1:-2}; [ $# -gt 0 ] && shift
  sizes=${*:-8 4096 65536 1048576}
  if [ $# = 0 ]; then
    timeout 900 /usr/bin/rdma_pingpong --report > /tmp/ours.log 2>&1; rc=$?
    cat /tmp/ours.log; result rdma_pingpong-report $rc
  fi
  echo "clocksource: $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource 2>/dev/null)"
  # perftest uses the GID rdma_cm picks for 10.77.0.1 (the IPv4-mapped RoCE v2 one), so both sides
  # take the same network path through rxe.
  GIDX=0
  for g in 0 1 2 3 4 5 6 7; do
    grep -q 'ffff:0a4d:0001' /sys/class/infiniband/rxe0/ports/1/gids/$g 2>/dev/null && { GIDX=$g; break; }
  done
  echo "perftest GID index $GIDX"
  # Other builds of the example (run.sh's BASE_PINGPONG) take a slot each, every round.
  bases=$(cd /usr/bin && ls rdma_pingpong_base* rdma_pingpong_procs 2>/dev/null | sed 's/^rdma_pingpong_//' | tr '\n' ' ')
  subjects="ours placebo $bases"
  ptok=0; t=$(now); : > /tmp/cells
  # The same iteration counts on both sides (32 MiB per run, 20..5000; latency 2000); both report
  # MB/s of 2^20 bytes.
  for sz in $sizes; do
    it=$(awk -v s=$sz 'BEGIN{i=int(33554432/s); if(i<20)i=20; if(i>5000)i=5000; print i}')
    for who in perftest $subjects; do eval "V_${who}_w= V_${who}_r= V_${who}_l= R_${who}_w= R_${who}_r= R_${who}_l="; done
    run_one perftest $sz $it; pw=$w_; pr=$r_; pl=$l_; V_perftest_w=" $pw"; V_perftest_r=" $pr"; V_perftest_l=" $pl"
    for rep in $(seq 1 $runs); do
      # Rotate who goes first, round by round.
      order=$(echo $subjects | awk -v k=$rep '{ for (i = 0; i < NF; i++) printf "%s ", $((i + k - 1) % NF + 1) }')
      for who in $order; do
        run_one $who $sz $it; sw=$w_; sr=$r_; sl=$l_
        run_one perftest $sz $it
        for k in w r l; do
          eval "v=\$s$k before=\$p$k after=\$${k}_"
          u=MBps; [ $k = l ] && u=usec
          rat=$(paired "$v" "$before" "$after" $u)
          eval "V_${who}_$k=\"\$V_${who}_$k $v\" R_${who}_$k=\"\$R_${who}_$k $rat\" V_perftest_$k=\"\$V_perftest_$k \$${k}_\""
        done
        pw=$w_; pr=$r_; pl=$l_
      done
    done
    cell write_bw $sz MBps w | tee -a /tmp/cells
    cell read_bw $sz MBps r | tee -a /tmp/cells
    if [ $sz = 8 ]; then cell write_lat 8 usec l | tee -a /tmp/cells; fi
  done
  # A FINDING does not fail the run (TCG figures move with the host's load); it is counted here.
  c=/tmp/cells
  echo "RXE-BENCH-SUMMARY cells=$(grep -c '^RXE-BENCH ' $c) ok=$(grep -c 'verdict: ok' $c) within_noise=$(grep -c 'verdict: within noise' $c) findings=$(grep -c 'verdict: FINDING' $c) undecided=$(grep -c 'verdict: below' $c) rounds=$runs time=$(awk -v a=$t -v b=$(now) 'BEGIN{printf "%.0f", b-a}')s"
  result perftest-baselines $ptok
}

# --- between the two nodes: ib_write_bw (rxe_bR serves, rxe_aR connects) and rdma_pingpong
# (--server in b, --connect from a) alternating, on each rail (16 MiB per run). perftest-two-nodes
# passes when every ib_write_bw did.
gid_of() {  # gid_of NODE DEV ADDR-HEX: the index of the device's IPv4-mapped GID, seen from NODE
  $IP netns exec $1 sh -c "for g in 0 1 2 3 4 5 6 7; do grep -qs 'ffff:$3\$' /sys/class/infiniband/$2/ports/1/gids/\$g && { echo \$g; exit; }; done; echo 1"
}
wait_tcp() {  # wait_tcp NODE PORT PID: until a TCP listener on PORT exists in NODE (30 s at most)
  hex=$(printf ':%04X' $2)
  for i in $(seq 1 60); do
    kill -0 $3 2>/dev/null || return 1
    $IP netns exec $1 cat /proc/net/tcp | awk -v p="$hex" '$4=="0A" && substr($2, length($2)-4)==p {f=1} END {exit !f}' && return 0
    sleep 0.5
  done
}
pt_pair() {  # pt_pair RAIL SIZE ITERS -> the client's average MB/s (port 18515 + RAIL)
  r=$1; port=$((18515 + r)); gb=$(gid_of b rxe_b$r "0a4d:0$((r + 1))02"); ga=$(gid_of a rxe_a$r "0a4d:0$((r + 1))01")
  $IP netns exec b timeout 120 ib_write_bw -d rxe_b$r -x $gb -s $2 -n $3 -F -p $port > /tmp/srv$r.log 2>&1 &
  p=$!; wait_tcp b $port $p
  $IP netns exec a timeout 120 ib_write_bw -d rxe_a$r -x $ga -s $2 -n $3 -F -p $port 10.77.$((r + 1)).2 > /tmp/cli$r.log 2>&1; c=$?
  wait $p; s=$?
  [ $c = 0 ] && [ $s = 0 ] || { cat /tmp/cli$r.log /tmp/srv$r.log >&2; return 1; }
  awk -v s=$2 '$1==s && NF>=4 {print $4; exit}' /tmp/cli$r.log
}
ours_pair() {  # ours_pair RAIL SIZE ITERS -> rdma_pingpong's write MB/s between the nodes
  # A figure only: on 7.3 the client's last send is at times never acknowledged once the server,
  # which exits on receiving it, has gone (README, "Kernels"); the pair entries are the pass/fail.
  $IP netns exec b timeout 120 rdma_pingpong --server --port 7470 > /tmp/srv.log 2>&1 &
  p=$!; wait_listen b 7470 $p
  $IP netns exec a timeout 120 rdma_pingpong --connect 10.77.$(($1 + 1)).2 --port 7470 --size $2 --iters $3 > /tmp/one.log 2>&1; c=$?
  wait $p; s=$?
  [ $c = 0 ] && [ $s = 0 ] || echo "RXE-WARN two-nodes rdma_pingpong rail=$1 size=$2: client $c, server $s: $(grep -h 'error' /tmp/one.log /tmp/srv.log | head -2 | tr '\n' ' ')" >&2
  sed -n 's/^bandwidth: .* RDMA write \([0-9.]*\) MB\/s.*/\1/p' /tmp/one.log
}
# --- the transfer engine (examples/transfer.rs --bench, i.e. benches/transfer.rs) beside perftest
# between the two nodes on rail 0 (README.md, "The two-node transfer bench"). Per cell and round,
# one chain with a perftest run between every two others:
#   P ours P base1 P ... [P mc]  (the order rotating round by round)
# Each run is divided by the mean of the two perftest runs beside it (for latency, that mean over
# the run): its paired ratio. A cell gives each one's median figure and the median of its paired
# ratios with the interval that holds the median with 95% (the order statistics of the rounds;
# min-max below 6 rounds), and ours against each other subject round by round (the ratio of their
# paired ratios). transfer-bench passes when every run completed and every moved-bytes check held.
median() { tr ' ' '\n' | grep . | sort -n | awk '{a[NR]=$1} END { if (NR) print a[int((NR+1)/2)] }'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN{ if (a>0 && b>0) printf "%.2f", a/b; else print "?"}'; }
# ci "V1 V2 ..." -> "median lo hi min max n" of the positive numbers among them, as
# docs/benches.md decides a cell: [lo..hi] the 95% interval of the median from the order
# statistics (ranks k and n+1-k, k the largest with 2 P(Bin(n, 1/2) < k) <= 0.05), "? ?" below
# six rounds.
ci() {
  echo "$1" | awk '{ n = 0
    for (i = 1; i <= NF; i++) if ($i ~ /^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$/ && $i + 0 > 0) v[++n] = $i + 0
    if (!n) { print "? ? ? ? ? 0"; exit }
    for (i = 2; i <= n; i++) { x = v[i]; j = i - 1; while (j > 0 && v[j] > x) { v[j + 1] = v[j]; j-- } v[j + 1] = x }
    m = (n % 2) ? v[(n + 1) / 2] : (v[n / 2] + v[n / 2 + 1]) / 2
    k = 0; c = 0; p = 1; for (i = 0; i < n; i++) p /= 2
    for (j = 0; j < n; j++) { c += p; if (c > 0.025) break; k = j + 1; p = p * (n - j) / (j + 1) }
    if (k >= 1 && k <= (n + 1) / 2) printf "%.4f %.4f %.4f %.4f %.4f %d\n", m, v[k], v[n + 1 - k], v[1], v[n], n
    else printf "%.4f ? ? %.4f %.4f %d\n", m, v[1], v[n], n }'
}
# per_round "A1 A2 .." "B1 B2 .." -> "A1/B1 A2/B2 ..." ("?" where either is missing)
per_round() {
  awk -v a="$1" -v b="$2" 'BEGIN { n = split(a, A, " "); split(b, B, " ")
    for (i = 1; i <= n; i++) printf "%s ", (A[i] + 0 > 0 && B[i] + 0 > 0) ? sprintf("%.4f", A[i] / B[i]) : "?" }'
}
# verdict "CI" TARGET -> ok (the median meets TARGET), MISSES (the whole interval misses it) or
# undecided (the median misses it and the interval reaches it, or fewer than six rounds)
verdict() {
  echo "$1" | awk -v t=$2 '{ if ($6 == 0) print "?"; else if ($2 == "?") print "undecided"
    else if ($1 >= t) print "ok"; else if ($3 < t) print "MISSES"; else print "undecided" }'
}
# fmt_ci "CI" -> "median [lo..hi] (min..max) nN"
fmt_ci() { echo "$1" | awk '{ if ($6 == 0) print "?"; else printf "%.2f [%s..%s] (%.2f..%.2f) n%d", $1, f($2), f($3), $4, $5, $6 }
  function f(x) { return x == "?" ? "?" : sprintf("%.2f", x) }'; }
TBIN=transfer   # which build of the transfer example ours_transfer runs (transfer_baseN: BASE_TRANSFER)
echo 0 > /tmp/tcheck   # moved-bytes checks that failed (runs happen in subshells)
checkfail() { echo $(( $(cat /tmp/tcheck) + 1 )) > /tmp/tcheck; echo "RXE-WARN moved-bytes check: $*" >&2; }
# ours_transfer [--buffer BYTES] ARGS... -> the client's TRANSFER-BENCH line; checks that the
# server's target holds the client's pattern on the span it wrote, and that rxe_a0 sent at least
# the bytes the client counted.
ours_transfer() {
  sb=; [ "$1" = --buffer ] && { sb="--buffer $2"; shift 2; }
  before=$(sent_bytes)
  $IP netns exec b timeout 120 $TBIN --bench --listen 7490 --device rxe_b0 $sb > /tmp/tsrv.log 2>&1 &
  p=$!; wait_listen b 7490 $p
  $IP netns exec a timeout 120 $TBIN --bench --connect 10.77.1.2:7490 --device rxe_a0 "$@" > /tmp/tcli.log 2>&1; c=$?
  wait $p; s=$?
  [ $c = 0 ] && [ $s = 0 ] || { echo "RXE-WARN transfer bench ($TBIN) $*: client $c, server $s: $(tail -2 /tmp/tcli.log /tmp/tsrv.log | tr '\n' ' ')" >&2; return 1; }
  l=$(grep -h '^TRANSFER-BENCH' /tmp/tcli.log | head -1)
  span=$(echo "$l" | sed -n 's/.* span=\([0-9]*\).*/\1/p')
  nset=$(sed -n 's/^TRANSFER-BENCH target bytes_set=\([0-9]*\).*/\1/p' /tmp/tsrv.log)
  bytes=$(echo "$l" | sed -n 's/.* bytes=\([0-9]*\).*/\1/p')
  wire=$(traffic "$before" "$(sent_bytes)" | tr ' ' '\n' | sed -n 's/^rxe_a0=+//p')
  # Older builds (BASE_TRANSFER) print no span: nothing to compare.
  [ -z "$span" ] || [ "$nset" = "$span" ] || checkfail "$TBIN $*: the target holds $nset bytes of the pattern, the client wrote $span"
  [ -z "$bytes" ] || [ "${wire:-0}" -ge "$bytes" ] || checkfail "$TBIN $*: rxe_a0 sent $wire bytes, the client counted $bytes"
  # The listening side's figures of a latency run (its turn and its wait) join the line.
  echo "$l $(sed -n 's/^TRANSFER-BENCH serve //p' /tmp/tsrv.log | head -1)"
}
connect_bench() {  # connect_bench [--key-file F] -> the client's TRANSFER-BENCH connect line
  $IP netns exec b timeout 120 transfer --bench --listen 7491 --device rxe_b0 --connect-bench 30 "$@" > /tmp/csrv.log 2>&1 &
  p=$!; wait_listen b 7491 $p
  $IP netns exec a timeout 120 transfer --bench --connect 10.77.1.2:7491 --device rxe_a0 --connect-bench 30 "$@" > /tmp/ccli.log 2>&1; c=$?
  wait $p; s=$?
  [ $c = 0 ] && [ $s = 0 ] || { echo "RXE-WARN connect bench $*: client $c, server $s: $(tail -2 /tmp/ccli.log /tmp/csrv.log | tr '\n' ' ')" >&2; return 1; }
  grep -h '^TRANSFER-BENCH connect' /tmp/ccli.log
}
pt_lat_pair() {  # pt_lat_pair ITERS [BIN] -> BIN's t_avg (usec; ib_write_lat, or ib_send_lat), 8 bytes, rail 0
  bin=${2:-ib_write_lat}
  gb=$(gid_of b rxe_b0 "0a4d:0102"); ga=$(gid_of a rxe_a0 "0a4d:0101")
  $IP netns exec b timeout 120 $bin -d rxe_b0 -x $gb -s 8 -n $1 -F -p 18530 > /tmp/lsrv.log 2>&1 &
  p=$!; wait_tcp b 18530 $p
  $IP netns exec a timeout 120 $bin -d rxe_a0 -x $ga -s 8 -n $1 -F -p 18530 10.77.1.2 > /tmp/lcli.log 2>&1; c=$?
  wait $p; s=$?
  [ $c = 0 ] && [ $s = 0 ] || { cat /tmp/lcli.log /tmp/lsrv.log >&2; return 1; }
  awk '$1==8 && NF>=6 {print $6; exit}' /tmp/lcli.log
}
# Mooncake's transfer_engine_bench (run.sh's MOONCAKE_WHEEL): target in b, initiator in a, rail 0.
MCB=/opt/mooncake/mooncake/transfer_engine_bench
# mc_run SIZE BATCH THREADS SECONDS -> its MiB/s; checks that rxe_a0 sent at least the bytes it
# counted (it checks no bytes itself).
mc_run() {
  buf=$(( $1 * $2 * $3 )); [ $buf -lt 67108864 ] && buf=67108864
  gb=$(gid_of b rxe_b0 "0a4d:0102"); ga=$(gid_of a rxe_a0 "0a4d:0101")
  common="--protocol=rdma --metadata_server=P2PHANDSHAKE --buffer_size=$buf --block_size=$1 --batch_size=$2 --threads=$3"
  MC_GID_INDEX=$gb GLOG_logtostderr=1 $IP netns exec b timeout 150 $MCB --mode=target \
    --local_server_name=10.77.1.2 --device_name=rxe_b0 $common > /tmp/mct.log 2>&1 &
  p=$!; seg=
  # Up once its RPC listens and its buffer is registered (an MR of the buffer's length).
  for i in $(seq 1 120); do
    kill -0 $p 2>/dev/null || break
    seg=$(sed -n 's/.*listening on \([0-9.]*:[0-9]*\).*/\1/p' /tmp/mct.log | tail -1)
    [ -n "$seg" ] && rdma resource show mr 2>/dev/null | grep -q "mrlen $buf " && break
    sleep 0.5
  done
  if [ -z "$seg" ] || ! kill -0 $p 2>/dev/null; then
    echo "RXE-WARN mooncake target did not come up: $(tail -5 /tmp/mct.log | tr '\n' ' ')" >&2
    kill $p 2>/dev/null; wait $p; return 1
  fi
  sleep 0.5
  before=$(sent_bytes)
  MC_GID_INDEX=$ga GLOG_logtostderr=1 $IP netns exec a timeout 150 $MCB --mode=initiator \
    --local_server_name=10.77.1.1 --device_name=rxe_a0 --segment_id=$seg --operation=write \
    --duration=$4 --report_unit=MiB $common > /tmp/mci.log 2>&1; c=$?
  wire=$(traffic "$before" "$(sent_bytes)" | tr ' ' '\n' | sed -n 's/^rxe_a0=+//p')
  kill -TERM $p 2>/dev/null; wait $p
  line=$(grep -a 'Test completed' /tmp/mci.log | tail -1)
  v=$(echo "$line" | sed -n 's/.*throughput \([0-9.]*\) MiB\/s.*/\1/p')
  n=$(echo "$line" | sed -n 's/.*batch count \([0-9]*\).*/\1/p')
  if [ $c != 0 ] || [ -z "$v" ]; then
    echo "RXE-WARN mooncake initiator (exit $c): $(grep -a -E 'ERROR|FAILED|Check failed' /tmp/mci.log | tail -3 | tr '\n' ' ') $(tail -3 /tmp/mci.log | tr '\n' ' ')" >&2
    return 1
  fi
  claimed=$(( ${n:-0} * $1 * $2 ))
  [ "${wire:-0}" -ge "$claimed" ] || checkfail "mooncake size=$1 batch=$2 threads=$3: rxe_a0 sent $wire bytes, it counted $claimed"
  echo "$v"
}
# tchain RUNS UNIT SUBJECTS...: RUNS rounds of the chain; `tp` gives a perftest figure, `trun WHO`
# a subject's. Sets V_pt, V_<who> (figures) and R_<who> (paired ratios), "?" where a run failed.
tchain() {
  runs=$1 unit=$2; shift 2; subs="$*"
  V_pt=; for w in $subs; do eval "V_$w= R_$w="; done
  prev=$(tp) || tok=1; V_pt=" ${prev:-?}"
  for rep in $(seq 1 $runs); do
    order=$(echo $subs | awk -v k=$rep '{ for (i = 0; i < NF; i++) printf "%s ", $((i + k - 1) % NF + 1) }')
    for w in $order; do
      v=$(trun $w) || tok=1
      nxt=$(tp) || tok=1
      r=$(paired "$v" "$prev" "$nxt" $unit)
      eval "V_$w=\"\$V_$w ${v:-?}\" R_$w=\"\$R_$w ${r:-?}\""
      V_pt="$V_pt ${nxt:-?}"; prev=$nxt
    done
  done
}
# tcell LABEL UNIT TARGET SUBJECTS...: the cell's RXE-RUNS and RXE-BENCH lines after tchain; ours
# against perftest (TARGET: the ratio to reach, "-" for none) and against each other subject.
tcell() {
  label=$1 unit=$2 target=$3; shift 3
  line="perftest_$unit=$(fmt_ci "$(ci "$V_pt")")"
  for w in "$@"; do
    eval "v=\$V_$w r=\$R_$w"
    echo "RXE-RUNS transfer rail=0 $label $w:[$v ] ${w}_ratios:[$r ] perftest:[$V_pt ]"
    line="$line ${w}_$unit=$(ci "$v" | awk '{ print ($6 == 0) ? "?" : sprintf("%.2f", $1) }') $w/perftest=$(fmt_ci "$(ci "$r")")"
  done
  for w in "$@"; do
    [ $w = ours ] && continue
    eval "rr=\$R_$w"; pr=$(per_round "$R_ours" "$rr")
    echo "RXE-RUNS transfer rail=0 $label ours/$w:[ $pr]"
    line="$line ours/$w=$(fmt_ci "$(ci "$pr")")"
  done
  [ "$target" = - ] || line="$line ours/perftest_target=$target verdict: $(verdict "$(ci "$R_ours")" $target)"
  echo "RXE-BENCH transfer rail=0 $label $line"
}
tbases=$(cd /usr/bin && ls transfer_base* 2>/dev/null | sed 's/^transfer_//' | tr '\n' ' ')
# trun WHO: one run of a subject of the current cell: Mooncake ($mcargs: SIZE BATCH THREADS
# SECONDS), or a build of the transfer example ($targs: its arguments; $tkind $tfield: the line
# and the figure in it; a build that ignores the arguments prints another line and gives none).
trun() {
  case $1 in
    mc) mc_run $mcargs; return ;;
    ours) TBIN=transfer ;;
    *) TBIN=transfer_$1 ;;
  esac
  l=$(ours_transfer $targs) || return 1
  echo "$l" | sed -n "s/^TRANSFER-BENCH $tkind .* $tfield=\([0-9.]*\).*/\1/p"
  # Where a latency run's time went (medians, usec): the client's post and wait, the listening
  # side's turn and wait.
  [ $tkind = write_lat ] && echo "$l" | sed -n 's/.* post_usec=\([0-9.]*\) wait_usec=\([0-9.]*\).* turn_usec=\([0-9.]*\) ack_usec=\([0-9.]*\).*/\1 \2 \3 \4/p' >> /tmp/tparts_$1
  # Allocations (every thread's) per round trip on the client, per ping on the listening side.
  [ $tkind = write_lat ] && echo "$l" | sed -n 's/.* allocs_per_rt=\([0-9.]*\).* allocs_per_ping=\([0-9.]*\).*/\1 \2/p' >> /tmp/tallocs_$1
  return 0
}
# latency_cells RUNS: the 8-byte latency chains beside ib_write_lat, then beside ib_send_lat.
latency_cells() {
  runs=$1
  tp() { pt_lat_pair 500; }
  targs="--lat --iters 500" tkind=write_lat tfield=usec
  rm -f /tmp/tparts_* /tmp/tallocs_*
  tchain $runs usec ours $tbases
  tcell "write_lat size=8" usec 0.9 ours $tbases
  for w in ours $tbases; do
    [ -s /tmp/tparts_$w ] || continue
    echo "RXE-BENCH transfer rail=0 write_lat parts $w: $(awk '{ for (i = 1; i <= 4; i++) v[i] = v[i] " " $i }
      END { split("client_post client_wait server_turn server_wait", n, " ")
        for (i = 1; i <= 4; i++) { c = split(v[i], a, " "); for (j = 2; j <= c; j++) { x = a[j]; k = j - 1; while (k > 0 && a[k] + 0 > x + 0) { a[k + 1] = a[k]; k-- } a[k + 1] = x }
          printf "%s_usec=%s ", n[i], a[int((c + 1) / 2)] } }' /tmp/tparts_$w)(medians over the runs of each run's median)"
  done
  for w in ours $tbases; do
    [ -s /tmp/tallocs_$w ] || continue
    echo "RXE-BENCH transfer rail=0 write_lat allocs $w: $(awk 'NR == 1 { a = b = $1; c = d = $2 } { if ($1 < a) a = $1; if ($1 > b) b = $1; if ($2 < c) c = $2; if ($2 > d) d = $2 }
      END { printf "client_per_rt=%s..%s server_per_ping=%s..%s", a, b, c, d }' /tmp/tallocs_$w) (all threads, lowest..highest over the runs)"
  done
  # The same round trips beside ib_send_lat: the engine's notification is a write with
  # immediate data, which lands at the peer as a receive completion (what ib_send_lat waits
  # for); ib_write_lat polls the last byte written instead, with no receive to post again.
  tp() { pt_lat_pair 500 ib_send_lat; }
  tchain $runs usec ours $tbases
  tcell "write_lat_vs_send_lat size=8" usec - ours $tbases
}
bench_transfer() {
  [ -x /usr/bin/transfer ] || return 0
  runs=${1:-5}
  tok=0; t=$(now); echo 0 > /tmp/tcheck
  for sz in 4096 65536 1048576; do
    it=$(awk -v s=$sz 'BEGIN{i=int(8388608/s); if(i<10)i=10; if(i>5000)i=5000; print i}')
    tp() { pt_pair 0 $tsz $tit; }
    tsz=$sz tit=$it targs="--size $sz --bytes $((sz * it))" tkind=write_bw tfield=MBps
    tchain $runs MBps ours $tbases
    tcell "write_bw size=$sz" MBps 0.95 ours $tbases
  done
  latency_cells $runs
  # Connecting with the key and without, alternately: TRANSFER-BENCH connect medians of 30
  # endpoints each, the key's cost as the paired ratio of each round.
  cks=; cns=; crs=
  for rep in $(seq $runs); do
    k=$(connect_bench --key-file /tmp/transfer.key | sed -n 's/.* usec=\([0-9.]*\) .*/\1/p')
    u=$(connect_bench | sed -n 's/.* usec=\([0-9.]*\) .*/\1/p')
    [ -n "$k" ] && [ -n "$u" ] || tok=1
    cks="$cks $k"; cns="$cns $u"; crs="$crs $(ratio "$k" "$u")"
  done
  echo "RXE-BENCH transfer rail=0 connect key=yes usec=$(echo "$cks" | median) key=no usec=$(echo "$cns" | median) paired_ratio(key/no)=$(echo "$crs" | median) runs: key[$cks ] no_key[$cns ] ratios[$crs ]"
  $IP netns exec a timeout 300 transfer --bench --register --device rxe_a0 --device rxe_a1 > /tmp/treg.log 2>&1 || { cat /tmp/treg.log; tok=1; }
  sed -n 's/^TRANSFER-BENCH register/RXE-BENCH transfer register/p' /tmp/treg.log
  [ "$(cat /tmp/tcheck)" = 0 ] || tok=1
  echo "TWO-NODES: transfer bench took $(awk -v a=$t -v b=$(now) 'BEGIN{printf "%.1f", b-a}')s"
  result transfer-bench $tok
}
# bench_latency RUNS: only the latency cells of bench_transfer (BENCH_PARTS=latency).
bench_latency() {
  [ -x /usr/bin/transfer ] || return 0
  tok=0; t=$(now); echo 0 > /tmp/tcheck
  latency_cells ${1:-5}
  [ "$(cat /tmp/tcheck)" = 0 ] || tok=1
  echo "TWO-NODES: latency bench took $(awk -v a=$t -v b=$(now) 'BEGIN{printf "%.1f", b-a}')s"
  result latency-bench $tok
}
# trace_latency: one short latency run of ours (60 round trips), then one of ib_write_lat, each
# under ftrace (the scheduler's switches and wake-ups, every system call's entry, and Soft-RoCE's
# protocol functions), the trace of each printed between RXE-TRACE-BEGIN and RXE-TRACE-END
# (BENCH_PARTS=trace; ci/rxe-vm/scripts/trace-rt.py reads the log), and the guest's clock source
# before and after.
trace_latency() {
  T=/sys/kernel/tracing
  [ -w $T/trace ] || mount -t tracefs nodev $T 2>/dev/null || true
  [ -w $T/trace ] || { echo "RXE-WARN no tracefs"; result latency-trace 1; return; }
  echo 0 > $T/tracing_on
  echo 8192 > $T/buffer_size_kb
  echo > $T/set_ftrace_filter
  for f in rxe_post_send rxe_post_recv rxe_requester rxe_completer rxe_responder rxe_receiver rxe_rcv \
      rxe_cq_post rxe_sched_task rxe_run_task rxe_xmit_packet rxe_req_notify_cq ib_uverbs_comp_handler; do
    echo $f >> $T/set_ftrace_filter 2>/dev/null || true
  done
  echo function > $T/current_tracer
  echo 1 > $T/events/sched/sched_switch/enable
  echo 1 > $T/events/sched/sched_wakeup/enable
  echo "RXE-TRACE clocksource $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource)"
  echo 1 > $T/events/raw_syscalls/sys_enter/enable
  for who in ours perftest; do
    echo > $T/trace
    echo 1 > $T/tracing_on
    case $who in
      ours) TBIN=transfer ours_transfer --lat --iters 60 >/dev/null ;;
      perftest) pt_lat_pair 60 >/dev/null ;;
    esac
    echo 0 > $T/tracing_on
    echo "RXE-TRACE-BEGIN $who"
    cat $T/trace | grep -v '^#'
    echo "RXE-TRACE-END $who"
  done
  echo nop > $T/current_tracer
  echo 0 > $T/events/enable
  # With perf in the guest (run.sh's GUEST_TOOLS=/usr/bin/perf): where each side's CPU time went
  # in a run of 3,000 round trips, sampled on the CPU clock (TCG has no hardware counters).
  if command -v perf >/dev/null; then
    $IP netns exec b timeout 120 perf record -q -e cpu-clock -F 20000 -o /tmp/perf-b.data -- \
      transfer --bench --listen 7490 --device rxe_b0 > /tmp/tsrv.log 2>&1 &
    p=$!; wait_listen b 7490 $p
    $IP netns exec a timeout 120 perf record -q -e cpu-clock -F 20000 -o /tmp/perf-a.data -- \
      transfer --bench --connect 10.77.1.2:7490 --device rxe_a0 --lat --iters 3000 > /tmp/tcli.log 2>&1
    wait $p
    for s in a b; do
      echo "RXE-PERF-BEGIN $s"
      perf report -i /tmp/perf-$s.data --stdio --sort comm,dso,sym --percent-limit 0.25 2>/dev/null | grep -v '^#' | grep -v '^$' | head -100
      echo "RXE-PERF-END $s"
    done
  fi
  echo "RXE-TRACE clocksource at the end $(cat /sys/devices/system/clocksource/clocksource0/current_clocksource)"
  dmesg | grep -i 'clocksource' | tail -3
  result latency-trace 0
}
# bench_mooncake RUNS: Mooncake's write bench beside ours and perftest (ib_write_bw of the same
# size) per configuration (/etc/gpudirect-mooncake: MC_CONFIGS "BATCH:THREADS ...", MC_SIZES,
# MC_SECONDS): one batch of BATCH blocks a thread at a time, waited for, again for MC_SECONDS, on
# THREADS threads; ours the same (--batch --threads --seconds).
bench_mooncake() {
  [ -x $MCB ] || { echo "no $MCB"; result mooncake-bench 1; return; }
  MC_CONFIGS="1:1 64:1 1:4 64:4"; MC_SIZES="4096 65536 1048576"; MC_SECONDS=3
  [ -r /etc/gpudirect-mooncake ] && . /etc/gpudirect-mooncake
  runs=${1:-5}
  tok=0; t=$(now); echo 0 > /tmp/tcheck
  mcv=$(mc_run 65536 1 1 1) || { echo "RXE-WARN mooncake smoke run failed; its logs:"; tail -30 /tmp/mct.log /tmp/mci.log; result mooncake-bench 1; return; }
  echo "TWO-NODES: mooncake smoke run: $mcv MiB/s ($(grep -a -c . /tmp/mci.log) log lines)"
  for cfg in $MC_CONFIGS; do
    b=${cfg%%:*}; th=${cfg#*:}
    for sz in $MC_SIZES; do
      it=$(awk -v s=$sz 'BEGIN{i=int(16777216/s); if(i<20)i=20; if(i>5000)i=5000; print i}')
      tp() { pt_pair 0 $tsz $tit; }
      buf=$(( sz * b * th )); [ $buf -lt 1048576 ] && buf=1048576
      tsz=$sz tit=$it tkind=write_batch tfield=MBps
      targs="--buffer $buf --size $sz --batch $b --threads $th --seconds $MC_SECONDS"
      mcargs="$sz $b $th $MC_SECONDS"
      tchain $runs MBps ours mc $tbases
      # perftest keeps 128 writes in flight: the paired ratios only follow the host's load here.
      tcell "write_batch size=$sz batch=$b threads=$th" MBps - ours mc $tbases
      om=$(ci "$(per_round "$R_ours" "$R_mc")")
      echo "RXE-BENCH mooncake rail=0 write size=$sz batch=$b threads=$th ours/mc=$(fmt_ci "$om") target=1 verdict: $(verdict "$om" 1)"
    done
  done
  [ "$(cat /tmp/tcheck)" = 0 ] || tok=1
  echo "TWO-NODES: mooncake bench took $(awk -v a=$t -v b=$(now) 'BEGIN{printf "%.1f", b-a}')s"
  result mooncake-bench $tok
}
bench_pair() {
  ok=0
  nodes_up || { result perftest-two-nodes 1; return; }
  # One rail at a time: perftest and rdma_pingpong alternate, best of two (TCG is noisy).
  for cell in 0:4096 0:65536 0:1048576 1:65536 1:1048576; do
    r=${cell%%:*}; sz=${cell#*:}; t=$(now); pw=; ow=
    it=$(awk -v s=$sz 'BEGIN{i=int(16777216/s); if(i<20)i=20; if(i>5000)i=5000; print i}')
    before=$(sent_bytes)
    for rep in 1 2; do
      v=$(pt_pair $r $sz $it) || ok=1; pw=$(best "$pw" "$v" max)
      v=$(ours_pair $r $sz $it); ow=$(best "$ow" "$v" max)
    done
    echo "RXE-BENCH two-nodes rail=$r write_bw size=$sz perftest_MBps=${pw:-?} ours_MBps=${ow:-?} ratio=$(awk -v a="$ow" -v b="$pw" 'BEGIN{ if (a>0 && b>0) printf "%.2f", a/b; else print "?"}') traffic: $(traffic "$before" "$(sent_bytes)")time=$(awk -v a=$t -v b=$(now) 'BEGIN{printf "%.1f", b-a}')s"
  done
  # Both rails at once (two ib_write_bw, 1 MiB): the ceiling a transfer striped over both rails
  # can reach in this VM.
  t=$(now); before=$(sent_bytes); sz=1048576; it=20
  (pt_pair 0 $sz $it > /tmp/bw0 || echo fail > /tmp/bw0) & j0=$!
  (pt_pair 1 $sz $it > /tmp/bw1 || echo fail > /tmp/bw1) & j1=$!
  wait $j0; wait $j1
  b0=$(cat /tmp/bw0); b1=$(cat /tmp/bw1)
  case "$b0$b1" in *fail*|'') ok=1;; esac
  echo "RXE-BENCH two-nodes rails=0+1 write_bw size=$sz perftest_MBps=$(awk -v a="$b0" -v b="$b1" 'BEGIN{printf "%.2f", a+b}') (rail0 ${b0:-?} + rail1 ${b1:-?}) traffic: $(traffic "$before" "$(sent_bytes)")time=$(awk -v a=$t -v b=$(now) 'BEGIN{printf "%.1f", b-a}')s"
  result perftest-two-nodes $ok
}

while read -r kind name args; do
  case $kind in ''|'#'*) continue;; esac
  echo "=== $kind $name (at $(now)s)"
  case $kind in
    test) timeout 600 /usr/bin/$name --test-threads=1 --nocapture; result "$name" $? ;;
    example) timeout 600 /usr/bin/$name; result "$name" $? ;;
    bench) timeout 600 /usr/bin/$name --test; result "$name" $? ;;
    bench-loopback) bench_loopback $name $args ;;
    pair) run_pair "$name" $args; result "pair:$name" $? ;;
    bench-pair)  # bench-pair RUNS PARTS...: pingpong (ib_write_bw beside rdma_pingpong), transfer, mooncake
      for part in ${args:-pingpong transfer}; do
        nodes_up || { result two-node-bench 1; break; }
        case $part in pingpong) bench_pair ;; transfer) bench_transfer $name ;; latency) bench_latency $name ;; trace) trace_latency ;; mooncake) bench_mooncake $name ;; esac
      done ;;
    nodes) /n-nodes.sh $name $args; result "n-nodes" $? ;;
    *) echo "unknown entry: $kind $name"; result "$kind" 1 ;;
  esac
done < /etc/gpudirect-tests
echo "$pass passed, $fail failed"
[ $fail = 0 ]
