//! What enlightened guests say their pages are (PV §3.1, issue 17): each guest's report
//! replaces its [`CategoryMap`] and its books by category; the sharing scan reads it
//! (`scan.rs`).

use super::Engine;
use crate::categories::{CategoryCounts, CategoryError, CategoryMap, CategoryRun};
use crate::ids::VmId;

impl Engine {
    /// Guest `id`'s agent reported its pages as `runs` (gfns, sorted, not overlapping;
    /// pages no run covers are unknown): its category map is replaced and its pages booked
    /// by category, and the pages it marks never to be shared that are shared now are
    /// taken back ([`super::never_share`]). Returns the counts. A refused report leaves
    /// the map as it was.
    ///
    /// Errors: [`CategoryError::NoGuest`]; [`CategoryError::OutOfRange`] and
    /// [`CategoryError::Overlap`] for runs that do not fit its RAM (booked as
    /// `category_refused`).
    pub fn guest_categories(
        &mut self,
        id: VmId,
        runs: &[CategoryRun],
    ) -> Result<CategoryCounts, CategoryError> {
        let v = self.vms.get_mut(&id).ok_or(CategoryError::NoGuest)?;
        match CategoryMap::from_runs(v.pages(), runs) {
            Ok(m) => self.guest_category_map(id, m),
            Err(e) => {
                v.books.category_refused += 1;
                Err(e)
            }
        }
    }

    /// Guest `id`'s agent reported its pages as map `m` (built as its report came, see
    /// [`crate::categories::CategoryMapBuilder`]), as [`Engine::guest_categories`].
    ///
    /// Errors: [`CategoryError::NoGuest`]; [`CategoryError::OutOfRange`] for a map of
    /// another number of pages than the guest's (booked as `category_refused`).
    pub fn guest_category_map(
        &mut self,
        id: VmId,
        m: CategoryMap,
    ) -> Result<CategoryCounts, CategoryError> {
        let now = self.now_us();
        let v = self.vms.get_mut(&id).ok_or(CategoryError::NoGuest)?;
        if m.pages() != v.pages() {
            v.books.category_refused += 1;
            return Err(CategoryError::OutOfRange {
                first: 0,
                count: m.pages(),
                pages: v.pages(),
            });
        }
        let c = m.counts();
        v.categories = Some(m);
        v.categories_at_us = now;
        v.books.categories = Some(c);
        v.books.category_reports += 1;
        // Pages it now marks never-share that are shared come back (Satori §4.3).
        self.take_back_never_share(id);
        Ok(c)
    }

    /// Guest `id`'s name (its agent's, QEMU's `-name`).
    pub fn vm_name(&self, id: VmId) -> Option<&str> {
        self.vms.get(&id).map(|v| v.name.as_str())
    }

    /// Guest `id`'s category map, if its agent reported one.
    pub fn category_map(&self, id: VmId) -> Option<&CategoryMap> {
        self.vms.get(&id)?.categories.as_ref()
    }
}

#[cfg(test)]
mod tests {
    use crate::categories::{Category, CategoryError, CategoryRun, CategorySet, PageInfo};
    use crate::engine::de::GUEST_R_MAX_AGE_US;
    use crate::ids::Gfn;
    use crate::p2m::PageState;
    use crate::sim::Rig;
    use crate::{EngineConfig, Policy, PAGE_SIZE};

    const PAGES: u32 = 1024;

    fn cfg(guest_categories: bool, rate: u64) -> EngineConfig {
        EngineConfig {
            policy: Policy::sharing_only(),
            rate,
            clock_interval_us: None,
            min_scan_interval_us: 10_000,
            max_scan_interval_us: 10_000,
            quiet_scan_period: 1,
            guest_categories,
            guest_skip: CategorySet::SLAB_KERNEL,
            ..EngineConfig::default()
        }
    }

    /// Bytes unique to `seed`, never zero.
    fn unique(seed: u32) -> Vec<u8> {
        let mut p: Vec<u8> = (0..PAGE_SIZE)
            .map(|i| (i * 31 + (i >> 8)) as u8 | 1)
            .collect();
        p[..4].copy_from_slice(&seed.to_le_bytes());
        p
    }

    /// What the guest of these tests says its pages are: [0, 256) slab, [256, 512)
    /// kernel, [512, 768) anon, [768, 896) free, [896, 1024) page cache.
    fn layout() -> Vec<CategoryRun> {
        let run = |first: u32, count, category| CategoryRun {
            first: Gfn(first),
            count,
            info: PageInfo {
                category,
                active: false,
                referenced: false,
                buddy: false,
                never_share: false,
            },
        };
        vec![
            run(0, 256, Category::Slab),
            run(256, 256, Category::Kernel),
            run(512, 256, Category::Anon),
            run(768, 128, Category::Free),
            run(896, 128, Category::Cache),
        ]
    }

    /// A guest whose unique pages are everywhere but its page cache, which holds 64
    /// pairs of equal pages (a file read twice): 64 shares to find.
    fn rig(guest_categories: bool, rate: u64, report: bool) -> Rig {
        let mut r = Rig::new(cfg(guest_categories, rate), PAGES).unwrap();
        for g in 0..PAGES {
            let seed = if g >= 896 { 100_000 + (g - 896) / 2 } else { g };
            r.agent.write(Gfn(g), 0, &unique(seed)).unwrap();
        }
        if report {
            r.engine.guest_categories(r.vm, &layout()).unwrap();
        }
        r
    }

    fn books(r: &Rig) -> &crate::engine::VmBooks {
        &r.engine.vms[&r.vm].books
    }

    /// Full scans (one a step at rate 0) until the scan finds nothing more; returns the
    /// pages shared and the pages read.
    fn settle(r: &mut Rig) -> (u64, u64) {
        for _ in 0..6 {
            r.step(10_000).unwrap();
        }
        r.engine.check_invariants().unwrap();
        (books(r).shared_pages, books(r).scanned_pages)
    }

    /// PV §3.1: slab and kernel pages "should not be shared": with the guest's report
    /// the scan reads half the pages for the same 128 shared pages.
    #[test]
    fn slab_and_kernel_pages_are_not_read_for_the_same_shares() {
        let (on, off) = (
            settle(&mut rig(true, 0, true)),
            settle(&mut rig(false, 0, true)),
        );
        assert_eq!(on.0, 128, "every page-cache pair shared");
        assert_eq!(on.0, off.0, "the same shares");
        // The first full scan reads every resident page, the next five those still
        // private (the 128 shared ones are no longer in guest RAM).
        assert_eq!(off.1, PAGES as u64 + 5 * (PAGES as u64 - 128));
        assert_eq!(
            on.1,
            512 + 5 * (512 - 128),
            "slab and kernel pages never read"
        );
        let r = {
            let mut r = rig(true, 0, true);
            settle(&mut r);
            r
        };
        assert_eq!(books(&r).category_skipped, 6 * 512);
        assert_eq!(books(&r).skipped_pages, 0);
        // A guest that reported nothing is scanned as before, categories on or not.
        assert_eq!(settle(&mut rig(true, 0, false)), off);
    }

    /// The skipped categories are the configuration's: slab alone leaves kernel pages
    /// read (and a duplicate among them shared).
    #[test]
    fn the_skipped_categories_are_the_configurations() {
        let mut r = Rig::new(
            EngineConfig {
                guest_skip: CategorySet::SLAB,
                ..cfg(true, 0)
            },
            PAGES,
        )
        .unwrap();
        for g in 0..PAGES {
            let seed = if g >= 896 { 100_000 + (g - 896) / 2 } else { g };
            r.agent.write(Gfn(g), 0, &unique(seed)).unwrap();
        }
        // Kernel pages 300 and 301 equal, slab pages 10 and 11 too.
        r.agent.write(Gfn(301), 0, &unique(300)).unwrap();
        r.agent.write(Gfn(11), 0, &unique(10)).unwrap();
        r.engine.guest_categories(r.vm, &layout()).unwrap();
        r.step(10_000).unwrap();
        assert_eq!(books(&r).scanned_pages, PAGES as u64 - 256);
        assert_eq!(books(&r).category_skipped, 256);
        assert!(matches!(
            r.engine.page_state(r.vm, Gfn(301)),
            Some(PageState::Shared(_))
        ));
        assert_eq!(r.engine.page_state(r.vm, Gfn(11)), Some(PageState::Private));
    }

    /// Page cache first: at 1000 pages/s, the page cache's 64 pairs are all shared after
    /// the first 128 pages read; without the report, after the whole guest.
    #[test]
    fn page_cache_is_read_first() {
        let read_until_shared = |categories: bool| {
            let mut r = rig(categories, 1000, true);
            for _ in 0..200 {
                r.step(64_000).unwrap();
                if books(&r).shared_pages == 128 {
                    return books(&r).scanned_pages;
                }
            }
            panic!("not all shared");
        };
        let (on, off) = (read_until_shared(true), read_until_shared(false));
        assert!(on <= 128 + 64, "read {on} pages first");
        assert!(off >= PAGES as u64, "read {off} pages first");
        // And the rest is still read in the same full scan: a duplicate among the anon
        // pages is found.
        let mut r = rig(true, 0, true);
        r.agent.write(Gfn(600), 0, &unique(601)).unwrap();
        settle(&mut r);
        assert!(matches!(
            r.engine.page_state(r.vm, Gfn(600)),
            Some(PageState::Shared(_))
        ));
        assert!(matches!(
            r.engine.page_state(r.vm, Gfn(0)),
            Some(PageState::Private)
        ));
    }

    /// A report that does not fit the guest's RAM is refused and counted; the map stays.
    #[test]
    fn a_report_past_the_ram_is_refused_and_the_map_kept() {
        let mut r = rig(true, 0, true);
        let bad = [CategoryRun {
            first: Gfn(PAGES - 1),
            count: 2,
            info: PageInfo::UNKNOWN,
        }];
        assert!(matches!(
            r.engine.guest_categories(r.vm, &bad),
            Err(CategoryError::OutOfRange { .. })
        ));
        let b = books(&r);
        assert_eq!((b.category_reports, b.category_refused), (1, 1));
        let c = b.categories.expect("the first report's");
        assert_eq!(c.of(Category::Slab), 256);
        assert_eq!(c.of(Category::Cache), 128);
        assert_eq!(
            r.engine.category_map(r.vm).unwrap().category(Gfn(300)),
            Category::Kernel
        );
        // A report of part of the RAM: the rest is unknown, and counted so.
        let part = [CategoryRun {
            first: Gfn(8),
            count: 2,
            info: PageInfo {
                category: Category::Anon,
                active: false,
                referenced: true,
                buddy: false,
                never_share: false,
            },
        }];
        let c = r.engine.guest_categories(r.vm, &part).unwrap();
        assert_eq!(
            (c.of(Category::Unknown), c.of(Category::Anon)),
            (PAGES as u64 - 2, 2)
        );
        assert_eq!(c.referenced, 2);
        r.engine.check_invariants().unwrap();
    }

    /// The clock from the guest's LRU (issue 17, [`EngineConfig::clock_from_guest`]):
    /// its page-cache and anonymous pages are armed for writes only, so their reads take
    /// no fault, and their R is the guest's referenced or active bit; kernel pages keep
    /// the host's R. A guest that reads every page each step: its pages the guest calls
    /// referenced or active stay warm, those it calls neither go cold although read,
    /// and kernel pages stay warm by their faults. Off, every read page stays warm; so
    /// too when the guest's last report is older than [`GUEST_R_MAX_AGE_US`] (its agent
    /// went quiet): R is the host's again.
    #[test]
    fn the_clock_takes_r_of_lru_pages_from_the_guest() {
        let run = |first: u32, count, category, active, referenced| CategoryRun {
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
        let classes = |from_guest: bool, stale: bool| {
            let mut r = Rig::new(
                EngineConfig {
                    clock_interval_us: Some(20_000),
                    clock_from_guest: from_guest,
                    clock_rearm_max: 1,
                    ..cfg(true, 0)
                },
                128,
            )
            .unwrap();
            for g in 0..128 {
                r.agent.write(Gfn(g), 0, &unique(g)).unwrap();
            }
            let report = [
                run(0, 16, Category::Anon, false, true),
                run(16, 16, Category::Cache, true, false),
                run(32, 32, Category::Anon, false, false),
                run(64, 32, Category::Kernel, false, false),
                // Mapped by no process and not in the buddy allocator: the kernel's own
                // (module text, network buffers), which no LRU bit follows.
                run(96, 32, Category::Free, false, false),
            ];
            r.engine.guest_categories(r.vm, &report).unwrap();
            if stale {
                r.step(GUEST_R_MAX_AGE_US + 1).unwrap();
            }
            let mut wp_only_seen = false;
            for _ in 0..40 {
                for g in 0..128 {
                    r.agent.read(Gfn(g)).unwrap();
                }
                r.engine.clock_step();
                for c in &r.engine.vms[&r.vm].queue {
                    if let crate::engine::Command::ClockScan { wp_only, .. } = c {
                        // Only the LRU pages (0..64, the first word) for writes only.
                        wp_only_seen |= wp_only.first().is_some_and(|&w| w != 0);
                        if let Some(&w1) = wp_only.get(1) {
                            assert_eq!(w1, 0, "kernel pages, and free ones not in the buddy allocator, are zapped");
                        }
                    }
                }
                r.step(5_000).unwrap();
            }
            r.engine.check_invariants().unwrap();
            assert_eq!(wp_only_seen, from_guest && !stale);
            let v = &r.engine.vms[&r.vm];
            let idle = |g: u32| v.clock.page(g).idle_scans() > 0;
            (
                (0..32).filter(|&g| idle(g)).count(),
                (32..64).filter(|&g| idle(g)).count(),
                (64..128).filter(|&g| idle(g)).count(),
            )
        };
        assert_eq!(
            classes(true, false),
            (0, 32, 0),
            "R from the guest for LRU pages"
        );
        assert_eq!(
            classes(false, false),
            (0, 0, 0),
            "R from faults: every page read is warm"
        );
        assert_eq!(
            classes(true, true),
            (0, 0, 0),
            "a stale report's bits are not R: every page read is warm"
        );
    }
}
