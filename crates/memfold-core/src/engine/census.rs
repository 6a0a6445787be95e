//! The census of the guests' memory by content ([`crate::census`], Satori §6.1's
//! sharing potential), as the engine knows it.

use super::Engine;
use crate::census::Census;
use crate::ids::Gfn;
use crate::p2m::PageState;
use crate::PAGE_SIZE;

/// Pages read from guest RAM at a time.
const RUN: usize = 64;

impl Engine {
    /// Every page of every guest by content now: a private page (or one in flight to
    /// being shared or reclaimed, still in guest RAM) by its bytes, read from guest RAM
    /// (a hole reads as zeros); a shared page by its frame's content hash; a reclaimed
    /// page as zeros; a page shared without a mapping by its frame's hash, as a shared
    /// one; a stored page (patched, compressed, swapped) as unknown. A page that cannot be read counts as unknown. O(guest memory):
    /// for measurements, not for the engine's loop.
    pub fn census(&self) -> Census {
        let mut c = Census::new();
        let mut buf = vec![0u8; RUN * PAGE_SIZE];
        for v in self.vms.values() {
            let frames = &self.domain(v.domain).frames;
            let n = v.pages();
            let mut g = 0u32;
            while g < n {
                let k = (n - g).min(RUN as u32);
                // A run holding a page paged out to the kernel's swap is read page by
                // page around it: reading it would swap it back in (issue 15). It counts
                // as unknown, as a stored page.
                let away = |i: u32| v.paged_out_or_going(Gfn(g + i));
                let read = if (0..k).any(away) {
                    (0..k).filter(|&i| !away(i)).all(|i| {
                        let at = i as usize * PAGE_SIZE;
                        v.ram.read(Gfn(g + i), &mut buf[at..at + PAGE_SIZE]).is_ok()
                    })
                } else {
                    v.ram
                        .read(Gfn(g), &mut buf[..k as usize * PAGE_SIZE])
                        .is_ok()
                };
                for i in 0..k {
                    let gfn = Gfn(g + i);
                    match v.state(gfn) {
                        PageState::Private if away(i) => c.add_unknown(),
                        PageState::Shared(f) | PageState::Unmapped(f)
                            if frames.hash(f) != self.zero_hash =>
                        {
                            c.add_hash(frames.hash(f))
                        }
                        PageState::Shared(_) | PageState::Unmapped(_) | PageState::Zero => {
                            c.add_zero()
                        }
                        PageState::Private | PageState::Sharing(_) | PageState::Reclaiming
                            if read =>
                        {
                            let at = i as usize * PAGE_SIZE;
                            let page: &crate::Page =
                                buf[at..at + PAGE_SIZE].try_into().expect("one page");
                            c.add_page(page);
                        }
                        _ => c.add_unknown(),
                    }
                }
                g += k;
            }
        }
        c
    }
}

#[cfg(test)]
mod tests {
    use crate::sim::Rig;
    use crate::{EngineConfig, Policy, ZeroPolicy, PAGE_SIZE};
    use memfold_ids::Gfn;

    /// The census is the same before and after sharing and reclaiming: it counts
    /// contents, not frames (what sharing captured is another figure).
    #[test]
    fn the_census_counts_contents_whatever_memfold_made_of_them() {
        let cfg = EngineConfig {
            policy: Policy::sharing_only(),
            rate: 0,
            zero: ZeroPolicy::Reclaim,
            clock_interval_us: None,
            min_scan_interval_us: 10_000,
            max_scan_interval_us: 10_000,
            ..EngineConfig::default()
        };
        let mut r = Rig::new(cfg, 16).unwrap();
        for g in 0..16u32 {
            // Pages 0-5: one content; 6-8: another; 9-11: unique; 12-15 zero.
            let b = match g {
                0..=5 => 7u8,
                6..=8 => 9,
                9..=11 => 20 + g as u8,
                _ => 0,
            };
            r.agent.write(Gfn(g), 0, &[b; PAGE_SIZE]).unwrap();
        }
        let before = r.engine.census();
        assert_eq!((before.pages, before.zero_pages), (16, 4));
        assert_eq!(before.duplicate_pages(), 5 + 2);
        for _ in 0..20 {
            r.step(10_000).unwrap();
        }
        let b = r.engine.books();
        assert!(b.mapped_pages >= 9 && b.zero_reclaimed_pages > 0, "{b:?}");
        let after = r.engine.census();
        assert_eq!(
            (
                after.pages,
                after.zero_pages,
                after.unknown_pages,
                after.duplicate_pages()
            ),
            (16, 4, 0, 7)
        );
    }
}
