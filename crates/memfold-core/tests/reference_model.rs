//! The engine against a plain reference model of guest memory, under random interleavings
//! of VM creation and destruction, full and partial writes, reads, discards, clock ticks,
//! share / reference / patch / compress / swap operations, policy changes and injected swap
//! I/O failures. After every step: every page reads as the model says, every invariant
//! holds (refcounts = mappings + patch references, no leaked frame, blob or slot), and the
//! books add up. At the end all VMs are destroyed and nothing may remain.
//!
//! The long variant runs 10^7 operations (not in CI):
//! `MEMFOLD_MODEL_OPS=10000000 cargo test --release -p memfold-core --test reference_model -- --ignored --nocapture`

mod model;

use model::{random_op, random_setup, Content, Harness, Op, Setup};
use proptest::prelude::*;
use rand::{rngs::SmallRng, SeedableRng};

fn content() -> impl Strategy<Value = Content> {
    prop_oneof![
        2 => Just(Content::Zero),
        3 => any::<u8>().prop_map(Content::Base),
        3 => (any::<u8>(), any::<u8>()).prop_map(|(b, s)| Content::Similar(b, s)),
        1 => any::<u8>().prop_map(Content::Text),
        1 => any::<u64>().prop_map(Content::Random),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    let vg = (any::<u32>(), any::<u32>());
    prop_oneof![
        2 => (1u32..40).prop_map(|pages| Op::CreateVm { pages }),
        1 => any::<u32>().prop_map(|vm| Op::DestroyVm { vm }),
        20 => (vg, content()).prop_map(|((vm, gfn), content)| Op::WritePage { vm, gfn, content }),
        10 => (vg, any::<u16>(), any::<u16>(), any::<u8>()).prop_map(|((vm, gfn), offset, len, byte)| Op::WritePartial { vm, gfn, offset, len, byte }),
        15 => (vg, any::<u16>(), any::<u16>()).prop_map(|((vm, gfn), offset, len)| Op::Read { vm, gfn, offset, len }),
        3 => vg.prop_map(|(vm, gfn)| Op::Discard { vm, gfn }),
        12 => (1u16..64, 0u32..3000).prop_map(|(budget, advance_ms)| Op::Tick { budget, advance_ms }),
        8 => vg.prop_map(|(vm, gfn)| Op::Share { vm, gfn }),
        4 => vg.prop_map(|(vm, gfn)| Op::IndexReference { vm, gfn }),
        7 => vg.prop_map(|(vm, gfn)| Op::Patch { vm, gfn }),
        6 => vg.prop_map(|(vm, gfn)| Op::Compress { vm, gfn }),
        5 => vg.prop_map(|(vm, gfn)| Op::SwapOut { vm, gfn }),
        2 => (1u8..8).prop_map(|pages| Op::SwapHint { pages }),
        1 => any::<u8>().prop_map(Op::SetPolicy),
        2 => any::<bool>().prop_map(Op::FailSwapWrites),
        2 => any::<bool>().prop_map(Op::FailSwapReads),
    ]
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        any::<u8>(),
        prop_oneof![Just(1u32), Just(5)],
        any::<u8>(),
        any::<u8>(),
        prop::option::of(8u32..80),
        0u32..96,
        prop::bool::weighted(0.15),
        prop_oneof![Just(0u32), Just(4000)],
    )
        .prop_map(
            |(
                zero,
                passes,
                patch_codec,
                compress_codec,
                host_limit,
                swap_slots,
                collide_hashes,
                min_rescan_ms,
            )| Setup {
                zero,
                passes,
                patch_codec,
                compress_codec,
                host_limit,
                swap_slots,
                collide_hashes,
                min_rescan_ms,
            },
        )
}

fn run(setup: &Setup, ops: &[Op]) -> Result<(), String> {
    let mut h = Harness::new(setup);
    // Always start with two VMs so that early ops have something to act on.
    h.step(&Op::CreateVm { pages: 24 })?;
    h.step(&Op::CreateVm { pages: 17 })?;
    for (n, op) in ops.iter().enumerate() {
        h.step(op).map_err(|e| format!("step {n}: {e}"))?;
        h.verify_all()
            .map_err(|e| format!("after step {n} ({op:?}): {e}"))?;
    }
    h.teardown()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 96, max_shrink_iters: 4000, ..ProptestConfig::default() })]
    #[test]
    fn engine_matches_reference_model(setup in setup(), ops in proptest::collection::vec(op(), 1..250)) {
        if let Err(e) = run(&setup, &ops) {
            prop_assert!(false, "{e}\nsetup: {setup:?}");
        }
    }
}

/// Seeded random runs, many steps each: deeper states than proptest's short sequences.
#[test]
fn engine_matches_reference_model_seeded() {
    long_run(200_000, 1, 25);
}

#[test]
#[ignore = "long: 10^7 operations; run with --ignored (see the module docs)"]
fn engine_matches_reference_model_long() {
    let ops: u64 = std::env::var("MEMFOLD_MODEL_OPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(10_000_000);
    long_run(ops, 100, 1);
}

/// Runs `total` ops over runs of `total / runs` ops, each with a fresh random setup.
/// The touched page is checked after every step, everything every `full_every` steps.
fn long_run(total: u64, seed: u64, full_every: u64) {
    let runs = (total / 20_000).max(1);
    let per_run = total / runs;
    let mut r = SmallRng::seed_from_u64(seed);
    let mut tolerated = 0;
    let mut c = memfold_core::Counters::default();
    let started = std::time::Instant::now();
    for run_no in 0..runs {
        let setup = random_setup(&mut r);
        let mut h = Harness::new(&setup);
        h.step(&Op::CreateVm { pages: 32 }).unwrap();
        h.step(&Op::CreateVm { pages: 20 }).unwrap();
        for n in 0..per_run {
            let op = random_op(&mut r);
            let touched = h
                .step(&op)
                .unwrap_or_else(|e| panic!("run {run_no} step {n}: {e}\n{setup:?}"));
            if let Some((i, g)) = touched {
                h.verify_page(i, g)
                    .unwrap_or_else(|e| panic!("run {run_no} step {n} ({op:?}): {e}\n{setup:?}"));
            }
            if n % full_every == 0 {
                h.verify_all()
                    .unwrap_or_else(|e| panic!("run {run_no} step {n} ({op:?}): {e}\n{setup:?}"));
            }
        }
        h.verify_all().unwrap();
        let k = *h.engine.counters();
        for (sum, x) in [
            (&mut c.shares, k.shares),
            (&mut c.zero_reclaims, k.zero_reclaims),
            (&mut c.cow_breaks, k.cow_breaks),
            (&mut c.patches, k.patches),
            (&mut c.unpatches, k.unpatches),
            (&mut c.compressions, k.compressions),
            (&mut c.decompressions, k.decompressions),
            (&mut c.swap_outs, k.swap_outs),
            (&mut c.swap_ins, k.swap_ins),
            (&mut c.swap_full, k.swap_full),
            (&mut c.hash_false_matches, k.hash_false_matches),
            (&mut c.passes, k.passes),
        ] {
            *sum += x;
        }
        h.teardown().unwrap_or_else(|e| panic!("run {run_no}: {e}"));
        tolerated += h.tolerated_errors;
    }
    println!(
        "reference model: {} ops in {runs} runs, {tolerated} tolerated errors (budget/swap I/O), {:.1} s\n{c:?}",
        runs * per_run,
        started.elapsed().as_secs_f64()
    );
    // The mix must reach every mechanism and its undo, or this test proves nothing.
    for (name, n) in [
        ("shares", c.shares),
        ("zero reclaims", c.zero_reclaims),
        ("CoW breaks", c.cow_breaks),
        ("patches", c.patches),
        ("unpatches", c.unpatches),
        ("compressions", c.compressions),
        ("decompressions", c.decompressions),
        ("swap-outs", c.swap_outs),
        ("swap-ins", c.swap_ins),
        ("full swap", c.swap_full),
        ("false hash matches", c.hash_false_matches),
        ("passes", c.passes),
    ] {
        assert!(n > 0, "the random mix never reached {name}");
    }
}
