#!/usr/bin/env bash
# Builds one guest image profile from Debian packages only, into OUT (a cache folder).
#   images/build.sh PROFILE OUT
# Profiles: tiny (kernel + busybox initramfs, no disk), web, db, py (bookworm), web-trixie, py-trixie.
# Prints "== step: ..." lines for progress. Idempotent per step: finished steps leave stamps.
set -euo pipefail
profile=$1
out=$2
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
current="start"
step() { current="$*"; echo "== step: $*"; }
trap 'echo "memfold image build: step \"$current\" failed (profile $profile, into $out)" >&2' ERR

case "$profile" in
    tiny) release=; packages= ;;
    web) release=bookworm; packages="iproute2 nginx-light curl" ;;
    web-trixie) release=trixie; packages="iproute2 nginx curl" ;;
    db) release=bookworm; packages="iproute2 postgresql postgresql-contrib redis-server redis-tools" ;;
    py) release=bookworm; packages="iproute2 python3" ;;
    py-trixie) release=trixie; packages="iproute2 python3" ;;
    *) echo "unknown profile '$profile' (tiny, web, db, py, web-trixie, py-trixie)" >&2; exit 2 ;;
esac

kernel_dir=$(dirname "$out")/kernel
# --- kernel: Debian's stock kernel package, unpacked (not installed on the host) ---
if [ ! -f "$kernel_dir/.done" ]; then
    step "kernel: downloading Debian's linux-image-amd64"
    rm -rf "$kernel_dir.tmp"; mkdir -p "$kernel_dir.tmp"
    pkg=$(apt-cache depends linux-image-amd64 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
    if [ -z "$pkg" ]; then
        apt-get update -qq
        pkg=$(apt-cache depends linux-image-amd64 | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
    fi
    [ -n "$pkg" ] || { echo "no linux-image package found (run apt-get update)" >&2; exit 1; }
    (cd "$kernel_dir.tmp" && apt-get download -q "$pkg" >/dev/null && dpkg-deb -x ./*.deb root && rm -f ./*.deb) || {
        rm -rf "$kernel_dir.tmp"
        exit 1
    }
    cp "$kernel_dir.tmp"/root/boot/vmlinuz-* "$kernel_dir.tmp/vmlinuz"
    kver=$(ls "$kernel_dir.tmp/root/lib/modules")
    echo "$kver" > "$kernel_dir.tmp/version"
    rm -rf "$kernel_dir"; mv "$kernel_dir.tmp" "$kernel_dir"
    touch "$kernel_dir/.done"
fi
kver=$(cat "$kernel_dir/version")
cp "$kernel_dir/vmlinuz" "$out/vmlinuz"

# --- initramfs: busybox; for disk profiles it loads virtio-blk and ext4 and switches root ---
# (and virtio_balloon: the root file system has no modules, and a guest with a balloon
# device, the kernel-kit peer's free page reporting, needs its driver; without one it idles)
step "initramfs"
ird=$(mktemp -d)
trap 'rm -rf "$ird"' EXIT
mkdir -p "$ird"/{bin,proc,sys,dev,tmp,newroot,lib/modules}
# The initramfs has no libc: a dynamically linked busybox (Debian's busybox package)
# would leave the guest without an /init; fail here rather than cache a guest that panics.
{ LC_ALL=C ldd /bin/busybox 2>&1 || true; } | grep -qE "not a dynamic executable|statically linked" \
    || { echo "build.sh: /bin/busybox is linked dynamically; install busybox-static" >&2; exit 1; }
cp /bin/busybox "$ird/bin/busybox"
# The tiny guest loads only the virtio stack: the balloon (memfoldd's entitlements drive it)
# and virtio-blk (a data disk its cache reader reads, when it has one).
# And virtio_console: the enlightened guest's port to memfoldd (memfold-guest, issue 17).
modules="virtio_ring virtio virtio_pci_legacy_dev virtio_pci_modern_dev virtio_pci virtio_balloon virtio_blk virtio_console"
[ "$profile" = tiny ] || modules="crc16 crc32c_generic mbcache jbd2 ext4 $modules"
for m in $modules; do
    f=$(find "$kernel_dir/root/lib/modules/$kver" -name "$m.ko*" | head -1)
    [ -n "$f" ] || continue   # built into the kernel
    case "$f" in
        *.xz) xz -dc "$f" > "$ird/lib/modules/$m.ko" ;;
        *.zst) zstd -qdc "$f" > "$ird/lib/modules/$m.ko" ;;
        *) cp "$f" "$ird/lib/modules/$m.ko" ;;
    esac
    echo "$m" >> "$ird/lib/modules/order"
done
if [ "$profile" = tiny ]; then
    cp "$here/tiny-init" "$ird/init"
    cp "$here/mechanism-data" "$ird/memfold-mechanism-data"
    # The side-channel probe (images/memfold-probe.rs, built by memfold-vm's build script
    # and written beside these scripts): run when the kernel command line asks for it.
    install -m 0755 "$here/memfold-probe" "$ird/bin/memfold-probe"
    # The enlightened guest's agent (images/memfold-guest.rs, built likewise): tiny-init
    # starts it at boot; it answers memfoldd on the virtio-serial port org.memfold.guest.0.
    install -m 0755 "$here/memfold-guest" "$ird/bin/memfold-guest"
else
    cp "$here/disk-init" "$ird/init"
    # The workload and self-check ride in the initramfs (disk-init copies them into the
    # throw-away root): changing them rebuilds the initramfs, not the rootfs.
    mkdir -p "$ird/memfold"
    cp "$here/guest-init" "$ird/memfold/memfold-init"
    cp "$here/selfcheck.sh" "$ird/memfold/memfold-selfcheck"
    cp "$here/mechanism-data" "$ird/memfold/memfold-mechanism-data"
    # The enlightened guest's agent too (issue 17): guest-init starts it when it is there.
    install -m 0755 "$here/memfold-guest" "$ird/memfold/memfold-guest"
fi
chmod +x "$ird/init"
(cd "$ird" && find . | cpio -o -H newc 2>/dev/null | gzip -1 > "$out/initrd.img")

# The root file system is built again when its recipe changes (a warm cache kept one
# without a package added since, and fresh and warm machines then ran different guests):
# the release, the packages and this block's own text (how db is initialised, what is
# written into it), or when its file is gone.
recipe="$release $packages $(sed -n '/^# rootfs: begin/,/^# rootfs: end/p' "$0" | sha256sum | cut -c1-16)"
# rootfs: begin
if [ -n "$release" ] && { [ ! -s "$out/rootfs.ext4" ] || [ "$(cat "$out/.rootfs-done" 2>/dev/null)" != "$recipe" ]; }; then
    root="$out/rootfs.tmp"
    rm -rf "$root"
    step "debootstrap $release (minbase)"
    debootstrap --variant=minbase "$release" "$root" >"$out/debootstrap.log" 2>&1 || { tail -20 "$out/debootstrap.log" >&2; exit 1; }
    step "packages: $packages"
    mount -t proc proc "$root/proc"
    trap 'umount "$root/proc" 2>/dev/null || true; rm -rf "$ird"' EXIT
    # No daemons start inside the chroot while installing.
    printf '#!/bin/sh\nexit 101\n' > "$root/usr/sbin/policy-rc.d"; chmod +x "$root/usr/sbin/policy-rc.d"
    chroot "$root" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $packages >"$out/apt.log" 2>&1 || { tail -20 "$out/apt.log" >&2; exit 1; }
    rm -f "$root/usr/sbin/policy-rc.d"
    echo "$profile" > "$root/etc/memfold-profile"
    case "$profile" in
        db)
            step "db: initialise postgresql and pgbench tables"
            pgbin=$(ls -d "$root"/usr/lib/postgresql/*/bin | head -1); pgbin=${pgbin#"$root"}
            chroot "$root" su postgres -s /bin/sh -c "rm -rf /var/lib/postgresql/data && $pgbin/initdb -D /var/lib/postgresql/data -A trust >/dev/null"
            chroot "$root" su postgres -s /bin/sh -c "$pgbin/pg_ctl -D /var/lib/postgresql/data -o '-k /tmp -c listen_addresses=' -w start >/dev/null && { $pgbin/pgbench -h /tmp -i -s 4 postgres >/dev/null 2>&1; rc=\$?; $pgbin/pg_ctl -D /var/lib/postgresql/data -w stop >/dev/null; exit \$rc; }" || { echo "build.sh: db: pgbench -i failed" >&2; exit 1; }
            echo "$pgbin" > "$root/etc/memfold-pgbin"
            ;;
    esac
    umount "$root/proc"
    chroot "$root" apt-get clean
    rm -rf "$root"/var/lib/apt/lists/*
    step "rootfs.ext4"
    size_mb=$(( $(du -sm "$root" | cut -f1) * 13 / 10 + 64 ))
    rm -f "$out/rootfs.ext4"
    mkfs.ext4 -q -F -L memfold -d "$root" "$out/rootfs.ext4" "${size_mb}M"
    rm -rf "$root"
    echo "$recipe" > "$out/.rootfs-done"
fi
# rootfs: end
echo "$profile" > "$out/profile"
step "done: $out"
