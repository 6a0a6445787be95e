#!/usr/bin/env bash
# Fuzzes memfold's decoders (fuzz/, issue 14): builds every cargo-fuzz target (nightly,
# AddressSanitizer, debug assertions and overflow checks) and runs each for SECONDS,
# starting from the checked-in seeds (fuzz/seeds/<target>) and the corpus earlier runs
# kept (fuzz/corpus/<target>). Exits non-zero if any target fails a property or crashes;
# the failing input is kept in fuzz/artifacts/<target>/ and its log is printed.
#
#   scripts/fuzz.sh SECONDS [TARGET...]     (all targets if none is named)
#
# Without a nightly toolchain or cargo-fuzz (scripts/setup.sh installs cargo-fuzz) it says
# so and exits 0, so that CI on a machine without nightly still runs everything else;
# FUZZ_REQUIRED=1 (as `make fuzz` sets) makes that an error.
set -euo pipefail

secs=${1:?usage: scripts/fuzz.sh SECONDS [TARGET...]}
shift
cd "$(dirname "$0")/.."
root=$PWD
export PATH="$HOME/.cargo/bin:$PATH"

skip() {
    if [ "${FUZZ_REQUIRED:-0}" = 1 ]; then
        echo "fuzz: cannot fuzz: $1" >&2
        exit 1
    fi
    echo "fuzz: SKIPPED (not a failure): $1"
    exit 0
}
if ! command -v rustup >/dev/null 2>&1 || ! rustup toolchain list | grep -q '^nightly'; then
    skip "no nightly Rust toolchain (cargo fuzz needs one; rustup cannot download it here)"
fi
cargo +nightly fuzz --version >/dev/null 2>&1 ||
    skip "cargo-fuzz is not installed (cargo install cargo-fuzz --version 0.13.2 --locked)"

# Fuzz builds live beside the workspace's (own RUSTFLAGS: a shared folder would rebuild).
target_dir="${CARGO_TARGET_DIR:-$root/target}/fuzz"
fuzz() { cargo +nightly fuzz "$1" --target-dir "$target_dir" "${@:2}"; }

targets=("$@")
if ((${#targets[@]} == 0)); then
    mapfile -t targets < <(cargo +nightly fuzz list)
fi

start=$SECONDS
fuzz build
# The seed writer (fuzz/examples/seeds.rs) builds every message by hand: checked here, so
# that a new field in the wire breaks this run rather than the next person to reseed.
(cd fuzz && cargo +nightly check --examples --target-dir "$target_dir/check")
echo "fuzz: built ${#targets[@]} targets and the seed writer in $((SECONDS - start)) s"

# -max_len: room for the largest blob (WKdm's worst case is 4358 bytes) and two pages of
# arbitrary input. -timeout: one decode of one page taking seconds is a bug (a peer could
# stall the agent). -malloc_limit_mb: no decoder may allocate what a peer's bytes ask for.
flags=(-max_total_time="$secs" -max_len=8192 -timeout=10 -rss_limit_mb=2048 -malloc_limit_mb=64
    -print_final_stats=1)
failed=()
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
for t in "${targets[@]}"; do
    corpus=fuzz/corpus/$t
    mkdir -p "$corpus"
    dirs=("$corpus")
    [ -d "fuzz/seeds/$t" ] && dirs+=("fuzz/seeds/$t")
    log=$logs/$t.log
    if fuzz run "$t" "${dirs[@]}" -- "${flags[@]}" >"$log" 2>&1; then
        runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
        echo "fuzz: $t: ok, ${runs:-?} inputs in $secs s, corpus $(find "$corpus" -type f | wc -l) files"
    else
        failed+=("$t")
        echo "fuzz: $t: FAILED; the end of its log:"
        tail -n 60 "$log"
    fi
done
echo "fuzz: ${#targets[@]} targets, $((${#targets[@]} - ${#failed[@]})) passed, ${#failed[@]} failed ($((SECONDS - start)) s)"
if ((${#failed[@]})); then
    echo "fuzz: failed: ${failed[*]}; the failing inputs are in fuzz/artifacts/TARGET/," \
        "replay one with: cargo +nightly fuzz run --target-dir $target_dir TARGET FILE" >&2
    exit 1
fi
