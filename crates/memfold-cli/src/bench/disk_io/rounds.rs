//! The guests' I/O rounds as their consoles report them (`MEMFOLD-IO round kind bytes ns`,
//! images/memfold-probe.rs `diskio`), which of them ran while both sides ran, and their
//! throughput as mean ± 2 standard errors and a ratio.

use std::collections::BTreeMap;

use serde::Serialize;

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
    /// Throughput, MiB/s.
    pub fn mibps(&self) -> f64 {
        self.bytes as f64 / (1u64 << 20) as f64 / (self.ns.max(1) as f64 / 1e9)
    }
}

/// The passes in a console's text, in order (lines that do not parse are skipped).
pub fn passes(serial: &str) -> Vec<Pass> {
    serial
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

/// The rounds of `passes` that count: those after `first` (the round under way when the
/// other side started, and any before it, ran beside a booting guest or none), complete
/// (every kind reported).
pub fn counted(passes: &[Pass], first: u64) -> BTreeMap<u64, [f64; 3]> {
    let mut by_round: BTreeMap<u64, [Option<f64>; 3]> = BTreeMap::new();
    for p in passes.iter().filter(|p| p.round > first) {
        by_round.entry(p.round).or_default()[p.kind] = Some(p.mibps());
    }
    by_round
        .into_iter()
        .filter_map(|(r, k)| Some((r, [k[0]?, k[1]?, k[2]?])))
        .collect()
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
    /// memfold-blk's mean, MiB/s.
    pub blk_mibps: f64,
    /// Its two standard errors, MiB/s.
    pub blk_2se: f64,
    /// Rounds on memfold-blk.
    pub blk_rounds: usize,
    /// QEMU's virtio-blk's mean, MiB/s.
    pub virtio_mibps: f64,
    /// Its two standard errors, MiB/s.
    pub virtio_2se: f64,
    /// Rounds on virtio-blk.
    pub virtio_rounds: usize,
    /// `blk / virtio` (under 1: memfold-blk is slower).
    pub ratio: f64,
    /// Two standard errors of the ratio (delta method, the sides' rounds taken as
    /// independent).
    pub ratio_2se: f64,
}

/// Each kind compared, memfold-blk's rounds against virtio-blk's.
pub fn compare(blk: &BTreeMap<u64, [f64; 3]>, virtio: &BTreeMap<u64, [f64; 3]>) -> Vec<Compared> {
    (0..KINDS.len())
        .map(|k| {
            let b: Vec<f64> = blk.values().map(|r| r[k]).collect();
            let v: Vec<f64> = virtio.values().map(|r| r[k]).collect();
            let ((bm, bse), (vm, vse)) = (mean_2se(&b), mean_2se(&v));
            let ratio = bm / vm;
            Compared {
                kind: KINDS[k].into(),
                blk_mibps: bm,
                blk_2se: bse,
                blk_rounds: b.len(),
                virtio_mibps: vm,
                virtio_2se: vse,
                virtio_rounds: v.len(),
                ratio,
                ratio_2se: ratio * ((bse / bm).powi(2) + (vse / vm).powi(2)).sqrt(),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passes_are_read_and_junk_skipped() {
        let s = "MEMFOLD-IO-START /dev/vdb 16384 pages\nMEMFOLD-IO 0 seq-4k 1048576 500000000\n\
                 [ 1.0] x MEMFOLD-IO 0 rand-4k 4096 1000000\nMEMFOLD-IO 0 bogus 1 1\n\
                 MEMFOLD-IO 0 seq-1m 1048576\n";
        let p = passes(s);
        assert_eq!(p.len(), 2);
        assert_eq!((p[0].kind, p[0].mibps()), (0, 2.0));
        assert_eq!(p[1].kind, 1);
        assert!((p[1].mibps() - 4096.0 / 1048576.0 / 1e-3).abs() < 1e-9);
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
        assert_eq!(c[&2], [1.0; 3]);
    }

    #[test]
    fn ratios_carry_both_sides_spread() {
        assert_eq!(mean_2se(&[2.0]), (2.0, 0.0));
        let (m, se) = mean_2se(&[1.0, 3.0]);
        assert_eq!(m, 2.0);
        assert!((se - 2.0).abs() < 1e-12, "sd √2, s.e. 1, 2 s.e. 2: {se}");
        let side = |x: [f64; 2]| -> BTreeMap<u64, [f64; 3]> {
            x.iter()
                .enumerate()
                .map(|(i, &v)| (i as u64, [v; 3]))
                .collect()
        };
        let c = compare(&side([9.0, 11.0]), &side([10.0, 10.0]));
        assert_eq!(c.len(), 3);
        assert_eq!(
            (c[0].ratio, c[0].blk_rounds, c[0].virtio_2se),
            (1.0, 2, 0.0)
        );
        assert!((c[0].ratio_2se - 0.2).abs() < 1e-12, "{}", c[0].ratio_2se);
    }
}
