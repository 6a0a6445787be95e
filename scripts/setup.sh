#!/usr/bin/env bash
# Installs what memfold needs on a fresh Debian machine; does nothing that is already done:
# a C compiler (the zstd crate builds zstd's C library) and static libc (the guest probe),
# QEMU and qemu-img, and the tools that build guest
# images from Debian packages (debootstrap, busybox-static, e2fsprogs, cpio, xz, zstd), and
# for fuzzing a nightly toolchain (if rustup can get one) and cargo-fuzz.
# Guest images themselves are built on demand by `memfold image build` (cached).
set -euo pipefail

need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(gcc libc6-dev)
# The tiny image's memfold-probe is linked statically (crates/memfold-vm/build.rs): libc.a.
[ -f /usr/lib/x86_64-linux-gnu/libc.a ] || need_apt+=(libc6-dev)
command -v make >/dev/null 2>&1 || need_apt+=(make)
command -v pkg-config >/dev/null 2>&1 || need_apt+=(pkg-config)
command -v qemu-system-x86_64 >/dev/null 2>&1 || need_apt+=(qemu-system-x86)
# memfold-blk's copy-on-write root disks are qcow2 overlays made by qemu-img.
command -v qemu-img >/dev/null 2>&1 || need_apt+=(qemu-utils)
command -v debootstrap >/dev/null 2>&1 || need_apt+=(debootstrap)
# Static: the initramfs has no libc (Debian's busybox package has switch_root too, but is
# linked dynamically, and a guest's /init could not run).
{ [ -x /bin/busybox ] && /bin/busybox --list 2>/dev/null | grep -qx switch_root \
    && { LC_ALL=C ldd /bin/busybox 2>&1 || true; } | grep -qE "not a dynamic executable|statically linked"; } || need_apt+=(busybox-static)
# scripts/libvirt-check.sh reads memfold's JSON with python3.
command -v python3 >/dev/null 2>&1 || need_apt+=(python3)
command -v mkfs.ext4 >/dev/null 2>&1 || need_apt+=(e2fsprogs)
command -v cpio >/dev/null 2>&1 || need_apt+=(cpio)
command -v xz >/dev/null 2>&1 || need_apt+=(xz-utils)
command -v zstd >/dev/null 2>&1 || need_apt+=(zstd)
command -v tmux >/dev/null 2>&1 || need_apt+=(tmux)
if ((${#need_apt[@]})); then
    echo "setup: installing ${need_apt[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${need_apt[@]}"
fi

# Rust comes with the machine (rustup's toolchain); Debian's packaged rustc is too old for
# the workspace (rust-version 1.85) and rustup cannot download here, so say so clearly.
export PATH="$HOME/.cargo/bin:$PATH"
if ! command -v cargo >/dev/null 2>&1; then
    echo "setup: no cargo found; memfold needs Rust >= 1.85 (rustup toolchain in ~/.cargo/bin)" >&2
    exit 1
fi
ver=$(rustc --version | awk '{print $2}')
if [ "$(printf '%s\n1.85.0\n' "$ver" | sort -V | head -1)" != "1.85.0" ]; then
    echo "setup: rustc $ver is older than 1.85; memfold needs Rust >= 1.85" >&2
    exit 1
fi
if ! cargo clippy --version >/dev/null 2>&1; then
    if command -v rustup >/dev/null 2>&1; then
        rustup component add clippy
    else
        echo "setup: clippy missing and no rustup; lint will fail" >&2
    fi
fi

# Fuzzing (scripts/fuzz.sh) needs a nightly toolchain and cargo-fuzz. A machine without
# nightly tries rustup once; where it cannot download, fuzz.sh says it skips, and the rest
# of CI runs as before. cargo-fuzz builds from crates.io.
if command -v rustup >/dev/null 2>&1; then
    if ! rustup toolchain list | grep -q '^nightly'; then
        echo "setup: installing the nightly toolchain (for cargo fuzz)"
        timeout 300 rustup toolchain install nightly --profile minimal ||
            echo "setup: no nightly toolchain (rustup could not install one): fuzzing will be skipped" >&2
    fi
    if rustup toolchain list | grep -q '^nightly' && ! cargo +nightly fuzz --version >/dev/null 2>&1; then
        echo "setup: installing cargo-fuzz"
        # Pinned: a newer release that does not build with this toolchain would turn
        # fuzzing off without a failure.
        cargo install cargo-fuzz --version 0.13.2 --locked ||
            echo "setup: cargo-fuzz did not install: fuzzing will be skipped" >&2
    fi
fi
# cargo-deb (for `make deb` and the libvirt check `make test` runs, which packages the
# release build): from crates.io; where it cannot build, the check says it skips.
if ! command -v cargo-deb >/dev/null 2>&1; then
    echo "setup: installing cargo-deb"
    # Pinned, as cargo-fuzz.
    cargo install cargo-deb --version 3.8.0 --locked ||
        echo "setup: cargo-deb did not install: the libvirt check will be skipped" >&2
fi
# promtool (for the metrics endpoint's test: `promtool check metrics` on a scrape), from
# Debian's prometheus package without installing it as a service: only the promtool binary
# is extracted, into ~/.cache/memfold/promtool/. The test finds it there (or on PATH) and
# says so when it is missing.
promtool_dir="$HOME/.cache/memfold/promtool"
if ! command -v promtool >/dev/null 2>&1 && [ ! -x "$promtool_dir/promtool" ]; then
    echo "setup: extracting promtool from Debian's prometheus package"
    tmp=$(mktemp -d)
    if (cd "$tmp" && { apt-get download prometheus >/dev/null 2>&1 ||
        { apt-get update -qq && apt-get download prometheus >/dev/null; }; }); then
        dpkg-deb --fsys-tarfile "$tmp"/prometheus_*.deb |
            tar -x -C "$tmp" ./usr/bin/promtool
        mkdir -p "$promtool_dir"
        install -m 0755 "$tmp/usr/bin/promtool" "$promtool_dir/promtool"
    else
        echo "setup: could not download Debian's prometheus package: the metrics test will skip promtool" >&2
    fi
    rm -rf "$tmp"
fi
echo "setup: ok ($(cargo --version))"
