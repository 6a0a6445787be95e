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
    /// Have memfoldd serve Prometheus metrics at this loopback address (memfoldd's
    /// --metrics-listen), e.g. 127.0.0.1:9464.
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<std::net::SocketAddr>,
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
    /// With `--compress-backing zswap`: zswap's compressor for memfold's backing, e.g.
    /// `lzo-rle` (default: the first the kernel takes of zstd, deflate, lz4, lzo-rle,
    /// lzo, as the kit's). A faster one costs less CPU at each page-out and swap-in and
    /// keeps the pages larger (docs/peer.md, "A zswap backing").
    #[arg(long, value_name = "NAME")]
    pub backing_compressor: Option<String>,
    /// Give each managed guest a virtio balloon with free page reporting (never
    /// inflated): the guest reports free 2 MiB blocks, QEMU discards them from its RAM,
    /// and memfold's agent lets go of whatever it held there (shared, zero, stored
    /// pages). Checked per guest, as for the kit's `--peer ksm+zswap+fpr`.
    #[arg(long)]
    pub free_page_reporting: bool,
    /// Give each guest a read-only data disk of this many MiB of random bytes (one file,
    /// `data-disk.img` in the output folder, read by all): the `tiny` image reads it whole
    /// over and over through its page cache and reports `cache-MiB/s` per pass — a
    /// workload whose speed depends on the memory the guest has (docs/entitlements.md).
    #[arg(long, value_name = "MIB", value_parser = clap::value_parser!(u64).range(1..))]
    pub data_disk_mib: Option<u64>,
    /// The data disk's read speed, MiB/s (QEMU's throttle: the disk the page cache
    /// saves reads from); 0: as fast as the host's copy of the file.
    #[arg(
        long,
        value_name = "MIBPS",
        default_value_t = 64,
        requires = "data_disk_mib"
    )]
    pub data_disk_mibps: u64,
    /// With a data disk: each guest (`tiny` image) drops its page cache after every pass
    /// over the disk and waits SECS before the next, so the page-cache duplicates between
    /// guests live only seconds (Satori §6.1's short-lived sharing).
    #[arg(long, value_name = "SECS", requires = "data_disk_mib")]
    pub data_disk_drop: Option<u64>,
    /// With a data disk: each guest (`tiny` image) checksums every pass over the disk,
    /// and a pass that read other bytes than its first is a self-check mismatch (the run
    /// fails): reads landing on shared, stored and swapped pages checked byte for byte.
    #[arg(long, requires = "data_disk_mib")]
    pub data_disk_verify: bool,
    /// Make guest GUEST (a name like `tiny-3`; the `tiny` image only) a sharing breaker:
    /// at SECS of its uptime it writes fresh bytes over all its duplicate pages, breaking
    /// its sharing — its entitlement falls and its balloon inflates to repay (Satori
    /// §4.3), while guests that share nothing with it should see no change.
    #[arg(long, value_name = "GUEST@SECS", value_parser = parse_guest_at)]
    pub break_sharing: Option<(String, u64)>,
    /// Make guest GUEST (the `tiny` image only) drop its page cache at SECS of its uptime
    /// (`drop_caches`), freeing pages that may be shared: with --free-page-reporting they
    /// are discarded and memfold drops them instead of copying them at their next write
    /// (no-copy-on-write, Satori §4.3; the run counts the copies avoided).
    #[arg(long, value_name = "GUEST@SECS", value_parser = parse_guest_at)]
    pub drop_caches: Option<(String, u64)>,
    /// Who serves the guests' disks (the profile images' root disks and the data disk):
    /// `memfold` — memfold-blk, memfold's sharing-aware block device (Satori §4.1), one
    /// process per disk, reporting every page a read fills so memfoldd shares it at once,
    /// the root disk a qcow2 overlay per guest over the shared image; `virtio` — QEMU's
    /// own virtio-blk (a throw-away overlay), found only by the scan. KSM's side of a
    /// comparison always runs on QEMU's own disks.
    #[arg(long, value_enum, default_value_t = DiskBackend::Memfold)]
    pub disk: DiskBackend,
    /// Every SECS seconds, take a census of the guests' memory by content: the sharing
    /// potential (non-zero duplicates) and how much of it is captured (Satori §6.1),
    /// into run.json. Costs memfoldd one read of all guest memory per census.
    #[arg(long, value_name = "SECS", value_parser = clap::value_parser!(u64).range(1..))]
    pub census: Option<u64>,
    /// Run the managed guests enlightened (issue 17, docs/enlightened.md): each gets a
    /// virtio-serial port `org.memfold.guest.0` on a socket in `OUT/channels`, and
    /// memfoldd (`--guest-channels`) asks memfold-guest inside it (every built-in image
    /// starts it at boot) for its pages' categories: the live view and the summary show them,
    /// and with `--guest-categories on` (the default) the scan uses them.
    #[arg(long)]
    pub enlightened: bool,
    /// With `--enlightened`: how often memfoldd asks each guest for its categories, ms
    /// (memfoldd's `--guest-interval-ms`; default: memfoldd's). Each report costs the
    /// guest a read of its kernel's flags word per frame (and of the map count where the
    /// flags leave the category open) and their transfer (docs/enlightened.md).
    #[arg(long, value_name = "MS", requires = "enlightened")]
    pub guest_interval_ms: Option<u64>,
    /// How each managed guest's agent takes the NRU clock's R bits (`MEMFOLD_CLOCK_RBITS`
    /// in its QEMU's environment; docs/peer.md, "R bits from the page tables"):
    /// `userfault`, a minor userfault through the agent per used page per pass; `pagemap`,
    /// the kernel's own minor fault, read back with `PAGEMAP_SCAN` (Linux 6.7+; the agent
    /// falls back to `userfault` without it). `pagemap` no longer catches writes into
    /// guest RAM's memfd that bypass QEMU's mapping (docs/security.md); it is the default
    /// here because this command starts the guests itself, and nothing but QEMU (and
    /// memfold-blk, through QEMU's page tables) writes their RAM. An agent whose
    /// environment says nothing (`memfold qemu`, libvirt) takes `userfault`.
    #[arg(long, value_enum, default_value_t = ClockRBits::Pagemap)]
    pub clock_rbits: ClockRBits,
}

/// The agent's ways of taking R bits (`memfold_agent::ClockRBits`), as flags name them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum ClockRBits {
    /// A minor userfault per used page per pass.
    Userfault,
    /// The kernel's minor fault, read back from the page tables.
    Pagemap,
}

impl ClockRBits {
    /// The agent's `MEMFOLD_CLOCK_RBITS` value.
    pub fn env_value(self) -> &'static str {
        match self {
            ClockRBits::Userfault => "userfault",
            ClockRBits::Pagemap => "pagemap",
        }
    }
}

impl MemfoldArgs {
    /// The guest kernel arguments of guest `name` (`--break-sharing`, `--drop-caches`,
    /// `--data-disk-drop`, `--data-disk-verify`).
    pub fn kernel_args_of(&self, name: &str) -> Option<String> {
        let args: Vec<String> = [
            ("memfold.break_at", &self.break_sharing),
            ("memfold.drop_caches_at", &self.drop_caches),
        ]
        .into_iter()
        .filter_map(|(k, v)| {
            v.as_ref()
                .filter(|(g, _)| g == name)
                .map(|(_, secs)| format!("{k}={secs}"))
        })
        .chain(
            self.data_disk_drop
                .map(|s| format!("memfold.data_drop={s}")),
        )
        .chain(
            self.data_disk_verify
                .then(|| "memfold.data_verify=1".to_string()),
        )
        .collect();
        (!args.is_empty()).then(|| args.join(" "))
    }

    /// The guests named by `--break-sharing` and `--drop-caches`.
    pub fn named_guests(&self) -> impl Iterator<Item = &str> {
        [&self.break_sharing, &self.drop_caches]
            .into_iter()
            .flatten()
            .map(|(g, _)| g.as_str())
    }
}

/// Who serves a managed guest's disks (`--disk`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum DiskBackend {
    /// QEMU's own virtio-blk.
    Virtio,
    /// memfold-blk (vhost-user-blk), sharing at read.
    Memfold,
}

impl MemfoldArgs {
    /// The memfold-blk disks of a guest of profile `profile` with a data disk or not
    /// (`--disk memfold`), reporting what reads land to memfoldd at `socket` if given
    /// (managed guests; their plain twins get the same device, silent). `None` with
    /// `--disk virtio`, or for a guest with no disk (`tiny` without a data disk).
    ///
    /// Errors: no such profile.
    pub fn blk_disks(
        &self,
        profile: &str,
        data_disk: bool,
        socket: Option<&Path>,
    ) -> anyhow::Result<Option<memfold_vm::launcher::BlkDisks>> {
        let p = memfold_vm::images::profile(profile).map_err(|e| anyhow::anyhow!("{e}"))?;
        let root = p.release.is_some();
        Ok(
            (self.disk == DiskBackend::Memfold && (root || data_disk)).then(|| {
                memfold_vm::launcher::BlkDisks {
                    data: data_disk,
                    root,
                    landed_socket: socket.map(Path::to_path_buf),
                    ..Default::default()
                }
            }),
        )
    }
}

/// The folder of the enlightened guests' channel sockets (`--enlightened`): `channels`
/// beside memfoldd's socket.
pub fn channels_dir(socket: &Path) -> std::path::PathBuf {
    socket.with_file_name("channels")
}

/// `GUEST@SECS` of `--break-sharing` and `--drop-caches`.
fn parse_guest_at(s: &str) -> Result<(String, u64), String> {
    let (g, secs) = s
        .rsplit_once('@')
        .ok_or_else(|| format!("{s:?}: expected GUEST@SECS, e.g. tiny-3@120"))?;
    let secs = secs
        .parse()
        .map_err(|_| format!("{s:?}: SECS {secs:?} is not a whole number of seconds"))?;
    Ok((g.to_string(), secs))
}

impl MemfoldArgs {
    /// The data disk asked for, with its file written (or kept, when already of the size
    /// asked) as `out/data-disk.img`: random bytes, so that nothing but sharing between
    /// the guests' page caches can fold it. `None` without `--data-disk-mib`.
    pub fn data_disk(&self, out: &Path) -> anyhow::Result<Option<memfold_vm::launcher::DataDisk>> {
        let Some(mib) = self.data_disk_mib else {
            return Ok(None);
        };
        Ok(Some(memfold_vm::launcher::DataDisk {
            path: crate::bench::data_file(out, mib)?,
            read_bytes_per_sec: (self.data_disk_mibps > 0).then_some(self.data_disk_mibps << 20),
        }))
    }

    /// memfoldd's command line for this run (after the program name): the socket, no
    /// configuration file (a run does not take the host's /etc/memfold/memfoldd.toml),
    /// every engine setting explicitly ([`EngineArgs::to_args`]) and, with a host budget,
    /// `out` as the folder of the guests' swap files.
    pub fn memfoldd_args(&self, socket: &Path, out: &Path) -> Vec<OsString> {
        let mut v: Vec<OsString> = vec![
            "--socket".into(),
            socket.into(),
            "--config".into(),
            "none".into(),
        ];
        v.extend(self.engine.to_args());
        if self.enlightened {
            v.push("--guest-channels".into());
            v.push(channels_dir(socket).into());
            if let Some(ms) = self.guest_interval_ms {
                v.push("--guest-interval-ms".into());
                v.push(ms.to_string().into());
            }
        }
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
            metrics_listen: None,
        }
    }

    /// The plain twins asked for (`None`: without `--plain-twins`).
    pub fn twins(&self) -> Option<Twins> {
        self.plain_twins.then_some(Twins {
            plain_first: self.plain_first,
        })
    }
}

/// Plain twins (`--plain-twins` of `memfold run` and `memfold compare`): every profile of a
/// set booted twice, one guest managed (by memfold, or by the kernel's kit) and one plain
/// beside it, so that each workload's throughput can be compared over the same seconds on
/// the same host.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Twins {
    /// The plain twin of each pair boots first (the managed one second), to tell an order
    /// effect from the manager's.
    pub plain_first: bool,
}

impl Twins {
    /// `set` with every profile twice (`web,db` → `web,web,db,db`: web-1 and its twin
    /// web-2, ...).
    pub fn set(&self, set: &guests::GuestSetArgs) -> guests::GuestSetArgs {
        let mut set = set.clone();
        set.profiles = set
            .profiles
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .flat_map(|p| [p, p])
            .collect::<Vec<_>>()
            .join(",");
        set
    }

    /// Whether the guest `name` of [`Twins::set`] is the managed one of its pair: the
    /// odd-numbered ones (the even ones with [`Twins::plain_first`]).
    pub fn is_managed(&self, name: &str) -> bool {
        name.rsplit('-')
            .next()
            .and_then(|n| n.parse::<u32>().ok())
            .is_some_and(|n| (n % 2 == 1) != self.plain_first)
    }

    /// The set to boot with `twins` or without (`None`: `set` as it is).
    pub fn set_of(twins: Option<Twins>, set: &guests::GuestSetArgs) -> guests::GuestSetArgs {
        twins.map_or_else(|| set.clone(), |t| t.set(set))
    }

    /// Whether `name` is managed with `twins` or without (`None`: every guest is).
    pub fn manages(twins: Option<Twins>, name: &str) -> bool {
        twins.is_none_or(|t| t.is_managed(name))
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
    fn a_backing_compressor_needs_the_zswap_backing() {
        let out = Path::new("/nonexistent");
        let m = parse(&["--backing-compressor", "lzo-rle"]);
        let e = super::super::kernel_swap(&m, out).err().expect("refused");
        assert!(e.to_string().contains("--compress-backing zswap"), "{e}");
        assert!(super::super::kernel_swap(&parse(&[]), out)
            .unwrap()
            .is_none());
    }

    #[test]
    fn an_enlightened_run_gives_memfoldd_the_channels_folder_beside_its_socket() {
        let plain =
            strings(parse(&[]).memfoldd_args(Path::new("/o/memfoldd.sock"), Path::new("/o")));
        assert!(!plain.iter().any(|s| s == "--guest-channels"));
        assert!(plain.windows(2).any(|w| w == ["--guest-categories", "on"]));
        let a = parse(&["--enlightened", "--guest-categories", "off"]);
        let v = strings(a.memfoldd_args(Path::new("/o/memfoldd.sock"), Path::new("/o")));
        assert!(v
            .windows(2)
            .any(|w| w == ["--guest-channels", "/o/channels"]));
        assert!(v.windows(2).any(|w| w == ["--guest-categories", "off"]));
        assert!(
            !v.iter().any(|s| s == "--guest-interval-ms"),
            "memfoldd's own"
        );
        let a = parse(&["--enlightened", "--guest-interval-ms", "10000"]);
        let v = strings(a.memfoldd_args(Path::new("/o/memfoldd.sock"), Path::new("/o")));
        assert!(v.windows(2).any(|w| w == ["--guest-interval-ms", "10000"]));
    }

    #[test]
    fn memfoldd_gets_the_socket_every_engine_setting_and_the_swap_folder() {
        let a = parse(&[]);
        let v = strings(a.memfoldd_args(Path::new("/o/memfoldd.sock"), Path::new("/o")));
        assert_eq!(
            &v[..4],
            ["--socket", "/o/memfoldd.sock", "--config", "none"]
        );
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
    fn a_breaker_is_a_guest_and_a_second_and_a_data_disk_its_size_and_speed() {
        let a = parse(&["--break-sharing", "tiny-3@120", "--data-disk-mib", "128"]);
        assert_eq!(a.break_sharing, Some(("tiny-3".to_string(), 120)));
        assert_eq!((a.data_disk_mib, a.data_disk_mibps), (Some(128), 64));
        assert_eq!(
            a.kernel_args_of("tiny-3").as_deref(),
            Some("memfold.break_at=120")
        );
        assert_eq!(a.kernel_args_of("tiny-1"), None);
        let b = parse(&[
            "--break-sharing",
            "tiny-1@90",
            "--drop-caches",
            "tiny-1@100",
        ]);
        assert_eq!(
            b.kernel_args_of("tiny-1").as_deref(),
            Some("memfold.break_at=90 memfold.drop_caches_at=100")
        );
        // A churning page cache is every guest's.
        let c = parse(&["--data-disk-mib", "64", "--data-disk-drop", "2"]);
        assert_eq!(
            c.kernel_args_of("tiny-2").as_deref(),
            Some("memfold.data_drop=2")
        );
        let c = parse(&["--data-disk-mib", "8", "--data-disk-verify"]);
        assert_eq!(
            c.kernel_args_of("tiny-1").as_deref(),
            Some("memfold.data_verify=1")
        );
        for bad in ["tiny-3", "tiny-3@soon", "tiny-3@-1"] {
            let e = parse_guest_at(bad).unwrap_err();
            assert!(e.contains(bad), "{e}");
        }
        // A throttle without a disk is a mistake, said so.
        assert!(Cli::try_parse_from(["memfold-run", "--data-disk-mibps", "10"]).is_err());
    }

    #[test]
    fn plain_twins_double_the_set_and_alternate_management() {
        let a = parse_run(&["--profiles", "web, db", "--plain-twins"]);
        let t = a.twins();
        assert_eq!(t, Some(Twins { plain_first: false }));
        assert_eq!(Twins::set_of(t, &a.memfold.set).profiles, "web,web,db,db");
        assert!(Twins::manages(t, "web-1") && !Twins::manages(t, "web-2"));
        assert!(Twins::manages(t, "py-trixie-3") && !Twins::manages(t, "py-trixie-4"));
        let b = parse_run(&["--plain-twins", "--plain-first"]).twins();
        assert!(!Twins::manages(b, "web-1") && Twins::manages(b, "web-2"));
        let c = parse_run(&["--profiles", "web,db"]);
        assert_eq!(c.twins(), None);
        assert_eq!(Twins::set_of(None, &c.memfold.set).profiles, "web,db");
        assert!(Twins::manages(None, "web-1") && Twins::manages(None, "db-2"));
    }
}
