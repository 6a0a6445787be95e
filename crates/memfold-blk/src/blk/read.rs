//! The read path: a read's pages filled from frames where memfoldd holds their blocks
//! ([`super::fill`]), the rest read from the disk into the device's reused aligned buffer
//! and written into guest RAM through QEMU, every page that landed reported.

use std::collections::BTreeMap;

use super::{fill, sub_runs, BlkBackend, Chain, ReqError};
use crate::disk::Extent;
use crate::landed::Landed;
use crate::mem::{RamFile, RemoteMemory, PAGE};

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
    /// The bytes come from a read ahead covering this range if one ran while the
    /// previous request was copied or the guest took it (`ahead.rs`), else from the
    /// disk now, into one of the device's reused aligned buffers: the disk reads
    /// straight into it with `O_DIRECT` (`RawDisk::read_at`), so a request's bytes are
    /// copied once, into guest RAM, and no buffer is allocated or zeroed for it. Before
    /// that copy, the next request's disk read is started if `serve_pass` found one
    /// waiting.
    fn read_disk(
        &mut self,
        mem: &RemoteMemory,
        runs: &[(u64, u64)],
        off: u64,
        len: u64,
        filled: &[u64],
    ) -> Result<(), ReqError> {
        // Read before now: served only if the base is still the one they were read
        // from, as every read checks after itself (else the disk's own read refuses).
        let ahead = self.ahead.take(off, len).and_then(|(buf, extents, at)| {
            if self.disk.check_base().is_ok() {
                Some((buf, extents, at))
            } else {
                self.ahead.drop_unused(buf);
                None
            }
        });
        let (buf, extents, at) = match ahead {
            Some((buf, extents, at)) => {
                self.counters.read_ahead += 1;
                (buf, Ok(extents), at)
            }
            None => {
                let mut buf = self.ahead.buffer(len as usize);
                let extents = self.read_from_disk(off, buf.bytes_mut(), filled);
                (buf, extents, 0)
            }
        };
        self.ahead.served(off, len);
        let bytes = &buf.bytes()[at..at + len as usize];
        let r = extents.and_then(|extents| {
            if let Some((o, n)) = self.ahead.next.take() {
                self.ahead.start(&self.disk, o, n);
            }
            if filled.is_empty() {
                self.put(mem, runs, bytes)?;
            } else {
                self.put_except(mem, runs, bytes, filled)?;
            }
            self.report(mem, runs, off, &extents, filled);
            Ok(())
        });
        self.ahead.give_back(buf);
        r
    }

    /// Reads from the disk into `buf` (`len` bytes at `off`, holding an earlier
    /// request's bytes: every byte the guest gets is read into it first —
    /// [`crate::disk::Disk::read`] writes all of its buffer) all but the pages at read
    /// offsets `filled` (frames filled them; they are not written to the guest).
    /// Returns where the bytes came from.
    ///
    /// Errors: the disk's.
    fn read_from_disk(
        &mut self,
        off: u64,
        buf: &mut [u8],
        filled: &[u64],
    ) -> Result<Vec<Extent>, ReqError> {
        let len = buf.len() as u64;
        let extents = if filled.is_empty() {
            self.throttle_read(len);
            self.disk.read(off, buf)?
        } else {
            // Only what frames did not fill comes from the disk.
            let mut extents = Vec::new();
            for (a, b) in fill::unfilled(filled, len) {
                self.throttle_read(b - a);
                let e = self.disk.read(off + a, &mut buf[a as usize..b as usize])?;
                extents.extend(e);
            }
            extents
        };
        self.counters.disk_read_bytes += len - filled.len() as u64 * PAGE;
        Ok(extents)
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
