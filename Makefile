# memfold: the two commands of the README, and the parts they are made of.

.PHONY: setup main test test-long bench lint

# Installs what a fresh machine lacks (idempotent).
setup:
	bash scripts/setup.sh

# The main job on the built-in default. Until live guests land (issues 3-4): the
# Difference Engine micro-benchmark driven through the engine core.
main: setup
	cargo run --release -p memfold-cli --bin memfold -- bench micro

# Every test CI runs: unit, property and integration tests, plus lint.
test: setup
	cargo test --workspace --release
	cargo clippy --workspace --all-targets --release -- -D warnings

# The reference-model run of 10^7 operations (about 6 minutes; not in CI).
test-long:
	MEMFOLD_MODEL_OPS=10000000 cargo test --release -p memfold-core --test reference_model -- --ignored --nocapture

bench:
	cargo bench -p memfold-core --bench ops
