//! The write-latency side channel of page sharing, scored (Satori §4.3; issue 17,
//! "Proof"; docs/side-channel.md): what `memfold bench side-channel` reads from the
//! consoles of its two `tiny` guests running `memfold-probe` (images/memfold-probe.rs),
//! and the attacker's decision.
//!
//! A **trial** is one guessed secret of a few pages: the victim holds it or not (exactly
//! half of each round's trials, at random; the victim's console says which, for scoring
//! only). The attacker built the guess in its own pages, waited past memfoldd's scan
//! interval, and timed one write to each page; it also timed writes to **control** pages
//! of its own that no other guest holds. Its rule uses only what it measured: a trial is
//! "present" when the **median** of its pages' write times is over a threshold derived
//! from the control writes ([`threshold_ns`]: a plain write's distribution), so a single
//! slow write (an interrupt, a vCPU descheduled on a busy host) does not decide a trial.
//! A copy-on-write break (a write-protect fault served by memfold's agent in QEMU: tens of
//! µs) is far over it; a plain write (under a µs, even under TCG) far under.

use serde::{Deserialize, Serialize};

/// Why consoles could not be scored.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SideChannelError {
    /// A console line of the probe that does not parse.
    #[error("{guest} console line {line:?}: {why}")]
    BadLine {
        /// `victim` or `attacker`.
        guest: &'static str,
        /// The line.
        line: String,
        /// What is wrong with it.
        why: String,
    },
    /// A trial the attacker timed whose truth the victim did not print (or the reverse).
    #[error("round {round}: the attacker timed {timed} trials, the victim held {held}")]
    Mismatch {
        /// The round.
        round: u32,
        /// Trials the attacker timed.
        timed: usize,
        /// Trials the victim printed the truth of.
        held: usize,
    },
    /// Nothing to score.
    #[error("no trial timed, or no control write")]
    Empty,
}

/// One trial as the attacker timed it, with its truth.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trial {
    /// Round (each round's pages are built, waited on and timed together).
    pub round: u32,
    /// Whether the victim held the guessed secret.
    pub present: bool,
    /// The write time of each of its pages, ns.
    pub write_ns: Vec<u64>,
}

/// Everything the two consoles said.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Observed {
    /// Every trial of every round.
    pub trials: Vec<Trial>,
    /// Write times to the attacker's control pages (pages no other guest holds), ns.
    pub controls_ns: Vec<u64>,
}

fn numbers(list: &str) -> Result<Vec<u64>, String> {
    list.split(',')
        .map(|n| n.parse::<u64>().map_err(|e| format!("{n:?}: {e}")))
        .collect()
}

/// Reads the probe's lines from the victim's and the attacker's console text (other
/// lines are ignored; a console may carry kernel messages between them).
///
/// Errors: a probe line that does not parse, or rounds whose trial counts differ.
pub fn parse(victim: &str, attacker: &str) -> Result<Observed, SideChannelError> {
    use std::collections::BTreeMap;
    let bad = |guest, line: &str, why: String| SideChannelError::BadLine {
        guest,
        line: line.into(),
        why,
    };
    let mut truth: BTreeMap<u32, Vec<bool>> = BTreeMap::new();
    for line in victim.lines() {
        let Some(rest) = line.trim_end().strip_prefix("MEMFOLD-PROBE-TRUTH ") else {
            continue;
        };
        let (r, bits) = rest
            .split_once(' ')
            .ok_or_else(|| bad("victim", line, "no bits".into()))?;
        let r: u32 = r.parse().map_err(|e| bad("victim", line, format!("{e}")))?;
        let bits = bits
            .chars()
            .map(|c| match c {
                '0' => Ok(false),
                '1' => Ok(true),
                _ => Err(bad("victim", line, format!("{c:?} is not a bit"))),
            })
            .collect::<Result<Vec<bool>, _>>()?;
        truth.insert(r, bits);
    }
    let mut obs = Observed::default();
    let mut timed: BTreeMap<u32, usize> = BTreeMap::new();
    for line in attacker.lines() {
        let line = line.trim_end();
        if let Some(rest) = line.strip_prefix("MEMFOLD-PROBE-T ") {
            let f: Vec<&str> = rest.split(' ').collect();
            let [r, t, ns] = f[..] else {
                return Err(bad("attacker", line, "3 fields expected".into()));
            };
            let r: u32 = r
                .parse()
                .map_err(|e| bad("attacker", line, format!("{e}")))?;
            let t: usize = t
                .parse()
                .map_err(|e| bad("attacker", line, format!("{e}")))?;
            let write_ns = numbers(ns).map_err(|e| bad("attacker", line, e))?;
            let present = truth.get(&r).and_then(|b| b.get(t)).copied().ok_or(
                SideChannelError::Mismatch {
                    round: r,
                    timed: t + 1,
                    held: truth.get(&r).map_or(0, Vec::len),
                },
            )?;
            *timed.entry(r).or_default() += 1;
            obs.trials.push(Trial {
                round: r,
                present,
                write_ns,
            });
        } else if let Some(rest) = line.strip_prefix("MEMFOLD-PROBE-K ") {
            let (_, ns) = rest
                .split_once(' ')
                .ok_or_else(|| bad("attacker", line, "no times".into()))?;
            obs.controls_ns
                .extend(numbers(ns).map_err(|e| bad("attacker", line, e))?);
        }
    }
    for (&round, &n) in &timed {
        let held = truth.get(&round).map_or(0, Vec::len);
        if n != held {
            return Err(SideChannelError::Mismatch {
                round,
                timed: n,
                held,
            });
        }
    }
    if obs.trials.is_empty() || obs.controls_ns.is_empty() {
        return Err(SideChannelError::Empty);
    }
    Ok(obs)
}

/// The `q` quantile (0..=1) of `v` (nearest rank), or 0 for none.
pub fn quantile(v: &[u64], q: f64) -> u64 {
    if v.is_empty() {
        return 0;
    }
    let mut s = v.to_vec();
    s.sort_unstable();
    let i = ((s.len() - 1) as f64 * q.clamp(0.0, 1.0)).round() as usize;
    s[i]
}

/// The attacker's threshold from its control writes (plain writes), ns: four times their
/// 90th percentile, and at least 5 µs. A trial whose median write is over it is called
/// present. Derived from what the attacker measured, never from the truth; the 90th
/// percentile rather than the tail, so that a busy host's rare slow plain writes (a vCPU
/// descheduled mid-write) do not lift it over a CoW break's cost.
pub fn threshold_ns(controls_ns: &[u64]) -> u64 {
    (quantile(controls_ns, 0.9) * 4).max(5_000)
}

/// The attacker's call on one trial: the median of its pages' write times over `threshold`.
pub fn called_present(t: &Trial, threshold: u64) -> bool {
    quantile(&t.write_ns, 0.5) > threshold
}

/// One side's score.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Score {
    /// Trials scored.
    pub trials: usize,
    /// Of them, secrets the victim held.
    pub present: usize,
    /// The attacker's accuracy: trials called right ÷ trials (0.5: chance).
    pub accuracy: f64,
    /// Half-width of its 95% confidence interval (normal approximation), as a fraction.
    pub accuracy_ci95: f64,
    /// Present trials called present ÷ present trials.
    pub true_positive_rate: f64,
    /// Absent trials called present ÷ absent trials.
    pub false_positive_rate: f64,
    /// The attacker's threshold, ns ([`threshold_ns`]).
    pub threshold_ns: u64,
    /// Control writes: count, and their p50, p90 and p99, ns.
    pub control_writes: usize,
    /// Control writes' p50, ns.
    pub control_p50_ns: u64,
    /// Control writes' p90, ns.
    pub control_p90_ns: u64,
    /// Control writes' p99, ns.
    pub control_p99_ns: u64,
    /// Median over present trials of each trial's median write, ns.
    pub present_median_ns: u64,
    /// Median over absent trials of each trial's median write, ns.
    pub absent_median_ns: u64,
}

/// Scores what the consoles said with the attacker's rule ([`called_present`] against
/// [`threshold_ns`] of the controls).
pub fn score(obs: &Observed) -> Score {
    let thr = threshold_ns(&obs.controls_ns);
    let n = obs.trials.len();
    let present = obs.trials.iter().filter(|t| t.present).count();
    let (mut right, mut tp, mut fp) = (0usize, 0usize, 0usize);
    for t in &obs.trials {
        let call = called_present(t, thr);
        right += usize::from(call == t.present);
        tp += usize::from(call && t.present);
        fp += usize::from(call && !t.present);
    }
    let medians = |p: bool| -> Vec<u64> {
        obs.trials
            .iter()
            .filter(|t| t.present == p)
            .map(|t| quantile(&t.write_ns, 0.5))
            .collect()
    };
    let acc = right as f64 / n.max(1) as f64;
    let ratio = |a: usize, b: usize| if b == 0 { 0.0 } else { a as f64 / b as f64 };
    Score {
        trials: n,
        present,
        accuracy: acc,
        accuracy_ci95: 1.96 * (acc * (1.0 - acc) / n.max(1) as f64).sqrt(),
        true_positive_rate: ratio(tp, present),
        false_positive_rate: ratio(fp, n - present),
        threshold_ns: thr,
        control_writes: obs.controls_ns.len(),
        control_p50_ns: quantile(&obs.controls_ns, 0.5),
        control_p90_ns: quantile(&obs.controls_ns, 0.9),
        control_p99_ns: quantile(&obs.controls_ns, 0.99),
        present_median_ns: quantile(&medians(true), 0.5),
        absent_median_ns: quantile(&medians(false), 0.5),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const VICTIM: &str = "boot noise\nMEMFOLD-PROBE-TRUTH 0 1001\nMEMFOLD-PROBE-TRUTH 1 0110\nMEMFOLD-PROBE-VICTIM-READY 32 pages\n";

    fn attacker(slow: u64) -> String {
        let mut s = String::from("MEMFOLD-PROBE-START attacker\n");
        let truth = ["1001", "0110"];
        for (r, bits) in truth.iter().enumerate() {
            for (t, b) in bits.chars().enumerate() {
                // A present secret is slow in 3 of its 4 pages; an absent one has one
                // slow outlier, which the median ignores.
                let ns = if b == '1' {
                    format!("{slow},{slow},300,{slow}")
                } else {
                    format!("250,{slow},280,300")
                };
                s += &format!("MEMFOLD-PROBE-T {r} {t} {ns}\n");
            }
            s += &format!("MEMFOLD-PROBE-K {r} 200,250,300,260,240,230,1000\r\n");
        }
        s + "MEMFOLD-PROBE-DONE 2 rounds\n"
    }

    #[test]
    fn cow_breaks_are_called_present_by_the_median() {
        let o = parse(VICTIM, &attacker(40_000)).unwrap();
        assert_eq!(o.trials.len(), 8);
        assert_eq!(o.controls_ns.len(), 14);
        let s = score(&o);
        assert_eq!(s.threshold_ns, 5_000);
        assert_eq!((s.accuracy, s.present), (1.0, 4));
        assert_eq!((s.true_positive_rate, s.false_positive_rate), (1.0, 0.0));
    }

    #[test]
    fn without_a_slow_write_nothing_is_called_present_and_accuracy_is_chance() {
        // Plain writes everywhere (never-share): every trial called absent, half right.
        let s = score(&parse(VICTIM, &attacker(310)).unwrap());
        assert_eq!(s.accuracy, 0.5);
        assert_eq!(s.true_positive_rate, 0.0);
    }

    #[test]
    fn the_threshold_follows_the_plain_writes() {
        let slow_host: Vec<u64> = (0..100).map(|i| 2_000 + i * 10).collect();
        assert_eq!(threshold_ns(&slow_host), 4 * 2_890);
        assert_eq!(threshold_ns(&[100, 200]), 5_000);
    }

    #[test]
    fn truth_and_timings_must_agree() {
        let short = "MEMFOLD-PROBE-TRUTH 0 10\n";
        let e = parse(short, &attacker(40_000)).unwrap_err();
        assert!(
            matches!(e, SideChannelError::Mismatch { round: 0, .. }),
            "{e}"
        );
        let e = parse(VICTIM, "MEMFOLD-PROBE-T 0 0 12,x\n").unwrap_err();
        assert!(matches!(e, SideChannelError::BadLine { .. }), "{e}");
        assert_eq!(parse(VICTIM, "nothing"), Err(SideChannelError::Empty));
    }
}
