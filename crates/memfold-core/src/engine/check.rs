//! Consistency checks of the engine's structures against each other, for tests.

use hashbrown::{HashMap, HashSet};

use super::Engine;
use crate::blobstore::BlobKind;
use crate::frames::{BLOB_CHUNK, IN_SHARE_TABLE};
use crate::share::ShareEntry;
use crate::types::{Frame, PageState};

impl Engine {
    /// Verifies every invariant the engine relies on and returns the first violation:
    /// reference counts equal mappings plus patch references; a private frame has exactly
    /// one holder; share-table entries name live, flagged frames whose content still hashes
    /// to the entry; blobs and swap slots are held by exactly one page each; frames in use
    /// are exactly those reachable. O(memory); meant for tests.
    pub fn check_invariants(&self) -> Result<(), String> {
        let mut expect: HashMap<Frame, u32> = HashMap::new();
        let mut private: HashSet<Frame> = HashSet::new();
        let mut shared: HashSet<Frame> = HashSet::new();
        let mut blobs_seen = HashSet::new();
        let mut slots_seen = HashSet::new();
        for (id, v) in &self.vms {
            for (gfn, e) in v.p2m.iter().enumerate() {
                let at = || format!("{id} gfn {gfn}");
                match e.state() {
                    PageState::Private(f) => {
                        if !private.insert(f) {
                            return Err(format!("{}: private frame {f:?} mapped twice", at()));
                        }
                        *expect.entry(f).or_default() += 1;
                    }
                    PageState::Shared(f) => {
                        shared.insert(f);
                        *expect.entry(f).or_default() += 1;
                    }
                    PageState::Patched(b) | PageState::Compressed(b) => {
                        if !blobs_seen.insert(b) {
                            return Err(format!("{}: blob {b} held twice", at()));
                        }
                        let meta = self.blobs.meta(&self.frames, b);
                        match (e.state(), meta.kind, meta.reference) {
                            (PageState::Patched(_), BlobKind::Patch(_), Some(r)) => {
                                *expect.entry(r).or_default() += 1
                            }
                            (PageState::Compressed(_), BlobKind::Compressed(_), None) => {}
                            _ => {
                                return Err(format!(
                                    "{}: blob {b} kind {meta:?} does not match entry",
                                    at()
                                ))
                            }
                        }
                    }
                    PageState::Swapped(s) => {
                        if !slots_seen.insert(s) || !self.swap.is_used(s) {
                            return Err(format!("{}: swap slot {s} not held exactly once", at()));
                        }
                    }
                    PageState::Unbacked | PageState::Zero => {}
                }
            }
        }
        for f in &private {
            if shared.contains(f) {
                return Err(format!("frame {f:?} mapped both private and shared"));
            }
            if expect[f] != 1 {
                return Err(format!(
                    "private frame {f:?} also used as a patch reference"
                ));
            }
            if self.frames.flags(*f) & IN_SHARE_TABLE != 0 {
                return Err(format!("private frame {f:?} is in the share table"));
            }
        }
        for (&f, &n) in &expect {
            let c = self.frames.refcount(f);
            if c != n {
                return Err(format!(
                    "frame {f:?}: refcount {c}, but {n} mappings and patch references"
                ));
            }
            if self.frames.flags(f) & BLOB_CHUNK != 0 {
                return Err(format!("frame {f:?} is both guest data and a blob chunk"));
            }
        }
        let chunks: HashSet<Frame> = self.blobs.chunk_frames().collect();
        for &f in &chunks {
            if self.frames.refcount(f) != 1 || self.frames.flags(f) & BLOB_CHUNK == 0 {
                return Err(format!(
                    "blob chunk {f:?} has refcount {} / flags {}",
                    self.frames.refcount(f),
                    self.frames.flags(f)
                ));
            }
        }
        let allocated = self.frames.allocated().count();
        if allocated != expect.len() + chunks.len() || allocated != self.frames.in_use() as usize {
            return Err(format!(
                "{allocated} frames allocated ({} in use), {} reachable from pages and {} blob chunks: leak",
                self.frames.in_use(),
                expect.len(),
                chunks.len()
            ));
        }
        let live_blobs = self.blobs.live_ids().count();
        if live_blobs != blobs_seen.len() {
            return Err(format!(
                "{live_blobs} live blobs, {} held by pages",
                blobs_seen.len()
            ));
        }
        if self.swap.stats().in_use as usize != slots_seen.len() {
            return Err(format!(
                "{} swap slots used, {} held by pages",
                self.swap.stats().in_use,
                slots_seen.len()
            ));
        }
        let mut listed = HashSet::new();
        for (tag, e) in self.share.entries() {
            if let ShareEntry::Shared(f) = e {
                if !expect.contains_key(&f) || self.frames.flags(f) & IN_SHARE_TABLE == 0 {
                    return Err(format!(
                        "share table names frame {f:?} that is not a flagged live frame"
                    ));
                }
                if private.contains(&f) {
                    return Err(format!("share table names private frame {f:?}"));
                }
                if (self.hash(self.frames.data(f)) >> 32) as u32 != tag {
                    return Err(format!(
                        "shared frame {f:?} content no longer matches its hash: it was written"
                    ));
                }
                if !listed.insert(f) {
                    return Err(format!("frame {f:?} listed twice in the share table"));
                }
            }
        }
        for f in self.frames.allocated() {
            if self.frames.flags(f) & IN_SHARE_TABLE != 0 && !listed.contains(&f) {
                return Err(format!(
                    "frame {f:?} flagged as listed but missing from the share table"
                ));
            }
        }
        Ok(())
    }
}
