//! Where a QEMU x86 guest's RAM lies in its physical address space, and how its frames
//! map to memfold's gfns (issue 17: an enlightened guest reports by frame; memfold
//! keeps pages by gfn).

use crate::categories::{CategoryRun, PageInfo};
use crate::ids::Gfn;
use crate::PAGE_SIZE;

/// Why a guest's RAM layout does not fit its RAM.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// The guest's RAM above 4 GiB is as large as or larger than all its RAM.
    #[error("{high} pages of RAM above 4 GiB in a guest of {pages} pages")]
    TooHigh {
        /// Pages above 4 GiB the guest reported.
        high: u64,
        /// The guest's RAM, pages.
        pages: u64,
    },
    /// A System RAM range below 4 GiB past the low part of RAM.
    #[error("System RAM up to page {end:#x} below 4 GiB, but only {low:#x} pages are low RAM")]
    LowPast {
        /// End of the range, frame number.
        end: u64,
        /// Pages of RAM below 4 GiB.
        low: u64,
    },
    /// A range that is empty or crosses 4 GiB.
    #[error("range of frames [{start:#x}, {end:#x}) is empty or crosses 4 GiB")]
    BadRange {
        /// First frame.
        start: u64,
        /// End frame.
        end: u64,
    },
    /// More ranges than [`MAX_RAM_RANGES`].
    #[error("{0} RAM ranges (at most {MAX_RAM_RANGES})")]
    TooMany(usize),
    /// QEMU's split of its RAM (QMP) is not whole pages, or does not add up to the RAM.
    #[error("QEMU says {below} bytes of RAM below 4 GiB and {above} above it, for a RAM of {pages} pages")]
    QemuSplit {
        /// Bytes below 4 GiB, as QEMU said.
        below: u64,
        /// Bytes above 4 GiB, as QEMU said.
        above: u64,
        /// The guest's RAM (its memfd's), pages.
        pages: u64,
    },
    /// A System RAM range of the guest outside the RAM QEMU laid out.
    #[error("System RAM [{start:#x}, {end:#x}) lies outside the guest's RAM ({low:#x} pages from 0, {high:#x} from 4 GiB)")]
    Outside {
        /// First frame.
        start: u64,
        /// End frame.
        end: u64,
        /// Pages of RAM at 0.
        low: u64,
        /// Pages of RAM at 4 GiB.
        high: u64,
    },
}

/// Most System RAM ranges a layout takes from a guest.
pub const MAX_RAM_RANGES: usize = 256;

/// First guest frame above the PCI hole: 4 GiB.
pub const FOUR_GIB_PFN: u64 = (4u64 << 30) / PAGE_SIZE as u64;

/// Where a QEMU x86 guest's RAM lies in its physical address space. QEMU (pc and q35)
/// puts the first `low` pages of its RAM at guest-physical 0 and the rest at 4 GiB
/// (q35: `low` = 2 GiB when RAM ≥ 2.75 GiB, else all of it; `max-ram-below-4g` changes
/// the split), and both parts are one RAM block: memfold's gfn is the page's offset in
/// the RAM memfd / 4096. So frame `p` < `low` is gfn `p`, frame 4 GiB/4096 + `k` is
/// gfn `low + k`, and the rest (the PCI hole) is no RAM.
///
/// The split is QEMU's own when memfoldd can ask QEMU ([`RamLayout::from_qemu`]: its PCI
/// host bridge's `below-4g-mem-size` and `above-4g-mem-size`): exact, whatever the
/// guest's kernel was told (`mem=`, `memmap=`). Else it is derived
/// ([`RamLayout::from_ranges`]): from the guest's RAM size (its memfd's, known to
/// memfoldd) and the guest's own e820 "System RAM" ranges (`/proc/iomem`): whatever
/// lies above 4 GiB is the high part, the rest is low — wrong if the guest hid the top
/// of its RAM, so such a layout is not [`exact`](RamLayout::exact).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RamLayout {
    /// Pages of RAM at guest-physical 0.
    pub low: u64,
    /// Pages of RAM at 4 GiB.
    pub high: u64,
    /// QEMU said so (`true`), or the guest's ranges suggest it (`false`).
    pub exact: bool,
}

impl RamLayout {
    /// The layout QEMU gave a guest of `pages` pages: `below` bytes of RAM from
    /// guest-physical 0 and `above` bytes from 4 GiB (QEMU's PCI host bridge's
    /// `below-4g-mem-size`, `above-4g-mem-size`; `pc_memory_init` maps the RAM block's
    /// first `below` bytes at 0 and the rest at 4 GiB).
    ///
    /// Errors: [`LayoutError::QemuSplit`] unless both are whole pages that add up to
    /// `pages` with at most 4 GiB below.
    pub fn from_qemu(pages: u64, below: u64, above: u64) -> Result<RamLayout, LayoutError> {
        let page = PAGE_SIZE as u64;
        let fits = below % page == 0
            && above % page == 0
            && below / page <= FOUR_GIB_PFN
            && below / page + above / page == pages;
        if !fits {
            return Err(LayoutError::QemuSplit {
                below,
                above,
                pages,
            });
        }
        Ok(RamLayout {
            low: below / page,
            high: above / page,
            exact: true,
        })
    }

    /// The layout for a guest's System RAM `ranges` (frames, `[start, end)`): `qemu`'s
    /// if memfoldd has it, once the ranges are checked to lie inside it or wholly past
    /// its RAM at 4 GiB (a hot-plugged DIMM's: another RAM region, whose frames name no
    /// gfn of this one); else derived from the ranges and the RAM's `pages`
    /// ([`RamLayout::from_ranges`]).
    ///
    /// Errors: [`LayoutError`]: a range outside QEMU's RAM (in the PCI hole, across its
    /// end), or ranges that do not fit.
    pub fn for_ranges(
        pages: u64,
        ranges: &[(u64, u64)],
        qemu: Option<RamLayout>,
    ) -> Result<RamLayout, LayoutError> {
        let Some(l) = qemu else {
            return RamLayout::from_ranges(pages, ranges);
        };
        if ranges.len() > MAX_RAM_RANGES {
            return Err(LayoutError::TooMany(ranges.len()));
        }
        for &(start, end) in ranges {
            let inside = start < end
                && (end <= l.low || (start >= FOUR_GIB_PFN && end - FOUR_GIB_PFN <= l.high));
            // Past the RAM, only with QEMU's word on where it ends: inferred, it could
            // be this RAM's hidden top.
            let past = l.exact && start < end && start >= l.high_end();
            if !inside && !past {
                return Err(LayoutError::Outside {
                    start,
                    end,
                    low: l.low,
                    high: l.high,
                });
            }
        }
        Ok(l)
    }

    /// The layout of a guest of `pages` pages whose System RAM ranges (frame numbers,
    /// `[start, end)`) are `ranges`.
    ///
    /// Errors: [`LayoutError`] when the ranges do not fit the RAM (a guest lying, or a
    /// machine type that lays RAM out otherwise).
    pub fn from_ranges(pages: u64, ranges: &[(u64, u64)]) -> Result<RamLayout, LayoutError> {
        if ranges.len() > MAX_RAM_RANGES {
            return Err(LayoutError::TooMany(ranges.len()));
        }
        let mut high_end = FOUR_GIB_PFN;
        for &(start, end) in ranges {
            if start >= end || (start < FOUR_GIB_PFN && end > FOUR_GIB_PFN) {
                return Err(LayoutError::BadRange { start, end });
            }
            if start >= FOUR_GIB_PFN {
                high_end = high_end.max(end);
            }
        }
        let high = high_end - FOUR_GIB_PFN;
        if high >= pages {
            return Err(LayoutError::TooHigh { high, pages });
        }
        let low = pages - high;
        if low > FOUR_GIB_PFN {
            return Err(LayoutError::LowPast {
                end: low,
                low: FOUR_GIB_PFN,
            });
        }
        if let Some(&(_, end)) = ranges.iter().find(|&&(s, e)| s < FOUR_GIB_PFN && e > low) {
            return Err(LayoutError::LowPast { end, low });
        }
        Ok(RamLayout {
            low,
            high,
            exact: false,
        })
    }

    /// Guest RAM, pages.
    pub fn pages(&self) -> u64 {
        self.low + self.high
    }

    /// The frame past the RAM at 4 GiB: the first frame above 4 GiB of no gfn here.
    pub fn high_end(&self) -> u64 {
        FOUR_GIB_PFN + self.high
    }

    /// Whether a guest's run of frames `[start, end)` fits this layout: not empty, and
    /// inside the RAM at 0 or at 4 GiB; with an [`exact`](RamLayout::exact) layout also
    /// from 4 GiB on past the RAM (a hot-plugged DIMM's frames, of another RAM region,
    /// which [`RamLayout::runs`] drops). A run in the PCI hole never fits.
    pub fn takes_run(&self, start: u64, end: u64) -> bool {
        start < end
            && (end <= self.low
                || (start >= FOUR_GIB_PFN && (end <= self.high_end() || self.exact)))
    }

    /// Memfold's gfn of guest frame `pfn`; `None` in the PCI hole or past the RAM.
    pub fn gfn(&self, pfn: u64) -> Option<Gfn> {
        let g = if pfn < self.low {
            pfn
        } else if pfn >= FOUR_GIB_PFN && pfn - FOUR_GIB_PFN < self.high {
            self.low + (pfn - FOUR_GIB_PFN)
        } else {
            return None;
        };
        u32::try_from(g).ok().map(Gfn)
    }

    /// The guest frame of gfn `g`; `None` past the RAM.
    pub fn pfn(&self, g: Gfn) -> Option<u64> {
        let g = g.0 as u64;
        if g < self.low {
            Some(g)
        } else if g < self.pages() {
            Some(FOUR_GIB_PFN + (g - self.low))
        } else {
            None
        }
    }

    /// A run of `count` frames from `pfn` with one report, as gfn runs (split where it
    /// crosses the PCI hole; frames that are no RAM dropped).
    pub fn runs(&self, pfn: u64, count: u64, info: PageInfo, out: &mut Vec<CategoryRun>) {
        let end = pfn.saturating_add(count);
        for (lo, hi) in [(0, self.low), (FOUR_GIB_PFN, FOUR_GIB_PFN + self.high)] {
            let (s, e) = (pfn.max(lo), end.min(hi));
            if s < e {
                let first = self.gfn(s).expect("inside RAM");
                out.push(CategoryRun {
                    first,
                    count: (e - s) as u32,
                    info,
                });
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::categories::Category;

    const MIB: u64 = 256; // pages
    const GIB: u64 = 1024 * MIB;

    /// The System RAM of /proc/iomem of a q35 guest under SeaBIOS with `low` and `high`
    /// pages: the BIOS keeps the first page, the 640 KiB–1 MiB hole and a few pages at the
    /// top of low RAM.
    fn iomem(low: u64, high: u64) -> Vec<(u64, u64)> {
        let mut r = vec![(1, 0x9f), (0x100, low - 0x20)];
        if high > 0 {
            r.push((FOUR_GIB_PFN, FOUR_GIB_PFN + high));
        }
        r
    }

    #[test]
    fn q35_512_mib_is_all_low() {
        let l = RamLayout::from_ranges(512 * MIB, &iomem(512 * MIB, 0)).unwrap();
        assert_eq!(
            l,
            RamLayout {
                low: 512 * MIB,
                high: 0,
                exact: false,
            }
        );
        assert_eq!(l.gfn(0x1234), Some(Gfn(0x1234)));
        assert_eq!(l.gfn(512 * MIB - 1), Some(Gfn(512 * MIB as u32 - 1)));
        assert_eq!(l.gfn(512 * MIB), None);
        assert_eq!(l.gfn(FOUR_GIB_PFN), None);
    }

    #[test]
    fn q35_3_gib_splits_at_2_gib() {
        // QEMU's q35: RAM ≥ 0xb0000000 bytes puts 2 GiB low and the rest at 4 GiB.
        let l = RamLayout::from_ranges(3 * GIB, &iomem(2 * GIB, GIB)).unwrap();
        assert_eq!(
            l,
            RamLayout {
                low: 2 * GIB,
                high: GIB,
                exact: false,
            }
        );
        assert_eq!(l.gfn(2 * GIB - 1), Some(Gfn(2 * GIB as u32 - 1)));
        assert_eq!(l.gfn(2 * GIB), None, "the PCI hole");
        assert_eq!(l.gfn(FOUR_GIB_PFN - 1), None);
        assert_eq!(l.gfn(FOUR_GIB_PFN), Some(Gfn(2 * GIB as u32)));
        assert_eq!(l.gfn(FOUR_GIB_PFN + GIB - 1), Some(Gfn(3 * GIB as u32 - 1)));
        assert_eq!(l.gfn(FOUR_GIB_PFN + GIB), None);
        for g in [0, 5, 2 * GIB as u32 - 1, 2 * GIB as u32, 3 * GIB as u32 - 1] {
            assert_eq!(l.gfn(l.pfn(Gfn(g)).unwrap()), Some(Gfn(g)));
        }
        assert_eq!(l.pfn(Gfn(3 * GIB as u32)), None);
    }

    #[test]
    fn q35_8_gib_maps_6_gib_above_4_gib() {
        let l = RamLayout::from_ranges(8 * GIB, &iomem(2 * GIB, 6 * GIB)).unwrap();
        assert_eq!(
            l,
            RamLayout {
                low: 2 * GIB,
                high: 6 * GIB,
                exact: false,
            }
        );
        assert_eq!(
            l.gfn(FOUR_GIB_PFN + 6 * GIB - 1),
            Some(Gfn(8 * GIB as u32 - 1))
        );
        let mut runs = Vec::new();
        let info = PageInfo {
            category: Category::Cache,
            active: true,
            referenced: false,
            buddy: false,
            never_share: false,
        };
        // A run over the hole is split, the hole dropped.
        l.runs(
            2 * GIB - 10,
            FOUR_GIB_PFN + 5 - (2 * GIB - 10),
            info,
            &mut runs,
        );
        assert_eq!(
            runs,
            vec![
                CategoryRun {
                    first: Gfn(2 * GIB as u32 - 10),
                    count: 10,
                    info
                },
                CategoryRun {
                    first: Gfn(2 * GIB as u32),
                    count: 5,
                    info
                },
            ]
        );
    }

    #[test]
    fn layouts_that_do_not_fit_the_ram_are_refused() {
        // More RAM above 4 GiB than the guest has.
        assert!(matches!(
            RamLayout::from_ranges(GIB, &iomem(2 * GIB, 2 * GIB)),
            Err(LayoutError::TooHigh { .. })
        ));
        // All low is a layout (pc's i440fx keeps up to 3.5 GiB low)...
        assert_eq!(
            RamLayout::from_ranges(3 * GIB, &iomem(3 * GIB, 0)),
            Ok(RamLayout {
                low: 3 * GIB,
                high: 0,
                exact: false,
            })
        );
        // ...but not low System RAM past what the high part leaves for the low one.
        assert!(matches!(
            RamLayout::from_ranges(3 * GIB, &iomem(2 * GIB + 512 * MIB, GIB)),
            Err(LayoutError::LowPast { .. })
        ));
        assert!(matches!(
            RamLayout::from_ranges(3 * GIB, &[(FOUR_GIB_PFN - 1, FOUR_GIB_PFN + 1)]),
            Err(LayoutError::BadRange { .. })
        ));
        assert!(matches!(
            RamLayout::from_ranges(8 * GIB, &vec![(1, 2); MAX_RAM_RANGES + 1]),
            Err(LayoutError::TooMany(_))
        ));
    }

    #[test]
    fn qemus_split_is_taken_whole_or_refused() {
        let page = PAGE_SIZE as u64;
        let l = RamLayout::from_qemu(3 * GIB, 2 * GIB * page, GIB * page).unwrap();
        assert_eq!(
            l,
            RamLayout {
                low: 2 * GIB,
                high: GIB,
                exact: true,
            }
        );
        for (pages, below, above) in [
            (3 * GIB, 2 * GIB * page, 2 * GIB * page), // more than the RAM
            (3 * GIB, 2 * GIB * page + 1, GIB * page - 1), // not whole pages
            (5 * GIB, 5 * GIB * page, 0),              // over 4 GiB below it
        ] {
            assert!(
                matches!(
                    RamLayout::from_qemu(pages, below, above),
                    Err(LayoutError::QemuSplit { .. })
                ),
                "{below:#x} + {above:#x}"
            );
        }
        // A guest booted with mem= lists less than QEMU's RAM: QEMU's split stands.
        assert_eq!(
            RamLayout::for_ranges(3 * GIB, &iomem(2 * GIB, GIB / 2), Some(l)),
            Ok(l)
        );
        // A range QEMU did not lay out (the PCI hole, past the high RAM) is refused.
        for bad in [
            vec![(2 * GIB - 1, 2 * GIB + 1)],
            vec![(FOUR_GIB_PFN, FOUR_GIB_PFN + GIB + 1)],
            vec![(5, 5)],
        ] {
            assert!(
                matches!(
                    RamLayout::for_ranges(3 * GIB, &bad, Some(l)),
                    Err(LayoutError::Outside { .. })
                ),
                "{bad:x?}"
            );
        }
        // Without QEMU's word, it is inferred and not exact.
        assert!(
            !RamLayout::for_ranges(3 * GIB, &iomem(2 * GIB, GIB), None)
                .unwrap()
                .exact
        );
    }

    /// A 1 GiB DIMM plugged into a 3 GiB guest (2 + 1 GiB) lies past its RAM at 4 GiB,
    /// at 5 GiB or above: with QEMU's layout its range is dropped and its runs are
    /// taken and dropped, not the report refused (seen failing: `Outside`). A range
    /// across the RAM's end, and anything past the RAM when inferred, stay refused.
    #[test]
    fn ram_past_qemus_layout_is_dropped_not_refused() {
        let page = PAGE_SIZE as u64;
        let l = RamLayout::from_qemu(3 * GIB, 2 * GIB * page, GIB * page).unwrap();
        let end = FOUR_GIB_PFN + GIB;
        assert_eq!(l.high_end(), end);
        for dimm in [(end, end + GIB), (end + GIB, end + 2 * GIB)] {
            let mut ranges = iomem(2 * GIB, GIB);
            ranges.push(dimm);
            assert_eq!(RamLayout::for_ranges(3 * GIB, &ranges, Some(l)), Ok(l));
            // Inferred, the DIMM's range would be this RAM's top: refused.
            assert!(RamLayout::for_ranges(3 * GIB, &ranges, None).is_err());
        }
        for bad in [(end - 1, end + 1), (end, end)] {
            assert!(matches!(
                RamLayout::for_ranges(3 * GIB, &[bad], Some(l)),
                Err(LayoutError::Outside { .. })
            ));
        }
        // Runs: inside, or from 4 GiB on past the RAM with QEMU's word only.
        assert!(l.takes_run(end - 10, end + 10) && l.takes_run(end, end + GIB));
        assert!(!l.takes_run(2 * GIB - 1, 2 * GIB + 1), "into the PCI hole");
        assert!(!l.takes_run(end, end));
        let inferred = RamLayout { exact: false, ..l };
        assert!(inferred.takes_run(end - 10, end));
        assert!(!inferred.takes_run(end - 10, end + 10) && !inferred.takes_run(end, end + 1));
        let mut runs = Vec::new();
        let info = PageInfo {
            category: Category::Cache,
            active: false,
            referenced: false,
            buddy: false,
            never_share: false,
        };
        l.runs(end - 10, 20, info, &mut runs);
        l.runs(end + 5, 100, info, &mut runs);
        assert_eq!(
            runs,
            vec![CategoryRun {
                first: Gfn(3 * GIB as u32 - 10),
                count: 10,
                info
            }]
        );
    }
}
