#!/usr/bin/env bash
# Proof that the Debian package installs and runs on a clean Debian (issue 20):
# a minimal bookworm (debootstrap minbase, unpacked from a cached tarball), `dpkg -i` of
# the package (with `apt-get -f install` if it lacks dependencies), memfoldd started as
# the unit's ExecStart starts it (no systemd as PID 1 in a chroot: /run/memfold made as
# RuntimeDirectory= would, then ExecStart run by hand), a client's request for
# statistics answered, SIGTERM → exit 0 and the socket gone, a second start on the same
# path answered, kill -9 (a stale socket left), a third start over it answered, SIGTERM.
# Needs root (debootstrap, chroot).
#
# With QEMU on the host and the `tiny` image cached (`memfold image build tiny`), a guest
# joins too (MEMFOLD_DEB_CHECK_GUEST=0 skips it): a host QEMU preloads the *packaged*
# agent library from the chroot and attaches to the packaged memfoldd; its self-checking
# workload must keep passing across the SIGTERM (no memfoldd for a while), the restart
# (the guest re-attached, its pool adopted) and the kill -9. Boots a guest: run it under
# `flock /tmp/measure.lock` on a shared machine.
#
#   bash scripts/deb-check.sh [PACKAGE.deb]      # default: the newest out/deb/memfold_*.deb
#
# The client: the packaged `memfold unmerge` inside the chroot (memfoldd's answer, an
# error for a guest it does not have, is the round trip) and a request for statistics
# over the socket in Python from the host (the wire's JSON; `memfold status` replaces it
# once it exists). Writes out/deb-check/result.txt and memfoldd's log beside it.
set -euo pipefail
cd "$(dirname "$0")/.."

deb=${1:-$(ls -t out/deb/memfold_*.deb 2>/dev/null | head -1)}
[ -n "$deb" ] && [ -f "$deb" ] || { echo "deb-check: no package (make deb builds out/deb/memfold_*.deb)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "deb-check: needs root (debootstrap, chroot)" >&2; exit 1; }
command -v debootstrap >/dev/null || { echo "deb-check: debootstrap is missing (make setup)" >&2; exit 1; }

release=bookworm
cache=${MEMFOLD_CACHE:-$HOME/.cache/memfold}/deb-check
tarball=$cache/$release-minbase.tgz
out=out/deb-check
mkdir -p "$cache" "$out"
result=$out/result.txt
: >"$result"
say() { echo "deb-check: $*" | tee -a "$result"; }
t0=$(date +%s)

if [ ! -f "$tarball" ]; then
    say "debootstrap $release (minbase) into $tarball, once"
    rm -rf "$cache/mk"
    debootstrap --variant=minbase --make-tarball="$tarball.tmp" "$release" "$cache/mk" >"$cache/make-tarball.log" 2>&1 \
        || { tail -20 "$cache/make-tarball.log" >&2; exit 1; }
    mv "$tarball.tmp" "$tarball"
    rm -rf "$cache/mk"
fi

root=$(mktemp -d /var/tmp/memfold-deb-check.XXXXXX)
daemon_pid=
qemu_pid=
cleanup() {
    [ -n "$daemon_pid" ] && kill "$daemon_pid" 2>/dev/null || true
    [ -n "$qemu_pid" ] && kill -9 "$qemu_pid" 2>/dev/null || true
    umount "$root/proc" 2>/dev/null || true
    rm -rf "$root"
}
trap cleanup EXIT

say "a clean $release chroot in $root (debootstrap --unpack-tarball)"
debootstrap --variant=minbase --unpack-tarball="$(realpath "$tarball")" "$release" "$root" >"$out/debootstrap.log" 2>&1 \
    || { tail -20 "$out/debootstrap.log" >&2; exit 1; }
mount -t proc proc "$root/proc"
printf '#!/bin/sh\nexit 101\n' >"$root/usr/sbin/policy-rc.d"; chmod +x "$root/usr/sbin/policy-rc.d"
cp /etc/resolv.conf "$root/etc/resolv.conf"

say "dpkg -i $(basename "$deb")"
cp "$deb" "$root/tmp/memfold.deb"
if ! chroot "$root" dpkg -i /tmp/memfold.deb >"$out/dpkg.log" 2>&1; then
    say "dependencies missing: apt-get update && apt-get -f install"
    chroot "$root" apt-get update -qq >>"$out/dpkg.log" 2>&1
    chroot "$root" env DEBIAN_FRONTEND=noninteractive apt-get -f install -y -qq >>"$out/dpkg.log" 2>&1 \
        || { tail -20 "$out/dpkg.log" >&2; exit 1; }
fi
chroot "$root" dpkg -s memfold | grep -E '^(Status|Version|Depends):' | sed 's/^/  /' | tee -a "$result"
for f in /usr/bin/memfoldd /usr/bin/memfold /usr/lib/memfold/libmemfold_agent.so /usr/lib/memfold/memfold-blk \
         /lib/systemd/system/memfoldd.service /etc/memfold/memfoldd.toml; do
    [ -e "$root$f" ] || { say "FAIL: $f not installed"; exit 1; }
done
chroot "$root" dpkg-query -W -f='${Conffiles}\n' memfold | grep -q /etc/memfold/memfoldd.toml \
    || { say "FAIL: /etc/memfold/memfoldd.toml is not a conffile"; exit 1; }
say "installed: memfoldd, memfold, the agent library, the unit, the conffile"

# As systemd would: RuntimeDirectory=memfold, then ExecStart as the unit has it.
exec_start=$(sed -n 's/^ExecStart=//p' "$root/lib/systemd/system/memfoldd.service")
socket=/run/memfold/memfoldd.sock

start() {
    mkdir -p "$root/run/memfold"; chmod 0755 "$root/run/memfold"
    chroot "$root" $exec_start 2>>"$out/memfoldd.log" &
    daemon_pid=$!
    for _ in $(seq 100); do
        [ -S "$root$socket" ] && return 0
        kill -0 "$daemon_pid" 2>/dev/null || { say "FAIL: memfoldd exited"; cat "$out/memfoldd.log" >&2; exit 1; }
        sleep 0.1
    done
    say "FAIL: no socket at $socket"; exit 1
}

# Statistics from memfoldd through the packaged `memfold status`; with a guest name, waits
# (up to 120 s) until it is attached with shared pages.
stats() {
    local guest=${1:-} t0=$SECONDS json
    while :; do
        # After a kill -9 the stale socket file is there before the new memfoldd
        # listens: a refused connection is retried like a guest not yet attached.
        if json=$(chroot "$root" memfold status --socket "$socket" --interval 0 --json 2>&1); then
            [ -z "$guest" ] && break
        else
            guest_wait_reason=$json
            json='{"vms":[]}'
        fi
        python3 -c '
import json, sys
v = [r for r in json.loads(sys.stdin.read())["vms"] if r["name"] == sys.argv[1]]
sys.exit(0 if v and v[0]["state"] == "managed" and v[0]["shared_pages"] > 0 else 1)
' "$guest" <<<"$json" && break
        if (( SECONDS - t0 > 120 )); then
            say "FAIL: guest ${guest:-(none)} not attached with shared pages after 120 s: $json ${guest_wait_reason:-}"
            exit 1
        fi
        sleep 1
    done
    echo "  memfold status (the packaged binary):"
    chroot "$root" memfold status --socket "$socket" --interval 0 | sed 's/^/    /'
}

# The guest's self-check rounds so far; more_rounds N waits for N more, failing on a
# mismatch.
rounds() { grep -c '^MEMFOLD-CHECK ok' "$out/serial.log" 2>/dev/null || true; }
more_rounds() {
    local want=$(( $(rounds) + $1 ))
    for _ in $(seq 120); do
        if grep -q MEMFOLD-MISMATCH "$out/serial.log"; then
            say "FAIL: the guest's self-check: $(grep MEMFOLD-MISMATCH "$out/serial.log" | head -3)"; exit 1
        fi
        if [ "$(rounds)" -ge "$want" ]; then
            say "  the guest passed $1 more self-check rounds (round $(rounds)), no mismatch"; return 0
        fi
        sleep 1
    done
    say "FAIL: the guest did not pass $1 more rounds in 120 s"; exit 1
}

images=${MEMFOLD_CACHE:-$HOME/.cache/memfold}/images
guest=
if [ "${MEMFOLD_DEB_CHECK_GUEST:-1}" != 0 ] && command -v qemu-system-x86_64 >/dev/null \
    && [ -f "$images/tiny/vmlinuz" ] && [ -f "$images/tiny/initrd.img" ]; then
    guest=deb-check
fi
# KVM only where memfold's own probe found it works (on some nested hosts KVM opens but
# guests hang: crates/memfold-vm's detect_accel), else TCG.
accel="tcg,tb-size=64"
if [ "$(cat "$images/accel-probe" 2>/dev/null)" = "$(cat /proc/sys/kernel/random/boot_id) kvm" ]; then
    accel="kvm -cpu host"
fi
boot_guest() {
    : >"$out/serial.log"
    LD_PRELOAD="$root/usr/lib/memfold/libmemfold_agent.so" MEMFOLD_SOCKET="$root$socket" \
    MEMFOLD_VM_NAME=$guest MEMFOLD_RAM_BYTES=$((256 << 20)) \
    qemu-system-x86_64 -name $guest -accel $accel \
        -object memory-backend-memfd,id=ram0,size=256M,share=on -machine q35,memory-backend=ram0 -m 256M \
        -smp 1 -display none -vga none -nodefaults -no-reboot -serial "file:$out/serial.log" \
        -kernel "$images/tiny/vmlinuz" -initrd "$images/tiny/initrd.img" \
        -append "console=ttyS0 panic=-1 quiet" 2>"$out/qemu.stderr" &
    qemu_pid=$!
}

stop() {
    kill -TERM "$daemon_pid"
    set +e; wait "$daemon_pid"; code=$?; set -e
    daemon_pid=
    [ "$code" = 0 ] || { say "FAIL: memfoldd exited $code on SIGTERM"; exit 1; }
    [ ! -e "$root$socket" ] || { say "FAIL: the socket is left behind"; exit 1; }
    say "SIGTERM: exit 0, socket removed"
}

: >"$out/memfoldd.log"
say "start: $exec_start (in the chroot)"
start
stats | tee -a "$result"
if [ -n "$guest" ]; then
    say "a tiny guest (-accel $accel): host QEMU with LD_PRELOAD=<chroot>/usr/lib/memfold/libmemfold_agent.so (the packaged agent)"
    boot_guest
    stats $guest | tee -a "$result"
    more_rounds 2
else
    say "no guest (no qemu-system-x86_64 or no cached tiny image, or MEMFOLD_DEB_CHECK_GUEST=0)"
fi
unmerge=$(chroot "$root" memfold unmerge no-such-guest --socket "$socket" 2>&1 || true)
echo "  memfold unmerge no-such-guest: $unmerge" | tee -a "$result"
case $unmerge in *"no guest named"*) ;; *) say "FAIL: memfold got no answer from memfoldd"; exit 1;; esac
stop
if [ -n "$guest" ]; then
    kill -0 "$qemu_pid" || { say "FAIL: QEMU died with memfoldd"; exit 1; }
    say "  no memfoldd: the guest runs on"
    more_rounds 2
fi
say "restart on the same path"
start
stats $guest | tee -a "$result"
[ -z "$guest" ] || more_rounds 1
kill -KILL "$daemon_pid"; wait "$daemon_pid" 2>/dev/null || true; daemon_pid=
[ -S "$root$socket" ] || { say "FAIL: no stale socket after kill -9"; exit 1; }
say "kill -9: the socket file is left; start again over it (Restart=on-failure's path)"
[ -z "$guest" ] || more_rounds 1
start
stats $guest | tee -a "$result"
[ -z "$guest" ] || more_rounds 1
stop
if [ -n "$guest" ]; then
    more_rounds 1
    kill -9 "$qemu_pid"; wait "$qemu_pid" 2>/dev/null || true; qemu_pid=
fi
grep -q 'a stale socket (nothing listens): replaced' "$out/memfoldd.log" \
    || { say "FAIL: the stale socket was not reported replaced"; exit 1; }
grep -q '^<6>listening on /run/memfold/memfoldd.sock' "$out/memfoldd.log" \
    || { say "FAIL: no journald-style start line in the log"; exit 1; }
say "memfoldd's log (journald priority prefixes):"
sed 's/^/  /' "$out/memfoldd.log" | tee -a "$result"
say "PASS in $(( $(date +%s) - t0 )) s ($deb)"
