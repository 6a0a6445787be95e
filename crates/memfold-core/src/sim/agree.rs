//! The engine's books against where an agent keeps its pages: a test's check once every
//! answer and event is in.

use super::{Home, SimAgent};
use crate::ids::{Gfn, VmId};
use crate::p2m::PageState;
use crate::Engine;

/// Whether `engine` books each page of guest `vm` where `agent` keeps it: shared on the
/// frame it maps, stored (or shared without a mapping) where the agent holds a stash,
/// reclaimed where it holds a hole, private where it holds the page — pages in flight
/// aside (a take-back an answer queued is not yet the agent's) — and paged out only
/// where the agent's page is out (one way: a page-out whose answer was lost may be out,
/// unbooked). A page booked shared that the agent holds privately keeps a frame no one
/// maps and counts as saved; one booked private on a frame is never broken in the books.
///
/// Errors: the first page that disagrees, and how.
pub fn booked_where_kept(engine: &Engine, vm: VmId, agent: &SimAgent) -> Result<(), String> {
    for g in (0..agent.pages()).map(Gfn) {
        let Some(state) = engine.page_state(vm, g) else {
            return Err(format!("{g}: no page state"));
        };
        let agrees = match (state, agent.home(g)) {
            (s, _) if s.in_flight() => true,
            (PageState::Private, Home::Private)
            | (PageState::Zero, Home::Zero)
            | (PageState::Stored(_) | PageState::Unmapped(_), Home::Stashed(_)) => true,
            (PageState::Shared(f), Home::Frame(h)) => f == h,
            _ => false,
        };
        if !agrees {
            return Err(format!(
                "{g}: booked {state:?}, the agent holds it as {:?}",
                agent.home(g)
            ));
        }
        if engine.page_paged_out(vm, g) && !agent.is_paged_out(g) {
            return Err(format!("{g}: booked paged out, in RAM at the agent"));
        }
    }
    Ok(())
}
