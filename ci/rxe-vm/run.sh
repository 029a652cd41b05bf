#!/bin/bash
# Tier 1 CI: the project's RDMA tests and examples against Soft-RoCE (rdma_rxe) in a qemu VM.
#
#   bash ci/rxe-vm/run.sh
#
# 1. Builds here, in release mode: every test binary of tests/rdma_*.rs, examples/rdma_*.rs,
#    examples/gpu_rdma_*.rs (it skips without a GPU), the probe example (its RDMA section is filled
#    from rxe0) and the criterion bench benches/rdma.rs
#    (they dlopen libibverbs/librdmacm: `ldd` must not list them).
# 2. Fetches qemu, a Debian kernel with rdma_rxe and the guest's user space (rdma-core, perftest)
#    through a private APT config made from this machine's own apt sources, unpacked with dpkg -x
#    under the work dir; nothing is installed on the host.
# 3. Boots the VM (TCG: KVM here is PVM), creates rxe0 on dummy0 (10.77.0.1), runs each binary
#    with GPUDIRECT_REQUIRE=rdma, then perftest (ib_write_bw, ib_read_bw, ib_write_lat,
#    ib_send_lat) beside `rdma_pingpong --report` in the same boot, printing the ratios.
# Exit 0 only if every binary and the baselines passed; the last line is "N passed, N failed".
#
# Two nodes (README.md, "Two nodes"): TWO_NODES=1 runs the test binaries and examples above
# (without the loopback baselines), then, in the same boot, the entries of two-nodes.list between
# the network namespaces a and b (two rails of veth + rxe) and ib_write_bw / rdma_pingpong figures
# between them; TWO_NODES=only runs just the two-node part. Needs the 7.x kernel (the default
# then): 6.12's rxe does not follow network namespaces.
#
# N nodes (README.md, "N nodes"): NODES=4 runs only tests/membership_nodes.rs (feature etcd) with
# etcd inside the VM (Debian's etcd-server, fetched as the guest's other packages): four network
# namespaces on one bridge, an rxe device each; every node publishes itself by name, then
# all-to-all writes found by name, one node SIGKILLed, one SIGSTOPped and resumed, etcd killed
# and restarted; and the bench (connecting to 3 peers by name against by address). Kernel 7.
#
# Env: W (work dir, cached between runs; default <repo>/.vm/w), KERNEL=6.12|7 (default 6.12, 7 with
#      TWO_NODES), TWO_NODES=0|1|only, TWO_NODES_NETNS=shared|exclusive (RDMA netns mode, default
#      shared), VM_TIMEOUT (s, default 1500; 1800 with TWO_NODES), ACCEL=auto|kvm|tcg, SMP (default 2),
#      MEM (default 2G), APPEND (extra kernel arguments); the loopback bench (README.md, "The
#      loopback bench"): BENCH_RUNS (rounds per size, 1-99; default 2, 7 with BENCH_ONLY),
#      BENCH_ONLY=1 (build rdma_pingpong and run only the bench), BENCH_SIZES (with BENCH_ONLY:
#      some of 8 4096 65536 1048576), BASE_PINGPONG (other rdma_pingpong builds, benched beside),
#      BENCH_TWO_PROCS=1 (also ours as two processes, --server and --connect, as perftest runs);
#      the two-node bench: BASE_TRANSFER (other builds of examples/transfer, benched beside
#      it round by round, an A/B in one boot), PAIRS=0 (skip two-nodes.list, run only bench-pair),
#      PAIR_ONLY (an extended regex: only the list's entries whose label matches; BENCH_PARTS=none
#      then skips the bench too),
#      BENCH_RUNS (its rounds per cell, default 5), BENCH_PARTS (some of pingpong transfer
#      latency trace mooncake; latency: the transfer part's latency cells alone; trace: one short
#      latency run of ours and of ib_write_lat under ftrace, read by scripts/trace-rt.py; default
#      pingpong transfer, and mooncake with MOONCAKE_WHEEL), GUEST_TOOLS (host programs copied
#      into the guest with their libraries: /usr/bin/perf makes the trace part profile each side
#      too), MOONCAKE_WHEEL (a
#      wheel of Mooncake's transfer engine whose C++ transfer_engine_bench runs beside ours:
#      README.md, "Mooncake beside"), MOONCAKE_CONFIGS ("BATCH:THREADS ...", default
#      "1:1 64:1 1:4 64:4"), MOONCAKE_SIZES (default "4096 65536 1048576"), MOONCAKE_SECONDS (3); the N-node mode:
#      NODES (3-9, default 0: off), BENCH_RUNS (its bench's rounds, default 7), NODES_TTL_MS (the
#      lease TTL, default 2000).
# README.md (beside this script) says what was learned getting rxe to run here.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
W=${W:-$ROOT/.vm/w}; mkdir -p "$W"; export W
TWO_NODES=${TWO_NODES:-0}
BENCH_ONLY=${BENCH_ONLY:-0}; BENCH_RUNS=${BENCH_RUNS:-}
case $BENCH_ONLY:$TWO_NODES in 0:*|1:0) ;; *) echo "HOST: BENCH_ONLY=1 and TWO_NODES do not mix" >&2; exit 2;; esac
case $BENCH_RUNS in ''|[1-9]|[1-9][0-9]) ;; *) echo "HOST: BENCH_RUNS must be 1 to 99" >&2; exit 2;; esac
for s in ${BENCH_SIZES:-}; do
  case $s in 8|4096|65536|1048576) ;; *) echo "HOST: BENCH_SIZES takes 8 4096 65536 1048576" >&2; exit 2;; esac
done
case $TWO_NODES in 0|1|only) ;; *) echo "HOST: TWO_NODES must be 0, 1 or only" >&2; exit 2;; esac
NODES=${NODES:-0}
case $NODES:$TWO_NODES:$BENCH_ONLY in 0:*|[3-9]:0:0) ;; *) echo "HOST: NODES takes 3 to 9, alone (no TWO_NODES, no BENCH_ONLY)" >&2; exit 2;; esac
if [ "$TWO_NODES" = 0 ] && [ "$NODES" = 0 ]; then KERNEL=${KERNEL:-6.12}; else KERNEL=${KERNEL:-7}; fi
t0=$(date +%s.%N); stamp() { printf 'HOST: %-28s %6.1fs\n' "$1" "$(echo "$(date +%s.%N) - $t0" | bc)"; }
die() { echo "HOST: $*" >&2; echo "0 passed, 1 failed"; exit 1; }
command -v cargo >/dev/null || die "cargo not found"
command -v bc >/dev/null || die "bc not found"
command -v apt-get >/dev/null && command -v dpkg >/dev/null || die "apt-get and dpkg are needed"
case $TWO_NODES:$KERNEL in
  0:*|*:7*) ;;
  *) die "TWO_NODES needs KERNEL=7: the rxe of $KERNEL does not follow network namespaces (RDMA traffic between them times out)";;
esac
case $NODES:$KERNEL in
  0:*|*:7*) ;;
  *) die "NODES needs KERNEL=7: the rxe of $KERNEL does not follow network namespaces";;
esac

# --- 1. project binaries (release)
cd "$ROOT"
BIN=$W/bin; rm -rf "$BIN"; mkdir -p "$BIN"
: > "$W/tests.list"
build_one() {  # build_one NAME: examples/NAME.rs or tests/NAME.rs, copied to $BIN/NAME
  [ -e "$BIN/$1" ] && return 0
  if [ -f "examples/$1.rs" ]; then
    cargo build --release --example "$1" 2>>"$W/build.log" || { tail -30 "$W/build.log"; die "building $1 failed"; }
    cp "target/release/examples/$1" "$BIN/$1"
  elif [ -f "tests/$1.rs" ]; then
    cargo test --release --no-run ${FEATURES:+--features "$FEATURES"} --message-format=json --test "$1" > "$W/build1.json" 2>>"$W/build.log" \
      || { tail -30 "$W/build.log"; die "building $1 failed"; }
    exe=$(grep '"reason":"compiler-artifact"' "$W/build1.json" | grep '"executable":"/' \
      | sed -e 's/.*"executable":"\([^"]*\)".*/\1/' | tail -1)
    [ -n "$exe" ] || die "no executable for tests/$1.rs"
    cp "$exe" "$BIN/$1"
  else
    die "two-nodes.list names $1: no examples/$1.rs or tests/$1.rs"
  fi
}
if [ "$NODES" != 0 ]; then   # the N-node mode alone
  FEATURES=etcd build_one membership_nodes
  echo "nodes $NODES membership_nodes ${BENCH_RUNS:-7} ${NODES_TTL_MS:-2000}" >> "$W/tests.list"
elif [ "$BENCH_ONLY" = 1 ]; then
  build_one rdma_pingpong
  echo "bench-loopback ${BENCH_RUNS:-7} ${BENCH_SIZES:-8 4096 65536 1048576}" >> "$W/tests.list"
elif [ "$TWO_NODES" != only ]; then
cargo test --release --no-run --message-format=json --test 'rdma_*' > "$W/build.json" 2>"$W/build.log" \
  || { tail -30 "$W/build.log"; die "building the tests failed"; }
# "name executable" of each test executable (cargo's JSON lines, read without jq or python).
grep '"reason":"compiler-artifact"' "$W/build.json" | grep '"executable":"/' \
  | sed -e 's/.*"target":{[^}]*"name":"\([^"]*\)".*"executable":"\([^"]*\)".*/\1 \2/' \
  | grep '^rdma_' > "$W/tests.raw" || true
while read -r name exe; do cp "$exe" "$BIN/$name"; echo "test $name" >> "$W/tests.list"; done < "$W/tests.raw"
for ex in examples/rdma_*.rs examples/gpu_rdma_*.rs examples/probe.rs; do
  name=$(basename "$ex" .rs)
  cargo build --release --example "$name" 2>>"$W/build.log" || { tail -30 "$W/build.log"; die "building $name failed"; }
  cp "target/release/examples/$name" "$BIN/$name"; echo "example $name" >> "$W/tests.list"
done
# The criterion bench, run once per benchmark (`--test`) in the VM: proves it works on a device.
cargo bench --no-run --message-format=json --bench rdma > "$W/bench.json" 2>>"$W/build.log" \
  || { tail -30 "$W/build.log"; die "building the rdma bench failed"; }
exe=$(grep '"reason":"compiler-artifact"' "$W/bench.json" | grep '"executable":"/' \
  | sed -e 's/.*"executable":"\([^"]*\)".*/\1/' | tail -1)
[ -n "$exe" ] && cp "$exe" "$BIN/rdma_bench" && echo "bench rdma_bench" >> "$W/tests.list"
# The loopback baselines belong to the default run (6.12): on 7.3 rdma_pingpong --only ends too
# often with an unacknowledged last send (README, "Kernels").
[ "$TWO_NODES" = 0 ] && echo "bench-loopback ${BENCH_RUNS:-2}" >> "$W/tests.list"
fi
if [ "${BENCH_TWO_PROCS:-0}" = 1 ]; then   # ours again, server and client as two processes
  cp "$BIN/rdma_pingpong" "$BIN/rdma_pingpong_procs"
fi
n=0
for b in ${BASE_PINGPONG:-}; do   # other builds of rdma_pingpong, benched beside it
  [ -x "$b" ] || die "BASE_PINGPONG: $b is not an executable"
  n=$((n + 1)); cp "$b" "$BIN/rdma_pingpong_base$n"
done
n=0
for b in ${BASE_TRANSFER:-}; do   # other builds of the transfer example, benched beside it
  [ -x "$b" ] || die "BASE_TRANSFER: $b is not an executable"
  n=$((n + 1)); cp "$b" "$BIN/transfer_base$n"
done
MCDIR=
if [ -n "${MOONCAKE_WHEEL:-}" ]; then
  [ "$TWO_NODES" != 0 ] || die "MOONCAKE_WHEEL runs between the two nodes: set TWO_NODES"
  [ -f "$MOONCAKE_WHEEL" ] || die "MOONCAKE_WHEEL: $MOONCAKE_WHEEL is not a file"
  # Its bench and the libraries bundled beside it (RPATH \$ORIGIN/../<package>.libs: kept as laid out).
  MCDIR=$W/mooncake/$(basename "$MOONCAKE_WHEEL" .whl)
  if [ ! -x "$MCDIR/mooncake/transfer_engine_bench" ]; then
    rm -rf "$MCDIR"; mkdir -p "$MCDIR"
    python3 - "$MOONCAKE_WHEEL" "$MCDIR" <<'PY' || die "MOONCAKE_WHEEL: no mooncake/transfer_engine_bench in it"
import os, sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
names = [n for n in z.namelist() if n == "mooncake/transfer_engine_bench"
         or (n.split("/")[0].endswith(".libs") and not n.endswith("/"))]
if "mooncake/transfer_engine_bench" not in names:
    sys.exit(1)
for n in names:
    z.extract(n, sys.argv[2])
os.chmod(os.path.join(sys.argv[2], "mooncake/transfer_engine_bench"), 0o755)
PY
  fi
  printf 'MC_CONFIGS="%s"\nMC_SIZES="%s"\nMC_SECONDS=%s\n' "${MOONCAKE_CONFIGS:-1:1 64:1 1:4 64:4}" \
    "${MOONCAKE_SIZES:-4096 65536 1048576}" "${MOONCAKE_SECONDS:-3}" > "$W/mooncake.conf"
fi
if [ "$TWO_NODES" != 0 ]; then
  build_one rdma_pingpong   # bench-pair
  build_one transfer        # bench-pair's transfer bench
  # The list's pair entries, or those whose label PAIR_ONLY (an extended regex) matches.
  pairs_listed() {
    grep -E '^pair ' "$HERE/two-nodes.list" | awk -v re="${PAIR_ONLY:-.}" '$2 ~ re'
  }
  if [ "${PAIRS:-1}" != 0 ]; then
    # The binary: the first word after the label that is not a NAME=VALUE assignment.
    while read -r _ label rest; do
      for bin in $rest; do case $bin in *=*) ;; *) break;; esac; done
      build_one "$bin"
    done < <(pairs_listed)
    pairs_listed >> "$W/tests.list"
  fi
  parts=${BENCH_PARTS:-pingpong transfer${MCDIR:+ mooncake}}
  case " $parts " in *" mooncake "*) [ -n "$MCDIR" ] || die "BENCH_PARTS names mooncake: set MOONCAKE_WHEEL";; esac
  echo "bench-pair ${BENCH_RUNS:-5} $parts" >> "$W/tests.list"
fi
for b in "$BIN"/*; do
  if ldd "$b" | grep -qE 'libibverbs|librdmacm'; then die "$(basename "$b") links rdma-core at build time"; fi
done
[ -s "$W/tests.list" ] || die "no rdma test binaries found"
echo "HOST: binaries: $(ls "$BIN" | tr '\n' ' ')"
stamp "project built"
cd "$W"

# --- 2. private APT configs (bookworm family for user space + qemu; kernel suite separately)
mkapt() {  # mkapt DIR "suite..."  -- mirrors are taken from this machine's own apt sources
  mkdir -p "$1"/lists/partial "$1"/archives/partial "$1"/cache
  : > "$1/sources.list"
  main_uri=$(awk '/^URIs:/{print $2; exit}' /etc/apt/sources.list.d/debian.sources)
  sec_uri=$(awk '/^URIs:/{u=$2} /^Suites:.*-security/{print u; exit}' /etc/apt/sources.list.d/debian.sources)
  for s in $2; do
    case $s in *-security) u=$sec_uri;; *) u=$main_uri;; esac
    echo "deb [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] $u $s main" >> "$1/sources.list"
  done
  printf 'Dir::Etc::SourceList "%s/sources.list";\nDir::Etc::SourceParts "/dev/null";\nDir::State::Lists "%s/lists";\nDir::Cache "%s/cache";\nDir::Cache::Archives "%s/archives";\nAPT::Sandbox::User "root";\n' "$1" "$1" "$1" "$1" > "$1/apt.conf"
  # Cached lists younger than a day are reused.
  if [ -z "$(find "$1/lists" -name '*Packages*' -mmin -1440 2>/dev/null | head -1)" ]; then
    APT_CONFIG=$1/apt.conf apt-get -qq update
  fi
}
mkapt "$W/apt" "bookworm bookworm-updates bookworm-security bookworm-backports"
case $KERNEL in
  6.12) KSUITE=bookworm-backports;;
  7*)   KSUITE=trixie-backports;;
  *) die "unknown KERNEL=$KERNEL";;
esac
KAPT=$W/apt-k-$KSUITE; mkapt "$KAPT" "$KSUITE"
stamp "apt lists"

# --- 3. host tools: qemu-system-x86 and cpio, unpacked under $W/host
if [ ! -x "$W/host/usr/bin/qemu-system-x86_64" ]; then
  APT_CONFIG=$W/apt/apt.conf apt-get -qq install -d -y --no-install-recommends -t bookworm-backports qemu-system-x86 >/dev/null
  mkdir -p debs/hosttools && (cd debs/hosttools && APT_CONFIG=$W/apt/apt.conf apt-get -qq download cpio)
  mkdir -p host && for d in apt/archives/*.deb debs/hosttools/*.deb; do dpkg -x "$d" host; done
fi
stamp "qemu ready"

# --- 4. guest user space
if [ ! -x "$W/gpkgs/usr/bin/ib_write_lat" ]; then
  mkdir -p debs/guest && (cd debs/guest && APT_CONFIG=$W/apt/apt.conf apt-get -qq download \
     busybox-static kmod iproute2 ibverbs-utils ibverbs-providers libibverbs1 libibverbs-dev \
     libnl-3-200 libnl-route-3-200 librdmacm1 perftest libpci3 libibumad3)
  mkdir -p gpkgs && for d in debs/guest/*.deb; do dpkg -x "$d" gpkgs; done
fi
if ! ls "$W"/gpkgs/usr/lib/*/libibumad.so.3 >/dev/null 2>&1; then   # ib_send_lat needs it
  mkdir -p debs/umad && (cd debs/umad && APT_CONFIG=$W/apt/apt.conf apt-get -qq download libibumad3)
  for d in debs/umad/*.deb; do dpkg -x "$d" gpkgs; done
fi
if [ "$NODES" != 0 ] && [ ! -x "$W/gpkgs/usr/bin/etcd" ]; then   # etcd inside the VM
  mkdir -p debs/etcd && (cd debs/etcd && APT_CONFIG=$W/apt/apt.conf apt-get -qq download etcd-server)
  for d in debs/etcd/*.deb; do dpkg -x "$d" gpkgs; done
fi
mkdir -p tools; for t in depmod modprobe modinfo; do ln -sf ../gpkgs/bin/kmod tools/$t; done
stamp "guest packages ready"

# --- 5. kernel (vmlinuz + modules only; never installed on the host)
KMETA=$(APT_CONFIG=$KAPT/apt.conf apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-/{print $2; exit}')
KV=${KMETA#linux-image-}
KDIR=$W/kernel-$KV
if [ ! -d "$KDIR" ]; then
  mkdir -p debs/kernel-$KV && cd debs/kernel-$KV
  APT_CONFIG=$KAPT/apt.conf apt-get -qq download "$KMETA"
  if [ "$(dpkg -c "$KMETA"_*.deb | grep -c vmlinuz)" = 0 ]; then
    APT_CONFIG=$KAPT/apt.conf apt-get -qq download "linux-binary-$KV" "linux-modules-$KV" "linux-base-$KV"
  fi
  mkdir -p "$KDIR"; for d in *.deb; do dpkg -x "$d" "$KDIR"; done
  cd "$W"
fi
if [ -d "$KDIR/usr/lib/modules/$KV" ]; then KROOT=$KDIR/usr; else KROOT=$KDIR; fi
for VMLINUZ in "$KDIR/boot/vmlinuz-$KV" "$KROOT/lib/modules/$KV/vmlinuz"; do [ -f "$VMLINUZ" ] && break; done
[ -s "$KROOT/lib/modules/$KV/modules.dep.bin" ] || tools/depmod -b "$KROOT" "$KV"   # unpacked once
stamp "kernel $KV ready"

# --- 6. initramfs with the project binaries
echo "${TWO_NODES_NETNS:-shared}" > "$W/netns"
CPIO=$W/host/bin/cpio KV=$KV KROOT=$KROOT TEST_SH=$HERE/scripts/test.sh HERE=$HERE NETNS_FILE=$W/netns NODES=$NODES \
  MOONCAKE_DIR=$MCDIR MOONCAKE_CONF=${MCDIR:+$W/mooncake.conf} \
  TEST_LIST=$W/tests.list EXTRA_BINS="$(ls -d "$BIN"/* | tr '\n' ' ') ${GUEST_TOOLS:-}" \
  "$HERE/scripts/build-initramfs.sh" >/dev/null
stamp "initramfs built"

# --- 7. boot and run
ACCEL=${ACCEL:-auto}
if [ "$ACCEL" = auto ]; then
  if [ -w /dev/kvm ] && [ ! -d /sys/module/kvm_pvm ] && grep -qwE 'vmx|svm' /proc/cpuinfo; then ACCEL=kvm; else ACCEL=tcg; fi
fi
LOG=$W/vm-$KV-$ACCEL.log
if [ "$TWO_NODES" = 0 ] && [ "$NODES" = 0 ]; then VM_TIMEOUT=${VM_TIMEOUT:-1500}; elif [ -n "$MCDIR" ]; then VM_TIMEOUT=${VM_TIMEOUT:-5400}; else VM_TIMEOUT=${VM_TIMEOUT:-1800}; fi
# 7.x under TCG: with its default lazy preemption (and the CPU-bug mitigations) a kworker of rxe
# waits for the tick behind a polling thread; these two bring its latency back to 6.12's. And the
# TSC stays the clock source: the watchdog may otherwise find it skewed under TCG and switch to the
# HPET in the middle of a boot, where every clock read is a system call and an emulated device
# read (costing programs that read the clock through clock_gettime, not perftest, which reads the
# TSC itself).
case $KERNEL in 7*) APPEND=${APPEND-preempt=full mitigations=off tsc=reliable};; esac
load0=$(cut -d' ' -f1-3 /proc/loadavg)
VM_TIMEOUT=$VM_TIMEOUT MEM=${MEM:-2G} ACCEL=$ACCEL VMLINUZ=$VMLINUZ LOG=$LOG APPEND=${APPEND:-} \
  "$HERE/scripts/boot-vm.sh" > /dev/null 2>&1 || true
stamp "vm finished"
echo "HOST: load before: $load0; after: $(cut -d' ' -f1-3 /proc/loadavg) ($(nproc) cores)"
grep -a -E '^(RXE-|TWO-NODES|N-NODES|NNODES|\[n[0-9]\] (NNODES-BENCH|node-[0-9]+: round)|GID\[|test |running |SKIPPED|FAILED|REPORT|thread |rdma_pingpong|loopback|send/recv|RDMA |bandwidth|latency|server:|\[[ab]\] )|panicked|test result' "$LOG" || true
echo "HOST: full log: $LOG"
summary=$(grep -a -E '^[0-9]+ passed, [0-9]+ failed' "$LOG" | tail -1 | tr -d '\r')
if [ -z "$summary" ]; then
  echo "HOST: the VM did not finish the test script (timeout or crash)"
  n=$(wc -l < "$W/tests.list"); grep -q '^bench-loopback' "$W/tests.list" && n=$((n + 1))
  echo "0 passed, $n failed"; exit 1
fi
echo "$summary"
case $summary in *" 0 failed") exit 0;; *) exit 1;; esac
