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
    bench) timeout 600 /usr/bin/$name --test; result "$name" $? ;;
  esac
done < /etc/gpudirect-tests

# Same boot: perftest baselines and the library's own figures (loopback on rxe0).
echo "=== bench: rdma_pingpong --report"
timeout 900 /usr/bin/rdma_pingpong --report > /tmp/ours.log 2>&1; rc=$?
cat /tmp/ours.log; result rdma_pingpong-report $rc
# perftest uses the GID rdma_cm picks for 10.77.0.1 (the IPv4-mapped RoCE v2 one), so both sides
# take the same network path through rxe.
GIDX=0
for g in 0 1 2 3 4 5 6 7; do
  grep -q 'ffff:0a4d:0001' /sys/class/infiniband/rxe0/ports/1/gids/$g 2>/dev/null && { GIDX=$g; break; }
done
echo "perftest GID index $GIDX"
pt() {  # pt TOOL SIZE ITERS  -> prints the average MB/s (bw) or t_avg usec (lat)
  $1 -d rxe0 -x $GIDX -s $2 -n $3 -F $4 > /tmp/srv.log 2>&1 &
  sleep 1
  $1 -d rxe0 -x $GIDX -s $2 -n $3 -F $4 127.0.0.1 > /tmp/cli.log 2>&1; r=$?
  wait
  [ $r = 0 ] || { cat /tmp/cli.log /tmp/srv.log; return 1; }
  case $1 in
    *_lat) awk -v s=$2 '$1==s && NF>=6 {print $6; exit}' /tmp/cli.log ;;   # t_avg (usec)
    *)     awk -v s=$2 '$1==s && NF>=4 {print $4; exit}' /tmp/cli.log ;;   # BW average (MB/s)
  esac
}
ptok=0
best() { awk -v a="$1" -v b="$2" -v m="$3" 'BEGIN{ if (a=="") {print b; exit} if (b=="") {print a; exit} if ((m=="max") == (a+0 > b+0)) print a; else print b }'; }
ours_get() { awk -v t=$1 -v s=$2 '$1=="REPORT" && $2==t && $3=="size="s {split($5,a,"="); print a[2]; exit}' /tmp/one.log; }
# Compared sizes: perftest and the library alternate, three times each, best of three (the host
# is shared and TCG is noisy); the same iteration counts on both sides (32 MiB per run, 20..5000).
# Both report MB/s of 2^20 bytes.
for sz in 8 4096 65536 1048576; do
  it=$(awk -v s=$sz 'BEGIN{i=int(33554432/s); if(i<20)i=20; if(i>5000)i=5000; print i}')
  pw=; pr=; ow=; orr=; pl=; ol=
  for rep in 1 2 3; do
    v=$(pt ib_write_bw $sz $it "") || ptok=1; pw=$(best "$pw" "$v" max)
    v=$(pt ib_read_bw $sz $it "") || ptok=1; pr=$(best "$pr" "$v" max)
    timeout 300 /usr/bin/rdma_pingpong --only $sz --bytes 33554432 > /tmp/one.log 2>&1 || { cat /tmp/one.log; ptok=1; }
    ow=$(best "$ow" "$(ours_get write_bw $sz)" max); orr=$(best "$orr" "$(ours_get read_bw $sz)" max)
    if [ $sz = 8 ]; then
      ol=$(best "$ol" "$(ours_get write_lat 8)" min)
      v=$(pt ib_write_lat 8 2000 "") || ptok=1; pl=$(best "$pl" "$v" min)
    fi
  done
  echo "RXE-BENCH write_bw size=$sz perftest_MBps=${pw:-?} ours_MBps=${ow:-?} ratio=$(awk -v a="$ow" -v b="$pw" 'BEGIN{ if (a>0 && b>0) printf "%.2f", a/b; else print "?"}')"
  echo "RXE-BENCH read_bw size=$sz perftest_MBps=${pr:-?} ours_MBps=${orr:-?} ratio=$(awk -v a="$orr" -v b="$pr" 'BEGIN{ if (a>0 && b>0) printf "%.2f", a/b; else print "?"}')"
  [ $sz = 8 ] && echo "RXE-BENCH write_lat size=8 perftest_usec=${pl:-?} ours_usec=${ol:-?} ratio(perftest/ours)=$(awk -v a="$ol" -v b="$pl" 'BEGIN{ if (a>0 && b>0) printf "%.2f", b/a; else print "?"}')"
done
result perftest-baselines $ptok
echo "$pass passed, $fail failed"
[ $fail = 0 ]
