//! Booting a set of guests for a command, with progress on stderr.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::Args;
use memfold_vm::images;
use memfold_vm::launcher::{detect_accel, Accel, Guest, GuestSpec, RamBackend};

use crate::run::Twins;

/// The guest set of a command that boots guests and measures them.
#[derive(Args, Clone, Debug)]
pub struct GuestSetArgs {
    /// Guest profiles, comma-separated (repeat a profile for several guests).
    #[arg(long, default_value = "web,web,db,py-trixie")]
    pub profiles: String,
    /// Seconds to let the guests run their workloads after they are ready, before measuring.
    #[arg(long, default_value_t = 30)]
    pub settle: u64,
    /// RAM per guest, MiB (default: the profile's).
    #[arg(long)]
    pub mem_mib: Option<u32>,
    /// Output folder.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the result as JSON.
    #[arg(long)]
    pub json: bool,
}

impl GuestSetArgs {
    /// The output folder: `--out`, or `out/<default_out>`.
    pub fn out_dir(&self, default_out: &str) -> PathBuf {
        self.out
            .clone()
            .unwrap_or_else(|| crate::default_out(default_out))
    }
}

/// Parses `web,db,py` (a profile may repeat: `web,web`) into guest specs named
/// `web-1`, `web-2`, `db-1`, ...
pub fn specs(profiles: &str, ram: RamBackend, mem_mib: Option<u32>) -> Result<Vec<GuestSpec>> {
    let mut out: Vec<GuestSpec> = Vec::new();
    for p in profiles.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let prof = images::profile(p)?;
        let n = out.iter().filter(|s| s.profile == p).count() + 1;
        out.push(GuestSpec::new(
            &format!("{p}-{n}"),
            p,
            mem_mib.unwrap_or(prof.mem_mib),
            ram,
        ));
    }
    anyhow::ensure!(!out.is_empty(), "no guest profile given");
    Ok(out)
}

/// Builds any missing image of `specs`, printing the build steps.
pub fn ensure_images(cache: &Path, specs: &[GuestSpec]) -> Result<()> {
    let mut names: Vec<&str> = specs.iter().map(|s| s.profile.as_str()).collect();
    names.push("tiny"); // the KVM probe boots it
    names.sort();
    names.dedup();
    for n in names {
        images::build(cache, n, |line| {
            eprintln!("  [{n}] {}", line.trim_start_matches("== step: "))
        })?;
    }
    Ok(())
}

/// A work folder for one command run under `out`.
pub fn workdir(out: &Path) -> Result<PathBuf> {
    let d = out.join("vm");
    std::fs::create_dir_all(&d).with_context(|| format!("cannot create {}", d.display()))?;
    Ok(d)
}

/// The whole start of a measuring command: the set's specs, its images (built if
/// missing), every guest booted and ready, then `settle` seconds of workload. Returns the
/// guests, the acceleration used and the output folder.
pub fn start_set(
    set: &GuestSetArgs,
    ram: RamBackend,
    default_out: &str,
) -> Result<(Vec<Guest>, Accel, PathBuf)> {
    start_set_with(set, ram, default_out, |_| Vec::new())
}

/// [`start_set`] with a QEMU environment per guest (memfold's agent).
pub fn start_set_with(
    set: &GuestSetArgs,
    ram: RamBackend,
    default_out: &str,
    env: impl Fn(&GuestSpec) -> Vec<(String, String)>,
) -> Result<(Vec<Guest>, Accel, PathBuf)> {
    start_set_in(set, ram, default_out, |_| {}, env)
}

/// [`start_set_with`], each guest's spec first changed by `adjust` (the kernel-kit peer
/// puts its QEMUs in a memory cgroup, gives them a balloon, ...).
pub fn start_set_in(
    set: &GuestSetArgs,
    ram: RamBackend,
    default_out: &str,
    adjust: impl Fn(&mut GuestSpec),
    env: impl Fn(&GuestSpec) -> Vec<(String, String)>,
) -> Result<(Vec<Guest>, Accel, PathBuf)> {
    let out = set.out_dir(default_out);
    let cache = images::cache_dir();
    let mut specs = specs(&set.profiles, ram, set.mem_mib)?;
    for s in &mut specs {
        adjust(s);
    }
    eprintln!("images ({}):", cache.display());
    ensure_images(&cache, &specs)?;
    let (guests, accel) = boot(
        &cache,
        &specs,
        &workdir(&out)?,
        Duration::from_secs(600),
        env,
    )?;
    eprintln!("settling {} s", set.settle);
    std::thread::sleep(Duration::from_secs(set.settle));
    Ok((guests, accel, out))
}

/// The start of a side of `memfold run` or `compare`, with plain twins or without: boots
/// `set` (with `twins`, every profile twice, [`Twins::set`]), each spec changed by
/// `adjust(spec, managed)` and each managed guest's QEMU given the environment
/// `managed_env` (memfold's agent; the plain twins get none), lets them settle, and pins
/// each pair of twins to one host CPU (equal shares; the manager's CPU in the managed
/// QEMU is then time its vCPU did not get — unpinned, the scheduler gave managed QEMUs
/// 30-45% more). Returns the managed guests, their plain twins (empty without twins, else
/// in the same order) and the output folder.
///
/// Errors: as [`start_set`], or a pair cannot be pinned.
pub fn start_pairs(
    set: &GuestSetArgs,
    twins: Option<Twins>,
    ram: RamBackend,
    default_out: &str,
    adjust: impl Fn(&mut GuestSpec, bool),
    managed_env: impl Fn(&GuestSpec) -> Vec<(String, String)>,
) -> Result<(Vec<Guest>, Vec<Guest>, PathBuf)> {
    let managed = |name: &str| Twins::manages(twins, name);
    let (all, _accel, out) = start_set_in(
        &Twins::set_of(twins, set),
        ram,
        default_out,
        |s| adjust(s, managed(&s.name)),
        |s| {
            if managed(&s.name) {
                managed_env(s)
            } else {
                Vec::new()
            }
        },
    )?;
    let (guests, plain): (Vec<Guest>, Vec<Guest>) = all.into_iter().partition(|g| managed(&g.name));
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    for (i, (m, p)) in guests.iter().zip(&plain).enumerate() {
        for g in [m, p] {
            g.pin_to_cpu(i % cpus)
                .with_context(|| format!("cannot pin {} to CPU {}", g.name, i % cpus))?;
        }
    }
    Ok((guests, plain, out))
}

/// Starts every guest (with the QEMU environment `env` gives it, e.g. memfold's agent) and
/// waits until all are ready (`timeout` each, from its start).
pub fn boot(
    cache: &Path,
    specs: &[GuestSpec],
    work: &Path,
    timeout: Duration,
    env: impl Fn(&GuestSpec) -> Vec<(String, String)>,
) -> Result<(Vec<Guest>, Accel)> {
    let accel = detect_accel(cache);
    eprintln!("booting {} guest(s) under {accel:?}", specs.len());
    let mut guests = Vec::new();
    for s in specs {
        guests.push(Guest::start_with_env(s, cache, work, accel, &env(s))?);
    }
    for g in &mut guests {
        let t = g.wait_ready(timeout)?;
        eprintln!("  {} ready after {:.1} s", g.name, t.as_secs_f64());
    }
    Ok((guests, accel))
}
