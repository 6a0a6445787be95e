//! Never-share guests ([`Sharing::NeverShare`], Satori §4.3): each alone in its sharing
//! domain, so that no other guest's page is ever shared with, patched against or a
//! reference for one of its pages. The engine refuses, both ways, an attach that would
//! put a guest beside one; the model asks it for such an attach at each first attach.

use memfold_core::backing::mem::MemBacking;
use memfold_core::engine::{Attach, Sharing};

use super::Harness;

impl Harness {
    /// Before guest `i`'s first attach to this engine: an attach of it into another
    /// domain, beside a never-share guest the engine knows (attached or not) — or,
    /// never-share itself, beside any guest — is refused, and leaves nothing.
    pub(super) fn refused_beside(&mut self, i: usize) -> Result<(), String> {
        let v = &self.vms[i];
        let d = self.domain_of(v);
        let beside = (self.vms.iter().enumerate())
            .filter(|&(k, o)| k != i && o.id.is_some() && (v.alone || o.alone))
            .map(|(_, o)| (self.domain_of(o), o.alone))
            .find(|&(od, _)| od != d);
        let Some((od, never)) = beside else {
            return Ok(());
        };
        let got = self.engine.attach(Attach {
            name: format!("g{}", v.pid),
            pid: v.pid,
            pages: v.agent.pages(),
            ram: self.engine_faults.ram(&v.agent.ram),
            mapped: Vec::new(),
            domain: od,
            store: Box::new(MemBacking::new()),
            swap: None,
            sharing: if v.alone {
                Sharing::NeverShare
            } else {
                Sharing::Domain
            },
        });
        match got {
            Err(_) => {
                self.refused_beside += 1;
                Ok(())
            }
            Ok(id) => Err(format!(
                "vm {i} ({}) attached as {id} into {od} beside a {} guest",
                if v.alone { "never-share" } else { "sharing" },
                if never { "never-share" } else { "sharing" },
            )),
        }
    }
}
