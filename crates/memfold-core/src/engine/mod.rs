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
//! | `mod.rs` | the engine's state, commands and outcomes, helpers shared below |
//! | `config.rs` | parameters, the zero policy, validation |
//! | `guests.rs` | attach, re-attach (reconcile), detach, remove; pool adoption |
//! | `scan.rs` | the rate-limited sharing scan (ESX §4.3) and zero pages |
//! | `de.rs` | the NRU clock's slices and the Difference Engine over them (DE §4.2–4.6) |
//! | `unmapped.rs` | identical pages shared without a mapping (punched, kept as a reference to the frame) |
//! | `outcomes.rs` | agents' answers and events applied back |
//! | `books.rs` | savings by mechanism and guest, budget, lifetimes |
//! | `categories.rs` | what enlightened guests say their pages are (PV §3.1) |
//! | `free_discard.rs` | free pages discarded on the guest's word (issue 17) |
//! | `never_share.rs` | pages the guest marks never to be shared (Satori §4.3) |
//! | `entitlement.rs` | sharing entitlements: shared pages by rank (Satori §4.2) |
//! | `check.rs` | every invariant, for tests |

mod at_read;
mod books;
mod categories;
mod census;
mod check;
mod config;
mod de;
mod early;
mod entitlement;
pub mod fill;
pub mod free_discard;
mod gpn_space;
mod guests;
mod kernel_swap;
pub mod never_share;
mod outcomes;
mod page_hints;
mod scan;
pub mod send_order;
mod unmapped;
pub mod wait_target;

use std::collections::{BTreeMap, BTreeSet};

use serde::Serialize;

use crate::backing::{Backing, BackingError, Clock, GuestRam};
use crate::blobs::{BlobHome, BlobSpace, BlobTable, Form, Kept};
use crate::clock::ClockHand;
use crate::frames::FrameTable;
use crate::ids::{DomainId, FrameId, Gfn, Gpn, VmId};
use crate::p2m::{BlobId, P2mEntry, PageState};
use crate::share::{ShareEntry, ShareTable};
use crate::similarity::{SimilarityDetector, SimilarityIndex};
use crate::{Page, PAGE_SIZE};

pub use at_read::{Landed, MAX_LANDED};
pub use books::{
    Books, LifetimeBooks, MetadataBytes, SavedBy, SwapBooks, VmBooks, VmReport, LIFETIME_MARKS_S,
};
pub use config::{ConfigError, EngineConfig, ZeroPolicy};
pub use entitlement::{claim_target, short_of_memory, ClaimPolicy, SharingRanks, CLAIM_GRAIN};
pub use fill::{BlockCandidate, FillAnswer};
pub use guests::{Attach, Mapped, Sharing};
pub use kernel_swap::{CompressBacking, FRAME_PAGE_OUT_US};
pub use outcomes::Discard;

const PAGE: u64 = PAGE_SIZE as u64;

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

/// A sharing domain (issue 14; ESX §4.3 shares "across VMs", the strict setting of which is
/// one VM): the guests that may share frames and patch against each other's pages. Each
/// domain has its own pool, frame table, share table, zero frames and similarity index,
/// so no scan, share or patch pairs pages of two domains, and a guest's agent (given only
/// its domain's pool) holds no descriptor to read another domain's frames.
pub(crate) struct Domain {
    /// The pool of frames (frame `f` at byte `f·4096`).
    pub(crate) pool: Box<dyn Backing>,
    pub(crate) frames: FrameTable,
    /// Whether the pool was adopted from a previous memfoldd.
    pub(crate) adopted: bool,
    pub(crate) share: ShareTable,
    /// Frames of zeros (ESX §4.1's zero page): their pages earn no entitlement, count as
    /// zero shares. Usually one; every path that makes or adopts one books it here.
    pub(crate) zero_frames: BTreeSet<FrameId>,
    /// Reference-page candidates by signature (DE §4.3), cleared every 4 clock intervals.
    pub(crate) similar: SimilarityIndex,
    pub(crate) similar_cleared_us: u64,
    /// Frames that held a page its guest marked never-share ([`never_share`]): out of the
    /// share table, no reference, no fill, their holders taken back until it is freed.
    pub(crate) withdrawn: std::collections::HashSet<FrameId>,
    /// When the pages of other guests on its withdrawn frames were last taken back, µs
    /// ([`never_share`]: at most every [`never_share::PARTNER_PASS_US`] a domain).
    pub(crate) partner_pass_us: Option<u64>,
}

/// One command for the agent of a guest: the engine's plan. Each names the page and what
/// the agent must check before it acts, so a page written meanwhile is never lost.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    /// Map the page onto the frame if its bytes still equal the frame's (ESX §4.3).
    Share {
        /// The page.
        gfn: Gfn,
        /// The pool frame.
        frame: FrameId,
    },
    /// Map the page onto the frame, which holds the base block a disk read would put
    /// there, if the page still begins with the block device's `nonce` (Satori §5.2; see
    /// [`fill`]).
    Fill {
        /// The page.
        gfn: Gfn,
        /// The pool frame.
        frame: FrameId,
        /// The nonce the device wrote at the start of the page.
        nonce: [u64; 2],
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
    /// Take the page back into guest RAM as a private page, whatever memfold made of it:
    /// copy a shared frame back (a CoW break), decode a stored page, let a reclaimed zero
    /// page be an ordinary hole. The operator's opt-out of a guest ([`Engine::opt_out`],
    /// as KSM's `MADV_UNMERGEABLE`). The agent reports each page as the event it is
    /// ([`Engine::cow_broken`], [`Engine::unstashed`], [`Engine::refilled`]).
    TakeBack {
        /// The page.
        gfn: Gfn,
    },
    /// Page the private page out to the kernel's swap (zswap) if nothing but guest RAM's
    /// memfd holds it (issue 15, [`CompressBacking::Zswap`]): its bytes stay in the memfd,
    /// so nothing is in flight and nothing can be lost (`kernel_swap`).
    PageOut {
        /// The page.
        gfn: Gfn,
    },
    /// Write-protect the private page and set its watch bit, which a write clears (issue
    /// 17's free-page discard, [`free_discard`]). No state change: the page stays private.
    Watch {
        /// The page.
        gfn: Gfn,
        /// The watch round it belongs to: an answer for an earlier round (one ended while
        /// its watches were under way) counts for nothing.
        round: free_discard::WatchRound,
    },
    /// Punch the page out if its watch bit is still set: the guest reported it free after
    /// it was watched, and nothing wrote it since ([`free_discard`]). Its next access
    /// reads zeros.
    DiscardFree {
        /// The page.
        gfn: Gfn,
    },
    /// Report the slice's R and M bits since it was last armed, and arm the pages of
    /// `arm` that are private again (DE §4.2); the others are left as they are, with no
    /// fault to take (see [`crate::clock::ClockHand::arm_mask`]).
    ClockScan {
        /// First page.
        first: Gfn,
        /// Pages.
        count: u32,
        /// Pages to arm: bit k of word k/64 for page `first + k`.
        arm: Vec<u64>,
        /// Of those, pages to write-protect only, not zap (same layout): their R comes
        /// from the enlightened guest's LRU bits ([`EngineConfig::clock_from_guest`]), so
        /// their reads take no fault; their writes do (M stays exact).
        wp_only: Vec<u64>,
        /// Also drop the PTEs of the slice's pages that are mapped onto pool frames (their
        /// write-protection stays: a write is still a CoW break). A frame whose pages
        /// the guests do not touch again is then mapped nowhere and can be paged out
        /// ([`EngineConfig::page_out_mapped_frames`], `kernel_swap`); one they read is
        /// mapped back by the kernel's own minor fault, no userfault.
        zap_shared: bool,
    },
}

impl Command {
    /// The page the command acts on; `None` for a clock scan (a slice of pages).
    pub fn gfn(&self) -> Option<Gfn> {
        match *self {
            Command::Share { gfn, .. }
            | Command::Fill { gfn, .. }
            | Command::Reclaim { gfn }
            | Command::Stash { gfn, .. }
            | Command::TakeBack { gfn }
            | Command::Watch { gfn, .. }
            | Command::PageOut { gfn }
            | Command::DiscardFree { gfn } => Some(gfn),
            Command::ClockScan { .. } => None,
        }
    }
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
    /// The page's checksum: the decoded page must match it before it is installed.
    pub checksum: u64,
}

/// How the agent answered a command.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Outcome {
    /// Carried out.
    Done,
    /// The page's bytes no longer matched: left as it was.
    Changed,
    /// Not carried out for another reason (VMA budget, page not private, unreadable blob).
    Refused,
    /// Never delivered: queued when the agent detached, dropped at an opt-out, or its
    /// send failed. Undone as a refusal (the page stays as it was, what the request held
    /// is released) but not counted as one: the agent said nothing about the page, so none
    /// of a refusal's back-offs follows (VMA pressure after a refused share, a page-out not
    /// tried again until the guest writes the page).
    NotSent,
    /// Sent, and the connection was lost before the answer: the agent may or may not have
    /// carried it out. The page stays in doubt until the agent re-attaches (listing what
    /// it maps) or its QEMU exits.
    Lost,
}

/// One guest.
pub(crate) struct Vm {
    pub(crate) name: String,
    pub(crate) pid: u32,
    pub(crate) base: Gpn,
    /// Its sharing domain (fixed at its first attach).
    pub(crate) domain: DomainId,
    /// Whom its pages may be shared with (never-share: alone in its domain).
    pub(crate) sharing: Sharing,
    pub(crate) ram: Box<dyn GuestRam>,
    /// Its store of patches and compressed pages (host memory), and its swap file: its
    /// own, so its QEMU reads no other guest's stored pages (issue 14).
    pub(crate) store: BlobSpace,
    pub(crate) swap: Option<BlobSpace>,
    /// The agent is connected.
    pub(crate) attached: bool,
    /// The operator took the guest out of memfold ([`Engine::opt_out`]): nothing is
    /// shared, stored or reclaimed for it, and what was is taken back.
    pub(crate) opted_out: bool,
    pub(crate) p2m: Vec<P2mEntry>,
    /// The sharing scan's next page and whether this full scan has covered the guest.
    pub(crate) cursor: u32,
    pub(crate) scanned_this_pass: bool,
    /// End of the data run the cursor is in, as last asked of its RAM (0: to be asked).
    pub(crate) run_end: u32,
    /// Each page's hints, a byte a page: the scan's quiet age, the re-store wait, whether
    /// DE failed it, a page-out going ([`page_hints`]).
    pub(crate) hints: page_hints::PageHints,
    /// Commands not yet handed to the executor.
    pub(crate) queue: Vec<Command>,
    pub(crate) clock: ClockHand,
    /// When the agent last refused a share (its VMA budget, most likely), µs: for a
    /// while after, identical pages are shared without a mapping ([`unmapped`]).
    pub(crate) share_refused_us: Option<u64>,
    /// Mapped shared pages asked back ([`Command::TakeBack`]) to be shared without a
    /// mapping once their CoW break is reported ([`unmapped`]; issue 19).
    pub(crate) unmapping: std::collections::HashSet<Gfn>,
    /// Events the agent reported before answering their page's request ([`early`]).
    pub(crate) early: std::collections::HashMap<Gfn, early::Early>,
    /// Pages whose page-out answer was lost: their next page-in may be that page-out's,
    /// not the next one's ([`early`]). Kept across a re-attach.
    pub(crate) lost_page_outs: std::collections::BTreeSet<Gfn>,
    /// Whether each page shared without a mapping has lived long ([`unmapped`]); its
    /// marks are nibbles of `clock`'s words.
    pub(crate) unmapped_ages: unmapped::UnmappedAges,
    /// Pages a disk read filled whose share is under way, with when they landed (µs;
    /// [`at_read`], Satori §4.1).
    pub(crate) read_sharing: std::collections::HashMap<Gfn, u64>,
    /// Pages shared at read lately, with when the share was mapped (µs; at most
    /// [`at_read::READ_REUSE_PAGES`]): a write that soon marks a reused read buffer.
    pub(crate) read_shared_at: std::collections::HashMap<Gfn, u64>,
    /// Reused read buffers: (strikes, not shared at read before this time, µs; at most
    /// [`at_read::READ_REUSE_PAGES`]).
    pub(crate) read_backoff: std::collections::HashMap<Gfn, (u8, u64)>,
    /// The clock slices asked for with pages armed for writes only, by first page, until
    /// their bits come back ([`EngineConfig::clock_from_guest`]).
    pub(crate) clock_wp_only: Vec<(u32, Vec<u64>)>,
    /// Clock slices still to be sent with `zap_shared` (a whole pass after each round of
    /// frame page-outs, [`kernel_swap`]). Counted when a slice is queued: a slice lost on
    /// the wire zaps nothing, and its frames wait for the pass after the next round (a
    /// frame left mapped stays in RAM, as before the zap existed: no data depends on it).
    pub(crate) zap_shared_slices: u32,
    /// When a report of its that withdrew a frame last started a never-share pass, µs.
    pub(crate) never_share_pass_us: Option<u64>,
    /// What its guest agent last said its pages are (PV §3.1; `None`: it said nothing).
    pub(crate) categories: Option<crate::categories::CategoryMap>,
    /// When `categories` was reported, µs of the engine's clock.
    pub(crate) categories_at_us: u64,
    /// The sharing scan's sweep over it in this full scan when categories are used: 0
    /// reads page-cache pages, 1 the rest ([`scan`]).
    pub(crate) sweep: u8,
    /// Its free-page watch round ([`free_discard`]).
    pub(crate) free_watch: free_discard::FreeWatch,
    /// Its wait controller and store floor ([`wait_target`]).
    pub(crate) wait: wait_target::WaitControl,
    pub(crate) books: VmBooks,
}

/// A stored page taken back sooner than this (µs) was not cold enough.
const RESTASH_LIVED_US: u64 = 30_000_000;

impl Vm {
    /// Its blob space at `home`: the store, or the swap file if it has one.
    pub(crate) fn space(&self, home: BlobHome) -> Option<&BlobSpace> {
        match home {
            BlobHome::Store => Some(&self.store),
            BlobHome::Swap => self.swap.as_ref(),
        }
    }

    /// The pages a take-back is queued for (not yet sent).
    pub(crate) fn queued_take_backs(&self) -> std::collections::HashSet<Gfn> {
        self.queue
            .iter()
            .filter_map(|c| match *c {
                Command::TakeBack { gfn } => Some(gfn),
                _ => None,
            })
            .collect()
    }

    /// Its part of the current full sharing scan is done: the cursor back at gfn 0, no
    /// data run cached.
    pub(crate) fn end_scan_part(&mut self) {
        self.cursor = 0;
        self.run_end = 0;
        self.sweep = 0;
        self.scanned_this_pass = true;
    }

    pub(crate) fn state(&self, g: Gfn) -> PageState {
        self.p2m[g.index()].state()
    }

    /// Page `g` is in state `s` now (a paged-out mark goes: [`kernel_swap`]).
    pub(crate) fn set(&mut self, g: Gfn, s: PageState) {
        self.unmark_paged_out(g);
        self.p2m[g.index()] = P2mEntry::new(s);
    }

    /// Whether page `g` is marked paged out to the kernel's swap, or a page-out of it is
    /// under way ([`kernel_swap`]): either way reading it through guest RAM's memfd would
    /// swap it back in, so nothing of memfold's reads it.
    pub(crate) fn paged_out_or_going(&self, g: Gfn) -> bool {
        self.p2m[g.index()].is_paged_out() || self.hints.page_out_going(g)
    }

    /// Its guest's last report, if at most [`de::GUEST_R_MAX_AGE_US`] old at `now`: what
    /// the clock and the Difference Engine may act on (a quiet agent's old word is not).
    pub(crate) fn fresh_categories(&self, now: u64) -> Option<&crate::categories::CategoryMap> {
        self.categories
            .as_ref()
            .filter(|_| now.saturating_sub(self.categories_at_us) <= de::GUEST_R_MAX_AGE_US)
    }

    /// Whether page `g` is a free page the guest reported and memfoldd discarded, not
    /// touched since ([`P2mEntry::FREE_HOLE`]; its state is [`PageState::Zero`]).
    pub(crate) fn is_free_hole(&self, g: Gfn) -> bool {
        self.p2m[g.index()].is_free_hole()
    }

    /// Page `g`, punched out as a free page the guest reported, is a discarded free page:
    /// a zero-state hole ([`P2mEntry::FREE_HOLE`]) booked as a reclaimed zero page and as
    /// free-page discard's saving.
    pub(crate) fn set_free_hole(&mut self, g: Gfn) {
        self.unmark_paged_out(g);
        self.p2m[g.index()] = P2mEntry::FREE_HOLE;
        self.books.zero_reclaimed_pages += 1;
        self.books.free_reclaimed_pages += 1;
    }

    pub(crate) fn pages(&self) -> u32 {
        self.p2m.len() as u32
    }
}

/// The memfold engine. See the module documentation.
pub struct Engine {
    pub(crate) cfg: EngineConfig,
    pub(crate) clock: Box<dyn Clock>,
    pub(crate) domains: BTreeMap<DomainId, Domain>,
    /// The capacity of all guests' swap files together, bytes.
    pub(crate) swap_capacity: u64,
    pub(crate) blobs: BlobTable,
    /// Blobs of moves to swap whose page the guest took back meanwhile: held by the move
    /// request alone until it is answered (or lost with its guest's connection).
    pub(crate) orphans: std::collections::BTreeSet<BlobId>,
    pub(crate) zero_hash: u64,
    pub(crate) vms: BTreeMap<VmId, Vm>,
    /// VM by first gpn.
    pub(crate) by_base: BTreeMap<Gpn, VmId>,
    /// The global page space: each guest's range, and the free ones.
    pub(crate) gpns: gpn_space::GpnSpace,
    pub(crate) next_vm: u32,
    pub(crate) scan: scan::ScanState,
    pub(crate) budget: books::BudgetState,
    pub(crate) books: books::EngineBooks,
    pub(crate) started_us: u64,
    /// While [`Engine::read_landed`] looks a landed page up: when it landed (µs), so that
    /// each share it asks (the page's, and its hinted twin's) is booked as made at read.
    pub(crate) landed_us: Option<u64>,
    /// Reads served from frames and the block indexes ([`fill`]).
    pub(crate) fills: fill::Fills,
    /// Hints kept across full scans, per domain: pages disk reads landed lately, pairs
    /// left to the clock ([`at_read::KEPT_HINTS`]).
    pub(crate) kept_hints: BTreeMap<DomainId, std::collections::VecDeque<(u64, Gpn)>>,
}

impl Engine {
    /// An engine with no guests and no domains. `swap_capacity` bounds the guests' swap
    /// files together, bytes (used by guests attached with a swap file, under a host
    /// budget).
    ///
    /// Errors: [`EngineError::Config`].
    pub fn new(
        cfg: EngineConfig,
        clock: Box<dyn Clock>,
        swap_capacity: u64,
    ) -> Result<Engine, EngineError> {
        cfg.validate()?;
        SimilarityDetector::new(cfg.similarity).map_err(ConfigError::Similarity)?;
        let now = clock.now_us();
        Ok(Engine {
            domains: BTreeMap::new(),
            swap_capacity,
            blobs: BlobTable::default(),
            orphans: Default::default(),
            zero_hash: (cfg.page_hash)(&[0u8; PAGE_SIZE]),
            vms: BTreeMap::new(),
            by_base: BTreeMap::new(),
            gpns: Default::default(),
            next_vm: 0,
            scan: scan::ScanState::new(now),
            budget: books::BudgetState::new(now),
            books: books::EngineBooks::new(),
            started_us: now,
            landed_us: None,
            fills: Default::default(),
            kept_hints: BTreeMap::new(),
            clock,
            cfg,
        })
    }

    /// Adds sharing domain `d` over an empty `pool`. Returns false (and leaves the engine
    /// as it was) if `d` exists.
    pub fn add_domain(&mut self, d: DomainId, pool: Box<dyn Backing>) -> bool {
        if self.domains.contains_key(&d) {
            return false;
        }
        let det = SimilarityDetector::new(self.cfg.similarity).expect("validated in new()");
        let now = self.now_us();
        self.domains.insert(
            d,
            Domain {
                pool,
                frames: FrameTable::new(),
                adopted: false,
                share: ShareTable::new(self.cfg.share_passes),
                zero_frames: BTreeSet::new(),
                similar: SimilarityIndex::new(det),
                similar_cleared_us: now,
                withdrawn: Default::default(),
                partner_pass_us: None,
            },
        );
        true
    }

    /// Whether domain `d` exists.
    pub fn has_domain(&self, d: DomainId) -> bool {
        self.domains.contains_key(&d)
    }

    /// The domains, with the guests in each.
    pub fn domains(&self) -> Vec<(DomainId, Vec<VmId>)> {
        self.domains
            .keys()
            .map(|&d| {
                let vms = self
                    .vms
                    .iter()
                    .filter(|(_, v)| v.domain == d)
                    .map(|(id, _)| *id)
                    .collect();
                (d, vms)
            })
            .collect()
    }

    /// The configuration.
    pub fn config(&self) -> &EngineConfig {
        &self.cfg
    }

    /// Guests, by id: (id, QEMU's pid, attached).
    pub fn vms(&self) -> Vec<(VmId, u32, bool)> {
        self.vms
            .iter()
            .map(|(id, v)| (*id, v.pid, v.attached))
            .collect()
    }

    /// Guest `id`'s RAM, bytes (`None`: no such guest).
    pub fn ram_bytes(&self, id: VmId) -> Option<u64> {
        self.vms.get(&id).map(|v| v.pages() as u64 * PAGE)
    }

    /// The guests named `name` (names come from the agents: several may share one).
    pub fn vms_named(&self, name: &str) -> Vec<VmId> {
        self.vms
            .iter()
            .filter(|(_, v)| v.name == name)
            .map(|(id, _)| *id)
            .collect()
    }

    /// Guest `id`'s sharing domain.
    pub fn domain_of(&self, id: VmId) -> Option<DomainId> {
        self.vms.get(&id).map(|v| v.domain)
    }

    /// A guest page's state.
    pub fn page_state(&self, id: VmId, g: Gfn) -> Option<PageState> {
        let v = self.vms.get(&id)?;
        (g.0 < v.pages()).then(|| v.state(g))
    }

    /// Whether frame `f` of domain `d` is held (so no other content may take its place).
    pub fn frame_held(&self, d: DomainId, f: FrameId) -> bool {
        self.domains
            .get(&d)
            .is_some_and(|dom| dom.frames.contains(f) && dom.frames.is_used(f))
    }

    /// Guests with commands waiting.
    pub fn vms_with_commands(&self) -> Vec<VmId> {
        self.vms
            .iter()
            .filter(|(_, v)| !v.queue.is_empty())
            .map(|(id, _)| *id)
            .collect()
    }

    /// Guest `id`'s waiting commands, in the order they were queued
    /// ([`Engine::take_commands`] hands them out in send order). Blobs written to its swap
    /// file are synced first, so that swapped pages really leave host memory; if the sync
    /// fails (EIO, a full disk), the stashes to swap are refused here and never sent —
    /// their blobs may not be on disk, and the pages stay in guest RAM (issue 14: a failed
    /// `fdatasync` must not lose a byte).
    fn take_queue(&mut self, id: VmId) -> Vec<Command> {
        let Some(v) = self.vms.get_mut(&id) else {
            return Vec::new();
        };
        let mut cmds = std::mem::take(&mut v.queue);
        let to_swap =
            |c: &Command| matches!(c, Command::Stash { stash, .. } if stash.home == BlobHome::Swap);
        if !cmds.iter().any(to_swap) {
            return cmds;
        }
        let Some(Err(e)) = v.swap.as_mut().map(BlobSpace::sync) else {
            return cmds;
        };
        self.books.swap_sync_errors += 1;
        let now = self.now_us();
        self.budget.swap_failed(now);
        tracing::warn!("{id}: swap file write-back: {e}; its swap-outs are refused");
        let (refused, sent): (Vec<Command>, Vec<Command>) = cmds.drain(..).partition(to_swap);
        // Refused, not NotSent: memfoldd itself refuses them, and a refusal's back-off is
        // wanted while the swap file fails.
        for c in &refused {
            self.outcome(id, c, Outcome::Refused);
        }
        sent
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

    /// Whether a mechanism may act on page `g` of guest `id` now: attached, not opted
    /// out, and private, nothing under way. (An opted-out guest's pages are neither
    /// shared nor stored, nor hints or reference pages for another guest.)
    pub(crate) fn sharable(&self, id: VmId, g: Gfn) -> bool {
        self.vms.get(&id).is_some_and(|v| {
            v.attached && !v.opted_out && v.state(g) == PageState::Private && !v.request_going(g)
        })
    }

    /// Guest `id`'s domain (the guest must exist).
    pub(crate) fn dom(&self, id: VmId) -> DomainId {
        self.vms[&id].domain
    }

    /// Domain `d` (it must exist: every guest's does).
    pub(crate) fn domain(&self, d: DomainId) -> &Domain {
        &self.domains[&d]
    }

    /// Domain `d`, mutably.
    pub(crate) fn domain_mut(&mut self, d: DomainId) -> &mut Domain {
        self.domains
            .get_mut(&d)
            .expect("every guest's domain exists")
    }

    /// A new frame of domain `d`'s pool holding `page` (hashing to `h`), with one pending
    /// request; `None` (counted and logged) if the pool cannot grow or be written (host out
    /// of memory): a share or a reference page is a hint, given up then.
    pub(crate) fn alloc_frame(&mut self, d: DomainId, page: &Page, h: u64) -> Option<FrameId> {
        let dom = self
            .domains
            .get_mut(&d)
            .expect("every guest's domain exists");
        let (f, grow) = dom.frames.alloc(h);
        if let Some(frames) = grow {
            // A frame id is a P2M entry's payload (29 bits): 2 TiB of frames grow no more.
            let room = (frames <= crate::p2m::P2mEntry::MAX_PAYLOAD)
                .then_some(())
                .ok_or_else(|| BackingError::new(format!("{frames} frames"), "no id left"));
            if let Err(e) = room.and_then(|_| dom.pool.resize(frames as u64 * PAGE)) {
                // The table shrinks back: the next alloc asks for the grow again.
                dom.frames.ungrow(f);
                if let Some(n) = self.books.pool_error() {
                    tracing::warn!("pool of {d}: {e}; page left private (error {n})");
                }
                return None;
            }
        }
        let Err(e) = dom.pool.write(f.offset(), page) else {
            if h == self.zero_hash && crate::is_zero_page(page) {
                dom.zero_frames.insert(f);
            }
            return Some(f);
        };
        // A write that failed part-way may have allocated the frame's page: punched, so
        // the pool holds no page its books do not (the frame was free: nothing lost).
        dom.pool.release(f.offset(), PAGE);
        dom.frames.unalloc(f);
        if let Some(n) = self.books.pool_error() {
            tracing::warn!("pool of {d}: {e}; page left private (error {n})");
        }
        None
    }

    /// A share request naming frame `f` of domain `d` ended; frees the frame if nothing
    /// holds it any more.
    pub(crate) fn frame_answer(&mut self, d: DomainId, f: FrameId, mapped: bool) {
        if self.domain_mut(d).frames.answer(f, mapped) {
            self.forget_frame(d, f);
        }
    }

    /// One mapping (or patch) of frame `f` of domain `d` fewer; frees the frame if nothing
    /// holds it any more.
    pub(crate) fn frame_decref(&mut self, d: DomainId, f: FrameId, patch: bool) {
        if self.domain_mut(d).frames.decref(f, patch) {
            self.forget_frame(d, f);
        }
    }

    /// A freed frame leaves the share table and the similarity index (and stops being
    /// the zero frame), and its bytes leave the pool.
    pub(crate) fn forget_frame(&mut self, d: DomainId, f: FrameId) {
        if let Some(i) = self.fills.index.get_mut(&d) {
            i.forget_frame(f);
        }
        let dom = self.domain_mut(d);
        dom.share.remove(dom.frames.hash(f), ShareEntry::Shared(f));
        dom.similar.forget_frame(f);
        dom.withdrawn.remove(&f);
        dom.zero_frames.remove(&f);
        dom.pool.release(f.offset(), PAGE);
    }

    /// Guest `id`'s blob space of `home` (`None`: no such guest, or no swap file).
    pub(crate) fn space(&mut self, id: VmId, home: BlobHome) -> Option<&mut BlobSpace> {
        let v = self.vms.get_mut(&id)?;
        match home {
            BlobHome::Store => Some(&mut v.store),
            BlobHome::Swap => v.swap.as_mut(),
        }
    }

    /// Frees a blob: its slot, its slot bytes in the books, its hold on a reference frame.
    /// The blob's guest must still exist.
    pub(crate) fn release_blob(&mut self, b: BlobId) {
        let blob = self.blobs.remove(b);
        if let Some(space) = self.space(blob.vm, blob.home()) {
            let size = space.slot(blob.slot).size;
            space.free(blob.slot);
            self.books.slot_bytes[kept_index(blob.kept())] -= size as u64;
        }
        if let Some(f) = blob.reference() {
            let d = self.dom(blob.vm);
            self.frame_decref(d, f, true);
        }
    }

    /// Queues a share of page `g` of guest `id` onto `f` (whose pending count the caller
    /// took).
    pub(crate) fn enqueue_share(&mut self, id: VmId, g: Gfn, f: FrameId) {
        self.scan.pass_requests += 1;
        let v = self.vms.get_mut(&id).expect("sharable");
        v.hints.age_reset(g);
        v.set(g, PageState::Sharing(f));
        v.queue.push(Command::Share { gfn: g, frame: f });
        if let Some(t) = self.landed_us {
            v.read_sharing.insert(g, t);
        }
    }
}

/// Index of a kind of kept page in per-kind tables.
pub(crate) fn kept_index(k: Kept) -> usize {
    match k {
        Kept::Patched => 0,
        Kept::Compressed => 1,
        Kept::Swapped => 2,
        Kept::Unmapped => 3,
    }
}

impl VmBooks {
    /// The counter of pages kept out of RAM by `k`.
    pub(crate) fn kept_pages(&mut self, k: Kept) -> &mut u64 {
        match k {
            Kept::Patched => &mut self.patched_pages,
            Kept::Compressed => &mut self.compressed_pages,
            Kept::Swapped => &mut self.swapped_pages,
            Kept::Unmapped => &mut self.unmapped_pages,
        }
    }
}
