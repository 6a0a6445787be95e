//! Which pages of a clock slice the Difference Engine reads: its candidates that hold
//! data, found with few asks of where guest RAM's data lies.

use crate::ids::Gfn;

/// The pages of `[first, end)` that are `candidate`s and hold data, in order, asking
/// `next_data_run` (guest RAM's `SEEK_DATA`/`SEEK_HOLE`: the run of data at or after a
/// page, clamped to an end) only from a candidate past the run last returned: a data run
/// holding no candidate is never asked for, unless it is the first at or after one. Asked
/// run by run over the whole slice, a guest whose shared and stored pages are holes
/// between its data cost an ask for each of its runs, most holding no candidate (perf of
/// the mixed set with frames paged out: ~0.8 CPU s of memfoldd's 4–5 per 90 s in
/// `next_data_run`). Asks: at most one a data run holding or following a candidate, plus
/// one.
pub(crate) fn candidates_with_data(
    first: Gfn,
    end: Gfn,
    candidate: impl Fn(Gfn) -> bool,
    mut next_data_run: impl FnMut(Gfn, Gfn) -> Option<(Gfn, Gfn)>,
) -> Vec<Gfn> {
    let mut todo = Vec::new();
    let mut data: Option<(Gfn, Gfn)> = None;
    let mut g = first;
    while g < end {
        if !candidate(g) {
            g = Gfn(g.0 + 1);
            continue;
        }
        if data.is_none_or(|(_, b)| g >= b) {
            data = next_data_run(g, end);
        }
        match data {
            // No data from `g` on: the rest of the slice is holes.
            None => break,
            // A hole up to `a`: its candidates hold nothing to read.
            Some((a, _)) if g < a => g = a,
            Some((_, b)) => {
                // `next_data_run`'s contract: `from <= a < b <= end`.
                debug_assert!(g < b, "an empty or backward data run ending at {b:?}");
                todo.push(g);
                g = Gfn(g.0 + 1);
            }
        }
    }
    todo
}
#[cfg(test)]
mod tests {
    use super::*;
    use rand::{rngs::SmallRng, Rng, SeedableRng};

    /// Data runs of a sieve `data` (page g holds data iff `data[g]`), asked as memfoldd
    /// asks its memfd, each ask counted.
    fn runs<'a>(
        data: &'a [bool],
        asks: &'a std::cell::Cell<u32>,
    ) -> impl FnMut(Gfn, Gfn) -> Option<(Gfn, Gfn)> + 'a {
        move |from, end| {
            asks.set(asks.get() + 1);
            let a = (from.0..end.0).find(|&g| data[g as usize])?;
            let b = (a..end.0).find(|&g| !data[g as usize]).unwrap_or(end.0);
            Some((Gfn(a), Gfn(b)))
        }
    }

    /// The same pages as a walk of every data run (the definition), for random sieves
    /// and candidates of every density.
    #[test]
    fn the_candidates_holding_data_whatever_the_sieve() {
        let mut rng = SmallRng::seed_from_u64(7);
        for round in 0..300 {
            let n = rng.gen_range(0..600);
            let (pd, pc) = (rng.gen_range(0.0..1.0), rng.gen_range(0.0..1.0));
            let data: Vec<bool> = (0..n).map(|_| rng.gen_bool(pd)).collect();
            let cand: Vec<bool> = (0..n).map(|_| rng.gen_bool(pc)).collect();
            let first = rng.gen_range(0..=n);
            let end = rng.gen_range(first..=n);
            let asks = std::cell::Cell::new(0);
            let got = candidates_with_data(
                Gfn(first),
                Gfn(end),
                |g| cand[g.0 as usize],
                runs(&data, &asks),
            );
            let want: Vec<Gfn> = (first..end)
                .filter(|&g| data[g as usize] && cand[g as usize])
                .map(Gfn)
                .collect();
            assert_eq!(got, want, "round {round}");
        }
    }

    /// A slice of 4 096 pages, every other one data (2 048 runs), with candidates in two
    /// places only: a handful of asks, not one a run.
    #[test]
    fn data_runs_without_candidates_are_not_asked_for() {
        let data: Vec<bool> = (0..4096).map(|g| g % 2 == 0).collect();
        let cand: Vec<bool> = (0..4096)
            .map(|g| (100..110).contains(&g) || (3000..3003).contains(&g))
            .collect();
        let asks = std::cell::Cell::new(0);
        let got = candidates_with_data(
            Gfn(0),
            Gfn(4096),
            |g| cand[g.0 as usize],
            runs(&data, &asks),
        );
        let want: Vec<Gfn> = [100, 102, 104, 106, 108, 3000, 3002].map(Gfn).to_vec();
        assert_eq!(got, want);
        assert!(asks.get() <= 10, "{} asks", asks.get());
        // No candidate at all: no ask.
        asks.set(0);
        assert!(candidates_with_data(Gfn(0), Gfn(4096), |_| false, runs(&data, &asks)).is_empty());
        assert_eq!(asks.get(), 0);
    }
}
