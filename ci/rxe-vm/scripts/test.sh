#!/bin/sh
# Inside the VM: run every project binary listed in /etc/gpudirect-tests with GPUDIRECT_REQUIRE=rdma,
# then perftest baselines beside the example's --report mode. Prints "RXE-RESULT name PASS|FAIL",
# "RXE-BENCH ..." lines and finally "N passed, N failed".
export GPUDIRECT_REQUIRE=rdma RUST_BACKTRACE=1
pass=0; fail=0
result() { if [ "$2" = 0 ]; then echo "RXE-RESULT $1 PASS"; pass=$((pass+1)); else echo "RXE-RESULT $1 FAIL (exit $2)"; fail=$((fail+1)); fi; }
for g in 0 1 2 3; do
  f=/sys/class/infiniband/rxe0/ports/1/gids/$g; [ -r $f ] && echo "GID[$g] $(cat $f) $(cat /sys/class/infiniband/rxe0/ports/1/gid_attrs/types/$g 2>/dev/null)"
done
while read -r kind name; do
  echo "=== $kind $name"
  case $kind in
    test) timeout 600 /usr/bin/$name --test-threads=1 --nocapture; result "$name" $? ;;
    example) timeout 600 /usr/bin/$name; result "$name" $? ;;
  esac
done < /etc/gpudirect-tests

# Same boot: perftest baselines and the library's own figures (loopback on rxe0).
echo "=== bench: rdma_pingpong --report"
timeout 900 /usr/bin/rdma_pingpong --report > /tmp/ours.log 2>&1; rc=$?
cat /tmp/ours.log; result rdma_pingpong-report $rc
pt() {  # pt TOOL SIZE ITERS  -> prints the average MB/s (bw) or t_avg usec (lat)
  $1 -d rxe0 -x 0 -s $2 -n $3 -F $4 > /tmp/srv.log 2>&1 &
  sleep 1
  $1 -d rxe0 -x 0 -s $2 -n $3 -F $4 127.0.0.1 > /tmp/cli.log 2>&1; r=$?
  wait
  [ $r = 0 ] || { cat /tmp/cli.log /tmp/srv.log; return 1; }
  case $1 in
    *_lat) awk -v s=$2 '$1==s && NF>=6 {print $6; exit}' /tmp/cli.log ;;   # t_avg (usec)
    *)     awk -v s=$2 '$1==s && NF>=4 {print $4; exit}' /tmp/cli.log ;;   # BW average (MB/s)
  esac
}
ptok=0
for sz in 8 4096 65536 1048576; do
  it=$(awk -v s=$sz 'BEGIN{i=int(8388608/s); if(i<20)i=20; if(i>2000)i=2000; print i}')
  for t in write read; do
    base=$(pt ib_${t}_bw $sz $it "") || ptok=1
    ours=$(awk -v s=$sz -v t=${t}_bw '$1=="REPORT" && $2==t && $3=="size="s {split($5,a,"="); print a[2]}' /tmp/ours.log)
    echo "RXE-BENCH ${t}_bw size=$sz perftest_MBps=${base:-?} ours_MBps=${ours:-?} ratio=$(awk -v a="$ours" -v b="$base" 'BEGIN{ if (a>0 && b>0) printf "%.2f", a/b; else print "?"}')"
  done
done
base=$(pt ib_write_lat 8 1000 "") || ptok=1
ours=$(awk '$1=="REPORT" && $2=="write_lat" && $3=="size=8" {split($5,a,"="); print a[2]}' /tmp/ours.log)
echo "RXE-BENCH write_lat size=8 perftest_usec=${base:-?} ours_usec=${ours:-?} ratio(perftest/ours)=$(awk -v a="$ours" -v b="$base" 'BEGIN{ if (a>0 && b>0) printf "%.2f", b/a; else print "?"}')"
result perftest-baselines $ptok
echo "$pass passed, $fail failed"
[ $fail = 0 ]
