//! What each read put where: the report memfold builds its image of the guests' page
//! caches from (Satori §4.1: "a good image of the page cache contents can be built up by
//! observing the content of disk reads"; §5.2: tapdisk records "what data is loaded into
//! which locations in the guests' memory").
//!
//! After a read request's data is in guest RAM (before the guest is told it completed),
//! the device calls [`LandedSink::landed`] with every guest page the read wrote whole and
//! where its bytes came from. Pages the read wrote only in part are not reported, nor are
//! pages whose bytes came from two sources (part base, part overlay) or from a base range
//! that is not one 4 KiB block (a read at an odd sector offset).

use std::collections::HashMap;

use memfold_ids::{BaseBlock, Gfn};

pub use crate::mem::RamFile;

pub use memfold_ids::DiskId;

/// Where a page's bytes came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Source {
    /// Block `block` (4 KiB units: bytes `[block·4096, +4096)`) of the read-only base
    /// image `disk`: the same bytes for every guest that reads that block.
    Base {
        /// The base image.
        disk: DiskId,
        /// Block index, 4 KiB units.
        block: u64,
    },
    /// This guest's overlay (data it wrote itself).
    Overlay,
    /// Zeros: an unallocated or zero cluster, or past the end of the image.
    Zero,
}

/// One guest page a read wrote whole.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Landed {
    /// The page: its index in the RAM file (file offset / 4096), not its guest-physical
    /// page number (q35 with more than 2 GiB maps one memfd in two regions).
    pub gfn: Gfn,
    /// Where its bytes came from.
    pub source: Source,
}

/// Where the device reports landed pages. Called on the device's queue thread with the
/// request not yet completed to the guest: keep it quick. `Sync` because
/// vhost-user-backend shares the device between its threads (behind a lock).
pub trait LandedSink: Send + Sync {
    /// `pages` of RAM file `ram` now hold what one read put there.
    fn landed(&mut self, ram: RamFile, pages: &[Landed]);

    /// Whether a frame is said to hold base block `b` (Satori §5.2): a read of it may be
    /// served by [`LandedSink::fill`]. Never, for a sink that is not memfoldd.
    fn held(&self, _b: BaseBlock) -> bool {
        false
    }

    /// Whether any block is said to be held: when none is, a read asks nothing and
    /// need not even look at where its bytes come from.
    fn holds_any(&self) -> bool {
        false
    }

    /// Asks that `pages` of `ram` (each already beginning with `nonce`) be filled from
    /// frames holding their blocks; waits up to `wait`; returns the pages filled, which
    /// the device must not write. None, for a sink that is not memfoldd.
    fn fill(
        &self,
        _ram: RamFile,
        _pages: &[(Gfn, BaseBlock)],
        _nonce: [u64; 2],
        _wait: std::time::Duration,
    ) -> Vec<Gfn> {
        Vec::new()
    }
}

/// A sink that counts (tests): pages per source kind, and the last source of each page.
#[derive(Debug, Default)]
pub struct CountingSink {
    /// Pages reported from a base image.
    pub base: u64,
    /// Pages reported from the overlay.
    pub overlay: u64,
    /// Pages reported as zeros.
    pub zero: u64,
    /// The last report of each page.
    pub last: HashMap<(RamFile, Gfn), Source>,
}

impl CountingSink {
    /// All pages reported (a page reported twice counts twice).
    pub fn total(&self) -> u64 {
        self.base + self.overlay + self.zero
    }
}

impl LandedSink for CountingSink {
    fn landed(&mut self, ram: RamFile, pages: &[Landed]) {
        for p in pages {
            match p.source {
                Source::Base { .. } => self.base += 1,
                Source::Overlay => self.overlay += 1,
                Source::Zero => self.zero += 1,
            }
            self.last.insert((ram, p.gfn), p.source);
        }
    }
}

/// A sink that logs each report at debug level (`RUST_LOG=memfold_blk=debug`).
#[derive(Debug, Default)]
pub struct LogSink;

impl LandedSink for LogSink {
    fn landed(&mut self, ram: RamFile, pages: &[Landed]) {
        if let (Some(first), Some(last)) = (pages.first(), pages.last()) {
            tracing::debug!(
                "landed: {} pages of ram {}:{} ({} .. {}), first from {:?}",
                pages.len(),
                ram.dev,
                ram.ino,
                first.gfn,
                last.gfn,
                first.source
            );
        }
    }
}

/// The sink that tells memfoldd (Satori §4.1): every landed page, whatever its source,
/// goes to memfoldd's socket as [`memfold_wire::ToDaemon::ReadLanded`] through a
/// [`memfold_wire::LandedReporter`], which never blocks the queue thread — a report
/// that cannot be queued, or sent while memfoldd is away, is dropped and counted (the
/// scan still finds those pages). memfoldd looks each page up at once and shares it with
/// an equal frame or page; it reads and compares the bytes itself. Pages from a base
/// block are named by it: memfoldd learns from the base (whose descriptor the hello
/// carries) which frames hold which blocks, and serves reads of those from frames
/// (Satori §5.2, [`LandedSink::fill`]).
pub struct MemfolddSink {
    reporter: memfold_wire::LandedReporter,
}

impl MemfolddSink {
    /// A sink reporting to memfoldd's socket at `socket`, for a disk over the base
    /// `base` (its id and a descriptor of its file; `None`: no base, no fill).
    ///
    /// Errors: the reporter's thread could not be started.
    pub fn new(
        socket: &std::path::Path,
        base: Option<(DiskId, std::os::fd::OwnedFd)>,
    ) -> std::io::Result<MemfolddSink> {
        Ok(MemfolddSink {
            reporter: memfold_wire::LandedReporter::spawn_with_bases(
                socket,
                base.into_iter().collect(),
            )?,
        })
    }
}

impl LandedSink for MemfolddSink {
    fn landed(&mut self, ram: RamFile, pages: &[Landed]) {
        let ram = memfold_wire::RamFile {
            dev: ram.dev,
            ino: ram.ino,
        };
        let bases = pages
            .iter()
            .enumerate()
            .filter_map(|(i, p)| match p.source {
                Source::Base { disk, block } => Some((i as u32, BaseBlock { disk, block })),
                _ => None,
            })
            .collect();
        self.reporter
            .report_from(ram, pages.iter().map(|p| p.gfn).collect(), bases);
    }

    fn held(&self, b: BaseBlock) -> bool {
        self.reporter.held(b)
    }

    fn holds_any(&self) -> bool {
        self.reporter.holds_any()
    }

    fn fill(
        &self,
        ram: RamFile,
        pages: &[(Gfn, BaseBlock)],
        nonce: [u64; 2],
        wait: std::time::Duration,
    ) -> Vec<Gfn> {
        let ram = memfold_wire::RamFile {
            dev: ram.dev,
            ino: ram.ino,
        };
        self.reporter.fill(ram, pages, nonce, wait)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counting_sink_counts_by_source() {
        let ram = RamFile { dev: 1, ino: 2 };
        let mut s = CountingSink::default();
        s.landed(
            ram,
            &[
                Landed {
                    gfn: Gfn(3),
                    source: Source::Zero,
                },
                Landed {
                    gfn: Gfn(4),
                    source: Source::Base {
                        disk: DiskId(9),
                        block: 7,
                    },
                },
            ],
        );
        s.landed(
            ram,
            &[Landed {
                gfn: Gfn(3),
                source: Source::Overlay,
            }],
        );
        assert_eq!((s.base, s.overlay, s.zero, s.total()), (1, 1, 1, 3));
        assert_eq!(s.last[&(ram, Gfn(3))], Source::Overlay);
    }
}
