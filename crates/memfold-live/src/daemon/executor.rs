//! The executor: takes the engine's commands, sends them to the agents in batches, and
//! hands each answer back to the engine as the outcome of each command it named.
//!
//! An answer counts only from the agent the batch went to and only for a batch of its
//! kind; anything else is logged and ignored. A batch that could not be sent is refused;
//! a batch whose connection dropped before the answer is lost (the engine keeps its
//! pages in doubt until the agent re-attaches).

use std::collections::{HashMap, HashSet};

use memfold_core::blobs::{BlobHome, Form};
use memfold_core::engine::send_order::send_rank;
use memfold_core::engine::{Command, Outcome, Stash};
use memfold_core::ids::{BatchId, Gfn, VmId};
use memfold_core::Encoding;
use memfold_core::Engine;
use memfold_wire::{Blob, StashPage, ToAgent, MAX_BATCH};

use super::guests::Guests;

/// The kind of a batch, for matching answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Shares, or fills (answered alike, `ShareDone`; a batch holds one or the other).
    Share,
    Reclaim,
    Stash,
    TakeBack,
    Clock,
    /// Free-page watches ([`Command::Watch`]).
    Watch,
    /// Free-page discards ([`Command::DiscardFree`]).
    Discard,
    /// Page-outs to the kernel's swap ([`Command::PageOut`]).
    PageOut,
}

struct Batch {
    vm: VmId,
    kind: Kind,
    cmds: Vec<Command>,
}

/// Most clock slices a guest's agent may have unanswered; an honest agent answers each
/// within milliseconds, so it has one at most.
const MAX_CLOCKS: usize = 4;

/// Batches sent and not yet answered.
#[derive(Default)]
pub(crate) struct Executor {
    batches: HashMap<BatchId, Batch>,
    next: u64,
}

/// The wire's form of a stash.
fn stash_page(gfn: Gfn, s: &Stash) -> StashPage {
    let blob = match (s.form, s.reference) {
        (Form::Raw, _) => Blob::Raw,
        (Form::Encoded(Encoding::Compressed(c)), _) => Blob::Compressed(c),
        (Form::Encoded(Encoding::Patch(codec)), Some(reference)) => {
            Blob::Patch { codec, reference }
        }
        (Form::Encoded(Encoding::Patch(_)), None) => {
            unreachable!("the engine records a reference frame with every patch")
        }
    };
    StashPage {
        gfn,
        blob,
        home: match s.home {
            BlobHome::Store => memfold_wire::BlobHome::Store,
            BlobHome::Swap => memfold_wire::BlobHome::Swap,
        },
        offset: s.offset,
        len: s.len,
        moving: s.moving,
        checksum: s.checksum,
    }
}

impl Executor {
    /// Sends every guest's waiting commands in the engine's send order
    /// ([`send_rank`]): clock scans one by one, every other kind in batches of one rank
    /// (fills: one nonce) of at most [`MAX_BATCH`] pages.
    pub(crate) fn flush(&mut self, engine: &mut Engine, guests: &Guests) {
        for vm in engine.vms_with_commands() {
            if guests.conn(vm).is_some_and(|c| !c.has_room()) {
                // Its agent is behind: its commands wait in the engine's queue.
                continue;
            }
            // In send order (`send_order::send_rank`): a batch is a run of one rank, at
            // most MAX_BATCH pages; the model carries commands out in this order too.
            let mut cmds = engine.take_commands(vm).into_iter().peekable();
            while let Some(c) = cmds.next() {
                let kind = match c {
                    // An agent that does not answer its clock slices is sent no more
                    // until it does: each would wait in `batches` for good (the engine
                    // asks for a slice every period, answered or not).
                    Command::ClockScan { .. } if self.clocks_under_way(vm) >= MAX_CLOCKS => {
                        engine.outcome(vm, &c, Outcome::NotSent);
                        continue;
                    }
                    Command::ClockScan { .. } => {
                        self.send(engine, guests, vm, Kind::Clock, vec![c]);
                        continue;
                    }
                    Command::Fill { .. } | Command::Share { .. } => Kind::Share,
                    Command::Stash { .. } => Kind::Stash,
                    Command::Reclaim { .. } => Kind::Reclaim,
                    Command::TakeBack { .. } => Kind::TakeBack,
                    Command::Watch { .. } => Kind::Watch,
                    Command::DiscardFree { .. } => Kind::Discard,
                    Command::PageOut { .. } => Kind::PageOut,
                };
                let rank = send_rank(&c);
                let mut batch = vec![c];
                while batch.len() < MAX_BATCH {
                    match cmds.next_if(|n| send_rank(n) == rank) {
                        Some(n) => batch.push(n),
                        None => break,
                    }
                }
                self.send(engine, guests, vm, kind, batch);
            }
        }
    }

    fn send(
        &mut self,
        engine: &mut Engine,
        guests: &Guests,
        vm: VmId,
        kind: Kind,
        cmds: Vec<Command>,
    ) {
        self.next += 1;
        let batch = BatchId(self.next);
        // The pages of a batch of per-page commands (one kind a batch).
        let gfns = || cmds.iter().filter_map(Command::gfn).collect::<Vec<Gfn>>();
        let msg = match kind {
            Kind::Share if matches!(cmds.first(), Some(Command::Fill { .. })) => {
                let Some(&Command::Fill { nonce, .. }) = cmds.first() else {
                    unreachable!("matched above")
                };
                ToAgent::Fill {
                    batch,
                    pages: cmds
                        .iter()
                        .filter_map(|c| match *c {
                            Command::Fill { gfn, frame, .. } => Some((gfn, frame)),
                            _ => None,
                        })
                        .collect(),
                    nonce,
                }
            }
            Kind::Share => ToAgent::Share {
                batch,
                pages: cmds
                    .iter()
                    .filter_map(|c| match *c {
                        Command::Share { gfn, frame } => Some((gfn, frame)),
                        _ => None,
                    })
                    .collect(),
            },
            Kind::Reclaim => ToAgent::ReclaimZero {
                batch,
                gfns: gfns(),
            },
            Kind::TakeBack => ToAgent::TakeBack {
                batch,
                gfns: gfns(),
            },
            Kind::Watch => ToAgent::Watch {
                batch,
                gfns: gfns(),
            },
            Kind::Discard => ToAgent::DiscardFree {
                batch,
                gfns: gfns(),
            },
            Kind::PageOut => ToAgent::PageOut {
                batch,
                gfns: gfns(),
            },
            Kind::Stash => ToAgent::Stash {
                batch,
                pages: cmds
                    .iter()
                    .filter_map(|c| match c {
                        Command::Stash { gfn, stash, .. } => Some(stash_page(*gfn, stash)),
                        _ => None,
                    })
                    .collect(),
            },
            Kind::Clock => match &cmds[0] {
                Command::ClockScan {
                    first,
                    count,
                    arm,
                    wp_only,
                    zap_shared,
                } => ToAgent::ClockScan {
                    batch,
                    first: *first,
                    count: *count,
                    arm: arm.clone(),
                    wp_only: wp_only.clone(),
                    zap_shared: *zap_shared,
                },
                _ => unreachable!("clock batches hold one clock scan"),
            },
        };
        // Queued for the connection's writer: an agent that does not read holds its
        // writer, not this thread (`outbox.rs`).
        let sent = guests.conn(vm).is_some_and(|c| c.send(msg));
        if sent {
            self.track(batch, vm, kind, cmds);
        } else {
            // Never delivered: the pages stay as they were.
            for c in &cmds {
                engine.outcome(vm, c, Outcome::NotSent);
            }
        }
    }

    /// Batches sent and not yet answered.
    pub(crate) fn under_way(&self) -> usize {
        self.batches.len()
    }

    /// Clock slices sent to guest `vm` and not yet answered.
    fn clocks_under_way(&self, vm: VmId) -> usize {
        let clock = |b: &&Batch| b.vm == vm && b.kind == Kind::Clock;
        self.batches.values().filter(clock).count()
    }

    /// Records batch `batch` of `cmds`, sent to guest `vm`, until it is answered.
    fn track(&mut self, batch: BatchId, vm: VmId, kind: Kind, cmds: Vec<Command>) {
        self.batches.insert(batch, Batch { vm, kind, cmds });
    }

    /// Takes the batch `batch` out if guest `vm` was sent it and it is of `kind`.
    fn answered(&mut self, vm: VmId, batch: BatchId, kind: Kind) -> Option<Vec<Command>> {
        match self.batches.get(&batch) {
            Some(b) if b.vm == vm && b.kind == kind => self.batches.remove(&batch).map(|b| b.cmds),
            Some(b) => {
                tracing::warn!(
                    "{vm} answered {batch} as {kind:?}, but it was sent to {} as {:?}: ignored",
                    b.vm,
                    b.kind
                );
                None
            }
            None => {
                tracing::warn!("{vm} answered {batch}, which is not under way: ignored");
                None
            }
        }
    }

    /// An agent's answer to a share, reclaim, stash or take-back batch: each command's page
    /// is done, changed, or else refused.
    pub(crate) fn reply(
        &mut self,
        engine: &mut Engine,
        vm: VmId,
        batch: BatchId,
        kind: Kind,
        done: &[Gfn],
        changed: &[Gfn],
    ) {
        let Some(cmds) = self.answered(vm, batch, kind) else {
            return;
        };
        let done: HashSet<Gfn> = done.iter().copied().collect();
        let changed: HashSet<Gfn> = changed.iter().copied().collect();
        for c in &cmds {
            let Some(g) = c.gfn() else {
                continue;
            };
            let o = if done.contains(&g) {
                Outcome::Done
            } else if changed.contains(&g) {
                Outcome::Changed
            } else {
                Outcome::Refused
            };
            engine.outcome(vm, c, o);
        }
    }

    /// An agent's clock bits: the slice asked for, if guest `vm` was asked for it.
    pub(crate) fn clock_reply(&mut self, vm: VmId, batch: BatchId, first: Gfn) -> Option<u32> {
        let cmds = self.answered(vm, batch, Kind::Clock)?;
        match cmds[0] {
            Command::ClockScan {
                first: f, count, ..
            } if f == first => Some(count),
            _ => {
                tracing::warn!("{vm} answered {batch} for another slice: ignored");
                None
            }
        }
    }

    /// Guest `vm`'s connection dropped: its batches are lost.
    pub(crate) fn lost(&mut self, engine: &mut Engine, vm: VmId) {
        let mine: Vec<BatchId> = self
            .batches
            .iter()
            .filter(|(_, b)| b.vm == vm)
            .map(|(id, _)| *id)
            .collect();
        for id in mine {
            let b = self.batches.remove(&id).expect("listed");
            for c in &b.cmds {
                engine.outcome(vm, c, Outcome::Lost);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memfold_core::backing::mem::{ManualClock, MemBacking, MemGuestRam};
    use memfold_core::engine::Attach;
    use memfold_core::ids::DomainId;
    use memfold_core::p2m::PageState;
    use memfold_core::{EngineConfig, Policy};

    /// A guest of `ram`'s pages attached to `e` in domain 0, as QEMU `pid`'s `name`.
    fn guest(e: &mut Engine, name: &str, pid: u32, ram: MemGuestRam) -> VmId {
        let pages = ram.file().bytes.len() as u32 / 4096;
        e.attach(Attach {
            name: name.into(),
            pid,
            pages,
            ram: Box::new(ram),
            mapped: vec![],
            domain: DomainId(0),
            store: Box::new(MemBacking::new()),
            swap: None,
            sharing: Default::default(),
        })
        .unwrap()
    }

    /// An agent that never answers its clock slices is sent at most [`MAX_CLOCKS`] of
    /// them: the rest are not sent, so nothing piles up for it. Seen failing without the
    /// cap (one batch kept a period, for good).
    #[test]
    fn unanswered_clock_slices_do_not_pile_up() {
        let clock = ManualClock::new();
        let cfg = EngineConfig {
            policy: Policy::difference_engine(),
            clock_interval_us: Some(1_000),
            rate: 0,
            ..EngineConfig::default()
        };
        let mut e = Engine::new(cfg, Box::new(clock.clone()), 0).unwrap();
        e.add_domain(DomainId(0), Box::new(MemBacking::new()));
        let vm = guest(&mut e, "silent", 10, MemGuestRam::new(64));
        let dir = tempfile::tempdir().unwrap();
        let listener = memfold_wire::Listener::bind(&dir.path().join("s")).unwrap();
        let _silent = memfold_wire::Conn::connect(&dir.path().join("s")).unwrap();
        let mut guests = Guests::default();
        let outbox = super::super::outbox::Outbox::new(&listener.accept().unwrap(), "silent");
        guests.attached(vm, "silent", 1, outbox.unwrap(), (10, 0, (0, 0)));
        let mut x = Executor::default();
        for _ in 0..50 {
            clock.advance(10_000);
            e.clock_step();
            x.flush(&mut e, &guests);
        }
        assert!(x.clocks_under_way(vm) > 0, "no clock slice was sent");
        assert!(
            x.under_way() <= MAX_CLOCKS,
            "{} batches kept",
            x.under_way()
        );
    }

    /// An answer counts only from the guest the batch went to: another guest's agent
    /// answering it (forging the batch number) changes nothing.
    #[test]
    fn answers_are_bound_to_the_guest_the_batch_went_to() {
        let cfg = EngineConfig {
            policy: Policy::sharing_only(),
            clock_interval_us: None,
            rate: 0,
            ..EngineConfig::default()
        };
        let mut e = Engine::new(cfg, Box::new(ManualClock::new()), 0).unwrap();
        e.add_domain(DomainId(0), Box::new(MemBacking::new()));
        let mut vms = Vec::new();
        for (pid, name) in [(10, "a"), (11, "b")] {
            let ram = MemGuestRam::new(4);
            {
                let mut f = ram.file();
                f.bytes[..4096].fill(7);
                f.touch(0, 4096);
            }
            vms.push(guest(&mut e, name, pid, ram));
        }
        e.scan_step().unwrap();
        let (a, b) = (vms[0], vms[1]);
        let mut x = Executor::default();
        let cmds = e.take_commands(a);
        let Some(Command::Share { gfn, frame }) = cmds.first().cloned() else {
            panic!("a share for guest a: {cmds:?}");
        };
        x.track(BatchId(1), a, Kind::Share, cmds);
        // Guest b answers a's batch: ignored; a's page and b's (asked to share the same
        // frame, its answer not in yet) stay requested.
        let requested = Some(PageState::Sharing(frame));
        assert_eq!(e.page_state(b, gfn), requested);
        x.reply(&mut e, b, BatchId(1), Kind::Share, &[], &[]);
        assert_eq!(
            (e.page_state(a, gfn), e.page_state(b, gfn)),
            (requested, requested)
        );
        x.reply(&mut e, b, BatchId(1), Kind::Share, &[gfn], &[]);
        assert_eq!(
            (e.page_state(a, gfn), e.page_state(b, gfn)),
            (requested, requested)
        );
        // An answer of the wrong kind from the right guest: ignored too.
        x.reply(&mut e, a, BatchId(1), Kind::Stash, &[gfn], &[]);
        assert_eq!(e.page_state(a, gfn), Some(PageState::Sharing(frame)));
        // Its own agent's answer counts.
        x.reply(&mut e, a, BatchId(1), Kind::Share, &[gfn], &[]);
        assert_eq!(e.page_state(a, gfn), Some(PageState::Shared(frame)));
        e.check_invariants().unwrap();
    }
}
