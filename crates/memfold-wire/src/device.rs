//! A block device's side of memfoldd's socket (Satori §4.1, sharing-aware block
//! devices): `memfold-blk` tells memfoldd which guest pages each disk read filled
//! ([`ToDaemon::ReadLanded`]), so that memfoldd looks them up at once instead of when
//! its scan reaches them.
//!
//! A report is a hint, and the device's own work comes first: [`LandedReporter::report`]
//! never blocks the request path. Reports go through a bounded queue to a thread of
//! their own that holds the connection; a full queue, or memfoldd not running, drops the
//! report (counted in [`LandedReporter::dropped`]) — the scan still finds those pages.
//! The thread connects again at most once a second while memfoldd is away.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use memfold_ids::Gfn;

use crate::messages::{RamFile, ToDaemon, MAX_BATCH, PROTOCOL_VERSION};
use crate::Conn;

/// Reports waiting for the reporter's thread at most (each up to one read request's
/// pages); more are dropped.
pub const QUEUE: usize = 1024;

/// Least time between two attempts to reach memfoldd.
const RECONNECT: Duration = Duration::from_secs(1);

/// A send to memfoldd waiting longer than this takes memfoldd as stalled: the connection
/// is dropped and made again.
const SEND_TIMEOUT: Duration = Duration::from_millis(500);

/// Sends [`ToDaemon::ReadLanded`] reports to memfoldd from a thread of its own.
pub struct LandedReporter {
    tx: SyncSender<(RamFile, Vec<Gfn>, u64)>,
    counts: Arc<Counts>,
}

#[derive(Default)]
struct Counts {
    sent: AtomicU64,
    dropped: AtomicU64,
}

impl LandedReporter {
    /// A reporter to memfoldd's socket at `socket`; its thread is named `landed`.
    ///
    /// Errors: the thread could not be started.
    pub fn spawn(socket: &Path) -> std::io::Result<LandedReporter> {
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let counts = Arc::new(Counts::default());
        let (path, c) = (socket.to_path_buf(), counts.clone());
        std::thread::Builder::new()
            .name("landed".into())
            .spawn(move || send_loop(&path, &rx, &c))?;
        Ok(LandedReporter { tx, counts })
    }

    /// Queues a report that pages `gfns` (file offset / 4 KiB) of the guest RAM memfd
    /// `ram` were just filled whole by a disk read. Never blocks: with the queue full or
    /// the thread gone the pages are dropped. Returns whether they were queued. The
    /// report is stamped now (`CLOCK_MONOTONIC`): memfoldd times its shares from here.
    pub fn report(&self, ram: RamFile, gfns: Vec<Gfn>) -> bool {
        if gfns.is_empty() {
            return true;
        }
        let n = gfns.len() as u64;
        match self
            .tx
            .try_send((ram, gfns, memfold_sys::proc::monotonic_ns()))
        {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.counts.dropped.fetch_add(n, Ordering::Relaxed);
                false
            }
        }
    }

    /// Pages sent to memfoldd so far.
    pub fn sent(&self) -> u64 {
        self.counts.sent.load(Ordering::Relaxed)
    }

    /// Pages dropped so far: queue full, or memfoldd not reachable.
    pub fn dropped(&self) -> u64 {
        self.counts.dropped.load(Ordering::Relaxed)
    }
}

/// The reporter's thread: until the reporter is dropped, sends each report in batches of
/// at most [`MAX_BATCH`] pages, connecting (with a [`ToDaemon::DeviceHello`]) when it
/// has none and dropping reports while memfoldd cannot be reached.
fn send_loop(path: &Path, rx: &Receiver<(RamFile, Vec<Gfn>, u64)>, counts: &Counts) {
    let mut conn: Option<Conn> = None;
    let mut next_try = Instant::now();
    while let Ok((ram, gfns, landed_ns)) = rx.recv() {
        if conn.is_none() && Instant::now() >= next_try {
            next_try = Instant::now() + RECONNECT;
            conn = connect(path);
        }
        let n = gfns.len() as u64;
        let Some(c) = &conn else {
            counts.dropped.fetch_add(n, Ordering::Relaxed);
            continue;
        };
        let all_sent = gfns.chunks(MAX_BATCH).all(|chunk| {
            let msg = ToDaemon::ReadLanded {
                ram,
                gfns: chunk.to_vec(),
                landed_ns,
            };
            c.send(&msg, &[]).is_ok()
        });
        if all_sent {
            counts.sent.fetch_add(n, Ordering::Relaxed);
        } else {
            tracing::debug!(
                "memfoldd at {}: a report failed; reconnecting",
                path.display()
            );
            counts.dropped.fetch_add(n, Ordering::Relaxed);
            conn = None;
        }
    }
}

fn connect(path: &Path) -> Option<Conn> {
    let c = Conn::connect(path)
        .inspect_err(|e| tracing::debug!("{e}; read reports dropped for now"))
        .ok()?;
    c.set_send_timeout(SEND_TIMEOUT).ok()?;
    c.send(
        &ToDaemon::DeviceHello {
            version: PROTOCOL_VERSION,
        },
        &[],
    )
    .ok()?;
    Some(c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Listener;

    fn ram() -> RamFile {
        RamFile { dev: 7, ino: 42 }
    }

    /// Waits up to 5 s for `f`.
    fn eventually(f: impl Fn() -> bool) -> bool {
        let until = Instant::now() + Duration::from_secs(5);
        while Instant::now() < until {
            if f() {
                return true;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// With memfoldd away reports are dropped and counted, never blocking; once it
    /// listens, the reporter connects, says hello, and a report of more pages than a
    /// batch arrives in batches of at most [`MAX_BATCH`], every page once, in order.
    #[test]
    fn reports_are_dropped_while_memfoldd_is_away_then_arrive_in_batches() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memfoldd.sock");
        let r = LandedReporter::spawn(&path).unwrap();
        assert!(r.report(ram(), vec![Gfn(1), Gfn(2)]));
        assert!(eventually(|| r.dropped() == 2), "dropped {}", r.dropped());
        let listener = Listener::bind(&path).unwrap();
        std::thread::sleep(RECONNECT);
        let gfns: Vec<Gfn> = (0..MAX_BATCH as u32 + 10).map(Gfn).collect();
        assert!(r.report(ram(), gfns.clone()));
        let conn = listener.accept().unwrap();
        let (hello, _) = conn.recv::<ToDaemon>().unwrap().unwrap();
        assert_eq!(
            hello,
            ToDaemon::DeviceHello {
                version: PROTOCOL_VERSION
            }
        );
        let mut got = Vec::new();
        while got.len() < gfns.len() {
            match conn.recv::<ToDaemon>().unwrap().unwrap().0 {
                ToDaemon::ReadLanded { ram: f, gfns, .. } => {
                    assert_eq!(f, ram());
                    assert!(gfns.len() <= MAX_BATCH);
                    got.extend(gfns);
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(got, gfns);
        assert!(eventually(|| r.sent() == gfns.len() as u64));
        assert_eq!(r.dropped(), 2);
    }

    /// A full queue drops instead of waiting (the device's requests must not stall on
    /// memfoldd).
    #[test]
    fn a_full_queue_drops_without_blocking() {
        let (tx, _rx) = mpsc::sync_channel(1);
        let r = LandedReporter {
            tx,
            counts: Arc::default(),
        };
        assert!(r.report(ram(), vec![Gfn(1)]));
        let started = Instant::now();
        assert!(!r.report(ram(), vec![Gfn(2), Gfn(3)]));
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(r.dropped(), 2);
    }
}
