//! A clean stop (SIGTERM's path: `daemon::serve` with its stop flag set) and a restart
//! on the same socket path (issue 20). This test process plays QEMU for one guest (guest
//! RAM a memfd mapping, the real agent in a thread). memfoldd shares, reclaims, patches
//! and compresses its pages, then is told to stop: it must return `Ok`, remove its socket
//! file, and leave the guest reading every byte it wrote while no memfoldd runs (its
//! agent serves every fault from what it holds). A second memfoldd must refuse to start
//! while the first listens (and leave its socket alone), take over a stale socket file
//! (nothing listening) at the path, and pick the guest up when its agent re-attaches: the
//! shared frames adopted, the bytes intact, nothing held past the books.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{
    attached, daemon_config, every_mechanism, fast_engine, fill_every_mechanism, start_agent,
    start_stoppable_memfoldd, wait_for, GuestRam, PAGE,
};
use memfold_live::daemon::{self, DaemonError};

fn check(ram: &GuestRam, want: &[Vec<u8>], when: &str) {
    let mut page = vec![0u8; PAGE];
    for (g, w) in want.iter().enumerate() {
        ram.read(g, &mut page);
        assert!(page == *w, "{when}: gfn {g} reads bytes it did not write");
    }
}

/// What memfoldd logs, captured (the one test of this binary installs it globally:
/// memfoldd logs from its own threads).
#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Log {
    fn install() -> Log {
        let log = Log::default();
        let w = log.clone();
        let sub = tracing_subscriber::fmt()
            .with_writer(move || w.clone())
            .with_ansi(false)
            .without_time()
            .finish();
        tracing::subscriber::set_global_default(sub).expect("the only subscriber");
        log
    }

    /// Lines logged so far that contain every one of `parts`.
    fn count(&self, parts: &[&str]) -> usize {
        let text = String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned();
        text.lines()
            .filter(|l| parts.iter().all(|p| l.contains(p)))
            .count()
    }
}

#[test]
fn a_clean_stop_keeps_the_guests_data_and_the_next_memfoldd_picks_it_up() {
    let log = Log::install();
    let work = tempfile::tempdir().unwrap();
    let (socket, stop, first) = start_stoppable_memfoldd(work.path(), fast_engine());
    let ram = GuestRam::new("clean-stop-ram", 1280);
    let want = fill_every_mechanism(&ram, 20);
    start_agent(&socket, "g", &ram);
    wait_for(&socket, Duration::from_secs(60), "every mechanism", |s| {
        attached(s, "g").is_some_and(every_mechanism)
    });

    // A second memfoldd at the path of a running one does not start, nor take its socket.
    let again = daemon::run_until(
        daemon_config(work.path(), fast_engine()),
        &AtomicBool::new(true),
    );
    assert!(
        matches!(again, Err(DaemonError::Running { .. })),
        "a second memfoldd at a live socket: {again:?}"
    );
    memfold_live::query_stats(&socket).expect("the first memfoldd still answers");

    // The clean stop: Ok, the socket file gone, the guest's bytes intact without memfoldd.
    stop.store(true, Ordering::Relaxed);
    first.join().unwrap().expect("a clean stop returns Ok");
    assert!(
        !socket.exists(),
        "the socket file is removed on a clean stop"
    );
    check(&ram, &want, "with no memfoldd");

    // A stale socket file (nothing listens) is taken over by the next memfoldd.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    assert!(socket.exists());
    let stop2 = Arc::new(AtomicBool::new(false));
    let flag = Arc::clone(&stop2);
    let cfg = daemon_config(work.path(), fast_engine());
    let second = std::thread::spawn(move || daemon::run_until(cfg, &flag));
    let s = wait_for(&socket, Duration::from_secs(30), "g re-attached", |s| {
        attached(s, "g").is_some_and(|v| v.shared_pages > 0)
    });
    assert!(
        s.adopted_pool,
        "the second memfoldd adopts g's pool: {s:#?}"
    );
    check(&ram, &want, "after the restart");
    std::thread::sleep(Duration::from_secs(1));
    let s = memfold_live::query_stats(&socket).unwrap();
    assert_eq!(
        s.held.unbooked(),
        0,
        "bytes held past the books: {:?}",
        s.held
    );
    stop2.store(true, Ordering::Relaxed);
    second
        .join()
        .unwrap()
        .expect("the second stops cleanly too");
    assert!(!socket.exists());
    check(&ram, &want, "after the second stop");

    // The lifecycle, logged: each start's socket, the guest attached to each, the pool
    // adopted, each stop.
    let sock = socket.display().to_string();
    assert_eq!(log.count(&["listening on ", &sock]), 2);
    assert_eq!(
        log.count(&["a stale socket (nothing listens): replaced"]),
        1
    );
    assert_eq!(log.count(&["attached", "name=g "]), 2);
    assert_eq!(log.count(&["adopts the pool of a previous memfoldd"]), 1);
    assert_eq!(log.count(&["stopping: no new work"]), 2);
    assert_eq!(log.count(&["stopped: socket ", &sock, "1 agents left"]), 2);
}
