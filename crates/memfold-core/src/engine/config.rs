//! The engine's parameters: one set of defaults memfoldd and `memfold run` share.

use memfold_codecs::{CompressCodec, PatchCodec};
use serde::Serialize;

use super::CompressBacking;
use crate::clock::Policy;
use crate::similarity::{SimilarityConfig, SimilarityDetector};
use crate::{page_hash, Page, PAGE_SIZE};

/// What to do with guest pages that are all zero.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum ZeroPolicy {
    /// Punch them out of guest RAM; the agent fills a zero page on the next access (ESX
    /// §4.3's zero page without a frame or a mapping, so no VMA is spent).
    Reclaim,
    /// Map them onto one shared zero frame, copy-on-write (ESX §4.3).
    Share,
    /// Leave them alone (Satori §4.1: zero pages are mostly short-lived free memory).
    Keep,
}

impl ZeroPolicy {
    /// The names [`ZeroPolicy::from_name`] takes.
    pub const NAMES: [&'static str; 3] = ["reclaim", "share", "keep"];

    /// The policy named `name` (one of [`ZeroPolicy::NAMES`]).
    pub fn from_name(name: &str) -> Option<Self> {
        match name {
            "reclaim" => Some(ZeroPolicy::Reclaim),
            "share" => Some(ZeroPolicy::Share),
            "keep" => Some(ZeroPolicy::Keep),
            _ => None,
        }
    }

    /// The policy's name.
    pub fn name(self) -> &'static str {
        match self {
            ZeroPolicy::Reclaim => "reclaim",
            ZeroPolicy::Share => "share",
            ZeroPolicy::Keep => "keep",
        }
    }
}

/// The engine's parameters. [`EngineConfig::default`] is the one set of defaults memfoldd
/// and `memfold run` share.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// Which mechanisms may touch pages of each NRU class (DE §4.2).
    pub policy: Policy,
    /// What to do with zero pages.
    pub zero: ZeroPolicy,
    /// HashSimilarityDetector parameters (DE §3.2).
    pub similarity: SimilarityConfig,
    /// Patch encoding (DE §3.2).
    pub patch_codec: PatchCodec,
    /// Largest patch kept, bytes (DE §3.2: 2048).
    pub patch_cutoff: usize,
    /// Page compressor (DE §3.3).
    pub compress_codec: CompressCodec,
    /// Largest compressed page kept, bytes (DE §3.3 uses 2048; the store's multi-page size
    /// classes let larger blobs save memory too, so the default is 3584: at least 512
    /// bytes saved a page).
    pub compress_cutoff: usize,
    /// Where pages that only compress (DE §3.3: no patch, no share) are kept: memfold's
    /// store, or the kernel's swap (zswap) behind the agent's `MADV_PAGEOUT` (issue 15).
    pub compress_backing: CompressBacking,
    /// With [`CompressBacking::Zswap`]: pool frames that only patches hold go to the
    /// kernel's swap too, this often and once quiet this long, µs (issue 15, "dedup in
    /// the store": one compressed copy for all the pages that patch against a frame;
    /// `engine/kernel_swap.rs`); `None` keeps every frame in RAM. Default
    /// [`FRAME_PAGE_OUT_US`].
    ///
    /// [`FRAME_PAGE_OUT_US`]: super::kernel_swap::FRAME_PAGE_OUT_US
    pub page_out_frames_us: Option<u64>,
    /// With frame page-out on: frames some guest page maps go too, once no guest has
    /// touched them since its clock dropped their PTEs (issue 15: cold shared frames
    /// compressed as well). Each round's next clock pass drops the PTEs of every guest
    /// page mapped onto a frame ([`Command::ClockScan`]`::zap_shared`), and the kernel,
    /// which pages out only what no process maps, keeps those read since in RAM. Off:
    /// only frames that patches alone hold.
    ///
    /// [`Command::ClockScan`]: super::Command::ClockScan
    pub page_out_mapped_frames: bool,
    /// Sharing scan rate limit, pages/s (ESX §4.3); 0 scans at full speed.
    pub rate: u64,
    /// Shortest time between the starts of two full sharing scans, µs.
    pub min_scan_interval_us: u64,
    /// Longest time between full scans, µs: after a quiet scan (requests for under 0.1%
    /// of the pages read) the interval doubles up to this; a busy one resets it.
    pub max_scan_interval_us: u64,
    /// Most full scans between two reads of a quiet page, scans (1, 2, 4 or 8; 1 reads
    /// every resident page in every scan): a page read 3, 5 and 8 scans in a row with
    /// nothing found is then read every 2nd, 4th and 8th scan, as Linux KSM's smart scan
    /// (on by default since 6.7) skips pages that did not merge, up to 8 scans
    /// (`scan.rs`). 8, the default.
    pub quiet_scan_period: u32,
    /// Hash intervals the hints of quiet pages are kept in, one a full scan (DE §4.3's
    /// "multiple passes", after Kloster et al.; [`crate::share::ShareTable`]): odd, 1..=15
    /// (odd, so the intervals cycle through the scans that read every page, multiples of
    /// [`Self::quiet_scan_period`]). A page read in its first 3 scans since it was new,
    /// led to a request, or was seen written by the clock (quiet age under 3) is hinted
    /// in every scan, so new sharing is found as soon as without partitioning; a quiet
    /// page only in its interval's scans: the table holds about 1/passes of the quiet
    /// pages' hints (issue 19, metadata), and two quiet duplicates meet within passes ×
    /// the quiet period scans. Shared frames are in the
    /// table in every scan. 1 (no partitioning), the default: at 5 the largest metadata
    /// of a 0.5 GiB guest's run went 0.523% → 0.482% at the same saving (docs/metadata.md),
    /// but under the Difference Engine a cold page whose twin's hint is out of the
    /// current interval is compressed on its own rather than shared.
    pub share_passes: u32,
    /// Time for the NRU clock's hand to pass over each guest once, µs (DE §4.2: ≥ 4 s);
    /// `None`: no clock, so no R/M tracking faults and sharing alone.
    pub clock_interval_us: Option<u64>,
    /// Most clock passes between two armings of a settled hot page (one the clock found
    /// used in 3 consecutive scans; [`crate::clock::ClockHand::arm_mask`]): fewer R-bit
    /// faults for the same classes of cold pages. 1 arms every page every pass (DE §4.2
    /// as written); at most 64, the default: a page hot for 3 scans that then goes cold
    /// is found so within 64 passes (256 s at a 4 s interval), and on the mixed set the
    /// steady clock faults fell 6.5× against 4.3× at 16, at the same saving (docs/peer.md).
    pub clock_rearm_max: u32,
    /// Pages the similarity index is sized for, per page the last clock cycle offered it
    /// as a reference candidate, at most the managed pages (DE §4.3 sizes it by managed
    /// pages: half a bucket a page a group, its first cycle here too). The index has half
    /// a bucket a group per page sized for (rounded up to a power of two), so 2 gives
    /// each group at least a bucket per offered page; 1..=8. 2, the default (issue 19): it
    /// was 4, and 2 patched as many pages with half the index (docs/metadata.md).
    pub similarity_per_offered: u32,
    /// Share identical pages without a mapping (issue 19): a page identical to a pool
    /// frame is kept in the store as a patch against it (DE §3.2's degenerate patch) instead
    /// of mapped (ESX §4.3), so it costs QEMU no VMA, when the NRU clock finds it cold
    /// (a class the policy patches or compresses) or the guest's agent refused a share
    /// lately (its VMA budget). Read while so kept, it comes back private on the access
    /// and waits the re-store back-off before it is kept so again. `true`, the default.
    pub share_cold_unmapped: bool,
    /// Serve reads of base blocks that frames hold from those frames (Satori §5.2,
    /// [`super::fill`]): the engine learns which blocks frames hold and fills what block
    /// devices ask. `false` (the default: on this host's fast local disk a fill's round
    /// trip through memfoldd and the agent under load cost the guests more than the disk
    /// read it saves — docs/sharing-at-read.md): every fill is answered empty, nothing is
    /// learnt. Worth it where a disk read costs more (network or contended storage).
    pub read_fill: bool,
    /// Host memory budget for the guests' RAM (their memfds, the pool and the store),
    /// bytes; over it, cold pages are swapped out (DE §4.6). `None`: no swapping.
    pub host_budget: Option<u64>,
    /// Use what enlightened guests say their pages are (PV §3.1, issue 17;
    /// [`crate::categories`]): the sharing scan passes over the pages a guest reported as
    /// of a category of [`EngineConfig::guest_skip`] and reads its page-cache
    /// pages first, then the rest. Guests that report nothing are scanned as before.
    /// `true`, the default.
    pub guest_categories: bool,
    /// With [`EngineConfig::guest_categories`], the categories whose pages the sharing
    /// scan passes over. Slab by default. PV §3.1 skips slab and kernel pages ("kernel
    /// only pages … should not be shared", a limit of its Xen design, where the guest
    /// kernel takes no fault on them; memfold's agent serves any fault); measured on two
    /// `tiny` guests, their kernel pages do share (identical kernels): skipping slab and
    /// kernel read 42% fewer pages but saved 33% less, slab alone 11% fewer pages for 3%
    /// less (docs/enlightened.md).
    pub guest_skip: crate::categories::CategorySet,
    /// With [`EngineConfig::guest_categories`], discard the private pages an enlightened
    /// guest reports free, without copying (issue 17; [`super::free_discard`]): watched
    /// first, discarded only if a later report still shows them free and no write
    /// reached them since. `true`, the default.
    pub discard_free: bool,
    /// With [`EngineConfig::guest_categories`], take the NRU clock's R bit of an
    /// enlightened guest's LRU pages (page cache, anonymous, free) from its own report
    /// (its kernel's referenced and active bits) instead of zapping them at each visit
    /// (issue 17, "the clock from the guest's LRU"): their reads take no minor fault.
    /// M stays exact (they are still write-protected). Kernel, slab and unreported pages
    /// keep the host's R. `false`, the default (docs/enlightened.md has the measurement).
    pub clock_from_guest: bool,
    /// A wait target per guest, percent of the time its threads may wait on its agent
    /// (issue 15; [`super::wait_target`]): over it, pages must stay idle longer before
    /// they are stored. `None` (the default): no target.
    pub wait_target_pct: Option<f64>,
    /// The share table's content hash ([`page_hash`], xxh3-64). Tests replace it with
    /// one that collides, so that every match must be confirmed byte for byte.
    pub page_hash: fn(&Page) -> u64,
}

impl Default for EngineConfig {
    /// The Difference Engine policy with a 4 s clock (settled hot pages re-armed every 64
    /// passes), zero pages reclaimed, run-diff
    /// patches under 2 KiB and zstd compression under 3.5 KiB, scanning 100 000 pages/s with
    /// full scans 1–8 s apart, quiet pages read in every 8th; no host budget.
    fn default() -> Self {
        EngineConfig {
            policy: Policy::difference_engine(),
            zero: ZeroPolicy::Reclaim,
            similarity: SimilarityConfig::default(),
            patch_codec: PatchCodec::RunDiff,
            patch_cutoff: 2048,
            compress_codec: CompressCodec::Zstd,
            compress_cutoff: 3584,
            compress_backing: CompressBacking::Store,
            page_out_frames_us: Some(super::kernel_swap::FRAME_PAGE_OUT_US),
            page_out_mapped_frames: true,
            rate: 100_000,
            min_scan_interval_us: 1_000_000,
            max_scan_interval_us: 8_000_000,
            quiet_scan_period: 8,
            share_passes: 1,
            clock_interval_us: Some(4_000_000),
            clock_rearm_max: 64,
            similarity_per_offered: 2,
            share_cold_unmapped: true,
            read_fill: false,
            host_budget: None,
            guest_categories: true,
            guest_skip: crate::categories::CategorySet::SLAB,
            discard_free: true,
            clock_from_guest: false,
            wait_target_pct: None,
            page_hash,
        }
    }
}

/// A configuration the engine cannot run.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ConfigError {
    /// A cut-off over one page.
    #[error("{which} cut-off of {bytes} bytes: at most 4096")]
    Cutoff {
        /// `patch` or `compression`.
        which: &'static str,
        /// The value given.
        bytes: usize,
    },
    /// A policy that patches or compresses, or a host budget, without the NRU clock.
    #[error("{what} needs the NRU clock: give a clock interval (e.g. 4 s)")]
    NeedsClock {
        /// What needs it.
        what: String,
    },
    /// Similarity parameters out of range.
    #[error("similarity: {0}")]
    Similarity(String),
    /// A clock re-arm period out of 1..=64 passes.
    #[error("clock re-arm period of {0} passes: give 1 to 64")]
    ClockRearm(u32),
    /// A similarity index sized for out of 1..=8 pages a page offered.
    #[error("similarity index sized for {0} pages a page offered: give 1 to 8")]
    SimilarityPerOffered(u32),
    /// A quiet-page period other than 1, 2, 4 or 8 scans.
    #[error("quiet pages read every {0} scans: give 1, 2, 4 or 8")]
    QuietScanPeriod(u32),
    /// Share passes even or out of 1..=15.
    #[error("share table in {0} passes: give an odd number from 1 to 15")]
    SharePasses(u32),
    /// A wait target outside (0, 100) percent.
    #[error("wait target of {0}%: give more than 0 and less than 100")]
    WaitTarget(String),
}

impl EngineConfig {
    /// Checks the configuration.
    ///
    /// Errors: [`ConfigError`], saying which parameter and why.
    pub fn validate(&self) -> Result<(), ConfigError> {
        for (which, bytes) in [
            ("patch", self.patch_cutoff),
            ("compression", self.compress_cutoff),
        ] {
            if bytes > PAGE_SIZE {
                return Err(ConfigError::Cutoff { which, bytes });
            }
        }
        if !(1..=64).contains(&self.clock_rearm_max) {
            return Err(ConfigError::ClockRearm(self.clock_rearm_max));
        }
        if !(1..=8).contains(&self.similarity_per_offered) {
            return Err(ConfigError::SimilarityPerOffered(
                self.similarity_per_offered,
            ));
        }
        if ![1, 2, 4, 8].contains(&self.quiet_scan_period) {
            return Err(ConfigError::QuietScanPeriod(self.quiet_scan_period));
        }
        if self.share_passes % 2 == 0 || self.share_passes > 15 {
            return Err(ConfigError::SharePasses(self.share_passes));
        }
        if self.clock_interval_us.is_none() {
            if self.policy.needs_clock() {
                return Err(ConfigError::NeedsClock {
                    what: format!("policy {} (patching or compression)", self.policy.name),
                });
            }
            if self.host_budget.is_some() {
                return Err(ConfigError::NeedsClock {
                    what: "a host budget (swap picks C4 pages)".into(),
                });
            }
        }
        if let Some(p) = self.wait_target_pct.filter(|p| !(*p > 0.0 && *p < 100.0)) {
            return Err(ConfigError::WaitTarget(p.to_string()));
        }
        SimilarityDetector::new(self.similarity).map_err(ConfigError::Similarity)?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Each knob out of its range is refused, naming it; its ends are taken.
    #[test]
    fn knobs_out_of_range_are_refused_by_name() {
        let with = |f: &dyn Fn(&mut EngineConfig)| {
            let mut c = EngineConfig::default();
            f(&mut c);
            c.validate()
        };
        for k in [1, 8] {
            assert_eq!(with(&|c| c.similarity_per_offered = k), Ok(()));
        }
        for k in [0, 9] {
            let e = with(&|c| c.similarity_per_offered = k).unwrap_err();
            assert_eq!(e, ConfigError::SimilarityPerOffered(k));
            assert!(e.to_string().contains("similarity index"), "{e}");
        }
        assert_eq!(
            with(&|c| c.clock_rearm_max = 65),
            Err(ConfigError::ClockRearm(65))
        );
        for k in [1, 5, 15] {
            assert_eq!(with(&|c| c.share_passes = k), Ok(()));
        }
        for k in [0, 2, 4, 17] {
            let e = with(&|c| c.share_passes = k).unwrap_err();
            assert_eq!(e, ConfigError::SharePasses(k));
            assert!(e.to_string().contains("odd"), "{e}");
        }
    }
}
