//! The engine: every guest's P2M map over the pool's frames and the blob spaces, the
//! sharing scan, the Difference Engine over the NRU clock, the host budget and the books.
//!
//! The engine decides; mechanisms carry out. It reads guest pages through [`GuestRam`],
//! confirms candidates byte for byte, writes new frames and blobs through the backings,
//! and queues [`Command`]s for the agent in the guest's QEMU: share this gfn onto that
//! frame, reclaim this zero page, stash this page as that blob, report this clock slice.
//! The agent checks each command against the page's bytes under write-protection and
//! answers; its [`Outcome`] comes back through [`Engine::outcome`]. What the agent did on
//! its own — copy-on-write breaks, refills of zero pages, pages decoded back on access —
//! comes back as events ([`Engine::cow_broken`], [`Engine::refilled`],
//! [`Engine::unstashed`]).
//!
//! | file | concern |
//! |---|---|
//! | `mod.rs` | configuration, guests (attach, re-attach, detach, remove), commands |
//! | `scan.rs` | the rate-limited sharing scan (ESX §4.3) and zero pages |
//! | `de.rs` | the NRU clock's slices and the Difference Engine over them (DE §4.2–4.6) |
//! | `outcomes.rs` | agents' answers and events applied back |
//! | `books.rs` | savings by mechanism and guest, budget, lifetimes |
//! | `check.rs` | every invariant, for tests |

mod books;
mod check;
mod de;
mod outcomes;
mod scan;

use std::collections::BTreeMap;

use memfold_codecs::{CompressCodec, PatchCodec};
use serde::Serialize;

use crate::backing::{Backing, BackingError, Clock, GuestRam};
use crate::blobs::{BlobHome, BlobSpace, BlobTable, Form, Kept};
use crate::clock::{ClockHand, Policy};
use crate::frames::FrameTable;
use crate::ids::{FrameId, Gfn, Gpn, VmId};
use crate::p2m::{BlobId, P2mEntry, PageState};
use crate::share::{ShareEntry, ShareTable};
use crate::similarity::{SimilarityConfig, SimilarityDetector, SimilarityIndex};
use crate::{page_hash, Page, PAGE_SIZE};

pub use books::{Books, LifetimeBooks, SavedBy, SwapBooks, VmBooks, VmReport, LIFETIME_MARKS_S};

const PAGE: u64 = PAGE_SIZE as u64;

/// What to do with guest pages that are all zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum ZeroPolicy {
    /// Punch them out of guest RAM; the agent fills a zero page on the next access (ESX
    /// §4.3's zero page without a frame or a mapping, so no VMA is spent).
    Reclaim,
    /// Map them onto one shared zero frame, copy-on-write (ESX §4.3).
    Share,
    /// Leave them alone (Satori §4.1: zero pages are mostly short-lived free memory).
    Keep,
}

impl ZeroPolicy {
    /// The names [`ZeroPolicy::from_name`] takes.
    pub const NAMES: [&'static str; 3] = ["reclaim", "share", "keep"];

    /// The policy named `name` (one of [`ZeroPolicy::NAMES`]).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "reclaim" => Some(ZeroPolicy::Reclaim),
            "share" => Some(ZeroPolicy::Share),
            "keep" => Some(ZeroPolicy::Keep),
            _ => None,
        }
    }

    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self {
            ZeroPolicy::Reclaim => "reclaim",
            ZeroPolicy::Share => "share",
            ZeroPolicy::Keep => "keep",
        }
    }
}

/// The engine's parameters. [`EngineConfig::default`] is the one set of defaults memfoldd
/// and `memfold run` share.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Which mechanisms may touch pages of each NRU class (DE §4.2).
    pub policy: Policy,
    /// What to do with zero pages.
    pub zero: ZeroPolicy,
    /// HashSimilarityDetector parameters (DE §3.2).
    pub similarity: SimilarityConfig,
    /// Patch encoding (DE §3.2).
    pub patch_codec: PatchCodec,
    /// Largest patch kept, bytes (DE §3.2: 2048).
    pub patch_cutoff: usize,
    /// Page compressor (DE §3.3).
    pub compress_codec: CompressCodec,
    /// Largest compressed page kept, bytes (DE §3.3: 2048).
    pub compress_cutoff: usize,
    /// Sharing scan rate limit, pages/s (ESX §4.3); 0 scans at full speed.
    pub rate: u64,
    /// Shortest time between the starts of two full sharing scans, µs.
    pub min_scan_interval_us: u64,
    /// Longest time between full scans, µs: after a quiet scan (requests for under 0.1%
    /// of the pages read) the interval doubles up to this; a busy one resets it.
    pub max_scan_interval_us: u64,
    /// Time for the NRU clock's hand to pass over each guest once, µs (DE §4.2: ≥ 4 s);
    /// `None`: no clock, so no R/M tracking faults and sharing alone.
    pub clock_interval_us: Option<u64>,
    /// Host memory budget for the guests' RAM (their memfds, the pool and the store),
    /// bytes; over it, cold pages are swapped out (DE §4.6). `None`: no swapping.
    pub host_budget: Option<u64>,
    /// The share table's content hash ([`page_hash`], xxh3-64). Tests replace it with
    /// one that collides, so that every match must be confirmed byte for byte.
    pub page_hash: fn(&Page) -> u64,
}

impl Default for EngineConfig {
    /// The Difference Engine policy with a 4 s clock, zero pages reclaimed, run-diff
    /// patches and zstd compression under 2 KiB cut-offs, scanning 100 000 pages/s with
    /// full scans 1–8 s apart; no host budget.
    fn default() -> Self {
        EngineConfig {
            policy: Policy::difference_engine(),
            zero: ZeroPolicy::Reclaim,
            similarity: SimilarityConfig::default(),
            patch_codec: PatchCodec::RunDiff,
            patch_cutoff: 2048,
            compress_codec: CompressCodec::Zstd,
            compress_cutoff: 2048,
            rate: 100_000,
            min_scan_interval_us: 1_000_000,
            max_scan_interval_us: 8_000_000,
            clock_interval_us: Some(4_000_000),
            host_budget: None,
            page_hash,
        }
    }
}

/// A configuration the engine cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A cut-off over one page.
    #[error("{which} cut-off of {bytes} bytes: at most 4096")]
    Cutoff {
        /// `patch` or `compression`.
        which: &'static str,
        /// The value given.
        bytes: usize,
    },
    /// A policy that patches or compresses, or a host budget, without the NRU clock.
    #[error("{what} needs the NRU clock: give a clock interval (e.g. 4 s)")]
    NeedsClock {
        /// What needs it.
        what: String,
    },
    /// Similarity parameters out of range.
    #[error("similarity: {0}")]
    Similarity(String),
}

impl EngineConfig {
    /// Checks the configuration.
    ///
    /// Errors: [`ConfigError`], saying which parameter and why.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (which, bytes) in [
            ("patch", self.patch_cutoff),
            ("compression", self.compress_cutoff),
        ] {
            if bytes > PAGE_SIZE {
                return Err(ConfigError::Cutoff { which, bytes });
            }
        }
        if self.clock_interval_us.is_none() {
            if self.policy.needs_clock() {
                return Err(ConfigError::NeedsClock {
                    what: format!("policy {} (patching or compression)", self.policy.name),
                });
            }
            if self.host_budget.is_some() {
                return Err(ConfigError::NeedsClock {
                    what: "a host budget (swap picks C4 pages)".into(),
                });
            }
        }
        SimilarityDetector::new(self.similarity).map_err(ConfigError::Similarity)?;
        Ok(())
    }
}

/// Why an engine call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum EngineError {
    /// A backing failed where the engine cannot go on without it (the pool).
    #[error("pool: {0}")]
    Pool(BackingError),
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An attach the engine refuses.
    #[error("attach of {name} (pid {pid}): {why}")]
    Attach {
        /// Guest name.
        name: String,
        /// QEMU's pid.
        pid: u32,
        /// Why.
        why: String,
    },
}

/// The backings an engine keeps frames and blobs in.
pub struct Backings {
    /// The pool of frames (frame `f` at byte `f·4096`).
    pub pool: Box<dyn Backing>,
    /// The store of patches and compressed pages (host memory).
    pub store: Box<dyn Backing>,
    /// The swap file and its capacity, bytes (with a host budget).
    pub swap: Option<(Box<dyn Backing>, u64)>,
}

/// One command for the agent of a guest: the engine's plan. Each names the page and what
/// the agent must check before it acts, so a page written meanwhile is never lost.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Command {
    /// Map the page onto the frame if its bytes still equal the frame's (ESX §4.3).
    Share {
        /// The page.
        gfn: Gfn,
        /// The pool frame.
        frame: FrameId,
    },
    /// Punch the page out if it is still all zeros; refill it with zeros on access.
    Reclaim {
        /// The page.
        gfn: Gfn,
    },
    /// Keep the page as this blob if the blob decodes to its bytes (DE §3.2, §3.3, §4.6).
    Stash {
        /// The page.
        gfn: Gfn,
        /// The engine's blob.
        blob: BlobId,
        /// Where the blob is and how it decodes.
        stash: Stash,
    },
    /// Report the slice's R and M bits since it was last armed and arm it again (DE §4.2).
    ClockScan {
        /// First page.
        first: Gfn,
        /// Pages.
        count: u32,
    },
}

/// Where a stashed page's blob is and how the agent decodes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Stash {
    /// Store or swap file.
    pub home: BlobHome,
    /// Byte offset there.
    pub offset: u64,
    /// Length, bytes.
    pub len: u32,
    /// What it holds.
    pub form: Form,
    /// A patch's reference frame.
    pub reference: Option<FrameId>,
    /// The page is stashed already; this moves its blob to the swap file (the agent
    /// replaces its record only if the page is still stashed and both decode alike).
    pub moving: bool,
}

/// How the agent answered a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Outcome {
    /// Carried out.
    Done,
    /// The page's bytes no longer matched: left as it was.
    Changed,
    /// Not carried out for another reason (VMA budget, page not private, unreadable blob),
    /// or never delivered.
    Refused,
    /// Sent, and the connection was lost before the answer: the agent may or may not have
    /// carried it out. The page stays in doubt until the agent re-attaches (listing what
    /// it maps) or its QEMU exits.
    Lost,
}

/// An attach (or re-attach) of a guest.
pub struct Attach {
    /// Guest name.
    pub name: String,
    /// QEMU's pid (from the socket's peer credentials, not the peer's word).
    pub pid: u32,
    /// Guest RAM, pages.
    pub pages: u32,
    /// Its RAM.
    pub ram: Box<dyn GuestRam>,
    /// What the agent maps now (re-attach): pool frames and reclaimed zero pages.
    pub mapped: Vec<(Gfn, Mapped)>,
}

/// A page a re-attaching agent maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mapped {
    /// Onto this pool frame.
    Frame(FrameId),
    /// A reclaimed zero page (a hole the agent refills).
    Zero,
}

/// One guest.
pub(crate) struct Vm {
    pub(crate) name: String,
    pub(crate) pid: u32,
    pub(crate) base: Gpn,
    pub(crate) ram: Box<dyn GuestRam>,
    /// The agent is connected.
    pub(crate) attached: bool,
    pub(crate) p2m: Vec<P2mEntry>,
    /// The sharing scan's next page and whether this full scan has covered the guest.
    pub(crate) cursor: u32,
    pub(crate) scanned_this_pass: bool,
    /// Commands not yet handed to the executor.
    pub(crate) queue: Vec<Command>,
    pub(crate) clock: ClockHand,
    /// Per gfn (bit): neither a patch nor compression was under the cut-off when last
    /// tried; not tried again until the guest writes the page.
    pub(crate) de_failed: Vec<u64>,
    /// Per gfn: idle clock scans the page needs before it is stored again (0: what the
    /// policy's classes say). A page the guest took back within [`RESTASH_LIVED_US`]
    /// waits twice as long next time (2, 4, then 7 scans), so pages a workload revisits
    /// every few seconds stop cycling through decode faults.
    pub(crate) restash_wait: Vec<u8>,
    pub(crate) books: VmBooks,
}

/// A stored page taken back sooner than this (µs) was not cold enough.
const RESTASH_LIVED_US: u64 = 30_000_000;

impl Vm {
    pub(crate) fn state(&self, g: Gfn) -> PageState {
        self.p2m[g.index()].state()
    }

    pub(crate) fn set(&mut self, g: Gfn, s: PageState) {
        self.p2m[g.index()] = P2mEntry::new(s);
    }

    pub(crate) fn pages(&self) -> u32 {
        self.p2m.len() as u32
    }
}

/// The memfold engine. See the module documentation.
pub struct Engine {
    pub(crate) cfg: EngineConfig,
    pub(crate) clock: Box<dyn Clock>,
    pub(crate) pool: Box<dyn Backing>,
    pub(crate) frames: FrameTable,
    /// Whether the pool was adopted from a previous memfoldd.
    pub(crate) adopted: bool,
    pub(crate) store: BlobSpace,
    pub(crate) swap: Option<BlobSpace>,
    pub(crate) blobs: BlobTable,
    /// Blobs of moves to swap whose page the guest took back meanwhile: held by the move
    /// request alone until it is answered (or lost with its guest's connection).
    pub(crate) orphans: std::collections::BTreeSet<BlobId>,
    pub(crate) share: ShareTable,
    pub(crate) zero_hash: u64,
    pub(crate) zero_frame: Option<FrameId>,
    /// Reference-page candidates by signature (DE §4.3), cleared every 4 clock intervals.
    pub(crate) similar: SimilarityIndex,
    pub(crate) similar_cleared_us: u64,
    pub(crate) vms: BTreeMap<VmId, Vm>,
    /// VM by first gpn.
    pub(crate) by_base: BTreeMap<Gpn, VmId>,
    pub(crate) next_base: u32,
    pub(crate) next_vm: u32,
    pub(crate) scan: scan::ScanState,
    pub(crate) budget: books::BudgetState,
    pub(crate) books: books::EngineBooks,
    pub(crate) started_us: u64,
}

impl Engine {
    /// An engine with no guests over empty backings.
    ///
    /// Errors: [`EngineError::Config`].
    pub fn new(
        cfg: EngineConfig,
        backings: Backings,
        clock: Box<dyn Clock>,
    ) -> Result<Engine, EngineError> {
        cfg.validate()?;
        let det = SimilarityDetector::new(cfg.similarity).map_err(ConfigError::Similarity)?;
        let now = clock.now_us();
        Ok(Engine {
            pool: backings.pool,
            frames: FrameTable::new(),
            adopted: false,
            store: BlobSpace::new(BlobHome::Store, backings.store, None),
            swap: backings
                .swap
                .map(|(b, cap)| BlobSpace::new(BlobHome::Swap, b, Some(cap))),
            blobs: BlobTable::default(),
            orphans: Default::default(),
            share: ShareTable::new(1),
            zero_hash: (cfg.page_hash)(&[0u8; PAGE_SIZE]),
            zero_frame: None,
            similar: SimilarityIndex::new(det),
            similar_cleared_us: now,
            vms: BTreeMap::new(),
            by_base: BTreeMap::new(),
            next_base: 0,
            next_vm: 0,
            scan: scan::ScanState::new(now),
            budget: books::BudgetState::new(now),
            books: books::EngineBooks::new(),
            started_us: now,
            clock,
            cfg,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Whether the engine's pool is still untouched: no frame ever allocated, no guest
    /// attached. Only then may it adopt another ([`Engine::adopt_pool`]).
    pub fn pool_untouched(&self) -> bool {
        self.frames.size() == 0 && self.vms.is_empty()
    }

    /// Adopts the pool of a previous memfoldd, handed back by a re-attaching agent: its
    /// `frames` frames, of which those in `held` hold data. Those stay pinned until
    /// [`Engine::end_adoption`]: an agent not yet re-attached may map any of them.
    ///
    /// Errors: [`EngineError::Attach`]-free; refuses (returns false) unless
    /// [`Engine::pool_untouched`].
    pub fn adopt_pool(
        &mut self,
        pool: Box<dyn Backing>,
        frames: u32,
        held: impl IntoIterator<Item = FrameId>,
    ) -> bool {
        if !self.pool_untouched() {
            return false;
        }
        self.pool = pool;
        self.frames = FrameTable::adopted(frames, held);
        self.adopted = true;
        true
    }

    /// Ends the adoption of a pool: every process that held the old pool has re-attached
    /// or exited, so adopted frames no guest maps are freed.
    pub fn end_adoption(&mut self) {
        for f in self.frames.end_adoption() {
            self.forget_frame(f);
        }
    }

    /// Whether adopted frames are still pinned.
    pub fn adoption_pending(&self) -> bool {
        self.frames.adoption_pending()
    }

    /// Attaches a guest, or re-attaches one whose connection was lost while its QEMU
    /// lived (same pid): its agent wrote every stashed page back before re-attaching, so
    /// their blobs are released; what it maps now (`a.mapped`) replaces what the books said,
    /// including requests lost in doubt. Frames of an adopted pool that a guest maps are
    /// read, hashed and entered in the share table.
    ///
    /// Errors: [`EngineError::Attach`] for a guest of 0 pages, or pages past the 2^31
    /// global page space; [`EngineError::Pool`] if an adopted frame cannot be read.
    pub fn attach(&mut self, a: Attach) -> Result<VmId, EngineError> {
        let refuse = |why: String| EngineError::Attach {
            name: a.name.clone(),
            pid: a.pid,
            why,
        };
        let old = self
            .vms
            .iter()
            .find(|(_, v)| v.pid == a.pid && !v.attached && v.pages() == a.pages)
            .map(|(id, _)| *id);
        let id = match old {
            Some(id) => {
                self.release_blobs(id);
                let v = self.vms.get_mut(&id).expect("found above");
                v.ram = a.ram;
                v.name = a.name;
                id
            }
            None => {
                if a.pages == 0 {
                    return Err(refuse("a guest of 0 pages".into()));
                }
                let base = self.next_base;
                let end = base as u64 + a.pages as u64;
                if end > 1 << 31 {
                    return Err(refuse(format!(
                        "{} pages would pass the 2^31-page global page space",
                        a.pages
                    )));
                }
                let id = VmId(self.next_vm);
                self.next_vm += 1;
                self.next_base = end as u32;
                self.by_base.insert(Gpn(base), id);
                let n = a.pages as usize;
                self.vms.insert(
                    id,
                    Vm {
                        name: a.name,
                        pid: a.pid,
                        base: Gpn(base),
                        ram: a.ram,
                        attached: false,
                        p2m: vec![P2mEntry::PRIVATE; n],
                        cursor: 0,
                        scanned_this_pass: false,
                        queue: Vec::new(),
                        clock: ClockHand::new(n),
                        de_failed: vec![0; n.div_ceil(64)],
                        restash_wait: vec![0; n],
                        books: VmBooks::default(),
                    },
                );
                id
            }
        };
        self.reconcile(id, &a.mapped)?;
        let v = self.vms.get_mut(&id).expect("attached above");
        v.attached = true;
        v.scanned_this_pass = false;
        tracing::info!(
            vm = %id, name = %v.name, pid = v.pid, pages = v.pages(),
            shared = v.books.shared_pages, "attached"
        );
        Ok(id)
    }

    /// Makes the books of guest `id` say what its agent maps (`mapped`): requests in
    /// doubt end, mappings no longer there are dropped, new ones are counted.
    fn reconcile(&mut self, id: VmId, mapped: &[(Gfn, Mapped)]) -> Result<(), EngineError> {
        let pages = self.vms[&id].pages();
        let mut now = vec![None; pages as usize];
        for &(g, m) in mapped {
            let ok = g.0 < pages
                && match m {
                    Mapped::Frame(f) => self.frames.contains(f) && self.frames.is_used(f),
                    Mapped::Zero => true,
                };
            if ok {
                now[g.index()] = Some(m);
            } else {
                tracing::warn!(vm = %id, gfn = %g, "re-attach lists a page memfoldd cannot hold; ignored");
            }
        }
        // New holds first, then the old ones go: a frame whose only holder was a request
        // in doubt must not be freed before the mapping the agent reports takes it over.
        let mut page = [0u8; PAGE_SIZE];
        let mut changes = Vec::new();
        for (i, is) in now.into_iter().enumerate() {
            let g = Gfn(i as u32);
            let was = self.vms[&id].state(g);
            let next = match is {
                Some(Mapped::Frame(f)) => PageState::Shared(f),
                Some(Mapped::Zero) => PageState::Zero,
                None => PageState::Private,
            };
            if was == next {
                continue;
            }
            if let PageState::Shared(f) = next {
                if self.frames.is_adopted(f) && self.frames.refcount(f) == 0 {
                    self.claim_adopted(f, &mut page)?;
                }
                self.frames.incref(f, false);
            }
            changes.push((g, was, next));
        }
        for (g, was, next) in changes {
            match was {
                // Requests in doubt end here: the agent's list says what happened.
                PageState::Sharing(f) => self.frame_answer(f, false),
                PageState::Shared(f) => self.frame_decref(f, false),
                _ => {}
            }
            self.vms.get_mut(&id).expect("live").set(g, next);
        }
        let v = self.vms.get_mut(&id).expect("live");
        let count =
            |want: fn(PageState) -> bool| v.p2m.iter().filter(|e| want(e.state())).count() as u64;
        v.books.shared_pages = count(|s| matches!(s, PageState::Shared(_)));
        v.books.zero_reclaimed_pages = count(|s| s == PageState::Zero);
        let zero = self.zero_frame;
        v.books.zero_shared_pages = v
            .p2m
            .iter()
            .filter(|e| zero.is_some_and(|z| e.state() == PageState::Shared(z)))
            .count() as u64;
        Ok(())
    }

    /// An adopted frame a re-attaching guest maps: read, hash and list it once.
    fn claim_adopted(&mut self, f: FrameId, page: &mut Page) -> Result<(), EngineError> {
        self.pool
            .read(f.offset(), page)
            .map_err(EngineError::Pool)?;
        let h = (self.cfg.page_hash)(page);
        if self.frames.hash(f) != h || !self.share.lookup(h).any(|e| e == ShareEntry::Shared(f)) {
            self.frames.set_hash(f, h);
            self.share.insert(h, ShareEntry::Shared(f));
        }
        if h == self.zero_hash && crate::is_zero_page(page) {
            self.zero_frame = Some(f);
        }
        Ok(())
    }

    /// The agent of guest `id` is gone but its QEMU may live: requests not yet handed out
    /// are dropped (their pages as they were); requests sent stay in doubt until it
    /// re-attaches ([`Engine::attach`]) or its QEMU exits ([`Engine::remove`]).
    pub fn detach(&mut self, id: VmId) {
        let Some(v) = self.vms.get_mut(&id) else {
            return;
        };
        let queued = std::mem::take(&mut v.queue);
        for c in queued {
            self.outcome(id, &c, Outcome::Refused);
        }
        self.vms.get_mut(&id).expect("checked").attached = false;
        tracing::info!(vm = %id, "detached");
    }

    /// Guest `id`'s QEMU has exited: its mappings are gone. Releases every frame
    /// reference, request and blob it held.
    pub fn remove(&mut self, id: VmId) {
        if !self.vms.contains_key(&id) {
            return;
        }
        self.release_blobs(id);
        let v = self.vms.remove(&id).expect("checked");
        self.by_base.remove(&v.base);
        for e in &v.p2m {
            match e.state() {
                PageState::Shared(f) => {
                    self.frame_decref(f, false);
                }
                PageState::Sharing(f) => {
                    self.frame_answer(f, false);
                }
                _ => {}
            }
        }
        tracing::info!(vm = %id, name = %v.name, pid = v.pid, "released");
    }

    /// Guests, by id: (id, QEMU's pid, attached).
    pub fn vms(&self) -> Vec<(VmId, u32, bool)> {
        self.vms
            .iter()
            .map(|(id, v)| (*id, v.pid, v.attached))
            .collect()
    }

    /// A guest page's state.
    pub fn page_state(&self, id: VmId, g: Gfn) -> Option<PageState> {
        let v = self.vms.get(&id)?;
        (g.0 < v.pages()).then(|| v.state(g))
    }

    /// Whether frame `f` is held (so no other content may take its place).
    pub fn frame_held(&self, f: FrameId) -> bool {
        self.frames.contains(f) && self.frames.is_used(f)
    }

    /// Guests with commands waiting.
    pub fn vms_with_commands(&self) -> Vec<VmId> {
        self.vms
            .iter()
            .filter(|(_, v)| !v.queue.is_empty())
            .map(|(id, _)| *id)
            .collect()
    }

    /// Hands out guest `id`'s waiting commands (the executor sends them). Blobs written to
    /// the swap file are synced first, so that swapped pages really leave host memory.
    pub fn take_commands(&mut self, id: VmId) -> Vec<Command> {
        let Some(v) = self.vms.get_mut(&id) else {
            return Vec::new();
        };
        let cmds = std::mem::take(&mut v.queue);
        let to_swap = cmds
            .iter()
            .any(|c| matches!(c, Command::Stash { stash, .. } if stash.home == BlobHome::Swap));
        if to_swap {
            if let Some(Err(e)) = self.swap.as_mut().map(BlobSpace::sync) {
                self.books.swap_sync_errors += 1;
                tracing::warn!("swap file write-back: {e}");
            }
        }
        cmds
    }

    // ---- helpers shared by the submodules ----

    pub(crate) fn now_us(&self) -> u64 {
        self.clock.now_us()
    }

    /// The guest and gfn of a global page number.
    pub(crate) fn locate(&self, gpn: Gpn) -> Option<(VmId, Gfn)> {
        let (&base, &id) = self.by_base.range(..=gpn).next_back()?;
        let v = self.vms.get(&id)?;
        let g = gpn.0 - base.0;
        (g < v.pages()).then_some((id, Gfn(g)))
    }

    /// Whether a mechanism may act on page `g` of guest `id` now: attached and private,
    /// nothing under way.
    pub(crate) fn sharable(&self, id: VmId, g: Gfn) -> bool {
        self.vms
            .get(&id)
            .is_some_and(|v| v.attached && v.state(g) == PageState::Private)
    }

    /// A new frame holding `page` (hashing to `h`), with one pending request.
    ///
    /// Errors: the pool could not grow or be written (host out of memory).
    pub(crate) fn alloc_frame(&mut self, page: &Page, h: u64) -> Result<FrameId, EngineError> {
        let (f, grow) = self.frames.alloc(h);
        let written = (|| {
            if let Some(frames) = grow {
                self.pool.resize(frames as u64 * PAGE)?;
            }
            self.pool.write(f.offset(), page)
        })();
        if let Err(e) = written {
            self.frames.unalloc(f);
            return Err(EngineError::Pool(e));
        }
        Ok(f)
    }

    /// [`Engine::alloc_frame`], or `None` (counted and logged) if the pool cannot take
    /// the frame: a share or a reference page is a hint, given up then.
    pub(crate) fn alloc_frame_or_skip(&mut self, page: &Page, h: u64) -> Option<FrameId> {
        match self.alloc_frame(page, h) {
            Ok(f) => Some(f),
            Err(e) => {
                self.books.pool_errors += 1;
                if self.books.pool_errors.is_power_of_two() {
                    tracing::warn!("{e}; page left private (error {})", self.books.pool_errors);
                }
                None
            }
        }
    }

    /// A share request naming `f` ended; frees the frame if nothing holds it any more.
    pub(crate) fn frame_answer(&mut self, f: FrameId, mapped: bool) {
        if self.frames.answer(f, mapped) {
            self.forget_frame(f);
        }
    }

    /// One mapping (or patch) of `f` fewer; frees the frame if nothing holds it any more.
    pub(crate) fn frame_decref(&mut self, f: FrameId, patch: bool) {
        if self.frames.decref(f, patch) {
            self.forget_frame(f);
        }
    }

    /// A freed frame leaves the share table (and stops being the zero frame), and its
    /// bytes leave the pool.
    fn forget_frame(&mut self, f: FrameId) {
        self.share
            .remove(self.frames.hash(f), ShareEntry::Shared(f));
        if self.zero_frame == Some(f) {
            self.zero_frame = None;
        }
        self.pool.release(f.offset(), PAGE);
    }

    /// The blob space of `home`.
    pub(crate) fn space(&mut self, home: BlobHome) -> Option<&mut BlobSpace> {
        match home {
            BlobHome::Store => Some(&mut self.store),
            BlobHome::Swap => self.swap.as_mut(),
        }
    }

    /// Frees a blob: its slot, its slot bytes in the books, its hold on a reference frame.
    pub(crate) fn release_blob(&mut self, b: BlobId) {
        let blob = self.blobs.remove(b);
        if let Some(space) = self.space(blob.home) {
            space.free(blob.slot);
        }
        self.books.slot_bytes[kept_index(blob.kept())] -= blob.size as u64;
        if let Some(f) = blob.reference {
            self.frame_decref(f, true);
        }
    }

    /// Releases every blob guest `id` holds (its agent wrote its stashed pages back, or
    /// its QEMU is gone): the pages are private again and its stash counters zero.
    fn release_blobs(&mut self, id: VmId) {
        let pages = self.vms[&id].pages();
        for i in 0..pages {
            let g = Gfn(i);
            let st = self.vms[&id].state(g);
            let held: [Option<BlobId>; 2] = match st {
                PageState::Stored(b) | PageState::Stashing(b) => [Some(b), None],
                PageState::Moving(b) => [Some(b), self.blobs.get(b).replaces],
                _ => continue,
            };
            for b in held.into_iter().flatten() {
                self.release_blob(b);
            }
            self.vms
                .get_mut(&id)
                .expect("live")
                .set(g, PageState::Private);
        }
        let mine: Vec<BlobId> = self
            .orphans
            .iter()
            .copied()
            .filter(|&b| self.blobs.get(b).vm == id)
            .collect();
        for b in mine {
            self.orphans.remove(&b);
            self.release_blob(b);
        }
        let v = self.vms.get_mut(&id).expect("live");
        v.books.patched_pages = 0;
        v.books.compressed_pages = 0;
        v.books.swapped_pages = 0;
    }

    /// Queues a share of page `g` of guest `id` onto `f` (whose pending count the caller
    /// took).
    pub(crate) fn enqueue_share(&mut self, id: VmId, g: Gfn, f: FrameId) {
        self.scan.pass_requests += 1;
        let v = self.vms.get_mut(&id).expect("sharable");
        v.set(g, PageState::Sharing(f));
        v.queue.push(Command::Share { gfn: g, frame: f });
    }
}

/// Index of a kind of kept page in per-kind tables.
pub(crate) fn kept_index(k: Kept) -> usize {
    match k {
        Kept::Patched => 0,
        Kept::Compressed => 1,
        Kept::Swapped => 2,
    }
}

impl VmBooks {
    /// The counter of pages kept out of RAM by `k`.
    pub(crate) fn kept_pages(&mut self, k: Kept) -> &mut u64 {
        match k {
            Kept::Patched => &mut self.patched_pages,
            Kept::Compressed => &mut self.compressed_pages,
            Kept::Swapped => &mut self.swapped_pages,
        }
    }
}
