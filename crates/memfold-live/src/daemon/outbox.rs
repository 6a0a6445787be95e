//! The way to an agent: memfoldd's main thread queues its messages, and a writer thread
//! of the connection sends them, so that an agent that does not read holds its own writer
//! and never the main thread, which serves every guest. (The main thread sent them itself
//! and waited out a 2 s send timeout for each agent that stopped reading: one that
//! attached, stopped reading and attached again cost every guest 2 s a cycle.)
//!
//! Flow control stays: the executor hands a guest new batches only while its outbox has
//! room ([`Outbox::has_room`]), so an agent that is only slow (its socket buffer full
//! while it serves faults) gets its commands later, not a dropped connection. One whose
//! writer cannot send for [`SEND_TIMEOUT`](super::readers::SEND_TIMEOUT) is gone: the
//! writer shuts the connection, the reader sees the end, the guest is detached.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{mpsc, Arc, Mutex};

use memfold_wire::{Conn, ToAgent};

/// Messages an outbox holds at most; a message past it is not sent (the caller books
/// its commands as never sent).
const OUTBOX: usize = 256;

/// Messages queued past which the executor hands the guest no new batches this turn.
const ROOM: usize = OUTBOX / 2;

/// What the writer thread is handed.
enum Out {
    /// A message, in its turn.
    Message(ToAgent),
    /// Look at the state waiting ([`Outbox::send_state`]).
    State,
}

/// One agent's outbox ([module docs](self)).
pub(crate) struct Outbox {
    tx: mpsc::SyncSender<Out>,
    /// Messages queued and not yet sent (or failed).
    queued: Arc<AtomicUsize>,
    /// The latest state message not yet sent ([`Outbox::send_state`]).
    state: Arc<Mutex<Option<ToAgent>>>,
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
        let (tx, rx) = mpsc::sync_channel::<Out>(OUTBOX);
        let queued = Arc::new(AtomicUsize::new(0));
        let state: Arc<Mutex<Option<ToAgent>>> = Default::default();
        let writer = conn.try_clone()?;
        let conn = conn.try_clone()?;
        let (left, waiting) = (Arc::clone(&queued), Arc::clone(&state));
        let who = name.to_string();
        std::thread::Builder::new()
            .name("outbox".into())
            .spawn(move || {
                let send = |m: &ToAgent| match writer.send(m, &[]) {
                    Ok(()) => true,
                    Err(e) => {
                        // Gone, or not reading for the send timeout: its reader sees the
                        // end, and the guest is detached.
                        tracing::warn!("{who}: send failed ({e}); its connection is closed");
                        writer.shutdown();
                        false
                    }
                };
                for o in rx {
                    if let Out::Message(m) = o {
                        let sent = send(&m);
                        left.fetch_sub(1, Ordering::Relaxed);
                        if !sent {
                            return;
                        }
                    }
                    // After every message: the state waiting, if any (the latest), counted as
                    // queued while it goes out, so that `close` waits for it.
                    left.fetch_add(1, Ordering::Relaxed);
                    let s = waiting.lock().unwrap_or_else(|p| p.into_inner()).take();
                    let sent = s.is_none_or(|m| send(&m));
                    left.fetch_sub(1, Ordering::Relaxed);
                    if !sent {
                        return;
                    }
                }
            })?;
        Ok(Outbox {
            tx,
            queued,
            state,
            conn,
        })
    }

    /// Queues `m` for the agent. False if it is not sent: the agent is gone, or
    /// [`OUTBOX`] messages behind.
    pub(crate) fn send(&self, m: ToAgent) -> bool {
        self.queued.fetch_add(1, Ordering::Relaxed);
        let queued = self.tx.try_send(Out::Message(m)).is_ok();
        if !queued {
            self.queued.fetch_sub(1, Ordering::Relaxed);
        }
        queued
    }

    /// Sends state message `m` (an opt-out the agent must carry to the next memfoldd),
    /// however far behind the agent is: it replaces a state message not yet sent, and
    /// goes out after the message being sent now, so the agent ends with the latest.
    /// (Queued as a message, it was dropped when the agent was [`OUTBOX`] messages
    /// behind.)
    pub(crate) fn send_state(&self, m: ToAgent) {
        *self.state.lock().unwrap_or_else(|p| p.into_inner()) = Some(m);
        // A full queue needs no wake: its writer looks after each message it sends.
        let _ = self.tx.try_send(Out::State);
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
        let busy = |o: &Outbox| {
            o.queued.load(Ordering::Relaxed) > 0
                || o.state.lock().unwrap_or_else(|p| p.into_inner()).is_some()
        };
        while all.iter().any(busy) && std::time::Instant::now() < until {
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        for o in all {
            o.conn.shutdown();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memfold_wire::Listener;

    /// An agent's connection (its end, memfoldd's end) and memfoldd's outbox onto it; the
    /// folder of the socket.
    fn connected() -> (tempfile::TempDir, Conn, Conn, Outbox) {
        let dir = tempfile::tempdir().unwrap();
        let l = Listener::bind(&dir.path().join("s")).unwrap();
        let agent = Conn::connect(&dir.path().join("s")).unwrap();
        let ours = l.accept().unwrap();
        let o = Outbox::new(&ours, "agent").unwrap();
        (dir, agent, ours, o)
    }

    /// An agent that stops reading until its outbox is full still gets the state message
    /// once it reads again, and only the latest. Fails with the state queued as a message
    /// (`send`): it is dropped.
    #[test]
    fn a_state_message_reaches_an_agent_whose_outbox_is_full() {
        let (_dir, agent, _ours, o) = connected();
        // The socket's buffer, then the queue, fill: later messages are refused.
        let refused = (0..4000)
            .filter(|_| !o.send(ToAgent::Welcome { version: 0 }))
            .count();
        assert!(refused > 0, "the outbox never filled");
        o.send_state(ToAgent::OptedOut { out: false });
        o.send_state(ToAgent::OptedOut { out: true });
        agent
            .set_recv_timeout(std::time::Duration::from_secs(1))
            .unwrap();
        let mut states = Vec::new();
        while let Ok(Some((m, _))) = agent.recv::<ToAgent>() {
            if let ToAgent::OptedOut { out } = m {
                states.push(out);
            }
        }
        assert_eq!(states, [true], "the opt-outs the agent got");
    }

    /// A stop's close waits for a state message its writer is sending into a full socket
    /// (it took the message, so none waited). Fails without the writer counting it.
    #[test]
    fn close_waits_for_a_state_message_being_sent() {
        let (_dir, agent, ours, o) = connected();
        // The socket full, past the outbox: the writer blocks on the state itself.
        while ours.try_send(&ToAgent::Welcome { version: 0 }).unwrap() {}
        o.send_state(ToAgent::OptedOut { out: true });
        std::thread::sleep(std::time::Duration::from_millis(100));
        let closing =
            std::thread::spawn(move || Outbox::close(vec![o], std::time::Duration::from_secs(5)));
        std::thread::sleep(std::time::Duration::from_millis(300));
        agent
            .set_recv_timeout(std::time::Duration::from_secs(1))
            .unwrap();
        let mut got = false;
        while let Ok(Some((m, _))) = agent.recv::<ToAgent>() {
            got |= matches!(m, ToAgent::OptedOut { out: true });
        }
        closing.join().unwrap();
        assert!(got, "the opt-out was cut off by the close");
    }
}
