//! The engine's books against where each agent keeps its pages, once every answer and
//! event is in (the reference model's teardown).

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
