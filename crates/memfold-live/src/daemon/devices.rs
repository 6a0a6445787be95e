//! Block devices (`memfold-blk`, Satori §4.1, §5.2): their reports of pages disk reads
//! filled, their requests to have reads served from frames, and what memfoldd tells
//! them back.
//!
//! Trust: a device is an operator's process (its hello is heard from root or memfoldd's
//! own user only, `readers.rs`), but its peer QEMU is not, so nothing a device says about
//! a page's content is believed:
//! - a base image is named by the descriptor the device passes in its hello, checked
//!   against the id it claims (`fstat`), and only bases so checked are taken — under
//!   an id, only the file first taken under it, while anything of it is in use
//!   ([`Devices::hello`]);
//! - which frame holds a base block is learnt from the base's own bytes, read here
//!   through that descriptor, never from a guest page ([`memfold_core::engine::fill`]),
//!   and only while the file's id is the one the block names: the id covers the bytes
//!   (size and mtime, [`DiskId::of_file`]), so a base rewritten in place is another
//!   disk, whose reads are never filled with frames of its old bytes;
//! - a fill maps a frame over a page only where the agent finds the device's nonce
//!   under write-protection, so a device that gave up waiting loses nothing.
//!
//! A device sees only answers to its own requests, for pages of the guest whose RAM it
//! names; which base blocks frames hold it is told for its own bases only, and only of
//! its guest's sharing domain: a block held by another tenant's frames must not make
//! this guest's reads of it slower or faster (a fill is refused across domains anyway,
//! but the device would ask, and the time it takes would tell). A device that names its
//! guest after blocks were learnt (restarted, or serving a guest started later) is told
//! of those its guest's domain holds of its bases then, at most [`MAX_CATCH_UP`], and of
//! each block learnt after as it is.
//!
//! # The invariant
//!
//! **A device acts only on guest RAM its process holds.** A report or fill names its
//! guest's RAM by `(st_dev, st_ino)`: two numbers the device chooses. Believed as said,
//! a device serving guest b (and the untrusted QEMU behind it) could name guest a's RAM:
//! have a's pages that begin with a nonce it chose (a common page prefix) mapped over
//! with base blocks, and hear which blocks a's domain holds. So memfoldd looks among the
//! device process's descriptors (`/proc/PID/fd`, its pid from the kernel at its hello)
//! for that RAM memfd — QEMU sent it in `SET_MEM_TABLE`, and vhost-user-backend keeps it
//! open ([`holds_file`]) — and takes RAM found there while it is an attached guest's,
//! bound to that guest ([`Device::rams`]). Whoever holds a guest's RAM memfd can read and
//! write that RAM anyway: the check gives a device nothing it did not have. A message
//! naming RAM not found so is dropped (a fill answered empty), logged once per device,
//! and never makes that RAM's guest the device's ([`Device::vm`]). A failed look is made
//! again at most once a second per device ([`LOOK_AGAIN`]): the guest may attach after
//! the device first names it, and a device naming many guests' RAM costs memfoldd one
//! look a second. memfoldd runs as root or as the device's user (no other device is
//! heard), so it may read the device's descriptors. The pid is the one the device
//! connected from, held by a pidfd taken at its hello (`SO_PEERPIDFD`): a look is
//! believed only if that process still runs after it, so the pid cannot have been freed
//! and reused meanwhile — a device that hands its connection to another process and
//! exits holds no RAM from then on, whatever process its pid names later (on a kernel
//! before 6.5, without `SO_PEERPIDFD`, the pidfd is opened by pid at the hello: a pid
//! reused before then would pass, [`memfold_sys::pidfd::of_peer`]). The device
//! could instead pass the memfd with its
//! messages; the look needs no change to the protocol, and a device that holds the
//! memfd passes either way. Found by a read-only review, 2026-12; test
//! `device_ram_proof.rs`, which fails without the check.
//!
//! memfoldd's main thread serves every guest: what it sends a device never waits
//! ([`Device::send`]).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::fs::File;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use memfold_core::engine::fill::MAX_WAITING;
use memfold_core::engine::BlockCandidate;
use memfold_core::ids::{BaseBlock, DiskId, DomainId, FillId, Gfn, VmId};
use memfold_core::{Engine, Page, PAGE_SIZE};
use memfold_sys::files::LeaseError;
use memfold_wire::{Conn, ToDaemon, ToDevice, MAX_BATCH};

use super::guests::Guests;

/// Base blocks read to check candidates per main-loop step at most (each one disk read,
/// ~10–100 µs); the rest wait for the next step.
const MAX_CHECKS_PER_STEP: usize = 256;

/// A page, aligned for `O_DIRECT` reads (the device's base descriptor is `O_DIRECT`).
#[repr(C, align(4096))]
struct AlignedPage([u8; PAGE_SIZE]);

struct Device {
    token: u64,
    conn: Conn,
    bases: HashMap<DiskId, File>,
    /// The guest whose RAM its reports and fills name (the last one named, of those it
    /// holds); none until its first: no news of held blocks until then. When it names
    /// a guest, it is told of the blocks that guest's domain holds already
    /// ([`Device::catch_up`]), then of each block as it is learnt.
    vm: Option<VmId>,
    /// Blocks the domains of its guests held when it named them, each with its domain,
    /// not told yet: at most [`MAX_CATCH_UP`], sent as its socket has room
    /// ([`Device::send_catch_up`]), also after it names a guest of another domain (it
    /// holds RAM of both).
    catch_up: Vec<(DomainId, BaseBlock)>,
    /// The sharing domains it was caught up on (at most [`MAX_RAM_FILES`]: one a RAM
    /// file it holds): a catch-up is listed once a domain, not at each change of guest (a
    /// QEMU with several RAM regions is several guests — of one domain, or under the
    /// `vm` rule and never-share of one each — and a device serving it names them in
    /// turn). Forgotten when its guest is gone: a guest it names then is caught up anew.
    caught_up: Vec<DomainId>,
    /// The device's pid (from the kernel at its hello): whose descriptors are looked at.
    pid: u32,
    /// A pidfd of the process that connected (module docs): while it runs, `pid` is its.
    pidfd: OwnedFd,
    /// Guest RAM files (`st_dev`, `st_ino`) found among the device's descriptors, each
    /// with the guest whose RAM it was then: at most [`MAX_RAM_FILES`]. Bound to that
    /// guest, so that a file number the kernel gives a later guest's RAM once this one
    /// is freed is not taken as found.
    rams: HashMap<(u64, u64), VmId>,
    /// When a look for RAM not found may be made again ([`LOOK_AGAIN`]).
    next_look: Instant,
    /// Whether its naming of RAM it does not hold was logged (once a connection).
    told_unheld: bool,
    /// Its connection failed (the device gone): nothing more is sent.
    closed: bool,
    /// Messages dropped because its socket was full.
    dropped: u64,
    /// Whether a full socket was logged (once a connection).
    told_full: bool,
}

impl Device {
    /// Sends `m` if the device's socket has room for it now; false if not sent. Never
    /// waits: a device that does not read must not stall memfoldd, whose main thread
    /// serves every guest (it waited out a 2 s send timeout here). What does not fit is
    /// dropped, counted and said once a connection, and the connection kept: held-block
    /// news are hints (a block not announced is read from the disk), and a fill answer
    /// not received is waited for 20 ms by the device, which then reads the disk. An
    /// honest device whose reader was off the CPU for a moment (full-size news fill the
    /// socket's buffer in about a dozen messages) loses some news, not its connection:
    /// closed, it would lose every block it was told, and a new connection is told at
    /// most [`MAX_CATCH_UP`] of them again.
    /// A connection that failed otherwise (the device gone) is shut down.
    fn send(&mut self, m: &ToDevice) -> bool {
        if self.closed {
            return false;
        }
        match self.conn.try_send(m) {
            Ok(true) => true,
            Ok(false) => {
                self.dropped += 1;
                if !self.told_full {
                    self.told_full = true;
                    tracing::warn!(
                        "block device {}: its socket is full (it is not reading now); \
                         messages to it are dropped until it reads (logged once a connection)",
                        self.token
                    );
                }
                false
            }
            Err(e) => {
                self.close(e);
                false
            }
        }
    }

    /// Its connection failed with `e` (the device gone): shut down, nothing more sent.
    fn close(&mut self, e: impl std::fmt::Display) {
        tracing::warn!("block device {}: {e}; its connection is closed", self.token);
        self.conn.shutdown();
        self.closed = true;
        self.catch_up = Vec::new();
    }

    /// Sends the next part of [`Device::catch_up`] (one message, at most [`MAX_BATCH`]
    /// blocks, a step: a message of them is about the socket's buffer, and fill answers
    /// and news must find room) if its socket has room; never waits, drops nothing: the
    /// rest goes at a later step. Blocks their domain no longer holds (`held` says; a
    /// domain gone holds none) are left out as they come (each would cost the device a
    /// fill refused).
    fn send_catch_up(&mut self, held: &dyn Fn(DomainId, BaseBlock) -> bool) {
        if self.catch_up.is_empty() || self.closed {
            return;
        }
        let from = self.catch_up.len().saturating_sub(MAX_BATCH);
        let blocks: Vec<BaseBlock> = self.catch_up[from..]
            .iter()
            .filter(|&&(d, b)| held(d, b))
            .map(|&(_, b)| b)
            .collect();
        let sent = blocks.is_empty()
            || match self.conn.try_send(&ToDevice::Held { blocks }) {
                Ok(sent) => sent,
                Err(e) => {
                    self.close(e);
                    return;
                }
            };
        if sent {
            self.catch_up.truncate(from);
        }
        if self.catch_up.is_empty() {
            self.catch_up = Vec::new();
        }
    }

    /// Tells the device that frames of `domain` hold `blocks` (of its bases). While a
    /// catch-up is being sent they join it (up to [`MAX_CATCH_UP`] in all), where they
    /// would otherwise find its socket full and be dropped.
    fn tell_held(&mut self, domain: DomainId, blocks: &[BaseBlock]) {
        if !self.catch_up.is_empty() {
            let room = MAX_CATCH_UP.saturating_sub(self.catch_up.len());
            self.catch_up
                .extend(blocks.iter().take(room).map(|&b| (domain, b)));
            return;
        }
        for chunk in blocks.chunks(MAX_BATCH) {
            let held = ToDevice::Held {
                blocks: chunk.to_vec(),
            };
            if !self.send(&held) {
                return;
            }
        }
    }

    /// The guest whose RAM file `ram` (`st_dev`, `st_ino`) is, if it is an attached
    /// guest's and the device holds it ([module docs](self)).
    fn guest_of(&mut self, guests: &Guests, ram: (u64, u64)) -> Option<VmId> {
        let vm = guests.vm_of_ram(ram)?;
        if self.rams.get(&ram) == Some(&vm) {
            return Some(vm);
        }
        let now = Instant::now();
        if now < self.next_look {
            return None;
        }
        // RAM of guests gone (hot-unplugged regions) makes room for new.
        self.rams.retain(|r, v| guests.vm_of_ram(*r) == Some(*v));
        if self.rams.len() < MAX_RAM_FILES && holds_file(self.pid, self.pidfd.as_fd(), ram) {
            self.rams.insert(ram, vm);
            return Some(vm);
        }
        self.next_look = now + LOOK_AGAIN;
        if !self.told_unheld {
            self.told_unheld = true;
            tracing::warn!(
                "block device {} (pid {}): names guest RAM {}:{}, which it does not hold; \
                 its reports and fills of RAM it does not hold are dropped (logged once \
                 a connection)",
                self.token,
                self.pid,
                ram.0,
                ram.1
            );
        }
        None
    }
}

/// Blocks a device is told of at most when it names its guest after they were learnt
/// (16 bytes each: 1 MiB a device; 256 MiB of base blocks filled from frames).
const MAX_CATCH_UP: usize = 1 << 16;

/// Guest RAM files one device connection may hold at most: a device serves one guest,
/// whose RAM is one memfd (q35 maps it in two regions) or a few.
const MAX_RAM_FILES: usize = 16;

/// Least time between two looks of one device for RAM not found (module docs).
const LOOK_AGAIN: Duration = Duration::from_secs(1);

/// Descriptors of a device looked at at most in one look: a device holds tens (its RAM
/// regions, disk files, sockets, eventfds); one that opened a million must not make a
/// look cost memfoldd's main thread seconds (a `stat` each, ~1–2 µs).
const MAX_FDS_LOOKED: usize = 4096;

/// Whether process `pid` holds a descriptor of the memfd `(dev, ino)` among its first
/// [`MAX_FDS_LOOKED`]: a `stat` of each entry of `/proc/PID/fd` whose link names a memfd
/// (`/memfd:...`; nothing is opened, and no other file is stat'ed: a device's disk on a
/// hung NFS or FUSE mount would hold memfoldd's main thread). Guest RAM memfold manages
/// is a memfd. Tens of µs for a device. False unless `pidfd`'s process still runs after
/// the look: `pid` was then its own throughout (a pid is freed only once its process has
/// exited), not a later process's.
fn holds_file(pid: u32, pidfd: BorrowedFd<'_>, (dev, ino): (u64, u64)) -> bool {
    let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/fd")) else {
        return false;
    };
    let memfds = dir.flatten().take(MAX_FDS_LOOKED).filter(|e| {
        std::fs::read_link(e.path())
            .is_ok_and(|l| l.as_os_str().as_encoded_bytes().starts_with(b"/memfd:"))
    });
    super::guests::holds(memfds, dev, ino) && memfold_sys::pidfd::alive(pidfd)
}

/// The block devices attached, by connection.
#[derive(Default)]
pub(crate) struct Devices {
    by_token: BTreeMap<u64, Device>,
    /// Fills under way: memfoldd's id → (connection, the device's id).
    fills: HashMap<FillId, (u64, FillId)>,
    next_fill: u64,
    /// Candidates waiting to be checked against their base, oldest first: at most
    /// [`MAX_WAITING`], as in the engine (shares at read faster than
    /// [`MAX_CHECKS_PER_STEP`] a step, sustained, grew it without bound).
    unchecked: VecDeque<BlockCandidate>,
    /// Candidates dropped with [`MAX_WAITING`] waiting (cumulative): their blocks are
    /// not learnt as held, nothing else.
    pub(crate) unchecked_dropped: u64,
    /// Pages filled from frames, all devices (cumulative).
    pub(crate) filled: u64,
    /// Fill requests answered, all devices (cumulative).
    pub(crate) fills_answered: u64,
    /// Base blocks read to check what a frame holds (cumulative).
    pub(crate) blocks_checked: u64,
    /// The file (`st_dev`, `st_ino`) taken under each disk id, while a connected device
    /// serves it or the engine indexes blocks of it ([`Devices::hello`]'s invariant).
    base_files: HashMap<DiskId, (u64, u64)>,
}

/// Disk ids [`Devices::base_files`] holds before it forgets those no device serves and
/// no frame holds a block of ([`Devices::forget_unused_bases`]).
const MAX_BASE_FILES: usize = 1024;

impl Devices {
    /// Device connection `token` of process `pid` (held by `pidfd`, taken from the
    /// connection) said hello, serving the checked `bases`.
    pub(crate) fn hello(
        &mut self,
        token: u64,
        conn: Conn,
        bases: Vec<(DiskId, File)>,
        (pid, pidfd): (u32, OwnedFd),
    ) {
        // INVARIANT: one disk id, one file. An id is a 64-bit hash of the file's device,
        // inode, size and mtime (`DiskId::of_file`), and a candidate is checked through
        // any device's file of its id: two files of one id (a collision someone who sets
        // a base's size and mtime might aim for) would have one guest's reads filled
        // with another file's bytes. So the first file taken under an id is the id's for
        // as long as a device serves it or a frame holds a block learnt under it
        // (`base_files`): another file under that id is not taken, whether or not the
        // device that brought the first is still connected (blocks stay indexed after it
        // left, and would be served for the second file's reads).
        let file_of = |f: &File| {
            use std::os::unix::fs::MetadataExt;
            f.metadata().ok().map(|m| (m.dev(), m.ino()))
        };
        let base_files = &mut self.base_files;
        let bases: HashMap<DiskId, File> = bases
            .into_iter()
            .filter(|(id, f)| {
                let taken = match (file_of(f), base_files.get(id)) {
                    (None, _) => false,
                    (Some(file), Some(&first)) => file == first,
                    (Some(file), None) => {
                        base_files.insert(*id, file);
                        true
                    }
                };
                if !taken {
                    tracing::warn!(
                        "block device {token}: {id} names another file than the one taken \
                         under it before (or one whose identity cannot be read); not taken"
                    );
                }
                taken
            })
            .collect();
        self.by_token.insert(
            token,
            Device {
                token,
                conn,
                bases,
                vm: None,
                catch_up: Vec::new(),
                caught_up: Vec::new(),
                pid,
                pidfd,
                rams: HashMap::new(),
                next_look: Instant::now(),
                told_unheld: false,
                closed: false,
                dropped: 0,
                told_full: false,
            },
        );
    }

    /// Past [`MAX_BASE_FILES`] disk ids, forgets the files of those that no connected
    /// device serves and of which `indexed` (called then only: the disks the engine's
    /// frames hold blocks of, [`memfold_core::Engine::indexed_disks`]) holds no block: an
    /// id forgotten so has nothing left that another file under it could be served.
    pub(crate) fn forget_unused_bases<I>(&mut self, indexed: impl FnOnce() -> I)
    where
        I: IntoIterator<Item = DiskId>,
    {
        if self.base_files.len() <= MAX_BASE_FILES {
            return;
        }
        let mut keep: std::collections::HashSet<DiskId> = indexed().into_iter().collect();
        keep.extend(self.by_token.values().flat_map(|d| d.bases.keys().copied()));
        self.base_files.retain(|id, _| keep.contains(id));
    }

    /// Device connection `token` ended.
    pub(crate) fn gone(&mut self, token: u64) {
        if let Some(d) = self.by_token.remove(&token).filter(|d| d.dropped > 0) {
            tracing::info!(
                "block device {token} gone; {} messages to it were dropped (its socket full)",
                d.dropped
            );
        }
        self.fills.retain(|_, (t, _)| *t != token);
    }

    /// A message of device `token`: a report (looked up now, Satori §4.1) or a fill
    /// (Satori §5.2). A message naming no attached guest's RAM the device holds, too
    /// many pages, or a base the device did not show, is dropped with a count (a fill
    /// is answered empty).
    pub(crate) fn message(
        &mut self,
        engine: &mut Engine,
        guests: &mut Guests,
        token: u64,
        msg: ToDaemon,
    ) {
        let Some(dev) = self.by_token.get_mut(&token) else {
            return;
        };
        // INVARIANT (module docs): only RAM the device holds names its guest.
        let vm = match &msg {
            ToDaemon::ReadLanded { ram, .. } | ToDaemon::FillRead { ram, .. } => {
                dev.guest_of(guests, (ram.dev, ram.ino))
            }
            _ => None,
        };
        if vm.is_some() && vm != dev.vm {
            dev.vm = vm;
            // Told of what its guest's domain holds of its bases already (module docs),
            // once a domain: a walk of the domain's index each time a device names
            // another region of one QEMU would be the device's to ask for at will.
            if let Some(d) = Self::domain_of(engine, dev)
                .filter(|d| !dev.caught_up.contains(d) && dev.caught_up.len() < MAX_RAM_FILES)
            {
                dev.caught_up.push(d);
                let bases = &dev.bases;
                // After what is left of an earlier domain's (its guest's RAM is the
                // device's too), within MAX_CATCH_UP in all.
                let room = MAX_CATCH_UP.saturating_sub(dev.catch_up.len());
                let listed = engine.blocks_held_of(d, |disk| bases.contains_key(&disk), room);
                dev.catch_up
                    .splice(0..0, listed.into_iter().map(|b| (d, b)));
                dev.send_catch_up(&|d, b| engine.block_held_in(d, b));
            }
        }
        match msg {
            ToDaemon::ReadLanded {
                gfns,
                landed_ns,
                bases,
                ..
            } => {
                match vm {
                    Some(vm) if gfns.len() <= MAX_BATCH => {
                        // The time since the device wrote the pages, µs (0 if not said or
                        // not monotonic: a peer's clock is only a hint).
                        let now = memfold_sys::proc::monotonic_ns();
                        let age_us = if landed_ns > 0 && landed_ns <= now {
                            (now - landed_ns) / 1000
                        } else {
                            0
                        };
                        engine.read_landed(vm, &gfns, age_us);
                        let from_base: Vec<(Gfn, BaseBlock)> = bases
                            .iter()
                            .filter(|(_, b)| dev.bases.contains_key(&b.disk))
                            .filter_map(|&(i, b)| gfns.get(i as usize).map(|&g| (g, b)))
                            .collect();
                        engine.landed_from_base(vm, &from_base);
                    }
                    _ => guests.landed_dropped += gfns.len() as u64,
                }
            }
            ToDaemon::FillRead {
                fill, nonce, pages, ..
            } => {
                self.next_fill += 1;
                let ours = FillId(self.next_fill);
                self.fills.insert(ours, (token, fill));
                let pages: Vec<(Gfn, BaseBlock)> = pages
                    .into_iter()
                    .take(MAX_BATCH)
                    .filter(|(_, b)| dev.bases.contains_key(&b.disk))
                    .collect();
                match vm {
                    Some(vm) => {
                        engine.fill_read(vm, ours, &pages, nonce);
                    }
                    None => {
                        self.fills.remove(&ours);
                        self.answer(token, fill, Vec::new());
                    }
                }
            }
            other => tracing::warn!("block device {token} sent {other:?}; ignored"),
        }
    }

    /// The sharing domain of device `d`'s guest, if it named one still attached.
    fn domain_of(engine: &Engine, d: &Device) -> Option<DomainId> {
        d.vm.and_then(|v| engine.domain_of(v))
    }

    /// After a step: answers the fills the engine finished, and checks waiting
    /// candidates against their bases, telling each device that serves a base of the
    /// blocks now held.
    pub(crate) fn pump(&mut self, engine: &mut Engine) {
        // Answers first: a device waits for each (20 ms), and a catch-up's message could
        // fill its socket.
        for a in engine.take_fill_answers() {
            if let Some((token, theirs)) = self.fills.remove(&a.fill) {
                self.filled += a.filled.len() as u64;
                self.answer(token, theirs, a.filled);
            }
        }
        self.pump_catch_ups(engine);
        self.wait_to_check(engine.take_block_candidates());
        if self.unchecked.is_empty() {
            return;
        }
        let take = self.unchecked.len().min(MAX_CHECKS_PER_STEP);
        let batch: Vec<BlockCandidate> = self.unchecked.drain(..take).collect();
        let mut held: HashMap<(DomainId, DiskId), Vec<BaseBlock>> = HashMap::new();
        let mut page = Box::new(AlignedPage([0u8; PAGE_SIZE]));
        for c in batch {
            if engine.block_held_in(c.domain, c.block) {
                continue;
            }
            let Some(file) = self
                .by_token
                .values()
                .find_map(|d| d.bases.get(&c.block.disk))
            else {
                continue;
            };
            let Some(off) = c.block.block.checked_mul(PAGE_SIZE as u64) else {
                continue;
            };
            self.blocks_checked += 1;
            let mut read = || {
                file.read_exact_at(&mut page.0, off)?;
                file.metadata()
            };
            // INVARIANT: a block is learnt only of the bytes its disk id names. A base
            // rewritten in place is another id (`DiskId::of_file`), but the descriptor
            // reads its new bytes: its id is checked after the read, as the device's
            // guard does, so a change before the read is seen. One under way during it
            // is not (Linux sets the mtime as a write call starts, and a long one goes
            // on writing: the block's old bytes would be learnt under the final id), so
            // the read is made while no process has the file open for writing (a read
            // lease holds a writer's open until it is done; `files::without_writers`).
            let got = match memfold_sys::files::without_writers(file, &mut read) {
                Ok(got) => got,
                Err(LeaseError::Writer) => {
                    tracing::debug!("{}: open for writing; not learnt", c.block.disk);
                    continue;
                }
                // Not the base's owner, without CAP_LEASE: as before leases, said once.
                Err(LeaseError::Unavailable(e)) => {
                    static SAID: std::sync::Once = std::sync::Once::new();
                    SAID.call_once(|| {
                        tracing::warn!(
                            "{}: {e}: base blocks are learnt without it (a long write in \
                             place under way may be learnt half done; said once)",
                            c.block.disk
                        )
                    });
                    read()
                }
            };
            match got {
                Ok(m) if DiskId::of_metadata(&m) == c.block.disk => {}
                Ok(_) => {
                    tracing::debug!("{}: changed since it was shown; not learnt", c.block.disk);
                    continue;
                }
                Err(e) => {
                    tracing::debug!("{}: block {} unreadable: {e}", c.block.disk, c.block.block);
                    continue;
                }
            }
            let bytes: &Page = &page.0;
            if engine.block_verified(&c, bytes) {
                held.entry((c.domain, c.block.disk))
                    .or_default()
                    .push(c.block);
            }
        }
        for ((domain, disk), blocks) in held {
            for d in self.by_token.values_mut().filter(|d| {
                d.bases.contains_key(&disk) && Self::domain_of(engine, d) == Some(domain)
            }) {
                d.tell_held(domain, &blocks);
            }
        }
    }

    /// Sends each device the next part of its catch-up, if its socket has room.
    fn pump_catch_ups(&mut self, engine: &Engine) {
        for d in self.by_token.values_mut() {
            if Self::domain_of(engine, d).is_none() {
                d.caught_up.clear();
            }
            d.send_catch_up(&|d, b| engine.block_held_in(d, b));
        }
    }

    /// Queues `new` candidates behind those waiting, up to [`MAX_WAITING`]; the rest are
    /// dropped and counted.
    fn wait_to_check(&mut self, new: impl IntoIterator<Item = BlockCandidate>) {
        for c in new {
            if self.unchecked.len() < MAX_WAITING {
                self.unchecked.push_back(c);
            } else {
                self.unchecked_dropped += 1;
                // Said at the first drop and at each doubling: a count, not a flood.
                if self.unchecked_dropped.is_power_of_two() {
                    tracing::warn!(
                        "{} block candidates dropped so far: {MAX_WAITING} wait for their \
                         check against the base already (their blocks are not learnt as held)",
                        self.unchecked_dropped
                    );
                }
            }
        }
    }

    fn answer(&mut self, token: u64, fill: FillId, gfns: Vec<Gfn>) {
        self.fills_answered += 1;
        if let Some(d) = self.by_token.get_mut(&token) {
            // A device too slow to read its answer has long given up on it.
            d.send(&ToDevice::Filled { fill, gfns });
        }
    }
}

/// The bases a device's hello names, each with the file of the descriptor it passed in
/// the same place (opened again read-only, a description of memfoldd's own), kept only
/// if the descriptor's file is the one the id names and a regular file (a base image is
/// one; memfoldd reads blocks of it on its main thread, where a FIFO, socket or device
/// node has no business). Logged otherwise.
pub(crate) fn checked_bases(
    token: u64,
    ids: &[DiskId],
    fds: Vec<std::os::fd::OwnedFd>,
) -> Vec<(DiskId, File)> {
    let mut out = Vec::new();
    for (&id, fd) in ids.iter().zip(fds) {
        let file = File::from(fd);
        match file.metadata() {
            Ok(m) if DiskId::of_metadata(&m) != id => tracing::warn!(
                "block device {token}: its descriptor for {id} is another file, or a file \
                 written since the device opened it; not taken"
            ),
            Ok(m) if !m.is_file() => tracing::warn!(
                "block device {token}: its descriptor for {id} is {}, not a regular file \
                 (a base image is one); not taken",
                memfold_sys::files::kind_of(&m.file_type())
            ),
            // Read, and leased, through a description of memfoldd's own: the device's
            // could have its lease-break signal set to SIGKILL (`without_writers`).
            Ok(_) => match memfold_sys::files::reopen_read_only(&file) {
                Ok(ours) => out.push((id, ours)),
                Err(e) => tracing::warn!("block device {token}: {id}: {e}; not taken"),
            },
            Err(e) => tracing::warn!("block device {token}: {id}: {e}; not taken"),
        }
    }
    out
}

#[cfg(test)]
mod tests;
