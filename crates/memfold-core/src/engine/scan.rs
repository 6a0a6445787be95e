//! The clock sweep (DE §4.2): scans a slice of each VM in turn, classifies pages C1–C4 and
//! applies the policy's mechanisms to them.

use serde::Serialize;

use super::Engine;
use crate::clock::NruState;
use crate::error::Result;
use crate::types::{Gfn, PageState, VmId};

use super::mechanisms::{PatchOutcome, ShareOutcome};

/// What one [`Engine::tick`] did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct TickReport {
    /// Pages scanned.
    pub scanned: u32,
    /// Pages found in C1, C2, C3, C4.
    pub states: [u32; 4],
    /// Pages shared or zero-reclaimed.
    pub shared: u32,
    /// Pages patched.
    pub patched: u32,
    /// Pages compressed.
    pub compressed: u32,
    /// Pages swapped out.
    pub swapped: u32,
    /// Times a VM was passed over because its last sweep began less than `min_rescan_us` ago.
    pub vms_resting: u32,
}

impl Engine {
    /// Runs the clock for up to `budget` pages at time `now_us` (µs, any monotonic origin;
    /// the live layer turns a pages/s scan rate into budgets, like ESX's rate limits).
    ///
    /// VMs take turns, a slice of `budget / VMs` pages each (DE §4.2 "for fairness"). A VM
    /// whose sweep wraps starts its next sweep no sooner than `min_rescan_us` after the
    /// previous one began (DE: 4 s), giving guests time to set R/M bits. When every VM has
    /// completed a sweep, a pass ends (share table hints dropped or, partitioned, the table
    /// emptied); after `share_passes` passes a cycle ends and the similarity index is rebuilt.
    ///
    /// For each scanned page, by its class's actions: share (or reclaim a zero page); else
    /// patch; else index it as a reference; compress once it has stayed idle through a full
    /// sharing cycle (DE §4.3); swap out when over the host budget.
    ///
    /// Errors: [`crate::EngineError::SwapIo`] or [`crate::EngineError::Corrupt`] from a swap-out;
    /// [`crate::EngineError::FramesExhausted`].
    pub fn tick(&mut self, now_us: u64, budget: u32) -> Result<TickReport> {
        let mut rep = TickReport::default();
        let n = self.vms.len() as u32;
        if n == 0 {
            return Ok(rep);
        }
        let slice = budget.div_ceil(n).max(1);
        let mut left = budget;
        let mut resting_in_a_row = 0;
        while left > 0 && resting_in_a_row < n {
            let Some(vm) = self.next_vm_after(self.clock_cursor) else {
                break;
            };
            self.clock_cursor = Some(vm);
            let v = self.vms.get_mut(&vm).expect("live VM");
            if v.hand == 0 {
                if let Some(t) = v.sweep_start_us {
                    if now_us.saturating_sub(t) < self.cfg.min_rescan_us {
                        resting_in_a_row += 1;
                        rep.vms_resting += 1;
                        continue;
                    }
                }
                v.sweep_start_us = Some(now_us);
            }
            resting_in_a_row = 0;
            let take = slice.min(left);
            for _ in 0..take {
                let v = self.vms.get_mut(&vm).expect("live VM");
                let gfn = v.hand;
                v.hand += 1;
                let wrapped = v.hand as usize == v.p2m.len();
                if wrapped {
                    v.hand = 0;
                }
                self.scan_page(vm, gfn, &mut rep)?;
                left -= 1;
                if wrapped {
                    self.pass_pending.remove(&vm);
                    if self.pass_pending.is_empty() {
                        self.end_pass();
                    }
                    break;
                }
            }
        }
        Ok(rep)
    }

    fn over_budget(&self) -> bool {
        self.cfg
            .host_frames_limit
            .is_some_and(|l| self.frames.in_use() as u64 * 100 >= l as u64 * 95)
    }

    fn scan_page(&mut self, vm: VmId, gfn: Gfn, rep: &mut TickReport) -> Result<()> {
        let clock = &mut self.vms.get_mut(&vm).expect("live VM").clock[gfn as usize];
        let state = clock.scan();
        let idle = clock.idle_scans();
        rep.scanned += 1;
        rep.states[state.index()] += 1;
        self.counters.pages_scanned += 1;
        let a = self.cfg.policy.for_state(state);
        let entry = self.entry(vm, gfn).state();
        if let PageState::Private(_) | PageState::Shared(_) = entry {
            if a.share {
                match self.try_share(vm, gfn)? {
                    ShareOutcome::Shared | ShareOutcome::ZeroReclaimed => {
                        rep.shared += 1;
                        return Ok(());
                    }
                    _ => {}
                }
            }
            if a.patch {
                match self.try_patch(vm, gfn)? {
                    PatchOutcome::Patched(_) => {
                        rep.patched += 1;
                        return Ok(());
                    }
                    PatchOutcome::Shared => {
                        rep.shared += 1;
                        return Ok(());
                    }
                    _ => {}
                }
            }
            if a.reference {
                self.index_reference(vm, gfn)?;
            }
            // Compress only pages idle through a whole sharing cycle, so they had every
            // chance to be shared or serve as a reference first (DE §4.3).
            if a.compress && state == NruState::C4 && idle as u32 > self.cfg.share_passes {
                if let super::mechanisms::CompressOutcome::Compressed(_) =
                    self.try_compress(vm, gfn)?
                {
                    rep.compressed += 1;
                    return Ok(());
                }
            }
        }
        if a.swap && self.over_budget() && self.swap_frees_memory(vm, gfn) {
            if let super::mechanisms::SwapOutcome::Swapped(_) = self.swap_out(vm, gfn)? {
                rep.swapped += 1;
            }
        }
        Ok(())
    }
}
