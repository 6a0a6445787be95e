//! The way to an agent: memfoldd's main thread queues its messages, and a writer thread
//! of the connection sends them, so that an agent that does not read holds its own writer
//! and never the main thread, which serves every guest. (The main thread sent them itself
//! and waited out a 2 s send timeout for each agent that stopped reading: one that
//! attached, stopped reading and attached again cost every guest 2 s a cycle.)
//!
//! Flow control stays: the executor hands a guest new batches only while its outbox has
//! room ([`Outbox::has_room`]), so an agent that is only slow (its socket buffer full
//! while it serves faults) gets its commands later, not a dropped connection. One whose
//! writer cannot send for [`SEND_TIMEOUT`](super::guests::SEND_TIMEOUT) is gone: the
//! writer shuts the connection, the reader sees the end, the guest is detached.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

use memfold_wire::{Conn, ToAgent};

/// Messages an outbox holds at most; a message past it is not sent (the caller books
/// its commands as never sent).
const OUTBOX: usize = 256;

/// Messages queued past which the executor hands the guest no new batches this turn.
const ROOM: usize = OUTBOX / 2;

/// One agent's outbox ([module docs](self)).
pub(crate) struct Outbox {
    tx: mpsc::SyncSender<ToAgent>,
    /// Messages queued and not yet sent (or failed).
    queued: Arc<AtomicUsize>,
    /// The connection, to shut it down.
    conn: Conn,
}

impl Outbox {
    /// An outbox onto `conn`, with its writer thread (which ends when the outbox is
    /// dropped, once it has sent what was queued, or when a send fails).
    ///
    /// Errors: the connection cannot be cloned (no descriptor), or no thread: the guest
    /// is then refused.
    pub(crate) fn new(conn: &Conn, name: &str) -> std::io::Result<Outbox> {
        let (tx, rx) = mpsc::sync_channel::<ToAgent>(OUTBOX);
        let queued = Arc::new(AtomicUsize::new(0));
        let writer = conn.try_clone()?;
        let conn = conn.try_clone()?;
        let left = Arc::clone(&queued);
        let who = name.to_string();
        std::thread::Builder::new()
            .name("outbox".into())
            .spawn(move || {
                for m in rx {
                    let sent = writer.send(&m, &[]);
                    left.fetch_sub(1, Ordering::Relaxed);
                    if let Err(e) = sent {
                        // Gone, or not reading for the send timeout: its reader sees the
                        // end, and the guest is detached.
                        tracing::warn!("{who}: send failed ({e}); its connection is closed");
                        writer.shutdown();
                        return;
                    }
                }
            })?;
        Ok(Outbox { tx, queued, conn })
    }

    /// Queues `m` for the agent. False if it is not sent: the agent is gone, or
    /// [`OUTBOX`] messages behind.
    pub(crate) fn send(&self, m: ToAgent) -> bool {
        self.queued.fetch_add(1, Ordering::Relaxed);
        let queued = self.tx.try_send(m).is_ok();
        if !queued {
            self.queued.fetch_sub(1, Ordering::Relaxed);
        }
        queued
    }

    /// Whether the agent is few enough messages behind to be handed new batches.
    pub(crate) fn has_room(&self) -> bool {
        self.queued.load(Ordering::Relaxed) < ROOM
    }

    /// Ends the connection now; what is queued is dropped.
    pub(crate) fn end(self) {
        self.conn.shutdown();
    }

    /// Closes outboxes `all`: each writer sends what is queued (an opt-out the agent must
    /// carry to the next memfoldd, answers of a drain), for up to `wait` in all, then
    /// every connection ends.
    pub(crate) fn close(all: Vec<Outbox>, wait: std::time::Duration) {
        let until = std::time::Instant::now() + wait;
        let ends: Vec<(Arc<AtomicUsize>, Conn)> =
            all.into_iter().map(|o| (o.queued, o.conn)).collect();
        while ends.iter().any(|(q, _)| q.load(Ordering::Relaxed) > 0)
            && std::time::Instant::now() < until
        {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        for (_, c) in ends {
            c.shutdown();
        }
    }
}
