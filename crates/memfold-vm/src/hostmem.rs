//! How much host memory a guest's RAM uses: one definition for memfold and KSM.
//!
//! **Host memory used by guest RAM**, summed over guests, is what the kernel holds for it:
//! - anonymous guest RAM (KSM runs): the proportional set size (Pss) of the RAM mapping.
//!   Pss splits a page shared by n mappings into n parts, so a KSM-merged page counts
//!   once over all guests; pages never touched and pages mapped to the host zero page
//!   (KSM's `use_zero_pages`, zero-filled pieces of split huge pages) count nothing. A
//!   swapped page counts nothing either (it is not in RAM), as on memfd RAM below.
//! - memfd guest RAM (memfold runs): the bytes allocated to every memfd QEMU maps (the
//!   guest's RAM file) or holds (memfold's pool file, mapped only where a share is mapped,
//!   and its store of patched and compressed pages, which the agent reads but does not
//!   map), resident or swapped,
//!   each file counted once over all guests (every guest maps the one pool). For a file, allocated bytes —
//!   not Pss — are the memory used: a page in the file whose PTE is gone (the NRU clock
//!   zaps PTEs; CoW copies are written with pwrite) still uses memory, and a hole punched
//!   in it uses none. A page of the file in the kernel's swap is allocated too but not
//!   in RAM: its bytes (allocated less resident, `mincore`) are taken off, and the
//!   zswap pool that holds it is the caller's to add (issue 15's zswap backing;
//!   `memfold run` adds the pool's share that guest RAM's swap makes of it).
//!
//! A page used by guest RAM in host RAM is thus counted exactly once either way, and
//! unused or swapped pages never, so KSM and memfold are measured alike; the zswap pool
//! holding swapped pages of either kind is the caller's to add ([`total_swapped`] and
//! [`RamUsage::anon_swap_pss`] say how much of the swap is guest RAM's), as is the
//! mechanism's own memory (memfoldd's heap, KSM's rmap items: `memfold run`, the peer).

use serde::Serialize;

/// One guest's RAM mappings as the kernel reports them, bytes.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct RamUsage {
    /// Resident bytes mapped (shared pages counted in full), all RAM mappings.
    pub rss: u64,
    /// Proportional set size: shared pages split among their mappers, all RAM mappings.
    pub pss: u64,
    /// Bytes swapped out, all RAM mappings.
    pub swap: u64,
    /// Pss + swap of the anonymous RAM mappings.
    pub anon_used: u64,
    /// Of `anon_used`, the swap of the anonymous RAM mappings (not host RAM: taken off
    /// in [`total_used`], as a memfd's swapped bytes are).
    pub anon_swap: u64,
    /// The anonymous RAM mappings' proportional swap (`SwapPss`), bytes: a swap slot
    /// that n mappings share (a KSM page swapped out, one slot for all its sharers)
    /// counted 1/n in each, so once over all guests, where `anon_swap` counts it n
    /// times. What guest RAM holds in the zswap pool is measured by this.
    pub anon_swap_pss: u64,
    /// The memfd files mapped: (inode, bytes allocated to the file).
    pub memfd_files: Vec<(u64, u64)>,
    /// Of those, the bytes in the kernel's swap: (inode, bytes), the file's allocated
    /// bytes less those in RAM (`mincore` on a mapping of the file made to count them:
    /// the pool's frames that no mapping of QEMU's covers are counted too).
    pub memfd_swapped: Vec<(u64, u64)>,
}

impl RamUsage {
    /// Host memory used by this guest's RAM alone per the module's definition, bytes.
    pub fn used(&self) -> u64 {
        total_used(std::slice::from_ref(self))
    }
}

/// Host memory used by the RAM of several guests, bytes: each memfd file (the shared
/// pool) counted once.
pub fn total_used(guests: &[RamUsage]) -> u64 {
    let mut files = std::collections::BTreeMap::new();
    for g in guests {
        files.extend(g.memfd_files.iter().copied());
    }
    // Swapped pages are not host RAM, anonymous or memfd alike.
    let anon: u64 = guests
        .iter()
        .map(|g| g.anon_used.saturating_sub(g.anon_swap))
        .sum();
    (anon + files.values().sum::<u64>()).saturating_sub(total_swapped(guests))
}

/// Bytes of the guests' memfd files in the kernel's swap, each file counted once (not in
/// [`total_used`]; what holds them — the zswap pool — is the caller's to add).
pub fn total_swapped(guests: &[RamUsage]) -> u64 {
    let mut files = std::collections::BTreeMap::new();
    for g in guests {
        for &(ino, b) in &g.memfd_swapped {
            let e = files.entry(ino).or_insert(0u64);
            *e = (*e).max(b);
        }
    }
    // Never more than the file's allocation (read at two instants).
    files
        .iter()
        .map(|(ino, &b)| {
            let alloc = guests
                .iter()
                .flat_map(|g| &g.memfd_files)
                .find(|(i, _)| i == ino)
                .map_or(0, |&(_, a)| a);
            b.min(alloc)
        })
        .sum()
}

/// How memfold's store memfd shows in `/proc/<pid>/fd`.
const STORE_MEMFD: &str = "/memfd:memfold-store";
/// How memfold's pool memfd (the frames shared pages use) shows in `/proc/<pid>/fd`.
const POOL_MEMFD: &str = "/memfd:memfold-pool";

/// Each memfd of process `pid` whose inode is in `inodes`, and memfold's store and pool
/// memfds if the process holds them: (inode, bytes allocated, of them bytes in the kernel's swap —
/// 0 where the file cannot be opened or mapped to count them).
fn memfd_allocations(
    pid: u32,
    inodes: &std::collections::BTreeSet<u64>,
) -> std::io::Result<Vec<(u64, u64, u64)>> {
    use std::os::unix::fs::MetadataExt;
    let mut out = Vec::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd"))?.flatten() {
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        let target = target.to_string_lossy();
        if !target.starts_with("/memfd:") {
            continue;
        }
        // The store and the pool by their names: QEMU holds both, but maps the store never
        // and the pool only where a share is mapped — frames of shares left unmapped (cold
        // shares, the VMA budget) would drop out of the count with the pool's last mapping.
        let memfold_file = target.starts_with(STORE_MEMFD) || target.starts_with(POOL_MEMFD);
        // Follows the link to the file itself.
        let Ok(meta) = std::fs::metadata(entry.path()) else {
            continue;
        };
        if (memfold_file || inodes.contains(&meta.ino()))
            && !out.iter().any(|&(i, _, _)| i == meta.ino())
        {
            use std::os::fd::AsFd;
            let swapped = std::fs::File::open(entry.path())
                .ok()
                .and_then(|f| memfold_sys::pageout::swapped_bytes(f.as_fd(), u64::MAX).ok())
                .unwrap_or(0);
            out.push((meta.ino(), meta.blocks() * 512, swapped));
        }
    }
    Ok(out)
}

/// Sums Rss, Pss and Swap over QEMU process `pid`'s guest-RAM mappings: memfd mappings
/// (memfold) and anonymous read-write mappings of at least `min_bytes` (KSM runs; the RAM
/// is one such mapping, QEMU's other anonymous mappings are smaller).
///
/// Errors: the smaps file cannot be read, or is empty (the process is gone or a zombie,
/// e.g. QEMU after a guest kernel panic).
pub fn guest_ram_usage(pid: u32, min_bytes: u64) -> std::io::Result<RamUsage> {
    let smaps = std::fs::read_to_string(format!("/proc/{pid}/smaps"))?;
    if smaps.is_empty() {
        return Err(std::io::Error::other(format!(
            "process {pid} has no memory map: it has exited"
        )));
    }
    let (total, inodes) = ram_mappings(&smaps, min_bytes);
    with_files(pid, total, &inodes)
}

/// [`guest_ram_usage`] with only what [`total_used`] and [`total_swapped`] need: the memfd
/// files come from `/proc/PID/maps` (their headers, no page-table walk), and
/// `/proc/PID/smaps` is read only if QEMU maps anonymous guest RAM (its Pss and swap are
/// the used bytes: KSM runs). So `rss`, `pss` and `swap` are 0 for a QEMU whose guest RAM
/// is all memfds (memfold runs), whose used bytes are the files' allocations; otherwise
/// as [`guest_ram_usage`]'s. The used bytes are the same either way
/// (`lean_usage_counts_as_the_full_one`).
///
/// Why: the harness samples every guest once a second, and on memfold's side a QEMU maps
/// thousands of pool frames apart, whose smaps walk was most of the sampler's CPU
/// (docs/peer.md, "Where memfold's CPU goes"), taken from the guests it measures.
///
/// Errors: as [`guest_ram_usage`].
pub fn guest_ram_usage_lean(pid: u32, min_bytes: u64) -> std::io::Result<RamUsage> {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    if maps.is_empty() {
        return Err(std::io::Error::other(format!(
            "process {pid} has no memory map: it has exited"
        )));
    }
    let mappings: Vec<Mapping> = maps.lines().filter_map(mapping_header).collect();
    if mappings.iter().any(|m| m.is_anonymous_ram(min_bytes)) {
        return guest_ram_usage(pid, min_bytes);
    }
    let inodes = mappings
        .iter()
        .filter(|m| m.is_memfd())
        .map(|m| m.inode)
        .collect();
    with_files(pid, RamUsage::default(), &inodes)
}

/// The memfd files of process `pid` (those of `inodes`, memfold's store and pool) added
/// to `total`.
fn with_files(
    pid: u32,
    mut total: RamUsage,
    inodes: &std::collections::BTreeSet<u64>,
) -> std::io::Result<RamUsage> {
    let files = memfd_allocations(pid, inodes)?;
    total.memfd_files = files.iter().map(|&(ino, a, _)| (ino, a)).collect();
    total.memfd_swapped = files
        .iter()
        .filter(|&&(_, _, s)| s > 0)
        .map(|&(ino, _, s)| (ino, s))
        .collect();
    Ok(total)
}

/// One header line of `/proc/PID/maps` or `/proc/PID/smaps`:
/// "start-end perms offset dev inode [path]".
struct Mapping<'a> {
    /// Bytes mapped.
    size: u64,
    /// "rw-p" and the like.
    perms: &'a str,
    /// The file's inode (0 for anonymous memory).
    inode: u64,
    /// The path, "" for anonymous memory.
    path: String,
}

impl Mapping<'_> {
    /// A memfd's mapping (memfold's guest RAM, its pool).
    fn is_memfd(&self) -> bool {
        self.path.contains("memfd:")
    }

    /// An anonymous read-write mapping of at least `min_bytes`: QEMU's guest RAM
    /// without a memory backend (KSM runs); its other anonymous mappings are smaller.
    fn is_anonymous_ram(&self, min_bytes: u64) -> bool {
        self.path.is_empty() && self.perms.starts_with("rw") && self.size >= min_bytes
    }
}

/// `line` as a mapping header, or `None` for a field line of smaps ("Rss:   4 kB").
fn mapping_header(line: &str) -> Option<Mapping<'_>> {
    let mut parts = line.split_whitespace();
    let first = parts.next()?;
    if !(first.contains('-')
        && first.chars().next().is_some_and(|c| c.is_ascii_hexdigit())
        && !first.ends_with(':'))
    {
        return None;
    }
    let (s, e) = first.split_once('-').unwrap_or(("0", "0"));
    let size = u64::from_str_radix(e, 16)
        .unwrap_or(0)
        .saturating_sub(u64::from_str_radix(s, 16).unwrap_or(0));
    let perms = parts.next().unwrap_or("");
    let inode: u64 = parts.nth(2).and_then(|i| i.parse().ok()).unwrap_or(0);
    let path: Vec<&str> = parts.collect();
    Some(Mapping {
        size,
        perms,
        inode,
        path: path.join(" "),
    })
}

/// The sums of [`guest_ram_usage`] over the guest-RAM mappings of `smaps` (the text of
/// `/proc/PID/smaps`), and the inodes of the memfds mapped (their files not yet read).
fn ram_mappings(smaps: &str, min_bytes: u64) -> (RamUsage, std::collections::BTreeSet<u64>) {
    let mut total = RamUsage::default();
    let mut counting = false;
    let mut anonymous = false;
    let mut inodes = std::collections::BTreeSet::new();
    for line in smaps.lines() {
        if let Some(m) = mapping_header(line) {
            anonymous = false;
            counting = if m.is_memfd() {
                inodes.insert(m.inode);
                true
            } else {
                anonymous = m.is_anonymous_ram(min_bytes);
                anonymous
            };
            continue;
        }
        let mut parts = line.split_whitespace();
        let first = parts.next().unwrap_or("");
        if !counting {
            continue;
        }
        let mut kb = || {
            parts
                .next()
                .and_then(|v| v.parse::<u64>().ok())
                .unwrap_or(0)
                * 1024
        };
        match first {
            "Rss:" => total.rss += kb(),
            "Pss:" | "Swap:" => {
                let v = kb();
                if first == "Pss:" {
                    total.pss += v;
                } else {
                    total.swap += v;
                    if anonymous {
                        total.anon_swap += v;
                    }
                }
                if anonymous {
                    total.anon_used += v;
                }
            }
            "SwapPss:" if anonymous => total.anon_swap_pss += kb(),
            _ => {}
        }
    }
    (total, inodes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_a_large_anonymous_mapping_of_this_process() {
        let len = 64 << 20;
        let v = std::hint::black_box(vec![1u8; len]); // touched: resident
        let u = guest_ram_usage(std::process::id(), len as u64).unwrap();
        assert!(u.rss >= len as u64 / 2, "{u:?}");
        assert!(u.pss >= len as u64 / 2 && u.pss <= u.rss, "{u:?}");
        assert!(u.used() >= len as u64 / 2, "{u:?}");
        drop(v);
    }

    /// The lean read finds the same memfd files with the same allocations as the full
    /// one, and reads no mapping sizes where guest RAM is all memfds; with anonymous
    /// guest RAM it is the full read. Seen failing with the lean read's memfds left out.
    #[test]
    fn lean_usage_counts_as_the_full_one() {
        use std::os::fd::AsFd;
        use std::os::unix::fs::MetadataExt;
        let len = 4 << 20;
        let fd = memfold_sys::memfd::create("lean-usage-test").unwrap();
        memfold_sys::memfd::set_len(fd.as_fd(), len as u64).unwrap();
        memfold_sys::memfd::pwrite_all(fd.as_fd(), &vec![3u8; len / 2], 0).unwrap();
        let ino = std::fs::File::from(fd.try_clone().unwrap())
            .metadata()
            .unwrap()
            .ino();
        // SAFETY: a fresh shared mapping of the memfd, unmapped below; nothing else
        // points into it.
        let addr = unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                rustix::mm::ProtFlags::READ,
                rustix::mm::MapFlags::SHARED,
                fd.as_fd(),
                0,
            )
        }
        .unwrap();
        // No anonymous mapping of this process is 1 TiB: guest RAM is the memfd alone.
        let min = 1 << 40;
        let full = guest_ram_usage(std::process::id(), min).unwrap();
        let lean = guest_ram_usage_lean(std::process::id(), min).unwrap();
        // SAFETY: the mapping made above, unmapped once.
        unsafe { rustix::mm::munmap(addr, len) }.unwrap();
        let file = |u: &RamUsage| u.memfd_files.iter().find(|f| f.0 == ino).copied();
        assert_eq!(file(&lean), Some((ino, len as u64 / 2)), "{lean:?}");
        assert_eq!(file(&lean), file(&full));
        assert_eq!((lean.rss, lean.pss, lean.anon_used), (0, 0, 0), "{lean:?}");

        // Anonymous guest RAM: the full read, Pss and all.
        let anon = 32 << 20;
        let v = std::hint::black_box(vec![1u8; anon]);
        let lean = guest_ram_usage_lean(std::process::id(), anon as u64).unwrap();
        assert!(lean.anon_used >= anon as u64 / 2, "{lean:?}");
        assert!(lean.pss >= anon as u64 / 2, "{lean:?}");
        drop(v);
    }

    #[test]
    fn swapped_pages_of_a_file_are_taken_off_once_and_never_past_its_allocation() {
        let g = |swapped: u64| RamUsage {
            anon_used: 10,
            memfd_files: vec![(7, 1000), (8, 500)],
            memfd_swapped: vec![(7, swapped)],
            ..RamUsage::default()
        };
        assert_eq!(total_used(&[g(0)]), 1510);
        assert_eq!(total_used(&[g(300)]), 1210);
        // Two guests mapping file 7 (the same file seen twice): taken off once.
        assert_eq!(total_swapped(&[g(300), g(200)]), 300);
        assert_eq!(total_used(&[g(300), g(200)]), 20 + 1500 - 300);
        // Counted a moment before a punch: never more than the file holds.
        assert_eq!(total_swapped(&[g(5000)]), 1000);
    }

    #[test]
    fn an_anonymous_mapping_s_proportional_swap_is_read_apart_from_its_swap() {
        // Guest RAM (1 GiB, anonymous) with KSM pages swapped out that a second guest
        // maps too: Swap counts their slots whole, SwapPss half. A small anonymous
        // mapping and a memfd's swap are not guest RAM's anonymous swap.
        let smaps = "\
7f0000000000-7f0040000000 rw-p 00000000 00:00 0 
Rss:              409600 kB
Pss:              204800 kB
Swap:             102400 kB
SwapPss:           51200 kB
7f0050000000-7f0050100000 rw-p 00000000 00:00 0 
Pss:                1024 kB
Swap:                512 kB
SwapPss:             512 kB
7f0060000000-7f0070000000 rw-s 00000000 00:01 4242                       /memfd:memory-backend-memfd (deleted)
Pss:                4096 kB
Swap:                 64 kB
SwapPss:              64 kB
";
        let (u, inodes) = ram_mappings(smaps, 1 << 29);
        assert_eq!(u.swap, (102400 + 64) << 10);
        assert_eq!(u.anon_swap, 102400 << 10);
        assert_eq!(u.anon_swap_pss, 51200 << 10);
        assert_eq!(u.pss, (204800 + 4096) << 10);
        assert_eq!(inodes.into_iter().collect::<Vec<_>>(), vec![4242]);
    }

    #[test]
    fn a_swapped_page_counts_alike_on_anonymous_and_memfd_ram() {
        let anon = RamUsage {
            pss: 100,
            swap: 50,
            anon_used: 150,
            anon_swap: 50,
            ..RamUsage::default()
        };
        let memfd = RamUsage {
            memfd_files: vec![(7, 150)],
            memfd_swapped: vec![(7, 50)],
            ..RamUsage::default()
        };
        assert_eq!(total_used(&[anon]), 100);
        assert_eq!(total_used(&[memfd]), 100);
    }

    #[test]
    fn memfold_s_pool_counts_by_name_when_no_share_maps_it() {
        use std::os::unix::fs::{FileExt, MetadataExt};
        // Frames of shares left unmapped (cold shares, the VMA budget): the pool is held,
        // never mapped. Counted only when a guest mapped a share, its frames dropped out
        // of host memory with the last mapping.
        let pool = std::fs::File::from(memfold_sys::memfd::create("memfold-pool").unwrap());
        pool.write_all_at(&vec![3u8; 1 << 20], 0).unwrap();
        let other = std::fs::File::from(memfold_sys::memfd::create("not-ours").unwrap());
        other.write_all_at(&vec![3u8; 1 << 20], 0).unwrap();
        let u = guest_ram_usage(std::process::id(), u64::MAX).unwrap();
        let bytes = |f: &std::fs::File| {
            let ino = f.metadata().unwrap().ino();
            u.memfd_files.iter().find(|x| x.0 == ino).map(|x| x.1)
        };
        assert_eq!(bytes(&pool), Some(1 << 20), "{u:?}");
        assert_eq!(
            bytes(&other),
            None,
            "an unmapped memfd not memfold's: {u:?}"
        );
    }

    #[test]
    fn a_memfd_counts_its_allocated_pages_once_mapped_or_not() {
        use std::os::fd::AsRawFd;
        let file = std::fs::File::from(memfold_sys::memfd::create("hostmem-test").unwrap());
        let len = 8 << 20;
        file.set_len(len).unwrap();
        // Map it twice (like guest RAM plus a second view) and write 1 MiB by pwrite only.
        let map = |_| {
            // SAFETY: a new shared mapping of our memfd.
            let p = unsafe {
                libc::mmap(
                    std::ptr::null_mut(),
                    len as usize,
                    libc::PROT_READ,
                    libc::MAP_SHARED,
                    file.as_raw_fd(),
                    0,
                )
            };
            assert_ne!(p, libc::MAP_FAILED);
            p
        };
        let maps: Vec<_> = (0..2).map(map).collect();
        use std::os::unix::fs::FileExt;
        file.write_all_at(&vec![7u8; 1 << 20], 0).unwrap();
        let u = guest_ram_usage(std::process::id(), u64::MAX).unwrap();
        let ino = {
            use std::os::unix::fs::MetadataExt;
            file.metadata().unwrap().ino()
        };
        let bytes = u.memfd_files.iter().find(|f| f.0 == ino).map(|f| f.1);
        assert_eq!(bytes, Some(1 << 20), "{u:?}");
        assert_eq!(
            total_used(&[u.clone(), u.clone()]),
            u.used(),
            "a file counts once"
        );
        for p in maps {
            // SAFETY: unmaps the mappings made above.
            unsafe { libc::munmap(p, len as usize) };
        }
    }
}
