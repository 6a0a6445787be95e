//! The read path: a read's pages filled from frames where memfoldd holds their blocks
//! ([`super::fill`]), the rest read from the disk into the device's reused aligned buffer
//! and written into guest RAM through QEMU, every page that landed reported.

use std::collections::BTreeMap;

use super::{fill, sub_runs, BlkBackend, Chain, ReqError};
use crate::disk::Extent;
use crate::landed::Landed;
use crate::mem::{RamFile, RemoteMemory, PAGE};

/// The read buffer a device keeps between requests at most, bytes: a 1 MiB read is
/// two to four requests of up to 504 KiB (`seg_max` 126 pages); a larger one (up to
/// `MAX_DATA`, 31.5 MiB) gets a buffer of its own, dropped after it.
pub const KEEP_READ_BUF: usize = 2 << 20;

impl BlkBackend {
    /// Serves a read of `len` bytes at `sector` into the chain's writable buffers: the
    /// pages frames hold from memfoldd's fill, the rest from the disk.
    pub(super) fn read(
        &mut self,
        mem: &RemoteMemory,
        c: &Chain,
        sector: u64,
        len: u64,
    ) -> Result<(), ReqError> {
        let off = self.data_range(sector, len)?;
        let runs = sub_runs(&c.writable, 0, len);
        let fill = self.fill_from_frames(mem, &runs, off, len)?;
        if fill.at.len() as u64 * PAGE == len {
            self.counters.reads_from_frames += 1;
            return Ok(());
        }
        let r = self.read_disk(mem, &runs, off, len, &fill.at);
        if r.is_err() {
            // memfoldd may still answer the fill (late): once the guest has its buffer
            // back, no page of it may begin with the nonce (fill.rs).
            self.wipe_nonces(mem, &fill.nonced);
        }
        r
    }

    /// The rest of a read: the bytes of `[off, off + len)` frames did not fill (pages
    /// at read offsets `filled`) from the disk into the guest runs `runs`, reported.
    /// Read into the device's reused aligned buffer ([`BlkBackend::read_buf`]): the disk
    /// reads straight into it with `O_DIRECT` (`RawDisk::read_at`), so a request's bytes
    /// are copied once, into guest RAM, and no buffer is allocated or zeroed for it.
    fn read_disk(
        &mut self,
        mem: &RemoteMemory,
        runs: &[(u64, u64)],
        off: u64,
        len: u64,
        filled: &[u64],
    ) -> Result<(), ReqError> {
        let mut buf = std::mem::take(&mut self.read_buf);
        buf.reuse(len as usize);
        let r = self.read_disk_into(mem, runs, off, buf.bytes_mut(), filled);
        // Kept for the next request unless a rare large one grew it past what is worth
        // holding between requests.
        if buf.capacity() <= KEEP_READ_BUF {
            self.read_buf = buf;
        }
        r
    }

    /// [`BlkBackend::read_disk`] into `buf` (`len` bytes, holding an earlier request's
    /// bytes: every byte the guest gets is read into it first — `Disk::read` writes all
    /// of its buffer — and the pages frames filled are not written to the guest).
    fn read_disk_into(
        &mut self,
        mem: &RemoteMemory,
        runs: &[(u64, u64)],
        off: u64,
        buf: &mut [u8],
        filled: &[u64],
    ) -> Result<(), ReqError> {
        let len = buf.len() as u64;
        let extents = if filled.is_empty() {
            self.throttle_read(len);
            let extents = self.disk.read(off, buf)?;
            self.put(mem, runs, buf)?;
            extents
        } else {
            // Only what frames did not fill comes from the disk.
            let mut extents = Vec::new();
            for (a, b) in fill::unfilled(filled, len) {
                self.throttle_read(b - a);
                let e = self.disk.read(off + a, &mut buf[a as usize..b as usize])?;
                extents.extend(e);
            }
            self.put_except(mem, runs, buf, filled)?;
            extents
        };
        self.counters.disk_read_bytes += len - filled.len() as u64 * PAGE;
        self.report(mem, runs, off, &extents, filled);
        Ok(())
    }

    /// Writes `data` into the guest runs `runs`, all in one `process_vm_writev` (up to
    /// 1 024 pieces): a request over scattered guest pages costs one call, not one a run.
    pub(super) fn put(
        &self,
        mem: &RemoteMemory,
        runs: &[(u64, u64)],
        data: &[u8],
    ) -> Result<(), ReqError> {
        let mut parts = Vec::with_capacity(runs.len());
        let mut at = 0usize;
        for &(a, n) in runs {
            parts.push((a, &data[at..at + n as usize]));
            at += n as usize;
        }
        mem.write_runs(&parts)?;
        Ok(())
    }

    /// Reports to the sink the whole pages of `runs` a read of disk bytes from `off`
    /// (served as `extents`) filled, but those at read offsets `filled` (ascending:
    /// filled from frames, not written).
    fn report(
        &mut self,
        mem: &RemoteMemory,
        runs: &[(u64, u64)],
        off: u64,
        extents: &[Extent],
        filled: &[u64],
    ) {
        let mut by_file: BTreeMap<RamFile, Vec<Landed>> = BTreeMap::new();
        let mut stream = 0u64;
        for &(a, n) in runs {
            for (file, gfn, in_run) in mem.whole_pages(a, n) {
                if filled.binary_search(&(stream + in_run)).is_ok() {
                    continue;
                }
                let d = off + stream + in_run;
                let src = extents
                    .iter()
                    .find(|e| e.off <= d && d + PAGE <= e.off + e.len)
                    .and_then(|e| e.source.page_source(d));
                if let Some(source) = src {
                    by_file
                        .entry(file)
                        .or_default()
                        .push(Landed { gfn, source });
                }
            }
            stream += n;
        }
        for (file, pages) in by_file {
            for p in &pages {
                match p.source {
                    crate::landed::Source::Base { .. } => self.counters.landed_base += 1,
                    crate::landed::Source::Overlay => self.counters.landed_overlay += 1,
                    crate::landed::Source::Zero => self.counters.landed_zero += 1,
                }
            }
            self.sink.landed(file, &pages);
        }
    }
}
