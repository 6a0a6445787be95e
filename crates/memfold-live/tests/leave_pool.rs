//! A guest marked never-share at a memfoldd restart (Satori §4.3), whose pool another
//! QEMU still holds (it shared under the earlier memfoldd and another rule), is managed
//! alone — not refused and left unmanaged on frames the other QEMU maps. This process
//! plays QEMU for the guest (its RAM a memfd mapped here, the real agent in a thread);
//! a child process holding the pool plays the other QEMU. The first memfoldd shares and
//! stores the guest's pages; the second, with the guest marked, tells its agent to leave
//! the pool (`ToAgent::LeavePool`): the guest attaches again with none, into a domain of
//! its own, shares again there, maps nothing of the old pool, and reads every byte it
//! wrote. Fails with the old refusal (the guest never attaches).

mod common;

use std::collections::BTreeSet;
use std::os::unix::fs::MetadataExt;
use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{
    attached, daemon_config, fast_engine, fill_every_mechanism, start_agent, start_memfoldd_with,
    start_stoppable_memfoldd, wait_for, GuestRam, PAGE,
};

/// A descriptor of memfoldd's pool open in this process (memfoldd's or the agent's).
fn a_pool_here() -> std::fs::File {
    for e in std::fs::read_dir("/proc/self/fd").unwrap() {
        let p = e.unwrap().path();
        if std::fs::read_link(&p).is_ok_and(|l| l.to_string_lossy().contains("memfold-pool")) {
            return std::fs::File::options()
                .read(true)
                .write(true)
                .open(&p)
                .unwrap();
        }
    }
    panic!("no pool open in this process");
}

#[test]
fn a_guest_marked_never_share_at_a_restart_leaves_the_pool_others_hold() {
    let work = tempfile::tempdir().unwrap();
    let (socket, stop, first) = start_stoppable_memfoldd(work.path(), fast_engine());
    let ram = GuestRam::new("leave-pool-ram", 1536);
    let want = fill_every_mechanism(&ram, 41);
    start_agent(&socket, "g1", &ram);
    wait_for(
        &socket,
        Duration::from_secs(30),
        "g1 shared and stored",
        |s| attached(s, "g1").is_some_and(|v| v.shared_pages > 0 && v.compressed_pages > 0),
    );

    // Another QEMU holds the pool (a guest it shared with under the first memfoldd).
    let pool = a_pool_here();
    let pool_ino = pool.metadata().unwrap().ino();
    let mut other = std::process::Command::new("sleep")
        .arg("120")
        .stdin(pool)
        .spawn()
        .unwrap();
    assert!(
        memfold_sys::testing::mappings_of_inode(pool_ino) > 0,
        "g1 maps nothing of its pool"
    );

    // The first memfoldd goes; the second keeps g1 alone.
    stop.store(true, Ordering::Relaxed);
    first.join().unwrap().unwrap();
    let mut cfg = daemon_config(work.path(), fast_engine());
    cfg.never_share = BTreeSet::from(["g1".to_string()]);
    let socket = start_memfoldd_with(cfg);
    let s = wait_for(
        &socket,
        Duration::from_secs(30),
        "g1 attached alone and sharing again",
        |s| attached(s, "g1").is_some_and(|v| v.shared_pages > 0),
    );
    assert!(
        !s.adopted_pool,
        "the pool another process holds was adopted"
    );
    assert_eq!(s.domains, 1);
    assert_eq!(
        memfold_sys::testing::mappings_of_inode(pool_ino),
        0,
        "g1 still maps the pool another process holds"
    );
    let mut page = vec![0u8; PAGE];
    for (g, w) in want.iter().enumerate() {
        ram.read(g, &mut page);
        assert!(page == *w, "gfn {g} reads bytes it did not write");
    }
    other.kill().unwrap();
    other.wait().unwrap();
}
