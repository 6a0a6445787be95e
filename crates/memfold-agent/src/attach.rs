//! The agent's side of its connection to memfoldd: attaching (the hello with the guest
//! memfd, and when re-attaching the pool and the re-attach list; the welcome with the
//! pool, store and swap file), bringing stashed pages home before a re-attach, and the
//! reports (CoW breaks, refills and unstashed pages as they happen, counters and
//! latencies every second).
//!
//! Everything after the hello goes out through one queue in order (an answer before the
//! events that follow it), as far as memfoldd's socket takes it now
//! ([`Agent::flush_to_memfoldd`]): the thread that sends is the one that serves the
//! guest's faults, and a memfoldd that reads slowly or not at all (stalled, stopped, or
//! its readers held by its own full input queue) must never hold them. It did: a blocking
//! send on a full socket froze the guest until memfoldd read again.

use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::time::{Duration, Instant};

use memfold_codecs::PAGE_SIZE;
use memfold_ids::{FrameId, Gfn};
use memfold_sys::memfd::pwrite_all;
use memfold_wire::{
    reattach, shown, AgentReport, Conn, Discarded, OpLatency, ToAgent, ToDaemon, PROTOCOL_VERSION,
};

use crate::state::PageHome;
use crate::Agent;

/// Longest wait for memfoldd's welcome: the handshake runs on the fault-serving thread.
const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(2);

/// Wait before attaching again after memfoldd refused, or answered anything but a
/// welcome.
const REFUSED_BACK_OFF: std::time::Duration = std::time::Duration::from_secs(30);

/// Attaches in a row whose connection closes unanswered before the agent waits
/// [`REFUSED_BACK_OFF`]: a memfoldd stopping or restarting closes queued hellos, and its
/// successor should not wait 30 s; one that cannot read the hello closes every one.
const CLOSES_BEFORE_BACK_OFF: u32 = 3;

/// Longest unstash before the hello goes on the same connection: memfoldd closes one
/// that says no hello within 5 s (`memfold_live`'s `HELLO_TIMEOUT`), so after a longer
/// one the agent connects afresh.
const UNSTASH_KEEPS_CONNECTION: std::time::Duration = std::time::Duration::from_secs(1);

/// Pages [`Agent::leave_pool`] copies between two looks at the guest's faults (16 MiB).
const LEAVE_FAULTS_EVERY: usize = 4096;

/// How often the agent reports its counters and latencies.
const REPORT_EVERY: Duration = Duration::from_secs(1);

/// Messages that may wait for memfoldd to read; past it memfoldd is taken as gone and the
/// connection dropped (the re-attach lists what holds). While any wait, only answers join
/// them ([`Agent::report`]), one a request memfoldd sent, so this many means memfoldd
/// sent far more than it read.
const MAX_BEHIND: usize = 1 << 14;

/// Changes of page state the agent made on its own (serving faults), not yet reported.
#[derive(Default)]
pub(crate) struct Pending {
    /// CoW breaks: (page, the frame it left).
    pub(crate) breaks: Vec<(Gfn, FrameId)>,
    /// Reclaimed zero pages filled again.
    pub(crate) refills: Vec<Gfn>,
    /// Stashed pages decoded back.
    pub(crate) unstashed: Vec<Gfn>,
    /// Pages QEMU discarded that memfold held, and what it held.
    pub(crate) discards: Vec<(Gfn, Discarded)>,
    /// Pages paged out to the kernel's swap found in RAM again, or discarded (`pageout.rs`).
    pub(crate) paged_in: Vec<Gfn>,
}

/// Fault counts and operation latencies since the agent started.
pub(crate) struct Counters {
    /// Write faults on write-protected pages.
    pub(crate) wp_faults: u64,
    /// Faults on missing pages.
    pub(crate) missing_faults: u64,
    /// Minor faults (clock tracking).
    pub(crate) minor_faults: u64,
    /// CoW breaks of a whole run at the VMA budget.
    pub(crate) run_breaks: u64,
    /// Pages broken ahead of a sequential writer (`fault::BREAK_AHEAD`).
    pub(crate) ahead_breaks: u64,
    /// Pages broken without a copy under a writer's whole-page declaration (`nocopy.rs`).
    pub(crate) nocopy_breaks: u64,
    /// Runs whose PTEs a clock scan dropped (private pages armed, pages on frames).
    pub(crate) clock_zaps: u64,
    /// Runs a clock scan found unmapped and did not zap (`rbits::Mapped`).
    pub(crate) clock_zaps_skipped: u64,
    /// Minor-fault service.
    pub(crate) track: OpLatency,
    /// Share, per page.
    pub(crate) share: OpLatency,
    /// CoW break.
    pub(crate) cow: OpLatency,
    /// Missing-fault service (zero fill).
    pub(crate) fault: OpLatency,
    /// Reclaim, per page.
    pub(crate) reclaim: OpLatency,
    /// Stash, per page.
    pub(crate) stash: OpLatency,
    /// Missing fault on a stashed page.
    pub(crate) unstash: OpLatency,
    /// When the counters were last sent.
    last_report: Instant,
}

impl Counters {
    /// Nothing counted yet.
    pub(crate) fn new() -> Counters {
        Counters {
            wp_faults: 0,
            missing_faults: 0,
            minor_faults: 0,
            run_breaks: 0,
            ahead_breaks: 0,
            nocopy_breaks: 0,
            clock_zaps: 0,
            clock_zaps_skipped: 0,
            track: OpLatency::default(),
            share: OpLatency::default(),
            cow: OpLatency::default(),
            fault: OpLatency::default(),
            reclaim: OpLatency::default(),
            stash: OpLatency::default(),
            unstash: OpLatency::default(),
            last_report: Instant::now(),
        }
    }

    /// The counters as the wire carries them, with the agent's record of its pages,
    /// `state_bytes`, its process's mappings as counted, `mappings`, and its VMA budget,
    /// `vma_budget`.
    fn report(&self, state_bytes: u64, mappings: u64, vma_budget: u64) -> AgentReport {
        AgentReport {
            state_bytes,
            mappings,
            vma_budget,
            run_breaks: self.run_breaks,
            ahead_breaks: self.ahead_breaks,
            nocopy_breaks: self.nocopy_breaks,
            clock_zaps: self.clock_zaps,
            clock_zaps_skipped: self.clock_zaps_skipped,
            wp_faults: self.wp_faults,
            missing_faults: self.missing_faults,
            minor_faults: self.minor_faults,
            track_ns: self.track.to_pairs(),
            share_ns: self.share.to_pairs(),
            cow_break_ns: self.cow.to_pairs(),
            fault_ns: self.fault.to_pairs(),
            reclaim_ns: self.reclaim.to_pairs(),
            stash_ns: self.stash.to_pairs(),
            unstash_ns: self.unstash.to_pairs(),
        }
    }
}

/// Set when QEMU's command line says it switches to another user once set up (`-runas`,
/// `-run-with user=`): until then the process is root's.
static SWITCHES_USER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Records that QEMU switches to `user` once set up (`RamPlan::runs_as`): no agent
/// attaches before it has. Root named as the user (`root`, uid 0 with any group)
/// switches nothing. (Another name of uid 0 would keep the agent waiting: not resolved.)
pub(crate) fn expect_user_switch(user: &str) {
    // `-runas` takes a name or `uid:gid`; uid 0 with any group stays root.
    if user != "root" && user != "0" && !user.starts_with("0:") {
        SWITCHES_USER.store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Whether an attach must wait: QEMU switches user later (`switches`) and this process
/// still runs as root (`euid` 0).
///
/// Invariant: an agent whose QEMU will run as a tenant never connects as root. memfoldd
/// keys a connection by the credentials the kernel recorded at connect (SO_PEERCRED) for
/// its whole life: one made before QEMU's switch would put the tenant's guest in root's
/// sharing domain, with root's pool — which a guest escaping into its QEMU would then
/// hold — and without the tenant's quota.
fn before_user_switch(switches: bool, euid: u32) -> bool {
    switches && euid == 0
}

impl Agent {
    /// Connects and sends the hello (with the pool and the shared pages when re-attaching).
    /// Any failure leaves the agent detached; it tries again later.
    pub(crate) fn attach(&mut self) {
        if before_user_switch(
            SWITCHES_USER.load(std::sync::atomic::Ordering::SeqCst),
            memfold_sys::socket::my_uid(),
        ) {
            // Tried again in a second: QEMU switches user before it runs the guest.
            return;
        }
        // On the thread that serves the guest's faults: a memfoldd stopped or stalled,
        // its backlog full, must not hold the guest in connect(2). Tried again later.
        let Ok(conn) = Conn::connect_at_once(&self.cfg.socket) else {
            return;
        };
        // Only a memfoldd of root or our own user gets our guest's RAM.
        match conn.peer() {
            Ok(p) if p.trusted_by(memfold_sys::socket::my_uid()) => {}
            Ok(p) => {
                tracing::warn!(
                    "the process at {} (pid {}, uid {}) is not a memfoldd of root or our user; not attaching",
                    self.cfg.socket.display(),
                    p.pid,
                    p.uid
                );
                self.back_off();
                return;
            }
            Err(e) => {
                tracing::warn!(
                    "no credentials of the peer at {}: {e}",
                    self.cfg.socket.display()
                );
                return;
            }
        }
        // This runs on the thread that serves the guest's faults: never wait long.
        if conn.set_recv_timeout(HANDSHAKE_TIMEOUT).is_err() {
            return;
        }
        // The store belongs to the memfoldd that is gone: bring its pages home first.
        let unstashing = std::time::Instant::now();
        match self.unstash_all() {
            Ok(()) => {}
            // A blob that decodes to other bytes than were stored (the store or swap file
            // changed under the agent, or a bad sector) is lost for good: retried, it
            // would postpone every attach — the guest unmanaged, its old store and the
            // adopted pool pinned — until the guest touched the page and failed closed
            // then. Failing closed now keeps what can still be kept, as a fault would; so
            // does a stashed page written outside QEMU's mapping (`unstash_all`).
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                self.fail_closed(&format!("restoring stashed pages before a re-attach: {e}"))
            }
            // Anything else (EIO, ENOMEM) may pass: tried again at the next attach.
            Err(e) => {
                tracing::warn!("restoring stashed pages: {e}; attach postponed");
                return;
            }
        }
        if unstashing.elapsed() > UNSTASH_KEEPS_CONNECTION {
            // Home now (nothing left to unstash): a fresh connection, its hello at once.
            return self.attach();
        }
        let shared = self.pages.reattach_list();
        let hello = ToDaemon::AgentHello {
            version: PROTOCOL_VERSION,
            name: self.cfg.name.clone(),
            pid: std::process::id(),
            ram_bytes: self.ram_bytes,
            shared: shared.len() as u64,
            opted_out: self.opted_out,
        };
        let list = match self.pool.is_some().then(|| reattach::to_memfd(&shared)) {
            Some(Ok(l)) => Some(l),
            Some(Err(_)) => return,
            None => None,
        };
        let mut fds = vec![self.memfd.as_fd()];
        fds.extend(self.pool.as_ref().map(|p| p.as_fd()));
        fds.extend(list.as_ref().map(|l| l.as_fd()));
        if conn.send(&hello, &fds).is_err() {
            return;
        }
        drop(fds);
        match conn.recv::<ToAgent>() {
            // Pages on frames are on the old pool's: a welcome with another pool would
            // have their CoW breaks and decodes read that one's bytes at the same offsets.
            Ok(Some((ToAgent::Welcome { version }, got)))
                if version == PROTOCOL_VERSION
                    && !shared.is_empty()
                    && !self.same_pool(got.first()) =>
            {
                tracing::error!(
                    "memfoldd welcomed us with another pool than the one {} pages are on; not attached",
                    shared.len()
                );
                self.back_off();
            }
            Ok(Some((ToAgent::Welcome { version }, mut got)))
                if version == PROTOCOL_VERSION && !got.is_empty() =>
            {
                // A restarted memfoldd that adopted our pool hands the same pool back.
                let pool = got.remove(0);
                if let Ok(st) = rustix::fs::fstat(&pool) {
                    crate::regions::note_pool(st.st_ino);
                }
                self.pool = Some(pool);
                self.store = (!got.is_empty()).then(|| got.remove(0));
                self.swap = (!got.is_empty()).then(|| got.remove(0));
                self.conn = Some(conn);
                self.closes_in_a_row = 0;
                // Nothing of an old connection goes out on the new one.
                self.outgoing.clear();
                // Breaks and refills done while detached are reflected in the list.
                self.pending.breaks.clear();
                self.pending.refills.clear();
                self.pending.discards.clear();
                // Pages an earlier memfoldd paged out are not in the list: this one
                // knows nothing of them, and may page them out again (a no-op for a
                // page still in swap) without hearing of their return.
                self.pending.paged_in.clear();
                self.pages.forget_paged_out();
            }
            Ok(Some((ToAgent::Refused { message }, _))) => {
                tracing::warn!("memfoldd refused the attach: {}", shown(&message));
                self.back_off();
            }
            // Only with a pool to leave: one asked of a hello that brought none would
            // send the same hello again at once, for as long as memfoldd answers so.
            Ok(Some((ToAgent::LeavePool { message }, _))) if self.pool.is_some() => {
                tracing::warn!(
                    "memfoldd will not adopt our pool: {}; leaving it",
                    shown(&message)
                );
                // The list's memory goes before the copies take theirs.
                drop((conn, shared, list));
                match self.leave_pool() {
                    Ok(pages) => {
                        tracing::info!(
                            "left the pool: {pages} pages copied off its frames; attaching afresh"
                        );
                        self.attach();
                    }
                    Err(e) => {
                        tracing::warn!("leaving the pool: {e}; trying again later");
                        self.back_off();
                    }
                }
            }
            // Closed with no answer (memfoldd stopping, restarting, over its limit of
            // connections waiting for a hello, or unable to read ours): tried again in a
            // second, until it happened CLOSES_BEFORE_BACK_OFF times in a row.
            Ok(None) => self.closed("the connection closed"),
            // Reset or broken (a memfoldd killed, or one over its limit of connections
            // waiting for a hello): as a close. A timeout is not: below.
            Err(memfold_wire::WireError::Io(e))
                if !matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                self.closed(&e.to_string())
            }
            // Any other answer: not a welcome, and trying again every second would not
            // make it one.
            Ok(Some(other)) => {
                let what = match other {
                    (ToAgent::Welcome { version }, _) => {
                        format!("a welcome of protocol version {version} (ours {PROTOCOL_VERSION}) or with no pool")
                    }
                    (m, _) => shown(&format!("{m:?}")),
                };
                tracing::warn!("no welcome from memfoldd: {what}; trying again later");
                self.back_off();
            }
            Err(e) => {
                // No welcome in time: whatever listens there, do not block the guest's
                // faults on it every second.
                tracing::warn!("attach: {e}");
                self.back_off();
            }
        }
    }

    /// An attach's connection closed before any answer (`why`): tried again in a second,
    /// or after [`REFUSED_BACK_OFF`] once [`CLOSES_BEFORE_BACK_OFF`] did in a row.
    fn closed(&mut self, why: &str) {
        self.closes_in_a_row += 1;
        if self.closes_in_a_row >= CLOSES_BEFORE_BACK_OFF {
            tracing::warn!(
                "no welcome from memfoldd: {why}, {} times in a row; trying again later",
                self.closes_in_a_row
            );
            self.closes_in_a_row = 0;
            self.back_off();
        } else {
            tracing::info!("no welcome from memfoldd: {why}; trying again");
        }
    }

    /// Whether `new` is the file of the pool the agent holds (none held: any is).
    fn same_pool(&self, new: Option<&OwnedFd>) -> bool {
        let id = |f: &OwnedFd| memfold_sys::memfd::file_id(f.as_fd()).ok();
        match (&self.pool, new) {
            (None, _) => true,
            (Some(old), Some(new)) => id(old).is_some() && id(old) == id(new),
            (Some(_), None) => false,
        }
    }

    /// Leaves the pool memfoldd will not adopt ([`ToAgent::LeavePool`]: the guest is to be
    /// kept alone — never-share, Satori §4.3, or the `vm` rule — and other QEMUs hold the
    /// pool it shared under an earlier memfoldd). Every page on one of its frames becomes
    /// a private copy of the frame, a run of consecutive frames at a time (guest RAM
    /// mapped back over whole pool mappings, so no mapping is added: `vmas.rs`), marked
    /// written (the clock counts it modified: in the `pagemap` mode its writes from now on
    /// are not seen until it is armed); every reclaimed zero page a private hole (zeros
    /// on its next touch either way); then the pool is let go. The guest reads the same
    /// bytes throughout. Its faults are served between runs, every
    /// [`LEAVE_FAULTS_EVERY`] pages copied (a page not yet copied is broken off its frame
    /// as ever), so a guest with gigabytes shared does not stall for the whole copy. Once
    /// done, no page of it is on a frame another process maps: its writes are its own,
    /// and none is a CoW break another guest can time. Returns the pages copied.
    ///
    /// Errors: a frame could not be read, the memfd written or guest RAM mapped back
    /// (`ENOMEM`, the pool cut short). The pages done are private, the rest still on their
    /// frames (the failed run's copies punched out again) and the pool kept: memfoldd
    /// asks again at the next attach.
    fn leave_pool(&mut self) -> io::Result<usize> {
        let (mut copied, mut since) = (0, 0);
        for g in (0..self.pages.len()).map(Gfn) {
            match self.pages.home(g) {
                PageHome::Frame(f) => {
                    let (first, frame0, n) = self.pages.frame_run(g, f);
                    let moved = self
                        .copy_frames(first, frame0, n)
                        .and_then(|()| self.map_guest_range(first, n));
                    if let Err(e) = moved {
                        // Still on their frames: the copies only held memory.
                        self.punch(first, n as u64);
                        return Err(e);
                    }
                    for k in 0..n {
                        self.pages
                            .set(crate::state::plus(first, k), PageHome::Private);
                    }
                    self.pages.mark_modified(first, n as u64);
                    self.uffd
                        .wake(self.page_addr(first), n as u64 * crate::PAGE)?;
                    copied += n;
                    since += n;
                    if since >= LEAVE_FAULTS_EVERY {
                        since = 0;
                        while let Ok(Some(ev)) = self.uffd.read_event() {
                            self.handle_or_retry(ev);
                        }
                    }
                }
                PageHome::Zero => self.pages.set(g, PageHome::Private),
                // Copied with an earlier page of its run.
                _ => {}
            }
        }
        self.pool = None;
        Ok(copied)
    }

    /// After a refusal, the next attach waits [`REFUSED_BACK_OFF`] rather than a second.
    fn back_off(&mut self) {
        self.last_connect = Some(std::time::Instant::now() + REFUSED_BACK_OFF);
    }

    /// Writes every stashed page back into the guest memfd (before re-attaching to a new
    /// memfoldd, which has a store of its own), then lets go of the store and swap file. A
    /// guest thread faulting on one meanwhile finds the page present when its fault is
    /// handled.
    ///
    /// Errors: a blob cannot be read or decoded, the memfd was written at a stashed page
    /// since (`InvalidData`, as a fault on it: `fault.rs`), or the write failed; the pages
    /// not yet written back stay stashed.
    fn unstash_all(&mut self) -> io::Result<()> {
        let mut page = [0u8; PAGE_SIZE];
        for (g, s) in self.pages.stashed() {
            // Its hole filled outside QEMU's mapping: the write-back would silently undo
            // that write, and the write cannot be merged with the stored page.
            if self.holds_data(g) {
                return Err(crate::fault::bypass_written(g));
            }
            self.decode_stashed(g, &s, &mut page)?;
            pwrite_all(self.memfd.as_fd(), &page, g.offset())?;
            self.pages.set(g, PageHome::Private);
        }
        self.store = None;
        self.swap = None;
        self.pending.unstashed.clear();
        Ok(())
    }

    /// Queues `m` for memfoldd behind what waits, and sends what the socket takes now
    /// ([module docs](self)). Nothing without a connection (the re-attach lists what
    /// holds).
    pub(crate) fn send_to_memfoldd(&mut self, m: ToDaemon) {
        if self.conn.is_some() {
            self.outgoing.push_back(m);
            self.flush_to_memfoldd();
        }
    }

    /// Whether messages wait for room in memfoldd's socket (the loop then polls for it).
    pub(crate) fn behind(&self) -> bool {
        self.conn.is_some() && !self.outgoing.is_empty()
    }

    /// Sends the messages waiting, in order, until memfoldd's socket is full; never
    /// waits. A failed send, or more than [`MAX_BEHIND`] waiting, drops the connection.
    pub(crate) fn flush_to_memfoldd(&mut self) {
        let Some(c) = &self.conn else {
            self.outgoing.clear();
            return;
        };
        while let Some(m) = self.outgoing.front() {
            match c.try_send(m) {
                Ok(true) => {
                    self.outgoing.pop_front();
                }
                Ok(false) => break,
                Err(e) => {
                    tracing::warn!("send to memfoldd: {e}; re-attaching");
                    self.conn = None;
                    self.outgoing.clear();
                    return;
                }
            }
        }
        if self.outgoing.len() > MAX_BEHIND {
            tracing::warn!(
                "memfoldd has read none of the last {MAX_BEHIND} messages; re-attaching"
            );
            self.conn = None;
            self.outgoing.clear();
        }
    }

    /// Sends the CoW breaks made so far now, before the loop's turn ends (`nocopy.rs`);
    /// while memfoldd is behind they wait in [`Pending`] ([`Self::report`]).
    pub(crate) fn send_breaks(&mut self) {
        if self.conn.is_none() || self.pending.breaks.is_empty() || self.behind() {
            return;
        }
        // In messages of at most MAX_BATCH pages, as every event list (they grow while
        // memfoldd is behind; one message past the wire's largest would drop the
        // connection).
        for b in std::mem::take(&mut self.pending.breaks).chunks(memfold_wire::MAX_BATCH) {
            self.send_to_memfoldd(ToDaemon::CowBroken { breaks: b.to_vec() });
        }
    }

    /// Sends CoW breaks, refills, unstashed and discarded pages as they happen, counters and
    /// latencies every second. A failed send drops the connection.
    ///
    /// While messages wait for memfoldd, the events wait in [`Pending`] instead (one
    /// entry a page changed, bounded by the guest's pages; the counters' report waits too), so
    /// the queue holds answers only, bounded by the requests memfoldd sent: a memfoldd
    /// that stalls for a while does not make its agents drop their connections (each
    /// re-attach writes every stashed page back).
    pub(crate) fn report(&mut self) {
        self.flush_to_memfoldd();
        if self.behind() {
            return;
        }
        self.send_breaks();
        if self.conn.is_none() {
            return;
        }
        let mut msgs = Vec::new();
        // In messages of at most MAX_BATCH pages (`send_breaks`; a discard can name many).
        const N: usize = memfold_wire::MAX_BATCH;
        for gfns in std::mem::take(&mut self.pending.refills).chunks(N) {
            msgs.push(ToDaemon::Refilled {
                gfns: gfns.to_vec(),
            });
        }
        for gfns in std::mem::take(&mut self.pending.unstashed).chunks(N) {
            msgs.push(ToDaemon::Unstashed {
                gfns: gfns.to_vec(),
            });
        }
        for pages in std::mem::take(&mut self.pending.discards).chunks(N) {
            msgs.push(ToDaemon::Discarded {
                pages: pages.to_vec(),
            });
        }
        for gfns in std::mem::take(&mut self.pending.paged_in).chunks(N) {
            msgs.push(ToDaemon::PagedIn {
                gfns: gfns.to_vec(),
            });
        }
        if self.counters.last_report.elapsed() >= REPORT_EVERY {
            self.counters.last_report = Instant::now();
            msgs.push(ToDaemon::AgentStats(self.counters.report(
                self.pages.state_bytes(),
                crate::vmas::PROCESS.mappings_read(crate::vmas::read_self_maps) as u64,
                self.vma_budget.get() as u64,
            )));
        }
        for m in msgs {
            self.send_to_memfoldd(m);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agent_waits_for_its_qemus_switch_from_root() {
        assert!(before_user_switch(true, 0), "root, to switch: wait");
        assert!(!before_user_switch(true, 107), "switched: attach");
        assert!(!before_user_switch(false, 0), "root for good: attach");
    }
}
