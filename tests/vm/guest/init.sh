#!/bin/bash
# PID 1 of the L1 guest: mount the basics and the 9p share, run its job.sh, power off.
export PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin HOME=/root
mount -t proc proc /proc; mount -t sysfs sys /sys
mountpoint -q /dev || mount -t devtmpfs dev /dev
ln -sf /proc/self/fd /dev/fd; ln -sf fd/0 /dev/stdin; ln -sf fd/1 /dev/stdout; ln -sf fd/2 /dev/stderr
mkdir -p /dev/pts /dev/shm; mount -t devpts devpts /dev/pts; mount -t tmpfs -o mode=1777 tmpfs /dev/shm
mount -t tmpfs tmpfs /run; mount -t cgroup2 cgroup2 /sys/fs/cgroup 2>/dev/null
mount -o remount,rw /
ip link set lo up; hostname vmlane
modprobe 9pnet_virtio; modprobe 9p
mkdir -p /mnt/share; mount -t 9p -o trans=virtio,version=9p2000.L,msize=262144 share /mnt/share
echo "VMLANE: L1 userspace up at uptime $(cut -d' ' -f1 /proc/uptime) s"
bash /mnt/share/job.sh > /mnt/share/job.log 2>&1
echo "VMLANE: job exited rc=$? at uptime $(cut -d' ' -f1 /proc/uptime) s"
sync; umount /mnt/share 2>/dev/null; sync
echo 1 > /proc/sys/kernel/sysrq; echo o > /proc/sysrq-trigger; sleep 30
