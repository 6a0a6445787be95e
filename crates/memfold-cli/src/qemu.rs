//! `memfold qemu [--socket S] [--name N] [--fix] -- qemu-system-x86_64 ARGS...`: runs a
//! QEMU command line the operator wrote, with memfold's agent. Checks that guest RAM is a
//! shared memfd (`memfold_agent::qemu_args`) and that nothing on the line makes the agent
//! leave the guest alone (a back end writing guest RAM outside QEMU's page tables, a disk
//! read beyond the write fence, `-daemonize`); if anything does, prints each reason with
//! its fix and exits with status 2 (`--fix` rewrites QEMU's plain `-m SIZE` RAM into a
//! shared memfd backend instead). Then it replaces itself with QEMU (`exec`: same pid, so
//! QEMU's parent, signals and exit status are the caller's), with `LD_PRELOAD` naming the
//! agent library and `MEMFOLD_SOCKET` / `MEMFOLD_VM_NAME` set. The agent finds every guest RAM
//! region itself; nothing here needs the RAM size.

use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};

use memfold_agent::qemu_args::{Problem, RamPlan, MEMFD_BACKEND};
use memfold_cli::install::{agent_library_candidates, AGENT_LIBRARY};

/// Where packages install the agent library (tried after the places
/// [`agent_library_candidates`] names for this program).
const AGENT_DIR: &str = "/usr/lib/memfold";
/// The id `--fix` gives the memory backend it adds.
const FIX_ID: &str = "memfold-ram0";

/// Exit status when `memfold qemu` refuses a command line (nothing started): guest RAM is
/// not shareable, or the agent would leave the guest alone.
pub const EXIT_NOT_SHAREABLE: i32 = 2;

/// `memfold qemu`'s arguments.
#[derive(clap::Args, Debug)]
pub struct QemuArgs {
    /// memfoldd's socket (the agent connects to it, and reconnects every second until it
    /// answers).
    #[arg(long, default_value = memfold_cli::DEFAULT_SOCKET)]
    socket: PathBuf,
    /// The guest's name in memfoldd (default: QEMU's `-name`, else `qemu-PID`).
    #[arg(long)]
    name: Option<String>,
    /// The agent library (default: `libmemfold_agent.so` next to this program, else in
    /// /usr/lib/memfold/).
    #[arg(long)]
    agent: Option<PathBuf>,
    /// If guest RAM is QEMU's plain `-m SIZE` (no memory backend), add a shared memfd
    /// backend of that size and use it as guest RAM, rather than refusing.
    #[arg(long)]
    fix: bool,
    /// QEMU and its arguments, after `--`.
    #[arg(last = true, required = true, num_args = 1..)]
    qemu: Vec<String>,
}

/// Why `memfold qemu` does not start QEMU.
#[derive(Debug, thiserror::Error)]
pub enum QemuError {
    /// memfold cannot manage guest RAM: some is not shareable ([`Problem`]), or the agent
    /// would leave the guest alone (`refusals`); each reason with its fix.
    #[error("guest RAM memfold cannot share:\n{}", .0.iter().map(|p| format!("  - {p}")).collect::<Vec<_>>().join("\n"))]
    NotShareable(Vec<String>),
    /// The command line could not be read.
    #[error("QEMU's command line: {0}")]
    Args(#[from] memfold_agent::qemu_args::ArgsError),
    /// No agent library found.
    #[error("the agent library {AGENT_LIBRARY} is neither next to {exe}, nor in ../lib/memfold/ from there, nor in {AGENT_DIR}/ (build the workspace, or pass --agent PATH)")]
    NoAgent {
        /// This program's folder looked in.
        exe: String,
    },
    /// `--agent` names a file that does not exist.
    #[error("--agent {0}: no such file")]
    AgentMissing(PathBuf),
    /// exec failed.
    #[error("cannot run {prog}: {source}")]
    Exec {
        /// The program.
        prog: String,
        /// Why.
        source: std::io::Error,
    },
}

/// What to run: QEMU's words and the environment to add.
#[derive(Debug, PartialEq, Eq)]
pub struct Launch {
    /// Program and arguments (as given, or rewritten by `--fix`).
    pub argv: Vec<String>,
    /// Variables to set.
    pub env: Vec<(String, String)>,
}

/// What on QEMU's command line (`args`, without the program; `plan`, as read) makes the
/// agent leave the guest alone although its RAM is shareable, each with its fix: the
/// agent's own checks (`memfold_agent::run`), which would otherwise only log, and
/// `-daemonize`, after which the agent's thread is gone (docs/live.md).
fn refusals(plan: &RamPlan, args: &[String]) -> Vec<String> {
    let mut out: Vec<String> = plan
        .unfenced_io
        .iter()
        .map(|d| format!("{d}: its reads land in guest RAM after the submitting call returns (aio=native, or aio=io_uring with direct I/O), beyond memfold's write fence, so the agent would leave this guest alone; use aio=threads (QEMU's default)"))
        .collect();
    out.extend(plan.outside_writers.iter().map(|d| format!("{d}: its back end writes guest RAM outside QEMU's page tables (vhost-user other than vhost-user-blk, vDPA, VFIO), so the agent would leave this guest alone (docs/security.md); remove it, or run this guest without memfold")));
    if args.iter().any(|w| w == "-daemonize" || w == "--daemonize") {
        out.push("-daemonize: the agent's thread does not survive QEMU's fork, so the guest would run unmanaged (docs/live.md); run QEMU in the foreground (a service manager, or setsid with -pidfile)".into());
    }
    out
}

/// Decides what to run for `qemu` (program and arguments): checks guest RAM, applies
/// `fix`, names the guest (`name`, QEMU's `-name`, else `qemu-PID` with `pid`, QEMU's pid
/// after the exec) and sets the agent's environment (`agent`: the library; `preload`:
/// `LD_PRELOAD` as it was, kept after the agent).
///
/// Errors: [`QemuError::NotShareable`] (also for `refusals`), [`QemuError::Args`].
pub fn prepare(
    qemu: &[String],
    fix: bool,
    name: Option<&str>,
    socket: &Path,
    agent: &Path,
    preload: Option<&str>,
    pid: u32,
) -> Result<Launch, QemuError> {
    let mut argv = qemu.to_vec();
    let plan = RamPlan::parse(&argv[1..])?;
    let mut problems = plan.problems();
    if fix {
        // `size` is in a backend's terms already (`-m 256` gives `256M`, not 256 bytes).
        if let [Problem::AnonymousRam { size }] = &problems[..] {
            argv.extend([
                "-object".into(),
                format!("{MEMFD_BACKEND},id={FIX_ID},size={size},share=on"),
                "-machine".into(),
                format!("memory-backend={FIX_ID}"),
            ]);
            problems = RamPlan::parse(&argv[1..])?.problems();
        }
    }
    let mut reasons: Vec<String> = problems.iter().map(|p| p.to_string()).collect();
    reasons.extend(refusals(&plan, &argv[1..]));
    if !reasons.is_empty() {
        return Err(QemuError::NotShareable(reasons));
    }
    let name = name
        .map(String::from)
        .or_else(|| plan.name.clone())
        .unwrap_or_else(|| format!("qemu-{pid}"));
    let preload = match preload.filter(|p| !p.trim().is_empty()) {
        Some(p) => format!("{}:{p}", agent.display()),
        None => agent.display().to_string(),
    };
    Ok(Launch {
        argv,
        env: vec![
            ("LD_PRELOAD".into(), preload),
            ("MEMFOLD_SOCKET".into(), socket.display().to_string()),
            ("MEMFOLD_VM_NAME".into(), name),
        ],
    })
}

/// The agent library: `--agent`, else where `memfold run` finds it for this program
/// (beside it, or `../lib/memfold/`: [`agent_library_candidates`]), else in
/// [`AGENT_DIR`].
///
/// Errors: [`QemuError::AgentMissing`], [`QemuError::NoAgent`].
fn agent_library(given: Option<&Path>) -> Result<PathBuf, QemuError> {
    if let Some(p) = given {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(QemuError::AgentMissing(p.to_path_buf()))
        };
    }
    let exe = std::env::current_exe().unwrap_or_default();
    agent_library_candidates(&exe)
        .into_iter()
        .chain([Path::new(AGENT_DIR).join(AGENT_LIBRARY)])
        .find(|p| p.is_file())
        .ok_or_else(|| QemuError::NoAgent {
            exe: exe.parent().unwrap_or(Path::new(".")).display().to_string(),
        })
}

/// Runs `memfold qemu`: never returns but with an error (QEMU replaced this process).
///
/// Errors: as [`prepare`], [`agent_library`], and [`QemuError::Exec`].
pub fn run(a: &QemuArgs) -> Result<std::convert::Infallible, QemuError> {
    let agent = agent_library(a.agent.as_deref())?;
    let preload = std::env::var("LD_PRELOAD").ok();
    let launch = prepare(
        &a.qemu,
        a.fix,
        a.name.as_deref(),
        &a.socket,
        &agent,
        preload.as_deref(),
        std::process::id(),
    )?;
    if !a.socket.exists() {
        eprintln!(
            "memfold qemu: no memfoldd at {} yet; the agent connects once it is there",
            a.socket.display()
        );
    }
    let mut cmd = std::process::Command::new(&launch.argv[0]);
    cmd.args(&launch.argv[1..]);
    for (k, v) in &launch.env {
        cmd.env(k, v);
    }
    // Anything else the caller set for the agent (MEMFOLD_FAIL, MEMFOLD_VMA_BUDGET, the
    // MEMFOLD_RAM_BYTES check) passes on.
    let source = cmd.exec();
    Err(QemuError::Exec {
        prog: launch.argv[0].clone(),
        source,
    })
}

/// `OsString`s of `words` (for tests of the clap side).
#[cfg(test)]
fn os(words: &[&str]) -> Vec<std::ffi::OsString> {
    words.iter().map(std::ffi::OsString::from).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(line: &str) -> Vec<String> {
        line.split_whitespace().map(String::from).collect()
    }

    fn prep(line: &str, fix: bool) -> Result<Launch, QemuError> {
        prepare(
            &words(line),
            fix,
            None,
            Path::new("/run/m.sock"),
            Path::new("/opt/libmemfold_agent.so"),
            None,
            4242,
        )
    }

    fn env<'a>(l: &'a Launch, k: &str) -> &'a str {
        &l.env.iter().find(|e| e.0 == k).unwrap().1
    }

    #[test]
    fn good_command_lines_run_as_written_with_the_agent() {
        for good in [
            "qemu-system-x86_64 -object memory-backend-memfd,id=ram0,size=512M,share=on -machine q35,memory-backend=ram0 -m 512M -name web1",
            "qemu-system-x86_64 -name guest=web1,debug-threads=on -object memory-backend-memfd,id=m0,size=128M -object memory-backend-memfd,id=m1,size=64M -m 192M -numa node,memdev=m0 -numa node,memdev=m1",
        ] {
            let l = prep(good, false).unwrap();
            assert_eq!(l.argv, words(good), "run as written");
            assert_eq!(env(&l, "LD_PRELOAD"), "/opt/libmemfold_agent.so");
            assert_eq!(env(&l, "MEMFOLD_SOCKET"), "/run/m.sock");
            assert_eq!(env(&l, "MEMFOLD_VM_NAME"), "web1");
        }
        // No -name: QEMU's pid (this process's, kept across the exec).
        let l = prep(
            "qemu-system-x86_64 -object memory-backend-memfd,id=r,size=1G -M q35,memory-backend=r",
            false,
        )
        .unwrap();
        assert_eq!(env(&l, "MEMFOLD_VM_NAME"), "qemu-4242");
        // --name wins; an LD_PRELOAD of the caller's stays, after the agent.
        let l = prepare(
            &words("qemu-system-x86_64 -name a -object memory-backend-memfd,id=r,size=1G -M memory-backend=r"),
            false,
            Some("b"),
            Path::new("/s"),
            Path::new("/a.so"),
            Some("/x.so"),
            1,
        )
        .unwrap();
        assert_eq!(env(&l, "MEMFOLD_VM_NAME"), "b");
        assert_eq!(env(&l, "LD_PRELOAD"), "/a.so:/x.so");
    }

    #[test]
    fn bad_command_lines_are_refused_with_what_to_add() {
        for (bad, says) in [
            (
                "qemu-system-x86_64 -m 1G -machine q35",
                "add `-object memory-backend-memfd,id=ram0,size=1G,share=on -machine memory-backend=ram0`",
            ),
            (
                "qemu-system-x86_64 -object memory-backend-memfd,id=ram0,size=1G,share=off -machine memory-backend=ram0",
                "define it as `-object memory-backend-memfd,id=ram0,size=1G,share=on`",
            ),
            (
                "qemu-system-x86_64 -object memory-backend-ram,id=m0,size=1G -numa node,memdev=m0",
                "memory backend m0 is memory-backend-ram (not a memfd)",
            ),
            (
                "qemu-system-x86_64 -object memory-backend-file,id=m0,size=1G,mem-path=/dev/hugepages -machine memory-backend=m0",
                "memory backend m0 is memory-backend-file (not a memfd)",
            ),
        ] {
            let e = prep(bad, false).unwrap_err().to_string();
            assert!(e.starts_with("guest RAM memfold cannot share:\n  - "), "{e}");
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    /// What the agent would leave alone although guest RAM is shareable is refused as
    /// unshareable RAM is (main exits with [`EXIT_NOT_SHAREABLE`]), each reason said, `--fix`
    /// or not; a drive and a back end the agent manages pass.
    #[test]
    fn lines_the_agent_would_leave_alone_are_refused() {
        let ram =
            "qemu-system-x86_64 -object memory-backend-memfd,id=r,size=1G -M q35,memory-backend=r";
        for (extra, says) in [
            (
                "-drive file=d.img,if=virtio,cache=none,aio=native",
                "-drive file=d.img,if=virtio,cache=none,aio=native: its reads land in guest RAM after the submitting call returns",
            ),
            (
                "-blockdev driver=file,filename=d,node-name=f,cache.direct=on,aio=io_uring",
                "use aio=threads (QEMU's default)",
            ),
            (
                "-device vfio-pci,host=0000:01:00.0",
                "-device vfio-pci,host=0000:01:00.0: its back end writes guest RAM outside QEMU's page tables",
            ),
            ("-device vhost-user-fs-pci,chardev=fs0,tag=t", "vhost-user-fs-pci"),
            ("-netdev vhost-user,id=n0,chardev=c0", "-netdev vhost-user"),
            ("-nic vhost-vdpa,vhostdev=/dev/vhost-vdpa-0", "-nic vhost-vdpa"),
            ("-daemonize", "-daemonize: the agent's thread does not survive QEMU's fork"),
            ("--daemonize -pidfile /run/q.pid", "-daemonize"),
        ] {
            for (line, fix) in [
                (format!("{ram} {extra}"), false),
                (format!("qemu-system-x86_64 -m 1G {extra}"), true),
            ] {
                match prep(&line, fix) {
                    Err(e @ QemuError::NotShareable(_)) => {
                        let e = e.to_string();
                        assert!(e.starts_with("guest RAM memfold cannot share:\n  - "), "{e}");
                        assert!(e.contains(says), "{line}: {e}");
                    }
                    other => panic!("{line}: {other:?}"),
                }
            }
        }
        // Both kinds at once: every reason is listed.
        match prep(
            "qemu-system-x86_64 -m 1G -daemonize -device vfio-pci,host=1",
            false,
        ) {
            Err(QemuError::NotShareable(r)) => assert_eq!(r.len(), 3, "{r:?}"),
            other => panic!("{other:?}"),
        }
        for fine in [
            "-drive file=d.img,if=virtio,cache=none,aio=threads -drive file=e,aio=io_uring",
            "-chardev socket,id=b,path=/r/blk.sock -device vhost-user-blk-pci,chardev=b",
            "-netdev tap,id=n0,vhost=on -device virtio-net-pci,netdev=n0",
            "-append console=ttyS0 -pidfile /run/q.pid",
        ] {
            prep(&format!("{ram} {fine}"), false).unwrap();
        }
    }

    #[test]
    fn fix_turns_plain_m_into_a_shared_memfd_and_nothing_else() {
        let l = prep("qemu-system-x86_64 -machine q35 -m 256M -name t", true).unwrap();
        assert_eq!(
            l.argv[l.argv.len() - 4..],
            words("-object memory-backend-memfd,id=memfold-ram0,size=256M,share=on -machine memory-backend=memfold-ram0")
        );
        // The fixed line passes the check it was refused by.
        assert!(RamPlan::parse(&l.argv[1..]).unwrap().problems().is_empty());
        // A bare -m size is MiB (QEMU's rule), a backend's bare size bytes: the backend
        // added says MiB, so QEMU sees two equal sizes.
        for (m, size) in [("256", "256M"), ("size=4096,slots=2,maxmem=8G", "4096M")] {
            let l = prep(&format!("qemu-system-x86_64 -m {m}"), true).unwrap();
            assert_eq!(
                l.argv[l.argv.len() - 3],
                format!("memory-backend-memfd,id=memfold-ram0,size={size},share=on")
            );
        }
        // A private memfd or a file is not guessed at: refused even with --fix.
        assert!(prep(
            "qemu-system-x86_64 -object memory-backend-memfd,id=r,size=1G,share=off -machine memory-backend=r",
            true
        )
        .is_err());
        assert!(prep("qemu-system-x86_64 -m 1G -mem-path /dev/hugepages", true).is_err());
    }

    #[test]
    fn the_qemu_words_come_after_a_double_dash() {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: QemuArgs,
        }
        use clap::Parser;
        let c = Cli::try_parse_from(os(&[
            "memfold-qemu",
            "--name",
            "x",
            "--",
            "qemu-system-x86_64",
            "-m",
            "1G",
            "--name",
            "q",
        ]))
        .unwrap();
        assert_eq!(c.a.name.as_deref(), Some("x"));
        assert_eq!(c.a.qemu, words("qemu-system-x86_64 -m 1G --name q"));
        assert!(Cli::try_parse_from(os(&["memfold-qemu"])).is_err());
    }
}
