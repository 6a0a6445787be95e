//! Finding guest RAM in QEMU's address space: every region, without being told its size.
//!
//! QEMU 7.2 maps each `memory-backend-memfd` object whole, at its creation, as one shared
//! mapping of a memfd named `memory-backend-memfd` (`/proc/self/maps` shows
//! `/memfd:memory-backend-memfd (deleted)`, `rw-s` for `share=on`, `rw-p` for
//! `share=off`): the boot RAM of `-machine memory-backend=`, each NUMA node's
//! `memdev`, a pc-dimm's or virtio-mem's backend, whether plugged at start or later with
//! `object_add`. A **region** ([`Region`]) is one such memfd mapped shared and writable,
//! whole, from offset 0, in 4 KiB pages (not `hugetlb=on`), once in this process. Other
//! memfds QEMU or its libraries make (vhost logs, udmabuf, memfold's own pool) have other
//! names and are never regions.
//!
//! **One agent per region** (the design, issue 20): each region is attached to memfoldd
//! as a guest of its own — `NAME` when QEMU has one region, `NAME/ram0`, `NAME/ram1`, ...
//! in address order when it has several, the next free `NAME/ramK` for one that appears
//! later — with its own userfaultfd registered on exactly that region's range, its own
//! page table ([`crate::state::Pages`]) of `bytes / 4096` pages and its own connection.
//! Why this and not one agent announcing a table of regions concatenated into one gfn
//! space: memfoldd and the engine already isolate guests (one memfd, one gfn space, one
//! store per guest; the sharing domain, decided by the peer's uid, is the same for every
//! region of one QEMU, so the regions still share pages with each other and with other
//! guests of the user); the wire and memfoldd stay unchanged, and so do the proofs that a
//! request for one guest never reaches another's memory. The price: one thread,
//! userfaultfd and connection per region, and memfoldd lists a multi-node guest as
//! several guests.
//!
//! **Invariant (a fault or request touches one region only).** The kernel delivers a fault
//! to the userfaultfd that registered the faulting range, and each region's agent
//! registers its own range and no other, so a fault maps to exactly one (region, gfn):
//! `gfn = (address − base) / 4096 < bytes / 4096`; a fault outside `[base, base + bytes)`
//! is only woken (`fault.rs`). Requests name gfns of the connection's region; every
//! handler looks the page up in that region's table (`Pages::get`/`is_private`: `None` or
//! `false` past the end) and refuses a gfn past the region's end before any address is
//! formed, and the clock clamps its slice to the region, so no request reaches memory
//! outside `[base, base + bytes)` or another region's memfd. Tested by
//! `tests/regions.rs`: requests for the first gfn past a region's end are refused.
//!
//! **Regions that appear later** (pc-dimm or virtio-mem hot-plug with `object_add`): a
//! watcher thread reads `/proc/self/maps` and attaches each new region as `NAME/ramK`,
//! logging it. It reads at the first [`WATCH_PERIOD`] after a QEMU thread mapped a file
//! shared (QEMU maps a new backend's memfd so, with libc's `mmap`, which the agent
//! interposes: `unplug.rs`, [`note_shared_map`]), and at least every [`WATCH_BACKSTOP`]
//! for a mapping made some other way (a raw system call). Reading every period whatever
//! happened was the agents' largest single cost with frames paged out: 1.4–1.9 CPU s per
//! 90 s over four QEMUs of 3 900–6 400 mappings (perf, docs/peer.md, "Where memfold's
//! CPU goes with frames paged out"). A region whose range holds neither its memfd's
//! mapping nor a pool frame's, at two looks in a row (hot-unplug, `object_del`), is
//! logged and its agent detaches (a region shared whole maps only frames: taken for
//! unplugged, its agent's userfaultfd closed and left them writable by the guest): its range is no longer registered, so
//! every request to it would fail at its first write-protect; the agent tells memfoldd
//! (`ToDaemon::RegionUnmapped`) and ends, memfoldd sees the connection close and
//! releases the guest once QEMU neither maps nor holds its memfd, logged as a region
//! released, not as a QEMU exited (`daemon/guests.rs`, `Guests::released`).

use std::collections::BTreeSet;
use std::io;
use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::MetadataExt;

use crate::{AgentConfig, PAGE};

/// The memfd name QEMU gives every `memory-backend-memfd` object.
pub(crate) const QEMU_MEMFD_NAME: &str = "/memfd:memory-backend-memfd";

/// How often the watcher asks whether to look for regions plugged or unplugged after
/// attach ([`look_due`]).
pub(crate) const WATCH_PERIOD: std::time::Duration = std::time::Duration::from_secs(2);

/// Longest time between two looks of the watcher, whatever the interposer saw: a region
/// QEMU mapped without libc's `mmap` is attached within this (plus a period).
pub(crate) const WATCH_BACKSTOP: std::time::Duration = std::time::Duration::from_secs(8);

/// Shared file mappings made by QEMU's own threads (not the agents'), counted by the
/// interposed `mmap`: a new one may be a hot-plugged region.
static SHARED_MAPS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Counts an `mmap` with `flags` of file descriptor `fd` if it maps a file shared from a
/// thread not an agent's. Called by the interposer after every `mmap` that succeeded
/// (so a look that saw the count sees the mapping): no lock, no allocation (an
/// allocator may be mapping memory).
pub(crate) fn note_shared_map(fd: std::ffi::c_int, flags: std::ffi::c_int) {
    if fd >= 0 && flags & libc::MAP_SHARED != 0 && !crate::ram_sends::is_agent_thread() {
        SHARED_MAPS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Whether the watcher looks at `/proc/self/maps` now: a shared file mapped since its
/// last look (`mapped_since`), a region found missing at the last look (`confirming`:
/// two looks in a row detach it), or the last look [`WATCH_BACKSTOP`] old.
fn look_due(mapped_since: bool, confirming: bool, since_look: std::time::Duration) -> bool {
    mapped_since || confirming || since_look >= WATCH_BACKSTOP
}

/// `statfs` magic of hugetlbfs: a `hugetlb=on` memfd.
const HUGETLBFS_MAGIC: u64 = 0x9584_58f6;

/// One line of `/proc/self/maps`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Mapping {
    /// First address.
    pub(crate) start: u64,
    /// Address past the end.
    pub(crate) end: u64,
    /// `rw-s`, `r-xp`, ...
    pub(crate) perms: String,
    /// Offset in the file, bytes.
    pub(crate) offset: u64,
    /// The file's inode (0: anonymous).
    pub(crate) inode: u64,
    /// The path column (may be empty).
    pub(crate) path: String,
}

impl Mapping {
    /// Shared and writable.
    fn shared_rw(&self) -> bool {
        self.perms.starts_with("rw") && self.perms.ends_with('s')
    }

    /// Bytes.
    fn len(&self) -> u64 {
        self.end - self.start
    }
}

/// Parses `/proc/self/maps`; lines that do not parse are skipped.
pub(crate) fn parse_maps(text: &str) -> Vec<Mapping> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut parts = line.split_whitespace();
        let (Some(range), Some(perms), Some(offset), Some(_dev), Some(inode)) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            continue;
        };
        let path = parts.collect::<Vec<_>>().join(" ");
        let Some((s, e)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end), Ok(offset), Ok(inode)) = (
            u64::from_str_radix(s, 16),
            u64::from_str_radix(e, 16),
            u64::from_str_radix(offset, 16),
            inode.parse::<u64>(),
        ) else {
            continue;
        };
        if end <= start {
            continue;
        }
        out.push(Mapping {
            start,
            end,
            perms: perms.into(),
            offset,
            inode,
            path,
        });
    }
    out
}

/// Whether `[start, start + len)` is wholly mapped, shared and writable, from the file of
/// inode `inode` at the offsets `offset + (address - start)`: guest RAM still backed by
/// its memfd there, with no hole and nothing else in it. `maps` sorted by address, as
/// `/proc/self/maps` lists them.
pub(crate) fn backed_by(maps: &[Mapping], inode: u64, start: u64, len: u64, offset: u64) -> bool {
    let end = start.saturating_add(len);
    let mut at = start;
    for m in maps.iter().filter(|m| m.end > start && m.start < end) {
        if m.start > at || m.inode != inode || !m.shared_rw() {
            return false;
        }
        // The file offset of `at` in this mapping must be the one guest RAM has there.
        if m.offset.checked_add(at - m.start) != offset.checked_add(at - start) {
            return false;
        }
        at = m.end;
    }
    at >= end
}

/// [`backed_by`] for guest RAM's `memfd`, by this process's `/proc/self/maps` now.
///
/// Errors: `fstat` of the memfd, or `/proc/self/maps` unreadable.
pub(crate) fn memfd_backs(
    memfd: std::os::fd::BorrowedFd<'_>,
    start: u64,
    len: u64,
    offset: u64,
) -> io::Result<bool> {
    let ino = rustix::fs::fstat(memfd)?.st_ino;
    let maps = parse_maps(&std::fs::read_to_string("/proc/self/maps")?);
    Ok(backed_by(&maps, ino, start, len, offset))
}

/// A range of this process mapping one memfd shared and writable from offset 0, adjacent
/// lines of one file merged (the kernel may split one mapping in several lines).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Candidate {
    /// First address.
    pub(crate) base: u64,
    /// Bytes.
    pub(crate) bytes: u64,
    /// The memfd's inode.
    pub(crate) inode: u64,
}

/// Shared writable mappings of memfds whose path starts with `name` (any memfd when
/// `None`), merged, each whole from offset 0 and a multiple of 4 KiB; a memfd mapped
/// more than once is left out (which view would the guest use?).
pub(crate) fn candidates(maps: &[Mapping], name: Option<&str>) -> Vec<Candidate> {
    let mut runs: Vec<(Candidate, u64)> = Vec::new(); // (run, next expected offset)
    for m in maps {
        let named = match name {
            Some(n) => m.path.starts_with(n),
            None => m.path.starts_with("/memfd:"),
        };
        if !named || !m.shared_rw() {
            continue;
        }
        if let Some((run, next)) = runs.last_mut() {
            if run.inode == m.inode && run.base + run.bytes == m.start && *next == m.offset {
                run.bytes += m.len();
                *next += m.len();
                continue;
            }
        }
        runs.push((
            Candidate {
                base: m.start,
                bytes: m.len(),
                inode: m.inode,
            },
            m.offset + m.len(),
        ));
    }
    // Starting at offset 0: the run's first line's offset is its next minus its bytes.
    let mut out: Vec<Candidate> = runs
        .into_iter()
        .filter(|(c, next)| *next == c.bytes && c.bytes % PAGE == 0)
        .map(|(c, _)| c)
        .collect();
    let twice: BTreeSet<u64> = {
        let mut seen = BTreeSet::new();
        maps.iter()
            .filter(|m| m.inode != 0 && m.path.starts_with("/memfd:"))
            .filter(|m| m.offset == 0 && !seen.insert(m.inode))
            .map(|m| m.inode)
            .collect()
    };
    out.retain(|c| !twice.contains(&c.inode));
    out
}

/// A region of guest RAM this process maps: the memfd, where and how long.
#[derive(Debug)]
pub(crate) struct Region {
    /// Its address in this process.
    pub(crate) base: u64,
    /// Its length, bytes (a multiple of 4096).
    pub(crate) bytes: u64,
    /// The memfd's inode (who it is, for the watcher).
    pub(crate) inode: u64,
    /// The memfd, opened read-write (CoW breaks write the private copy with `pwrite`).
    pub(crate) memfd: OwnedFd,
}

/// Opens the memfd of each candidate among this process's descriptors (by inode), keeping
/// those whose file is exactly as long as the mapping and not of huge pages — hugetlb, or
/// shmem huge folios the host may give any memfd ([`memfold_sys::memfd::shmem_huge_folios`]:
/// a punched stashed page would then be zeroed, not freed, and a page written back
/// among holes would fill them with zeros). A candidate whose memfd is not open in this
/// process (closed after mapping) is skipped. Returns the regions and, for each memfd
/// skipped as huge pages, its description with what to change.
///
/// Errors: `/proc/self/fd` cannot be read.
pub(crate) fn open(cands: &[Candidate]) -> io::Result<(Vec<Region>, Vec<String>)> {
    let shmem_huge =
        memfold_sys::memfd::shmem_huge_folios(std::path::Path::new(memfold_sys::memfd::THP_SYSFS));
    let mut regions = Vec::new();
    let mut huge = Vec::new();
    let mut wanted: Vec<Candidate> = cands.to_vec();
    for entry in std::fs::read_dir("/proc/self/fd")?.flatten() {
        if wanted.is_empty() {
            break;
        }
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if !target.to_string_lossy().starts_with("/memfd:") {
            continue;
        }
        let Ok(file) = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(entry.path())
        else {
            continue;
        };
        let Ok(meta) = file.metadata() else { continue };
        let Some(k) = wanted.iter().position(|c| c.inode == meta.ino()) else {
            continue;
        };
        let c = wanted.swap_remove(k);
        let on_huge_pages =
            rustix::fs::fstatfs(file.as_fd()).is_ok_and(|s| s.f_type as u64 == HUGETLBFS_MAGIC);
        if on_huge_pages {
            huge.push(format!(
                "a memfd of huge pages (hugetlb=on) of {} MiB at {:#x} (define it as \
                 memory-backend-memfd without hugetlb=on)",
                c.bytes >> 20,
                c.base
            ));
            continue;
        }
        if let Some(why) = &shmem_huge {
            huge.push(format!(
                "a memfd of {} MiB at {:#x}, which the host may back with huge folios \
                 ({why}; set them to never)",
                c.bytes >> 20,
                c.base
            ));
            continue;
        }
        if meta.len() != c.bytes {
            continue;
        }
        regions.push(Region {
            base: c.base,
            bytes: c.bytes,
            inode: c.inode,
            memfd: OwnedFd::from(file),
        });
    }
    regions.sort_by_key(|r| r.base);
    Ok((regions, huge))
}

/// What this process maps that looks like guest RAM but is not shareable, for the log
/// line of a guest left unmanaged: `memory-backend-memfd` mappings that are private
/// (`share=off`), and the largest anonymous writable mapping (QEMU's own RAM for `-m`
/// without a backend).
pub(crate) fn describe_unshareable(maps: &[Mapping]) -> String {
    let mut found: Vec<String> = maps
        .iter()
        .filter(|m| m.path.starts_with(QEMU_MEMFD_NAME) && !m.shared_rw())
        .map(|m| {
            format!(
                "a private memory-backend-memfd (share=off, {}) of {} MiB",
                m.perms,
                m.len() >> 20
            )
        })
        .collect();
    if let Some(m) = maps
        .iter()
        .filter(|m| m.inode == 0 && m.path.is_empty() && m.perms.starts_with("rw"))
        .max_by_key(|m| m.len())
    {
        found.push(format!(
            "anonymous memory (the largest mapping: {} MiB)",
            m.len() >> 20
        ));
    }
    if found.is_empty() {
        "no memory-backend-memfd mapping".into()
    } else {
        found.join(", ")
    }
}

/// Set when a region's mapping is gone from this process (hot-unplug).
pub(crate) type GoneFlag = std::sync::Arc<std::sync::atomic::AtomicBool>;

/// Inodes of every pool memfd an agent of this process was welcomed with: frames of
/// them mapped inside a region's range are that region's pages.
static POOLS: std::sync::Mutex<Vec<u64>> = std::sync::Mutex::new(Vec::new());

/// Records `inode` as a pool's (an agent's welcome): its mappings inside a region keep
/// the region attached.
pub(crate) fn note_pool(inode: u64) {
    let mut p = POOLS.lock().unwrap_or_else(|e| e.into_inner());
    if !p.contains(&inode) {
        p.push(inode);
    }
}

/// Whether anything of the region `[base, end)` of memfd inode `inode` is still mapped
/// in its range, as the watcher looks ([`Watched::mapped`]); `true` if
/// `/proc/self/maps` cannot be read.
pub(crate) fn still_mapped(base: u64, end: u64, inode: u64) -> bool {
    let Ok(text) = std::fs::read_to_string("/proc/self/maps") else {
        return true;
    };
    let pools = POOLS.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let w = Watched {
        inode,
        base,
        end,
        missing_once: false,
        gone: GoneFlag::default(),
    };
    w.mapped(&parse_maps(&text), &pools)
}

/// A region the watcher watches.
#[derive(Clone)]
struct Watched {
    /// Its memfd's inode.
    inode: u64,
    /// Its range in this process, `[base, end)`.
    base: u64,
    end: u64,
    /// Whether the last look found it gone (two in a row detach it).
    missing_once: bool,
    gone: GoneFlag,
}

impl Watched {
    /// Whether anything of the region is still mapped at its range: its memfd, or the
    /// frames of a pool shared pages are on.
    ///
    /// Invariant: an agent detaches (its userfaultfd closed, which drops the uffd-wp of
    /// every pool frame it mapped) only once no pool frame is mapped in its range.
    /// Looking for the memfd alone took a region whose every page is shared, its memfd
    /// mapped nowhere any more, for one unplugged, and left its frames writable by the
    /// guest (`tests/whole_region_shared.rs`).
    fn mapped(&self, maps: &[Mapping], pools: &[u64]) -> bool {
        maps.iter().any(|m| {
            m.shared_rw()
                && m.start < self.end
                && self.base < m.end
                && (m.inode == self.inode || pools.contains(&m.inode))
        })
    }
}

/// The regions the agents manage, for the watcher.
pub(crate) struct Watch {
    cfg: AgentConfig,
    /// Every region managed.
    known: std::sync::Mutex<Vec<Watched>>,
    /// The index K of the next `NAME/ramK`.
    next: std::sync::atomic::AtomicUsize,
}

impl Watch {
    /// A watcher of the regions of the agents configured as `cfg`; the next region that
    /// appears is `NAME/ram{next}`.
    pub(crate) fn new(cfg: AgentConfig, next: usize) -> Watch {
        Watch {
            cfg,
            known: std::sync::Mutex::new(Vec::new()),
            next: std::sync::atomic::AtomicUsize::new(next),
        }
    }

    /// Records a region managed; returns its gone flag.
    pub(crate) fn add(&self, region: &Region) -> GoneFlag {
        let gone = GoneFlag::default();
        if let Ok(mut k) = self.known.lock() {
            k.push(Watched {
                inode: region.inode,
                base: region.base,
                end: region.base + region.bytes,
                missing_once: false,
                gone: std::sync::Arc::clone(&gone),
            });
        }
        gone
    }

    /// Every [`WATCH_PERIOD`] a look is due at ([`look_due`]): attaches regions that
    /// appeared (hot-plug) and tells the agents of regions that disappeared (hot-unplug)
    /// to detach. Ends only if `/proc/self/maps` cannot be read.
    pub(crate) fn watch(&self) {
        use std::sync::atomic::Ordering;
        // Its unmaps (none so far) are the agent's own (`unplug.rs`).
        crate::ram_sends::mark_agent_thread();
        let mut refused: std::collections::BTreeSet<u64> = Default::default();
        // The count of shared mappings at the last look and when it began; none yet.
        let mut looked: Option<(u64, std::time::Instant)> = None;
        loop {
            std::thread::sleep(WATCH_PERIOD);
            let maps_now = SHARED_MAPS.load(Ordering::SeqCst);
            if let Some((maps_then, at)) = looked {
                // A region the last look found missing and not yet gone is looked at again.
                let confirming = self.known.lock().is_ok_and(|k| {
                    k.iter()
                        .any(|w| w.missing_once && !w.gone.load(Ordering::SeqCst))
                });
                if !look_due(maps_now != maps_then, confirming, at.elapsed()) {
                    continue;
                }
            }
            // Taken before reading: a mapping made while reading is looked at next period.
            looked = Some((maps_now, std::time::Instant::now()));
            // The same read counts the mappings for the agent's report (`vmas.rs`).
            let read = || {
                // Bytes, not UTF-8: one mapped file's name that is not would stop the watch.
                let bytes = std::fs::read("/proc/self/maps").ok()?;
                let n = crate::vmas::count_mappings(&bytes);
                Some((n, String::from_utf8_lossy(&bytes).into_owned()))
            };
            let Some(text) = crate::vmas::PROCESS.read_with(read) else {
                tracing::warn!(
                    "cannot read /proc/self/maps: no longer watching for hot-plugged RAM"
                );
                return;
            };
            let maps = parse_maps(&text);
            let pools = POOLS.lock().unwrap_or_else(|e| e.into_inner()).clone();
            let known: Vec<u64> = match self.known.lock() {
                Ok(mut k) => {
                    for w in k.iter_mut().filter(|w| !w.gone.load(Ordering::SeqCst)) {
                        // Shared and writable: the agent's read-only page-out window onto
                        // the same memfd (`pageout.rs`) does not keep a region alive. Two
                        // looks in a row: `/proc/self/maps` is read in parts, each under
                        // its own lock, while the agent's shares move mappings.
                        if w.mapped(&maps, &pools) {
                            w.missing_once = false;
                        } else if !w.missing_once {
                            w.missing_once = true;
                        } else {
                            tracing::warn!(
                                "a guest RAM region (memfd inode {}) is no longer mapped (hot-unplug): its agent detaches",
                                w.inode
                            );
                            w.gone.store(true, Ordering::SeqCst);
                        }
                    }
                    k.iter().map(|w| w.inode).collect()
                }
                Err(_) => return,
            };
            let new: Vec<Candidate> = candidates(&maps, Some(QEMU_MEMFD_NAME))
                .into_iter()
                .filter(|c| !known.contains(&c.inode))
                .filter(|c| !refused.contains(&c.inode))
                .collect();
            if new.is_empty() {
                continue;
            }
            let Ok((found, huge)) = open(&new) else {
                continue;
            };
            if !huge.is_empty() {
                tracing::warn!(
                    "hot-plugged RAM not shareable, left alone: {}",
                    huge.join(", ")
                );
            }
            for c in &new {
                if !found.iter().any(|r| r.inode == c.inode) {
                    refused.insert(c.inode);
                }
            }
            for region in found {
                let k = self.next.fetch_add(1, Ordering::SeqCst);
                let mut cfg = self.cfg.clone();
                cfg.name = format!("{}/ram{k}", self.cfg.name);
                tracing::info!(
                    "guest RAM region {} appeared (hot-plug): {} MiB at {:#x}; attaching it",
                    cfg.name,
                    region.bytes >> 20,
                    region.base
                );
                let gone = self.add(&region);
                crate::spawn_region(cfg, region, gone);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// QEMU 7.2's lines for two shared memfd backends (128 and 64 MiB) and one with
    /// share=off (32 MiB), as read from a tiny guest's /proc/PID/maps; with the shared
    /// 64 MiB one split in two lines and the pool of memfold mapped too.
    const MAPS: &str = "\
5581a000-5581b000 r-xp 00000000 08:01 1234 /usr/bin/qemu-system-x86_64
7f4e95ffd000-7f4e97ffd000 rw-p 00000000 00:01 5581 /memfd:memory-backend-memfd (deleted)
7f4e97ffe000-7f4e99ffe000 rw-s 00000000 00:01 5580 /memfd:memory-backend-memfd (deleted)
7f4e99ffe000-7f4e9bffe000 rw-s 02000000 00:01 5580 /memfd:memory-backend-memfd (deleted)
7f4e9bfff000-7f4ea3fff000 rw-s 00000000 00:01 5579 /memfd:memory-backend-memfd (deleted)
7f4ea4000000-7f4ea4001000 rw-s 00000000 00:01 6000 /memfd:memfold-pool (deleted)
7f4ea5000000-7f4ea9000000 rw-p 00000000 00:00 0
";

    /// What a failed move onto guest RAM is checked by: the memfd at the right offsets
    /// over the whole run, no hole, no other file, no other offset.
    #[test]
    fn a_run_is_backed_by_its_memfd_only_whole_and_at_its_own_offsets() {
        let maps = parse_maps(MAPS);
        let (base, ino) = (0x7f4e_97ff_e000u64, 5580);
        // The 64 MiB region, split in two lines, read across the split.
        assert!(backed_by(&maps, ino, base + 0x1fff000, 0x2000, 0x1fff000));
        assert!(backed_by(&maps, ino, base, 0x400_0000, 0));
        assert!(
            !backed_by(&maps, ino, base + 0x1000, 0x1000, 0),
            "wrong offset"
        );
        assert!(!backed_by(&maps, 5579, base, 0x1000, 0), "another memfd");
        assert!(
            !backed_by(&maps, ino, base, 0x400_1000, 0),
            "runs past its end"
        );
        // A hole where a move unmapped the run, and then another file mapped in it.
        let hole: Vec<Mapping> = maps
            .iter()
            .cloned()
            .flat_map(|m| {
                if m.inode == ino && m.offset == 0 {
                    let mut a = m.clone();
                    a.end = m.start + 0x1000;
                    let mut b = m.clone();
                    b.start = m.start + 0x3000;
                    b.offset = 0x3000;
                    vec![a, b]
                } else {
                    vec![m]
                }
            })
            .collect();
        assert!(backed_by(&hole, ino, base, 0x1000, 0));
        assert!(
            !backed_by(&hole, ino, base + 0x1000, 0x1000, 0x1000),
            "a hole"
        );
        assert!(!backed_by(&hole, ino, base, 0x4000, 0), "a hole inside");
        let mut taken = hole.clone();
        taken.push(Mapping {
            start: base + 0x1000,
            end: base + 0x3000,
            perms: "rw-p".into(),
            offset: 0,
            inode: 0,
            path: String::new(),
        });
        taken.sort_by_key(|m| m.start);
        assert!(
            !backed_by(&taken, ino, base + 0x1000, 0x1000, 0x1000),
            "QEMU's heap"
        );
    }

    #[test]
    fn qemus_shared_memfd_backends_are_regions_and_nothing_else_is() {
        let maps = parse_maps(MAPS);
        assert_eq!(maps.len(), 7);
        let c = candidates(&maps, Some(QEMU_MEMFD_NAME));
        assert_eq!(
            c,
            [
                Candidate {
                    base: 0x7f4e97ffe000,
                    bytes: 64 << 20,
                    inode: 5580
                },
                Candidate {
                    base: 0x7f4e9bfff000,
                    bytes: 128 << 20,
                    inode: 5579
                },
            ]
        );
        // Any memfd: the pool too (the exact-size search of MEMFOLD_RAM_BYTES).
        assert_eq!(candidates(&maps, None).len(), 3);
        let d = describe_unshareable(&maps);
        assert!(
            d.contains("private memory-backend-memfd (share=off, rw-p) of 32 MiB"),
            "{d}"
        );
        assert!(
            d.contains("anonymous memory (the largest mapping: 64 MiB)"),
            "{d}"
        );
    }

    #[test]
    fn part_of_a_memfd_or_a_memfd_mapped_twice_is_not_a_region() {
        // Mapped from offset 4096: not the whole memfd.
        let part = "7f0000000000-7f0000100000 rw-s 00001000 00:01 7 /memfd:memory-backend-memfd (deleted)\n";
        assert_eq!(candidates(&parse_maps(part), Some(QEMU_MEMFD_NAME)), []);
        let twice = "\
7f0000000000-7f0000100000 rw-s 00000000 00:01 7 /memfd:memory-backend-memfd (deleted)
7f1000000000-7f1000100000 rw-s 00000000 00:01 7 /memfd:memory-backend-memfd (deleted)
";
        assert_eq!(candidates(&parse_maps(twice), Some(QEMU_MEMFD_NAME)), []);
        // Two lines of one file that are not contiguous in the file: not one region.
        let gap = "\
7f0000000000-7f0000100000 rw-s 00000000 00:01 7 /memfd:memory-backend-memfd (deleted)
7f0000100000-7f0000200000 rw-s 00200000 00:01 7 /memfd:memory-backend-memfd (deleted)
";
        assert_eq!(
            candidates(&parse_maps(gap), Some(QEMU_MEMFD_NAME)),
            [Candidate {
                base: 0x7f0000000000,
                bytes: 0x100000,
                inode: 7
            }]
        );
    }
}
