//! `memfold libvirt enable|disable DOMAIN`: puts a libvirt domain under memfold, or takes
//! it out, by editing its persistent XML through `virsh` (`dumpxml --inactive
//! --security-info`, then `define`). The edit itself is `memfold_cli::libvirt_xml`'s (a
//! pure function); this module runs virsh, checks the agent library is where libvirt's
//! QEMU can read it, and says what changed.

use std::io::Write;
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::Command;

use memfold_cli::install::{agent_library, AGENT_LIBRARY};
use memfold_cli::libvirt_xml::{self, Settings, XmlError};

/// Where `--claim`'s monitor socket goes by default (QEMU, as libvirt's user, creates it:
/// libvirt's own QEMU folder, `libvirt-qemu:kvm` on Debian).
const MONITOR_DIR: &str = "/var/lib/libvirt/qemu";

/// The size of a Unix socket address's path (`sun_path`, with its final NUL): a path of
/// this many bytes or more cannot be connected to (Rust's std refuses it).
const SUN_PATH: usize = 108;

/// `memfold libvirt`'s subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum LibvirtCmd {
    /// Put a domain under memfold: shared memfd guest RAM, memfold's agent in its QEMU's
    /// environment (and with --claim a QMP monitor for memfoldd's balloon claims). Edits
    /// the persistent definition; a running domain takes it at its next start.
    Enable(EnableArgs),
    /// Take a domain out of memfold: undoes exactly what `enable` changed.
    Disable(DisableArgs),
}

/// `memfold libvirt enable`'s arguments.
#[derive(clap::Args, Debug)]
pub struct EnableArgs {
    /// The domain (name, UUID or id, as virsh takes it).
    domain: String,
    /// libvirt's connection URI (virsh --connect), e.g. qemu:///system.
    #[arg(long, short = 'c', value_name = "URI")]
    connect: Option<String>,
    /// memfoldd's socket, as QEMU sees it.
    #[arg(long, default_value = "/run/memfold/memfoldd.sock")]
    socket: PathBuf,
    /// The agent library (default: `libmemfold_agent.so` beside this program, else in
    /// ../lib/memfold/ from there: /usr/lib/memfold/ for the Debian package).
    #[arg(long)]
    agent: Option<PathBuf>,
    /// Also give memfoldd a QMP monitor of the domain's QEMU (chardev id memfold-qmp), so
    /// its --claim-entitlement can drive the guest's virtio balloon (docs/entitlements.md).
    #[arg(long)]
    claim: bool,
    /// The monitor's socket with --claim (default:
    /// /var/lib/libvirt/qemu/memfold-qmp-DOMAIN.sock, the domain's UUID for DOMAIN when
    /// its name would make the path too long for a Unix socket).
    #[arg(long, requires = "claim", value_name = "PATH")]
    monitor_socket: Option<PathBuf>,
}

/// `memfold libvirt disable`'s arguments.
#[derive(clap::Args, Debug)]
pub struct DisableArgs {
    /// The domain (name, UUID or id, as virsh takes it).
    domain: String,
    /// libvirt's connection URI (virsh --connect).
    #[arg(long, short = 'c', value_name = "URI")]
    connect: Option<String>,
}

/// Why `memfold libvirt` did not change a domain.
#[derive(Debug, thiserror::Error)]
pub enum LibvirtError {
    /// virsh could not be run.
    #[error("cannot run virsh: {0} (Debian: apt install libvirt-clients)")]
    NoVirsh(std::io::Error),
    /// virsh ran and failed.
    #[error("virsh {args} failed ({status}): {stderr}")]
    Virsh {
        /// Its arguments.
        args: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// What it said.
        stderr: String,
    },
    /// The domain's XML cannot be edited.
    #[error("domain {domain}: {source}")]
    Xml {
        /// The domain as given.
        domain: String,
        /// Why.
        source: XmlError,
    },
    /// libvirt did not keep what was defined.
    #[error("domain {domain}: libvirt accepted the new definition but did not keep {what} (virsh dumpxml --inactive shows it without); nothing else was changed")]
    NotKept {
        /// The domain.
        domain: String,
        /// What is missing.
        what: &'static str,
    },
    /// No agent library found.
    #[error("the agent library {AGENT_LIBRARY} is neither beside {exe} nor in ../lib/memfold/ from there (install the memfold package, or pass --agent PATH)")]
    NoAgent {
        /// This program.
        exe: String,
    },
    /// `--agent` names no file.
    #[error("--agent {0}: no such file")]
    AgentMissing(PathBuf),
    /// A socket path a Unix socket cannot have.
    #[error("{flag} {path}: {len} bytes, but a Unix socket's path must be under {SUN_PATH} bytes; pass a shorter {flag}")]
    SocketTooLong {
        /// The option the path is for (`--socket`, `--monitor-socket`).
        flag: &'static str,
        /// The path, absolute.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
    },
    /// The domain has no persistent definition (started with `virsh create`).
    #[error("domain {0} is transient (started with virsh create): memfold edits a domain's persistent definition, and `virsh define` would make this one persistent; define it yourself first (virsh dumpxml {0} > {0}.xml; virsh define {0}.xml), then run this again; nothing was changed")]
    Transient(String),
    /// The temporary file for `virsh define`.
    #[error("temporary file {path}: {source}")]
    Temp {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// virsh with `--connect` if given.
struct Virsh<'a> {
    connect: Option<&'a str>,
}

impl Virsh<'_> {
    fn run(&self, args: &[&str]) -> Result<String, LibvirtError> {
        let mut cmd = Command::new("virsh");
        // Its words untranslated: `dominfo`'s "Persistent: no", `domstate`'s "running".
        cmd.env("LC_ALL", "C");
        if let Some(uri) = self.connect {
            cmd.args(["--connect", uri]);
        }
        let out = cmd.args(args).output().map_err(LibvirtError::NoVirsh)?;
        if !out.status.success() {
            return Err(LibvirtError::Virsh {
                args: args.join(" "),
                status: out.status,
                stderr: String::from_utf8_lossy(&out.stderr).trim().to_string(),
            });
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The persistent definition, passwords included (`define` must get them back).
    fn dumpxml(&self, domain: &str) -> Result<String, LibvirtError> {
        self.run(&["dumpxml", "--inactive", "--security-info", domain])
    }

    /// Defines `xml` (through a 0600 temporary file: it holds the domain's secrets).
    fn define(&self, xml: &str) -> Result<(), LibvirtError> {
        let path = std::env::temp_dir().join(format!("memfold-libvirt-{}.xml", std::process::id()));
        let temp = |source| LibvirtError::Temp {
            path: path.clone(),
            source,
        };
        let _ = std::fs::remove_file(&path);
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(temp)?;
        f.write_all(xml.as_bytes()).map_err(temp)?;
        drop(f);
        let r = self.run(&["define", &path.to_string_lossy()]);
        let _ = std::fs::remove_file(&path);
        r.map(drop)
    }

    /// Whether the domain runs now (its QEMU keeps the old definition until it restarts).
    fn running(&self, domain: &str) -> Result<bool, LibvirtError> {
        let state = self.run(&["domstate", domain])?;
        Ok(matches!(
            state.trim(),
            "running" | "paused" | "in shutdown" | "pmsuspended"
        ))
    }

    /// Refuses a transient domain ([`LibvirtError::Transient`]): `dumpxml --inactive` of
    /// one is its live definition, and defining it makes it persistent.
    fn persistent(&self, domain: &str) -> Result<(), LibvirtError> {
        let info = self.run(&["dominfo", domain])?;
        let transient = info.lines().any(|l| {
            l.split_once(':')
                .is_some_and(|(k, v)| k.trim() == "Persistent" && v.trim() == "no")
        });
        if transient {
            return Err(LibvirtError::Transient(domain.to_string()));
        }
        Ok(())
    }
}

/// Why libvirt's QEMU (`libvirt-qemu` under Debian's DAC driver) may not be able to read
/// the agent at `path`: a part of the path others cannot reach.
fn unreadable_by_others(path: &Path) -> Option<String> {
    let meta = std::fs::metadata(path).ok()?;
    if meta.permissions().mode() & 0o004 == 0 {
        return Some(format!(
            "{} is not readable by others (mode {:o})",
            path.display(),
            meta.permissions().mode() & 0o7777
        ));
    }
    for dir in path.ancestors().skip(1) {
        if let Ok(m) = std::fs::metadata(dir) {
            if m.permissions().mode() & 0o001 == 0 {
                return Some(format!(
                    "{} is not searchable by others (mode {:o})",
                    dir.display(),
                    m.permissions().mode() & 0o7777
                ));
            }
        }
    }
    None
}

fn xml_err(domain: &str) -> impl Fn(XmlError) -> LibvirtError + '_ {
    move |source| LibvirtError::Xml {
        domain: domain.to_string(),
        source,
    }
}

/// Says that a running domain keeps its old definition until its next start.
fn note_running(v: &Virsh, domain: &str) -> Result<(), LibvirtError> {
    if v.running(domain)? {
        println!(
            "{domain} is running: the change applies at its next start (virsh shutdown {domain}, then virsh start {domain}; a reboot inside the guest keeps the same QEMU)"
        );
    }
    Ok(())
}

/// `path` as libvirt's QEMU must see it: absolute (QEMU runs in `/`), and short enough
/// for a Unix socket; `flag` names it in the error.
///
/// Errors: [`LibvirtError::SocketTooLong`].
fn socket_path(flag: &'static str, path: &Path) -> Result<PathBuf, LibvirtError> {
    let path = std::path::absolute(path).unwrap_or_else(|_| path.to_path_buf());
    let len = path.as_os_str().len();
    if len >= SUN_PATH {
        return Err(LibvirtError::SocketTooLong { flag, path, len });
    }
    Ok(path)
}

/// The `--claim` monitor's socket: `given`, else in [`MONITOR_DIR`] named after the
/// domain's `name`, or after its `uuid` when the name makes the path too long (memfoldd
/// reads the path from QEMU's command line and `disable` from the record, so any name
/// does).
///
/// Errors: [`LibvirtError::SocketTooLong`].
fn monitor_socket(
    given: Option<&Path>,
    name: &str,
    uuid: Option<&str>,
) -> Result<PathBuf, LibvirtError> {
    const FLAG: &str = "--monitor-socket";
    if let Some(p) = given {
        return socket_path(FLAG, p);
    }
    let named = |n: &str| Path::new(MONITOR_DIR).join(format!("memfold-qmp-{n}.sock"));
    match (socket_path(FLAG, &named(name)), uuid) {
        (Err(_), Some(uuid)) => socket_path(FLAG, &named(uuid)),
        (r, _) => r,
    }
}

/// `memfold libvirt enable`.
pub fn enable(a: &EnableArgs) -> Result<(), LibvirtError> {
    let agent = match &a.agent {
        Some(p) if p.exists() => std::path::absolute(p).unwrap_or_else(|_| p.clone()),
        Some(p) => return Err(LibvirtError::AgentMissing(p.clone())),
        None => {
            let exe = std::env::current_exe().unwrap_or_default();
            agent_library(&exe).ok_or_else(|| LibvirtError::NoAgent {
                exe: exe.display().to_string(),
            })?
        }
    };
    if let Some(why) = unreadable_by_others(&agent) {
        eprintln!(
            "memfold libvirt: warning: {why}; libvirt's QEMU runs as its own user (libvirt-qemu on Debian) and may fail to preload the agent"
        );
    }
    let socket = socket_path("--socket", &a.socket)?;
    let v = Virsh {
        connect: a.connect.as_deref(),
    };
    let xml = v.dumpxml(&a.domain)?;
    let name = libvirt_xml::name_of(&xml).map_err(xml_err(&a.domain))?;
    let claim_monitor = if a.claim {
        let uuid = libvirt_xml::uuid_of(&xml).map_err(xml_err(&a.domain))?;
        let path = monitor_socket(a.monitor_socket.as_deref(), &name, uuid.as_deref())?;
        Some(path.display().to_string())
    } else {
        None
    };
    let settings = Settings {
        agent: agent.display().to_string(),
        socket: socket.display().to_string(),
        claim_monitor,
    };
    let on = libvirt_xml::enable(&xml, &settings).map_err(xml_err(&a.domain))?;
    v.persistent(&a.domain)?;
    // libvirt writes the XML in its own style (quotes, attribute order): compare what
    // it means, not its bytes.
    if libvirt_xml::canonical(&on.xml).map_err(xml_err(&a.domain))?
        == libvirt_xml::canonical(&xml).map_err(xml_err(&a.domain))?
    {
        println!("{name}: memfold is enabled already, with these settings; nothing to change");
        return note_running(&v, &a.domain);
    }
    v.define(&on.xml)?;
    if !libvirt_xml::is_enabled(&v.dumpxml(&a.domain)?).map_err(xml_err(&a.domain))? {
        return Err(LibvirtError::NotKept {
            domain: name,
            what: "memfold's <metadata> record",
        });
    }
    println!(
        "{name}: {} memfold: guest RAM a shared memfd (<memoryBacking><source type='memfd'/><access mode='shared'/>), QEMU's environment LD_PRELOAD={} MEMFOLD_SOCKET={} MEMFOLD_VM_NAME={name}{}; `memfold libvirt disable {name}` undoes it",
        if on.was_enabled { "updated" } else { "enabled" },
        settings.agent,
        settings.socket,
        settings
            .claim_monitor
            .as_deref()
            .map_or(String::new(), |m| format!(", a QMP monitor for memfoldd at {m}")),
    );
    note_running(&v, &a.domain)
}

/// `memfold libvirt disable`.
pub fn disable(a: &DisableArgs) -> Result<(), LibvirtError> {
    let v = Virsh {
        connect: a.connect.as_deref(),
    };
    let xml = v.dumpxml(&a.domain)?;
    let Some(off) = libvirt_xml::disable(&xml).map_err(xml_err(&a.domain))? else {
        println!(
            "{}: memfold is not enabled on it; nothing to change",
            a.domain
        );
        return Ok(());
    };
    v.persistent(&a.domain)?;
    v.define(&off)?;
    if libvirt_xml::is_enabled(&v.dumpxml(&a.domain)?).map_err(xml_err(&a.domain))? {
        return Err(LibvirtError::NotKept {
            domain: a.domain.clone(),
            what: "the removal of memfold's record",
        });
    }
    println!(
        "{}: memfold disabled: its memoryBacking, qemu:commandline entries and record are undone",
        a.domain
    );
    note_running(&v, &a.domain)
}

#[cfg(test)]
mod tests {
    use super::*;

    const UUID: &str = "4dea22b3-1d52-d8f3-2516-782e98ab3fa0";

    /// libvirt's QEMU runs in `/`: a relative socket path is made absolute, as `--agent`.
    #[test]
    fn a_relative_socket_path_is_made_absolute() {
        let cwd = std::env::current_dir().unwrap();
        let p = socket_path("--socket", Path::new("run/memfoldd.sock")).unwrap();
        assert_eq!(p, cwd.join("run/memfoldd.sock"));
        let p = monitor_socket(Some(Path::new("q.sock")), "web1", Some(UUID)).unwrap();
        assert_eq!(p, cwd.join("q.sock"));
        assert_eq!(
            socket_path("--socket", Path::new("/run/m.sock")).unwrap(),
            Path::new("/run/m.sock")
        );
    }

    /// A socket path of 108 bytes or more cannot be connected to: the default monitor
    /// path takes the domain's UUID when its name is too long, and a given path that long
    /// is refused, saying which option and how long.
    #[test]
    fn a_socket_path_fits_a_unix_socket_address() {
        let dir = format!("{MONITOR_DIR}/memfold-qmp-");
        // The longest name that fits: the path is 107 bytes.
        let fits = "n".repeat(SUN_PATH - 1 - dir.len() - ".sock".len());
        let p = monitor_socket(None, &fits, Some(UUID)).unwrap();
        assert_eq!(p, Path::new(&format!("{dir}{fits}.sock")));
        assert_eq!(p.as_os_str().len(), SUN_PATH - 1);
        let long = format!("{fits}n");
        assert_eq!(
            monitor_socket(None, &long, Some(UUID)).unwrap(),
            Path::new(&format!("{dir}{UUID}.sock"))
        );
        // Bytes count, not characters.
        let wide = "é".repeat(fits.len() / 2 + 1);
        assert!(monitor_socket(None, &wide, Some(UUID))
            .unwrap()
            .ends_with(format!("memfold-qmp-{UUID}.sock")));
        // Without a UUID there is nothing shorter to take.
        let e = monitor_socket(None, &long, None).unwrap_err().to_string();
        assert!(
            e.starts_with(&format!("--monitor-socket {dir}{long}.sock: 108 bytes, but a Unix socket's path must be under 108 bytes; pass a shorter --monitor-socket")),
            "{e}"
        );
        // A given path: 107 bytes pass, 108 are refused, whatever the name.
        let given = |n: usize| format!("/{}", "s".repeat(n - 1));
        let p = monitor_socket(Some(Path::new(&given(107))), "web1", Some(UUID)).unwrap();
        assert_eq!(p.as_os_str().len(), 107);
        assert!(matches!(
            monitor_socket(Some(Path::new(&given(108))), "web1", Some(UUID)),
            Err(LibvirtError::SocketTooLong {
                flag: "--monitor-socket",
                len: 108,
                ..
            })
        ));
        assert!(matches!(
            socket_path("--socket", Path::new(&given(200))),
            Err(LibvirtError::SocketTooLong {
                flag: "--socket",
                len: 200,
                ..
            })
        ));
    }
}
