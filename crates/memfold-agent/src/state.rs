//! The agent's record of guest RAM: where each page lives ([`PageHome`]) and its R and M
//! bits for the NRU clock since its slice was last armed.

use memfold_codecs::PatchCodec;
use memfold_ids::{FrameId, Gfn};
use memfold_wire::{Blob, BlobHome, Mapped, StashPage};

/// Where a guest page lives, as the agent knows it; a fault on the page is served by
/// where it lives (see the fault module).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PageHome {
    /// In the guest memfd, mapped as QEMU mapped it (or a hole never touched yet: the
    /// first touch gets zeros).
    Private,
    /// A reclaimed zero page: a hole in the guest memfd, refilled with zeros on the next
    /// access.
    Zero,
    /// Mapped onto this pool frame, write-protected: a write breaks copy-on-write.
    Frame(FrameId),
    /// Out of RAM as a blob in the store memfd or the swap file (a hole in the guest
    /// memfd), or as the identical patch against a pool frame ([`Stash::identical`]):
    /// decoded back on the next access.
    Stashed(Stash),
}

/// A stashed page's blob: what it is and where. A [`StashPage`] without its gfn (the
/// record's index) and its `moving` flag (a request's, never a state's).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stash {
    /// What the blob is (a patch names its pool reference frame).
    pub(crate) blob: Blob,
    /// Where the blob is.
    pub(crate) home: BlobHome,
    /// Byte offset of the blob in its home.
    pub(crate) offset: u64,
    /// Blob length, bytes.
    pub(crate) len: u32,
    /// The page's checksum: a decoded page that differs is never installed. `None` only
    /// for the identical patch ([`Stash::identical`]) as [`Pages`] reads it back: the
    /// table keeps no checksum for it, and its page is the reference frame's bytes
    /// (`fault.rs`, `decode_identical`, says why that needs none).
    pub(crate) checksum: Option<u64>,
}

impl From<&StashPage> for Stash {
    /// A request's blob, with the request's checksum.
    fn from(p: &StashPage) -> Stash {
        Stash {
            blob: p.blob,
            home: p.home,
            offset: p.offset,
            len: p.len,
            checksum: Some(p.checksum),
        }
    }
}

impl Stash {
    /// Page `f`'s bytes as a stash: the empty run-diff patch against frame `f` in the
    /// store, as memfoldd shares a page without a mapping (its offset means nothing: 0).
    /// The table keeps such a page in its slot alone, with no record and no checksum.
    pub(crate) fn identical(f: FrameId) -> Stash {
        Stash {
            blob: Blob::Patch {
                codec: PatchCodec::RunDiff,
                reference: f,
            },
            home: BlobHome::Store,
            offset: 0,
            len: 0,
            checksum: None,
        }
    }

    /// The frame this stash is the identical patch against ([`Stash::identical`], with
    /// or without a checksum, at any offset); `None` for any other blob.
    pub(crate) fn identical_to(&self) -> Option<FrameId> {
        match (self.blob, self.home, self.len) {
            (
                Blob::Patch {
                    codec: PatchCodec::RunDiff,
                    reference,
                },
                BlobHome::Store,
                0,
            ) => Some(reference),
            _ => None,
        }
    }
}

/// `gfn + k`.
pub(crate) fn plus(gfn: Gfn, k: usize) -> Gfn {
    Gfn(gfn.0 + k as u32)
}

mod slot;
pub(crate) use slot::{keeps_offset, BLOB_ALIGN, MAX_BLOB_OFFSET, MAX_FRAME};
use slot::{Packed, Record, Slot};

/// Free stash records below which [`Pages`] does not compact its table (a pass over every
/// slot is not worth less).
const COMPACT_MIN: usize = 4096;

/// Stash records the table grows by at least (32 KiB of them).
const GROW_MIN: usize = 1024;

/// Room for one more element of `v`, grown by an eighth of its length (at least
/// [`GROW_MIN`]), not doubled as `Vec::push` would: the stash table of a guest with
/// 300 000 stored pages would otherwise hold up to 9.6 MB it does not use (issue 19:
/// metadata against ESX's 0.5%). The copy is amortised over an eighth of the table's
/// pushes, on the request path (a stash), never on a fault's.
fn room_for_one<T>(v: &mut Vec<T>) {
    if v.len() == v.capacity() {
        v.reserve_exact((v.len() / 8).max(GROW_MIN));
    }
}

/// Every guest page's home, its R and M bits since its clock slice was last armed, and
/// its watch bit (bit `g % 64` of word `g / 64`).
pub(crate) struct Pages {
    homes: Vec<Packed>,
    /// The blob records of stashed pages, by [`Slot::Stashed`] index; entries listed in
    /// `free` belong to no page. Identical stashes ([`Slot::Identical`]) have none.
    stashes: Vec<Record>,
    /// Free entries of `stashes`.
    free: Vec<u32>,
    referenced: Vec<u64>,
    modified: Vec<u64>,
    /// Watch bits (issue 17's free-page discard): set by [`Pages::watch`] on a private
    /// page just write-protected, or on a page on a frame or stashed; cleared by a write
    /// ([`Pages::mark`]), by any change of the page's home ([`Pages::set`]) and by the
    /// agent lifting the protection ([`Pages::unwatch`]). The invariant the discard
    /// keeps: *a page whose bit is set has been write-protected, and written by no one,
    /// since it was watched*.
    watched: Vec<u64>,
    /// Zapped bits (the clock's `pagemap` mode, `ClockRBits::Pagemap`): the clock dropped
    /// the page's PTE when it last armed it, and its home has not changed since. Only for
    /// such a page does a present PTE at the next scan mean "referenced": any other was
    /// mapped by the agent itself (a decode, a CoW break, a pool frame).
    zapped: Vec<u64>,
    /// Paged-out bits (issue 15's zswap backing, `pageout.rs`): the agent sent the
    /// private page to the kernel's swap and has not yet seen it in RAM again. Cleared by
    /// any change of home, and when a scan finds the page resident.
    paged_out: Vec<u64>,
}

impl Pages {
    /// `pages` private pages, never armed: treated as recently modified (R and M set, as
    /// the engine's `PageClock::FRESH`).
    ///
    /// Panics: `pages` is 2^29 or more (2 TiB; a stash index would not pack).
    pub(crate) fn new(pages: usize) -> Pages {
        assert!(pages < MAX_FRAME as usize, "a region of {pages} pages");
        Pages {
            homes: vec![Packed::PRIVATE; pages],
            stashes: Vec::new(),
            free: Vec::new(),
            referenced: vec![u64::MAX; pages.div_ceil(64)],
            modified: vec![u64::MAX; pages.div_ceil(64)],
            watched: vec![0; pages.div_ceil(64)],
            zapped: vec![0; pages.div_ceil(64)],
            paged_out: vec![0; pages.div_ceil(64)],
        }
    }

    /// Pages of guest RAM.
    pub(crate) fn len(&self) -> u32 {
        self.homes.len() as u32
    }

    /// Where page `gfn` lives.
    ///
    /// Panics: `gfn` is beyond guest RAM (callers check faults against the RAM's range).
    pub(crate) fn home(&self, gfn: Gfn) -> PageHome {
        self.unpack(self.homes[gfn.index()].get())
    }

    /// Where page `gfn` lives; `None` beyond guest RAM.
    pub(crate) fn get(&self, gfn: Gfn) -> Option<PageHome> {
        self.homes.get(gfn.index()).map(|&s| self.unpack(s.get()))
    }

    /// The home a slot stands for.
    fn unpack(&self, s: Slot) -> PageHome {
        match s {
            Slot::Private => PageHome::Private,
            Slot::Zero => PageHome::Zero,
            Slot::Frame(f) => PageHome::Frame(f),
            Slot::Stashed(i) => PageHome::Stashed(self.stashes[i as usize].stash()),
            Slot::Identical(f) => PageHome::Stashed(Stash::identical(f)),
        }
    }

    /// The run of page `gfn` (on `frame`): the most pages around it on consecutive
    /// frames (page `gfn + k` on frame `frame + k`), as (first page, its frame, pages). A
    /// pool mapping maps consecutive frames over consecutive pages, so the run is a union
    /// of whole mappings.
    ///
    /// Panics: `gfn` is not on `frame`.
    pub(crate) fn frame_run(&self, gfn: Gfn, frame: FrameId) -> (Gfn, FrameId, usize) {
        assert_eq!(
            self.home(gfn),
            PageHome::Frame(frame),
            "{gfn} not on {frame}"
        );
        let on = |g: u32, f: u32| self.homes[g as usize].get() == Slot::Frame(FrameId(f));
        let mut first = gfn.0;
        while first > 0 {
            // Page `first − 1` continues the run if it is on frame `frame − back`.
            let back = gfn.0 - first + 1;
            if back > frame.0 || !on(first - 1, frame.0 - back) {
                break;
            }
            first -= 1;
        }
        let mut end = gfn.0 + 1;
        while end < self.len() && on(end, frame.0 + (end - gfn.0)) {
            end += 1;
        }
        (
            Gfn(first),
            FrameId(frame.0 - (gfn.0 - first)),
            (end - first) as usize,
        )
    }

    /// Whether `gfn` is a page of guest RAM, private.
    pub(crate) fn is_private(&self, gfn: Gfn) -> bool {
        self.get(gfn) == Some(PageHome::Private)
    }

    /// Records that page `gfn` now lives at `home`. A stash that is the identical patch
    /// against a frame below [`MAX_FRAME`] ([`Stash::identical_to`]) is kept as that frame
    /// alone, its checksum dropped: it reads back as [`Stash::identical`].
    ///
    /// Panics: another stash without a checksum.
    pub(crate) fn set(&mut self, gfn: Gfn, home: PageHome) {
        let old = self.homes[gfn.index()].get();
        let identical = match home {
            PageHome::Stashed(s) => s.identical_to().filter(|f| f.0 < MAX_FRAME),
            _ => None,
        };
        let slot = match (old, home, identical) {
            (_, _, Some(f)) => Slot::Identical(f),
            // A stashed page stashed anew (a move to the swap file) keeps its entry.
            (Slot::Stashed(i), PageHome::Stashed(s), None) => {
                self.stashes[i as usize] = Record::new(s);
                old
            }
            (_, PageHome::Stashed(s), None) => match self.free.pop() {
                Some(i) => {
                    self.stashes[i as usize] = Record::new(s);
                    Slot::Stashed(i)
                }
                None => {
                    room_for_one(&mut self.stashes);
                    self.stashes.push(Record::new(s));
                    Slot::Stashed(self.stashes.len() as u32 - 1)
                }
            },
            (_, PageHome::Private, _) => Slot::Private,
            (_, PageHome::Zero, _) => Slot::Zero,
            (_, PageHome::Frame(f), _) => Slot::Frame(f),
        };
        // The record of a page that needs it no more (not stashed, or identical now).
        let freed = match (old, slot) {
            (Slot::Stashed(i), s) if !matches!(s, Slot::Stashed(_)) => Some(i),
            _ => None,
        };
        if let Some(i) = freed {
            room_for_one(&mut self.free);
            self.free.push(i);
            if self.free.len() == self.stashes.len() {
                // No page stashed: the records' memory goes back too.
                self.stashes = Vec::new();
                self.free = Vec::new();
            }
        }
        self.homes[gfn.index()] = Packed::new(slot);
        if freed.is_some()
            && self.free.len() >= COMPACT_MIN
            && self.free.len() * 4 > self.stashes.len()
        {
            self.compact();
        }
        self.unwatch(gfn, 1);
        self.zapped[gfn.index() / 64] &= !(1 << (gfn.0 % 64));
        self.paged_out[gfn.index() / 64] &= !(1 << (gfn.0 % 64));
    }

    /// Records that private page `gfn` left RAM for the kernel's swap.
    pub(crate) fn paged_out(&mut self, gfn: Gfn) {
        debug_assert!(self.is_private(gfn));
        self.paged_out[gfn.index() / 64] |= 1 << (gfn.0 % 64);
    }

    /// Forgets every page's paged-out mark (a re-attach: the new memfoldd did not page
    /// them out).
    pub(crate) fn forget_paged_out(&mut self) {
        self.paged_out.fill(0);
    }

    /// Whether page `gfn` was paged out and not yet seen in RAM again.
    pub(crate) fn is_paged_out(&self, gfn: Gfn) -> bool {
        self.paged_out
            .get(gfn.index() / 64)
            .is_some_and(|w| w >> (gfn.0 % 64) & 1 == 1)
    }

    /// Clears page `gfn`'s paged-out bit: it is in RAM again.
    pub(crate) fn paged_in(&mut self, gfn: Gfn) {
        self.paged_out[gfn.index() / 64] &= !(1 << (gfn.0 % 64));
    }

    /// Whether any page of `[first, first+n)` (in RAM) is paged out.
    /// A word of 64 pages at a time, masked at the range's two ends (a QEMU discard
    /// covers 512 pages or more).
    pub(crate) fn any_paged_out(&self, first: Gfn, n: u32) -> bool {
        let end = first.0.saturating_add(n).min(self.len());
        let mut g = first.0;
        while g < end {
            let (word, bit) = (g as usize / 64, g % 64);
            let upto = (end - (g - bit)).min(64);
            // Bits [bit, upto) of this word lie in the range.
            let mask = (u64::MAX >> (64 - upto)) & (u64::MAX << bit);
            if self.paged_out[word] & mask != 0 {
                return true;
            }
            g += upto - bit;
        }
        false
    }

    /// The paged-out pages of `[first, first+n)` (in RAM) as spans (first page, pages),
    /// ascending: each span begins and ends on a paged-out page, and two spans are apart
    /// only where more than `gap` pages between them are not paged out. Empty if none is.
    pub(crate) fn paged_out_spans(&self, first: Gfn, n: u32, gap: u32) -> Vec<(Gfn, u32)> {
        let end = first.0.saturating_add(n).min(self.len());
        let mut spans: Vec<(Gfn, u32)> = Vec::new();
        let mut g = first.0;
        while g < end {
            // A word with no page out is passed whole.
            if g % 64 == 0 && self.paged_out[g as usize / 64] == 0 {
                g += 64;
                continue;
            }
            if self.is_paged_out(Gfn(g)) {
                match spans.last_mut() {
                    Some((s, len)) if g - (s.0 + *len) <= gap => *len = g - s.0 + 1,
                    _ => spans.push((Gfn(g), 1)),
                }
            }
            g += 1;
        }
        spans
    }

    /// Renumbers the stash records of stashed pages densely and gives back the rest
    /// (issue 19: after a burst of stores taken back, the table kept its peak — 6.8 MB
    /// against 3.4 in two runs of one 2 GiB guest that differed by an early burst of
    /// ~53 000 pages shared without a mapping). Indexes never leave [`Pages`], so
    /// renumbering under `&mut self` is invisible to every reader. One pass over every
    /// guest page's slot, on whichever agent thread freed the record (a decode's
    /// included: its vCPU is already woken); run when over a quarter of the records are
    /// free and at least [`COMPACT_MIN`], so at most once per a third as many frees as
    /// there are records left (over half until 2026-11-28: a table could sit at twice
    /// what it holds). Identical stashes hold no index and are left as they are.
    fn compact(&mut self) {
        let mut stashes = Vec::with_capacity(self.stashes.len() - self.free.len());
        for h in &mut self.homes {
            if let Slot::Stashed(i) = h.get() {
                *h = Packed::new(Slot::Stashed(stashes.len() as u32));
                stashes.push(self.stashes[i as usize]);
            }
        }
        self.stashes = stashes;
        self.free = Vec::new();
    }

    /// Clears the zapped bit of page `gfn`: the agent itself made it present (a zero fill
    /// of a hole, with its R already set), which is no minor fault to count at the next
    /// scan.
    pub(crate) fn unzap(&mut self, gfn: Gfn) {
        self.zapped[gfn.index() / 64] &= !(1 << (gfn.0 % 64));
    }

    /// Every zapped page of `[first, first+n)` (in RAM) counts as referenced and is zapped
    /// no longer: what the clock assumes when it cannot read the page tables (no page is
    /// then thought idle for want of a reading).
    pub(crate) fn all_zapped_referenced(&mut self, first: Gfn, n: u64) {
        for g in first.index()..(first.index() + n as usize).min(self.homes.len()) {
            let (w, b) = (g / 64, 1u64 << (g % 64));
            if self.zapped[w] & b != 0 {
                self.referenced[w] |= b;
                self.zapped[w] &= !b;
            }
        }
    }

    /// Records that the clock dropped the PTEs of private pages `[first, first+n)` (in
    /// RAM): in the `pagemap` mode a present PTE there at the next scan is an access.
    pub(crate) fn zapped(&mut self, first: Gfn, n: u64) {
        for g in first.index()..(first.index() + n as usize).min(self.homes.len()) {
            self.zapped[g / 64] |= 1 << (g % 64);
        }
    }

    /// The page tables show page `gfn` present: R, if the clock zapped it and its home
    /// has not changed since (else the PTE is no access of the guest's); it is zapped no
    /// longer. A zapped page not yet present stays zapped, armed until its first access,
    /// as its PTE stays dropped in the `userfault` mode.
    /// Returns whether it was zapped: one first access since the clock armed it, the
    /// kernel's own minor fault.
    pub(crate) fn present(&mut self, gfn: Gfn) -> bool {
        let (w, b) = (gfn.index() / 64, 1u64 << (gfn.0 % 64));
        let zapped = self.zapped[w] & b != 0;
        if zapped {
            self.referenced[w] |= b;
            self.zapped[w] &= !b;
        }
        zapped
    }

    /// Sets the watch bit of page `gfn`: a private page the caller has just
    /// write-protected, or one on a pool frame or stashed (any write to those faults).
    pub(crate) fn watch(&mut self, gfn: Gfn) {
        debug_assert!(!matches!(self.get(gfn), Some(PageHome::Zero) | None));
        self.watched[gfn.index() / 64] |= 1 << (gfn.0 % 64);
    }

    /// Whether page `gfn` has been write-protected and unwritten since it was watched.
    pub(crate) fn watched(&self, gfn: Gfn) -> bool {
        self.watched[gfn.index() / 64] >> (gfn.0 % 64) & 1 == 1
    }

    /// Clears the watch bits of pages `[first, first+n)` (in RAM): their protection is
    /// lifted, or they changed.
    pub(crate) fn unwatch(&mut self, first: Gfn, n: u64) {
        for g in first.index()..(first.index() + n as usize).min(self.homes.len()) {
            self.watched[g / 64] &= !(1 << (g % 64));
        }
    }

    /// Sets the M bits of the private pages of `[first, first+n)`: writes to them may go
    /// unseen. Pages that left RAM meanwhile (zero, stashed) keep theirs: one read back
    /// was not written.
    pub(crate) fn mark_modified(&mut self, first: Gfn, n: u64) {
        for g in first.index()..(first.index() + n as usize).min(self.homes.len()) {
            if self.is_private(Gfn(g as u32)) {
                self.modified[g / 64] |= 1 << (g % 64);
            }
        }
    }

    /// Bytes this record holds: its page homes, stash records and R/M bitmaps, as
    /// allocated (an identical stash costs nothing beyond its page's slot).
    pub(crate) fn state_bytes(&self) -> u64 {
        (self.homes.capacity() * std::mem::size_of::<Packed>()
            + self.stashes.capacity() * std::mem::size_of::<Record>()
            + self.free.capacity() * 4
            + (self.referenced.capacity()
                + self.modified.capacity()
                + self.watched.capacity()
                + self.zapped.capacity())
                * 8) as u64
    }

    /// Pages of this region mapped onto pool frames now.
    #[cfg(test)]
    pub(crate) fn on_frames(&self) -> usize {
        self.homes
            .iter()
            .filter(|s| matches!(s.get(), Slot::Frame(_)))
            .count()
    }

    /// Sets R (and M for a write) of `gfn`.
    pub(crate) fn mark(&mut self, gfn: Gfn, write: bool) {
        let (w, b) = (gfn.index() / 64, 1u64 << (gfn.0 % 64));
        self.referenced[w] |= b;
        if write {
            self.modified[w] |= b;
            self.watched[w] &= !b;
        }
    }

    /// Takes the R and M bits of pages `[first, first+n)` (in RAM), clearing them.
    /// Returns (R bits, M bits): bit k of word k/64 for gfn `first + k`.
    pub(crate) fn take_bits(&mut self, first: Gfn, n: u32) -> (Vec<u64>, Vec<u64>) {
        let mut r = vec![0u64; (n as usize).div_ceil(64)];
        let mut m = r.clone();
        for k in 0..n {
            let g = first.index() + k as usize;
            let (w, b) = (g / 64, 1u64 << (g % 64));
            let out = 1u64 << (k % 64);
            if self.referenced[w] & b != 0 {
                r[k as usize / 64] |= out;
            }
            if self.modified[w] & b != 0 {
                m[k as usize / 64] |= out;
            }
            self.referenced[w] &= !b;
            self.modified[w] &= !b;
        }
        (r, m)
    }

    /// The re-attach list: every page mapped onto a pool frame or reclaimed, in gfn order.
    /// Stashed pages are not in it: the agent brings them home before it re-attaches.
    pub(crate) fn reattach_list(&self) -> Vec<(Gfn, Mapped)> {
        self.homes
            .iter()
            .enumerate()
            .filter_map(|(g, h)| {
                let m = match h.get() {
                    Slot::Private => return None,
                    Slot::Zero => Mapped::ReclaimedZero,
                    Slot::Frame(f) => Mapped::Frame(f),
                    Slot::Stashed(_) | Slot::Identical(_) => {
                        debug_assert!(false, "stashed pages are restored before a re-attach");
                        return None;
                    }
                };
                Some((Gfn(g as u32), m))
            })
            .collect()
    }

    /// The stashed pages (identical ones too) and their blobs, in gfn order.
    pub(crate) fn stashed(&self) -> Vec<(Gfn, Stash)> {
        self.homes
            .iter()
            .enumerate()
            .filter_map(|(g, h)| {
                let s = match h.get() {
                    Slot::Stashed(i) => self.stashes[i as usize].stash(),
                    Slot::Identical(f) => Stash::identical(f),
                    _ => return None,
                };
                Some((Gfn(g as u32), s))
            })
            .collect()
    }
}

#[cfg(test)]
mod tests;
