//! Snapshots of guest RAM, and of which guest pages are resident on the host.
//!
//! A snapshot is three files in one folder: `NAME.ram` (guest RAM in RAM-offset order, 4
//! KiB pages, sparse where the host holds nothing), `NAME.resident` (one bit a page, LSB
//! first: 1 = resident in host memory or swap) and `NAME.json` (what was captured).
//!
//! RAM-offset order is the order of QEMU's RAM block, as its memfd and its host mapping
//! hold it. On pc and q35 machines it is not guest-physical order: QEMU maps the first
//! part of the block from guest-physical 0 and the rest from 4 GiB, past the PCI hole
//! ([`Qmp::ram_split`]).

use std::fs::{File, OpenOptions};
use std::io::{Seek, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::Serialize;
use serde_json::json;

use crate::launcher::{Guest, RamBackend, VmError};
use crate::qmp::Qmp;

const PAGE: u64 = 4096;

/// Where QEMU maps the RAM above the PCI hole of a pc or q35 guest, guest-physical bytes.
const ABOVE_4G: u64 = 1 << 32;

/// What [`capture`] wrote.
#[derive(Clone, Debug, Serialize)]
pub struct CaptureInfo {
    /// Guest name.
    pub name: String,
    /// Profile.
    pub profile: String,
    /// Guest pages.
    pub pages: u64,
    /// Pages resident on the host.
    pub resident_pages: u64,
    /// The RAM file, in RAM-offset order (the module's docs).
    pub ram: PathBuf,
    /// The residency bitmap.
    pub resident: PathBuf,
    /// Time the guest was paused, ms (0 for a live capture).
    pub paused_ms: u64,
    /// Wall time of the capture, ms.
    pub ms: u64,
}

/// Capture errors.
#[derive(Debug, thiserror::Error)]
pub enum CaptureError {
    /// The guest side failed.
    #[error(transparent)]
    Vm(#[from] VmError),
    /// The guest RAM could not be found in QEMU's process.
    #[error("guest {name}: cannot find its {what} in QEMU process {pid}")]
    NoRam {
        /// Guest.
        name: String,
        /// QEMU pid.
        pid: u32,
        /// What was looked for.
        what: &'static str,
    },
    /// QEMU's split of the RAM around the PCI hole does not add up to the guest's RAM.
    #[error(
        "guest {name}: QEMU maps {below} bytes of RAM from guest-physical 0 and {above} \
         from 4 GiB, not the {mem_bytes} bytes of its RAM"
    )]
    RamSplit {
        /// Guest.
        name: String,
        /// RAM mapped from guest-physical 0, bytes.
        below: u64,
        /// RAM mapped from guest-physical 4 GiB, bytes.
        above: u64,
        /// The guest's RAM, bytes.
        mem_bytes: u64,
    },
    /// I/O.
    #[error("{path}: {source}")]
    Io {
        /// Path.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
}

fn io(path: &Path) -> impl Fn(std::io::Error) -> CaptureError + '_ {
    move |source| CaptureError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Captures `guest`'s RAM into `out` (created if needed). With `pause`, the guest is
/// stopped (QMP `stop`) for the copy and resumed after, so the snapshot is consistent.
///
/// memfd RAM is read from QEMU's memfd with pread (reading through a mapping would
/// allocate holes), residency from SEEK_DATA/SEEK_HOLE. Anonymous RAM is dumped with QMP
/// `pmemsave`, one a part of QEMU's RAM split ([`Qmp::ram_split`]), so that both files
/// are in RAM-offset order as with memfd RAM; residency from `/proc/PID/pagemap`.
///
/// Errors: [`CaptureError::Vm`] (QMP), [`CaptureError::NoRam`],
/// [`CaptureError::RamSplit`], [`CaptureError::Io`].
pub fn capture(guest: &Guest, out: &Path, pause: bool) -> Result<CaptureInfo, CaptureError> {
    std::fs::create_dir_all(out).map_err(io(out))?;
    let ram_path = out.join(format!("{}.ram", guest.name));
    let res_path = out.join(format!("{}.resident", guest.name));
    let pages = guest.mem_bytes / PAGE;
    let t0 = Instant::now();
    let mut qmp = guest.qmp()?;
    let qerr = |source| VmError::Qmp {
        name: guest.name.clone(),
        source,
    };
    // Asked before the pause, which it need not lengthen.
    let ranges = match guest.ram {
        RamBackend::Memfd => Vec::new(),
        RamBackend::Anonymous | RamBackend::AnonymousNoThp => {
            ram_ranges(&mut qmp, &guest.name, guest.mem_bytes)?
        }
    };
    if pause {
        qmp.execute("stop", None).map_err(qerr)?;
    }
    let paused_at = Instant::now();
    let result = match guest.ram {
        RamBackend::Memfd => capture_memfd(guest, &ram_path, pages).map(|b| (b, Vec::new())),
        // No early return here: the guest must be resumed below whatever happens.
        RamBackend::Anonymous | RamBackend::AnonymousNoThp => (|| {
            // Residency first: pmemsave reads every page through QEMU's mapping, which maps
            // untouched ones to the zero page and would make them look present.
            let bitmap = resident_from_pagemap(guest, pages)?;
            let parts = pmemsave_ranges(&mut qmp, &guest.name, &ranges, &ram_path)?;
            Ok((bitmap, parts))
        })(),
    };
    let paused_ms = if pause {
        paused_at.elapsed().as_millis() as u64
    } else {
        0
    };
    if pause {
        // A session whose pmemsave failed half way takes no more commands (its answer may
        // still come): resumed through a new one.
        if qmp.unusable().is_some() {
            qmp = guest.qmp()?;
        }
        if let Err(e) = qmp.execute("cont", None) {
            if let Ok((_, parts)) = &result {
                remove_parts(parts);
            }
            return Err(qerr(e).into());
        }
    }
    let (bitmap, parts) = result?;
    // Joined once the guest runs again: only files are left to copy.
    join_parts(&ram_path, &parts)?;
    std::fs::write(&res_path, &bitmap).map_err(io(&res_path))?;
    let resident_pages = bitmap.iter().map(|b| b.count_ones() as u64).sum();
    let info = CaptureInfo {
        name: guest.name.clone(),
        profile: guest.profile.clone(),
        pages,
        resident_pages,
        ram: ram_path,
        resident: res_path,
        paused_ms,
        ms: t0.elapsed().as_millis() as u64,
    };
    let meta = out.join(format!("{}.json", guest.name));
    let mut f = File::create(&meta).map_err(io(&meta))?;
    writeln!(
        f,
        "{}",
        serde_json::to_string_pretty(&info).expect("serializable")
    )
    .map_err(io(&meta))?;
    Ok(info)
}

/// The guest-physical ranges, (address, bytes), that hold a guest's `mem_bytes` of RAM in
/// RAM-offset order: [0, below) and [4 GiB, 4 GiB + above) by QEMU's split, or the whole
/// RAM from 0 on a machine that does not say (`Qmp::ram_split`). `name`: the guest, for
/// errors.
fn ram_ranges(qmp: &mut Qmp, name: &str, mem_bytes: u64) -> Result<Vec<(u64, u64)>, CaptureError> {
    let split = qmp.ram_split().map_err(|source| VmError::Qmp {
        name: name.to_string(),
        source,
    })?;
    let Some((below, above)) = split else {
        return Ok(vec![(0, mem_bytes)]);
    };
    if below.checked_add(above) != Some(mem_bytes) || below > ABOVE_4G {
        return Err(CaptureError::RamSplit {
            name: name.to_string(),
            below,
            above,
            mem_bytes,
        });
    }
    Ok([(0, below), (ABOVE_4G, above)]
        .into_iter()
        .filter(|&(_, size)| size > 0)
        .collect())
}

/// Saves `ranges` (guest-physical (address, bytes)) with one QMP `pmemsave` each: the
/// first into `ram_path`, each other into a part file beside it (a `pmemsave` truncates
/// its file), returned in order for `join_parts`. On error the part files are removed.
fn pmemsave_ranges(
    qmp: &mut Qmp,
    name: &str,
    ranges: &[(u64, u64)],
    ram_path: &Path,
) -> Result<Vec<PathBuf>, CaptureError> {
    let mut parts = Vec::new();
    for (i, &(addr, size)) in ranges.iter().enumerate() {
        let path = if i == 0 {
            ram_path.to_path_buf()
        } else {
            let mut p = ram_path.as_os_str().to_owned();
            p.push(format!(".part{i}"));
            PathBuf::from(p)
        };
        let saved = std::path::absolute(&path)
            .map_err(io(&path))
            .and_then(|abs| {
                let file = abs.display().to_string();
                let args = json!({ "val": addr, "size": size, "filename": file });
                qmp.execute("pmemsave", Some(args))
                    .map_err(|source| VmError::Qmp {
                        name: name.to_string(),
                        source,
                    })
                    .map_err(CaptureError::from)
            });
        if i > 0 {
            parts.push(path);
        }
        if let Err(e) = saved {
            remove_parts(&parts);
            return Err(e);
        }
    }
    Ok(parts)
}

/// Appends `parts` to `ram_path` in order, and removes them (also on error).
fn join_parts(ram_path: &Path, parts: &[PathBuf]) -> Result<(), CaptureError> {
    let joined = (|| {
        if parts.is_empty() {
            return Ok(());
        }
        let mut dst = OpenOptions::new()
            .write(true)
            .open(ram_path)
            .map_err(io(ram_path))?;
        // Not O_APPEND: copy_file_range, which std::io::copy uses, refuses it.
        dst.seek(std::io::SeekFrom::End(0)).map_err(io(ram_path))?;
        for part in parts {
            let mut src = File::open(part).map_err(io(part))?;
            std::io::copy(&mut src, &mut dst).map_err(io(ram_path))?;
        }
        Ok(())
    })();
    remove_parts(parts);
    joined
}

/// Removes part files, best effort: they are only leftovers by then.
fn remove_parts(parts: &[PathBuf]) {
    for p in parts {
        let _ = std::fs::remove_file(p);
    }
}

/// Finds QEMU's guest-RAM memfd (the one of exactly the RAM's size) and opens it; with
/// the `/proc/PID/fd/N` path it was opened by (named in read errors).
fn open_ram_memfd(guest: &Guest) -> Result<(File, PathBuf), CaptureError> {
    let dir = PathBuf::from(format!("/proc/{}/fd", guest.pid));
    for entry in std::fs::read_dir(&dir).map_err(io(&dir))?.flatten() {
        let Ok(link) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if !link.to_string_lossy().starts_with("/memfd:") {
            continue;
        }
        if let Ok(f) = File::open(entry.path()) {
            if f.metadata().map(|m| m.len()).unwrap_or(0) == guest.mem_bytes {
                return Ok((f, entry.path()));
            }
        }
    }
    Err(CaptureError::NoRam {
        name: guest.name.clone(),
        pid: guest.pid,
        what: "RAM memfd",
    })
}

fn capture_memfd(guest: &Guest, ram_path: &Path, pages: u64) -> Result<Vec<u8>, CaptureError> {
    use rustix::fs::{seek, SeekFrom};
    let (src, src_path) = open_ram_memfd(guest)?;
    let dst = OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .open(ram_path)
        .map_err(io(ram_path))?;
    dst.set_len(guest.mem_bytes).map_err(io(ram_path))?;
    let mut bitmap = vec![0u8; pages.div_ceil(8) as usize];
    let mut buf = vec![0u8; 2 << 20];
    let mut pos = 0u64;
    while pos < guest.mem_bytes {
        // Next data extent: [data, hole).
        let data = match seek(&src, SeekFrom::Data(pos)) {
            Ok(d) => d,
            Err(rustix::io::Errno::NXIO) => break, // only holes from here on
            Err(e) => return Err(io(&src_path)(e.into())),
        };
        let hole = seek(&src, SeekFrom::Hole(data))
            .map_err(|e| io(&src_path)(e.into()))?
            .min(guest.mem_bytes);
        let mut off = data;
        while off < hole {
            let n = ((hole - off) as usize).min(buf.len());
            src.read_exact_at(&mut buf[..n], off)
                .map_err(io(&src_path))?;
            dst.write_all_at(&buf[..n], off).map_err(io(ram_path))?;
            off += n as u64;
        }
        for p in data / PAGE..hole.div_ceil(PAGE) {
            bitmap[(p / 8) as usize] |= 1 << (p % 8);
        }
        pos = hole;
    }
    Ok(bitmap)
}

/// Residency of anonymous guest RAM from the pagemap of QEMU's RAM mapping (the
/// read-write anonymous mapping of exactly the RAM's size).
fn resident_from_pagemap(guest: &Guest, pages: u64) -> Result<Vec<u8>, CaptureError> {
    let maps_path = PathBuf::from(format!("/proc/{}/maps", guest.pid));
    let maps = std::fs::read_to_string(&maps_path).map_err(io(&maps_path))?;
    let start = maps
        .lines()
        .filter_map(|l| {
            let mut p = l.split_whitespace();
            let range = p.next()?;
            let perms = p.next()?;
            let path_present = p.nth(3).is_some();
            let (s, e) = range.split_once('-')?;
            let (s, e) = (
                u64::from_str_radix(s, 16).ok()?,
                u64::from_str_radix(e, 16).ok()?,
            );
            (perms.starts_with("rw") && !path_present && e - s == guest.mem_bytes).then_some(s)
        })
        .next()
        .ok_or(CaptureError::NoRam {
            name: guest.name.clone(),
            pid: guest.pid,
            what: "anonymous RAM mapping",
        })?;
    let pm_path = PathBuf::from(format!("/proc/{}/pagemap", guest.pid));
    let pm = File::open(&pm_path).map_err(io(&pm_path))?;
    let zero_pfn = zero_page_pfn().unwrap_or(u64::MAX);
    let mut bitmap = vec![0u8; pages.div_ceil(8) as usize];
    let mut entries = vec![0u8; 8 * 4096];
    let mut page = 0u64;
    while page < pages {
        let n = (pages - page).min(4096);
        pm.read_exact_at(&mut entries[..(n * 8) as usize], (start / PAGE + page) * 8)
            .map_err(io(&pm_path))?;
        for i in 0..n {
            let e = u64::from_le_bytes(
                entries[(i * 8) as usize..(i * 8 + 8) as usize]
                    .try_into()
                    .expect("8 bytes"),
            );
            // Present (bit 63) and not the shared zero page, or swapped (bit 62).
            let present = e & (1 << 63) != 0 && (e & PFN_MASK) != zero_pfn;
            if present || e & (1 << 62) != 0 {
                let p = page + i;
                bitmap[(p / 8) as usize] |= 1 << (p % 8);
            }
        }
        page += n;
    }
    Ok(bitmap)
}

const PFN_MASK: u64 = (1 << 55) - 1;

/// The PFN of the kernel's shared zero page, found by reading a fresh anonymous page of
/// our own (a read fault maps it to the zero page). Needs root to see PFNs; `None` then.
fn zero_page_pfn() -> Option<u64> {
    use rustix::mm::{mmap_anonymous, munmap, MapFlags, ProtFlags};
    // SAFETY: a private anonymous page of our own, read once and unmapped.
    unsafe {
        let p = mmap_anonymous(
            std::ptr::null_mut(),
            4096,
            ProtFlags::READ,
            MapFlags::PRIVATE,
        )
        .ok()?;
        let _ = std::ptr::read_volatile(p as *const u8);
        let pm = File::open("/proc/self/pagemap").ok();
        let mut e = [0u8; 8];
        let ok = pm.and_then(|f| f.read_exact_at(&mut e, (p as u64 / PAGE) * 8).ok());
        let _ = munmap(p, 4096);
        ok?;
        let e = u64::from_le_bytes(e);
        (e & (1 << 63) != 0 && e & PFN_MASK != 0).then_some(e & PFN_MASK)
    }
}

#[cfg(test)]
mod tests;
