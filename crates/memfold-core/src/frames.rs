//! The pool's frames and their books (ESX §4.3's shared machine pages): which frames hold
//! content, how many guest pages map each (its sharing rank), how many share requests
//! name it, how many patches use it as their reference page, and its content hash.
//!
//! A frame is in use while anything holds it: a mapping, a request, a patch — or, after a
//! memfoldd restart, an agent that may still map it (an adopted pool: every frame its
//! memfd holds counts as taken until freed through these books). Allocation prefers the
//! frame after the last one allocated, so that runs of equal pages in two guests land on
//! runs of frames and their mappings merge into one VMA each.

use std::collections::BTreeSet;

use crate::ids::FrameId;

/// The pool grows this many frames at a time (untouched parts use no memory).
pub const GROW_FRAMES: u32 = 1024;

/// Which quiet frames [`FrameTable::take_quiet`] gives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quiet {
    /// Frames only patches hold (their reference page; no guest page maps them).
    ReferenceOnly,
    /// Every frame in use, mapped ones included.
    Held,
}

/// Books of the pool's frames.
#[derive(Default)]
pub struct FrameTable {
    /// Guest pages mapping the frame, plus patches using it as reference.
    refcount: Vec<u32>,
    /// Share requests naming the frame, not answered yet.
    pending: Vec<u32>,
    /// Of `refcount`, the patches using the frame as their reference page.
    patch_refs: Vec<u32>,
    /// Content hash of each frame in use.
    hash: Vec<u64>,
    /// Whether the frame is held although no book names it (adopted, not yet seen).
    adopted: Vec<bool>,
    /// A bit a frame: its books changed (a mapping, a patch or a request came or went), or
    /// memfoldd read it, since [`FrameTable::take_quiet`] last looked.
    touched: Vec<u64>,
    /// Where the next [`FrameTable::take_quiet`] starts.
    quiet_next: u32,
    free: BTreeSet<u32>,
    size: u32,
    next: u32,
    last: Option<u32>,
    in_use: u32,
}

impl FrameTable {
    /// Books for an empty pool.
    pub fn new() -> Self {
        Self::default()
    }

    /// Books for a pool of `frames` frames adopted from a previous memfoldd. The frames
    /// in `held` (those holding data) count as in use until freed through these books:
    /// an agent not yet re-attached may map any of them. The others are holes, free —
    /// handed out from the bottom up as [`FrameTable::alloc`] passes them, not listed
    /// (a pool's size comes from a peer: the books cost O(frames) words, no more).
    pub fn adopted(frames: u32, held: impl IntoIterator<Item = FrameId>) -> Self {
        let n = frames as usize;
        let mut t = FrameTable {
            refcount: vec![0; n],
            pending: vec![0; n],
            patch_refs: vec![0; n],
            hash: vec![0; n],
            adopted: vec![false; n],
            touched: vec![0; n.div_ceil(64)],
            quiet_next: 0,
            free: BTreeSet::new(),
            size: frames,
            next: 0,
            last: None,
            in_use: 0,
        };
        for f in held {
            if f.0 < frames && !t.adopted[f.index()] {
                t.adopted[f.index()] = true;
                t.in_use += 1;
            }
        }
        t
    }

    /// Frames the pool holds room for.
    pub fn size(&self) -> u32 {
        self.size
    }

    /// Frames in use (mapped, named by a request, a patch reference, or adopted).
    pub fn in_use(&self) -> u32 {
        self.in_use
    }

    /// Takes a free frame for content hashing to `hash`, with one pending request (the
    /// share request that will name it) and no references. Returns the frame and, if the
    /// pool must grow first to hold it, its new size in frames.
    pub fn alloc(&mut self, hash: u64) -> (FrameId, Option<u32>) {
        let preferred = self.last.map(|l| l + 1).filter(|n| self.free.contains(n));
        let mut grow = None;
        let f = if let Some(n) = preferred {
            self.free.remove(&n);
            n
        } else if let Some(n) = self.next_unheld() {
            n
        } else if let Some(n) = self.free.pop_first() {
            n
        } else {
            let size = self.size + GROW_FRAMES;
            self.resize(size);
            grow = Some(size);
            self.next += 1;
            self.next - 1
        };
        self.last = Some(f);
        let i = f as usize;
        self.touch(FrameId(f));
        self.pending[i] = 1;
        self.hash[i] = hash;
        self.in_use += 1;
        (FrameId(f), grow)
    }

    /// The next frame from `next` on that nothing holds (advancing `next`): past an
    /// adopted pool's held frames, pinned or — once the adoption ended — still mapped.
    fn next_unheld(&mut self) -> Option<u32> {
        while self.next < self.size && self.is_used(FrameId(self.next)) {
            self.next += 1;
        }
        (self.next < self.size).then(|| {
            self.next += 1;
            self.next - 1
        })
    }

    fn resize(&mut self, size: u32) {
        let n = size as usize;
        self.refcount.resize(n, 0);
        self.pending.resize(n, 0);
        self.patch_refs.resize(n, 0);
        self.hash.resize(n, 0);
        self.adopted.resize(n, false);
        self.touched.resize(n.div_ceil(64), 0);
        self.size = size;
    }

    /// Gives back a frame [`FrameTable::alloc`] handed out whose content could not be
    /// written: it was never named anywhere.
    pub fn unalloc(&mut self, f: FrameId) {
        self.pending[f.index()] = 0;
        self.free.insert(f.0);
        self.in_use -= 1;
    }

    /// Gives back frame `f`, which [`FrameTable::alloc`] handed out with a grow the pool
    /// could not make: the table shrinks back, and the next alloc asks for the grow again.
    /// (Kept grown, the next alloc handed out frames past the end of the pool file with no
    /// grow asked: their writes extended the file past the length memfoldd set.)
    pub fn ungrow(&mut self, f: FrameId) {
        self.pending[f.index()] = 0;
        self.in_use -= 1;
        self.next = f.0;
        self.last = None;
        self.resize(self.size - GROW_FRAMES);
    }

    /// Whether `f` is a frame of the pool.
    pub fn contains(&self, f: FrameId) -> bool {
        f.0 < self.size
    }

    /// Whether `f` is pinned as a frame of an adopted pool.
    pub fn is_adopted(&self, f: FrameId) -> bool {
        self.adopted[f.index()]
    }

    /// Whether any adopted frame is still pinned.
    pub fn adoption_pending(&self) -> bool {
        self.adopted.iter().any(|&a| a)
    }

    /// Unpins every adopted frame; returns those now free (nothing else holds them).
    pub fn end_adoption(&mut self) -> Vec<FrameId> {
        let mut freed = Vec::new();
        for i in 0..self.size as usize {
            if std::mem::take(&mut self.adopted[i]) {
                // Unpinned: its books changed (a reference-only frame waits a round).
                self.touch(FrameId(i as u32));
                if self.maybe_free(FrameId(i as u32)) {
                    freed.push(FrameId(i as u32));
                }
            }
        }
        freed
    }

    /// Records the content hash of frame `f` (an adopted frame, once read).
    pub fn set_hash(&mut self, f: FrameId, hash: u64) {
        self.hash[f.index()] = hash;
    }

    /// The frame's content hash.
    pub fn hash(&self, f: FrameId) -> u64 {
        self.hash[f.index()]
    }

    /// Guest pages mapping the frame plus patches using it (its sharing rank, with the
    /// patches).
    pub fn refcount(&self, f: FrameId) -> u32 {
        self.refcount[f.index()]
    }

    /// Share requests naming the frame.
    pub fn pending(&self, f: FrameId) -> u32 {
        self.pending[f.index()]
    }

    /// Patches using the frame as their reference page.
    pub fn patch_refs(&self, f: FrameId) -> u32 {
        self.patch_refs[f.index()]
    }

    /// Whether the frame holds content (something holds it).
    pub fn is_used(&self, f: FrameId) -> bool {
        let i = f.index();
        self.refcount[i] > 0 || self.pending[i] > 0 || self.adopted[i]
    }

    /// One more share request names `f`.
    pub fn add_pending(&mut self, f: FrameId) {
        self.touch(f);
        self.pending[f.index()] += 1;
    }

    /// A share request naming `f` ended (`mapped`: the page now maps it). Returns true if
    /// the frame is now free.
    pub fn answer(&mut self, f: FrameId, mapped: bool) -> bool {
        let i = f.index();
        self.touch(f);
        self.pending[i] -= 1;
        if mapped {
            self.refcount[i] += 1;
        }
        self.maybe_free(f)
    }

    /// One more mapping of `f` (or, with `patch`, one more patch using it).
    pub fn incref(&mut self, f: FrameId, patch: bool) {
        let i = f.index();
        self.touch(f);
        self.refcount[i] += 1;
        if patch {
            self.patch_refs[i] += 1;
        }
    }

    /// One mapping (or patch) fewer. Returns true if the frame is now free.
    pub fn decref(&mut self, f: FrameId, patch: bool) -> bool {
        let i = f.index();
        self.touch(f);
        self.refcount[i] -= 1;
        if patch {
            self.patch_refs[i] -= 1;
        }
        self.maybe_free(f)
    }

    fn maybe_free(&mut self, f: FrameId) -> bool {
        if self.is_used(f) {
            return false;
        }
        // A frame past `next` (an adopted pool's) is handed out from there.
        if f.0 < self.next {
            self.free.insert(f.0);
        }
        self.in_use -= 1;
        true
    }

    /// Frames held only as patch reference pages (no guest page maps them).
    pub fn reference_only(&self) -> u64 {
        self.patch_refs
            .iter()
            .zip(&self.refcount)
            .filter(|&(&p, &r)| p > 0 && p == r)
            .count() as u64
    }

    /// Marks frame `f` as just used: a change of its books, or memfoldd reading its bytes
    /// (a scan's compare, a reference page tried), which would have brought it back into
    /// RAM had it been paged out.
    pub fn touch(&mut self, f: FrameId) {
        self.touched[f.index() / 64] |= 1 << (f.0 % 64);
    }

    /// Frames in use that nothing touched since the last call — no patch made against
    /// one or decoded from it, no mapping made or dropped, no share request, no read of
    /// memfoldd's ([`FrameTable::touch`]) — at most `max`, taken from where the last call
    /// stopped (wrapping) so every frame has its turn, returned in ascending frame order;
    /// then forgets what changed.
    /// A frame that just changed waits one more call.
    ///
    /// [`Quiet::ReferenceOnly`] keeps the frames only patches hold: read only when a
    /// stored page that patches against one is decoded, each of those pages cold by the
    /// NRU clock (DE §4.2). [`Quiet::Held`] keeps mapped frames too; whether their guests
    /// still touch them is the kernel's to say (it pages out only what no process maps).
    /// The frames the zswap backing pages out (issue 15, `Engine::page_out_frames`).
    pub fn take_quiet(&mut self, which: Quiet, max: usize) -> Vec<FrameId> {
        let mut out = Vec::new();
        let n = self.size as usize;
        let start = (self.quiet_next as usize).min(n);
        let mut stop = start;
        for i in (start..n).chain(0..start) {
            if out.len() == max {
                stop = i;
                break;
            }
            let quiet = !crate::clock::mask_bit(&self.touched, i as u32);
            let (p, r) = (self.patch_refs[i], self.refcount[i]);
            let held = match which {
                Quiet::ReferenceOnly => p > 0 && p == r,
                Quiet::Held => r > 0,
            };
            if quiet && held && self.pending[i] == 0 && !self.adopted[i] {
                out.push(FrameId(i as u32));
            }
        }
        self.quiet_next = stop as u32;
        out.sort_unstable();
        self.touched.fill(0);
        out
    }

    /// Verifies the table's own books, for tests: the free set is exactly the frames
    /// below `next` that nothing holds (a frame missing from it is never handed out
    /// again; a used one in it is handed out twice), `next` is within the pool, and no
    /// frame counts more patches than references. Returns the first violation.
    pub(crate) fn check(&self) -> Result<(), String> {
        if self.next > self.size {
            return Err(format!(
                "next frame {} past the pool's {}",
                self.next, self.size
            ));
        }
        if let Some(f) = self.free.iter().find(|&&f| f >= self.next) {
            return Err(format!("free frame {f} at or past next {}", self.next));
        }
        for i in 0..self.size {
            let f = FrameId(i);
            let used = self.is_used(f);
            if i < self.next && used == self.free.contains(&i) {
                let why = if used {
                    "used, and in the free set"
                } else {
                    "free, and not in the free set"
                };
                return Err(format!("{f}: {why}"));
            }
            if self.patch_refs[f.index()] > self.refcount[f.index()] {
                return Err(format!(
                    "{f}: {} patches of {} references",
                    self.patch_refs[f.index()],
                    self.refcount[f.index()]
                ));
            }
        }
        Ok(())
    }

    /// Bytes of memory these books take.
    pub fn metadata_bytes(&self) -> usize {
        self.refcount.capacity() * 4
            + self.pending.capacity() * 4
            + self.patch_refs.capacity() * 4
            + self.hash.capacity() * 8
            + self.adopted.capacity()
            + self.touched.capacity() * 8
            + self.free.len() * 8
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_frame_lives_while_a_mapping_request_or_patch_holds_it() {
        let mut t = FrameTable::new();
        let (f, grow) = t.alloc(7);
        assert_eq!(grow, Some(GROW_FRAMES), "the first frame grows the pool");
        assert_eq!((t.pending(f), t.refcount(f), t.in_use()), (1, 0, 1));
        t.add_pending(f);
        assert!(!t.answer(f, true));
        t.incref(f, true);
        assert_eq!(t.reference_only(), 0);
        assert!(!t.answer(f, false));
        assert!(!t.decref(f, false), "the patch still holds it");
        assert_eq!(t.reference_only(), 1);
        assert!(t.decref(f, true));
        assert_eq!(t.in_use(), 0);
        let (g, grow) = t.alloc(8);
        assert_eq!(
            (g, grow),
            (FrameId(1), None),
            "the next frame, not the freed one"
        );
    }

    /// A grow the pool could not make is asked for again at the next alloc.
    #[test]
    fn a_grow_given_back_is_asked_for_again() {
        let mut t = FrameTable::new();
        let (f, grow) = t.alloc(7);
        assert_eq!(grow, Some(GROW_FRAMES));
        t.ungrow(f);
        assert_eq!((t.in_use(), t.contains(f)), (0, false));
        assert_eq!(t.alloc(8), (FrameId(0), Some(GROW_FRAMES)));
    }

    #[test]
    fn only_reference_frames_nothing_touched_for_a_whole_round_are_quiet() {
        let mut t = FrameTable::new();
        // a: reference-only; b: mapped and patched; c: reference-only with a request.
        // Each frame held by a patch before its first request ends (never freed early).
        let frame = |t: &mut FrameTable, h| {
            let (f, _) = t.alloc(h);
            t.incref(f, true);
            t.answer(f, false);
            f
        };
        let (a, b, c) = (frame(&mut t, 1), frame(&mut t, 2), frame(&mut t, 3));
        t.incref(b, false);
        t.add_pending(c);
        assert_eq!(t.in_use(), 3);
        assert_eq!(
            t.take_quiet(Quiet::ReferenceOnly, usize::MAX),
            vec![],
            "all just changed"
        );
        assert_eq!(
            t.take_quiet(Quiet::ReferenceOnly, usize::MAX),
            vec![a],
            "a whole round quiet"
        );
        // A patch decoded from a (its reference dropped): a waits another round.
        t.incref(a, true);
        t.decref(a, true);
        assert_eq!(t.take_quiet(Quiet::ReferenceOnly, usize::MAX), vec![]);
        assert_eq!(t.take_quiet(Quiet::ReferenceOnly, usize::MAX), vec![a]);
        // b's mapping gone: reference-only now, quiet a round later; c's request answered.
        t.decref(b, false);
        t.answer(c, false);
        assert_eq!(t.take_quiet(Quiet::ReferenceOnly, usize::MAX), vec![a]);
        assert_eq!(
            t.take_quiet(Quiet::ReferenceOnly, usize::MAX),
            vec![a, b, c]
        );
        // A freed frame is no one's (b and c, untouched, stay quiet).
        t.decref(a, true);
        assert_eq!(t.take_quiet(Quiet::ReferenceOnly, usize::MAX), vec![b, c]);
    }

    #[test]
    fn held_frames_mapped_ones_included_are_quiet_in_turns() {
        let mut t = FrameTable::new();
        // Five frames each mapped by a guest page, the middle one also a reference.
        let fs: Vec<FrameId> = (0..5)
            .map(|h| {
                let (f, _) = t.alloc(h);
                t.answer(f, true);
                f
            })
            .collect();
        t.incref(fs[2], true);
        assert_eq!(
            t.take_quiet(Quiet::Held, usize::MAX),
            vec![],
            "all just changed"
        );
        assert_eq!(
            t.take_quiet(Quiet::ReferenceOnly, usize::MAX),
            vec![],
            "all mapped"
        );
        // Two a call, from where the last stopped: every frame has its turn.
        assert_eq!(t.take_quiet(Quiet::Held, 2), vec![fs[0], fs[1]]);
        assert_eq!(t.take_quiet(Quiet::Held, 2), vec![fs[2], fs[3]]);
        t.touch(fs[0]);
        assert_eq!(
            t.take_quiet(Quiet::Held, 2),
            vec![fs[1], fs[4]],
            "0 touched: skipped"
        );
        // A frame with a request under way is not quiet; a freed one is no one's.
        t.add_pending(fs[3]);
        assert!(t.decref(fs[4], false), "freed");
        assert_eq!(
            t.take_quiet(Quiet::Held, usize::MAX),
            vec![fs[0], fs[1], fs[2]]
        );
    }

    /// Past a grow's worth of frames the freed ones are handed out again, the one after
    /// the last first, else the lowest; the free set stays exactly the frames nothing
    /// holds (`FrameTable::check`). The engine's tests never allocate this many.
    #[test]
    fn freed_frames_are_handed_out_again_and_the_free_set_stays_exact() {
        let mut t = FrameTable::new();
        for h in 0..GROW_FRAMES {
            let (f, _) = t.alloc(h as u64);
            t.answer(f, true);
        }
        for f in (10..20).chain([500]).map(FrameId) {
            assert!(t.decref(f, false));
        }
        t.check().unwrap();
        let mut got = Vec::new();
        for h in 0..11 {
            let (f, grow) = t.alloc(h);
            assert_eq!(grow, None);
            t.check().unwrap();
            got.push(f.0);
        }
        assert_eq!(got, (10..20).chain([500]).collect::<Vec<u32>>());
        assert!(t.answer(FrameId(15), false), "freed again");
        t.check().unwrap();
        assert_eq!(t.alloc(0), (FrameId(15), None));
        assert_eq!(t.alloc(0), (FrameId(GROW_FRAMES), Some(2 * GROW_FRAMES)));
        t.check().unwrap();
    }

    #[test]
    fn adopted_frames_stay_taken_until_their_books_free_them() {
        let mut t = FrameTable::adopted(4, [FrameId(0), FrameId(1), FrameId(2)]);
        assert_eq!(t.in_use(), 3);
        let (f, grow) = t.alloc(1);
        assert_eq!(
            (f, grow),
            (FrameId(3), None),
            "a hole is free; no held frame is reused"
        );
        t.incref(FrameId(1), false);
        assert!(!t.decref(FrameId(1), false), "pinned while adoption lasts");
        assert_eq!(t.in_use(), 4);
        t.incref(FrameId(2), false);
        assert_eq!(t.end_adoption(), vec![FrameId(0), FrameId(1)]);
        assert_eq!(t.in_use(), 2, "frame 2 is mapped, 3 pending");
    }
}
