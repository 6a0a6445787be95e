//! What this crate's guest-booting tests share: memfoldd and QEMU children killed when
//! dropped, memfoldd started with a test's own flags, the agent library of the build.
// Each test binary uses the part it needs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command};

/// A child process killed when dropped (also when the test fails: an orphan would hold
/// the test's output open).
pub struct Killed(pub Child);

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// This crate's memfoldd at `socket` with `args`, and not the host's
/// `/etc/memfold/memfoldd.toml` (a package may have put one there): the flags are the
/// test's.
pub fn memfoldd(socket: &Path, args: &[&str]) -> Killed {
    Killed(
        memfoldd_command(socket, args)
            .spawn()
            .expect("memfoldd starts"),
    )
}

/// As [`memfoldd`], its log (stderr) written to `log`.
pub fn memfoldd_logged(socket: &Path, args: &[&str], log: &Path) -> Killed {
    Killed(
        memfoldd_command(socket, args)
            .stderr(std::fs::File::create(log).expect("memfoldd's log"))
            .spawn()
            .expect("memfoldd starts"),
    )
}

/// memfoldd for one enlightened guest (issue 17), in `work`: sharing only, no clock, its
/// guest channels' folder `work/channels` asked every second, its log `work/memfoldd.log`.
pub struct Enlightened {
    /// The daemon (killed on drop).
    pub daemon: Killed,
    /// Its socket.
    pub socket: std::path::PathBuf,
    /// The guest channels' folder.
    pub channels: std::path::PathBuf,
    /// Its log.
    pub log: std::path::PathBuf,
}

/// Starts [`Enlightened`] memfoldd in `work`.
pub fn memfoldd_enlightened(work: &Path) -> Enlightened {
    let socket = work.join("memfoldd.sock");
    let channels = work.join("channels");
    std::fs::create_dir(&channels).unwrap();
    let log = work.join("memfoldd.log");
    let daemon = memfoldd_logged(
        &socket,
        &[
            "--rate",
            "0",
            "--policy",
            "sharing",
            "--clock-secs",
            "0",
            "--guest-channels",
            channels.to_str().unwrap(),
            "--guest-interval-ms",
            "1000",
        ],
        &log,
    );
    Enlightened {
        daemon,
        socket,
        channels,
        log,
    }
}

/// memfoldd of this build on `socket` with `args`, without the host's configuration file.
fn memfoldd_command(socket: &Path, args: &[&str]) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_memfoldd"));
    c.args(["--config", "none"])
        .args(args)
        .arg("--socket")
        .arg(socket);
    c
}

/// The agent library of this build, beside memfoldd.
pub fn agent_lib() -> PathBuf {
    let p = Path::new(env!("CARGO_BIN_EXE_memfoldd")).with_file_name("libmemfold_agent.so");
    assert!(
        p.exists(),
        "{} missing: build the workspace first (`cargo build --release --workspace`; make test does)",
        p.display()
    );
    p
}

/// QEMU's guest-RAM memfd (the one of exactly the RAM's size).
pub fn ram_memfd(g: &memfold_vm::launcher::Guest) -> std::fs::File {
    let dir = std::path::PathBuf::from(format!("/proc/{}/fd", g.pid));
    for e in std::fs::read_dir(&dir).unwrap().flatten() {
        let Ok(link) = std::fs::read_link(e.path()) else {
            continue;
        };
        if !link.to_string_lossy().starts_with("/memfd:") {
            continue;
        }
        if let Ok(f) = std::fs::File::open(e.path()) {
            if f.metadata().map(|m| m.len()).unwrap_or(0) == g.mem_bytes {
                return f;
            }
        }
    }
    panic!("no RAM memfd in {}", dir.display());
}
