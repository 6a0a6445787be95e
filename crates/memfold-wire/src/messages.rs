//! The messages between memfoldd, its agents and its clients (protocol version
//! [`PROTOCOL_VERSION`]).
//!
//! The first message of a connection says who speaks: [`ToDaemon::AgentHello`] (an agent
//! in a QEMU process, with the guest memfd) or [`ToDaemon::ClientHello`] (a command
//! asking for statistics). Pages are named by the typed ids of `memfold-ids`, which the
//! JSON carries as plain numbers.

use memfold_codecs::{CompressCodec, Encoding, PatchCodec};
use memfold_ids::{BaseBlock, BatchId, DiskId, FillId, FrameId, Gfn};
use serde::{Deserialize, Serialize};

use crate::stats::Stats;

/// Protocol version; a peer with another version is refused with a clear message.
/// Version 5: typed blobs in [`StashPage`]; 6: a checksum with every stashed page; 7:
/// the operator's opt-out ([`ToDaemon::OptOut`], [`ToAgent::TakeBack`]); 8: discarded
/// pages ([`ToDaemon::Discarded`]) and the opt-out carried across a restart
/// (`AgentHello::opted_out`); 9: which pages a clock scan arms
/// ([`ToAgent::ClockScan`]`::arm`). Also in 9, without a bump, the agent's
/// [`ToDaemon::RegionUnmapped`]: a memfoldd that does not know it takes it as a malformed
/// message and drops the connection, which the agent closes right after anyway, and an
/// agent that does not send it leaves memfoldd to find the region unmapped in `/proc`.
/// Also in 9, without a bump: the block device's [`ToDaemon::DeviceHello`] and
/// [`ToDaemon::ReadLanded`], which only `memfold-blk` sends (no agent or client of an
/// older memfoldd sends or expects them; an older memfoldd refuses the hello with a
/// message). 10: free-page discard ([`ToAgent::Watch`], [`ToAgent::DiscardFree`] and
/// their replies). 11: pages a clock scan arms for writes only
/// ([`ToAgent::ClockScan`]`::wp_only`: their R comes from the guest's LRU). 12: pages
/// sent to the kernel's swap ([`ToAgent::PageOut`], [`ToDaemon::PageOutDone`],
/// [`ToDaemon::PagedIn`]; issue 15's zswap backing). Also in 12, without a bump,
/// [`ToAgent::ClockScan`]`::zap_shared`: an agent that does not know it ignores it (its
/// shared pages stay mapped, their frames in RAM), and one that does reads it as false
/// from a memfoldd that does not send it. Also in 12, without a bump (no agent sees
/// them): statistics in parts ([`ToClient::StatsVms`], `Stats::vms_following`; a client
/// of before gets a split answer's head with no guests), and a hello's name bounded to
/// [`crate::name::MAX_NAME_BYTES`] printable bytes (refused past it). Also in 12, without
/// a bump, [`ToAgent::LeavePool`]: an agent that does not know it cannot decode the
/// answer to its hello and tries again later, unmanaged, as when it was refused.
pub const PROTOCOL_VERSION: u32 = 12;

/// Largest message, bytes (a share batch of [`MAX_BATCH`] pages is about 12 KiB).
pub const MAX_MESSAGE: usize = 256 * 1024;

/// Most pages in one share or reclaim request.
pub const MAX_BATCH: usize = 512;

/// Most pages in one clock slice ([`ToAgent::ClockScan`]).
pub const CLOCK_SLICE: u32 = 16384;

/// A guest RAM memfd, named by the device and inode numbers `fstat` gives for it: how a
/// block device, which shares the memfd with QEMU (vhost-user), names the guest whose
/// pages it wrote ([`ToDaemon::ReadLanded`]). memfoldd knows each attached guest's.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq, Hash)]
pub struct RamFile {
    /// `st_dev`.
    pub dev: u64,
    /// `st_ino`.
    pub ino: u64,
}

/// What memfold held of a page QEMU discarded ([`ToDaemon::Discarded`]).
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Discarded {
    /// Mapped onto this pool frame.
    Frame(FrameId),
    /// A reclaimed zero page.
    Zero,
    /// A stashed page (a blob in the store or the swap file).
    Stashed,
}

/// What a stashed page's blob is.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum Blob {
    /// A Difference Engine §3.2 patch against a pool frame (which no guest can write).
    Patch {
        /// The patch codec.
        codec: PatchCodec,
        /// The pool frame the patch is made against.
        reference: FrameId,
    },
    /// A §3.3 compressed page.
    Compressed(CompressCodec),
    /// The page itself, 4096 bytes (a page swapped out that neither patched nor
    /// compressed under the cut-off, DE §4.6).
    Raw,
}

impl Blob {
    /// The blob's encoding; `None` for the raw page.
    pub fn encoding(self) -> Option<Encoding> {
        match self {
            Blob::Patch { codec, .. } => Some(Encoding::Patch(codec)),
            Blob::Compressed(codec) => Some(Encoding::Compressed(codec)),
            Blob::Raw => None,
        }
    }

    /// The pool frame a patch is made against; `None` for other blobs.
    pub fn reference(self) -> Option<FrameId> {
        match self {
            Blob::Patch { reference, .. } => Some(reference),
            _ => None,
        }
    }
}

/// Where a stashed page's blob is.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum BlobHome {
    /// The store memfd (host memory).
    Store,
    /// The swap file (DE §4.6, on disk).
    Swap,
}

/// A page to keep as a blob instead of in guest RAM: a Difference Engine §3.2 patch or
/// §3.3 compressed page in the store memfd, or (§4.6) any of these or the raw page in
/// the swap file.
#[derive(Clone, Copy, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct StashPage {
    /// Guest frame.
    pub gfn: Gfn,
    /// What the blob is.
    pub blob: Blob,
    /// Where the blob is.
    pub home: BlobHome,
    /// Byte offset of the blob in its home.
    pub offset: u64,
    /// Blob length, bytes.
    pub len: u32,
    /// The page is stashed already (its blob in the store memfd) and this moves it to
    /// the swap file (DE §4.6: compressed and patched pages are swap candidates too):
    /// the agent replaces its record only if the page is still stashed in the store and
    /// the new blob decodes to the same bytes; otherwise it refuses.
    pub moving: bool,
    /// The page's checksum (`memfold_codecs::page_checksum`): the agent checks every page
    /// it decodes against it and never installs one that differs.
    pub checksum: u64,
}

/// What the agent measured since it started: fault counts and operation latencies as
/// (ns, count) histogram pairs ([`crate::OpLatency::to_pairs`]).
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct AgentReport {
    /// Write faults on write-protected pages (CoW breaks and writers waiting on a share
    /// or reclaim in progress).
    pub wp_faults: u64,
    /// Faults on missing pages (first touches and reclaimed pages), served by the agent.
    pub missing_faults: u64,
    /// Minor faults (first access to a page since the clock re-armed it): served by the
    /// agent as userfaults, or, with the clock's R bits from the page tables
    /// (`MEMFOLD_CLOCK_RBITS=pagemap`), the kernel's, counted at the slice's next scan.
    pub minor_faults: u64,
    /// Share, per page (a run's time divided over its pages).
    pub share_ns: Vec<(u64, u64)>,
    /// CoW break, from reading the fault to waking the writer.
    pub cow_break_ns: Vec<(u64, u64)>,
    /// Missing-fault service, from reading the fault to waking the thread.
    pub fault_ns: Vec<(u64, u64)>,
    /// Reclaim, per page.
    pub reclaim_ns: Vec<(u64, u64)>,
    /// The clock's R/M tracking: minor-fault (R) and write-protect (M) service, from
    /// reading the fault to waking.
    pub track_ns: Vec<(u64, u64)>,
    /// Stash (check a blob still decodes to the page, punch the page), per page.
    pub stash_ns: Vec<(u64, u64)>,
    /// Missing fault on a stashed page: read and decode the blob, install the page.
    pub unstash_ns: Vec<(u64, u64)>,
    /// Bytes of the agent's own record of this region's pages (its page homes and R/M
    /// bits): the agent's metadata in QEMU (issue 19; ESX §4.3 keeps it under 0.5%).
    #[serde(default)]
    pub state_bytes: u64,
    /// Mappings (VMAs) of the agent's QEMU as the agent counts them: its last read of
    /// `/proc/self/maps` (at most 10 s old) plus its own changes since, an upper bound.
    /// Shared pages cost mappings; `vm.max_map_count` caps them (issue 19's VMA wall).
    #[serde(default)]
    pub mappings: u64,
    /// Most mappings the agent lets shares and breaks bring its QEMU to (its VMA budget:
    /// `vm.max_map_count` less QEMU's own room, or `MEMFOLD_VMA_BUDGET`); shares stop at
    /// seven eighths of it. 0: an agent that does not say.
    #[serde(default)]
    pub vma_budget: u64,
    /// CoW breaks that broke a page's whole run of shared pages (at the VMA budget, where
    /// a one-page break would need two mappings more; each of the run's pages is also a
    /// CoW break).
    #[serde(default)]
    pub run_breaks: u64,
    /// Pages broken ahead of a sequential writer, unwritten yet (each also a CoW break):
    /// after two CoW breaks of adjacent pages moments apart, the agent breaks the next
    /// pages on frames in that direction at once instead of one fault each.
    #[serde(default)]
    pub ahead_breaks: u64,
    /// Pages broken without a copy (each also a CoW break): a device's write declared to
    /// overwrite them whole (Satori §4.3's no-copy-on-write), all broken onto zeroed
    /// pages at the first fault of its call.
    #[serde(default)]
    pub nocopy_breaks: u64,
    /// Runs of pages whose PTEs a clock scan dropped, each one `MADV_DONTNEED` and one
    /// remove event the agent reads back: private pages armed (DE §4.2's R bit) and
    /// pages on pool frames, so that their frames can leave RAM
    /// (`ToAgent::ClockScan::zap_shared`).
    #[serde(default)]
    pub clock_zaps: u64,
    /// Runs such a scan protected but left mapped as they were because the page tables
    /// showed none of their pages mapped (nothing to drop; the clock's `pagemap` mode
    /// only).
    #[serde(default)]
    pub clock_zaps_skipped: u64,
}

/// Messages to memfoldd.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToDaemon {
    /// An agent attaches its guest. Carries the guest RAM memfd; when re-attaching after a
    /// memfoldd restart also the pool memfd and a memfd listing its pool mappings.
    AgentHello {
        /// Protocol version.
        version: u32,
        /// Guest name: at most [`crate::name::MAX_NAME_BYTES`] bytes of printable
        /// characters ([`crate::name::check_name`]), or the hello is refused.
        name: String,
        /// QEMU's pid.
        pid: u32,
        /// Guest RAM, bytes.
        ram_bytes: u64,
        /// Pages mapped onto pool frames or reclaimed: the third descriptor holds as many
        /// entries of a re-attach list ([`crate::reattach`]; a list too long for one
        /// message).
        shared: u64,
        /// The operator opted this guest out of memfold ([`ToDaemon::OptOut`]) and has not
        /// opted it back in: a memfoldd it re-attaches to after a restart keeps it out.
        opted_out: bool,
    },
    /// Result of a [`ToAgent::Share`] request.
    ShareDone {
        /// The request's batch.
        batch: BatchId,
        /// Pages now mapped onto their frame.
        shared: Vec<Gfn>,
        /// Pages whose content no longer matched the frame (left private).
        changed: Vec<Gfn>,
        /// Pages not shared for another reason (already shared, VMA budget reached).
        refused: Vec<Gfn>,
    },
    /// Copy-on-write breaks done by the agent: (page, frame it left).
    CowBroken {
        /// (page, frame) pairs.
        breaks: Vec<(Gfn, FrameId)>,
    },
    /// Result of a [`ToAgent::ReclaimZero`] request.
    ReclaimDone {
        /// The request's batch.
        batch: BatchId,
        /// Pages now holes in the guest memfd.
        reclaimed: Vec<Gfn>,
        /// Pages no longer zero (left as they are).
        changed: Vec<Gfn>,
        /// Pages not reclaimed for another reason (shared or reclaimed already).
        refused: Vec<Gfn>,
    },
    /// Result of a [`ToAgent::Stash`] request.
    StashDone {
        /// The request's batch.
        batch: BatchId,
        /// Pages now holes in the guest memfd, their content in the store.
        stashed: Vec<Gfn>,
        /// Pages whose content no longer decodes from the blob (left as they are).
        changed: Vec<Gfn>,
        /// Pages not stashed for another reason (not private, unreadable blob).
        refused: Vec<Gfn>,
    },
    /// Stashed pages the guest accessed again: the agent decoded them back (private).
    Unstashed {
        /// Pages.
        gfns: Vec<Gfn>,
    },
    /// Reclaimed pages the guest accessed again: the agent filled them (private again).
    Refilled {
        /// Pages.
        gfns: Vec<Gfn>,
    },
    /// Pages QEMU discarded (punched out of guest RAM and unmapped: a balloon, free page
    /// reporting, virtio-mem) that memfold held: each with what the agent held, now a hole
    /// reading as zeros.
    Discarded {
        /// (page, what it was).
        pages: Vec<(Gfn, Discarded)>,
    },
    /// R and M bits of a clock slice since it was last armed (DE §4.2), answering
    /// [`ToAgent::ClockScan`]: bit k of word k/64 is page `first + k`.
    ClockBits {
        /// The request's batch.
        batch: BatchId,
        /// First page of the slice.
        first: Gfn,
        /// Pages in the slice.
        count: u32,
        /// Referenced bits.
        referenced: Vec<u64>,
        /// Modified bits.
        modified: Vec<u64>,
    },
    /// The agent's fault counts and latencies, sent about once a second.
    AgentStats(AgentReport),
    /// A command line client attaches (then sends [`ToDaemon::Stats`]).
    ClientHello {
        /// Protocol version.
        version: u32,
    },
    /// Asks for [`ToClient::Stats`].
    Stats,
    /// Asks for [`ToClient::Census`]: every guest page by content now (Satori §6.1's
    /// sharing potential). O(guest memory) in memfoldd: for measurements.
    Census,
    /// A block device (`memfold-blk`, Satori §4.1) attaches: it sends
    /// [`ToDaemon::ReadLanded`] from now on, and nothing is answered. Only root or
    /// memfoldd's own user may (a device's reports make memfoldd read guest pages).
    DeviceHello {
        /// Protocol version.
        version: u32,
        /// The read-only base images the device serves (Satori §4.1), one descriptor each
        /// in this order: memfoldd checks each id against its descriptor's file and reads
        /// blocks from it to check what a frame holds (Satori §5.2) — never trusting a
        /// guest page for a block's bytes.
        #[serde(default)]
        bases: Vec<DiskId>,
    },
    /// Guest pages a disk read just filled (Satori §4.1): pages (file offset / 4 KiB) of
    /// the guest RAM memfd `ram`, each written whole by the read, at most [`MAX_BATCH`].
    /// A hint: memfoldd reads, hashes and compares the pages itself, and the agent
    /// compares again under write-protection before anything is shared.
    ReadLanded {
        /// The guest RAM memfd the pages are in.
        ram: RamFile,
        /// The pages.
        gfns: Vec<Gfn>,
        /// When the read's data was in guest RAM: `CLOCK_MONOTONIC`, ns (0: not said).
        /// memfoldd times each share made at read from then.
        #[serde(default)]
        landed_ns: u64,
        /// Pages of `gfns` (by index) that came from a base block the hello listed.
        #[serde(default)]
        bases: Vec<(u32, BaseBlock)>,
    },
    /// A block device asks that a read be served from frames (Satori §5.2): it wrote
    /// `nonce` at the start of each page and waits, up to a time of its own, for
    /// [`ToDevice::Filled`]; pages not filled it reads from the disk. Blocks of bases
    /// its hello listed, at most [`MAX_BATCH`] pages.
    FillRead {
        /// The guest RAM memfd the pages are in.
        ram: RamFile,
        /// The device's request, echoed.
        fill: FillId,
        /// What the device wrote at the start of each page (never zero).
        nonce: [u64; 2],
        /// (page, base block) pairs.
        pages: Vec<(Gfn, BaseBlock)>,
    },
    /// The operator takes guest `name` out of memfold (`out`: every page it holds taken
    /// back, nothing shared or stored again, as KSM's `MADV_UNMERGEABLE`) or back in.
    /// Answered with [`ToClient::OptedOut`] or [`ToClient::Error`].
    OptOut {
        /// The guest's name.
        name: String,
        /// Out (true) or back in (false).
        out: bool,
    },
    /// The agent's guest RAM region is no longer mapped in QEMU (a memory backend deleted
    /// after hot-unplug, `object_del`): the agent detached and its connection closes next,
    /// while QEMU runs on. The last message of a connection; optional (see
    /// [`PROTOCOL_VERSION`]).
    RegionUnmapped,
    /// Result of a [`ToAgent::Watch`] request.
    WatchDone {
        /// The request's batch.
        batch: BatchId,
        /// Pages now watched: write-protected, their watch bits set.
        watched: Vec<Gfn>,
        /// Pages not watched (not private, past guest RAM).
        refused: Vec<Gfn>,
    },
    /// Result of a [`ToAgent::DiscardFree`] request.
    DiscardDone {
        /// The request's batch.
        batch: BatchId,
        /// Pages now holes in the guest memfd, reading as zeros on their next access.
        discarded: Vec<Gfn>,
        /// Pages written (or possibly written: a writer in another process held them)
        /// since they were watched, left as they are.
        changed: Vec<Gfn>,
        /// Pages not discarded for another reason (not private, the punch failed).
        refused: Vec<Gfn>,
    },
    /// Result of a [`ToAgent::PageOut`] request.
    PageOutDone {
        /// The request's batch.
        batch: BatchId,
        /// Pages that left RAM: their bytes are in the kernel's swap (zswap), guest RAM's
        /// memfd still names them, and the next access is the kernel's swap-in.
        paged: Vec<Gfn>,
        /// Pages still in RAM: mapped by another process or by QEMU (used since the clock
        /// armed them), a hole, or no swap to take them. Left as they are.
        resident: Vec<Gfn>,
        /// Pages not paged out for another reason (not private, past guest RAM, paged
        /// out already).
        refused: Vec<Gfn>,
    },
    /// Pages the agent had paged out ([`ToAgent::PageOut`]) that are no longer in the
    /// kernel's swap: in RAM again (the guest touched them and the kernel swapped them in,
    /// swap readahead brought them with a neighbour, or anything else read the memfd),
    /// found at a clock scan of their slice; or discarded by QEMU (a hole now). Sent with
    /// the agent's events, after the scan's [`ToDaemon::ClockBits`]; at most
    /// [`MAX_BATCH`] pages a message.
    PagedIn {
        /// Pages.
        gfns: Vec<Gfn>,
    },
    /// Result of a [`ToAgent::TakeBack`] request.
    TakeBackDone {
        /// The request's batch.
        batch: BatchId,
        /// Pages private again (reported as CoW breaks, decodes or refills first).
        taken: Vec<Gfn>,
        /// Pages not taken back (a blob that does not decode, a VMA limit).
        refused: Vec<Gfn>,
    },
}

impl ToDaemon {
    /// The message's kind, as its JSON's `type` names it (`share_done`): what memfoldd
    /// says of a message it did not expect, rather than its content (the peer's words,
    /// up to a message long).
    pub fn kind(&self) -> &'static str {
        match self {
            ToDaemon::AgentHello { .. } => "agent_hello",
            ToDaemon::ShareDone { .. } => "share_done",
            ToDaemon::CowBroken { .. } => "cow_broken",
            ToDaemon::ReclaimDone { .. } => "reclaim_done",
            ToDaemon::StashDone { .. } => "stash_done",
            ToDaemon::Unstashed { .. } => "unstashed",
            ToDaemon::Refilled { .. } => "refilled",
            ToDaemon::Discarded { .. } => "discarded",
            ToDaemon::ClockBits { .. } => "clock_bits",
            ToDaemon::AgentStats(_) => "agent_stats",
            ToDaemon::ClientHello { .. } => "client_hello",
            ToDaemon::Stats => "stats",
            ToDaemon::Census => "census",
            ToDaemon::DeviceHello { .. } => "device_hello",
            ToDaemon::ReadLanded { .. } => "read_landed",
            ToDaemon::FillRead { .. } => "fill_read",
            ToDaemon::OptOut { .. } => "opt_out",
            ToDaemon::RegionUnmapped => "region_unmapped",
            ToDaemon::WatchDone { .. } => "watch_done",
            ToDaemon::DiscardDone { .. } => "discard_done",
            ToDaemon::PageOutDone { .. } => "page_out_done",
            ToDaemon::PagedIn { .. } => "paged_in",
            ToDaemon::TakeBackDone { .. } => "take_back_done",
        }
    }
}

/// Messages to an agent.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToAgent {
    /// The guest is attached; carries the pool memfd, the store memfd (blobs of stashed
    /// pages) and, when memfoldd keeps a host memory budget, the swap file.
    Welcome {
        /// Protocol version.
        version: u32,
    },
    /// memfoldd will not manage this guest, and says why; the connection closes.
    Refused {
        /// Why.
        message: String,
    },
    /// An answer to a re-attach's hello, in place of a welcome: the guest is kept alone
    /// (never-share, Satori §4.3, or the `vm` rule) and the pool it brings is one memfoldd
    /// will not adopt for it (other processes hold it: it was shared under an earlier
    /// memfoldd and another rule). The agent copies every page off the pool's frames,
    /// lets the pool go and attaches again with none; the connection closes. Sent only
    /// to a hello that brought a pool; an agent that gets it otherwise takes it as a
    /// refusal.
    LeavePool {
        /// Why.
        message: String,
    },
    /// Map these guest pages onto these pool frames if their content still equals the
    /// frame's: (page, frame) pairs, at most [`MAX_BATCH`].
    Share {
        /// The batch, echoed in the reply.
        batch: BatchId,
        /// (page, frame) pairs.
        pages: Vec<(Gfn, FrameId)>,
    },
    /// Fill these guest pages from these pool frames instead of a disk read (Satori §5.2,
    /// `get_ro_ref` + `share_mfns`): map each page onto its frame if the page still
    /// begins with `nonce` (the 16 bytes the block device wrote there before asking, in
    /// native byte order), checked with the page write-protected; a page the device
    /// wrote since (it gave up waiting and read the disk) no longer begins with it and
    /// is refused. Answered with [`ToDaemon::ShareDone`] (`changed`: nonce gone). At most
    /// [`MAX_BATCH`] pairs.
    Fill {
        /// The batch, echoed in the reply.
        batch: BatchId,
        /// (page, frame) pairs.
        pages: Vec<(Gfn, FrameId)>,
        /// The device's nonce.
        nonce: [u64; 2],
    },
    /// Take these guest pages back as private pages, whatever memfold made of them: copy a
    /// shared frame into guest RAM (a CoW break), decode a stored page, let a reclaimed
    /// zero page be a plain hole; report each as that event. At most [`MAX_BATCH`].
    TakeBack {
        /// The batch, echoed in the reply.
        batch: BatchId,
        /// Pages.
        gfns: Vec<Gfn>,
    },
    /// The operator opted this guest out of memfold (`out`) or back in: the agent
    /// remembers it and says so in the hello of its next re-attach
    /// (`ToDaemon::AgentHello::opted_out`), so that a restarted memfoldd keeps it out. Not
    /// answered.
    OptedOut {
        /// Out (true) or back in (false).
        out: bool,
    },
    /// Reclaim these guest pages if they are still all zero: punch them out of the guest
    /// memfd; the next access faults (missing) and the agent fills a zero page (ESX §4.3's
    /// zero page, without a frame or a mapping: no VMA is spent). At most [`MAX_BATCH`].
    ReclaimZero {
        /// The batch, echoed in the reply.
        batch: BatchId,
        /// Pages.
        gfns: Vec<Gfn>,
    },
    /// Keep these guest pages as blobs already written to the store memfd or the swap
    /// file, if each blob still decodes to the page's bytes: punch the pages out of the
    /// guest memfd; the next access faults (missing) and the agent decodes the page back.
    /// A hint: the agent refuses pages it cannot check. At most [`MAX_BATCH`].
    Stash {
        /// The batch, echoed in the reply.
        batch: BatchId,
        /// The pages and their blobs.
        pages: Vec<StashPage>,
    },
    /// Watch these private guest pages for a free-page discard (issue 17; PV §3.1):
    /// write-protect each and set its watch bit, which any write to the page, or any
    /// change of its home, clears. Answered with [`ToDaemon::WatchDone`]. At most
    /// [`MAX_BATCH`].
    Watch {
        /// The batch, echoed in the reply.
        batch: BatchId,
        /// Pages.
        gfns: Vec<Gfn>,
    },
    /// Discard these guest pages, which the guest reported free in a report asked for
    /// after their [`ToDaemon::WatchDone`]: punch out of the guest memfd each page whose
    /// watch bit is still set (no write reached it since it was watched) and that no
    /// writer in another process holds; its next access reads zeros. Its content is
    /// not kept: the guest said it holds none. Answered with [`ToDaemon::DiscardDone`].
    /// At most [`MAX_BATCH`].
    DiscardFree {
        /// The batch, echoed in the reply.
        batch: BatchId,
        /// Pages.
        gfns: Vec<Gfn>,
    },
    /// Send these private guest pages to the kernel's swap (issue 15: memfold the policy,
    /// the kernel the mechanism; zswap when the host has it on): `MADV_PAGEOUT` through
    /// a mapping of the agent's own, which takes a page only if nothing else maps it (the
    /// clock's zap left QEMU's PTE dropped: a page unused since it was armed). The bytes
    /// never leave guest RAM's memfd, so no check is needed: the kernel swaps the page in
    /// at its next access, in the kernel, with no userfault under the `pagemap` clock's
    /// registration. Answered with [`ToDaemon::PageOutDone`]. At most [`MAX_BATCH`].
    PageOut {
        /// The batch, echoed in the reply.
        batch: BatchId,
        /// Pages.
        gfns: Vec<Gfn>,
    },
    /// Report the R and M bits of pages `[first, first+count)` since they were last armed,
    /// and arm those `arm` names again: write-protect private pages (a write faults: M)
    /// and zap their PTEs (any access faults as minor: R); the others are left as they
    /// are. At most [`CLOCK_SLICE`] pages.
    ClockScan {
        /// The batch, echoed in the reply.
        batch: BatchId,
        /// First page.
        first: Gfn,
        /// Pages.
        count: u32,
        /// Pages to arm: bit k of word k/64 for page `first + k` (missing words: none).
        arm: Vec<u64>,
        /// Of those, pages to write-protect only, not zap (same layout; missing words:
        /// none): an enlightened guest's LRU says whether they were used (issue 17), so
        /// reads need not fault. Their writes still fault: M stays exact.
        #[serde(default)]
        wp_only: Vec<u64>,
        /// Also drop the PTEs of the slice's pages mapped onto pool frames, keeping them
        /// write-protected (a write is still a CoW break): a frame no guest reads again is
        /// then mapped by no process, and memfoldd's `MADV_PAGEOUT` of the pool can take
        /// it (issue 15, cold shared frames to zswap). A read maps the frame back with the
        /// kernel's own minor fault. Absent (an older memfoldd): false.
        #[serde(default)]
        zap_shared: bool,
    },
}

/// The guests' pages by content at one instant ([`ToDaemon::Census`]): the sharing
/// potential, as Satori §6.1 measures it from memory snapshots.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct CensusStats {
    /// Pages counted (all guests).
    pub pages: u64,
    /// Of those, zero pages (never written, reclaimed, or written with zeros).
    pub zero_pages: u64,
    /// Pages whose content is not known without decoding (stored).
    pub unknown_pages: u64,
    /// Distinct non-zero contents.
    pub distinct: u64,
    /// The sharing potential: for each non-zero content n pages hold, n − 1, pages.
    pub duplicate_pages: u64,
}

/// Messages to a block device (Satori §5.2), on its connection.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToDevice {
    /// These base blocks are held by frames now: a read of one may be served from its
    /// frame ([`ToDaemon::FillRead`]). A hint: a frame may be gone by the time of the read
    /// (the fill then leaves the page to the disk). At most [`MAX_BATCH`].
    Held {
        /// Blocks.
        blocks: Vec<BaseBlock>,
    },
    /// The answer to a [`ToDaemon::FillRead`]: these pages now hold their blocks, mapped
    /// onto frames; the device must not write them (the others are its to read).
    Filled {
        /// The device's request.
        fill: FillId,
        /// Pages filled.
        gfns: Vec<Gfn>,
    },
}

/// Messages to a client.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum ToClient {
    /// The daemon's statistics; when they are too large for one message, a head whose
    /// [`Stats::vms_following`] guests follow in [`ToClient::StatsVms`] parts
    /// ([`crate::stats_parts`]).
    Stats(Box<Stats>),
    /// A part of the guests' statistics following a [`ToClient::Stats`] head, in order
    /// (at most [`crate::stats_parts::STATS_PART_BYTES`] of JSON unless one guest alone
    /// is larger). Added within version 12: only a reader asking for statistics gets it.
    StatsVms {
        /// Guests.
        vms: Vec<crate::stats::VmStats>,
    },
    /// The census asked for.
    Census(CensusStats),
    /// A [`ToDaemon::OptOut`] was carried out: `pages` pages are being taken back (0 for
    /// an opt-in).
    OptedOut {
        /// Pages queued to be taken back.
        pages: u32,
    },
    /// The request was refused.
    Error {
        /// Why.
        message: String,
    },
}
