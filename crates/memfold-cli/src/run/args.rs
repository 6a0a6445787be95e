//! The arguments of `memfold run` and how they become memfoldd's command line.

use std::ffi::OsString;
use std::path::Path;

use clap::Args;
use memfold_cli::engine_args::EngineArgs;

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
    /// Kill memfoldd with SIGKILL every this many seconds and start it again (a soak of
    /// the crash-safety path: the agents serve their guests meanwhile and re-attach, the
    /// pools are adopted). These kills do not count against the restart limit; the run
    /// ends non-zero if a guest's self-check fails or memory is left unbooked.
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(5..))]
    pub kill_memfoldd_every: Option<u64>,
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
    /// The engine's settings (memfoldd's own flags and defaults).
    #[command(flatten)]
    pub engine: EngineArgs,
}

impl MemfoldArgs {
    /// memfoldd's command line for this run (after the program name): the socket and,
    /// with a host budget, `out` as the folder of the guests' swap files, then every engine
    /// setting explicitly ([`EngineArgs::to_args`]).
    pub fn memfoldd_args(&self, socket: &Path, out: &Path) -> Vec<OsString> {
        let mut v: Vec<OsString> = vec!["--socket".into(), socket.into()];
        v.extend(self.engine.to_args());
        if self.engine.host_budget_mib.is_some() {
            v.push("--swap-dir".into());
            v.push(out.into());
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
            kill_memfoldd_every: None,
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

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

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
    fn memfoldd_gets_the_socket_every_engine_setting_and_the_swap_folder() {
        let a = parse(&[]);
        let v = strings(a.memfoldd_args(Path::new("/o/memfoldd.sock"), Path::new("/o")));
        assert_eq!(&v[..2], ["--socket", "/o/memfoldd.sock"]);
        assert!(v.windows(2).any(|w| w == ["--policy", "de"]));
        assert!(v.windows(2).any(|w| w == ["--clock-secs", "4"]));
        assert!(!v.iter().any(|s| s == "--swap-dir"));
        assert!(v.windows(2).any(|w| w == ["--share-domains", "user"]));
        let b = parse(&["--policy", "sharing", "--host-budget-mib", "200"]);
        let v = strings(b.memfoldd_args(Path::new("s"), Path::new("/o")));
        assert!(v.ends_with(&[
            "--host-budget-mib".into(),
            "200".into(),
            "--swap-mib".into(),
            "1024".into(),
            "--swap-dir".into(),
            "/o".into()
        ]));
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
