//! Shares confirmed byte for byte whoever queued them: the sharing scan's are checked in
//! `Op::Step`; here, those the Difference Engine and `share_cold` queue while a clock
//! slice's bits are applied (`Engine::clock_bits`, at the answer to a `ClockScan`) and
//! those a disk read's report queues (`Engine::read_landed`). A match on a hint queues a
//! share for the hinted page of another guest too, so every connected guest's queue is
//! checked.

use memfold_core::Engine;

use super::Harness;

impl Harness {
    /// Calls the engine (`f`); on even steps, every share it queued must name a frame
    /// holding the page's bytes ([`Harness::confirmed`]). What was queued before goes out
    /// first, unchecked (a `cow_broken` report's unmap leaves the check to the agent on
    /// purpose). On odd steps the commands stay queued as before, so that those the engine
    /// drops (an opt-out) or answers as not sent (a detach) are still drawn.
    pub(super) fn confirming(&mut self, f: impl FnOnce(&mut Engine)) -> Result<(), String> {
        if self.steps % 2 == 1 {
            f(&mut self.engine);
            return Ok(());
        }
        for v in self.vms.iter_mut().filter(|v| v.connected) {
            let cmds = self.engine.take_commands(v.id.expect("connected"));
            v.wire.extend(cmds);
        }
        f(&mut self.engine);
        self.send_confirmed()
    }

    /// Sends every connected guest's queued commands onto its wire, each share checked
    /// first ([`Harness::confirmed`]).
    pub(super) fn send_confirmed(&mut self) -> Result<(), String> {
        for i in 0..self.vms.len() {
            if !self.vms[i].connected {
                continue;
            }
            let cmds = self
                .engine
                .take_commands(self.vms[i].id.expect("connected"));
            self.confirmed(i, &cmds)?;
            self.vms[i].wire.extend(cmds);
        }
        Ok(())
    }
}
