#!/bin/bash
# Build initrd.cpio.gz for the rxe VM from extracted Debian packages ($P) plus host glibc.
set -euo pipefail
W=${W:?work dir}; HERE=${HERE:?folder of this harness}
P=$W/gpkgs                  # dpkg -x of guest packages
KV=${KV:?kernel version}
KROOT=${KROOT:?dir holding lib/modules/$KV}
R=$W/initramfs
rm -rf "$R"; mkdir -p "$R"/{bin,sbin,usr/bin,usr/sbin,lib64,lib/x86_64-linux-gnu,lib/modules,usr/lib/x86_64-linux-gnu/libibverbs,etc/libibverbs.d,proc,sys,dev,tmp,run}
export LD_LIBRARY_PATH=$P/usr/lib/x86_64-linux-gnu:$P/lib/x86_64-linux-gnu
copy_libs() {  # copy the shared libs an ELF needs, flattened into /lib/x86_64-linux-gnu
  ldd "$1" | awk '$2=="=>" && $3 ~ /^\//{print $3} $1 ~ /^\/lib64\//{print $1}' | while read -r lib; do
    case "$lib" in */ld-linux-x86-64.so.2) cp -L "$lib" "$R/lib64/ld-linux-x86-64.so.2";; *) cp -Ln "$lib" "$R/lib/x86_64-linux-gnu/";; esac
  done
  if ldd "$1" | grep -q 'not found'; then echo "missing libs for $1" >&2; ldd "$1" >&2; exit 1; fi
}
cp "$P/bin/busybox" "$R/bin/busybox"
# RDMA user space: iproute2's rdma tool, ibverbs-utils, perftest, the rxe provider + its .driver file
for b in rdma ibv_devices ibv_devinfo ibv_rc_pingpong ibv_ud_pingpong ib_write_bw ib_read_bw ib_write_lat ib_send_lat; do
  cp "$P/usr/bin/$b" "$R/usr/bin/"; copy_libs "$P/usr/bin/$b"
done
cp "$P/sbin/ip" "$R/usr/sbin/ip"; copy_libs "$P/sbin/ip"
cp "$P/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so" "$R/usr/lib/x86_64-linux-gnu/libibverbs/"
copy_libs "$P/usr/lib/x86_64-linux-gnu/libibverbs/librxe-rdmav34.so"
cp "$P/etc/libibverbs.d/rxe.driver" "$R/etc/libibverbs.d/"
# extra binaries built on the host (C probe, Rust program)
for b in ${EXTRA_BINS:-}; do cp "$b" "$R/usr/bin/"; copy_libs "$b"; done
# Project binaries dlopen libibverbs.so.1 and librdmacm.so.1 (nothing is linked): copy them in.
for lib in libibverbs.so.1 librdmacm.so.1; do
  f=$(find "$P" -name "$lib" | head -1); cp -L "$f" "$R/lib/x86_64-linux-gnu/"; copy_libs "$f"
done
# Mooncake's bench (run.sh's MOONCAKE_WHEEL) with its bundled libraries as the wheel lays them out,
# and the system libraries it needs (libibverbs from the guest packages, the rest from here).
if [ -n "${MOONCAKE_DIR:-}" ]; then
  mkdir -p "$R/opt/mooncake"; cp -a "$MOONCAKE_DIR"/. "$R/opt/mooncake/"
  ldd "$MOONCAKE_DIR/mooncake/transfer_engine_bench" | grep -q 'not found' \
    && { echo "missing libs for Mooncake's bench" >&2; ldd "$MOONCAKE_DIR/mooncake/transfer_engine_bench" >&2; exit 1; }
  ldd "$MOONCAKE_DIR/mooncake/transfer_engine_bench" | awk '$2=="=>" && $3 ~ /^\// && $3 !~ /\.libs\//{print $3}' \
    | while read -r lib; do cp -Ln "$lib" "$R/lib/x86_64-linux-gnu/"; done
  [ -n "${MOONCAKE_CONF:-}" ] && cp "$MOONCAKE_CONF" "$R/etc/gpudirect-mooncake"
fi
[ -n "${TEST_LIST:-}" ] && cp "$TEST_LIST" "$R/etc/gpudirect-tests"
# kernel modules, decompressed, loaded by busybox insmod in the order modprobe --show-depends gives.
# KROOT/lib/modules/$KV must have had depmod run (done by run.sh).
# ib_uverbs is needed by user space but is not a hard dep of rdma_rxe on newer kernels;
# crc32_generic only exists (and is needed: rxe asks the crypto API for "crc32") on 6.x kernels.
MODS="rdma_rxe ib_uverbs rdma_ucm dummy veth"   # rdma_ucm: /dev/infiniband/rdma_cm for librdmacm; veth: two nodes
[ -n "$(find "$KROOT/lib/modules/$KV" -name 'crc32_generic.ko*' | head -1)" ] && MODS="crc32_generic $MODS"
[ "${NODES:-0}" = 0 ] || MODS="$MODS bridge"   # the N-node mode's bridge
: > "$R/etc/rxe-modules"
for m in $MODS; do
  "$W/tools/modprobe" -d "$KROOT" -S "$KV" --show-depends "$m" | awk '$1=="insmod"{print $2}'
done | awk '!seen[$0]++' | while read -r ko; do
  name=$(basename "$ko"); name=${name%.xz}; name=${name%.zst}; name=${name%.gz}
  case "$ko" in *.xz) xz -dc "$ko";; *.zst) zstd -dc "$ko";; *.gz) gzip -dc "$ko";; *) cat "$ko";; esac > "$R/lib/modules/$name"
  echo "$name" >> "$R/etc/rxe-modules"
done
cp "$HERE/scripts/guest-init.sh" "$R/init"; chmod +x "$R/init"
[ -n "${TEST_SH:-}" ] && cp "$TEST_SH" "$R/test.sh" && chmod +x "$R/test.sh"
cp "$HERE/scripts/two-nodes.sh" "$R/two-nodes.sh" && chmod +x "$R/two-nodes.sh"
if [ "${NODES:-0}" != 0 ]; then   # the N-node mode: its script and etcd (from the guest packages)
  cp "$HERE/scripts/n-nodes.sh" "$R/n-nodes.sh" && chmod +x "$R/n-nodes.sh"
  cp "$P/usr/bin/etcd" "$R/usr/bin/etcd"; copy_libs "$P/usr/bin/etcd"
fi
[ -n "${NETNS_FILE:-}" ] && cp "$NETNS_FILE" "$R/etc/gpudirect-netns"
[ -n "${EXTRA_TEST:-}" ] && cp "$EXTRA_TEST" "$R/extra-test.sh" && chmod +x "$R/extra-test.sh"
(cd "$R" && find . -print0 | "${CPIO:-cpio}" --null -o -H newc --quiet | gzip -1) > "$W/initrd.cpio.gz"
ls -la "$W/initrd.cpio.gz"
