#!/bin/busybox sh
# PID 1 inside the rxe test VM: load rdma_rxe, create rxe0 on dummy0 (with an IPv4 address, which
# rdma_cm needs), run /test.sh, power off.
/bin/busybox --install -s /bin
export PATH=/usr/bin:/usr/sbin:/bin:/sbin
mount -t proc proc /proc
mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev
mkdir -p /tmp && mount -t tmpfs tmpfs /tmp
echo "RXE-VM: init up at $(cut -d' ' -f1 /proc/uptime)s uptime, kernel $(uname -r)"
for m in $(cat /etc/rxe-modules); do
    insmod /lib/modules/$m || echo "RXE-VM: insmod $m FAILED"
done
ulimit -l unlimited
ip link set lo up
ip link show dummy0 >/dev/null 2>&1 || ip link add dummy0 type dummy
ip link set dummy0 mtu 9000
ip addr add 10.77.0.1/24 dev dummy0
ip link set dummy0 up
rdma link add rxe0 type rxe netdev dummy0 || echo "RXE-VM: rdma link add FAILED"
sleep 1   # let ib_core populate the GID table
rdma link show
if [ -x /test.sh ]; then
    /test.sh
    echo "RXE-VM: test.sh exit=$?"
fi
echo "RXE-VM: done at $(cut -d' ' -f1 /proc/uptime)s uptime"
poweroff -f
