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
cleanup() {
    [ -n "$daemon_pid" ] && kill "$daemon_pid" 2>/dev/null || true
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
for f in /usr/bin/memfoldd /usr/bin/memfold /usr/lib/memfold/libmemfold_agent.so \
         /lib/systemd/system/memfoldd.service /etc/memfold/memfoldd.toml; do
    [ -e "$root$f" ] || { say "FAIL: $f not installed"; exit 1; }
done
chroot "$root" dpkg-query -W -f='${Conffiles}\n' memfold | grep -q /etc/memfold/memfoldd.toml \
    || { say "FAIL: /etc/memfold/memfoldd.toml is not a conffile"; exit 1; }
say "installed: memfoldd, memfold, the agent library, the unit, the conffile"

# As systemd would: RuntimeDirectory=memfold, then ExecStart as the unit has it.
exec_start=$(sed -n 's/^ExecStart=//p' "$root/lib/systemd/system/memfoldd.service")
socket=/run/memfold/memfoldd.sock
proto=$(sed -n 's/^pub const PROTOCOL_VERSION: u32 = \([0-9]*\);/\1/p' crates/memfold-wire/src/messages.rs)

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

stats() {
    python3 - "$root$socket" "$proto" <<'EOF'
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
s.connect(sys.argv[1])
s.send(json.dumps({"type": "client_hello", "version": int(sys.argv[2])}).encode())
s.send(json.dumps({"type": "stats"}).encode())
st = json.loads(s.recv(1 << 22))
assert st.get("type") == "stats", f"memfoldd answered {st}"
print(f"  stats: {len(st['vms'])} guests, {st['domains']} sharing domains; fields: {', '.join(sorted(st)[:8])}, ...")
EOF
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
unmerge=$(chroot "$root" memfold unmerge no-such-guest --socket "$socket" 2>&1 || true)
echo "  memfold unmerge no-such-guest: $unmerge" | tee -a "$result"
case $unmerge in *"no guest named"*) ;; *) say "FAIL: memfold got no answer from memfoldd"; exit 1;; esac
stop
say "restart on the same path"
start
stats | tee -a "$result"
kill -KILL "$daemon_pid"; wait "$daemon_pid" 2>/dev/null || true; daemon_pid=
[ -S "$root$socket" ] || { say "FAIL: no stale socket after kill -9"; exit 1; }
say "kill -9: the socket file is left; start again over it (Restart=on-failure's path)"
start
stats | tee -a "$result"
stop
grep -q 'a stale socket (nothing listens): replaced' "$out/memfoldd.log" \
    || { say "FAIL: the stale socket was not reported replaced"; exit 1; }
grep -q '^<6>listening on /run/memfold/memfoldd.sock' "$out/memfoldd.log" \
    || { say "FAIL: no journald-style start line in the log"; exit 1; }
say "memfoldd's log (journald priority prefixes):"
sed 's/^/  /' "$out/memfoldd.log" | tee -a "$result"
say "PASS in $(( $(date +%s) - t0 )) s ($deb)"
