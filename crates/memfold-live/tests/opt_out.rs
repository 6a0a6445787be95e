//! The operator's opt-out of a guest, live (issue 14, KSM parity: `MADV_UNMERGEABLE` for a
//! whole VM): this test process plays QEMU — guest RAM a memfd mapping, the real agent in
//! a thread, memfoldd in another. Once the guest's pages are shared, reclaimed as zero,
//! patched and compressed, `memfold_live::opt_out` asks memfoldd to take the guest out:
//! every page must come back into the guest's own RAM (its books count each mechanism
//! to zero, no page is left on the pool or a hole), its bytes unchanged, and nothing is
//! managed again until it is opted back in.

mod common;

use std::sync::atomic::Ordering;
use std::time::Duration;

use common::{
    attached, daemon_config, every_mechanism, fast_engine, fill_every_mechanism, managed,
    start_agent, start_memfoldd, start_stoppable_memfoldd, vm_named, wait_for, GuestRam, PAGE,
};
use memfold_core::sim::texty;
use memfold_live::daemon;
use rand::{rngs::SmallRng, Rng, SeedableRng};

const PAGES: usize = 1536;

const NAME: &str = "opted";

#[test]
fn an_opted_out_guest_gets_every_page_back_and_nothing_is_managed_again() {
    let work = tempfile::tempdir().unwrap();
    let socket = start_memfoldd(work.path(), fast_engine());
    let ram = GuestRam::new("opted-guest-ram", PAGES);
    // Zeros, duplicates, near-duplicates, text, random: every mechanism takes some.
    let want = fill_every_mechanism(&ram, 11);
    start_agent(&socket, "opted", &ram);
    let s = wait_for(&socket, Duration::from_secs(30), "every mechanism", |s| {
        every_mechanism(vm_named(s, NAME))
    });
    let before = managed(vm_named(&s, NAME));

    let queued = memfold_live::opt_out(&socket, "opted", true).unwrap();
    assert!(
        queued as u64 >= before / 2,
        "{queued} pages queued of {before}"
    );
    let s = wait_for(
        &socket,
        Duration::from_secs(20),
        "every page taken back",
        |s| managed(vm_named(s, NAME)) == 0,
    );
    let v = vm_named(&s, NAME);
    assert!(v.opted_out);
    assert_eq!((s.frames, s.store_pages), (0, 0), "{s:#?}");
    // In its own RAM again: no page on a pool frame, each non-zero page's bytes in the
    // memfd (zero pages may stay holes, as any never-touched page).
    for (g, w) in want.iter().enumerate() {
        assert!(!ram.on_pool(g), "gfn {g} still maps a pool frame");
        assert!(
            ram.has_data(g) || w.iter().all(|&b| b == 0),
            "gfn {g} is a hole"
        );
        let mut got = vec![0u8; PAGE];
        ram.read(g, &mut got);
        assert_eq!(&got, w, "gfn {g} reads other bytes after the opt-out");
    }
    // Nothing is managed again while it is out (several scans and clock passes).
    std::thread::sleep(Duration::from_secs(3));
    let s = memfold_live::query_stats(&socket).unwrap();
    assert_eq!(
        managed(vm_named(&s, NAME)),
        0,
        "managed again while opted out: {s:#?}"
    );

    // Back in: every mechanism takes its pages again, patches included (its duplicates,
    // cold by now, may be shared without a mapping: not in `shared_pages`).
    assert_eq!(memfold_live::opt_out(&socket, "opted", false).unwrap(), 0);
    wait_for(&socket, Duration::from_secs(30), "managed again", |s| {
        let v = vm_named(s, NAME);
        !v.opted_out
            && v.shared_pages + v.unmapped_pages > 0
            && v.zero_reclaimed_pages > 0
            && v.patched_pages > 0
            && v.compressed_pages > 0
    });
    let err = memfold_live::opt_out(&socket, "nobody", true).unwrap_err();
    assert!(
        err.to_string().contains("no guest named \"nobody\""),
        "{err}"
    );
}

/// An opt-out outlives memfoldd (as KSM's `MADV_UNMERGEABLE` outlives ksmd's restarts):
/// the agent remembers it and says so when it re-attaches, so the next memfoldd keeps
/// the guest out — nothing shared, reclaimed or stored — until the operator opts it in.
#[test]
fn an_opt_out_outlives_a_memfoldd_restart() {
    let work = tempfile::tempdir().unwrap();
    let (socket, stop, first) = start_stoppable_memfoldd(work.path(), fast_engine());
    let ram = GuestRam::new("kept-out-ram", 1100);
    let mut rng = SmallRng::seed_from_u64(5);
    let mut base = vec![0u8; PAGE];
    rng.fill(&mut base[..]);
    for g in 0..1100 {
        let mut p = vec![0u8; PAGE];
        match g % 3 {
            0 => {}
            1 => p.copy_from_slice(&base),
            _ => texty(&mut rng, &mut p),
        }
        ram.write(g, 0, &p);
    }
    start_agent(&socket, "kept-out", &ram);
    wait_for(&socket, Duration::from_secs(30), "shared", |s| {
        attached(s, "kept-out").is_some_and(|v| v.shared_pages > 0)
    });
    memfold_live::opt_out(&socket, "kept-out", true).unwrap();
    wait_for(&socket, Duration::from_secs(20), "taken back", |s| {
        attached(s, "kept-out").is_some_and(|v| v.opted_out && managed(v) == 0)
    });

    // memfoldd goes and a new one starts at the same path; the agent re-attaches.
    stop.store(true, Ordering::Relaxed);
    first.join().unwrap().unwrap();
    let second = daemon_config(work.path(), fast_engine());
    std::thread::spawn(move || daemon::run(second));
    let s = wait_for(&socket, Duration::from_secs(20), "re-attached", |s| {
        attached(s, "kept-out").is_some()
    });
    assert!(attached(&s, "kept-out").unwrap().opted_out, "{s:#?}");
    // Several scans and clock passes: still nothing managed.
    std::thread::sleep(Duration::from_secs(3));
    let s = memfold_live::query_stats(&socket).unwrap();
    let v = attached(&s, "kept-out").unwrap();
    assert!(
        v.opted_out && managed(v) == 0,
        "managed after the restart: {v:#?}"
    );

    // Opted in on the new memfoldd: managed again.
    memfold_live::opt_out(&socket, "kept-out", false).unwrap();
    wait_for(&socket, Duration::from_secs(30), "managed again", |s| {
        attached(s, "kept-out").is_some_and(|v| !v.opted_out && v.shared_pages > 0)
    });
}

/// Says hello as guest `name` of RAM memfd `ram` (`pages` pages) whose agent's word is
/// `opted_out`, and waits for memfoldd's welcome; returns the connection.
fn hello_again(
    socket: &std::path::Path,
    name: &str,
    ram: &std::os::fd::OwnedFd,
    pages: usize,
    opted_out: bool,
) -> memfold_wire::Conn {
    use memfold_wire::{Conn, ToAgent, ToDaemon, PROTOCOL_VERSION};
    use std::os::fd::AsFd;
    let c = Conn::connect(socket).unwrap();
    let hello = ToDaemon::AgentHello {
        version: PROTOCOL_VERSION,
        name: name.into(),
        pid: std::process::id(),
        ram_bytes: (pages * PAGE) as u64,
        shared: 0,
        opted_out,
    };
    c.send(&hello, &[ram.as_fd()]).unwrap();
    c.set_recv_timeout(Duration::from_secs(5)).unwrap();
    let (reply, _) = c.recv::<ToAgent>().unwrap().expect("an answer");
    assert!(matches!(reply, ToAgent::Welcome { .. }), "{reply:?}");
    c
}

/// An opt-out (and an opt-in) memfoldd answered holds across its restart even if the
/// guest's agent never heard of it: here the test plays an agent that reads nothing after
/// its welcome, and tells the next memfoldd its stale word (in after the opt-out, out
/// after the opt-in). The record beside the socket wins (`daemon/opt_outs.rs`). Fails
/// without it: the guest merged again after the restart, kept out after the opt-in.
#[test]
fn an_opt_out_its_agent_never_heard_of_outlives_a_memfoldd_restart() {
    let work = tempfile::tempdir().unwrap();
    let pages = 96;
    let ram = memfold_sys::memfd::create("unheard").unwrap();
    memfold_sys::memfd::set_len(std::os::fd::AsFd::as_fd(&ram), (pages * PAGE) as u64).unwrap();
    let is_out = |s: &memfold_wire::stats::Stats| attached(s, "unheard").map(|v| v.opted_out);

    let (socket, stop, first) = start_stoppable_memfoldd(work.path(), fast_engine());
    let c = hello_again(&socket, "unheard", &ram, pages, false);
    memfold_live::opt_out(&socket, "unheard", true).unwrap();
    stop.store(true, Ordering::Relaxed);
    first.join().unwrap().unwrap();
    drop(c);

    let (socket, stop, second) = start_stoppable_memfoldd(work.path(), fast_engine());
    let c = hello_again(&socket, "unheard", &ram, pages, false);
    let s = memfold_live::query_stats(&socket).unwrap();
    assert_eq!(
        is_out(&s),
        Some(true),
        "merged again after the restart: {s:#?}"
    );
    memfold_live::opt_out(&socket, "unheard", false).unwrap();
    stop.store(true, Ordering::Relaxed);
    second.join().unwrap().unwrap();
    drop(c);

    let (socket, _stop, _third) = start_stoppable_memfoldd(work.path(), fast_engine());
    let _c = hello_again(&socket, "unheard", &ram, pages, true);
    let s = memfold_live::query_stats(&socket).unwrap();
    assert_eq!(is_out(&s), Some(false), "kept out after the opt-in: {s:#?}");
}
