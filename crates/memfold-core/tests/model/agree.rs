//! The engine's books against where each agent keeps its pages, once every answer and
//! event is in: after every step for each guest whose answers and events are all in, and
//! at the teardown for every guest.

use super::{Harness, ModelVm};
use memfold_core::sim::booked_where_kept;

impl Harness {
    /// Once every answer and event is in, the engine books each page of guest `i` where
    /// its agent keeps it ([`booked_where_kept`]).
    pub(super) fn books_agree_with_agent(&self, i: usize, v: &ModelVm) -> Result<(), String> {
        let id = v.id.expect("attached");
        booked_where_kept(&self.engine, id, &v.agent).map_err(|e| format!("vm {i} {e}"))
    }
}

impl Harness {
    /// [`Harness::books_agree_with_agent`] for every connected guest with no answer held
    /// back and no event unreported (pages whose requests are on the wire are in flight,
    /// and skipped), nor a page-out in doubt (`ModelVm::page_out_in_doubt`). Checked after every step: a re-attach rewrites the books from the
    /// agent's mappings, so drift left to the teardown could be healed before it is seen.
    pub(super) fn books_agree_now(&self) -> Result<(), String> {
        let settled = |v: &&ModelVm| {
            v.connected && v.held.is_empty() && v.agent.events.is_empty() && !v.page_out_in_doubt
        };
        for (i, v) in self.vms.iter().enumerate().filter(|(_, v)| settled(v)) {
            self.books_agree_with_agent(i, v)?;
        }
        Ok(())
    }
}
