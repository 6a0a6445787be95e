//! A memfoldd restart in which a **new guest attaches first** (issue 14, "staggered
//! re-attach after kill -9, a new guest attaching first"). This test process plays QEMU
//! for two guests (guest RAM memfd mappings, the real agents in threads) and runs two
//! memfoldds in turn. The first shares and stores guest 1's pages, then stops (its
//! descriptors close, as a killed memfoldd's do). The second starts at another path, and
//! guest 2 attaches to it — making a pool for their domain — before the second's socket is
//! moved to the path guest 1's agent reconnects to. Guest 1 must re-attach with the pool
//! it maps (adopted beside the new one, in a second domain of the same user), keep its
//! shared frames, and both guests read every byte they wrote.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{
    attached, daemon_config, fast_engine, start_agent, start_stoppable_memfoldd, wait_for,
    GuestRam, PAGE,
};
use memfold_core::sim::texty;
use memfold_live::daemon;
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// Zeros, copies of `base`, text, random.
fn fill(ram: &GuestRam, base: &[u8], rng: &mut SmallRng) -> Vec<Vec<u8>> {
    let pages = ram.bytes() / PAGE;
    let mut want = vec![vec![0u8; PAGE]; pages];
    for (g, p) in want.iter_mut().enumerate() {
        match g % 4 {
            0 => {}
            1 => p.copy_from_slice(base),
            2 => texty(rng, p),
            _ => rng.fill(&mut p[..]),
        }
        ram.write(g, 0, p);
    }
    want
}

fn check(ram: &GuestRam, want: &[Vec<u8>], who: &str) {
    let mut page = vec![0u8; PAGE];
    for (g, w) in want.iter().enumerate() {
        ram.read(g, &mut page);
        assert!(page == *w, "{who} gfn {g} reads bytes it did not write");
    }
}

#[test]
fn a_new_guest_attaching_first_after_a_restart_does_not_lock_out_the_old_ones() {
    let work = tempfile::tempdir().unwrap();
    let (socket, stop, a) = start_stoppable_memfoldd(work.path(), fast_engine());

    let mut rng = SmallRng::seed_from_u64(31);
    let mut base = vec![0u8; PAGE];
    rng.fill(&mut base[..]);
    let ram1 = GuestRam::new("restart-g1-ram", 1024);
    let want1 = fill(&ram1, &base, &mut rng);
    start_agent(&socket, "g1", &ram1);
    wait_for(
        &socket,
        Duration::from_secs(30),
        "g1 shared and stored",
        |s| attached(s, "g1").is_some_and(|v| v.shared_pages > 0 && v.compressed_pages > 0),
    );

    // The first memfoldd goes; the second starts where g1's agent does not look yet.
    stop.store(true, Ordering::Relaxed);
    a.join().unwrap().unwrap();
    let mut second = daemon_config(work.path(), fast_engine());
    second.socket = work.path().join("second.sock");
    let second_socket = second.socket.clone();
    std::thread::spawn(move || daemon::run(second));
    wait_for(
        &second_socket,
        Duration::from_secs(10),
        "the second memfoldd",
        |_| true,
    );
    let ram2 = GuestRam::new("restart-g2-ram", 768);
    let want2 = fill(&ram2, &base, &mut rng);
    start_agent(&second_socket, "g2", &ram2);
    wait_for(&second_socket, Duration::from_secs(30), "g2 shares", |s| {
        attached(s, "g2").is_some_and(|v| v.shared_pages > 0)
    });
    check(&ram1, &want1, "g1 (on its own)");

    // Now g1's agent finds the second memfoldd and re-attaches with its pool.
    std::fs::rename(&second_socket, &socket).unwrap();
    let s = wait_for(&socket, Duration::from_secs(30), "g1 re-attached", |s| {
        attached(s, "g1").is_some_and(|v| v.shared_pages > 0) && attached(s, "g2").is_some()
    });
    assert_eq!(
        s.domains, 2,
        "g1's adopted pool is a domain beside g2's: {s:#?}"
    );
    assert!(s.adopted_pool);
    std::thread::sleep(Duration::from_secs(2));
    check(&ram1, &want1, "g1");
    check(&ram2, &want2, "g2");
    let s = memfold_live::query_stats(&socket).unwrap();
    assert_eq!(
        s.held.unbooked(),
        0,
        "bytes held past the books: {:?}",
        s.held
    );
}
