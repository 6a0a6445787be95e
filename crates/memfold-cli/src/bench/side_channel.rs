//! `memfold bench side-channel`: the write-latency side channel of page sharing, measured
//! on live guests (Satori §4.3; issue 17, "Proof"; docs/side-channel.md).
//!
//! Each side boots memfoldd (sharing alone, both guests one user's: one sharing domain
//! under `--share-domains user`) and two `tiny` guests running `memfold-probe`
//! (images/memfold-probe.rs): a **victim** holding, for each trial, a guessed secret or
//! bytes of its own (half of each round's trials at random), and once it is ready an
//! **attacker** that builds every guess in its own pages, waits past the scan interval,
//! and times one write to each page and to control pages of its own. The attacker's call
//! and its accuracy are [`memfold_cli::side_channel`]'s. The side with `--never-share`
//! marks the victim never-share (a sharing domain of its own): the attacker's guesses are
//! then never shared, whatever they match. With `--protect process` it marks only the
//! victim's probe process instead, from inside the guest (`memfold-guest never-share
//! --pid`, over the enlightened guest's channel): the guests stay one sharing domain, and
//! the victim's secret pages are never shared.
//!
//! Needs root (the agent's userfaultfd) and boots guests: on a shared host run it under
//! `flock /tmp/measure.lock`.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use memfold_cli::side_channel::{parse, score, Score};
use memfold_vm::launcher::{agent_env, Accel, Guest, GuestSpec, RamBackend};
use serde::Serialize;

use crate::run::{companions, Daemon};

/// `memfold bench side-channel`'s flags.
#[derive(Args, Clone, Debug)]
pub struct SideChannelArgs {
    /// Trials per side (rounded up to whole rounds of `--per-round`).
    #[arg(long, default_value_t = 512)]
    pub trials: usize,
    /// Trials per round: built together, waited on once, then timed.
    #[arg(long, default_value_t = 64)]
    pub per_round: usize,
    /// Pages per secret: the attacker calls a trial by the median of their write times.
    #[arg(long, default_value_t = 4)]
    pub pages: usize,
    /// The attacker's control pages per round (pages no other guest holds: plain writes,
    /// from which its threshold is derived).
    #[arg(long, default_value_t = 64)]
    pub controls: usize,
    /// How long the attacker waits between building a round's pages and timing them, s:
    /// past memfoldd's scan interval (`--scan-interval-ms`) times its quiet-page period
    /// (`--quiet-scan-period`): a round's pages may land on guest frames memfoldd had
    /// found quiet and reads only every 8th scan.
    #[arg(long, default_value_t = 6.0)]
    pub wait_secs: f64,
    /// memfoldd's `--quiet-scan-period`: most full scans between two reads of a quiet
    /// page (1: every page every scan; 8, memfoldd's default, as KSM's smart scan).
    #[arg(long, default_value_t = 8)]
    pub quiet_scan_period: u32,
    /// How long the attacker waits after it boots before its first round, s: memfoldd's
    /// attach of a new guest (its first scans share the boot pages the guests have in
    /// common; seconds on a busy host) is over by then.
    #[arg(long, default_value_t = 10.0)]
    pub settle_secs: f64,
    /// memfoldd's interval between full sharing scans, ms (its `--min-scan-interval-ms`
    /// and `--max-scan-interval-ms`).
    #[arg(long, default_value_t = 500)]
    pub scan_interval_ms: u64,
    /// Only the protected side: the victim marked never-share (`memfoldd --never-share
    /// victim`). Without it (and without `--both`), only the unprotected side.
    #[arg(long, conflicts_with = "both")]
    pub never_share: bool,
    /// Both sides, unprotected then never-share.
    #[arg(long)]
    pub both: bool,
    /// How the never-share side protects the victim: `vm` (memfoldd's `--never-share
    /// victim`, a sharing domain of its own) or `process` (the victim's guest marks its
    /// probe process with `memfold-guest never-share --pid`; one domain).
    #[arg(long, value_enum, default_value_t = Protect::Vm)]
    pub protect: Protect,
    /// Seed of the secrets, the truth and the write order.
    #[arg(long, default_value_t = 17)]
    pub seed: u64,
    /// RAM per guest, MiB.
    #[arg(long, default_value_t = 160)]
    pub mem_mib: u32,
    /// Output folder (default out/side-channel): `side-channel.json`, each side's consoles
    /// and memfoldd's log.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

/// How the never-share side protects the victim.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Protect {
    /// The whole guest (memfoldd's `--never-share`).
    Vm,
    /// Its probe process, marked from inside the guest.
    Process,
}

/// One side's result.
#[derive(Clone, Debug, Serialize)]
pub struct Side {
    /// Whether the victim was marked never-share.
    pub never_share: bool,
    /// How, if it was.
    pub protect: Option<Protect>,
    /// The victim's pages its guest marked never-share in its last report (`--protect
    /// process`), 4 KiB pages.
    pub victim_never_share_pages: u64,
    /// The attacker's score.
    pub score: Score,
    /// Sharing domains memfoldd had at the end.
    pub domains: u64,
    /// The attacker's pages mapped onto pool frames when it finished.
    pub attacker_shared_pages: u64,
    /// The attacker's copy-on-write breaks (cumulative).
    pub attacker_cow_breaks: u64,
    /// Wall time of the side, s.
    pub secs: f64,
}

/// The whole run.
#[derive(Clone, Debug, Serialize)]
pub struct SideChannelRun {
    /// Acceleration (KVM or TCG).
    pub accel: String,
    /// Trials per side, rounds, trials per round, pages per secret, controls per round.
    pub trials: usize,
    /// Rounds per side.
    pub rounds: usize,
    /// Trials per round.
    pub per_round: usize,
    /// Pages per secret.
    pub pages: usize,
    /// Control pages per round.
    pub controls: usize,
    /// The attacker's wait, s.
    pub wait_secs: f64,
    /// The attacker's wait after boot, before its first round, s.
    pub settle_secs: f64,
    /// memfoldd's scan interval, ms.
    pub scan_interval_ms: u64,
    /// memfoldd's quiet-page period, scans.
    pub quiet_scan_period: u32,
    /// Each side measured.
    pub sides: Vec<Side>,
}

/// Runs the benchmark.
///
/// Errors: not root, images or guests that do not come up, a probe that fails or times
/// out, consoles that do not parse.
pub fn run(a: &SideChannelArgs) -> Result<()> {
    anyhow::ensure!(
        a.per_round >= 2 && a.pages >= 1 && a.controls >= 1,
        "--per-round at least 2, --pages and --controls at least 1"
    );
    let (agent, daemon) = companions()?;
    let (out, cache, accel) = super::prepare(&a.out, "side-channel", &["tiny"])?;
    let rounds = a.trials.div_ceil(a.per_round);
    let sides: Vec<bool> = if a.both {
        vec![false, true]
    } else {
        vec![a.never_share]
    };
    let mut res = SideChannelRun {
        accel: format!("{accel:?}"),
        trials: rounds * a.per_round,
        rounds,
        per_round: a.per_round,
        pages: a.pages,
        controls: a.controls,
        wait_secs: a.wait_secs,
        settle_secs: a.settle_secs,
        scan_interval_ms: a.scan_interval_ms,
        quiet_scan_period: a.quiet_scan_period,
        sides: Vec::new(),
    };
    for ns in sides {
        let dir = out.join(if ns { "never-share" } else { "shared" });
        let s = side(a, ns, rounds, &dir, &cache, accel, &agent, &daemon)?;
        eprintln!(
            "{}: accuracy {:.1}% ± {:.1}% over {} trials (threshold {:.1} µs; median write: secret present {:.1} µs, absent {:.1} µs, controls p50 {:.1} µs p99 {:.1} µs); {} domains, {} attacker CoW breaks",
            if ns { "never-share" } else { "shared     " },
            100.0 * s.score.accuracy,
            100.0 * s.score.accuracy_ci95,
            s.score.trials,
            s.score.threshold_ns as f64 / 1e3,
            s.score.present_median_ns as f64 / 1e3,
            s.score.absent_median_ns as f64 / 1e3,
            s.score.control_p50_ns as f64 / 1e3,
            s.score.control_p99_ns as f64 / 1e3,
            s.domains,
            s.attacker_cow_breaks,
        );
        res.sides.push(s);
    }
    let json = serde_json::to_string_pretty(&res)?;
    std::fs::write(out.join("side-channel.json"), &json)?;
    if a.json {
        println!("{json}");
    }
    eprintln!("wrote {}", out.join("side-channel.json").display());
    Ok(())
}

/// One side: memfoldd, the victim until it is ready, the attacker until it is done.
#[allow(clippy::too_many_arguments)]
fn side(
    a: &SideChannelArgs,
    never_share: bool,
    rounds: usize,
    dir: &Path,
    cache: &Path,
    accel: Accel,
    agent: &Path,
    daemon_bin: &Path,
) -> Result<Side> {
    let t0 = Instant::now();
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir)?;
    let socket = dir.join("memfoldd.sock");
    let iv = a.scan_interval_ms.to_string();
    let quiet = a.quiet_scan_period.to_string();
    let mut args: Vec<&str> = vec![
        "--config",
        "none",
        "--policy",
        "sharing",
        "--rate",
        "0",
        "--min-scan-interval-ms",
        &iv,
        "--max-scan-interval-ms",
        &iv,
        "--quiet-scan-period",
        &quiet,
        "--share-domains",
        "user",
    ];
    let by_process = never_share && a.protect == Protect::Process;
    let channels = dir.join("channels");
    let channels_arg = channels.to_string_lossy().into_owned();
    if by_process {
        std::fs::create_dir_all(&channels)?;
        args.extend([
            "--guest-channels",
            &channels_arg,
            "--guest-interval-ms",
            "1000",
        ]);
    } else if never_share {
        args.extend(["--never-share", "victim"]);
    }
    let log = std::fs::File::create(dir.join("memfoldd.log"))?;
    let _daemon = Daemon(
        Command::new(daemon_bin)
            .args(&args)
            .arg("--socket")
            .arg(&socket)
            .stderr(log)
            .spawn()
            .with_context(|| format!("cannot start {}", daemon_bin.display()))?,
    );
    let probe = |role: &str, more: &str| {
        format!(
            "memfold.probe={role},{},{rounds},{},{}{more}",
            a.seed, a.per_round, a.pages
        )
    };
    let spec = |name: &str, args: String| GuestSpec {
        kernel_args: Some(args),
        ..GuestSpec::new(name, "tiny", a.mem_mib, RamBackend::Memfd)
    };
    let victim_spec = if by_process {
        GuestSpec {
            guest_channel: Some(channels.join("victim.sock")),
            ..spec(
                "victim",
                probe("victim", "") + " memfold.probe-never-share=1",
            )
        }
    } else {
        spec("victim", probe("victim", ""))
    };
    let wait_ms = (a.wait_secs * 1e3) as u64;
    let attacker_spec = spec(
        "attacker",
        probe(
            "attacker",
            &format!(",{},{wait_ms},{}", a.controls, (a.settle_secs * 1e3) as u64),
        ),
    );
    let mut victim = Guest::start_with_env(
        &victim_spec,
        cache,
        dir,
        accel,
        &agent_env(agent, &socket, &victim_spec),
    )?;
    wait_for(
        &mut victim,
        "MEMFOLD-PROBE-VICTIM-READY",
        Duration::from_secs(180),
    )?;
    eprintln!("victim ready after {:.1} s", t0.elapsed().as_secs_f64());
    if by_process {
        // The attacker starts once memfoldd has the marks: at least as many pages marked
        // as the victim holds secret pages (a count; the accuracy is the proof).
        let want = (rounds * a.per_round * a.pages) as u64;
        let t = Instant::now();
        loop {
            let marked = victim_marked(&socket);
            if marked >= want {
                eprintln!("victim's process marked: {marked} pages never-share");
                break;
            }
            victim.check_alive()?;
            if t.elapsed() > Duration::from_secs(120) {
                bail!("the victim's {want} secret pages were never reported marked ({marked})");
            }
            std::thread::sleep(Duration::from_millis(500));
        }
    }
    let mut attacker = Guest::start_with_env(
        &attacker_spec,
        cache,
        dir,
        accel,
        &agent_env(agent, &socket, &attacker_spec),
    )?;
    let budget =
        Duration::from_secs_f64(180.0 + a.settle_secs + rounds as f64 * (a.wait_secs + 30.0));
    wait_for(&mut attacker, "MEMFOLD-PROBE-DONE", budget)?;
    let stats = memfold_live::query_stats(&socket)
        .with_context(|| format!("memfoldd at {}", socket.display()))?;
    let names: Vec<&str> = stats.vms.iter().map(|v| v.name.as_str()).collect();
    for n in ["victim", "attacker"] {
        if !names.contains(&n) {
            bail!(
                "{n} never attached to memfoldd (attached: {names:?}; log {})",
                dir.join("memfoldd.log").display()
            );
        }
    }
    let att = stats
        .vms
        .iter()
        .find(|v| v.name == "attacker")
        .expect("checked above");
    let obs = parse(&victim.serial(), &attacker.serial())?;
    let s = Side {
        never_share,
        protect: never_share.then_some(a.protect),
        victim_never_share_pages: victim_marked(&socket),
        score: score(&obs),
        domains: stats.domains,
        attacker_shared_pages: att.shared_pages,
        attacker_cow_breaks: att.cow_breaks,
        secs: t0.elapsed().as_secs_f64(),
    };
    std::fs::write(dir.join("victim.console"), victim.serial())?;
    std::fs::write(dir.join("attacker.console"), attacker.serial())?;
    victim.stop();
    attacker.stop();
    Ok(s)
}

/// The victim's pages marked never-share in its guest's last report (0 without one).
fn victim_marked(socket: &Path) -> u64 {
    memfold_live::query_stats(socket)
        .ok()
        .and_then(|s| s.vms.into_iter().find(|v| v.name == "victim"))
        .and_then(|v| v.guest_pages)
        .map_or(0, |g| g.never_share)
}

/// Waits until `g`'s console says `marker`.
fn wait_for(g: &mut Guest, marker: &str, within: Duration) -> Result<()> {
    let t = Instant::now();
    loop {
        let s = g.serial();
        if s.contains(marker) {
            return Ok(());
        }
        if let Some(l) = s.lines().find(|l| l.starts_with("MEMFOLD-PROBE-FAILED")) {
            bail!("{}: {l}", g.name);
        }
        g.check_alive()?;
        if t.elapsed() > within {
            bail!("{}: no {marker} within {} s", g.name, within.as_secs());
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}
