//! Each page the reader guest reads, from its read to its sharing: the reader's console
//! lines (`MEMFOLD-PROBE-R round chunk` before a chunk's read, `MEMFOLD-PROBE-G round
//! chunk gfn,..` after it; images/memfold-probe.rs `reader`) as the host sees them, and a
//! [`Shared`] detector polled over the pages in flight.

use std::collections::HashMap;

use anyhow::Result;
use serde::Serialize;

use super::watch::Shared;

/// A page read and not yet seen shared.
#[derive(Clone, Copy, Debug)]
struct InFlight {
    round: u64,
    gfn: u64,
    /// When the host saw the chunk's read begin, s since the side's start.
    read_s: f64,
}

/// One page's outcome.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct PageTime {
    /// The reader's round.
    pub round: u64,
    /// When the host saw its chunk's read begin, s since the side's start.
    pub read_s: f64,
    /// From the chunk's read (its `R` line seen) to the page seen shared, ms; `None`: not
    /// shared within the timeout.
    pub ms: Option<f64>,
}

/// The reader's pages, from read to shared.
#[derive(Default)]
pub struct Tracker {
    /// Chunks whose read began, by (round, chunk): when, s.
    begun: HashMap<(u64, u64), f64>,
    flight: Vec<InFlight>,
    /// Every page's outcome so far.
    pub done: Vec<PageTime>,
    /// Whether the reader said it is done.
    pub reader_done: bool,
    /// Partial line carried to the next feed.
    rest: String,
}

impl Tracker {
    /// Takes console text that arrived at `now_s` (s since the side's start).
    pub fn feed(&mut self, text: &str, now_s: f64) {
        self.rest.push_str(text);
        let Some(cut) = self.rest.rfind('\n') else {
            return;
        };
        let lines: String = self.rest.drain(..=cut).collect();
        for l in lines.lines() {
            if l.contains("MEMFOLD-PROBE-DONE") {
                self.reader_done = true;
            }
            let two = |rest: &str| -> Option<(u64, u64, String)> {
                let mut f = rest.split_whitespace();
                let r = f.next()?.parse().ok()?;
                let c = f.next()?.parse().ok()?;
                Some((r, c, f.next().unwrap_or("").to_string()))
            };
            if let Some((r, c, _)) = l.split("MEMFOLD-PROBE-R ").nth(1).and_then(two) {
                self.begun.insert((r, c), now_s);
            } else if let Some((r, c, list)) = l.split("MEMFOLD-PROBE-G ").nth(1).and_then(two) {
                let read_s = self.begun.get(&(r, c)).copied().unwrap_or(now_s);
                for g in list.split(',').filter_map(|g| g.parse().ok()) {
                    self.flight.push(InFlight {
                        round: r,
                        gfn: g,
                        read_s,
                    });
                }
            }
        }
    }

    /// Asks `w` about every page in flight at `now_s`: a shared page is done with its
    /// time, one in flight for more than `timeout_s` is done unshared.
    ///
    /// Errors: the detector's.
    pub fn poll(&mut self, w: &dyn Shared, now_s: f64, timeout_s: f64) -> Result<()> {
        let mut keep = Vec::with_capacity(self.flight.len());
        for p in std::mem::take(&mut self.flight) {
            if w.shared(p.gfn)? {
                self.done.push(PageTime {
                    round: p.round,
                    read_s: p.read_s,
                    ms: Some((now_s - p.read_s) * 1e3),
                });
            } else if now_s - p.read_s > timeout_s {
                self.done.push(PageTime {
                    round: p.round,
                    read_s: p.read_s,
                    ms: None,
                });
            } else {
                keep.push(p);
            }
        }
        self.flight = keep;
        Ok(())
    }

    /// Pages in flight.
    pub fn in_flight(&self) -> usize {
        self.flight.len()
    }
}

/// The latencies of one side.
#[derive(Clone, Debug, Default, Serialize, PartialEq)]
pub struct Summary {
    /// Pages read.
    pub pages: usize,
    /// Of those, not shared within the timeout.
    pub unshared: usize,
    /// Median read-to-shared, ms (over the pages shared).
    pub p50_ms: f64,
    /// 99th percentile, ms (nearest rank, over all pages read: an unshared page counts as
    /// longer than any; `None` when more than 1% were not shared).
    pub p99_ms: Option<f64>,
    /// Longest, ms (over the pages shared).
    pub max_ms: f64,
    /// Per round, from its first read to 95% of its pages shared, s (`None`: fewer
    /// than 95% shared within the timeout).
    pub t95_s: Vec<Option<f64>>,
}

/// Nearest-rank quantile of sorted `v` (`p` in 0..=1).
fn rank(v: &[f64], p: f64) -> f64 {
    v[((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1]
}

/// The summary of `pages` over `rounds` rounds.
pub fn summarize(pages: &[PageTime], rounds: u64) -> Summary {
    let mut ms: Vec<f64> = pages.iter().filter_map(|p| p.ms).collect();
    ms.sort_by(f64::total_cmp);
    let unshared = pages.len() - ms.len();
    let p99 = (!pages.is_empty() && unshared as f64 <= 0.01 * pages.len() as f64).then(|| {
        // Unshared pages rank above every shared one.
        let k = ((0.99 * pages.len() as f64).ceil() as usize).clamp(1, pages.len());
        ms[k.min(ms.len()) - 1]
    });
    let t95_s = (0..rounds)
        .map(|r| {
            let of: Vec<&PageTime> = pages.iter().filter(|p| p.round == r).collect();
            let first = of.iter().map(|p| p.read_s).min_by(f64::total_cmp)?;
            // When each page was shared (unshared: never), from the round's first read.
            let mut at: Vec<f64> = of
                .iter()
                .map(|p| p.ms.map_or(f64::INFINITY, |m| p.read_s + m / 1e3 - first))
                .collect();
            at.sort_by(f64::total_cmp);
            let t = rank(&at, 0.95);
            t.is_finite().then_some(t)
        })
        .collect();
    Summary {
        pages: pages.len(),
        unshared,
        p50_ms: if ms.is_empty() {
            f64::NAN
        } else {
            rank(&ms, 0.5)
        },
        p99_ms: p99,
        max_ms: ms.last().copied().unwrap_or(f64::NAN),
        t95_s,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::collections::HashSet;

    struct Fake(RefCell<HashSet<u64>>);
    impl Shared for Fake {
        fn shared(&self, gfn: u64) -> Result<bool> {
            Ok(self.0.borrow().contains(&gfn))
        }
    }

    #[test]
    fn pages_are_timed_from_their_chunks_read_to_their_sharing() {
        let mut t = Tracker::default();
        let w = Fake(RefCell::new(HashSet::new()));
        t.feed("MEMFOLD-PROBE-R 0 0\nMEMFOLD-PRO", 1.0);
        t.feed("BE-G 0 0 10,11\n", 1.002);
        assert_eq!(t.in_flight(), 2);
        w.0.borrow_mut().insert(10);
        t.poll(&w, 1.005, 5.0).unwrap();
        assert_eq!(t.in_flight(), 1);
        assert_eq!(t.done[0].round, 0);
        assert!((t.done[0].ms.unwrap() - 5.0).abs() < 1e-9);
        t.poll(&w, 6.5, 5.0).unwrap();
        assert_eq!((t.in_flight(), t.done[1].ms), (0, None));
        assert!(!t.reader_done);
        t.feed("junk MEMFOLD-PROBE-G x\nMEMFOLD-PROBE-DONE 1 rounds\n", 7.0);
        assert!(t.reader_done && t.in_flight() == 0);
    }

    #[test]
    fn the_summary_counts_unshared_pages_above_every_shared_one() {
        // Page i read at 10 + i ms, shared i ms later.
        let p = |round, i: usize| PageTime {
            round,
            read_s: 10.0 + i as f64 / 1e3,
            ms: Some(i as f64),
        };
        let mut pages: Vec<PageTime> = (1..=100).map(|i| p(0, i)).collect();
        let s = summarize(&pages, 1);
        assert_eq!((s.p50_ms, s.p99_ms, s.max_ms), (50.0, Some(99.0), 100.0));
        // The 95th page shared at 10.190 s, the round's first read at 10.001 s.
        assert!((s.t95_s[0].unwrap() - 0.189).abs() < 1e-9, "{:?}", s.t95_s);
        pages[0].ms = None;
        let s = summarize(&pages, 1);
        assert_eq!((s.unshared, s.p99_ms), (1, Some(100.0)));
        pages[1].ms = None;
        let s = summarize(&pages, 2);
        assert_eq!((s.p99_ms, s.t95_s.len(), s.t95_s[1]), (None, 2, None));
        for q in pages.iter_mut().skip(2).take(4) {
            q.ms = None;
        }
        assert_eq!(
            summarize(&pages, 1).t95_s,
            vec![None],
            "6 of 100 unshared: no 95%"
        );
    }
}
