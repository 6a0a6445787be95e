//! An agent in memory: carries out the engine's commands on a guest's RAM the way the
//! real agent in QEMU does (`memfold-agent`), for the reference model and `bench micro`.
//!
//! Like the real one it serves the guest's accesses itself from where each page lives —
//! its RAM, a pool frame (copy-on-write on a write), a hole refilled with zeros, a blob
//! decoded back — and reports those as events afterwards; it checks every command against
//! the page's bytes before acting (a page written meanwhile is left alone), and it
//! reads the pool, the store and the swap file through handles of its own. It keeps the
//! R and M bits of the NRU clock for every access.

use crate::backing::mem::{MemBacking, MemGuestRam};
use crate::backing::Backing;
use crate::blobs::{BlobHome, Form};
use crate::engine::{Command, Discard, Mapped, Outcome, Stash};
use crate::ids::{FrameId, Gfn};
use crate::{Page, PAGE_SIZE};
use memfold_codecs::page_checksum;

mod agree;
mod pages;
mod rig;
pub use agree::booked_where_kept;
pub use pages::{every_mechanism_pages, texty};
pub use rig::{anon_report, quick_config, Rig};

/// Where the agent finds a page's bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Home {
    /// In guest RAM.
    Private,
    /// A reclaimed zero page: a hole refilled with zeros on access.
    Zero,
    /// Mapped onto a pool frame, write-protected.
    Frame(FrameId),
    /// Out of RAM as a blob.
    Stashed(Stash),
}

/// What the agent did on its own, reported after the fact.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// A write broke copy-on-write on the page, which left the frame.
    CowBroken(Gfn, FrameId),
    /// An access refilled a reclaimed zero page.
    Refilled(Gfn),
    /// An access decoded a stashed page back.
    Unstashed(Gfn),
    /// The guest's VMM discarded the page, which the agent held as this.
    Discarded(Gfn, Discard),
    /// A page paged out to the kernel's swap is in RAM again (the guest touched it) or
    /// was discarded.
    PagedIn(Gfn),
}

/// The agent's handles on what memfoldd hands it: its domain's pool, its own store and
/// its own swap file.
#[derive(Clone, Default)]
pub struct Shared {
    /// The pool of frames of its domain.
    pub pool: MemBacking,
    /// Its store of blobs.
    pub store: MemBacking,
    /// Its swap file.
    pub swap: MemBacking,
}

/// One guest's agent.
pub struct SimAgent {
    /// The guest's RAM (the engine reads the same).
    pub ram: MemGuestRam,
    /// memfoldd's backings.
    pub shared: Shared,
    home: Vec<Home>,
    referenced: Vec<bool>,
    modified: Vec<bool>,
    tracking: Vec<Tracking>,
    /// Watch bits of the free-page discard: set by a watch, cleared by a write or a new
    /// home (as the real agent's, which also clears them when it lifts a protection).
    watched: Vec<bool>,
    /// Paged out to the kernel's swap ([`Command::PageOut`]), not touched since: the bytes
    /// stay in `ram` (the kernel keeps them; the model needs no copy).
    paged_out: Vec<bool>,
    /// A page on a pool frame whose PTE is present (mapped by the share, or read since
    /// the clock last dropped it, [`Command::ClockScan`]`::zap_shared`); counted in the
    /// pool's [`MemFile::mapped`](crate::backing::mem::MemFile::mapped).
    frame_pte: Vec<bool>,
    /// Events not yet reported.
    pub events: Vec<Event>,
    /// Refuse every command (as at the VMA budget).
    pub refuse: bool,
    /// Most pages on pool frames (the real agent's VMA budget, which charges each page on
    /// a frame): a share past it is refused. `None`: no budget.
    pub frame_budget: Option<usize>,
}

const PAGE: u64 = PAGE_SIZE as u64;

/// What the next access to a private page costs the real agent: the clock's arming
/// (write-protect and zap) makes the first access a fault (R, and M for a write) and a
/// read leaves the page write-protected (a later write: M); then no fault until armed
/// again.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Tracking {
    /// Armed: any access faults.
    Armed,
    /// Read since armed: a write faults.
    ReadOnly,
    /// Neither: accesses are not seen.
    Open,
}

impl SimAgent {
    /// An agent for `ram` of `pages` pages, all private.
    pub fn new(ram: MemGuestRam, pages: u32, shared: Shared) -> Self {
        let n = pages as usize;
        SimAgent {
            ram,
            shared,
            home: vec![Home::Private; n],
            // Never armed: recently modified, as the clock assumes of new pages.
            referenced: vec![true; n],
            modified: vec![true; n],
            tracking: vec![Tracking::Open; n],
            watched: vec![false; n],
            paged_out: vec![false; n],
            frame_pte: vec![false; n],
            events: Vec::new(),
            refuse: false,
            frame_budget: None,
        }
    }

    /// Guest RAM, pages.
    pub fn pages(&self) -> u32 {
        self.home.len() as u32
    }

    /// Where page `g` lives now.
    pub fn home(&self, g: Gfn) -> Home {
        self.home[g.index()]
    }

    /// Page `i` lives at `h` now: its watch ends.
    fn set_home(&mut self, i: usize, h: Home) {
        self.frame_unmapped(i);
        if let Home::Frame(f) = h {
            self.frame_mapped(i, f);
        }
        self.home[i] = h;
        self.watched[i] = false;
        self.paged_out[i] = false;
        self.ram.file().swapped.remove(&(i as u64));
    }

    /// Page `i`'s PTE onto frame `f` present (counted in the pool's mapped pages).
    fn frame_mapped(&mut self, i: usize, f: FrameId) {
        self.frame_pte[i] = true;
        *self
            .shared
            .pool
            .file()
            .mapped
            .entry(f.0 as u64)
            .or_default() += 1;
    }

    /// Page `i`'s PTE onto its frame, if present, dropped.
    fn frame_unmapped(&mut self, i: usize) {
        let Home::Frame(f) = self.home[i] else {
            return;
        };
        if std::mem::take(&mut self.frame_pte[i]) {
            let p = f.0 as u64;
            let mut pool = self.shared.pool.file();
            let n = pool.mapped.get_mut(&p).expect("counted when mapped");
            *n -= 1;
            if *n == 0 {
                pool.mapped.remove(&p);
            }
        }
    }

    /// Its QEMU exits: every PTE onto a pool frame goes with the process (the pool's
    /// [`MemFile::mapped`](crate::backing::mem::MemFile::mapped) counts fall); the pages'
    /// homes stay as they were, for whoever inspects them after.
    pub fn exit(&mut self) {
        for i in 0..self.home.len() {
            self.frame_unmapped(i);
        }
    }

    /// Its pages on pool frames whose PTE is present (each counted once in the pool's
    /// [`MemFile::mapped`](crate::backing::mem::MemFile::mapped)).
    pub fn frame_ptes(&self) -> u64 {
        self.frame_pte.iter().filter(|&&p| p).count() as u64
    }

    /// Whether page `g` is paged out to the kernel's swap and untouched since.
    pub fn is_paged_out(&self, g: Gfn) -> bool {
        self.paged_out[g.index()]
    }

    /// Page `i` is in RAM again (or gone): reported if it was paged out.
    fn page_in(&mut self, i: usize) {
        if std::mem::take(&mut self.paged_out[i]) {
            self.ram.file().swapped.remove(&(i as u64));
            self.events.push(Event::PagedIn(Gfn(i as u32)));
        }
    }

    fn ram_page(&self, g: Gfn) -> Page {
        let f = self.ram.file();
        f.bytes[g.offset() as usize..(g.offset() + PAGE) as usize]
            .try_into()
            .expect("a page")
    }

    fn set_ram_page(&mut self, g: Gfn, page: &Page) {
        let mut f = self.ram.file();
        f.bytes[g.offset() as usize..(g.offset() + PAGE) as usize].copy_from_slice(page);
        f.touch(g.offset(), PAGE);
    }

    fn punch(&mut self, g: Gfn) {
        self.ram.file().punch(g.offset(), PAGE);
    }

    /// Decodes a blob into `out` and checks the page against the blob's checksum.
    ///
    /// Errors: the blob cannot be read, does not decode, or decodes to another page.
    fn decode(&self, s: &Stash, out: &mut Page) -> Result<(), String> {
        let space = match s.home {
            BlobHome::Store => &self.shared.store,
            BlobHome::Swap => &self.shared.swap,
        };
        let mut blob = vec![0u8; s.len as usize];
        space.read(s.offset, &mut blob).map_err(|e| e.to_string())?;
        match s.form {
            Form::Raw => {
                *out = blob
                    .as_slice()
                    .try_into()
                    .map_err(|_| "raw blob is not a page")?;
            }
            Form::Encoded(e) => {
                let mut reference = [0u8; PAGE_SIZE];
                if let Some(f) = s.reference {
                    self.shared
                        .pool
                        .read(f.offset(), &mut reference)
                        .map_err(|e| e.to_string())?;
                }
                e.decode(&blob, s.reference.map(|_| &reference), out)
                    .map_err(|e| e.to_string())?;
            }
        }
        // As the real agent: a page that does not match its checksum is never installed.
        if page_checksum(out) != s.checksum {
            return Err(
                "the decoded page does not match its checksum: the blob was changed".into(),
            );
        }
        Ok(())
    }

    /// Page `g`'s bytes as the guest would read them, without serving the access.
    pub fn peek(&self, g: Gfn) -> Result<Page, String> {
        match self.home[g.index()] {
            Home::Private => Ok(self.ram_page(g)),
            Home::Zero => Ok([0u8; PAGE_SIZE]),
            Home::Frame(f) => {
                let mut p = [0u8; PAGE_SIZE];
                self.shared
                    .pool
                    .read(f.offset(), &mut p)
                    .map_err(|e| e.to_string())?;
                Ok(p)
            }
            Home::Stashed(s) => {
                let mut p = [0u8; PAGE_SIZE];
                self.decode(&s, &mut p)?;
                Ok(p)
            }
        }
    }

    /// Serves an access to page `g` (the fault path): a zero page is refilled, a stashed
    /// page decoded back, and for a write a shared page gets a private copy. Returns the
    /// page's bytes.
    ///
    /// Errors: a blob that does not decode (the page stays stashed).
    fn fault_in(&mut self, g: Gfn, write: bool) -> Result<Page, String> {
        let i = g.index();
        let seen = match (self.home[i], self.tracking[i]) {
            (Home::Private, Tracking::Open) => false,
            (Home::Private, Tracking::ReadOnly) => write,
            _ => true, // armed, or not private: a fault either way
        };
        if write {
            self.watched[i] = false;
        }
        // The kernel swaps it in, as for any access.
        self.page_in(i);
        if seen {
            self.referenced[i] = true;
            self.modified[i] |= write;
            self.tracking[i] = if write {
                Tracking::Open
            } else {
                Tracking::ReadOnly
            };
        }
        match self.home[i] {
            Home::Private => Ok(self.ram_page(g)),
            Home::Zero => {
                let zero = [0u8; PAGE_SIZE];
                self.set_ram_page(g, &zero);
                self.set_home(i, Home::Private);
                self.events.push(Event::Refilled(g));
                Ok(zero)
            }
            Home::Frame(f) => {
                let p = self.peek(g)?;
                if !write && !self.frame_pte[i] {
                    // The kernel's minor fault maps the frame again.
                    self.frame_mapped(i, f);
                }
                if write {
                    self.set_ram_page(g, &p);
                    self.set_home(i, Home::Private);
                    self.events.push(Event::CowBroken(g, f));
                }
                Ok(p)
            }
            Home::Stashed(s) => {
                let mut p = [0u8; PAGE_SIZE];
                self.decode(&s, &mut p)?;
                self.set_ram_page(g, &p);
                self.set_home(i, Home::Private);
                self.events.push(Event::Unstashed(g));
                Ok(p)
            }
        }
    }

    /// The guest reads page `g`.
    ///
    /// Errors: as [`SimAgent::peek`].
    pub fn read(&mut self, g: Gfn) -> Result<Page, String> {
        self.fault_in(g, false)
    }

    /// The guest writes `bytes` at `offset` in page `g`.
    ///
    /// Errors: as [`SimAgent::peek`]; nothing is written then.
    pub fn write(&mut self, g: Gfn, offset: usize, bytes: &[u8]) -> Result<(), String> {
        let mut p = self.fault_in(g, true)?;
        p[offset..offset + bytes.len()].copy_from_slice(bytes);
        self.set_ram_page(g, &p);
        Ok(())
    }

    /// The guest's VMM discards page `g` (a balloon, free page reporting): QEMU punches it
    /// out of guest RAM and drops its mapping, and the agent forgets what it held there
    /// (a frame, a zero page, a blob), reporting it. The page reads as zeros afterwards.
    pub fn discard(&mut self, g: Gfn) {
        let i = g.index();
        self.punch(g);
        self.page_in(i);
        let what = match self.home[i] {
            Home::Private => return,
            Home::Zero => Discard::Zero,
            Home::Frame(f) => Discard::Frame(f),
            Home::Stashed(_) => Discard::Stored,
        };
        self.set_home(i, Home::Private);
        self.events.push(Event::Discarded(g, what));
    }

    /// Carries out a command as the real agent does; `ClockScan` is answered by
    /// [`SimAgent::clock_scan`], here `Done`.
    pub fn execute(&mut self, cmd: &Command) -> Outcome {
        if self.refuse {
            return Outcome::Refused;
        }
        match *cmd {
            Command::Share { gfn, frame } => {
                if gfn.0 >= self.pages() || self.home[gfn.index()] != Home::Private {
                    return Outcome::Refused;
                }
                let on_frames = || {
                    self.home
                        .iter()
                        .filter(|h| matches!(h, Home::Frame(_)))
                        .count()
                };
                if self.frame_budget.is_some_and(|b| on_frames() >= b) {
                    return Outcome::Refused;
                }
                let mut p = [0u8; PAGE_SIZE];
                if self.shared.pool.read(frame.offset(), &mut p).is_err() {
                    return Outcome::Refused;
                }
                if p != self.ram_page(gfn) {
                    return Outcome::Changed;
                }
                self.set_home(gfn.index(), Home::Frame(frame));
                self.punch(gfn);
                Outcome::Done
            }
            // As the real agent: the frame over the page if the page still begins with
            // the device's nonce (a zero nonce never).
            Command::Fill { gfn, frame, nonce } => {
                if gfn.0 >= self.pages()
                    || self.home[gfn.index()] != Home::Private
                    || nonce == [0, 0]
                {
                    return Outcome::Refused;
                }
                let page = self.ram_page(gfn);
                if page[..8] != nonce[0].to_ne_bytes() || page[8..16] != nonce[1].to_ne_bytes() {
                    return Outcome::Changed;
                }
                self.set_home(gfn.index(), Home::Frame(frame));
                self.punch(gfn);
                Outcome::Done
            }
            Command::Reclaim { gfn } => {
                if gfn.0 >= self.pages() || self.home[gfn.index()] != Home::Private {
                    return Outcome::Refused;
                }
                if self.ram_page(gfn) != [0u8; PAGE_SIZE] {
                    return Outcome::Changed;
                }
                self.set_home(gfn.index(), Home::Zero);
                self.punch(gfn);
                Outcome::Done
            }
            // As the real agent: a private page write-protected, so that a write is seen;
            // a page on a frame or stashed is protected already (a write gives it a new
            // home, which ends the watch).
            Command::Watch { gfn, .. } => {
                let i = gfn.index();
                if gfn.0 >= self.pages() || self.home[i] == Home::Zero {
                    return Outcome::Refused;
                }
                self.watched[i] = true;
                if self.home[i] == Home::Private && self.tracking[i] == Tracking::Open {
                    self.tracking[i] = Tracking::ReadOnly;
                }
                Outcome::Done
            }
            // As the real agent: private, shared or stored, discarded only while watched.
            Command::DiscardFree { gfn } => {
                if gfn.0 >= self.pages() || self.home[gfn.index()] == Home::Zero {
                    return Outcome::Refused;
                }
                if !self.watched[gfn.index()] {
                    return Outcome::Changed;
                }
                self.set_home(gfn.index(), Home::Zero);
                self.punch(gfn);
                Outcome::Done
            }
            Command::Stash { gfn, stash, .. } => self.stash(gfn, stash),
            Command::PageOut { gfn } => {
                let i = gfn.index();
                if gfn.0 >= self.pages() || self.home[i] != Home::Private || self.paged_out[i] {
                    Outcome::Refused
                } else if self.tracking[i] == Tracking::Armed {
                    // Its PTE dropped by the clock and not touched since: nothing else maps
                    // it, so `MADV_PAGEOUT` through the agent's window takes it.
                    self.paged_out[i] = true;
                    self.ram.file().swapped.insert(i as u64);
                    Outcome::Done
                } else {
                    // Mapped by QEMU (used since it was armed): left in RAM.
                    Outcome::Changed
                }
            }
            Command::TakeBack { gfn } => self.take_back(gfn),
            Command::ClockScan { .. } => Outcome::Done,
        }
    }

    /// Takes page `g` back as a private page (an opt-out), reporting it as the event it
    /// is; a private page needs nothing. Refused if a blob does not decode.
    fn take_back(&mut self, g: Gfn) -> Outcome {
        if g.0 >= self.pages() {
            return Outcome::Refused;
        }
        let i = g.index();
        let event = match self.home[i] {
            Home::Private => return Outcome::Done,
            Home::Zero => Event::Refilled(g),
            Home::Frame(f) => Event::CowBroken(g, f),
            Home::Stashed(_) => Event::Unstashed(g),
        };
        let Ok(p) = self.peek(g) else {
            return Outcome::Refused;
        };
        self.set_ram_page(g, &p);
        self.set_home(i, Home::Private);
        self.events.push(event);
        Outcome::Done
    }

    fn stash(&mut self, g: Gfn, s: Stash) -> Outcome {
        if g.0 >= self.pages() {
            return Outcome::Refused;
        }
        let mut new = [0u8; PAGE_SIZE];
        if s.moving {
            let Home::Stashed(cur) = self.home[g.index()] else {
                return Outcome::Changed;
            };
            if cur.home != BlobHome::Store {
                return Outcome::Changed;
            }
            let mut old = [0u8; PAGE_SIZE];
            if self.decode(&cur, &mut old).is_err() || self.decode(&s, &mut new).is_err() {
                return Outcome::Refused;
            }
            if old != new {
                return Outcome::Changed;
            }
            self.set_home(g.index(), Home::Stashed(Stash { moving: false, ..s }));
            return Outcome::Done;
        }
        if self.home[g.index()] != Home::Private {
            return Outcome::Refused;
        }
        if self.decode(&s, &mut new).is_err() {
            return Outcome::Refused;
        }
        if new != self.ram_page(g) {
            return Outcome::Changed;
        }
        self.set_home(g.index(), Home::Stashed(s));
        self.punch(g);
        Outcome::Done
    }

    /// Reports and clears the R and M bits of `[first, first+count)` (bit k of word k/64
    /// for page `first + k`), clamped to the guest's RAM, and arms the private pages `arm`
    /// names (same layout) as the real agent does: those `wp_only` names for writes only
    /// (write-protected, not zapped: a read takes no fault).
    pub fn clock_scan(
        &mut self,
        first: Gfn,
        count: u32,
        arm: &[u64],
        wp_only: &[u64],
        zap_shared: bool,
    ) -> (u32, Vec<u64>, Vec<u64>) {
        let n = count.min(self.pages().saturating_sub(first.0));
        let mut r = vec![0u64; (n as usize).div_ceil(64)];
        let mut m = r.clone();
        for k in 0..n as usize {
            let i = first.index() + k;
            // Paged out, and read back into RAM by memfoldd since (the real agent sees it
            // resident before the scan): reported back, as a guest access would be.
            if self.paged_out[i] && !self.ram.file().swapped.contains(&(i as u64)) {
                self.page_in(i);
            }
            if std::mem::take(&mut self.referenced[i]) {
                r[k / 64] |= 1 << (k % 64);
            }
            if std::mem::take(&mut self.modified[i]) {
                m[k / 64] |= 1 << (k % 64);
            }
            if zap_shared {
                self.frame_unmapped(i);
            }
            let armed = crate::clock::mask_bit(arm, k as u32);
            if armed && self.home[i] == Home::Private {
                self.tracking[i] = if crate::clock::mask_bit(wp_only, k as u32) {
                    Tracking::ReadOnly
                } else {
                    Tracking::Armed
                };
            }
        }
        (n, r, m)
    }

    /// Carries out `cmd` if it is a clock scan ([`SimAgent::clock_scan`]): its first page,
    /// pages and R and M bits; `None` for any other command (nothing done).
    pub fn clock_scan_cmd(&mut self, cmd: &Command) -> Option<(Gfn, u32, Vec<u64>, Vec<u64>)> {
        let Command::ClockScan {
            first,
            count,
            ref arm,
            ref wp_only,
            zap_shared,
        } = *cmd
        else {
            return None;
        };
        let (n, r, m) = self.clock_scan(first, count, arm, wp_only, zap_shared);
        Some((first, n, r, m))
    }

    /// Before re-attaching to a (new) memfoldd: writes every stashed page back into guest
    /// RAM, drops unreported events (the list says it all), and lists what it maps.
    ///
    /// Errors: a blob that does not decode (the page stays stashed; no attach).
    pub fn prepare_reattach(&mut self) -> Result<Vec<(Gfn, Mapped)>, String> {
        for i in 0..self.home.len() {
            if let Home::Stashed(s) = self.home[i] {
                let mut p = [0u8; PAGE_SIZE];
                self.decode(&s, &mut p)?;
                self.set_ram_page(Gfn(i as u32), &p);
                self.set_home(i, Home::Private);
            }
        }
        self.events.clear();
        Ok(self
            .home
            .iter()
            .enumerate()
            .filter_map(|(i, h)| match h {
                Home::Frame(f) => Some((Gfn(i as u32), Mapped::Frame(*f))),
                Home::Zero => Some((Gfn(i as u32), Mapped::Zero)),
                _ => None,
            })
            .collect())
    }
}
