//! The guests' I/O rounds as their consoles report them (`MEMFOLD-IO round kind bytes ns`,
//! images/memfold-probe.rs `diskio`), which of them ran while both sides ran, and their
//! throughput as total bytes / total time ± 2 standard errors (a ratio estimator: a pass
//! reads fixed bytes, and the mean of per-pass rates would weigh fast passes more) and a
//! ratio.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use serde::Serialize;

/// Whether each side's guest is still reading: the time since its last new pass while
/// it ran. A guest whose disk never answers (a device the agent refused, a device that
/// died for good) reports no pass, and the bench says so after its limit
/// ([`Progress::limit_for`]) instead of waiting out its whole deadline (600 s + 240 s a
/// round).
#[derive(Debug)]
pub struct Progress {
    /// Per side: passes seen, and when that count last changed or the side was last
    /// seen paused (time paused for another side's turn does not count).
    seen: [(usize, Instant); 2],
    limit: Duration,
}

impl Progress {
    /// A watch started at `now` that allows `limit` without a new pass.
    pub fn new(now: Instant, limit: Duration) -> Progress {
        Progress {
            seen: [(0, now); 2],
            limit,
        }
    }

    /// The longest a pass of `seq_mib` MiB read sequentially (4 KiB and 1 MiB at a
    /// time) and `rand_reads` random 4 KiB reads may take on a disk that works: 120 s,
    /// plus 2 s a MiB and 10 ms a random read (0.5 MiB/s and 100 reads/s, far below
    /// what any disk served here does, TCG included).
    pub fn limit_for(seq_mib: u64, rand_reads: u64) -> Duration {
        Duration::from_secs(120 + 2 * seq_mib) + Duration::from_millis(10 * rand_reads)
    }

    /// Side `side` had `passes` passes at `now`, running (else paused). Returns how long
    /// it has run without a new pass, if past the limit.
    pub fn look(
        &mut self,
        side: usize,
        passes: usize,
        running: bool,
        now: Instant,
    ) -> Option<Duration> {
        let (seen, since) = &mut self.seen[side];
        if passes != *seen || !running {
            (*seen, *since) = (passes, now);
            return None;
        }
        let idle = now.saturating_duration_since(*since);
        (idle > self.limit).then_some(idle)
    }
}

/// The kinds of pass, in the order a round runs them.
pub const KINDS: [&str; 3] = ["seq-4k", "rand-4k", "seq-1m"];

/// One pass of one round: bytes read and how long it took, ns (the guest's clock).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Pass {
    /// The round (from 0 at the guest's start).
    pub round: u64,
    /// Index into [`KINDS`].
    pub kind: usize,
    /// Bytes read.
    pub bytes: u64,
    /// Duration, ns.
    pub ns: u64,
}

impl Pass {
    /// (MiB read, seconds taken; at least 1 ns).
    pub fn mib_secs(&self) -> (f64, f64) {
        (
            self.bytes as f64 / (1u64 << 20) as f64,
            self.ns.max(1) as f64 / 1e9,
        )
    }
}

/// The passes in a console's text, in order (lines that do not parse are skipped, and so
/// is a last line not yet ended: QEMU may be writing it, its time cut short).
pub fn passes(serial: &str) -> Vec<Pass> {
    let ended = serial.rfind('\n').map_or("", |end| &serial[..end]);
    ended
        .lines()
        .filter_map(|l| {
            let mut f = l.split("MEMFOLD-IO ").nth(1)?.split_whitespace();
            let round = f.next()?.parse().ok()?;
            let kind = f.next()?;
            let kind = KINDS.iter().position(|k| *k == kind)?;
            let bytes = f.next()?.parse().ok()?;
            let ns = f.next()?.parse().ok()?;
            Some(Pass {
                round,
                kind,
                bytes,
                ns,
            })
        })
        .collect()
}

/// A counted round: each kind's (MiB, seconds).
pub type Round = [(f64, f64); 3];

/// The rounds of `passes` that count: those after `first` (the round under way when the
/// other side started, and any before it, ran beside a booting guest or none), complete
/// (every kind reported).
pub fn counted(passes: &[Pass], first: u64) -> BTreeMap<u64, Round> {
    let mut by_round: BTreeMap<u64, [Option<(f64, f64)>; 3]> = BTreeMap::new();
    for p in passes.iter().filter(|p| p.round > first) {
        by_round.entry(p.round).or_default()[p.kind] = Some(p.mib_secs());
    }
    by_round
        .into_iter()
        .filter_map(|(r, k)| Some((r, [k[0]?, k[1]?, k[2]?])))
        .collect()
}

/// The round a side is in now, by its console's passes: its last pass's round, or the
/// next one if that pass was the round's last (0 before any pass).
pub fn under_way(passes: &[Pass]) -> u64 {
    passes
        .last()
        .map_or(0, |p| p.round + u64::from(p.kind == KINDS.len() - 1))
}

/// [`counted`] without the rounds in `paused_in` (`--alternate`: a round the side was
/// paused in, or may have been).
pub fn counted_except(
    passes: &[Pass],
    first: u64,
    paused_in: &std::collections::BTreeSet<u64>,
) -> BTreeMap<u64, Round> {
    let mut c = counted(passes, first);
    c.retain(|r, _| !paused_in.contains(r));
    c
}

/// Mean and two standard errors of the mean of `xs` (2 s.e. is 0 under two values).
pub fn mean_2se(xs: &[f64]) -> (f64, f64) {
    let n = xs.len() as f64;
    if xs.is_empty() {
        return (0.0, 0.0);
    }
    let mean = xs.iter().sum::<f64>() / n;
    if xs.len() < 2 {
        return (mean, 0.0);
    }
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (n - 1.0);
    (mean, 2.0 * (var / n).sqrt())
}

/// One kind of pass on both sides.
#[derive(Clone, Debug, Serialize, PartialEq)]
pub struct Compared {
    /// The kind ([`KINDS`]).
    pub kind: String,
    /// memfold-blk's MiB over its seconds, all counted passes of the kind.
    pub blk_mibps: f64,
    /// Its two standard errors, MiB/s.
    pub blk_2se: f64,
    /// Rounds on memfold-blk.
    pub blk_rounds: usize,
    /// QEMU's virtio-blk's, likewise.
    pub virtio_mibps: f64,
    /// Its two standard errors, MiB/s.
    pub virtio_2se: f64,
    /// Rounds on virtio-blk.
    pub virtio_rounds: usize,
    /// `blk / virtio` (under 1: memfold-blk is slower).
    pub ratio: f64,
    /// Two standard errors of the ratio (delta method, the sides' rounds taken as
    /// independent: the round-to-round noise only; the two guests run at once on one host,
    /// which that leaves out).
    pub ratio_2se: f64,
}

/// Each kind compared, memfold-blk's rounds against virtio-blk's.
pub fn compare(blk: &BTreeMap<u64, Round>, virtio: &BTreeMap<u64, Round>) -> Vec<Compared> {
    use crate::run::measure::ratio_rate;
    (0..KINDS.len())
        .map(|k| {
            let side = |s: &BTreeMap<u64, Round>| {
                let r = ratio_rate(&s.values().map(|r| r[k]).collect::<Vec<_>>());
                let rel = r.rel_var.unwrap_or(0.0);
                (r, 2.0 * r.rate * rel.sqrt(), rel)
            };
            let ((b, bse, brel), (v, vse, vrel)) = (side(blk), side(virtio));
            let ratio = b.rate / v.rate;
            Compared {
                kind: KINDS[k].into(),
                blk_mibps: b.rate,
                blk_2se: bse,
                blk_rounds: b.rounds,
                virtio_mibps: v.rate,
                virtio_2se: vse,
                virtio_rounds: v.rounds,
                ratio,
                ratio_2se: 2.0 * ratio * (brel + vrel).sqrt(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A side that runs with no new pass past the limit is said; a new pass, or a
    /// pause, restarts its time. Fails if progress does not reset it, or a pause counts.
    #[test]
    fn a_side_that_runs_without_a_new_pass_is_said_after_the_limit() {
        let t0 = Instant::now();
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut p = Progress::new(t0, Duration::from_secs(100));
        assert_eq!(p.look(0, 0, true, at(100)), None);
        assert_eq!(p.look(0, 1, true, at(150)), None, "a pass came");
        assert_eq!(p.look(0, 1, true, at(250)), None);
        assert_eq!(p.look(0, 1, true, at(251)), Some(Duration::from_secs(101)));
        // Side 1 read 3 passes, then was paused for 490 s, then runs again: its time
        // starts at its resume.
        assert_eq!(p.look(1, 3, true, at(10)), None);
        assert_eq!(p.look(1, 3, false, at(500)), None);
        assert_eq!(p.look(1, 3, true, at(599)), None);
        assert_eq!(p.look(1, 3, true, at(601)), Some(Duration::from_secs(101)));
        assert!(Progress::limit_for(16, 2048) < Duration::from_secs(600));
    }

    #[test]
    fn passes_are_read_and_junk_skipped() {
        let s = "MEMFOLD-IO-START /dev/vdb 16384 pages\nMEMFOLD-IO 0 seq-4k 1048576 500000000\n\
                 [ 1.0] x MEMFOLD-IO 0 rand-4k 4096 1000000\nMEMFOLD-IO 0 bogus 1 1\n\
                 MEMFOLD-IO 0 seq-1m 1048576\n";
        let p = passes(s);
        assert_eq!(p.len(), 2);
        // A line still being written is not read: its ns may be cut short.
        let cut = format!("{s}MEMFOLD-IO 1 seq-4k 1048576 50");
        assert_eq!(passes(&cut), p);
        assert_eq!(passes(&format!("{cut}0000000\n")).len(), 3);
        assert_eq!((p[0].kind, p[0].mib_secs()), (0, (1.0, 0.5)));
        assert_eq!(p[1].kind, 1);
        assert_eq!(p[1].mib_secs(), (4096.0 / 1048576.0, 1e-3));
    }

    #[test]
    fn only_complete_rounds_after_the_first_count() {
        let pass = |round, kind| Pass {
            round,
            kind,
            bytes: 1 << 20,
            ns: 1_000_000_000,
        };
        let mut v: Vec<Pass> = (0..4)
            .flat_map(|r| (0..3).map(move |k| pass(r, k)))
            .collect();
        v.push(pass(4, 0));
        let c = counted(&v, 1);
        assert_eq!(c.keys().copied().collect::<Vec<_>>(), vec![2, 3]);
        assert_eq!(c[&2], [(1.0, 1.0); 3]);
    }

    #[test]
    fn the_round_under_way_and_rounds_a_pause_fell_in() {
        let pass = |round, kind| Pass {
            round,
            kind,
            bytes: 1 << 20,
            ns: 1_000_000_000,
        };
        assert_eq!(under_way(&[]), 0);
        assert_eq!(under_way(&[pass(3, 0)]), 3);
        assert_eq!(under_way(&[pass(3, 0), pass(3, 1)]), 3);
        assert_eq!(under_way(&[pass(3, 1), pass(3, 2)]), 4, "round 3 done");
        let v: Vec<Pass> = (0..6)
            .flat_map(|r| (0..3).map(move |k| pass(r, k)))
            .collect();
        let paused: std::collections::BTreeSet<u64> = [2, 3].into();
        let c = counted_except(&v, 0, &paused);
        assert_eq!(c.keys().copied().collect::<Vec<_>>(), vec![1, 4, 5]);
    }

    #[test]
    fn ratios_carry_both_sides_spread() {
        assert_eq!(mean_2se(&[2.0]), (2.0, 0.0));
        let (m, se) = mean_2se(&[1.0, 3.0]);
        assert_eq!(m, 2.0);
        assert!((se - 2.0).abs() < 1e-12, "sd √2, s.e. 1, 2 s.e. 2: {se}");
        // Rounds of (MiB, s): 9 and 11 MiB in 1 s each, against 10 MiB in 1 s twice.
        let side = |x: [(f64, f64); 2]| -> BTreeMap<u64, Round> {
            x.iter()
                .enumerate()
                .map(|(i, &v)| (i as u64, [v; 3]))
                .collect()
        };
        let c = compare(
            &side([(9.0, 1.0), (11.0, 1.0)]),
            &side([(10.0, 1.0), (10.0, 1.0)]),
        );
        assert_eq!(c.len(), 3);
        assert_eq!(
            (c[0].ratio, c[0].blk_rounds, c[0].virtio_2se),
            (1.0, 2, 0.0)
        );
        assert!((c[0].ratio_2se - 0.2).abs() < 1e-12, "{}", c[0].ratio_2se);
        assert!((c[0].blk_2se - 2.0).abs() < 1e-12, "{}", c[0].blk_2se);
        // Fixed bytes per pass: 16 MiB in 0.1 s twice, then in 0.4 s: 48 MiB in 0.6 s is
        // 80 MiB/s (the mean of the per-pass rates said 120).
        let mut uneven = side([(16.0, 0.1), (16.0, 0.1)]);
        uneven.insert(2, [(16.0, 0.4); 3]);
        let c = compare(&uneven, &uneven);
        assert!((c[0].blk_mibps - 80.0).abs() < 1e-9, "{}", c[0].blk_mibps);
    }
}
