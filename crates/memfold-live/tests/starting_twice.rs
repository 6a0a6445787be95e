//! Two memfoldds started at once on one socket path (a restart by the service manager
//! and an operator's, after a crash left the socket file behind): both found the socket
//! stale, the second unlinked the first's and bound its own, and each adopted the same
//! pool as its agents re-attached, handing out its holes twice. One memfoldd at a time
//! now holds the socket's lock file from its check to its end. Here the first holds it
//! (between its check and its bind): the second is refused before it touches the socket
//! file, and starts once the first is gone. Fails without the lock (the second removes
//! the stale socket and serves).

mod common;

use std::os::unix::fs::MetadataExt;
use std::sync::atomic::{AtomicBool, Ordering};

use common::{daemon_config, fast_engine, start_stoppable_memfoldd};
use memfold_live::daemon::{self, DaemonError};

#[test]
fn a_memfoldd_starting_beside_another_is_refused_before_it_touches_the_socket() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = daemon_config(dir.path(), fast_engine());
    let socket = cfg.socket.clone();
    // A killed memfoldd's socket file: nothing listens on it.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    let stale = std::fs::symlink_metadata(&socket).unwrap().ino();

    let first = daemon::lock_socket(&socket).unwrap();
    // Told to stop at once: without the lock it would bind, serve a moment, and return.
    let stop = AtomicBool::new(true);
    let r = daemon::serve(cfg, &stop, || {});
    assert!(matches!(r, Err(DaemonError::Locked { .. })), "{r:?}");
    let now = std::fs::symlink_metadata(&socket).unwrap().ino();
    assert_eq!(now, stale, "the second memfoldd replaced the socket file");

    drop(first);
    let (_, stop, thread) = start_stoppable_memfoldd(dir.path(), fast_engine());
    stop.store(true, Ordering::Relaxed);
    assert!(thread.join().unwrap().is_ok());
}
