//! Workload speed from the guests' `MEMFOLD-RATE <metric> <value> [at <uptime>]` lines,
//! one per round: a side's rate over its rounds, managed against plain twins, late in a
//! run, and around a sharing break.
//!
//! A side's rate is its total work over its total time (a ratio estimator), not the mean
//! of per-round rates: a round is a fixed amount of work (web: 50 requests, py: 50
//! requests, cache: one pass over the disk) or a fixed time (pgbench: `-T 20`), and the
//! plain mean would weigh fast periods more in the first case. Its standard error is the
//! ratio estimator's by the delta method, with the rounds as the units.

use std::collections::{BTreeMap, HashMap};

use memfold_vm::launcher::Guest;
use serde::Serialize;

use super::{cpu_seconds, AGENT_THREADS};

/// What bounds a workload's round, which decides how its rates add up.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RoundKind {
    /// Each round is the same work (a rate r took 1/r time units).
    FixedWork,
    /// Each round is the same time (a rate r did r work units).
    FixedTime,
}

impl RoundKind {
    /// The kind of a workload's rounds (images/guest-init, images/tiny-init): pgbench runs
    /// for a fixed time (`-T 20`); web and py time 50 requests, cache one pass.
    pub fn of(metric: &str) -> RoundKind {
        match metric {
            "pgbench-tps" => RoundKind::FixedTime,
            _ => RoundKind::FixedWork,
        }
    }

    /// A round of rate `r` as (work, time), in the kind's units.
    fn round(self, r: f64) -> (f64, f64) {
        match self {
            RoundKind::FixedWork => (1.0, 1.0 / r),
            RoundKind::FixedTime => (r, 1.0),
        }
    }
}

/// A side's rate over its rounds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct SideRate {
    /// Total work / total time, in the metric's unit (0 without rounds).
    pub rate: f64,
    /// Rounds counted.
    pub rounds: usize,
    /// Squared standard error of `rate` relative to it (`None` under two rounds).
    pub rel_var: Option<f64>,
}

/// The rate of rounds given as (work, time): Σwork / Σtime, with its squared relative
/// standard error by the delta method (`Var ≈ Σ(w_i − R·t_i)² / ((n − 1)·n·t̄²)`).
pub fn ratio_rate(rounds: &[(f64, f64)]) -> SideRate {
    let n = rounds.len();
    let (work, time) = rounds
        .iter()
        .fold((0.0, 0.0), |(w, t), &(wi, ti)| (w + wi, t + ti));
    if n == 0 || time <= 0.0 {
        return SideRate::default();
    }
    let rate = work / time;
    let rel_var = (n >= 2 && rate > 0.0).then(|| {
        let nf = n as f64;
        let t_mean = time / nf;
        let s2 = rounds
            .iter()
            .map(|&(w, t)| (w - rate * t).powi(2))
            .sum::<f64>()
            / (nf - 1.0);
        s2 / (nf * t_mean * t_mean) / (rate * rate)
    });
    SideRate {
        rate,
        rounds: n,
        rel_var,
    }
}

/// A side's rate from a workload's per-round rates (`metric` says what a round is).
pub fn side_rate(metric: &str, rates: &[f64]) -> SideRate {
    let kind = RoundKind::of(metric);
    let rounds: Vec<(f64, f64)> = rates.iter().map(|&r| kind.round(r)).collect();
    ratio_rate(&rounds)
}

/// Two standard errors of `a.rate / b.rate` from both sides' spreads (delta method, the
/// two taken as independent: see [`Throughput::change_2se`] for what that leaves out).
fn ratio_2se(a: SideRate, b: SideRate) -> Option<f64> {
    a.rel_var
        .zip(b.rel_var)
        .map(|(x, y)| 2.0 * (a.rate / b.rate) * (x + y).sqrt())
}

/// Seconds of workload rounds compared on each side of a sharing break.
pub const BREAK_WINDOW_S: f64 = 60.0;

/// Seconds after the break left out: the breaker's own writes, and the balloon's
/// inflation under way.
pub const BREAK_SETTLE_S: f64 = 10.0;

/// A workload's speed in one guest before and after a breaker broke its sharing: the
/// rounds that ended (by the guest's uptime, `MEMFOLD-RATE <metric> <value> at <s>`) in
/// the [`BREAK_WINDOW_S`] before the break and in the one starting [`BREAK_SETTLE_S`]
/// after it.
#[derive(Clone, Debug, Serialize)]
pub struct AroundBreak {
    /// The guest.
    pub guest: String,
    /// What the workload reports.
    pub metric: String,
    /// The rate before (total work / total time of its rounds), and its rounds.
    pub before: (f64, usize),
    /// The rate after, and its rounds.
    pub after: (f64, usize),
    /// Two standard errors of after / before, from both windows' spreads.
    pub ratio_2se: Option<f64>,
}

/// Each guest's [`AroundBreak`] for a break at `at_s` of uptime.
pub fn around_break(guests: &[Guest], at_s: f64) -> Vec<AroundBreak> {
    let mut out = Vec::new();
    for g in guests {
        for (metric, v) in timed_rates(&g.serial()) {
            let window = |from: f64| -> Vec<f64> {
                v.iter()
                    .filter(|&&(_, t)| t >= from && t < from + BREAK_WINDOW_S)
                    .map(|&(x, _)| x)
                    .collect()
            };
            let b = side_rate(&metric, &window(at_s - BREAK_WINDOW_S));
            let a = side_rate(&metric, &window(at_s + BREAK_SETTLE_S));
            out.push(AroundBreak {
                guest: g.name.clone(),
                metric,
                before: (b.rate, b.rounds),
                after: (a.rate, a.rounds),
                ratio_2se: ratio_2se(a, b),
            });
        }
    }
    out
}

/// The `MEMFOLD-RATE <metric> <value> at <uptime s>` values in a guest's console text,
/// by metric: (value, uptime) pairs; lines without a time are left out.
fn timed_rates(serial: &str) -> BTreeMap<String, Vec<(f64, f64)>> {
    let mut out: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for (m, v, t) in rate_lines(serial) {
        if let Some(t) = t {
            out.entry(m.to_string()).or_default().push((v, t));
        }
    }
    out
}

/// Each `MEMFOLD-RATE <metric> <value> [at <uptime s>]` line of a guest's console text
/// whose value is finite and positive: (metric, value, uptime if given and finite).
fn rate_lines(serial: &str) -> impl Iterator<Item = (&str, f64, Option<f64>)> {
    serial.lines().filter_map(|l| {
        let rest = l.split("MEMFOLD-RATE ").nth(1)?;
        let mut f = rest.split_whitespace();
        let (m, v) = (f.next()?, f.next()?.parse::<f64>().ok()?);
        let t = match (f.next(), f.next().map(str::parse::<f64>)) {
            (Some("at"), Some(Ok(t))) if t.is_finite() => Some(t),
            _ => None,
        };
        (v.is_finite() && v > 0.0).then_some((m, v, t))
    })
}

/// A workload's speed in one guest late in a run: its rate over the later half of the
/// rounds it reported (`MEMFOLD-RATE <metric> <value>`) since memfoldd started — by then
/// the balloons have settled where the claim policy puts them.
#[derive(Clone, Debug, Serialize)]
pub struct GuestRate {
    /// The guest.
    pub guest: String,
    /// What the workload reports (`cache-MiB/s`, `web-req/s`, ...).
    pub metric: String,
    /// Total work / total time of those rounds, in the metric's unit (named `mean` in
    /// `run.json` since before it was a ratio estimator).
    pub mean: f64,
    /// Rounds counted.
    pub rounds: usize,
    /// Two standard errors of the rate, relative to it (`None` under 2 rounds).
    pub rel_2se: Option<f64>,
}

/// Each guest's [`GuestRate`]s since `since` (per guest, see [`StartMark`]).
pub fn late_rates(guests: &[Guest], since: &HashMap<String, StartMark>) -> Vec<GuestRate> {
    let mut out = Vec::new();
    for g in guests {
        let from = since.get(&g.name).map_or(0, |m| m.0);
        for (metric, v) in rates(&g.serial_since(from)) {
            let late = side_rate(&metric, &v[v.len() / 2..]);
            out.push(GuestRate {
                guest: g.name.clone(),
                metric,
                mean: late.rate,
                rounds: late.rounds,
                rel_2se: late.rel_var.map(|r| 2.0 * r.sqrt()),
            });
        }
    }
    out
}

/// A workload's throughput in a managed guest and in its plain twin over the same run
/// (the `MEMFOLD-RATE <metric> <value>` lines the guests print, one per workload round).
#[derive(Clone, Debug, Serialize)]
pub struct Throughput {
    /// The managed guest.
    pub guest: String,
    /// Its plain twin.
    pub twin: String,
    /// What the workload reports (`web-req/s`, `pgbench-tps`, `py-req/s`).
    pub metric: String,
    /// The managed guest's rate: total work / total time of its rounds (0: none).
    pub managed: f64,
    /// Rounds reported by the managed guest (0: its speed was not measured).
    pub managed_rounds: usize,
    /// The plain twin's rate, likewise.
    pub plain: f64,
    /// Rounds reported by the plain twin (0: not measured).
    pub plain_rounds: usize,
    /// `managed` / `plain`: the managed guest's speed relative to its twin's (under 1: a
    /// slowdown); 0 when either side has no rounds ([`Throughput::measured`]).
    pub ratio: f64,
    /// CPU seconds the managed guest's QEMU used over the run (memfold's agent included).
    pub managed_cpu_s: f64,
    /// Of those, CPU seconds of its memfold agent's threads: with the pair pinned to one
    /// CPU, time the guest's vCPU did not get (a lower bound of memfold's cost to it;
    /// the vCPU's own time in the kernel's fault paths is not in it). 0 for a guest of the
    /// kernel's kit (no agent).
    pub managed_agent_cpu_s: f64,
    /// CPU seconds the plain twin's QEMU used over the run.
    pub plain_cpu_s: f64,
    /// Two standard errors of [`Throughput::ratio`] (and of [`Throughput::change`]) by
    /// the delta method from each side's round-to-round spread, the sides and the rounds
    /// taken as independent. It covers that noise only: the twins share one CPU, so one
    /// gains what the other loses (anti-correlated: the true error is larger), rounds in
    /// a row are alike (autocorrelated: larger again), and one boot's order and placement
    /// are not resampled. A rough bar, not a pessimistic one. `None` with fewer than two
    /// rounds on a side.
    pub change_2se: Option<f64>,
}

impl Throughput {
    /// Managed / plain − 1 (negative: the managed guest is slower).
    pub fn change(&self) -> f64 {
        self.ratio - 1.0
    }

    /// Whether both guests reported rounds: a workload with none on one side is a failure
    /// to measure (a managed db too slow to finish a pgbench round), not left out.
    pub fn measured(&self) -> bool {
        self.managed_rounds > 0 && self.plain_rounds > 0
    }

    /// Why this workload's speed is not measured, if it is not.
    pub fn unmeasured(&self) -> Option<String> {
        let side = match (self.managed_rounds, self.plain_rounds) {
            (0, 0) => "either guest",
            (0, _) => "the managed guest",
            (_, 0) => "the plain twin",
            _ => return None,
        };
        Some(format!(
            "{} {}: no rounds on {side} ({} managed, {} plain): its speed is not measured",
            self.guest, self.metric, self.managed_rounds, self.plain_rounds
        ))
    }
}

/// Why each unmeasured workload of `t` is so ([`Throughput::unmeasured`]).
pub fn unmeasured(t: &[Throughput]) -> Vec<String> {
    t.iter().filter_map(Throughput::unmeasured).collect()
}

/// The `MEMFOLD-RATE` values in a guest's console text, by metric.
fn rates(serial: &str) -> BTreeMap<String, Vec<f64>> {
    let mut out: BTreeMap<String, Vec<f64>> = BTreeMap::new();
    for (m, v, _) in rate_lines(serial) {
        out.entry(m.to_string()).or_default().push(v);
    }
    out
}

/// Where a guest stood when memfoldd started: bytes of its console log file (raw, not
/// decoded text: see `Guest::serial_since`), its QEMU's CPU seconds, and those of its
/// agent's threads.
pub type StartMark = (u64, f64, f64);

/// Each guest's [`StartMark`] now, by name.
pub fn start_marks<'a>(guests: impl Iterator<Item = &'a Guest>) -> HashMap<String, StartMark> {
    guests
        .map(|g| {
            let mark = (
                g.serial_len(),
                cpu_seconds(g.pid, None),
                cpu_seconds(g.pid, Some(AGENT_THREADS)),
            );
            (g.name.clone(), mark)
        })
        .collect()
}

/// One pair's workloads from each guest's rates by metric: every metric either reported
/// (one with no rounds on a side is kept, unmeasured); CPU figures left at 0.
fn pair_rates(
    guest: &str,
    twin: &str,
    managed: &BTreeMap<String, Vec<f64>>,
    plain: &BTreeMap<String, Vec<f64>>,
) -> Vec<Throughput> {
    let metrics: std::collections::BTreeSet<&String> = managed.keys().chain(plain.keys()).collect();
    metrics
        .into_iter()
        .map(|metric| {
            let side = |r: &BTreeMap<String, Vec<f64>>| {
                side_rate(metric, r.get(metric).map_or(&[][..], Vec::as_slice))
            };
            let (m, p) = (side(managed), side(plain));
            let both = m.rounds > 0 && p.rounds > 0;
            Throughput {
                guest: guest.into(),
                twin: twin.into(),
                metric: metric.clone(),
                managed: m.rate,
                managed_rounds: m.rounds,
                plain: p.rate,
                plain_rounds: p.rounds,
                ratio: if both { m.rate / p.rate } else { 0.0 },
                managed_cpu_s: 0.0,
                managed_agent_cpu_s: 0.0,
                plain_cpu_s: 0.0,
                change_2se: if both { ratio_2se(m, p) } else { None },
            }
        })
        .collect()
}

/// Pairs each managed guest with its plain twin and compares their rates since
/// `since` (per guest, see [`StartMark`]); a workload either guest reported is listed,
/// unmeasured ([`Throughput::measured`]) if the other reported no round of it.
pub fn throughput(
    managed: &[Guest],
    plain: &[Guest],
    since: &HashMap<String, StartMark>,
) -> Vec<Throughput> {
    let at_start = |g: &Guest| since.get(&g.name).copied().unwrap_or((0, 0.0, 0.0));
    let cpu = |g: &Guest| cpu_seconds(g.pid, None) - at_start(g).1;
    let agent_cpu = |g: &Guest| cpu_seconds(g.pid, Some(AGENT_THREADS)) - at_start(g).2;
    let window = |g: &Guest| rates(&g.serial_since(at_start(g).0));
    let mut out = Vec::new();
    for (m, p) in managed.iter().zip(plain) {
        for mut t in pair_rates(&m.name, &p.name, &window(m), &window(p)) {
            t.managed_cpu_s = cpu(m);
            t.managed_agent_cpu_s = agent_cpu(m);
            t.plain_cpu_s = cpu(p);
            out.push(t);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fixed_time_side_rate_is_the_mean_with_its_standard_error() {
        let s = side_rate("pgbench-tps", &[9.0, 11.0]);
        assert_eq!(s.rate, 10.0);
        // s = sqrt(2), s.e. = 1, relative 0.1, squared 0.01.
        assert!((s.rel_var.unwrap() - 0.01).abs() < 1e-12);
        assert_eq!(side_rate("pgbench-tps", &[5.0]).rel_var, None, "one round");
        assert_eq!(side_rate("web-req/s", &[]), SideRate::default());
    }

    /// Six rounds of 50 requests at 100/s, then three at 50/s: 450 requests in 6 s, 75/s
    /// (the mean of the per-round rates said 83.3).
    #[test]
    fn a_fixed_work_side_rate_is_total_work_over_total_time() {
        let v: Vec<f64> = [100.0; 6].into_iter().chain([50.0; 3]).collect();
        let s = side_rate("web-req/s", &v);
        assert!((s.rate - 75.0).abs() < 1e-9, "{}", s.rate);
        assert_eq!(s.rounds, 9);
        // Delta method: times 0.01 (×6) and 0.02 (×3) per request; d_i = 1 − 75·t_i is
        // 0.25 or −0.5; s² = (6·0.0625 + 3·0.25)/8; t̄ = 2/150.
        let s2: f64 = (6.0 * 0.0625 + 3.0 * 0.25) / 8.0;
        let t_mean: f64 = 2.0 / 150.0;
        let want = s2 / (9.0 * t_mean * t_mean) / (75.0 * 75.0);
        assert!((s.rel_var.unwrap() - want).abs() < 1e-12);
        // Equal rounds: no spread.
        assert_eq!(side_rate("py-req/s", &[20.0, 20.0]).rel_var, Some(0.0));
    }

    #[test]
    fn a_workload_missing_on_one_side_is_listed_unmeasured() {
        let r = |v: &[(&str, &[f64])]| -> BTreeMap<String, Vec<f64>> {
            v.iter().map(|(m, x)| (m.to_string(), x.to_vec())).collect()
        };
        let managed = r(&[("web-req/s", &[90.0, 110.0])]);
        let plain = r(&[
            ("web-req/s", &[100.0, 100.0]),
            ("pgbench-tps", &[40.0, 44.0]),
        ]);
        let t = pair_rates("db-1", "db-1-plain", &managed, &plain);
        assert_eq!(t.len(), 2, "{t:?}");
        let pg = t.iter().find(|t| t.metric == "pgbench-tps").unwrap();
        assert!(!pg.measured() && pg.ratio == 0.0 && pg.change_2se.is_none());
        assert_eq!((pg.managed_rounds, pg.plain_rounds), (0, 2));
        assert!(pg
            .unmeasured()
            .unwrap()
            .contains("no rounds on the managed guest"));
        let web = t.iter().find(|t| t.metric == "web-req/s").unwrap();
        assert!(web.measured() && web.unmeasured().is_none());
        // Fixed work: the harmonic mean of 90 and 110 is 99, against the twin's 100.
        assert!((web.ratio - 0.99).abs() < 1e-12, "{}", web.ratio);
        assert!(web.change_2se.is_some());
    }

    #[test]
    fn rate_lines_are_read_by_metric_and_junk_is_skipped() {
        let serial = "boot\nMEMFOLD-RATE web-req/s 12.50\n[ 3.1] x MEMFOLD-RATE pgbench-tps 88\n\
                      MEMFOLD-RATE web-req/s 7.5\nMEMFOLD-RATE web-req/s nan\nMEMFOLD-RATE py-req/s\n\
                      MEMFOLD-RATE web-req/s -1\n";
        let r = rates(serial);
        assert_eq!(r["web-req/s"], vec![12.5, 7.5]);
        let timed = timed_rates(
            "MEMFOLD-RATE cache-MiB/s 60.5 at 101.25\nMEMFOLD-RATE cache-MiB/s 70\n\
             MEMFOLD-RATE cache-MiB/s 80 at soon\nMEMFOLD-RATE cache-MiB/s 90 at 140.0\n",
        );
        assert_eq!(timed["cache-MiB/s"], vec![(60.5, 101.25), (90.0, 140.0)]);
        assert_eq!(r["pgbench-tps"], vec![88.0]);
        assert_eq!(r.len(), 2);
    }
}
