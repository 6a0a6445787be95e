//! A device's catch-up on held blocks (Satori §5.2's block → frame table) is listed once
//! for its guest's sharing domain: memfoldd's side, with real agents in this process and
//! a block device played through the wire's `LandedReporter`. A test binary of its
//! own: the in-process agents and memfoldds of two tests in one process disturb each
//! other.

mod common;

use std::time::Duration;

use memfold_ids::{BaseBlock, Gfn};
use rand::{rngs::SmallRng, SeedableRng};

use common::{eventually, ram_file};

const PAGES: usize = 2048;
const PAGES_B: usize = 2560;

/// A device told of what its guest's domain holds is told once a domain, not each time
/// it names another guest (a QEMU with several RAM regions is several guests — of one
/// domain, or here, under `--share-domains vm`, of one each — and its device names them
/// in turn): each catch-up walked a domain's index on memfoldd's main thread and sent its
/// blocks again. A late device names the two guests in turn; only a's domain holds the
/// blocks. Fails with a catch-up at each change of guest (the blocks told again each
/// time), and with only the last domain remembered.
#[test]
fn a_device_naming_guests_in_turn_is_caught_up_once_a_domain() {
    let dir = tempfile::tempdir().unwrap();
    let socket = common::start_memfoldd_with(memfold_live::daemon::DaemonConfig {
        domains: memfold_live::daemon::DomainRule::Vm,
        ..common::daemon_config(dir.path(), common::read_fill_engine())
    });
    let mut rng = SmallRng::seed_from_u64(59);
    let (a, b) = common::two_random_guests(&socket, &mut rng, PAGES, PAGES_B);
    let (base_path, base, disk) = common::random_base(dir.path(), &mut rng, 4);
    let block = |k: usize| BaseBlock {
        disk,
        block: k as u64,
    };
    let device = || common::base_device(&socket, &base_path, disk);
    let first = device();
    common::land_blocks(&a, &first, (&base, disk), 300, 4);
    eventually("a's blocks held", || (0..4).all(|k| first.held(block(k))));

    let late = device();
    assert!(late.report(ram_file(&a), vec![Gfn(6)]));
    eventually("the late device caught up", || {
        (0..4).all(|k| late.held(block(k)))
    });
    for turn in 0..6u32 {
        let (ram, g) = if turn % 2 == 0 { (&b, 7) } else { (&a, 8) };
        assert!(late.report(ram_file(ram), vec![Gfn(g + turn)]));
        eventually("the report sent", || late.sent() == 2 + u64::from(turn));
    }
    std::thread::sleep(Duration::from_millis(500));
    assert_eq!(
        late.told(),
        4,
        "blocks told again as the device named the guests in turn"
    );
}
