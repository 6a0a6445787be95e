//! The model's free pages (issue 17's free-page discard): the guest frees pages, its
//! agent (memfold-guest) samples which are free and its report reaches memfoldd late,
//! and a freed page is allocated again by the next write to it. The same reports carry
//! the pages the guest marks never to be shared (Satori §4.3), taken back when shared.

use memfold_core::categories::{Category, CategoryRun, PageInfo};
use memfold_core::ids::Gfn;
use memfold_core::p2m::PageState;
use memfold_core::sim::Home;
use memfold_core::PAGE_SIZE;
use rand::{rngs::SmallRng, Rng, SeedableRng};

use super::{Harness, ModelVm};

/// The guest writes `bytes` at `off` in page `g`. A free page is allocated first: its
/// bytes, old or (if a report allowed its discard) zeros, become the model's (any other
/// bytes are an error).
pub(super) fn guest_write(v: &mut ModelVm, g: Gfn, off: usize, bytes: &[u8]) -> Result<(), String> {
    if v.free[g.index()] {
        if let Ok(got) = v.agent.peek(g) {
            let zeros = v.may_zero[g.index()] && got == [0u8; PAGE_SIZE];
            if got != *v.model[g.index()] && !zeros {
                return Err(format!(
                    "{g}: a free page reads bytes the guest never wrote{}",
                    if got == [0u8; PAGE_SIZE] {
                        " (zeros: discarded, but no report allowed it)"
                    } else {
                        ""
                    }
                ));
            }
            *v.model[g.index()] = got;
        }
        v.free[g.index()] = false;
    }
    v.may_zero[g.index()] = false;
    v.agent.write(g, off, bytes)
}

impl Harness {
    /// The guest frees `n` pages from `gfn` on (reduced modulo its RAM).
    pub(super) fn free(&mut self, vm: u32, gfn: u32, n: u8) {
        if let Some(i) = self.pick(vm) {
            let v = &mut self.vms[i];
            let pages = v.agent.pages();
            for k in 0..n as u32 {
                let g = (gfn % pages + k) % pages;
                // Nor does a guest free a page under a device read (`fill_busy`).
                if !super::fill_busy(v, Gfn(g)) {
                    v.free[g as usize] = true;
                }
            }
        }
    }

    /// The guest's kernel starts or stops poisoning free pages: its reports from now on
    /// allow discards or not (memfoldd's `discards_allowed`).
    pub(super) fn poison(&mut self, vm: u32) {
        if let Some(i) = self.pick(vm) {
            let v = &mut self.vms[i];
            v.poison = !v.poison;
        }
    }

    /// The guest marks (`on`) or unmarks `n` pages from `gfn` on never to be shared
    /// (Satori §4.3): its next sample says so, and memfoldd takes back those shared.
    pub(super) fn mark(&mut self, vm: u32, gfn: u32, n: u8, on: bool) {
        if let Some(i) = self.pick(vm) {
            let v = &mut self.vms[i];
            let pages = v.agent.pages();
            for k in 0..n as u32 {
                v.never[((gfn % pages + k) % pages) as usize] = on;
            }
        }
    }

    /// memfold-guest samples the guest's pages now, the answer in flight: free pages in
    /// the buddy allocator (now and then not seen there: never discarded then), the others
    /// of any category and LRU bits, in runs of up to 8 pages alike (drawn from `seed`), a
    /// run now and then left out (unknown, its marks with it).
    pub(super) fn guest_sample(&mut self, vm: u32, seed: u64) {
        if let Some(i) = self.pick(vm) {
            let mut rng = SmallRng::seed_from_u64(seed);
            let v = &mut self.vms[i];
            let (mut runs, pages) = (Vec::new(), v.agent.pages() as usize);
            let mut g = 0;
            while g < pages {
                let (free, never) = (v.free[g], v.never[g]);
                let buddy = free && rng.gen_bool(0.9);
                let info = PageInfo {
                    // Free only in the buddy allocator or a per-CPU list (never discarded).
                    category: if buddy {
                        Category::Free
                    } else {
                        Category::ALL[rng.gen_range(0..Category::ALL.len())]
                    },
                    active: rng.gen_bool(0.3),
                    referenced: rng.gen_bool(0.5),
                    buddy,
                    never_share: never,
                };
                let alike = |k: usize| v.free[k] == free && v.never[k] == never;
                let most = (g + rng.gen_range(1..=8)).min(pages);
                let end = (g + 1..most).find(|&k| !alike(k)).unwrap_or(most);
                runs.push(CategoryRun {
                    first: Gfn(g as u32),
                    count: (end - g) as u32,
                    info,
                });
                g = end;
            }
            runs.retain(|_| rng.gen_bool(0.95));
            // Asked for now: after the round armed now, if any (as memfoldd's guest
            // channel notes when each round armed).
            let after = v.id.and_then(|id| self.engine.watch_armed(id));
            v.sample = Some((runs, after));
        }
    }

    /// The sampled report reaches memfoldd: its categories, then a watch round or a
    /// discard.
    pub(super) fn guest_report(&mut self, vm: u32) {
        if let Some(i) = self.pick(vm) {
            let v = &mut self.vms[i];
            if let (Some((runs, after)), Some(id)) = (v.sample.take(), v.id) {
                if self.engine.guest_categories(id, &runs).is_ok() {
                    // What each marked page may still be mapped onto: its frame now, or
                    // the one a share under way puts it on (taken back at a later report).
                    // A page no run covers is unknown: not marked.
                    v.marked.iter_mut().for_each(|m| *m = None);
                    for r in &runs {
                        for k in 0..r.count {
                            let g = Gfn(r.first.0 + k);
                            v.marked[g.index()] = r.info.never_share.then(|| {
                                let mut f = Vec::new();
                                if let Some(
                                    PageState::Shared(x)
                                    | PageState::Sharing(x)
                                    | PageState::Unmapped(x),
                                ) = self.engine.page_state(id, g)
                                {
                                    f.push(x);
                                }
                                match v.agent.home(g) {
                                    Home::Frame(x) => f.push(x),
                                    // A patch against it, until its take-back.
                                    Home::Stashed(st) => f.extend(st.reference),
                                    _ => {}
                                }
                                // A stash under way may end unmapped onto a frame the
                                // model cannot see (taken back at a later report).
                                if let Some(PageState::Stashing(_)) = self.engine.page_state(id, g)
                                {
                                    f.push(super::ANY_FRAME);
                                }
                                f
                            });
                        }
                    }
                    // A report that allows discards: each page free now may be
                    // discarded (this report's round, or one asked for before).
                    let discardable = !v.poison;
                    if discardable {
                        for (z, &f) in v.may_zero.iter_mut().zip(&v.free) {
                            *z |= f;
                        }
                    }
                    self.engine.discard_free(id, after, discardable);
                }
            }
        }
    }
}
