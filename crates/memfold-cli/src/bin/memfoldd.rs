//! memfoldd: the memfold daemon. Guests attach through the agent preloaded into QEMU;
//! memfoldd runs the engine over them: sharing, zero pages, the Difference Engine's
//! patching and compression of cold pages, and swap over a host budget.
//!
//! Settings: the command line over the configuration file (`--config`, by default
//! `/etc/memfold/memfoldd.toml` if it exists; every flag is a key there) over the
//! built-in defaults. SIGTERM or SIGINT stops it cleanly (exit 0): the guests keep
//! running, their agents keep their data and re-attach to the next memfoldd. Under
//! systemd (`Type=notify`) it reports `READY=1` once its socket accepts connections.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use clap::Parser;
use memfold_cli::config_file::{parse_layered, LayeredError, Source};
use memfold_cli::engine_args::EngineArgs;
use memfold_cli::logging;
use memfold_live::daemon::{refuse_if_running, serve, DaemonConfig};
use memfold_live::metrics::MetricsServer;

/// The configuration file read when `--config` is not given (if it exists).
const DEFAULT_CONFIG: &str = "/etc/memfold/memfoldd.toml";

/// memfoldd: saves the host memory of running QEMU guests (see `memfold run`).
#[derive(Parser, Debug)]
#[command(name = "memfoldd", version)]
struct Args {
    /// Configuration file (TOML; every other flag is a key, e.g. `rate = 500`); the
    /// command line wins over it. `none`: no file. Default: /etc/memfold/memfoldd.toml if
    /// it exists.
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Socket for agents and clients.
    #[arg(long, default_value = memfold_cli::DEFAULT_SOCKET)]
    socket: PathBuf,
    /// The engine's settings.
    #[command(flatten)]
    engine: EngineArgs,
    /// Folder for the guests' swap files (with --host-budget-mib): one per guest, unnamed
    /// (`O_TMPFILE`, mode 0600). It belongs on a disk: on tmpfs, swapped pages would still
    /// be host memory.
    #[arg(long, default_value = "/var/tmp")]
    swap_dir: PathBuf,
    /// A group whose members' QEMUs may attach (the socket becomes mode 0660, that
    /// group's): QEMUs run as a user per tenant, each user its own sharing domain under
    /// `--share-domains user`. They may attach and read statistics; only root and
    /// memfoldd's user may opt a guest out.
    #[arg(long, value_name = "GID")]
    agent_gid: Option<u32>,
    /// --agent-gid by name, read from the group database when memfoldd starts: e.g.
    /// `libvirt-qemu`, the group QEMU runs as under libvirt on Debian.
    #[arg(long, value_name = "GROUP", conflicts_with = "agent_gid")]
    agent_group: Option<String>,
    /// Guest RAM, GiB, that one tenant's guests (the QEMUs of one user other than root
    /// and memfoldd's own) may have attached together; a hello past it is refused.
    /// memfoldd books every page a guest has (~0.5% of guest RAM), and a sparse memfd
    /// costs its tenant nothing. Default: twice the host's RAM. Lowered below what a
    /// tenant has attached, its guests' re-attaches after a restart are refused (they
    /// then run unmanaged, their stashed pages written back).
    #[arg(long, value_name = "GIB")]
    tenant_max_gib: Option<u64>,
    /// Serve Prometheus metrics (`GET /metrics`) at this address, e.g. 127.0.0.1:9464
    /// (default: none). Loopback only unless --metrics-allow-remote. They name every
    /// guest with its size and counters, and any local user can read them (tenants'
    /// QEMUs too; memfoldd's own socket shows a tenant only its guests): on a host with
    /// tenants, leave it off or restrict the port to the scraper's user.
    #[arg(long, value_name = "ADDR")]
    metrics_listen: Option<std::net::SocketAddr>,
    /// Allow --metrics-listen on a non-loopback address (the metrics name every guest).
    #[arg(long, requires = "metrics_listen")]
    metrics_allow_remote: bool,
    /// Folder of enlightened guests' channel sockets (issue 17, docs/enlightened.md): for
    /// each attached guest named NAME with a socket DIR/NAME.sock (QEMU's chardev of the
    /// virtio-serial port org.memfold.guest.0), memfoldd asks memfold-guest inside it for
    /// its pages' categories. Default: none (no guest is asked).
    #[arg(long, value_name = "DIR")]
    guest_channels: Option<PathBuf>,
    /// How often each enlightened guest is asked for its pages' categories, ms.
    #[arg(long, default_value_t = 3000)]
    guest_interval_ms: u64,
    /// Raise the kernel's vm.max_map_count to at least N mappings when memfoldd starts
    /// (never lowers it; stops with an error if it cannot). Each run of guest pages mapped
    /// onto pool frames is a mapping (VMA) in QEMU: at the mixed set's density ~10 000 a
    /// GiB of guest RAM, so the default 65 530 stops a QEMU's mapped sharing near 6 GiB
    /// (past it, cold identical pages are still shared without a mapping; hot ones stay
    /// private). ~650 000 covers a 64 GiB guest, at ~200 bytes of kernel memory a mapping
    /// used. Running agents take the new limit within 10 s. Default: leave it.
    #[arg(long, value_name = "N")]
    max_map_count: Option<u64>,
    /// Log level: `error`, `warn`, `info`, `debug`, `trace`, or a tracing filter such as
    /// `info,memfold_live=debug`. Default: RUST_LOG if set, else `info`.
    #[arg(long, value_name = "LEVEL")]
    log: Option<String>,
}

/// The configuration file `args` asks for.
fn source(args: &Args) -> Source {
    Source::of(args.config.as_deref(), Path::new(DEFAULT_CONFIG))
}

/// Heap allocations from this size up are mapped on their own and given back when freed
/// (bytes): the engine's per-guest tables (similarity index, P2M, bitmaps, books' scratch
/// sets) are this big or more for guests of a few hundred MiB up, and are rebuilt or
/// regrown while memfoldd runs.
const MAP_ALLOCATIONS_FROM: usize = 256 * 1024;

fn main() {
    // Before anything allocates much: freed tables go back to the kernel, not into the
    // heap (docs/metadata.md, "memfoldd's resident set").
    memfold_sys::proc::map_large_allocations_from(MAP_ALLOCATIONS_FROM);
    let argv: Vec<OsString> = std::env::args_os().collect();
    let (a, file) = match parse_layered::<Args>(&argv, "config", source) {
        Ok(v) => v,
        Err(LayeredError::Cli(e)) => e.exit(),
        Err(e) => {
            eprintln!("memfoldd: {e}");
            std::process::exit(2);
        }
    };
    let filter = match logging::filter(a.log.as_deref()) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("memfoldd: {e}");
            std::process::exit(2);
        }
    };
    logging::init(logging::Style::detect(), filter);
    let engine = match a.engine.config() {
        Ok(c) => c,
        Err(e) => {
            tracing::error!("{e}");
            std::process::exit(2);
        }
    };
    // SIGTERM (systemctl stop) and SIGINT (Ctrl-C) set the flag the main loop polls.
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        if let Err(e) = signal_hook::flag::register(sig, Arc::clone(&stop)) {
            tracing::error!("cannot catch signal {sig}: {e}");
            std::process::exit(1);
        }
    }
    if let Some(dir) = a.socket.parent() {
        if let Err(e) = std::fs::create_dir_all(dir) {
            tracing::error!("socket folder {}: {e}", dir.display());
            std::process::exit(1);
        }
    }
    tracing::info!(
        "memfoldd {} starting: configuration {}, policy {}, rate {} pages/s, zero pages {}, sharing domains by {}{}{}",
        env!("CARGO_PKG_VERSION"),
        file.as_deref()
            .map_or("none (defaults and command line)".into(), |p| p.display().to_string()),
        a.engine.policy,
        a.engine.rate,
        a.engine.zero,
        a.engine.share_domains,
        if a.engine.never_share.is_empty() {
            String::new()
        } else {
            format!(", never-share {}", a.engine.never_share.join(","))
        },
        a.engine.host_budget_mib.map_or(String::new(), |b| format!(
            ", host budget {b} MiB, swap {} MiB in {}",
            a.engine.swap_mib,
            a.swap_dir.display()
        )),
    );
    // Beside a running memfoldd, refused before anything it holds is taken (its metrics
    // port); `serve` checks again as it binds.
    if let Err(e) = refuse_if_running(&a.socket) {
        tracing::error!("{e}");
        std::process::exit(1);
    }
    // Only a memfoldd that runs touches the host's limit.
    if let Some(n) = a.max_map_count {
        match raise_max_map_count(Path::new(memfold_sys::max_map_count::PATH), n) {
            Ok(said) => tracing::info!("{said}"),
            Err(e) => {
                tracing::error!("{e}");
                std::process::exit(1);
            }
        }
    }
    // The endpoint asks this memfoldd for its statistics over the socket, per scrape.
    let _metrics = match a.metrics_listen {
        Some(addr) => match MetricsServer::start(addr, a.metrics_allow_remote, a.socket.clone()) {
            Ok(m) => Some(m),
            Err(e) => {
                tracing::error!("{e}");
                std::process::exit(2);
            }
        },
        None => None,
    };
    let agent_gid = match (&a.agent_group, a.agent_gid) {
        (Some(name), _) => match group_id(name) {
            Ok(gid) => Some(gid),
            Err(e) => {
                tracing::error!("agent-group {name}: {e}");
                std::process::exit(2);
            }
        },
        (None, gid) => gid,
    };
    // Twice the host's RAM by default; no bound if /proc does not say what that is.
    let tenant_max_bytes = match (a.tenant_max_gib, memfold_sys::proc::host_ram_bytes()) {
        (Some(g), _) => g.saturating_mul(1 << 30),
        (None, 0) => u64::MAX,
        (None, host) => host.saturating_mul(2),
    };
    if agent_gid.is_some() {
        tracing::info!(
            "a tenant's guests hold at most {} of RAM together",
            if tenant_max_bytes == u64::MAX {
                "any amount".to_string()
            } else {
                format!("{} GiB", tenant_max_bytes >> 30)
            }
        );
    }
    let cfg = DaemonConfig {
        socket: a.socket,
        engine,
        swap_dir: a.swap_dir,
        swap_capacity: a.engine.swap_mib << 20,
        domains: a.engine.domain_rule(),
        never_share: a.engine.never_share(),
        agent_gid,
        claim: a.engine.claim(),
        allowance: a.engine.allowance_mib << 20,
        tenant_max_bytes,
        guest_channels: a.guest_channels.clone().map(|d| {
            (
                d,
                std::time::Duration::from_millis(a.guest_interval_ms.max(100)),
            )
        }),
    };
    let ready = || {
        // Without NOTIFY_SOCKET (not under systemd) this does nothing.
        if let Err(e) = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]) {
            tracing::warn!("sd_notify READY=1: {e}");
        }
    };
    let result = serve(cfg, &stop, ready);
    let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
    if let Err(e) = result {
        tracing::error!("{e}");
        std::process::exit(1);
    }
}

/// Raises `vm.max_map_count` (held in `path`) to at least `n` for `--max-map-count`: the
/// line to log of what was done.
///
/// Errors: the limit could not be read or raised; the message says what to do.
fn raise_max_map_count(path: &Path, n: u64) -> Result<String, String> {
    match memfold_sys::max_map_count::raise_at(path, n) {
        Ok(r) if r.now > r.was => Ok(format!(
            "vm.max_map_count raised from {} to {} (max-map-count, the operator's setting): \
             QEMUs may map that many runs of shared pages, less 4096 of their own",
            r.was, r.now
        )),
        Ok(r) => Ok(format!(
            "vm.max_map_count is {} already, at least max-map-count {n}: left as it is",
            r.now
        )),
        Err(e) => Err(format!(
            "max-map-count {n}: {e} (memfoldd must run as root, with /proc/sys writable, to \
             raise it: the packaged unit's ProtectKernelTunables=yes makes it read-only; or \
             set vm.max_map_count in /etc/sysctl.d/ and leave max-map-count out)"
        )),
    }
}

/// The id of the group named `name` (getgrnam_r: /etc/group, or NSS).
///
/// Errors: no such group, or the lookup failed.
fn group_id(name: &str) -> std::io::Result<u32> {
    let cname = std::ffi::CString::new(name)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidInput, "a NUL in the name"))?;
    let mut buf = vec![0u8; 16 << 10];
    // SAFETY: all-zero bytes are a valid `group` (null pointers, zero id), filled below.
    let mut grp: libc::group = unsafe { std::mem::zeroed() };
    let mut found: *mut libc::group = std::ptr::null_mut();
    // SAFETY: every pointer is to a live local of the right type and size; `buf`
    // outlives the call, and `grp`'s pointers into it are not used after.
    let rc = unsafe {
        libc::getgrnam_r(
            cname.as_ptr(),
            &mut grp,
            buf.as_mut_ptr().cast(),
            buf.len(),
            &mut found,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::from_raw_os_error(rc));
    }
    if found.is_null() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            "no such group",
        ));
    }
    Ok(grp.gr_gid)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;
    use memfold_cli::config_file::{file_args, valid_keys};

    /// The sample configuration shipped in the Debian package.
    fn sample() -> (PathBuf, String) {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../packaging/memfoldd.toml");
        let text = std::fs::read_to_string(&p).expect("packaging/memfoldd.toml");
        (p, text)
    }

    /// The sample with every `# key = value` line made live.
    fn uncommented(text: &str) -> String {
        text.lines()
            .filter_map(|l| {
                let l = l.strip_prefix('#')?.trim_start();
                let (k, _) = l.split_once('=')?;
                let k = k.trim();
                (!k.is_empty() && k.chars().all(|c| c.is_ascii_lowercase() || c == '-'))
                    .then(|| format!("{l}\n"))
            })
            .collect()
    }

    #[test]
    fn the_sample_configuration_parses_and_sets_every_flag() {
        let (path, text) = sample();
        let cmd = Args::command();
        assert_eq!(
            file_args(&cmd, &path, &text, &["config"]).unwrap(),
            Vec::<OsString>::new(),
            "as shipped, every key is commented out: the defaults hold"
        );
        let live = uncommented(&text);
        let table: toml::Table = toml::from_str(&live).expect("the commented keys are TOML");
        let mut keys: Vec<String> = table.keys().cloned().collect();
        keys.sort();
        assert_eq!(
            keys,
            valid_keys(&cmd, &["config"]),
            "packaging/memfoldd.toml must show every memfoldd flag as a commented `# key = value` line"
        );
        file_args(&cmd, &path, &live, &["config"]).expect("every sample value is valid");
        // Each key with a default shows that default.
        for arg in cmd.get_arguments() {
            let (Some(long), [default]) = (arg.get_long(), arg.get_default_values()) else {
                continue;
            };
            let shown = match &table[long] {
                toml::Value::String(s) => s.clone(),
                v => v.to_string(),
            };
            assert_eq!(
                shown,
                default.to_string_lossy(),
                "packaging/memfoldd.toml shows `{long}` other than its default"
            );
        }
    }

    #[test]
    fn agent_group_is_read_from_the_group_database() {
        assert_eq!(group_id("root").unwrap(), 0);
        let e = group_id("memfold-no-such-group").unwrap_err();
        assert_eq!(e.kind(), std::io::ErrorKind::NotFound, "{e}");
        // One or the other, not both.
        let argv: Vec<OsString> = [
            "memfoldd",
            "--config",
            "none",
            "--agent-gid",
            "5",
            "--agent-group",
            "kvm",
        ]
        .iter()
        .map(OsString::from)
        .collect();
        assert!(parse_layered::<Args>(&argv, "config", source).is_err());
    }

    #[test]
    fn max_map_count_raises_the_limit_never_lowers_it_and_stops_on_failure() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("max_map_count");
        std::fs::write(&f, "65530\n").unwrap();
        let said = raise_max_map_count(&f, 700_000).unwrap();
        assert!(said.contains("raised from 65530 to 700000"), "{said}");
        assert_eq!(std::fs::read_to_string(&f).unwrap().trim(), "700000");
        let said = raise_max_map_count(&f, 100_000).unwrap();
        assert!(said.contains("700000 already"), "{said}");
        assert_eq!(std::fs::read_to_string(&f).unwrap().trim(), "700000");
        let e = raise_max_map_count(&dir.path().join("absent"), 100_000).unwrap_err();
        assert!(e.contains("absent") && e.contains("root"), "{e}");
        // The flag parses from the file as from the command line.
        let conf = dir.path().join("memfoldd.toml");
        std::fs::write(&conf, "max-map-count = 650000\n").unwrap();
        let argv: Vec<OsString> = ["memfoldd", "--config", conf.to_str().unwrap()]
            .iter()
            .map(OsString::from)
            .collect();
        let (a, _) = parse_layered::<Args>(&argv, "config", source).unwrap();
        assert_eq!(a.max_map_count, Some(650_000));
    }

    /// memfoldd's arguments from the file `text` and the command line `extra`.
    fn layered(text: &str, extra: &[&str]) -> Result<Args, LayeredError> {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("memfoldd.toml");
        std::fs::write(&f, text).unwrap();
        let argv: Vec<OsString> = ["memfoldd", "--config", f.to_str().unwrap()]
            .iter()
            .chain(extra)
            .map(OsString::from)
            .collect();
        Ok(parse_layered::<Args>(&argv, "config", source)?.0)
    }

    #[test]
    fn a_key_may_require_another_key_of_the_file() {
        let a = layered(
            "metrics-listen = \"0.0.0.0:9464\"\nmetrics-allow-remote = true\n",
            &[],
        )
        .unwrap();
        assert!(a.metrics_allow_remote);
        assert_eq!(a.metrics_listen, Some("0.0.0.0:9464".parse().unwrap()));
    }

    #[test]
    fn a_flag_may_require_a_key_of_the_file() {
        let a = layered(
            "metrics-listen = \"0.0.0.0:9464\"\n",
            &["--metrics-allow-remote"],
        )
        .unwrap();
        assert!(a.metrics_allow_remote);
        // Neither gives it: the command line's own usage error.
        let e = layered("rate = 5\n", &["--metrics-allow-remote"]).unwrap_err();
        assert!(matches!(e, LayeredError::Cli(_)), "{e}");
    }

    #[test]
    fn a_requirement_the_file_leaves_unmet_is_an_error_naming_the_file() {
        let e = layered("metrics-allow-remote = true\n", &[]).unwrap_err();
        assert!(matches!(e, LayeredError::File(_)), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("memfoldd.toml: "), "{e}");
        assert!(e.contains("--metrics-listen"), "clap's whole message: {e}");
    }

    #[test]
    fn a_flag_replaces_the_key_it_conflicts_with() {
        let a = layered("agent-group = \"kvm\"\n", &["--agent-gid", "5"]).unwrap();
        assert_eq!((a.agent_gid, a.agent_group), (Some(5), None));
        // clap lists the conflict on one of the two flags only.
        let a = layered("agent-gid = 5\n", &["--agent-group", "kvm"]).unwrap();
        assert_eq!((a.agent_gid, a.agent_group.as_deref()), (None, Some("kvm")));
    }

    #[test]
    fn conflicting_keys_are_an_error_naming_the_file_and_the_lines() {
        let e = layered("agent-gid = 5\nagent-group = \"kvm\"\n", &[]).unwrap_err();
        assert!(matches!(e, LayeredError::File(_)), "{e:?}");
        let e = e.to_string();
        assert!(e.contains("memfoldd.toml:2: `agent-group`"), "{e}");
        assert!(e.contains("`agent-gid` (line 1)"), "{e}");
    }

    #[test]
    fn the_command_line_wins_over_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f = dir.path().join("memfoldd.toml");
        std::fs::write(&f, "rate = 500\npolicy = \"sharing\"\nlog = \"debug\"\n").unwrap();
        let argv = |extra: &[&str]| -> Vec<OsString> {
            ["memfoldd", "--config", f.to_str().unwrap()]
                .iter()
                .chain(extra)
                .map(OsString::from)
                .collect()
        };
        let (a, read) = parse_layered::<Args>(&argv(&["--rate", "7"]), "config", source).unwrap();
        assert_eq!(read.as_deref(), Some(f.as_path()));
        assert_eq!((a.engine.rate, a.engine.policy.as_str()), (7, "sharing"));
        assert_eq!(a.log.as_deref(), Some("debug"));
        let none: Vec<OsString> = ["memfoldd", "--config", "none"]
            .iter()
            .map(OsString::from)
            .collect();
        let (a, read) = parse_layered::<Args>(&none, "config", source).unwrap();
        assert_eq!(
            (read, a.engine.rate),
            (None, memfold_core::EngineConfig::default().rate)
        );
    }
}
