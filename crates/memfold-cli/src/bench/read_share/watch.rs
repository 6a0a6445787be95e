//! Whether a guest page is shared right now, read from outside the guest's QEMU, cheaply
//! enough to ask about every page in flight every millisecond or so:
//!
//! - memfold ([`MemfdHoles`]): a page memfold shares is mapped from a pool frame and its
//!   own copy punched out of the guest's RAM memfd (the agent's `share_run`), so a page
//!   that held the data a read put there is shared exactly when its range of the memfd
//!   is a hole again (`SEEK_DATA`). Under a sharing-only policy nothing else punches a
//!   page that holds data (zero pages are reclaimed, but the benchmark's data is random);
//!   stashing would, so the benchmark refuses policies that stash.
//! - KSM ([`KsmFlags`]): the host frame under the page in QEMU's page tables
//!   (`/proc/PID/pagemap`) is a KSM page (`/proc/kpageflags`, `KPF_KSM`).
//!
//! Both need root (another process's memfd, frame numbers and page flags).

use std::fs::File;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;

use anyhow::{bail, Context, Result};

const PAGE: u64 = 4096;
/// pagemap: present (bit 63), the frame number (bits 0-54).
const PRESENT: u64 = 1 << 63;
const PFN: u64 = (1 << 55) - 1;
/// `/proc/kpageflags`: `KPF_KSM` (include/uapi/linux/kernel-page-flags.h).
const KPF_KSM: u64 = 1 << 21;

/// A page-sharing detector for one guest.
pub trait Shared {
    /// Whether guest page `gfn` (guest-physical address / 4 KiB, below the 32-bit PCI
    /// hole) is shared now.
    ///
    /// Errors: the guest's files cannot be read (QEMU gone).
    fn shared(&self, gfn: u64) -> Result<bool>;
}

/// memfold's shares: holes in the guest's RAM memfd.
pub struct MemfdHoles {
    ram: File,
}

impl MemfdHoles {
    /// The memfd `/memfd:NAME` of process `pid` (QEMU names its guest RAM
    /// `memory-backend-memfd`), opened through `/proc/PID/fd`.
    ///
    /// Errors: no such memfd, or it cannot be opened.
    pub fn of(pid: u32, name: &str) -> Result<Self> {
        let want = format!("/memfd:{name} ");
        let dir = format!("/proc/{pid}/fd");
        for e in std::fs::read_dir(&dir)
            .with_context(|| dir.clone())?
            .flatten()
        {
            let Ok(target) = std::fs::read_link(e.path()) else {
                continue;
            };
            // "/memfd:ram0 (deleted)"
            if format!("{} ", target.display()).starts_with(&want) {
                let ram = File::open(e.path()).with_context(|| e.path().display().to_string())?;
                return Ok(MemfdHoles { ram });
            }
        }
        bail!("process {pid} holds no memfd named {name}")
    }

    /// The detector on an open memfd (a test's own).
    #[cfg(test)]
    fn on(ram: File) -> Self {
        MemfdHoles { ram }
    }
}

impl Shared for MemfdHoles {
    fn shared(&self, gfn: u64) -> Result<bool> {
        let at = gfn * PAGE;
        match rustix::fs::seek(&self.ram, rustix::fs::SeekFrom::Data(at)) {
            Ok(next) => Ok(next != at),
            // No data at or after `at`: a hole up to the end.
            Err(rustix::io::Errno::NXIO) => Ok(true),
            Err(e) => Err(e).context("SEEK_DATA on the guest's RAM memfd"),
        }
    }
}

/// KSM's shares: the page's host frame is a KSM page.
pub struct KsmFlags {
    pagemap: File,
    kpageflags: File,
    /// QEMU's address of guest-physical 0.
    base: u64,
}

impl KsmFlags {
    /// The detector for QEMU `pid` whose anonymous guest RAM is `ram_bytes` long: its RAM
    /// is the smallest anonymous read-write mapping at least that long.
    ///
    /// Errors: no such mapping, or the files cannot be opened.
    pub fn of(pid: u32, ram_bytes: u64) -> Result<Self> {
        let maps = BufReader::new(File::open(format!("/proc/{pid}/maps"))?);
        let mut best: Option<(u64, u64)> = None;
        for line in maps.lines() {
            let line = line?;
            let f: Vec<&str> = line.split_whitespace().collect();
            let (Some(range), Some(perms)) = (f.first(), f.get(1)) else {
                continue;
            };
            if f.len() > 5 || !perms.starts_with("rw") {
                continue;
            }
            let Some((s, e)) = range.split_once('-') else {
                continue;
            };
            let (Ok(s), Ok(e)) = (u64::from_str_radix(s, 16), u64::from_str_radix(e, 16)) else {
                continue;
            };
            if e - s >= ram_bytes && best.is_none_or(|(bs, be)| e - s < be - bs) {
                best = Some((s, e));
            }
        }
        let Some((base, _)) = best else {
            bail!("process {pid} has no anonymous mapping of {ram_bytes} bytes (its guest RAM)");
        };
        Ok(KsmFlags {
            pagemap: File::open(format!("/proc/{pid}/pagemap"))?,
            kpageflags: File::open("/proc/kpageflags").context("/proc/kpageflags")?,
            base,
        })
    }
}

impl Shared for KsmFlags {
    fn shared(&self, gfn: u64) -> Result<bool> {
        let mut e = [0u8; 8];
        self.pagemap
            .read_exact_at(&mut e, (self.base / PAGE + gfn) * 8)
            .context("QEMU's pagemap")?;
        let e = u64::from_ne_bytes(e);
        if e & PRESENT == 0 || e & PFN == 0 {
            return Ok(false);
        }
        let mut f = [0u8; 8];
        self.kpageflags
            .read_exact_at(&mut f, (e & PFN) * 8)
            .context("/proc/kpageflags")?;
        Ok(u64::from_ne_bytes(f) & KPF_KSM != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_punched_page_of_data_reads_as_shared_and_its_neighbours_do_not() {
        use rustix::fs::{fallocate, memfd_create, FallocateFlags, MemfdFlags};
        let fd = memfd_create("bench-ram", MemfdFlags::CLOEXEC).unwrap();
        let ram = File::from(fd);
        ram.write_all_at(&vec![7u8; 6 * PAGE as usize], 0).unwrap();
        fallocate(
            &ram,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            2 * PAGE,
            PAGE,
        )
        .unwrap();
        fallocate(
            &ram,
            FallocateFlags::PUNCH_HOLE | FallocateFlags::KEEP_SIZE,
            5 * PAGE,
            PAGE,
        )
        .unwrap();
        let w = MemfdHoles::on(ram.try_clone().unwrap());
        let got: Vec<bool> = (0..6).map(|g| w.shared(g).unwrap()).collect();
        // The last page: a hole up to the end (ENXIO).
        assert_eq!(got, [false, false, true, false, false, true]);
        // Found by name through /proc, as the benchmark finds QEMU's.
        let by_name = MemfdHoles::of(std::process::id(), "bench-ram").unwrap();
        assert!(by_name.shared(2).unwrap() && !by_name.shared(3).unwrap());
        assert!(MemfdHoles::of(std::process::id(), "bench-ra").is_err());
    }
}
