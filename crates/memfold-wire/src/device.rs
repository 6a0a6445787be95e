//! A block device's side of memfoldd's socket (Satori §4.1, §5.2, sharing-aware block
//! devices): `memfold-blk` tells memfoldd which guest pages each disk read filled
//! ([`ToDaemon::ReadLanded`]), so that memfoldd looks them up at once instead of when
//! its scan reaches them; and it asks memfoldd to serve reads of base blocks that frames
//! hold ([`ToDaemon::FillRead`]) instead of reading the disk.
//!
//! A report is a hint, and the device's own work comes first: [`LandedReporter::report`]
//! never blocks the request path. Reports go through a bounded queue to a thread of
//! their own that holds the connection; a full queue, or memfoldd not running, drops the
//! report (counted in [`LandedReporter::dropped`]) — the scan still finds those pages.
//! The thread connects again at most once a second while memfoldd is away. A fill
//! ([`LandedReporter::fill`]) waits for memfoldd's answer, at most as long as its caller
//! says; a reader thread takes memfoldd's answers and its [`ToDevice::Held`] news.

use std::collections::{HashMap, HashSet};
use std::os::fd::{AsFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use memfold_ids::{BaseBlock, DiskId, FillId, Gfn};

use crate::messages::{RamFile, ToDaemon, ToDevice, MAX_BATCH, PROTOCOL_VERSION};
use crate::Conn;

/// Messages waiting for the sender thread at most (each up to one read request's
/// pages); more are dropped.
pub const QUEUE: usize = 1024;

/// Base blocks a device remembers as held at most; past it news of more are dropped.
pub const MAX_HELD: usize = 1 << 20;

/// Least time between two attempts to reach memfoldd.
const RECONNECT: Duration = Duration::from_secs(1);

/// A send to memfoldd waiting longer than this takes memfoldd as stalled: the connection
/// is dropped and made again.
const SEND_TIMEOUT: Duration = Duration::from_millis(500);

/// One report for the sender thread.
struct Report {
    ram: RamFile,
    gfns: Vec<Gfn>,
    bases: Vec<(u32, BaseBlock)>,
    landed_ns: u64,
}

enum Out {
    Report(Report),
    Fill(ToDaemon),
}

/// Sends [`ToDaemon::ReadLanded`] reports and fills to memfoldd from a thread of its own.
pub struct LandedReporter {
    tx: SyncSender<Out>,
    shared: Arc<Shared>,
}

#[derive(Default)]
struct Shared {
    sent: AtomicU64,
    dropped: AtomicU64,
    connected: AtomicBool,
    /// The current connection's number; changed, like `connected` going down, only
    /// with `held` locked, so that a dead connection's reader, waking after the next
    /// connection is made, takes nothing of it down.
    generation: AtomicU64,
    next_fill: AtomicU64,
    /// Blocks memfoldd's held-block messages named (cumulative, repeats included).
    told: AtomicU64,
    /// Base blocks memfoldd said frames hold.
    held: Mutex<HashSet<BaseBlock>>,
    /// Fills waiting for their answer.
    waiting: Mutex<HashMap<FillId, SyncSender<Vec<Gfn>>>>,
}

impl LandedReporter {
    /// A reporter to memfoldd's socket at `socket`; its thread is named `landed`. It
    /// serves no base image: no fill.
    ///
    /// Errors: the thread could not be started.
    pub fn spawn(socket: &Path) -> std::io::Result<LandedReporter> {
        Self::spawn_with_bases(socket, Vec::new())
    }

    /// A reporter for a device serving the read-only base images `bases` (each by its id
    /// and an open descriptor of its file, sent in each hello).
    ///
    /// Errors: the thread could not be started.
    pub fn spawn_with_bases(
        socket: &Path,
        bases: Vec<(DiskId, OwnedFd)>,
    ) -> std::io::Result<LandedReporter> {
        let (tx, rx) = mpsc::sync_channel(QUEUE);
        let shared = Arc::new(Shared::default());
        let (path, s) = (socket.to_path_buf(), shared.clone());
        std::thread::Builder::new()
            .name("landed".into())
            .spawn(move || send_loop(&path, &rx, &s, &bases))?;
        Ok(LandedReporter { tx, shared })
    }

    /// Queues a report that pages `gfns` (file offset / 4 KiB) of the guest RAM memfd
    /// `ram` were just filled whole by a disk read; `bases` names, by index into `gfns`,
    /// those whose bytes came from a base block. Never blocks: with the queue full or
    /// the thread gone the pages are dropped. Returns whether they were queued. The
    /// report is stamped now (`CLOCK_MONOTONIC`): memfoldd times its shares from here.
    pub fn report_from(&self, ram: RamFile, gfns: Vec<Gfn>, bases: Vec<(u32, BaseBlock)>) -> bool {
        if gfns.is_empty() {
            return true;
        }
        let n = gfns.len() as u64;
        let r = Report {
            ram,
            gfns,
            bases,
            landed_ns: memfold_sys::proc::monotonic_ns(),
        };
        match self.tx.try_send(Out::Report(r)) {
            Ok(()) => true,
            Err(TrySendError::Full(_) | TrySendError::Disconnected(_)) => {
                self.shared.dropped.fetch_add(n, Ordering::Relaxed);
                false
            }
        }
    }

    /// [`LandedReporter::report_from`] with no base block named.
    pub fn report(&self, ram: RamFile, gfns: Vec<Gfn>) -> bool {
        self.report_from(ram, gfns, Vec::new())
    }

    /// Whether memfoldd said a frame holds base block `b` (and no fill found otherwise
    /// since).
    pub fn held(&self, b: BaseBlock) -> bool {
        self.shared.connected.load(Ordering::Relaxed)
            && self.shared.held.lock().expect("not poisoned").contains(&b)
    }

    /// Whether memfoldd said frames hold any block (and is connected).
    pub fn holds_any(&self) -> bool {
        self.shared.connected.load(Ordering::Relaxed)
            && !self.shared.held.lock().expect("not poisoned").is_empty()
    }

    /// Asks memfoldd to fill `pages` of RAM memfd `ram` from frames (Satori §5.2); the
    /// caller wrote `nonce` (never zero) at the start of each. Waits up to `wait` and
    /// returns the pages filled (empty when memfoldd is away, did not answer in time, or
    /// holds none). Blocks asked and not filled are forgotten as held. Pages not
    /// returned are the caller's to write; pages returned it must not write.
    pub fn fill(
        &self,
        ram: RamFile,
        pages: &[(Gfn, BaseBlock)],
        nonce: [u64; 2],
        wait: Duration,
    ) -> Vec<Gfn> {
        if pages.is_empty() || !self.shared.connected.load(Ordering::Relaxed) {
            return Vec::new();
        }
        let fill = FillId(self.shared.next_fill.fetch_add(1, Ordering::Relaxed));
        let (atx, arx) = mpsc::sync_channel(1);
        self.shared
            .waiting
            .lock()
            .expect("not poisoned")
            .insert(fill, atx);
        let msg = ToDaemon::FillRead {
            ram,
            fill,
            nonce,
            pages: pages.iter().take(MAX_BATCH).copied().collect(),
        };
        let filled = match self.tx.try_send(Out::Fill(msg)) {
            Ok(()) => arx.recv_timeout(wait).unwrap_or_default(),
            Err(_) => Vec::new(),
        };
        self.shared
            .waiting
            .lock()
            .expect("not poisoned")
            .remove(&fill);
        let got: HashSet<Gfn> = filled.iter().copied().collect();
        let mut held = self.shared.held.lock().expect("not poisoned");
        for (g, b) in pages {
            if !got.contains(g) {
                held.remove(b);
            }
        }
        filled
    }

    /// Blocks memfoldd's held-block messages named so far (repeats included).
    pub fn told(&self) -> u64 {
        self.shared.told.load(Ordering::Relaxed)
    }

    /// Pages sent to memfoldd so far.
    pub fn sent(&self) -> u64 {
        self.shared.sent.load(Ordering::Relaxed)
    }

    /// Pages dropped so far: queue full, or memfoldd not reachable.
    pub fn dropped(&self) -> u64 {
        self.shared.dropped.load(Ordering::Relaxed)
    }
}

/// The sender thread: until the reporter is dropped, sends each report in batches of at
/// most [`MAX_BATCH`] pages and each fill, connecting (with a
/// [`ToDaemon::DeviceHello`]) when it has none and dropping reports while memfoldd
/// cannot be reached.
fn send_loop(path: &Path, rx: &Receiver<Out>, s: &Arc<Shared>, bases: &[(DiskId, OwnedFd)]) {
    let mut conn: Option<Conn> = None;
    let mut next_try = Instant::now();
    while let Ok(out) = rx.recv() {
        if conn.is_none() && Instant::now() >= next_try {
            next_try = Instant::now() + RECONNECT;
            conn = connect(path, bases, s);
        }
        let n = match &out {
            Out::Report(r) => r.gfns.len() as u64,
            Out::Fill(_) => 0,
        };
        let Some(c) = &conn else {
            s.dropped.fetch_add(n, Ordering::Relaxed);
            continue;
        };
        let ok = match out {
            Out::Report(r) => r.gfns.chunks(MAX_BATCH).enumerate().all(|(k, chunk)| {
                let first = (k * MAX_BATCH) as u32;
                let bases = r
                    .bases
                    .iter()
                    .filter(|(i, _)| (first..first + chunk.len() as u32).contains(i))
                    .map(|&(i, b)| (i - first, b))
                    .collect();
                let msg = ToDaemon::ReadLanded {
                    ram: r.ram,
                    gfns: chunk.to_vec(),
                    landed_ns: r.landed_ns,
                    bases,
                };
                c.send(&msg, &[]).is_ok()
            }),
            Out::Fill(m) => c.send(&m, &[]).is_ok(),
        };
        if ok {
            s.sent.fetch_add(n, Ordering::Relaxed);
        } else {
            tracing::debug!(
                "memfoldd at {}: a send failed; reconnecting",
                path.display()
            );
            s.dropped.fetch_add(n, Ordering::Relaxed);
            c.shutdown();
            conn = None;
            s.connected.store(false, Ordering::Relaxed);
        }
    }
}

fn connect(path: &Path, bases: &[(DiskId, OwnedFd)], s: &Arc<Shared>) -> Option<Conn> {
    let c = Conn::connect(path)
        .inspect_err(|e| tracing::debug!("{e}; read reports dropped for now"))
        .ok()?;
    c.set_send_timeout(SEND_TIMEOUT).ok()?;
    let fds: Vec<_> = bases.iter().map(|(_, f)| f.as_fd()).collect();
    c.send(
        &ToDaemon::DeviceHello {
            version: PROTOCOL_VERSION,
            bases: bases.iter().map(|(d, _)| *d).collect(),
        },
        &fds,
    )
    .ok()?;
    let reader = c.try_clone().ok()?;
    let s2 = s.clone();
    let generation = {
        let mut held = s.held.lock().expect("not poisoned");
        // What memfoldd held for the last connection may be gone with it.
        held.clear();
        s.connected.store(true, Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::Relaxed) + 1
    };
    let spawned = std::thread::Builder::new()
        .name("landed-in".into())
        .spawn(move || read_loop(&reader, &s2, generation));
    if spawned.is_err() {
        s.connected.store(false, Ordering::Relaxed);
        return None;
    }
    Some(c)
}

/// The reader thread of connection number `generation`: memfoldd's news of held blocks
/// and its answers to fills, until the connection ends; then, unless a newer connection
/// was made meanwhile, the reporter is marked away.
fn read_loop(c: &Conn, s: &Shared, generation: u64) {
    loop {
        match c.recv::<ToDevice>() {
            Ok(Some((ToDevice::Held { blocks }, _))) => {
                s.told.fetch_add(blocks.len() as u64, Ordering::Relaxed);
                let mut held = s.held.lock().expect("not poisoned");
                for b in blocks {
                    if held.len() >= MAX_HELD {
                        break;
                    }
                    held.insert(b);
                }
            }
            Ok(Some((ToDevice::Filled { fill, gfns }, _))) => {
                if let Some(tx) = s.waiting.lock().expect("not poisoned").remove(&fill) {
                    let _ = tx.try_send(gfns);
                }
            }
            Ok(None) | Err(_) => {
                let mut held = s.held.lock().expect("not poisoned");
                if s.generation.load(Ordering::Relaxed) == generation {
                    s.connected.store(false, Ordering::Relaxed);
                    held.clear();
                }
                return;
            }
        }
    }
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
    /// batch arrives in batches of at most [`MAX_BATCH`], every page once, in order, each
    /// batch naming its own pages' base blocks.
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
        let b = |block| BaseBlock {
            disk: DiskId(3),
            block,
        };
        let last = MAX_BATCH as u32 + 1;
        assert!(r.report_from(ram(), gfns.clone(), vec![(0, b(10)), (last, b(11))]));
        let conn = listener.accept().unwrap();
        let (hello, _) = conn.recv::<ToDaemon>().unwrap().unwrap();
        assert_eq!(
            hello,
            ToDaemon::DeviceHello {
                version: PROTOCOL_VERSION,
                bases: vec![],
            }
        );
        let mut got = Vec::new();
        let mut bases = Vec::new();
        while got.len() < gfns.len() {
            match conn.recv::<ToDaemon>().unwrap().unwrap().0 {
                ToDaemon::ReadLanded {
                    ram: f,
                    gfns,
                    bases: bs,
                    ..
                } => {
                    assert_eq!(f, ram());
                    assert!(gfns.len() <= MAX_BATCH);
                    bases.extend(bs.iter().map(|&(i, b)| (gfns[i as usize], b)));
                    got.extend(gfns);
                }
                other => panic!("{other:?}"),
            }
        }
        assert_eq!(got, gfns);
        assert_eq!(bases, [(Gfn(0), b(10)), (Gfn(last), b(11))]);
        assert!(eventually(|| r.sent() == gfns.len() as u64));
        assert_eq!(r.dropped(), 2);
    }

    /// A connection's reader that wakes to its end after a newer connection was made
    /// takes nothing of the newer one down; the current one's end marks memfoldd away.
    #[test]
    fn a_dead_connection_s_reader_leaves_the_next_connection_alone() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memfoldd.sock");
        let listener = Listener::bind(&path).unwrap();
        let block = BaseBlock {
            disk: DiskId(3),
            block: 9,
        };
        for (reader_of, current, stays) in [(1, 2, true), (2, 2, false)] {
            let client = Conn::connect(&path).unwrap();
            drop(listener.accept().unwrap()); // memfoldd's end closed: the reader ends
            let s = Shared::default();
            s.generation.store(current, Ordering::Relaxed);
            s.connected.store(true, Ordering::Relaxed);
            s.held.lock().unwrap().insert(block);
            read_loop(&client, &s, reader_of);
            assert_eq!(s.connected.load(Ordering::Relaxed), stays);
            assert_eq!(s.held.lock().unwrap().contains(&block), stays);
        }
    }

    /// A full queue drops instead of waiting (the device's requests must not stall on
    /// memfoldd).
    #[test]
    fn a_full_queue_drops_without_blocking() {
        let (tx, _rx) = mpsc::sync_channel(1);
        let r = LandedReporter {
            tx,
            shared: Arc::default(),
        };
        assert!(r.report(ram(), vec![Gfn(1)]));
        let started = Instant::now();
        assert!(!r.report(ram(), vec![Gfn(2), Gfn(3)]));
        assert!(started.elapsed() < Duration::from_secs(1));
        assert_eq!(r.dropped(), 2);
    }

    /// A fill: the hello carries the bases' descriptors; held news arrive; a fill is
    /// answered with the pages memfoldd filled, and blocks it did not fill are no longer
    /// held; a fill memfoldd does not answer returns nothing after the wait.
    #[test]
    fn fills_wait_for_their_answer_at_most_the_time_given() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("memfoldd.sock");
        let listener = Listener::bind(&path).unwrap();
        let base = std::fs::File::open("/proc/self/exe").unwrap();
        let r = LandedReporter::spawn_with_bases(&path, vec![(DiskId(5), base.into())]).unwrap();
        assert!(r.report(ram(), vec![Gfn(1)]));
        let conn = listener.accept().unwrap();
        let (hello, fds) = conn.recv::<ToDaemon>().unwrap().unwrap();
        assert!(matches!(hello, ToDaemon::DeviceHello { ref bases, .. } if bases == &[DiskId(5)]));
        assert_eq!(fds.len(), 1);
        let b = |block| BaseBlock {
            disk: DiskId(5),
            block,
        };
        conn.send(
            &ToDevice::Held {
                blocks: vec![b(1), b(2)],
            },
            &[],
        )
        .unwrap();
        assert!(eventually(|| r.held(b(1)) && r.held(b(2))));
        let answer = std::thread::spawn(move || loop {
            match conn.recv::<ToDaemon>().unwrap().unwrap().0 {
                ToDaemon::FillRead { fill, pages, .. } => {
                    assert_eq!(pages, [(Gfn(7), b(1)), (Gfn(8), b(2))]);
                    conn.send(
                        &ToDevice::Filled {
                            fill,
                            gfns: vec![Gfn(7)],
                        },
                        &[],
                    )
                    .unwrap();
                    return conn;
                }
                _ => continue,
            }
        });
        let filled = r.fill(
            ram(),
            &[(Gfn(7), b(1)), (Gfn(8), b(2))],
            [1, 2],
            Duration::from_secs(5),
        );
        assert_eq!(filled, [Gfn(7)]);
        assert!(
            r.held(b(1)) && !r.held(b(2)),
            "an unfilled block is forgotten"
        );
        let _conn = answer.join().unwrap();
        let t = Instant::now();
        let filled = r.fill(ram(), &[(Gfn(9), b(1))], [1, 3], Duration::from_millis(100));
        assert!(filled.is_empty());
        assert!(t.elapsed() >= Duration::from_millis(100));
        assert!(!r.held(b(1)));
    }
}
