//! The order in which a guest's commands go to its agent: one definition, which
//! memfoldd's executor batches by and the simulator and the reference model carry out
//! in, so that what the model proves is the order memfoldd sends.
//!
//! A take of commands goes out grouped by kind, not in the order the engine queued them
//! (a batch holds one kind; fewer, larger batches). Commands about one page can so pass
//! each other: the engine must not queue, for a page, a command that is unsafe to carry
//! out before one queued for it earlier (e.g. no free-page watch of a page whose discard
//! is under way, `free_discard.rs`; `check_invariants` refuses such a queue).

use super::{Command, Engine};
use crate::ids::VmId;

/// Where a command goes in a take's send order, and the batch it may share: commands of
/// one rank go out together, in the order queued, at most the executor's batch size a
/// batch. Clock scans first (each its own batch), then fills (one batch a nonce: a block
/// device waits on each), stashes, shares, zero reclaims, take-backs, free-page watches,
/// free-page discards and page-outs.
pub fn send_rank(c: &Command) -> (u8, [u64; 2]) {
    match c {
        Command::ClockScan { .. } => (0, [0, 0]),
        Command::Fill { nonce, .. } => (1, *nonce),
        Command::Stash { .. } => (2, [0, 0]),
        Command::Share { .. } => (3, [0, 0]),
        Command::Reclaim { .. } => (4, [0, 0]),
        Command::TakeBack { .. } => (5, [0, 0]),
        Command::Watch { .. } => (6, [0, 0]),
        Command::DiscardFree { .. } => (7, [0, 0]),
        Command::PageOut { .. } => (8, [0, 0]),
    }
}

impl Engine {
    /// Hands out guest `id`'s waiting commands in send order ([`send_rank`], stable: in
    /// the order queued within a rank), for the executor to send as they come.
    pub fn take_commands(&mut self, id: VmId) -> Vec<Command> {
        let mut cmds = self.take_queue(id);
        cmds.sort_by_key(send_rank);
        cmds
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ids::Gfn;

    /// A take groups by rank and keeps the queue's order within one. Fails unsorted.
    #[test]
    fn a_take_is_in_send_order() {
        let mut r =
            crate::sim::Rig::new(crate::sim::quick_config(crate::Policy::sharing_only()), 8)
                .unwrap();
        let q = [
            Command::DiscardFree { gfn: Gfn(1) },
            Command::Reclaim { gfn: Gfn(2) },
            Command::DiscardFree { gfn: Gfn(0) },
            Command::Reclaim { gfn: Gfn(3) },
        ];
        r.engine.vms.get_mut(&r.vm).unwrap().queue.extend(q.clone());
        assert_eq!(
            r.engine.take_commands(r.vm),
            [q[1].clone(), q[3].clone(), q[0].clone(), q[2].clone()]
        );
    }
}
