//! News of held blocks (Satori §5.2's block → frame table) stay within a sharing domain
//! (`--share-domains`): memfoldd's side, with real agents in this process and block
//! devices played through the wire's [`LandedReporter`]. A test binary of its own: the
//! in-process agents and memfoldds of two tests in one process disturb each other.

mod common;

use std::time::Duration;

use memfold_ids::{BaseBlock, Gfn};
use memfold_wire::LandedReporter;
use rand::{rngs::SmallRng, SeedableRng};

use common::{eventually, ram_file, GuestRam};

const PAGES: usize = 2048;
const PAGES_B: usize = 2560;

/// Under `--share-domains vm` each guest is its own tenant: a block held by guest a's
/// frames is news for a's device only — b's device, told, would ask memfoldd for its
/// reads of it, and the time they took would tell b what a reads. A device that names
/// its guest after blocks were learnt (a restarted one, a guest started later) is told
/// of those its guest's domain holds, at once, and of no other domain's.
#[test]
fn news_of_held_blocks_stay_within_their_sharing_domain() {
    let dir = tempfile::tempdir().unwrap();
    let socket = common::start_memfoldd_with(memfold_live::daemon::DaemonConfig {
        domains: memfold_live::daemon::DomainRule::Vm,
        ..common::daemon_config(dir.path(), common::read_fill_engine())
    });
    let mut rng = SmallRng::seed_from_u64(53);
    let (a, b) = common::two_random_guests(&socket, &mut rng, PAGES, PAGES_B);
    // Blocks 0..4 both guests read; block 4 only a.
    let (base_path, base, disk) = common::random_base(dir.path(), &mut rng, 5);
    let block = |k: usize| BaseBlock {
        disk,
        block: k as u64,
    };
    let device = || common::base_device(&socket, &base_path, disk);
    // Each guest reads every block twice, into two pages of its own: shared within
    // its domain, which then holds the blocks.
    let land = |ram: &GuestRam, dev: &LandedReporter, first: usize, blocks: usize| {
        common::land_blocks(ram, dev, (&base, disk), first, blocks)
    };
    let (dev_a, dev_b) = (device(), device());
    // b's device names b's RAM first (a read of no base block).
    assert!(dev_b.report(ram_file(&b), vec![Gfn(5)]));
    eventually("b's device connected", || dev_b.sent() == 1);
    land(&a, &dev_a, 300, 5);
    eventually("a's blocks held, a's device told", || {
        (0..5).all(|k| dev_a.held(block(k)))
    });
    std::thread::sleep(Duration::from_millis(500));
    assert!(
        (0..5).all(|k| !dev_b.held(block(k))),
        "b's device told of blocks a's frames hold"
    );
    // Blocks b holds itself are b's news.
    land(&b, &dev_b, 700, 4);
    eventually("b's blocks held, b's device told", || {
        (0..4).all(|k| dev_b.held(block(k)))
    });
    assert!(
        !dev_b.held(block(4)),
        "b's device told of a block a's frames hold"
    );
    // A device that names b's RAM after the blocks were learnt (a restarted one) is told
    // of b's domain's blocks at once, in one message (5 blocks): block 4, a's alone,
    // would have come with them.
    let late = device();
    assert!(late.report(ram_file(&b), vec![Gfn(6)]));
    eventually("the late device told of b's blocks", || {
        (0..4).all(|k| late.held(block(k)))
    });
    assert!(
        !late.held(block(4)),
        "a late device told of another domain's block"
    );
}
