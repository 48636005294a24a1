# Sourced by run.sh: builds the emulated L1 guest into $LANE/cache, one cached stage at a time.
# Everything comes from Debian and PyPI packages; nothing here touches the checkout.

KVER=${KVER:-$(cat "$C/kver" 2>/dev/null || true)}
SMOL_VERSION=${SMOL_VERSION:-1.32.2}
DISK_SIZE=${DISK_SIZE:-12G}
ROOTFS_REV=3   # bump to force a rootfs (and disk) rebuild

# The Debian mirror apt is configured with (debootstrap must use the same one).
apt_mirror() {
  local m
  m=$(awk '/^URIs:/ {print $2; exit}' /etc/apt/sources.list.d/*.sources 2>/dev/null)
  [ -n "$m" ] || m=$(awk '$1 == "deb" {print $2; exit}' /etc/apt/sources.list 2>/dev/null)
  [ -n "$m" ] || die "no Debian mirror configured for apt"
  echo "$m"
}

# The project's runtime dependencies (from pyproject.toml) plus what the guest job needs.
guest_requirements() {
  python3 - "$ROOT/pyproject.toml" "$SMOL_VERSION" <<'PY'
import sys, tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
deps = [d for d in deps if not d.startswith("smolmachines")]
print("\n".join(sorted(deps + ["smolmachines==" + sys.argv[2], "pytest>=8", "pytest-timeout", "numpy"])))
PY
}

host_tools() {
  local need=() b
  for b in qemu-system-x86_64:qemu-system-x86 debootstrap:debootstrap depmod:kmod \
           mkfs.ext4:e2fsprogs cpio:cpio zstd:zstd; do
    command -v "${b%%:*}" >/dev/null 2>&1 || [ -x "/sbin/${b%%:*}" ] || need+=("${b##*:}")
  done
  [ ${#need[@]} -eq 0 ] && return 0
  log "apt-get install ${need[*]}"
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
}

resolve_kernel() {
  [ -n "$KVER" ] && return 0
  apt-get update -qq
  KVER=$(apt-cache depends linux-image-amd64 | awk -F'linux-image-' '/Depends:/ {print $2; exit}')
  [ -n "$KVER" ] || die "cannot resolve linux-image-amd64"
  echo "$KVER" > "$C/kver"
}

kernel() {
  local K=$C/kernel
  [ -f "$K/done" ] && return 0
  log "kernel: linux-image-$KVER + busybox-static"
  rm -rf "$K"; mkdir -p "$K"; chmod 777 "$K"
  (cd "$K" && apt-get download -q "linux-image-$KVER" busybox-static >/dev/null 2>&1)
  dpkg-deb -x "$K"/linux-image-*.deb "$K/x"
  dpkg-deb -x "$K"/busybox-static_*.deb "$K/bb"
  /sbin/depmod -b "$K/x" "$KVER"
  touch "$K/done"
}

initramfs() {
  local K=$C/kernel IR=$C/initramfs f rel files
  [ -f "$C/initrd.img" ] && return 0
  log "initramfs: busybox + virtio_pci/virtio_blk/ext4"
  rm -rf "$IR"; mkdir -p "$IR"/{bin,dev,proc,sys,newroot,lib/modules/$KVER}
  cp "$K/bb/bin/busybox" "$IR/bin/busybox"
  files=$(for m in virtio_pci virtio_blk crc32c_generic ext4; do
            /sbin/modprobe -d "$K/x" -S "$KVER" --show-depends "$m"; done | awk '/^insmod/ {print $2}' | sort -u)
  for f in $files; do
    rel=${f#"$K"/x/}
    mkdir -p "$IR/$(dirname "$rel")"; cp "$f" "$IR/$rel"
  done
  cp "$K/x/lib/modules/$KVER"/modules.{order,builtin,builtin.modinfo} "$IR/lib/modules/$KVER/"
  /sbin/depmod -b "$IR" "$KVER"
  cp "$HERE/guest/initramfs-init" "$IR/init"; chmod +x "$IR/init"
  (cd "$IR" && find . | cpio -o -H newc --quiet | gzip -1) > "$C/initrd.img.tmp"
  mv "$C/initrd.img.tmp" "$C/initrd.img"
}

rootfs_base() {
  [ -f "$C/rootfs-base.done" ] && return 0
  log "debootstrap bookworm minbase for L1 (a few minutes)"
  rm -rf "$C/rootfs-base"; mkdir -p "$C/debs"
  debootstrap --variant=minbase --cache-dir="$C/debs" \
    --include=python3,python3-venv,kmod,procps,iproute2,ca-certificates,e2fsprogs \
    bookworm "$C/rootfs-base" "$(apt_mirror)" > "$C/debootstrap.log" 2>&1 \
    || die "debootstrap failed: see $C/debootstrap.log"
  touch "$C/rootfs-base.done"
}

wheels() {
  local req=$C/requirements.txt
  guest_requirements > "$req.new"
  if [ -f "$C/wheels.done" ] && cmp -s "$req.new" "$req"; then rm "$req.new"; return 0; fi
  mv "$req.new" "$req"
  log "pip download wheels for the L1 guest (cp311 manylinux x86_64)"
  rm -rf "$C/wheels"; mkdir -p "$C/wheels"
  python3 -m pip download -q --only-binary=:all: --python-version 3.11 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d "$C/wheels" -r "$req" > "$C/wheels.log" 2>&1 \
    || die "pip download failed: see $C/wheels.log"
  rm -f "$C/rootfs.done"
  touch "$C/wheels.done"
}

rootfs() {
  local R=$C/rootfs
  [ "$(cat "$C/rootfs.done" 2>/dev/null)" = "$ROOTFS_REV" ] && return 0
  log "rootfs: base + kernel modules + venv with the project's dependencies"
  rm -rf "$R"; cp -a "$C/rootfs-base" "$R"
  mkdir -p "$R/lib/modules"; cp -a "$C/kernel/x/lib/modules/$KVER" "$R/lib/modules/"
  chroot "$R" /sbin/depmod "$KVER"
  chroot "$R" groupadd -r kvm 2>/dev/null || true
  rm -rf "$R/opt/wheels"; mkdir -p "$R/opt/wheels"; cp "$C"/wheels/*.whl "$R/opt/wheels/"
  cp "$C/requirements.txt" "$R/opt/requirements.txt"
  chroot "$R" python3 -m venv /opt/venv
  chroot "$R" /opt/venv/bin/pip install -q --no-index --find-links /opt/wheels -r /opt/requirements.txt \
    > "$C/rootfs-pip.log" 2>&1 || die "pip install in the rootfs failed: see $C/rootfs-pip.log"
  rm -rf "$R/opt/wheels"
  echo vmlane > "$R/etc/hostname"
  printf '127.0.0.1 localhost vmlane\n::1 localhost\n' > "$R/etc/hosts"
  install -m 0755 "$HERE/guest/init.sh" "$R/sbin/vmlane-init"
  rm -f "$C/prewarm.done"
  echo "$ROOTFS_REV" > "$C/rootfs.done"
}

# smol decompresses its sparse disk templates and extracts its agent rootfs on first use:
# ~40 s natively, 10+ min of emulated CPU in L1. Machine.create runs natively in a chroot up
# to the point where it needs /dev/kvm (absent there), which leaves those caches in place.
prewarm() {
  local R=$C/rootfs
  [ -f "$C/prewarm.done" ] && return 0
  log "prewarm: smol's disk templates and agent rootfs, natively"
  mountpoint -q "$R/proc" || mount -t proc proc "$R/proc"
  chroot "$R" /usr/bin/env -i PATH=/opt/venv/bin:/usr/bin:/bin HOME=/root /opt/venv/bin/python -c '
from smol import ConnectOptions, Machine, MachineConfig, ResourceSpec
try:
    Machine.create(MachineConfig(name="prewarm", resources=ResourceSpec(cpus=1, memory_mb=256, network=False)), ConnectOptions(target="local"))
except Exception as e:
    print("prewarm: expected failure without /dev/kvm:", str(e).splitlines()[0])
' >> "$C/prewarm.log" 2>&1 || true
  umount "$R/proc"
  rm -rf "$R/root/.local/share/smolvm/server" "$R/root/.cache/smolvm/vms"
  ls "$R"/opt/venv/lib/python3.11/site-packages/smol/*.ext4 >/dev/null 2>&1 \
    || die "prewarm left no unpacked disk templates: see $C/prewarm.log"
  rm -f "$C/disk.img"
  touch "$C/prewarm.done"
}

# The microVMs' image: a Debian rootfs with python3, as a directory (/srv/pyimg) and as a
# one-layer `docker save` archive (/srv/pyimg.tar); no registry is reachable from the lane.
pyimg() {
  if [ ! -f "$C/pyimg.done" ]; then
    log "debootstrap the microVM image (minbase + python3)"
    rm -rf "$C/pyimg"
    debootstrap --variant=minbase --cache-dir="$C/debs" --include=python3 bookworm "$C/pyimg" \
      "$(apt_mirror)" > "$C/pyimg.log" 2>&1 || die "debootstrap failed: see $C/pyimg.log"
    rm -rf "$C"/pyimg/usr/share/{doc,man,locale,info} "$C"/pyimg/var/cache/apt/* "$C"/pyimg/var/lib/apt/lists/*
    touch "$C/pyimg.done"
  fi
  [ -f "$C/rootfs/srv/pyimg.done" ] && return 0
  rm -rf "$C/rootfs/srv/pyimg" "$C/rootfs/srv/pyimg.tar"
  cp -a "$C/pyimg" "$C/rootfs/srv/pyimg"
  python3 "$HERE/mkarchive.py" "$C/pyimg" "$C/rootfs/srv/pyimg.tar" pyimg:latest > /dev/null
  rm -f "$C/disk.img"
  touch "$C/rootfs/srv/pyimg.done"
}

disk() {
  [ -f "$C/disk.img" ] && return 0
  log "disk: mkfs.ext4 -d rootfs ($DISK_SIZE sparse)"
  mkfs.ext4 -q -F -L vmlaneroot -d "$C/rootfs" "$C/disk.img.tmp" "$DISK_SIZE"
  mv "$C/disk.img.tmp" "$C/disk.img"
}

build() {
  local t0=$SECONDS
  host_tools; resolve_kernel; kernel; initramfs; rootfs_base; wheels; rootfs; prewarm; pyimg; disk
  log "build ready in $((SECONDS - t0)) s ($C)"
}
