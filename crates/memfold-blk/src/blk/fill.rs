//! Reads served from frames (Satori §5.2: "some reads can be satisfied without accessing
//! the underlying physical device"): before reading the disk, the device asks memfoldd
//! to map frames that hold the base blocks of the read over the pages it would write.
//!
//! The protocol and why it loses nothing (the invariant is the agent's, checked in
//! `memfold-agent/tests/fill.rs`): the device writes a nonce — unique to this request
//! of this device process — at the start of each page it asks for, through QEMU's page
//! tables as every write; memfoldd has the agent map the frame over each page that still
//! begins with the nonce, checked under write-protection. The device waits at most
//! [`FILL_WAIT`]; the pages not filled by then it writes from the disk, which overwrites
//! their nonce, so a fill arriving later finds no nonce and maps nothing; a fill racing
//! that write makes it land in a CoW copy of a frame that holds the same block. Pages
//! filled the device does not write. Only blocks memfoldd said frames hold are asked
//! for (`LandedSink::held`); a read of others costs nothing more. A fill not answered in
//! its whole wait holds fills off for [`FILL_BACKOFF`] ([`Backoff`]).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use memfold_ids::{BaseBlock, Gfn};

use super::{BlkBackend, ReqError};
use crate::landed::Source;
use crate::mem::{RamFile, RemoteMemory, PAGE};

/// How long a read waits for memfoldd's fill before it reads the disk. An `O_DIRECT`
/// read of a readahead window takes ~0.1–1 ms on a local SSD; a fill answers in about
/// a round trip through memfoldd and the agent.
pub const FILL_WAIT: Duration = Duration::from_millis(20);

/// How long no fill is asked for after one was not answered within [`FILL_WAIT`]: a
/// stalled memfoldd would otherwise cost every read of a held block that wait, with the
/// backend's lock held (a pass over a full queue, 256 reads: ~5 s).
pub const FILL_BACKOFF: Duration = Duration::from_secs(2);

/// When fills may be asked again (see [`FILL_BACKOFF`]).
#[derive(Debug, Default)]
pub(super) struct Backoff {
    until: Option<Instant>,
}

impl Backoff {
    /// Whether a fill may be asked at `now`.
    pub(super) fn allows(&self, now: Instant) -> bool {
        self.until.is_none_or(|u| now >= u)
    }

    /// A fill asked at `asked` came back at `now` with `filled` pages filled; returns
    /// whether fills are held off from now on. One that filled nothing in its whole wait
    /// was not answered (a quick answer of nothing is memfoldd's: not a stall).
    pub(super) fn answered(&mut self, asked: Instant, now: Instant, filled: usize) -> bool {
        let unanswered = filled == 0 && now.saturating_duration_since(asked) >= FILL_WAIT;
        self.until = unanswered.then(|| now + FILL_BACKOFF);
        unanswered
    }
}

/// The next nonce: this process's start (CLOCK_MONOTONIC ns, with the pid) and a
/// counter, so no two requests of any device process share one; never zero.
fn next_nonce() -> [u64; 2] {
    static START: OnceLock<u64> = OnceLock::new();
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let start = *START
        .get_or_init(|| memfold_sys::proc::monotonic_ns() ^ (std::process::id() as u64) << 44 | 1);
    [start, NEXT.fetch_add(1, Ordering::Relaxed)]
}

/// The nonce as written at the start of a page (native byte order, as the agent reads it).
pub(super) fn nonce_bytes(n: [u64; 2]) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&n[0].to_ne_bytes());
    b[8..].copy_from_slice(&n[1].to_ne_bytes());
    b
}

/// What [`BlkBackend::fill_from_frames`] did to a read's pages.
#[derive(Debug, Default)]
pub(super) struct Filled {
    /// Offsets in the read (bytes from its start) of the whole pages filled, ascending:
    /// pages the caller must not write.
    pub(super) at: Vec<u64>,
    /// Guest addresses of the pages asked for and not filled: each begins with the
    /// nonce until the caller writes it. A read that fails before writing them all
    /// wipes them ([`BlkBackend::wipe_nonces`]): memfoldd may still answer.
    pub(super) nonced: Vec<u64>,
}

impl BlkBackend {
    /// Tries to serve the read of `len` disk bytes at `off` into the guest runs `runs`
    /// from frames (see [`Filled`]). Nothing filled when memfoldd holds none of the
    /// read's base blocks, is away, or did not answer in time.
    ///
    /// Errors: [`ReqError`] if a nonce could not be written into guest RAM (nothing is
    /// asked then).
    pub(super) fn fill_from_frames(
        &mut self,
        mem: &RemoteMemory,
        runs: &[(u64, u64)],
        off: u64,
        len: u64,
    ) -> Result<Filled, ReqError> {
        if self.disk.base_changed()
            || !self.sink.holds_any()
            || !self.fill_backoff.allows(Instant::now())
        {
            return Ok(Filled::default());
        }
        let Some(extents) = self.disk.sources(off, len).ok().flatten() else {
            return Ok(Filled::default());
        };
        // (page's guest-physical address, offset in the read, page, block), one RAM file.
        let mut ram: Option<RamFile> = None;
        let mut asked: Vec<(u64, u64, Gfn, BaseBlock)> = Vec::new();
        let mut stream = 0u64;
        for &(a, n) in runs {
            for (file, gfn, in_run) in mem.whole_pages(a, n) {
                let d = off + stream + in_run;
                let src = extents
                    .iter()
                    .find(|e| e.off <= d && d + PAGE <= e.off + e.len)
                    .and_then(|e| e.source.page_source(d));
                let Some(Source::Base { disk, block }) = src else {
                    continue;
                };
                let b = BaseBlock { disk, block };
                if *ram.get_or_insert(file) == file && self.sink.held(b) {
                    asked.push((a + in_run, stream + in_run, gfn, b));
                }
            }
            stream += n;
        }
        let Some(ram) = ram.filter(|_| !asked.is_empty()) else {
            return Ok(Filled::default());
        };
        let nonce = next_nonce();
        let bytes = nonce_bytes(nonce);
        for &(gpa, ..) in &asked {
            mem.write(gpa, &bytes)?;
        }
        let pages: Vec<(Gfn, BaseBlock)> = asked.iter().map(|&(_, _, g, b)| (g, b)).collect();
        let asked_at = Instant::now();
        let filled = self.sink.fill(ram, &pages, nonce, FILL_WAIT);
        if self
            .fill_backoff
            .answered(asked_at, Instant::now(), filled.len())
        {
            tracing::warn!(
                "memfoldd did not answer a fill within {FILL_WAIT:?}: reads are served from the disk alone for {FILL_BACKOFF:?}"
            );
        }
        self.counters.fill_asked += asked.len() as u64;
        let mut out: Vec<u64> = asked
            .iter()
            .filter(|(_, _, g, _)| filled.contains(g))
            .map(|&(_, at, ..)| at)
            .collect();
        out.sort_unstable();
        out.dedup();
        self.counters.filled += out.len() as u64;
        let nonced = asked
            .iter()
            .filter(|(_, _, g, _)| !filled.contains(g))
            .map(|&(gpa, ..)| gpa)
            .collect();
        Ok(Filled { at: out, nonced })
    }

    /// Overwrites the nonce at the start of each page at guest address `gpas` (a read
    /// that failed before writing them): a fill memfoldd answers after the guest has its
    /// buffer back then finds no nonce and maps nothing over what the guest writes next
    /// (one racing this write makes it land in a copy of the frame). Best effort: a
    /// write that fails is QEMU's memory gone.
    pub(super) fn wipe_nonces(&self, mem: &RemoteMemory, gpas: &[u64]) {
        for &gpa in gpas {
            if let Err(e) = mem.write(gpa, &[0u8; 16]) {
                tracing::warn!("a nonce at {gpa:#x} could not be wiped: {e}");
            }
        }
    }

    /// Writes `data` into the guest runs `runs` except the whole pages at read offsets
    /// `skip` (ascending; filled from frames).
    pub(super) fn put_except(
        &self,
        mem: &RemoteMemory,
        runs: &[(u64, u64)],
        data: &[u8],
        skip: &[u64],
    ) -> Result<(), ReqError> {
        let mut parts = Vec::new();
        let mut stream = 0u64;
        let mut k = 0usize;
        for &(a, n) in runs {
            let mut at = 0u64;
            while at < n {
                while k < skip.len() && skip[k] < stream + at {
                    k += 1;
                }
                let next_skip = skip.get(k).copied().filter(|&s| s < stream + n);
                let end = next_skip.map_or(n, |s| s - stream);
                if end > at {
                    let from = (stream + at) as usize;
                    parts.push((a + at, &data[from..from + (end - at) as usize]));
                }
                at = match next_skip {
                    Some(s) => s - stream + PAGE,
                    None => n,
                };
            }
            stream += n;
        }
        mem.write_runs(&parts)?;
        Ok(())
    }
}

/// The byte ranges `[a, b)` of a read of `len` bytes outside the whole pages at offsets
/// `filled` (ascending, each a page).
pub(super) fn unfilled(filled: &[u64], len: u64) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = 0u64;
    for &f in filled {
        if f > at {
            out.push((at, f));
        }
        at = at.max(f + PAGE);
    }
    if at < len {
        out.push((at, len));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_disk_reads_only_what_frames_did_not_fill() {
        assert_eq!(unfilled(&[], 8192), [(0, 8192)]);
        assert_eq!(unfilled(&[0, 4096], 8192), []);
        assert_eq!(
            unfilled(&[4096, 12288], 5 * 4096),
            [(0, 4096), (8192, 12288), (16384, 20480)]
        );
    }

    #[test]
    fn a_fill_unanswered_in_its_whole_wait_holds_fills_off_for_the_backoff() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let mut b = Backoff::default();
        assert!(b.allows(t0));
        // Nothing filled, answered at once (memfoldd's frames changed): asked again.
        assert!(!b.answered(t0, t0 + ms(1), 0));
        assert!(b.allows(t0 + ms(1)));
        // Nothing filled in the whole wait: none asked for the backoff.
        let t1 = t0 + FILL_WAIT;
        assert!(b.answered(t0, t1, 0));
        assert!(!b.allows(t1));
        assert!(!b.allows(t1 + FILL_BACKOFF - ms(1)));
        assert!(b.allows(t1 + FILL_BACKOFF));
        // A fill answered after it clears it.
        let t2 = t1 + FILL_BACKOFF;
        assert!(!b.answered(t2, t2 + FILL_WAIT, 1));
        assert!(b.allows(t2 + FILL_WAIT));
    }
}
