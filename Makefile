# memfold: the two commands of the README, and the parts they are made of.

.PHONY: setup main test test-long fuzz bench lint deb deb-check libvirt-check

# Seconds of fuzzing per target (scripts/fuzz.sh): a short bound in `make test`, a long run.
FUZZ_CI_SECONDS ?= 10
FUZZ_SECONDS ?= 300

# Installs what a fresh machine lacks (idempotent).
setup:
	bash scripts/setup.sh

# The main job on the built-in default: build the guest images, boot a mixed set of
# real Debian guests with memfold's agent, run memfoldd and show live savings.
main: setup
	cargo build --workspace --release
	./target/release/memfold run

# Every test CI runs: unit, property and integration tests, lint, the libvirt check
# (scripts/libvirt-check.sh --optional: about 2 minutes; skipped, saying why, without
# root, debootstrap, cargo-deb, the tiny image or Debian's mirror), and a short fuzz of
# every decoder (skipped, saying so, where there is no nightly toolchain).
# The build comes first: live tests preload the agent library into QEMU. Every test
# binary runs even after one fails, so that one run shows every failure.
test: setup
	cargo build --workspace --release
	cargo test --workspace --release --no-fail-fast
	cargo clippy --workspace --all-targets --release -- -D warnings
	RUSTDOCFLAGS="-D warnings" cargo doc --workspace --no-deps
	bash scripts/libvirt-check.sh --optional
	bash scripts/fuzz.sh $(FUZZ_CI_SECONDS)

# A long fuzz run: every target for FUZZ_SECONDS (13 targets: about an hour at 300 s).
fuzz: setup
	FUZZ_REQUIRED=1 bash scripts/fuzz.sh $(FUZZ_SECONDS)

# The reference-model run of 10^7 operations (about 50 minutes on this 2-core host; not
# in CI). MEMFOLD_MODEL_RUN=N replays one of its 100 runs alone.
test-long:
	MEMFOLD_MODEL_OPS=10000000 cargo test --release -p memfold-core --test reference_model -- --ignored --nocapture

bench:
	cargo bench -p memfold-core --bench ops

# The Debian package (docs/operations.md): memfoldd, memfold, the agent library under
# /usr/lib/memfold, the systemd unit and /etc/memfold/memfoldd.toml, into out/deb/.
# Stripped; the debug symbols go to memfold-dbgsym_*.ddeb beside it. Installs
# cargo-deb from crates.io if it is missing.
deb:
	cargo build --release -p memfold-cli -p memfold-agent -p memfold-blk
	command -v cargo-deb >/dev/null || cargo install cargo-deb --version 3.8.0 --locked
	cargo deb -p memfold-cli --no-build --dbgsym --compress-debug-symbols=zlib --output out/deb/

# The package on a clean Debian bookworm chroot: installs, memfoldd starts as the unit
# would, a client gets its statistics, a tiny guest attaches through the packaged agent
# and passes its self-checks across SIGTERM, restart and kill -9 (needs root; boots a
# guest; about a minute once the minimal system is cached).
deb-check: deb
	bash scripts/deb-check.sh

# `memfold libvirt enable` on a clean Debian bookworm chroot with Debian's libvirt (DAC
# on: QEMU as libvirt-qemu) and the built package: a tiny guest domain enabled, started,
# memory saved and self-checks passed, then disabled and its XML restored byte for byte;
# the package's AppArmor rules compiled in libvirt's template (docs/operations.md). Needs
# root, network to Debian's mirror (or the cached .debs) and the tiny image; boots a
# guest, so it waits for /tmp/measure.lock; about 90 s once cached. `make test` runs it
# too (--optional: the package from its release build, skips where it cannot run).
libvirt-check: deb
	flock /tmp/measure.lock bash scripts/libvirt-check.sh
