//! What the harness counts so that a run can show the paths it reached (the long run
//! asserts each was: a mechanism never run is a test that passes vacuously).

use memfold_core::ids::{Gfn, VmId};
use memfold_core::sim::Event;

use super::Harness;

/// The page an agent's event is about.
fn event_gfn(e: &Event) -> Gfn {
    match *e {
        Event::CowBroken(g, _)
        | Event::Refilled(g)
        | Event::Unstashed(g)
        | Event::Discarded(g, _)
        | Event::PagedIn(g) => g,
    }
}

impl Harness {
    /// Counts event `e` of guest `id` in [`Harness::events_in_flight`] if a request about
    /// its page is under way (or in doubt) as it reaches the engine.
    pub(super) fn count_event(&mut self, id: VmId, e: &Event) {
        if self
            .engine
            .page_state(id, event_gfn(e))
            .is_some_and(|s| s.in_flight())
        {
            self.events_in_flight += 1;
        }
    }
}
