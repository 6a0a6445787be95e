//! The arguments of `memfold run` and how they become memfoldd's command line.

use std::ffi::OsString;
use std::path::Path;

use clap::Args;
use memfold_live::daemon::ZeroPolicy;

use crate::guests;

/// Arguments of `memfold run`: what memfold runs on which guests, and the plain twins.
#[derive(Args, Clone, Debug)]
pub struct RunArgs {
    /// The guests, memfoldd's settings, how long.
    #[command(flatten)]
    pub memfold: MemfoldArgs,
    /// Boot beside each guest a twin of its profile that memfold does not manage (no
    /// agent) and report each workload's throughput, managed vs plain, over the same
    /// seconds on the same host (guest overhead, side by side); each pair is pinned to
    /// one host CPU. Memory figures count the managed guests only.
    #[arg(long)]
    pub plain_twins: bool,
    /// With --plain-twins: boot the plain twin of each pair first (the managed one
    /// second), to tell an order effect from memfold's.
    #[arg(long, requires = "plain_twins")]
    pub plain_first: bool,
}

/// The guests and memfoldd's settings of `memfold run` and of `memfold compare`'s memfold
/// side.
#[derive(Args, Clone, Debug)]
pub struct MemfoldArgs {
    /// The guests.
    #[command(flatten)]
    pub set: guests::GuestSetArgs,
    /// Seconds memfoldd runs before the command stops everything (0: until Ctrl-C).
    #[arg(long, default_value_t = 120)]
    pub secs: u64,
    /// memfoldd's scan rate, pages/s (0: full speed).
    #[arg(long, default_value_t = 0)]
    pub rate: u64,
    /// Zero pages: reclaim (punch out, refill on access), share (one zero frame, ESX) or
    /// keep (Satori §4.1).
    #[arg(long, value_enum, default_value_t = ZeroPolicy::Reclaim)]
    pub zero: ZeroPolicy,
    /// NRU clock (DE §4.2): seconds for its hand to pass over each guest once (R/M
    /// tracking by minor and write-protect faults); 0: off, unless the policy patches or
    /// compresses or --host-budget-mib is given (then 4 s, DE's rescan interval).
    #[arg(long, default_value_t = 0.0)]
    pub clock_secs: f64,
    /// Which mechanisms may touch pages of each NRU class (DE §4.2): `sharing` (what
    /// ESX and KSM do), `de` (the Difference Engine: sharing, patching, compression),
    /// `aggressive` (every page as C4), or one mechanism alone.
    #[arg(long, default_value = "de", value_parser = clap::builder::PossibleValuesParser::new(memfold_core::Policy::NAMES))]
    pub policy: String,
    /// Host memory budget for the guests' RAM, MiB (DE §4.6): over it, memfoldd swaps
    /// cold pages out to a swap file in the output folder (turns the clock on). Guests
    /// whose RAM together exceeds it keep running: overcommit.
    #[arg(long)]
    pub host_budget_mib: Option<u64>,
    /// Swap file capacity, MiB (with --host-budget-mib).
    #[arg(long, default_value_t = 1024)]
    pub swap_mib: u64,
    /// Page compressor for cold pages (DE §3.3): zstd (level 1), lz4, lzo or wkdm.
    #[arg(long, default_value = "zstd")]
    pub compress_codec: memfold_core::CompressCodec,
    /// Largest compressed page kept, bytes (DE §3.3's cut-off).
    #[arg(long, default_value_t = 2048)]
    pub compress_cutoff: usize,
    /// Largest patch kept, bytes (DE §3.2's cut-off).
    #[arg(long, default_value_t = 2048)]
    pub patch_cutoff: usize,
}

impl MemfoldArgs {
    /// The clock interval memfoldd gets, s: as given, or 4 s for a policy that needs it.
    pub fn clock_interval_s(&self) -> f64 {
        let needs = memfold_core::Policy::by_name(&self.policy).is_some_and(|p| p.needs_clock())
            || self.host_budget_mib.is_some();
        if self.clock_secs <= 0.0 && needs {
            4.0
        } else {
            self.clock_secs
        }
    }

    /// The zero policy's name, as memfoldd's `--zero` takes it.
    pub fn zero_name(&self) -> &'static str {
        zero_name(self.zero)
    }

    /// memfoldd's command line for this run (after the program name): the one place where
    /// `memfold run` (and `memfold compare`) turn their flags into memfoldd's. The socket
    /// and, with a host budget, the swap file (`memfoldd.swap`) are in `out`. Every
    /// setting is passed explicitly, so memfoldd's own defaults do not apply.
    pub fn memfoldd_args(&self, socket: &Path, out: &Path) -> Vec<OsString> {
        let mut v: Vec<OsString> = vec!["--socket".into(), socket.into()];
        let mut opt = |name: &str, value: String| {
            v.push(name.into());
            v.push(value.into());
        };
        opt("--rate", self.rate.to_string());
        opt("--zero", self.zero_name().into());
        opt(
            "--clock-interval-ms",
            ((self.clock_interval_s() * 1000.0) as u64).to_string(),
        );
        opt("--policy", self.policy.clone());
        opt("--compress-codec", self.compress_codec.name().into());
        opt("--compress-cutoff", self.compress_cutoff.to_string());
        opt("--patch-cutoff", self.patch_cutoff.to_string());
        if let Some(b) = self.host_budget_mib {
            opt("--host-budget-mib", b.to_string());
            opt("--swap-mib", self.swap_mib.to_string());
            v.push("--swap-file".into());
            v.push(out.join("memfoldd.swap").into());
        }
        v
    }
}

impl RunArgs {
    /// `memfold` on its guests, without plain twins.
    pub fn without_twins(memfold: MemfoldArgs) -> Self {
        RunArgs {
            memfold,
            plain_twins: false,
            plain_first: false,
        }
    }

    /// The guest set to boot: with `--plain-twins` every profile twice (`web,db` →
    /// `web,web,db,db`: web-1 and its twin web-2, ...).
    pub fn guest_set(&self) -> guests::GuestSetArgs {
        let mut set = self.memfold.set.clone();
        if self.plain_twins {
            set.profiles = set
                .profiles
                .split(',')
                .map(str::trim)
                .filter(|p| !p.is_empty())
                .flat_map(|p| [p, p])
                .collect::<Vec<_>>()
                .join(",");
        }
        set
    }

    /// Whether memfold manages the guest `name` of [`RunArgs::guest_set`]: without twins
    /// every guest; with them the odd-numbered ones (the even ones with `--plain-first`).
    pub fn is_managed(&self, name: &str) -> bool {
        !self.plain_twins
            || name
                .rsplit('-')
                .next()
                .and_then(|n| n.parse::<u32>().ok())
                .is_some_and(|n| (n % 2 == 1) != self.plain_first)
    }
}

/// A zero policy's name on the command line (`reclaim`, `share`, `keep`).
fn zero_name(z: ZeroPolicy) -> &'static str {
    match z {
        ZeroPolicy::Reclaim => "reclaim",
        ZeroPolicy::Share => "share",
        ZeroPolicy::Keep => "keep",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Parser, ValueEnum};

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        run: RunArgs,
    }

    fn parse_run(args: &[&str]) -> RunArgs {
        Cli::try_parse_from(std::iter::once("memfold-run").chain(args.iter().copied()))
            .expect("arguments parse")
            .run
    }

    fn parse(args: &[&str]) -> MemfoldArgs {
        parse_run(args).memfold
    }

    fn strings(v: Vec<OsString>) -> Vec<String> {
        v.into_iter()
            .map(|s| s.into_string().expect("utf-8"))
            .collect()
    }

    #[test]
    fn memfoldd_gets_every_setting_with_run_defaults() {
        let a = parse(&[]);
        assert_eq!(
            strings(a.memfoldd_args(Path::new("/o/memfoldd.sock"), Path::new("/o"))),
            [
                "--socket",
                "/o/memfoldd.sock",
                "--rate",
                "0",
                "--zero",
                "reclaim",
                "--clock-interval-ms",
                "4000",
                "--policy",
                "de",
                "--compress-codec",
                "zstd",
                "--compress-cutoff",
                "2048",
                "--patch-cutoff",
                "2048",
            ]
        );
    }

    #[test]
    fn sharing_runs_without_the_clock_unless_a_budget_needs_it() {
        let a = parse(&["--policy", "sharing", "--zero", "keep"]);
        assert_eq!(a.clock_interval_s(), 0.0);
        let v = strings(a.memfoldd_args(Path::new("s"), Path::new("/o")));
        assert!(v.windows(2).any(|w| w == ["--zero", "keep"]));
        assert!(!v.iter().any(|s| s == "--swap-file"));
        let b = parse(&["--policy", "sharing", "--host-budget-mib", "200"]);
        assert_eq!(b.clock_interval_s(), 4.0);
        let v = strings(b.memfoldd_args(Path::new("s"), Path::new("/o")));
        assert!(v.ends_with(&[
            "--host-budget-mib".into(),
            "200".into(),
            "--swap-mib".into(),
            "1024".into(),
            "--swap-file".into(),
            "/o/memfoldd.swap".into()
        ]));
        assert_eq!(parse(&["--clock-secs", "8"]).clock_interval_s(), 8.0);
    }

    #[test]
    fn zero_names_are_the_ones_clap_parses() {
        for z in ZeroPolicy::value_variants() {
            let parsed = ZeroPolicy::from_str(zero_name(*z), false).expect("a value name");
            assert_eq!(parsed, *z);
        }
    }

    #[test]
    fn plain_twins_double_the_set_and_alternate_management() {
        let a = parse_run(&["--profiles", "web, db", "--plain-twins"]);
        assert_eq!(a.guest_set().profiles, "web,web,db,db");
        assert!(a.is_managed("web-1") && !a.is_managed("web-2"));
        assert!(a.is_managed("py-trixie-3") && !a.is_managed("py-trixie-4"));
        let b = parse_run(&["--plain-twins", "--plain-first"]);
        assert!(!b.is_managed("web-1") && b.is_managed("web-2"));
        let c = parse_run(&["--profiles", "web,db"]);
        assert_eq!(c.guest_set().profiles, "web,db");
        assert!(c.is_managed("web-1") && c.is_managed("db-2"));
    }
}
