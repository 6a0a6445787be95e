//! The engine's books against where each agent keeps its pages, once every answer and
//! event is in (the reference model's teardown).

use super::{Harness, ModelVm};
use memfold_core::ids::Gfn;
use memfold_core::p2m::PageState;
use memfold_core::sim::Home;

impl Harness {
    /// Once every answer and event is in, the engine books each page of guest `i` where
    /// its agent keeps it: a page booked shared that the agent holds privately keeps a
    /// frame no one maps (and counts as saved), one booked private that sits on a frame
    /// is never shared or broken in the books.
    pub(super) fn books_agree_with_agent(&self, i: usize, v: &ModelVm) -> Result<(), String> {
        let id = v.id.expect("attached");
        for g in (0..v.agent.pages()).map(Gfn) {
            let Some(state) = self.engine.page_state(id, g) else {
                return Err(format!("vm {i} {g}: no page state"));
            };
            let agrees = match (state, v.agent.home(g)) {
                // Sent later (a take-back queued by an answer): not yet the agent's.
                (s, _) if s.in_flight() => true,
                (PageState::Private, Home::Private)
                | (PageState::Zero, Home::Zero)
                | (PageState::Stored(_) | PageState::Unmapped(_), Home::Stashed(_)) => true,
                (PageState::Shared(f), Home::Frame(h)) => f == h,
                _ => false,
            };
            if !agrees {
                return Err(format!(
                    "vm {i} {g}: booked {state:?}, the agent holds it as {:?}",
                    v.agent.home(g)
                ));
            }
            // One way only: a page-out whose answer was lost may be out, unbooked.
            if self.engine.page_paged_out(id, g) && !v.agent.is_paged_out(g) {
                return Err(format!("vm {i} {g}: booked paged out, in RAM at the agent"));
            }
        }
        Ok(())
    }
}
