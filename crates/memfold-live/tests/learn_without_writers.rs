//! memfoldd learns which frame holds a base block (Satori §5.2's block → frame table) only
//! from a read of the base while no process has it open for writing: Linux sets a file's
//! mtime as a write call starts, so during a long write in place a block the write has not
//! reached yet would be read with its old bytes under the file's final id, and a device
//! opened after the rewrite filled with them. Here a writer holds the base open (writing
//! nothing): reads of its blocks landing in guest RAM are shared, but not learnt; once the
//! writer has closed it, the next reads are. Real agents in this process, the device
//! played through the wire's `LandedReporter`. Fails with the base read under no lease
//! (the blocks learnt with the writer open).

mod common;

use std::time::Duration;

use memfold_ids::BaseBlock;
use rand::{rngs::SmallRng, SeedableRng};

use common::eventually;

#[test]
fn no_block_is_learnt_while_its_base_is_open_for_writing() {
    let dir = tempfile::tempdir().unwrap();
    let socket = common::start_memfoldd_with(common::daemon_config(
        dir.path(),
        common::read_fill_engine(),
    ));
    let mut rng = SmallRng::seed_from_u64(61);
    let (a, _b) = common::two_random_guests(&socket, &mut rng, 2048, 2560);
    let (base_path, base, disk) = common::random_base(dir.path(), &mut rng, 4);
    let probe = std::fs::File::open(&base_path).unwrap();
    if let Err(memfold_sys::files::LeaseError::Unavailable(e)) =
        memfold_sys::files::without_writers(&probe, || ())
    {
        // A file system without leases, or fs.leases-enable 0: memfoldd learns as before.
        return memfold_sys::testing::skipped(
            "no_block_is_learnt_while_its_base_is_open_for_writing",
            &format!("no read lease here: {e}"),
        );
    }
    let block = |k: usize| BaseBlock {
        disk,
        block: k as u64,
    };
    let device = common::base_device(&socket, &base_path, disk);
    // Each block read twice, into two pages: shared, and a candidate to learn.
    let land = |first: usize| common::land_blocks(&a, &device, (&base, disk), first, 4);

    let writer = std::fs::OpenOptions::new()
        .write(true)
        .open(&base_path)
        .unwrap();
    land(300);
    common::wait_for(&socket, Duration::from_secs(20), "the reads shared", |s| {
        common::attached(s, "a").is_some_and(|v| v.shared_pages >= 4)
    });
    std::thread::sleep(Duration::from_secs(1));
    assert!(
        (0..4).all(|k| !device.held(block(k))),
        "blocks learnt while the base was open for writing"
    );
    let s = memfold_live::query_stats(&socket).unwrap();
    assert_eq!(s.blocks_held, 0, "{s:#?}");

    drop(writer);
    land(600);
    eventually("the blocks learnt once the writer closed the base", || {
        (0..4).all(|k| device.held(block(k)))
    });
}
