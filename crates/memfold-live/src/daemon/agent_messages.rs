//! What an attached agent tells memfoldd (`ToDaemon`), carried to the engine: answers to
//! batches through the executor (which matches them to what was asked), events (CoW
//! breaks, refills, pages decoded back, discards, pages back from the kernel's swap),
//! the clock's bits for a slice this memfoldd asked for, and the agent's counters.

use memfold_core::engine::Discard;
use memfold_core::ids::VmId;
use memfold_wire::{Discarded, ToDaemon};

use super::executor::Kind;
use super::Daemon;

impl Daemon {
    /// Carries message `msg` of guest `vm`'s agent to the engine; an unexpected one is
    /// logged and dropped (the agent is not trusted to send only what it should).
    pub(super) fn agent_message(&mut self, vm: VmId, msg: ToDaemon) {
        let e = &mut self.engine;
        match msg {
            ToDaemon::ShareDone {
                batch,
                shared,
                changed,
                ..
            } => self
                .executor
                .reply(e, vm, batch, Kind::Share, &shared, &changed),
            ToDaemon::ReclaimDone {
                batch,
                reclaimed,
                changed,
                ..
            } => self
                .executor
                .reply(e, vm, batch, Kind::Reclaim, &reclaimed, &changed),
            ToDaemon::StashDone {
                batch,
                stashed,
                changed,
                ..
            } => self
                .executor
                .reply(e, vm, batch, Kind::Stash, &stashed, &changed),
            ToDaemon::WatchDone { batch, watched, .. } => {
                self.executor
                    .reply(e, vm, batch, Kind::Watch, &watched, &[]);
                if let Some(c) = self.channels.as_mut() {
                    c.watch_answered(e, vm);
                }
            }
            ToDaemon::DiscardDone {
                batch,
                discarded,
                changed,
                ..
            } => self
                .executor
                .reply(e, vm, batch, Kind::Discard, &discarded, &changed),
            ToDaemon::CowBroken { breaks } => {
                for (g, f) in breaks {
                    e.cow_broken(vm, g, f);
                }
            }
            ToDaemon::Refilled { gfns } => {
                for g in gfns {
                    e.refilled(vm, g);
                }
            }
            ToDaemon::Unstashed { gfns } => {
                for g in gfns {
                    e.unstashed(vm, g);
                }
            }
            ToDaemon::Discarded { pages } => {
                for (g, what) in pages {
                    let what = match what {
                        Discarded::Frame(f) => Discard::Frame(f),
                        Discarded::Zero => Discard::Zero,
                        Discarded::Stashed => Discard::Stored,
                    };
                    e.discarded(vm, g, what);
                }
            }
            ToDaemon::ClockBits {
                batch,
                first,
                count,
                referenced,
                modified,
            } => {
                // Only a slice this memfoldd asked that agent for.
                if let Some(asked) = self.executor.clock_reply(vm, batch, first) {
                    e.clock_bits(vm, first, count.min(asked), &referenced, &modified);
                }
            }
            ToDaemon::PageOutDone {
                batch,
                paged,
                resident,
                ..
            } => self
                .executor
                .reply(e, vm, batch, Kind::PageOut, &paged, &resident),
            ToDaemon::PagedIn { gfns } => e.paged_in(vm, &gfns),
            ToDaemon::TakeBackDone { batch, taken, .. } => {
                self.executor
                    .reply(e, vm, batch, Kind::TakeBack, &taken, &[])
            }
            ToDaemon::AgentStats(r) => self.guests.report(vm, &r),
            ToDaemon::RegionUnmapped => {
                tracing::info!("{}", self.guests.region_unmapped(vm));
            }
            // Its kind only: the message is the peer's, up to 256 KiB each.
            other => tracing::warn!("{vm}: unexpected message of kind {}", other.kind()),
        }
    }
}
