//! The sharing potential of a running guest set and what a side captured of it, sampled
//! alike for memfold and for KSM (Satori §6.1 reports sharing "as a fraction of the
//! total sharing potential", both taken at the same instants). Zero pages are left out
//! of both: they are reclaimed or merged with no frame at all, and would swamp the
//! page-cache duplicates this measures.
//!
//! - memfold: memfoldd's census ([`memfold_live::query_census`]: every guest page by
//!   content) gives the potential; its books give what is captured (non-zero pages on
//!   frames beyond one a frame, and pages shared without a mapping).
//! - KSM: the guests' RAM read through `/proc/PID/mem` ([`memfold_vm::census`]) gives the
//!   potential; the host frames under it give what is captured: non-zero pages present
//!   minus the distinct frames holding them (KSM merges a content into one frame).

use std::collections::HashSet;
use std::path::Path;

use anyhow::{Context, Result};
use memfold_core::census::Census;
use memfold_vm::census::{for_each_ram_page, RamPage};
use memfold_vm::launcher::Guest;
use memfold_wire::Stats;
use serde::Serialize;

/// The guests' non-zero duplicates at one instant, pages.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct SharingCensus {
    /// Guest pages counted.
    pub pages: u64,
    /// Of those, zero pages (left out of the rest).
    pub zero_pages: u64,
    /// What sharing every non-zero duplicate would save: for each non-zero content held
    /// by n pages, n − 1.
    pub potential_pages: u64,
    /// What the side saves by sharing non-zero contents now.
    pub captured_pages: u64,
}

/// When a run takes its censuses (`--census SECS`): at its first sample, then once
/// `secs` seconds of run time have passed since the last; never without `secs`.
#[derive(Clone, Copy, Debug)]
pub struct CensusEvery {
    secs: Option<u64>,
    last: Option<f64>,
}

impl CensusEvery {
    /// Censuses every `secs` seconds (`None`: none).
    pub fn new(secs: Option<u64>) -> CensusEvery {
        CensusEvery { secs, last: None }
    }

    /// Whether a census is due at run time `t` (s); a due census counts as taken.
    pub fn due(&mut self, t: f64) -> bool {
        let Some(every) = self.secs else {
            return false;
        };
        let due = self.last.is_none_or(|l| t - l >= every as f64);
        if due {
            self.last = Some(t);
        }
        due
    }
}

/// What a run captured of the potential over its censuses.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct CapturedOverTime {
    /// Censuses counted (from the first with a potential on).
    pub censuses: usize,
    /// Mean potential over them, pages.
    pub mean_potential_pages: f64,
    /// Mean captured over them, pages.
    pub mean_captured_pages: f64,
}

impl CapturedOverTime {
    /// The censuses `(t, census)` of a run, from the first with a potential on (before it,
    /// the guests have not made duplicates yet); `None` without one.
    pub fn of(censuses: impl Iterator<Item = SharingCensus>) -> Option<CapturedOverTime> {
        let c: Vec<SharingCensus> = censuses.skip_while(|c| c.potential_pages == 0).collect();
        (!c.is_empty()).then(|| {
            let n = c.len() as f64;
            CapturedOverTime {
                censuses: c.len(),
                mean_potential_pages: c.iter().map(|c| c.potential_pages as f64).sum::<f64>() / n,
                mean_captured_pages: c.iter().map(|c| c.captured_pages as f64).sum::<f64>() / n,
            }
        })
    }

    /// Captured over potential, both averaged over time (Satori §6.1's figure).
    pub fn fraction(&self) -> f64 {
        if self.mean_potential_pages == 0.0 {
            1.0
        } else {
            self.mean_captured_pages / self.mean_potential_pages
        }
    }

    /// One line for a summary.
    pub fn line(&self) -> String {
        format!(
            "sharing captured: {:.1}% of the potential (non-zero duplicates; means over {} censuses: {:.0} of {:.0} pages)",
            self.fraction() * 100.0,
            self.censuses,
            self.mean_captured_pages,
            self.mean_potential_pages
        )
    }
}

/// memfold's census now, from memfoldd at `socket`, with its statistics `stats` taken
/// just before.
///
/// Errors: memfoldd does not answer.
pub fn of_memfold(socket: &Path, stats: &Stats) -> Result<SharingCensus> {
    let c = memfold_live::query_census(socket)
        .with_context(|| format!("a census from memfoldd at {}", socket.display()))?;
    let zero_mapped: u64 = stats.vms.iter().map(|v| v.zero_shared_pages).sum();
    let zero_frame = u64::from(zero_mapped > 0);
    let nonzero_mapped = stats.mapped_pages.saturating_sub(zero_mapped);
    let captured = nonzero_mapped.saturating_sub(stats.frames.saturating_sub(zero_frame))
        + stats.unmapped_pages;
    Ok(SharingCensus {
        pages: c.pages,
        zero_pages: c.zero_pages,
        potential_pages: c.duplicate_pages,
        captured_pages: captured,
    })
}

/// The census of guests not managed by memfold (KSM's side), read from their QEMUs.
///
/// Errors: a QEMU's memory cannot be read (gone, or not root).
pub fn of_guests(guests: &[Guest]) -> Result<SharingCensus> {
    let mut c = Census::new();
    let (mut nonzero_present, mut frames) = (0u64, HashSet::new());
    for g in guests {
        for_each_ram_page(g.pid, g.mem_bytes / 2, |p| match p {
            RamPage::Data { bytes, pfn } => {
                let page: &memfold_core::Page = bytes.try_into().expect("a page");
                if memfold_core::is_zero_page(page) {
                    c.add_zero();
                } else {
                    c.add_hash(memfold_core::page_hash(page));
                    nonzero_present += 1;
                    frames.insert(pfn);
                }
            }
            RamPage::Untouched => c.add_zero(),
            RamPage::Unknown => c.add_unknown(),
        })
        .with_context(|| format!("guest {}: reading its RAM for a census", g.name))?;
    }
    anyhow::ensure!(
        nonzero_present == 0 || !frames.contains(&0),
        "the census needs the host frame numbers of guest pages (/proc/PID/pagemap shows them to root only)"
    );
    Ok(SharingCensus {
        pages: c.pages,
        zero_pages: c.zero_pages,
        potential_pages: c.duplicate_pages(),
        captured_pages: nonzero_present - frames.len() as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn c(potential: u64, captured: u64) -> SharingCensus {
        SharingCensus {
            potential_pages: potential,
            captured_pages: captured,
            ..Default::default()
        }
    }

    #[test]
    fn a_census_is_due_at_the_first_sample_then_every_secs() {
        let mut e = CensusEvery::new(Some(5));
        let due: Vec<f64> = [1.0, 3.0, 5.9, 6.0, 10.0, 11.5]
            .into_iter()
            .filter(|&t| e.due(t))
            .collect();
        assert_eq!(due, [1.0, 6.0, 11.5]);
        assert!(!CensusEvery::new(None).due(100.0));
    }

    #[test]
    fn captured_over_time_is_a_ratio_of_means_from_the_first_potential_on() {
        let o = CapturedOverTime::of([c(0, 0), c(100, 50), c(300, 250)].into_iter()).unwrap();
        assert_eq!(o.censuses, 2);
        assert_eq!(o.fraction(), 150.0 / 200.0);
        assert!(CapturedOverTime::of([c(0, 0)].into_iter()).is_none());
    }
}
