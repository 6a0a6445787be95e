//! What an enlightened guest says its pages are (PV §3.1, "meta-data dependent sharing";
//! issue 17): page categories from the guest kernel's own book-keeping
//! (`/proc/kpageflags`, read by `memfold-guest` inside the guest), and the map from the
//! guest's physical frame numbers to memfold's gfns.
//!
//! The engine keeps, per guest that reported, a [`CategoryMap`] of 4 bits a page (a
//! [`Category`] in 3 bits and the active bit; the referenced bit is counted, not kept) and
//! books its pages by category ([`CategoryCounts`]). The sharing scan uses it when
//! [`crate::EngineConfig::guest_categories`] is on: pages of the categories of
//! [`crate::EngineConfig::guest_skip`] are not read (slab by default; PV §3.1 skips slab
//! and kernel: "Kernel only pages … should not be shared"), and page-cache pages are read first
//! ("Cache only pages … it is therefore monumental to share this kind of pages").
//! A guest that says nothing has no map and is scanned as before.
//!
//! Nothing here is trusted: a guest's report can only change how its own pages are
//! scanned (a lie costs it sharing, never a byte — every share is still confirmed byte
//! for byte and checked by the agent under write-protection).

use serde::{Deserialize, Serialize};

use crate::ids::Gfn;

/// What a guest page is used for, as the guest's kernel sees it (PV §3.1's groups, as
/// Linux's page flags give them).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[repr(u8)]
pub enum Category {
    /// Not reported (no report yet, a hole in the guest's frame numbers, or a frame the
    /// guest did not classify).
    Unknown = 0,
    /// Free: in the buddy allocator or a per-CPU free list (kpagecount 0).
    Free = 1,
    /// Page cache: on an LRU list and not anonymous (files, tmpfs/shmem, block devices).
    Cache = 2,
    /// Anonymous memory of processes.
    Anon = 3,
    /// The kernel's slab caches.
    Slab = 4,
    /// Kernel-only or reserved pages, page tables, and any other page in use that is
    /// neither on an LRU list nor slab.
    Kernel = 5,
}

impl Category {
    /// Every category, in code order.
    pub const ALL: [Category; 6] = [
        Category::Unknown,
        Category::Free,
        Category::Cache,
        Category::Anon,
        Category::Slab,
        Category::Kernel,
    ];

    /// The category of code `c` (0..=5), `None` otherwise.
    pub fn from_code(c: u8) -> Option<Category> {
        Category::ALL.get(c as usize).copied()
    }

    /// Its name, as the live view and JSON print it.
    pub fn name(self) -> &'static str {
        match self {
            Category::Unknown => "unknown",
            Category::Free => "free",
            Category::Cache => "cache",
            Category::Anon => "anon",
            Category::Slab => "slab",
            Category::Kernel => "kernel",
        }
    }

    /// The category named `name` (as [`Category::name`] gives it).
    pub fn from_name(name: &str) -> Option<Category> {
        Category::ALL.into_iter().find(|c| c.name() == name)
    }

    /// Its bit in a [`CategorySet`].
    pub fn bit(self) -> u8 {
        1 << self as u8
    }
}

/// A set of categories, a bit each ([`Category::bit`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct CategorySet(pub u8);

impl CategorySet {
    /// Slab pages alone: memfold's default skip.
    pub const SLAB: CategorySet = CategorySet(1 << Category::Slab as u8);

    /// PV §3.1's kernel-only pages, which it does not share: slab and kernel/reserved.
    pub const SLAB_KERNEL: CategorySet =
        CategorySet(1 << Category::Slab as u8 | 1 << Category::Kernel as u8);

    /// Whether `c` is in the set.
    pub fn contains(self, c: Category) -> bool {
        self.0 & c.bit() != 0
    }

    /// The set of comma-separated category names `s` (`none`: empty).
    ///
    /// Errors: the name that is no category.
    pub fn parse(s: &str) -> Result<CategorySet, String> {
        if s == "none" {
            return Ok(CategorySet(0));
        }
        s.split(',')
            .map(|n| {
                Category::from_name(n.trim()).ok_or_else(|| {
                    format!(
                        "{n:?} is no page category ({})",
                        Category::ALL.map(Category::name).join(", ")
                    )
                })
            })
            .try_fold(CategorySet(0), |set, c| Ok(CategorySet(set.0 | c?.bit())))
    }

    /// Its names, comma-separated (`none`: empty).
    pub fn names(self) -> String {
        let v: Vec<&str> = Category::ALL
            .into_iter()
            .filter(|&c| self.contains(c))
            .map(Category::name)
            .collect();
        if v.is_empty() {
            "none".into()
        } else {
            v.join(",")
        }
    }
}

/// One page's report: its category and the kernel's LRU bits.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageInfo {
    /// What it is.
    pub category: Category,
    /// On the active LRU list (`KPF_ACTIVE`).
    pub active: bool,
    /// Referenced since the kernel last looked (`KPF_REFERENCED`).
    pub referenced: bool,
    /// A frame of a free block of the buddy allocator (`KPF_BUDDY`, which the kernel sets
    /// on every frame of one since Linux 4.19: `is_free_buddy_page`): surely free when the
    /// guest looked. A map count of 0 alone is not (0 for every page only the kernel
    /// uses), so only these are ever discarded as free (issue 17).
    pub buddy: bool,
    /// The guest asked that this page never be shared (Satori §4.3: a page of a process
    /// or file marked with `memfold-guest never-share`): memfoldd never shares it,
    /// patches it, or uses it as a reference page, and takes back one already shared
    /// ([`crate::Engine::guest_categories`]).
    pub never_share: bool,
}

impl PageInfo {
    /// An unreported page.
    pub const UNKNOWN: PageInfo = PageInfo {
        category: Category::Unknown,
        active: false,
        referenced: false,
        buddy: false,
        never_share: false,
    };

    /// The wire code of the guest protocol: category in bits 0–2, active bit 3,
    /// referenced bit 4, buddy bit 5, never-share bit 6.
    pub fn code(self) -> u8 {
        self.category as u8
            | (self.active as u8) << 3
            | (self.referenced as u8) << 4
            | (self.buddy as u8) << 5
            | (self.never_share as u8) << 6
    }

    /// The page info of wire code `c`; `None` for an unknown category, bit 7, or the
    /// buddy bit on a page not free.
    pub fn from_code(c: u8) -> Option<PageInfo> {
        if c >> 7 != 0 {
            return None;
        }
        let category = Category::from_code(c & 7)?;
        let buddy = c & 32 != 0;
        if buddy && category != Category::Free {
            return None;
        }
        Some(PageInfo {
            category,
            active: c & 8 != 0,
            referenced: c & 16 != 0,
            buddy,
            never_share: c & 64 != 0,
        })
    }
}

/// Pages by category (4 KiB pages), and of the reported ones how many are active and
/// referenced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CategoryCounts {
    /// Pages of each category, indexed by [`Category`] code.
    pub pages: [u64; 6],
    /// Pages on the guest's active LRU list.
    pub active: u64,
    /// Pages the guest's kernel found referenced.
    pub referenced: u64,
    /// Pages the guest marked never to be shared ([`PageInfo::never_share`]).
    #[serde(default)]
    pub never_share: u64,
}

impl CategoryCounts {
    /// Pages of category `c`.
    pub fn of(&self, c: Category) -> u64 {
        self.pages[c as usize]
    }

    fn add(&mut self, info: PageInfo, n: u64) {
        self.pages[info.category as usize] += n;
        if info.active {
            self.active += n;
        }
        if info.referenced {
            self.referenced += n;
        }
        if info.never_share {
            self.never_share += n;
        }
    }
}

/// A run of guest pages with the same report, in memfold's gfns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CategoryRun {
    /// First page.
    pub first: Gfn,
    /// Pages (≥ 1).
    pub count: u32,
    /// Their report.
    pub info: PageInfo,
}

/// Why a category report was refused (nothing of it is applied).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CategoryError {
    /// A run past the guest's RAM or of no pages.
    #[error("run of {count} pages at gfn {first}: guest RAM is {pages} pages")]
    OutOfRange {
        /// First page of the run.
        first: u32,
        /// Its pages.
        count: u32,
        /// The guest's RAM, pages.
        pages: u32,
    },
    /// Runs that overlap or are out of order.
    #[error("run at gfn {first} overlaps or precedes the one before (ending at gfn {prev_end})")]
    Overlap {
        /// First page of the run.
        first: u32,
        /// End of the previous run.
        prev_end: u32,
    },
    /// No such guest.
    #[error("no guest of that id")]
    NoGuest,
}

/// A [`CategoryMap`] built as a report's runs come, so a report holds its map (under a
/// byte a page) and never a list of its runs (16 bytes a run, a run as small as a page).
#[derive(Clone, Debug)]
pub struct CategoryMapBuilder {
    map: CategoryMap,
    prev_end: u32,
}

impl CategoryMapBuilder {
    /// The map of a guest of `pages` pages, no run yet.
    pub fn new(pages: u32) -> CategoryMapBuilder {
        CategoryMapBuilder {
            map: CategoryMap {
                nibbles: vec![0; (pages as usize).div_ceil(2)],
                buddy: vec![0; (pages as usize).div_ceil(64)],
                never_share: vec![0; (pages as usize).div_ceil(64)],
                referenced: vec![0; (pages as usize).div_ceil(64)],
                pages,
                counts: CategoryCounts::default(),
            },
            prev_end: 0,
        }
    }

    /// Adds run `r` (after the runs already added, inside the guest's RAM).
    ///
    /// Errors: [`CategoryError::OutOfRange`], [`CategoryError::Overlap`]; the map is
    /// then as it was.
    pub fn push(&mut self, r: CategoryRun) -> Result<(), CategoryError> {
        let m = &mut self.map;
        let pages = m.pages;
        let end = r.first.0.checked_add(r.count).filter(|&e| e <= pages);
        let Some(end) = end.filter(|_| r.count > 0) else {
            return Err(CategoryError::OutOfRange {
                first: r.first.0,
                count: r.count,
                pages,
            });
        };
        if r.first.0 < self.prev_end {
            return Err(CategoryError::Overlap {
                first: r.first.0,
                prev_end: self.prev_end,
            });
        }
        self.prev_end = end;
        let nib = r.info.category as u8 | (r.info.active as u8) << 3;
        for g in r.first.0..end {
            m.set_nibble(g, nib);
            if r.info.buddy {
                m.buddy[g as usize / 64] |= 1 << (g % 64);
            }
            if r.info.never_share {
                m.never_share[g as usize / 64] |= 1 << (g % 64);
            }
            if r.info.referenced {
                m.referenced[g as usize / 64] |= 1 << (g % 64);
            }
        }
        m.counts.add(r.info, r.count as u64);
        Ok(())
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.map.bytes()
    }

    /// The map: pages no run covered are [`Category::Unknown`].
    pub fn finish(mut self) -> CategoryMap {
        let m = &mut self.map;
        let reported: u64 = m.counts.pages.iter().sum();
        m.counts.pages[Category::Unknown as usize] += m.pages as u64 - reported;
        self.map
    }
}

/// One guest's pages by category: 4 bits a page (category and active bit), two pages a
/// byte, the buddy, never-share and referenced bits a page, and its counts. Metadata:
/// `pages / 2 + 3 * pages / 8` bytes.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CategoryMap {
    nibbles: Vec<u8>,
    /// [`PageInfo::buddy`], a bit a page.
    buddy: Vec<u64>,
    /// [`PageInfo::never_share`], a bit a page.
    never_share: Vec<u64>,
    /// [`PageInfo::referenced`], a bit a page (the clock's R from the guest).
    referenced: Vec<u64>,
    pages: u32,
    counts: CategoryCounts,
}

impl CategoryMap {
    /// The map of a guest of `pages` pages from its runs (sorted by gfn, not overlapping,
    /// inside its RAM); pages no run covers are [`Category::Unknown`].
    ///
    /// Errors: [`CategoryError::OutOfRange`], [`CategoryError::Overlap`].
    pub fn from_runs(pages: u32, runs: &[CategoryRun]) -> Result<CategoryMap, CategoryError> {
        let mut b = CategoryMapBuilder::new(pages);
        for &r in runs {
            b.push(r)?;
        }
        Ok(b.finish())
    }

    fn set_nibble(&mut self, g: u32, nib: u8) {
        let b = &mut self.nibbles[g as usize / 2];
        *b = if g % 2 == 0 {
            (*b & 0xf0) | nib
        } else {
            (*b & 0x0f) | nib << 4
        };
    }

    fn nibble(&self, g: u32) -> u8 {
        let b = self.nibbles.get(g as usize / 2).copied().unwrap_or(0);
        if g % 2 == 0 {
            b & 0x0f
        } else {
            b >> 4
        }
    }

    /// Page `g`'s category ([`Category::Unknown`] past the end).
    pub fn category(&self, g: Gfn) -> Category {
        if g.0 >= self.pages {
            return Category::Unknown;
        }
        Category::from_code(self.nibble(g.0) & 7).unwrap_or(Category::Unknown)
    }

    /// Whether page `g` was a frame of a free buddy block when the guest looked
    /// ([`PageInfo::buddy`]).
    pub fn buddy(&self, g: Gfn) -> bool {
        g.0 < self.pages && crate::clock::mask_bit(&self.buddy, g.0)
    }

    /// Whether the guest marked page `g` never to be shared ([`PageInfo::never_share`]).
    pub fn never_share(&self, g: Gfn) -> bool {
        g.0 < self.pages && crate::clock::mask_bit(&self.never_share, g.0)
    }

    /// The pages the guest marked never to be shared, in gfn order.
    pub fn never_share_pages(&self) -> impl Iterator<Item = Gfn> + '_ {
        let words = self.never_share.iter().enumerate().filter(|(_, &b)| b != 0);
        words.flat_map(|(w, &bits)| {
            (0..64)
                .filter(move |b| bits >> b & 1 == 1)
                .map(move |b| Gfn((w * 64 + b) as u32))
        })
    }

    /// Whether the guest's kernel found page `g` referenced when it looked
    /// ([`PageInfo::referenced`]).
    pub fn referenced(&self, g: Gfn) -> bool {
        g.0 < self.pages && crate::clock::mask_bit(&self.referenced, g.0)
    }

    /// Whether page `g` is on the guest's active list.
    pub fn active(&self, g: Gfn) -> bool {
        g.0 < self.pages && self.nibble(g.0) & 8 != 0
    }

    /// Its pages by category.
    pub fn counts(&self) -> CategoryCounts {
        self.counts
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.nibbles.capacity()
            + (self.buddy.capacity() + self.never_share.capacity() + self.referenced.capacity()) * 8
    }

    /// The guest's pages it covers.
    pub fn pages(&self) -> u32 {
        self.pages
    }
}

mod layout;
pub use layout::{LayoutError, RamLayout, FOUR_GIB_PFN, MAX_RAM_RANGES};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn category_sets_parse_and_print_by_name() {
        assert_eq!(
            CategorySet::parse("slab,kernel"),
            Ok(CategorySet::SLAB_KERNEL)
        );
        assert_eq!(CategorySet::SLAB_KERNEL.names(), "slab,kernel");
        assert_eq!(CategorySet::parse("none").unwrap().names(), "none");
        let s = CategorySet::parse("cache").unwrap();
        assert!(s.contains(Category::Cache) && !s.contains(Category::Slab));
        assert!(CategorySet::parse("slab,heap").is_err());
    }

    #[test]
    fn codes_round_trip_and_bad_codes_are_refused() {
        for c in 0..=255u8 {
            match PageInfo::from_code(c) {
                Some(i) => assert_eq!(i.code(), c),
                None => assert!(
                    c >> 7 != 0 || c & 7 > 5 || (c & 32 != 0 && c & 7 != 1),
                    "code {c}"
                ),
            }
        }
        assert_eq!(PageInfo::from_code(6), None);
        // The buddy bit: on a free page only.
        assert!(
            PageInfo::from_code(32 | Category::Free as u8)
                .unwrap()
                .buddy
        );
        assert_eq!(PageInfo::from_code(32 | Category::Anon as u8), None);
        // The never-share bit: on any page.
        let marked = PageInfo::from_code(64 | Category::Anon as u8).unwrap();
        assert!(marked.never_share && marked.category == Category::Anon);
        assert_eq!(PageInfo::from_code(128), None);
    }

    #[test]
    fn a_map_keeps_categories_in_4_bits_and_counts_them() {
        let run = |first, count, category, active, referenced| CategoryRun {
            first: Gfn(first),
            count,
            info: PageInfo {
                category,
                active,
                referenced,
                buddy: false,
                never_share: false,
            },
        };
        let m = CategoryMap::from_runs(
            11,
            &[
                run(0, 3, Category::Slab, false, false),
                run(3, 1, Category::Cache, true, true),
                run(5, 6, Category::Anon, true, false),
            ],
        )
        .unwrap();
        assert_eq!(
            m.bytes(),
            6 + 3 * 8,
            "4 bits a page, and 3 bitsets of one word"
        );
        let cats: Vec<_> = (0..12).map(|g| m.category(Gfn(g))).collect();
        use Category::*;
        assert_eq!(
            cats,
            [Slab, Slab, Slab, Cache, Unknown, Anon, Anon, Anon, Anon, Anon, Anon, Unknown]
        );
        assert!(m.active(Gfn(3)) && !m.active(Gfn(2)) && m.active(Gfn(10)));
        let c = m.counts();
        assert_eq!(c.pages, [1, 0, 1, 6, 3, 0]);
        assert_eq!((c.active, c.referenced), (7, 1));
        // Refused: past the end, empty, overlapping.
        for bad in [
            vec![run(10, 2, Anon, false, false)],
            vec![run(3, 0, Anon, false, false)],
            vec![run(0, 4, Anon, false, false), run(3, 1, Anon, false, false)],
            vec![run(u32::MAX, 2, Anon, false, false)],
        ] {
            assert!(CategoryMap::from_runs(11, &bad).is_err(), "{bad:?}");
        }
    }
}
