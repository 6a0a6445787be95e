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

/// A stash record as the table keeps it: a [`Stash`] whose checksum is known (32 bytes;
/// `Option<u64>` would take 40).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Record {
    blob: Blob,
    home: BlobHome,
    offset: u64,
    len: u32,
    checksum: u64,
}

impl Record {
    /// `s` as a record. Panics: `s` has no checksum (only the identical patch read back
    /// from the table has none, and that is never kept as a record).
    fn new(s: Stash) -> Record {
        Record {
            blob: s.blob,
            home: s.home,
            offset: s.offset,
            len: s.len,
            checksum: s.checksum.expect("a stash record without a checksum"),
        }
    }

    /// The record as the stash it keeps.
    fn stash(self) -> Stash {
        Stash {
            blob: self.blob,
            home: self.home,
            offset: self.offset,
            len: self.len,
            checksum: Some(self.checksum),
        }
    }
}

/// `gfn + k`.
pub(crate) fn plus(gfn: Gfn, k: usize) -> Gfn {
    Gfn(gfn.0 + k as u32)
}

/// A page's home as the table reads it; kept packed in 4 bytes ([`Packed`]), a stashed
/// page's blob record apart ([`Pages`]' `stashes`), since most pages have none (issue 19:
/// the agent's records were a 32-byte [`PageHome`] a page, 0.78% of guest RAM; 8 bytes
/// as this enum; 4 packed: 0.1%).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Slot {
    Private,
    Zero,
    Frame(FrameId),
    /// Index into `stashes`.
    Stashed(u32),
    /// Stashed as the identical patch against this frame ([`Stash::identical`]), with no
    /// record: memfoldd's share without a mapping, ~200 000 pages of an 8 GiB guest, each
    /// 32 bytes of record before (issue 19).
    Identical(FrameId),
}

/// Frames and stash indexes a [`Packed`] slot holds: below 2^29 (a pool of 2 TiB; a
/// region of 2 TiB). The agent refuses shares onto frames past it, and keeps a record
/// for an identical stash against one.
pub(crate) const MAX_FRAME: u32 = 1 << 29;

/// Bits of a [`Packed`] slot below its kind.
const KIND_SHIFT: u32 = MAX_FRAME.trailing_zeros();

/// A [`Slot`] in 4 bytes: a 3-bit kind over a 29-bit frame or stash index.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Packed(u32);

impl Packed {
    const PRIVATE: Packed = Packed(0);

    /// Packs `s`. Panics: a frame or index of 2^29 or more (callers refuse such frames,
    /// and no region has that many pages).
    fn new(s: Slot) -> Packed {
        let (kind, x) = match s {
            Slot::Private => (0, 0),
            Slot::Zero => (1, 0),
            Slot::Frame(f) => (2, f.0),
            Slot::Stashed(i) => (3, i),
            Slot::Identical(f) => (4, f.0),
        };
        assert!(x < MAX_FRAME, "{s:?} does not pack");
        Packed(kind << KIND_SHIFT | x)
    }

    fn get(self) -> Slot {
        let x = self.0 & (MAX_FRAME - 1);
        match self.0 >> KIND_SHIFT {
            0 => Slot::Private,
            1 => Slot::Zero,
            2 => Slot::Frame(FrameId(x)),
            3 => Slot::Stashed(x),
            _ => Slot::Identical(FrameId(x)),
        }
    }
}

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
    /// frames (page `gfn + k` on frame `frame + k`), as (first page, pages). A pool
    /// mapping maps consecutive frames over consecutive pages, so the run is a union of
    /// whole mappings.
    ///
    /// Panics: `gfn` is not on `frame`.
    pub(crate) fn frame_run(&self, gfn: Gfn, frame: FrameId) -> (Gfn, usize) {
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
        (Gfn(first), (end - first) as usize)
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
    pub(crate) fn any_paged_out(&self, first: Gfn, n: u32) -> bool {
        (first.0..(first.0 + n).min(self.len())).any(|g| self.is_paged_out(Gfn(g)))
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
mod tests {
    use super::*;
    use memfold_codecs::PatchCodec;

    #[test]
    fn a_page_record_stays_small() {
        // One per guest page: 4 bytes, 0.1% of guest RAM, and 4 bits (R, M, watch,
        // zapped); a stashed page's 32 more (none for an identical one).
        assert_eq!(std::mem::size_of::<Packed>(), 4);
        assert!(std::mem::size_of::<Record>() <= 32);
        let mut p = Pages::new(1024);
        assert_eq!(p.state_bytes(), 1024 * 4 + 4 * 16 * 8, "no page stashed");
        p.set(Gfn(3), PageHome::Stashed(stash(3)));
        assert!(p.state_bytes() > 1024 * 4 + 4 * 16 * 8);
        p.set(Gfn(3), PageHome::Private);
        assert_eq!(p.state_bytes(), 1024 * 4 + 4 * 16 * 8, "given back");
    }

    fn stash(k: u64) -> Stash {
        Stash {
            blob: Blob::Compressed(memfold_codecs::CompressCodec::Zstd),
            home: if k % 3 == 0 {
                BlobHome::Swap
            } else {
                BlobHome::Store
            },
            offset: 64 * k,
            len: 100 + k as u32,
            checksum: Some(k.wrapping_mul(0x9e37_79b9_7f4a_7c15)),
        }
    }

    /// Frame `f`'s identical patch as a stash request brings it: with a checksum, at
    /// some offset in the store.
    fn requested_identical(f: u32, k: u64) -> Stash {
        Stash {
            offset: 4096 * k,
            checksum: Some(k ^ 0x5555),
            ..Stash::identical(FrameId(f))
        }
    }

    /// The packed table reads back exactly what a plain one would, through any sequence
    /// of homes (stash entries reused, moved, freed and given back).
    #[test]
    fn the_packed_table_agrees_with_a_plain_one() {
        let mut p = Pages::new(64);
        let mut plain = vec![PageHome::Private; 64];
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for step in 0..20_000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let g = (x % 64) as usize;
            let f = (x >> 16) as u32 % MAX_FRAME;
            let (home, reads) = match (x >> 8) % 5 {
                0 => (PageHome::Private, PageHome::Private),
                1 => (PageHome::Zero, PageHome::Zero),
                // Frames up to the largest that packs.
                2 => (PageHome::Frame(FrameId(f)), PageHome::Frame(FrameId(f))),
                3 => (
                    PageHome::Stashed(stash(step)),
                    PageHome::Stashed(stash(step)),
                ),
                // Read back without its offset and checksum.
                _ => (
                    PageHome::Stashed(requested_identical(f, step)),
                    PageHome::Stashed(Stash::identical(FrameId(f))),
                ),
            };
            p.set(Gfn(g as u32), home);
            plain[g] = reads;
            if step % 97 == 0 {
                for (k, h) in plain.iter().enumerate() {
                    assert_eq!(p.home(Gfn(k as u32)), *h, "page {k} at step {step}");
                }
                let frames = plain
                    .iter()
                    .filter(|h| matches!(h, PageHome::Frame(_)))
                    .count();
                assert_eq!(p.on_frames(), frames);
                let stashed: Vec<(Gfn, Stash)> = plain
                    .iter()
                    .enumerate()
                    .filter_map(|(k, h)| match h {
                        PageHome::Stashed(s) => Some((Gfn(k as u32), *s)),
                        _ => None,
                    })
                    .collect();
                assert_eq!(p.stashed(), stashed);
                let recorded = stashed.iter().filter(|(_, s)| s.checksum.is_some());
                assert_eq!(
                    p.stashes.len() - p.free.len(),
                    recorded.count(),
                    "no entry leaks"
                );
            }
        }
    }

    /// A burst of stores taken back leaves the table at what is still stashed, not at its
    /// peak, and every page reads back its own record (without the compaction, 20 000
    /// records stay).
    #[test]
    fn records_freed_in_bulk_are_given_back_and_the_rest_renumbered() {
        let n = 20_000u32;
        let mut p = Pages::new(n as usize);
        for g in 0..n {
            p.set(Gfn(g), PageHome::Stashed(stash(g as u64)));
        }
        for g in (0..n).filter(|g| g % 10 != 0) {
            p.set(Gfn(g), PageHome::Private);
        }
        // At most COMPACT_MIN free records beyond those in use (or a third as many).
        let used = n as usize / 10;
        assert!(
            p.stashes.len() <= used + COMPACT_MIN.max(used / 3),
            "{} records",
            p.stashes.len()
        );
        assert_eq!(p.stashes.len() - p.free.len(), used);
        for g in 0..n {
            let want = if g % 10 == 0 {
                PageHome::Stashed(stash(g as u64))
            } else {
                PageHome::Private
            };
            assert_eq!(p.home(Gfn(g)), want, "page {g}");
        }
        // Reused after the compaction: still each page's own.
        p.set(Gfn(1), PageHome::Stashed(stash(7)));
        p.set(Gfn(10), PageHome::Zero);
        assert_eq!(p.home(Gfn(1)), PageHome::Stashed(stash(7)));
        assert_eq!(p.home(Gfn(20)), PageHome::Stashed(stash(20)));
    }

    /// A page stashed as the identical patch takes no record: 512 of them leave the
    /// table and `state_bytes` as they were (a record each would be 16 KiB), each reads
    /// back as its frame's identical patch (no checksum, offset 0), and a record taken
    /// for another blob is given back when the page becomes identical again. The same
    /// patch in the swap file, or not empty, or of another codec, is no identical one.
    #[test]
    fn an_identical_stash_takes_no_record_and_reads_back_as_its_frame() {
        let mut p = Pages::new(1024);
        let empty = p.state_bytes();
        for g in 0..512u32 {
            p.set(
                Gfn(g),
                PageHome::Stashed(requested_identical(g * 3, g as u64)),
            );
        }
        assert_eq!(p.state_bytes(), empty, "no record an identical page");
        assert!(p.stashes.is_empty() && p.free.is_empty());
        for g in 0..512u32 {
            let want = Stash::identical(FrameId(g * 3));
            assert_eq!(p.home(Gfn(g)), PageHome::Stashed(want), "page {g}");
            assert_eq!(p.get(Gfn(g)), Some(PageHome::Stashed(want)));
            // Read back, set again: the same home.
            p.set(Gfn(g), p.home(Gfn(g)));
            assert_eq!(p.home(Gfn(g)), PageHome::Stashed(want));
        }
        assert_eq!(p.stashed().len(), 512, "identical pages are stashed pages");
        assert_eq!(p.stashed()[7], (Gfn(7), Stash::identical(FrameId(21))));
        // Moved to a blob with a record, and back: the record is given back.
        p.set(Gfn(5), PageHome::Stashed(stash(5)));
        assert_eq!(p.home(Gfn(5)), PageHome::Stashed(stash(5)));
        assert_eq!(p.stashes.len() - p.free.len(), 1);
        p.set(Gfn(5), PageHome::Stashed(requested_identical(9, 1)));
        assert_eq!(
            p.home(Gfn(5)),
            PageHome::Stashed(Stash::identical(FrameId(9)))
        );
        assert!(p.stashes.is_empty(), "given back");
        assert_eq!(p.state_bytes(), empty);
        p.set(Gfn(6), PageHome::Private);
        assert_eq!(p.home(Gfn(6)), PageHome::Private);
        // Not the identical form: each keeps a record and its checksum.
        let near = [
            Stash {
                home: BlobHome::Swap,
                ..requested_identical(4, 1)
            },
            Stash {
                len: 1,
                ..requested_identical(4, 2)
            },
            Stash {
                blob: Blob::Patch {
                    codec: PatchCodec::XorLz4,
                    reference: FrameId(4),
                },
                ..requested_identical(4, 3)
            },
        ];
        for (k, s) in near.into_iter().enumerate() {
            p.set(Gfn(600 + k as u32), PageHome::Stashed(s));
            assert_eq!(p.home(Gfn(600 + k as u32)), PageHome::Stashed(s));
        }
        assert_eq!(p.stashes.len() - p.free.len(), 3);
    }

    /// Slots hold frames and indexes below 2^29: 2^29 − 1 packs and reads back in every
    /// kind, 2^29 does not pack; an identical stash against a frame past it keeps a
    /// record (with its checksum) rather than fail.
    #[test]
    fn a_frame_of_2_pow_29_minus_1_packs_and_2_pow_29_does_not() {
        assert_eq!(MAX_FRAME, 1 << 29);
        let top = (1 << 29) - 1;
        for s in [
            Slot::Private,
            Slot::Zero,
            Slot::Frame(FrameId(top)),
            Slot::Stashed(top),
            Slot::Identical(FrameId(top)),
            Slot::Frame(FrameId(0)),
            Slot::Stashed(0),
            Slot::Identical(FrameId(0)),
        ] {
            assert_eq!(Packed::new(s).get(), s);
        }
        for s in [
            Slot::Frame(FrameId(1 << 29)),
            Slot::Stashed(1 << 29),
            Slot::Identical(FrameId(1 << 29)),
        ] {
            assert!(
                std::panic::catch_unwind(|| Packed::new(s)).is_err(),
                "{s:?} packed"
            );
        }
        let mut p = Pages::new(4);
        p.set(Gfn(0), PageHome::Stashed(requested_identical(top, 1)));
        assert_eq!(
            p.home(Gfn(0)),
            PageHome::Stashed(Stash::identical(FrameId(top)))
        );
        let past = requested_identical(1 << 29, 2);
        p.set(Gfn(1), PageHome::Stashed(past));
        assert_eq!(p.home(Gfn(1)), PageHome::Stashed(past), "kept as a record");
        assert_eq!(p.stashes.len(), 1);
    }

    /// Compaction renumbers the records of stashed pages and leaves identical ones (no
    /// index) alone: with the two interleaved, every page keeps its home through it.
    #[test]
    fn compaction_keeps_every_home_with_identical_stashes_interleaved() {
        let n = 20_000u32;
        let mut p = Pages::new(n as usize);
        // Page g: identical against frame 7g + 1 when g % 3 == 0, else a record.
        let want = |g: u32, freed: bool| {
            if g % 3 == 0 {
                PageHome::Stashed(Stash::identical(FrameId(7 * g + 1)))
            } else if freed && g % 10 != 1 {
                PageHome::Private
            } else {
                PageHome::Stashed(stash(g as u64))
            }
        };
        for g in 0..n {
            let s = if g % 3 == 0 {
                requested_identical(7 * g + 1, g as u64)
            } else {
                stash(g as u64)
            };
            p.set(Gfn(g), PageHome::Stashed(s));
        }
        let records = p.stashes.len();
        assert_eq!(records as u32, n - n.div_ceil(3));
        for g in (0..n).filter(|g| g % 3 != 0 && g % 10 != 1) {
            p.set(Gfn(g), PageHome::Private);
        }
        let kept = (0..n).filter(|g| g % 3 != 0 && g % 10 == 1).count();
        assert_eq!(p.stashes.len() - p.free.len(), kept);
        assert!(
            p.stashes.len() < records / 2,
            "compacted: {}",
            p.stashes.len()
        );
        for g in 0..n {
            assert_eq!(p.home(Gfn(g)), want(g, true), "page {g}");
        }
        // Records reused after it: still each page's own.
        p.set(Gfn(2), PageHome::Stashed(stash(99)));
        p.set(Gfn(3), PageHome::Stashed(stash(98)));
        assert_eq!(p.home(Gfn(2)), PageHome::Stashed(stash(99)));
        assert_eq!(p.home(Gfn(3)), PageHome::Stashed(stash(98)));
        assert_eq!(p.home(Gfn(6)), want(6, true));
        assert_eq!(p.home(Gfn(11)), want(11, true));
    }

    /// The stash table grows by an eighth (at least GROW_MIN records), not by doubling:
    /// 300 000 records take at most ~340 000 slots (a doubled Vec: 524 288).
    #[test]
    fn the_stash_table_grows_by_an_eighth() {
        let n = 300_000u32;
        let mut p = Pages::new(n as usize);
        for g in 0..n {
            p.set(Gfn(g), PageHome::Stashed(stash(g as u64)));
            let (len, cap) = (p.stashes.len(), p.stashes.capacity());
            assert!(
                cap <= len + (len / 8).max(GROW_MIN),
                "{len} records in {cap} slots"
            );
        }
        assert_eq!(p.home(Gfn(n - 1)), PageHome::Stashed(stash(n as u64 - 1)));
    }

    #[test]
    fn pages_start_private_and_fresh_and_bits_are_taken_once() {
        let mut p = Pages::new(130);
        assert_eq!(p.len(), 130);
        assert!(p.is_private(Gfn(129)));
        assert!(!p.is_private(Gfn(130)), "beyond RAM");
        assert_eq!(p.get(Gfn(130)), None);
        // Never armed: R and M set.
        let (r, m) = p.take_bits(Gfn(60), 70);
        assert_eq!((r.len(), m.len()), (2, 2));
        assert_eq!((r[0], r[1]), (u64::MAX, (1 << 6) - 1));
        assert_eq!(m, r);
        assert_eq!(p.take_bits(Gfn(60), 70), (vec![0, 0], vec![0, 0]));
        p.mark(Gfn(61), false);
        p.mark(Gfn(129), true);
        let (r, m) = p.take_bits(Gfn(60), 70);
        assert_eq!(r, vec![0b10, 1 << 5]);
        assert_eq!(m, vec![0, 1 << 5]);
    }

    #[test]
    fn a_watch_ends_at_a_write_a_new_home_or_lifted_protection_and_a_read_keeps_it() {
        let mut p = Pages::new(200);
        for g in [3, 64, 130, 131, 199] {
            p.watch(Gfn(g));
        }
        p.mark(Gfn(3), false);
        assert!(p.watched(Gfn(3)), "a read is no write");
        p.mark(Gfn(3), true);
        assert!(!p.watched(Gfn(3)), "a write ends it");
        p.set(Gfn(64), PageHome::Zero);
        p.set(Gfn(64), PageHome::Private);
        assert!(!p.watched(Gfn(64)), "a new home ends it");
        p.unwatch(Gfn(130), 1);
        assert!(!p.watched(Gfn(130)) && p.watched(Gfn(131)));
        p.unwatch(Gfn(190), 50); // clamped to RAM
        assert!(!p.watched(Gfn(199)));
        assert!((0..200).all(|g| !p.watched(Gfn(g)) || g == 131));
    }

    #[test]
    fn the_reattach_list_names_frames_and_zero_pages() {
        let mut p = Pages::new(8);
        p.set(Gfn(1), PageHome::Frame(FrameId(4)));
        p.set(Gfn(1), PageHome::Frame(FrameId(4)));
        p.set(Gfn(2), PageHome::Frame(FrameId(5)));
        p.set(Gfn(2), PageHome::Private);
        assert_eq!(p.on_frames(), 1);
        p.set(Gfn(3), PageHome::Zero);
        let stash = Stash {
            blob: Blob::Patch {
                codec: PatchCodec::XorLz4,
                reference: FrameId(4),
            },
            home: BlobHome::Store,
            offset: 64,
            len: 100,
            checksum: Some(7),
        };
        p.set(Gfn(5), PageHome::Stashed(stash));
        assert_eq!(p.stashed(), vec![(Gfn(5), stash)]);
        p.set(Gfn(5), PageHome::Private);
        assert_eq!(
            p.reattach_list(),
            vec![
                (Gfn(1), Mapped::Frame(FrameId(4))),
                (Gfn(3), Mapped::ReclaimedZero)
            ]
        );
        assert_eq!(plus(Gfn(3), 2), Gfn(5));
    }
}
