#!/usr/bin/env bash
# Proof that `memfold libvirt enable` puts a libvirt domain under memfold with libvirt's
# DAC security driver on (issue 20): a clean Debian bookworm chroot (the minimal system
# deb-check caches), Debian's libvirt (libvirt-daemon-system: qemu.conf, the libvirt-qemu
# user, the AppArmor abstraction) and QEMU, the built memfold package; virtlogd and
# libvirtd started by hand (no systemd as PID 1 in a chroot); a domain booting memfold's
# `tiny` image (kernel + initramfs, a self-checking workload on its serial console);
# `memfold libvirt enable`, the packaged memfoldd started as its unit starts it with
# `agent-group = "libvirt-qemu"` in its configuration file, `virsh start`; QEMU must run
# as libvirt-qemu (DAC), the agent attach, memory be saved (`memfold status`) and the
# guest's self-checks pass; then `memfold libvirt disable` while it runs, `virsh destroy`,
# and the inactive XML must be what it was before enable, byte for byte. Then `enable
# --claim`, memfoldd restarted claiming entitlements (at once, 160 MiB allowance), the
# domain started again: its balloon must be driven to allowance + entitlement and the
# guest see it; destroy, disable, the XML restored again.
#
# What the chroot changes in libvirt, and why: qemu.conf `namespaces = [ ]` and
# `cgroup_controllers = [ ]` (a chroot cannot give QEMU a mount namespace or a cgroup of
# its own). Not changed: `user`/`group` (libvirt-qemu), `dynamic_ownership` (on: libvirt
# chowns the kernel, initrd and serial log to libvirt-qemu and back), `security_driver`
# (default: AppArmor if the kernel has it, else none). The chroot's /dev is its own
# tmpfs, so its /dev/userfaultfd can be given to group kvm (QEMU's supplementary group)
# without touching the host's.
#
# AppArmor: the package's rules (/etc/apparmor.d/abstractions/libvirt-qemu.d/memfold) are
# compiled with apparmor_parser inside libvirt's per-domain template, through the one
# include line docs/operations.md tells bookworm's operators to add. Whether libvirt's
# AppArmor driver confines QEMU depends on the host kernel: without AppArmor in it (no
# /sys/module/apparmor), the script says so and that part is not exercised.
#
#   flock /tmp/measure.lock bash scripts/libvirt-check.sh [PACKAGE.deb]
#   bash scripts/libvirt-check.sh --optional     # `make test`: skips (exit 0, saying why)
#
# --optional is for the README's test command: it packages the release build `make test`
# has just made (cargo deb --no-build --fast, into out/libvirt-check/deb/, no debug symbols) and
# skips cleanly, saying why, where a prerequisite is missing: root, debootstrap, cargo-deb,
# the tiny image, or Debian's mirror (apt-get update fails). A failure once everything is
# there is a failure. It does not take /tmp/measure.lock itself (neither do the guest
# tests `cargo test` runs before it).
#
# Needs root, debootstrap, network to Debian's mirror (or the cached .debs in
# ~/.cache/memfold/libvirt-check/archives) and the cached tiny image (`memfold image build
# tiny`). Boots a guest: run it under flock /tmp/measure.lock on a shared machine. Writes
# out/libvirt-check/result.txt and the logs beside it.
set -euo pipefail
cd "$(dirname "$0")/.."

optional=
if [ "${1:-}" = --optional ]; then optional=1; shift; fi
# A missing prerequisite: a skip under --optional, else an error.
missing() {
    if [ -n "$optional" ]; then echo "libvirt-check: SKIP: $*"; exit 0; fi
    echo "libvirt-check: $*" >&2; exit 1
}
[ "$(id -u)" = 0 ] || missing "needs root (debootstrap, chroot, libvirtd)"
command -v debootstrap >/dev/null || missing "debootstrap is missing (make setup)"
cache=${MEMFOLD_CACHE:-$HOME/.cache/memfold}
images=$cache/images/tiny
[ -f "$images/vmlinuz" ] && [ -f "$images/initrd.img" ] \
    || missing "no tiny image in $images (memfold image build tiny)"
if [ -n "$optional" ] && [ -z "${1:-}" ]; then
    command -v cargo-deb >/dev/null || missing "cargo-deb is missing (make deb installs it)"
    rm -rf out/libvirt-check/deb
    cargo deb -p memfold-cli --no-build --fast --output out/libvirt-check/deb/ >/dev/null 2>&1 \
        || { echo "libvirt-check: cargo deb --no-build failed (is the release build there?)" >&2; exit 1; }
    deb=$(ls out/libvirt-check/deb/memfold_*.deb)
else
    deb=${1:-$(ls -t out/deb/memfold_*.deb 2>/dev/null | head -1)}
fi
[ -n "$deb" ] && [ -f "$deb" ] || { echo "libvirt-check: no package (make deb builds out/deb/memfold_*.deb)" >&2; exit 1; }

release=bookworm
tarball=$cache/deb-check/$release-minbase.tgz
archives=$cache/libvirt-check/archives
out=out/libvirt-check
mkdir -p "$cache/deb-check" "$archives/partial" "$out"
result=$out/result.txt
: >"$result"
say() { echo "libvirt-check: $*" | tee -a "$result"; }
fail() { say "FAIL: $*"; exit 1; }
t0=$(date +%s)

if [ ! -f "$tarball" ]; then
    say "debootstrap $release (minbase) into $tarball, once"
    rm -rf "$cache/deb-check/mk"
    debootstrap --variant=minbase --make-tarball="$tarball.tmp" "$release" "$cache/deb-check/mk" \
        >"$cache/deb-check/make-tarball.log" 2>&1 || { rm -rf "$cache/deb-check/mk" "$tarball.tmp"
            tail -5 "$cache/deb-check/make-tarball.log" >&2; missing "debootstrap $release failed (no Debian mirror?)"; }
    mv "$tarball.tmp" "$tarball"
    rm -rf "$cache/deb-check/mk"
fi

root=$(mktemp -d /var/tmp/memfold-libvirt-check.XXXXXX)
# The chroot's / must be searchable by libvirt-qemu (mktemp makes it 0700).
chmod 0755 "$root"
mounted=()
daemon_pid=
domain=lvtiny
socket=/run/memfold/memfoldd.sock
pid_in() { cat "$root$1" 2>/dev/null || true; }
cleanup() {
    set +e
    if [ -S "$root/run/libvirt/libvirt-sock" ]; then
        chroot "$root" virsh -q destroy $domain >/dev/null 2>&1
    fi
    # Only what this script started, by the pids they wrote.
    local qemu; qemu=$(pid_in /run/libvirt/qemu/$domain.pid)
    [ -n "$qemu" ] && kill -9 "$qemu" 2>/dev/null
    [ -n "$daemon_pid" ] && kill "$daemon_pid" 2>/dev/null && wait "$daemon_pid" 2>/dev/null
    for f in /run/libvirtd.pid /run/virtlogd.pid; do
        local p; p=$(pid_in $f)
        [ -n "$p" ] && kill "$p" 2>/dev/null
    done
    sleep 1
    for f in /run/libvirtd.pid /run/virtlogd.pid; do
        local p; p=$(pid_in $f)
        [ -n "$p" ] && kill -9 "$p" 2>/dev/null
    done
    local i
    for (( i = ${#mounted[@]} - 1; i >= 0; i-- )); do
        umount "${mounted[i]}" || umount -l "${mounted[i]}"
    done
    # Never rm -rf across a mount left behind (a bind mount would take its source along).
    if grep -q " $root" /proc/self/mounts; then
        echo "libvirt-check: mounts left under $root; not removing it:" >&2
        grep " $root" /proc/self/mounts >&2
    else
        rm -rf "$root"
    fi
}
trap cleanup EXIT
mnt() { mount "$@"; mounted+=("${!#}"); }

say "a clean $release chroot in $root (debootstrap --unpack-tarball)"
debootstrap --variant=minbase --unpack-tarball="$(realpath "$tarball")" "$release" "$root" >"$out/debootstrap.log" 2>&1 \
    || { tail -20 "$out/debootstrap.log" >&2; exit 1; }
mnt -t proc proc "$root/proc"
mnt -t sysfs sysfs "$root/sys"
mnt -t tmpfs -o mode=0755 tmpfs "$root/run"
# A /dev of its own: the nodes QEMU and libvirt use, and /dev/userfaultfd for group kvm.
mnt -t tmpfs -o mode=0755 tmpfs "$root/dev"
mkdir -p "$root/dev/pts" "$root/dev/shm"
mnt -t devpts -o newinstance,ptmxmode=0666 devpts "$root/dev/pts"
ln -s pts/ptmx "$root/dev/ptmx"
for d in null:1:3 zero:1:5 full:1:7 random:1:8 urandom:1:9 tty:5:0; do
    IFS=: read -r n ma mi <<<"$d"
    mknod -m 666 "$root/dev/$n" c "$ma" "$mi"
done
uffd=
if [ -c /dev/userfaultfd ]; then
    uffd=$(stat -c '%t:%T' /dev/userfaultfd)
    mknod -m 600 "$root/dev/userfaultfd" c "$((16#${uffd%:*}))" "$((16#${uffd#*:}))"
fi
mnt --bind "$archives" "$root/var/cache/apt/archives"
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"; chmod +x "$root/usr/sbin/policy-rc.d"
cp /etc/resolv.conf "$root/etc/resolv.conf"

pkgs="libvirt-daemon libvirt-daemon-driver-qemu libvirt-daemon-system libvirt-clients qemu-system-x86 apparmor"
say "apt-get install $pkgs (the .debs cached in $archives)"
ta=$(date +%s)
chroot "$root" apt-get update -qq >"$out/apt.log" 2>&1 && ! grep -q '^[WE]: ' "$out/apt.log" \
    || { tail -5 "$out/apt.log" >&2; missing "apt-get update failed (no Debian mirror?)"; }
chroot "$root" env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $pkgs >>"$out/apt.log" 2>&1 \
    || { tail -20 "$out/apt.log" >&2; exit 1; }
say "  installed in $(( $(date +%s) - ta )) s: $(chroot "$root" dpkg-query -W -f='${Package} ${Version}, ' libvirt-daemon qemu-system-x86 apparmor)"

say "dpkg -i $(basename "$deb")"
cp "$deb" "$root/tmp/memfold.deb"
chroot "$root" dpkg -i /tmp/memfold.deb >"$out/dpkg.log" 2>&1 \
    || { chroot "$root" env DEBIAN_FRONTEND=noninteractive apt-get -f install -y -qq >>"$out/dpkg.log" 2>&1 \
         || { tail -20 "$out/dpkg.log" >&2; exit 1; }; }
snippet=/etc/apparmor.d/abstractions/libvirt-qemu.d/memfold
[ -f "$root$snippet" ] || fail "$snippet not installed"
chroot "$root" dpkg-query -W -f='${Conffiles}\n' memfold | grep -q "$snippet" || fail "$snippet is not a conffile"

# AppArmor: bookworm's abstraction (libvirt 9.0) includes local/abstractions/libvirt-qemu,
# not the libvirt-qemu.d folder newer libvirt includes: the operator's one line.
say "AppArmor: the package's rules compiled inside libvirt's per-domain template"
grep -q 'libvirt-qemu.d' "$root/etc/apparmor.d/abstractions/libvirt-qemu" \
    && say "  this libvirt's abstraction includes abstractions/libvirt-qemu.d itself" \
    || { echo '  include <abstractions/libvirt-qemu.d/memfold>' >>"$root/etc/apparmor.d/local/abstractions/libvirt-qemu"
         say "  added 'include <abstractions/libvirt-qemu.d/memfold>' to /etc/apparmor.d/local/abstractions/libvirt-qemu (libvirt 9.0 has no libvirt-qemu.d include)"; }
sed 's/LIBVIRT_TEMPLATE/libvirt-00000000-0000-0000-0000-00000000c0de/' \
    "$root/etc/apparmor.d/libvirt/TEMPLATE.qemu" >"$root/tmp/memfold-profile"
chroot "$root" apparmor_parser --skip-kernel-load --skip-cache -S /tmp/memfold-profile >"$out/apparmor.bin" 2>"$out/apparmor.log" \
    || { cat "$out/apparmor.log" >&2; fail "apparmor_parser refused the profile with memfold's rules"; }
chroot "$root" apparmor_parser -p /tmp/memfold-profile 2>/dev/null | grep -q '^  /usr/lib/memfold/libmemfold_agent.so mr,' \
    || fail "memfold's rules are not in the compiled profile"
say "  apparmor_parser compiled it ($(stat -c %s "$out/apparmor.bin") bytes of policy) with memfold's rules in it"
if [ -d /sys/module/apparmor ] && [ "$(cat /sys/module/apparmor/parameters/enabled 2>/dev/null)" = Y ]; then
    say "  this kernel has AppArmor: libvirt's AppArmor driver is on for the domain"
else
    say "  this kernel has no AppArmor (no /sys/module/apparmor): libvirt runs without its AppArmor driver; the rules are compiled, not enforced"
fi

say "libvirt: qemu.conf namespaces = [ ], cgroup_controllers = [ ] (chroot limits); user, group, dynamic_ownership, security_driver left as shipped"
cat >>"$root/etc/libvirt/qemu.conf" <<'EOF'
# libvirt-check (a chroot): no mount namespace, no cgroups of QEMU's own.
namespaces = [ ]
cgroup_controllers = [ ]
EOF
if [ -n "$uffd" ]; then
    chroot "$root" chgrp kvm /dev/userfaultfd
    chmod 0660 "$root/dev/userfaultfd"
    say "/dev/userfaultfd in the chroot: group kvm, mode 0660 (QEMU's supplementary group under libvirt)"
fi
mkdir -p "$root/var/log/libvirt/qemu" "$root/var/lib/libvirt/images/tiny"
cp "$images/vmlinuz" "$images/initrd.img" "$root/var/lib/libvirt/images/tiny/"
chroot "$root" virtlogd -d
chroot "$root" libvirtd -d
for _ in $(seq 100); do chroot "$root" virsh -q -c qemu:///system uri >/dev/null 2>&1 && break; sleep 0.1; done
chroot "$root" virsh -q -c qemu:///system uri >/dev/null || fail "libvirtd does not answer"

cat >"$root/tmp/$domain.xml" <<EOF
<domain type='qemu'>
  <name>$domain</name>
  <memory unit='MiB'>256</memory>
  <vcpu>1</vcpu>
  <os>
    <type arch='x86_64' machine='q35'>hvm</type>
    <kernel>/var/lib/libvirt/images/tiny/vmlinuz</kernel>
    <initrd>/var/lib/libvirt/images/tiny/initrd.img</initrd>
    <cmdline>console=ttyS0 panic=-1 quiet</cmdline>
  </os>
  <on_reboot>destroy</on_reboot>
  <devices>
    <emulator>/usr/bin/qemu-system-x86_64</emulator>
    <serial type='file'>
      <source path='/var/log/libvirt/qemu/$domain-serial.log'/>
    </serial>
    <memballoon model='virtio'/>
  </devices>
</domain>
EOF
virsh() { chroot "$root" virsh -c qemu:///system "$@"; }
virsh define /tmp/$domain.xml >/dev/null
virsh dumpxml --inactive --security-info $domain >"$out/before.xml"

say "memfold libvirt enable $domain --connect qemu:///system"
chroot "$root" memfold libvirt enable $domain --connect qemu:///system | tee -a "$result"
virsh dumpxml --inactive --security-info $domain >"$out/enabled.xml"
diff -u "$out/before.xml" "$out/enabled.xml" >"$out/enable.diff" || true
sed 's/^/  /' "$out/enable.diff" | tail -n +3 | grep '^  [-+]' | tee -a "$result"
again=$(chroot "$root" memfold libvirt enable $domain --connect qemu:///system)
case $again in *"nothing to change"*) say "  enable again: $again";; *) fail "enable twice changed the domain again: $again";; esac
virsh dumpxml --inactive --security-info $domain | cmp -s - "$out/enabled.xml" || fail "the second enable changed the XML"

# memfoldd as the unit starts it, with the group libvirt's QEMUs run as.
sed -i 's/^# agent-group = "libvirt-qemu"$/agent-group = "libvirt-qemu"/' "$root/etc/memfold/memfoldd.toml"
grep -q '^agent-group = "libvirt-qemu"$' "$root/etc/memfold/memfoldd.toml" || fail "no agent-group line to uncomment in the packaged memfoldd.toml"
exec_start=$(sed -n 's/^ExecStart=//p' "$root/lib/systemd/system/memfoldd.service")
mkdir -p "$root/run/memfold"; chmod 0755 "$root/run/memfold"
say "memfoldd: $exec_start (agent-group = \"libvirt-qemu\" in /etc/memfold/memfoldd.toml)"
chroot "$root" $exec_start 2>"$out/memfoldd.log" &
daemon_pid=$!
for _ in $(seq 100); do [ -S "$root$socket" ] && break; sleep 0.1; done
[ -S "$root$socket" ] || fail "no memfoldd socket"
say "  socket: $(chroot "$root" stat -c '%A %U:%G' $socket)"

serial=$root/var/log/libvirt/qemu/$domain-serial.log
say "virsh start $domain"
tb=$(date +%s)
virsh start $domain >/dev/null
qemu=$(pid_in /run/libvirt/qemu/$domain.pid)
[ -n "$qemu" ] || fail "no QEMU pid"
creds=$(grep -E '^(Uid|Gid|Groups):' /proc/$qemu/status | tr -s '\t ' ' ' | paste -sd';')
say "  QEMU pid $qemu: $creds"
[ "$(awk '/^Uid:/ {print $2}' /proc/$qemu/status)" = "$(chroot "$root" id -u libvirt-qemu)" ] \
    || fail "QEMU does not run as libvirt-qemu (DAC)"
# Not root, no CAP_SYS_PTRACE: with vm.unprivileged_userfaultfd = 0 the agent's
# userfaultfd can only come from /dev/userfaultfd.
capeff=$(awk '/^CapEff:/ {print $2}' /proc/$qemu/status)
sysctl_uffd=$(cat /proc/sys/vm/unprivileged_userfaultfd 2>/dev/null || echo '?')
(( (16#$capeff >> 19) & 1 )) && fail "QEMU has CAP_SYS_PTRACE ($capeff)"
say "  QEMU's CapEff $capeff (no CAP_SYS_PTRACE); host vm.unprivileged_userfaultfd = $sysctl_uffd"
label=$(virsh dominfo $domain | sed -n 's/^Security model: *//p' | paste -sd, -)
say "  virsh dominfo: security model ${label:-none} (DAC runs stacked under it, as libvirt-qemu)"
say "  the kernel while it runs (DAC dynamic ownership): $(chroot "$root" stat -c '%n %U:%G' /var/lib/libvirt/images/tiny/vmlinuz)"

status_json() { chroot "$root" memfold status --socket $socket --interval 0 --json 2>/dev/null; }
rounds() { grep -c '^MEMFOLD-CHECK ok' "$serial" 2>/dev/null || true; }
attached=
for _ in $(seq 180); do
    grep -q MEMFOLD-MISMATCH "$serial" 2>/dev/null && fail "self-check: $(grep MEMFOLD-MISMATCH "$serial" | head -3)"
    kill -0 "$qemu" 2>/dev/null || { tail -20 "$root/var/log/libvirt/qemu/$domain.log" >&2; fail "QEMU exited"; }
    if json=$(status_json) && python3 -c '
import json, sys
v = [r for r in json.loads(sys.stdin.read())["vms"] if r["name"] == sys.argv[1]]
sys.exit(0 if v and v[0]["state"] == "managed" and v[0]["shared_pages"] > 0 else 1)' $domain <<<"$json"; then
        attached=$(( $(date +%s) - tb )); break
    fi
    sleep 1
done
[ -n "$attached" ] || { tail -20 "$root/var/log/libvirt/qemu/$domain.log" >&2; fail "the guest was not attached with shared pages after 180 s"; }
say "  the agent attached and pages are shared, $attached s after virsh start"
[ "$sysctl_uffd" = 0 ] && say "  so its userfaultfd came from the chroot's /dev/userfaultfd (group kvm, 0660)"
grep -q 'memfold_agent' "$root/var/log/libvirt/qemu/$domain.log" \
    && grep 'memfold_agent' "$root/var/log/libvirt/qemu/$domain.log" | head -3 | sed 's/^/  QEMU log: /' | tee -a "$result"
# Savings settle over the next minute (the clock's passes): the figure at 60 s after start.
want=$(( $(rounds) + 3 ))
while (( $(date +%s) - tb < 60 )) || (( $(rounds) < want )); do
    grep -q MEMFOLD-MISMATCH "$serial" && fail "self-check: $(grep MEMFOLD-MISMATCH "$serial" | head -3)"
    (( $(date +%s) - tb < 240 )) || fail "the guest passed $(rounds) self-check rounds in 240 s, wanted $want"
    sleep 1
done
json=$(status_json)
echo "$json" >"$out/status.json"
saved=$(python3 -c 'import json, sys; print(json.load(sys.stdin)["saved"]["total"])' <"$out/status.json")
(( saved > 0 )) || fail "nothing saved: $json"
say "  $(( $(date +%s) - tb )) s after start, $(rounds) self-check rounds, $(grep -c MEMFOLD-MISMATCH "$serial" || true) mismatches; memfold status (packaged, in the chroot):"
chroot "$root" memfold status --socket $socket --interval 1 | sed 's/^/    /' | tee -a "$result"

say "memfold libvirt disable $domain (while it runs)"
off=$(chroot "$root" memfold libvirt disable $domain --connect qemu:///system)
echo "$off" | sed 's/^/  /' | tee -a "$result"
case $off in *"next start"*) ;; *) fail "disable on a running domain did not say it applies at the next start";; esac
virsh destroy $domain >/dev/null
virsh dumpxml --inactive --security-info $domain >"$out/after.xml"
cmp -s "$out/before.xml" "$out/after.xml" || { diff -u "$out/before.xml" "$out/after.xml" >&2; fail "the XML after disable differs from before enable"; }
say "  the inactive XML after disable is byte for byte the one before enable"
# --claim: libvirt takes the monitor arguments (defined, not booted), and disable takes
# them away again.
chroot "$root" memfold libvirt enable $domain --connect qemu:///system --claim >/dev/null
virsh dumpxml --inactive $domain >"$out/claim.xml"
grep -q "<qemu:arg value='socket,id=memfold-qmp,path=/var/lib/libvirt/qemu/memfold-qmp-$domain.sock,server=on,wait=off'/>" "$out/claim.xml" \
    && grep -q "<qemu:arg value='chardev=memfold-qmp,mode=control'/>" "$out/claim.xml" \
    || fail "enable --claim: libvirt did not keep the monitor arguments (out/libvirt-check/claim.xml)"
say "  enable --claim: libvirt kept the memfold-qmp -chardev/-mon arguments"

# --claim booted (issue 18 under libvirt): memfoldd restarted claiming entitlements at
# once over a 160 MiB allowance; the guest's balloon must be driven through its
# memfold-qmp monitor to the allowance plus its entitlement, and the guest see it (its
# MemTotal falls by what the balloon holds, within 1 MiB).
kill -TERM "$daemon_pid"; wait "$daemon_pid" || fail "memfoldd exited $? on SIGTERM"; daemon_pid=
allowance_mib=160
printf 'claim-entitlement = "at-once"\nallowance-mib = %s\n' $allowance_mib >>"$root/etc/memfold/memfoldd.toml"
say "memfoldd restarted with claim-entitlement = \"at-once\", allowance-mib = $allowance_mib"
chroot "$root" $exec_start 2>>"$out/memfoldd.log" &
daemon_pid=$!
for _ in $(seq 100); do [ -S "$root$socket" ] && break; sleep 0.1; done
[ -S "$root$socket" ] || fail "no memfoldd socket after the restart"
: >"$serial" 2>/dev/null || true
tb=$(date +%s)
virsh start $domain >/dev/null
qemu=$(pid_in /run/libvirt/qemu/$domain.pid)
[ -n "$qemu" ] || fail "no QEMU pid (--claim)"
claimed=
for _ in $(seq 180); do
    grep -q MEMFOLD-MISMATCH "$serial" 2>/dev/null && fail "self-check: $(grep MEMFOLD-MISMATCH "$serial" | head -3)"
    kill -0 "$qemu" 2>/dev/null || { tail -20 "$root/var/log/libvirt/qemu/$domain.log" >&2; fail "QEMU exited (--claim)"; }
    boot=$(sed -n 's/^MEMFOLD-MEMTOTAL-BOOT-KIB //p' "$serial" 2>/dev/null | tail -1)
    now=$(sed -n 's/^MEMFOLD-MEMTOTAL-KIB //p' "$serial" 2>/dev/null | tail -1)
    if [ -n "$boot" ] && [ -n "$now" ] && json=$(status_json) && claimed=$(python3 -c '
import json, sys
name, allowance, boot, now = sys.argv[1], int(sys.argv[2]) << 20, int(sys.argv[3]), int(sys.argv[4])
v = [r for r in json.loads(sys.stdin.read())["vms"] if r["name"] == name]
if not v or v[0]["balloon_bytes"] is None:
    sys.exit(1)
b, e = v[0]["balloon_bytes"], v[0]["entitlement_bytes"]
want = min(allowance + e, 256 << 20) >> 20 << 20
held_kib = ((256 << 20) - b) >> 10
ok = e > 0 and b == want and abs((boot - now) - held_kib) <= 1024
print("balloon leaves it %d MiB = %d + entitlement %.1f MiB; MemTotal %d -> %d KiB" % (b >> 20, allowance >> 20, e / 2**20, boot, now))
sys.exit(0 if ok else 1)' $domain $allowance_mib "$boot" "$now" <<<"$json"); then
        break
    fi
    claimed=
    sleep 1
done
[ -n "$claimed" ] || { status_json >&2 || true; tail -5 "$out/memfoldd.log" >&2; fail "the balloon was not driven to allowance + entitlement within 180 s"; }
say "  $(( $(date +%s) - tb )) s after start: $claimed"
virsh destroy $domain >/dev/null
chroot "$root" memfold libvirt disable $domain --connect qemu:///system >/dev/null
virsh dumpxml --inactive --security-info $domain | cmp -s - "$out/before.xml" || fail "the XML after enable --claim and disable differs"
say "  disable restored the XML byte for byte again"
twice=$(chroot "$root" memfold libvirt disable $domain --connect qemu:///system)
case $twice in *"not enabled"*) ;; *) fail "disable twice: $twice";; esac
say "  the kernel after the guest stopped: $(chroot "$root" stat -c '%n %U:%G' /var/lib/libvirt/images/tiny/vmlinuz) (DAC restored the owner)"

kill -TERM "$daemon_pid"; wait "$daemon_pid" || fail "memfoldd exited $? on SIGTERM"; daemon_pid=
cp "$serial" "$out/serial.log"; cp "$root/var/log/libvirt/qemu/$domain.log" "$out/qemu.log"
say "PASS in $(( $(date +%s) - t0 )) s ($deb)"
