//! Disks served by memfold-blk (issue 16, Satori §4.1): which of a guest's disks it
//! serves, where its binary is, and starting one process per disk before QEMU, each
//! watched by a thread that restarts it if it dies while the guest runs
//! ([`BlkSupervisor`]).
//!
//! # A device that dies
//!
//! QEMU keeps the guest running when its vhost-user backend goes away and reconnects
//! (`reconnect=1`, every second) once a backend listens on the socket again; on the loss
//! it sets each queue's next request back to the ring's used index, so the new backend
//! serves again every request the old one had not completed (memfold-blk completes in
//! order, so none is left out and none done twice in a way the guest can see: a read
//! read again, a write written again with the same bytes). The supervisor restarts a dead
//! `memfold-blk` after [`RESTART_DELAY`], at most [`MAX_RESTARTS`] times per disk, each
//! restart logged (and noted in the disk's log file).

use std::ffi::OsString;
use std::fs::File;
use std::io::Write as _;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::sync::{mpsc, Arc};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::{GuestSpec, RamBackend, VmError, DATA_DISK_SERIAL};
use crate::images;

/// Which of a guest's disks memfold-blk serves, one `memfold-blk` process per disk
/// (started before QEMU, its socket `blk-data.sock` / `blk-root.sock` in the guest's
/// folder, killed when the guest stops). Needs [`RamBackend::Memfd`] (vhost-user shares
/// guest RAM by its memfd).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlkDisks {
    /// The data disk ([`GuestSpec::data_disk`]; its read throttle is memfold-blk's
    /// `--read-bytes-per-sec`).
    pub data: bool,
    /// The data disk writable: its image a read-only base under a per-guest qcow2
    /// overlay (`data.qcow2` in the guest's folder), as the root disk's (with `data`).
    pub data_overlay: bool,
    /// The root disk: the profile's image as a read-only base under a per-guest qcow2
    /// overlay (`root.qcow2` in the guest's folder, made with `qemu-img create -f qcow2 -b
    /// IMAGE -F raw`) instead of QEMU's throw-away `snapshot=on` overlay.
    pub root: bool,
    /// The `memfold-blk` binary; `None`: [`memfold_blk_binary`].
    pub binary: Option<PathBuf>,
    /// Passed as `--landed-socket` (memfoldd's socket for landed pages); `None`: the
    /// device counts them itself.
    pub landed_socket: Option<PathBuf>,
}

/// The environment variable naming the `memfold-blk` binary.
pub const MEMFOLD_BLK_ENV: &str = "MEMFOLD_BLK";

/// The `memfold-blk` binary: `$MEMFOLD_BLK`, else beside the running executable, else in
/// its parent folder (a test binary in `target/release/deps` finds the build's in
/// `target/release`), else `../lib/memfold/` from its folder (an installed memfold, as
/// the agent library).
pub fn memfold_blk_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(MEMFOLD_BLK_ENV) {
        return Some(PathBuf::from(p));
    }
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    [
        Some(dir.join("memfold-blk")),
        dir.parent().map(|p| p.join("memfold-blk")),
        dir.parent().map(|p| p.join("lib/memfold/memfold-blk")),
    ]
    .into_iter()
    .flatten()
    .find(|p| p.is_file())
}

/// The `memfold-blk` processes for `spec`'s disks (`b`), each waited for until its socket
/// exists (10 s at most); the root disk's overlay is made first.
///
/// Errors: [`VmError::Blk`] (RAM not memfd, no binary, `qemu-img`
/// failed, a process that exits or makes no socket in time).
pub(super) fn start_blk(
    spec: &GuestSpec,
    b: &BlkDisks,
    img: &images::Image,
    dir: &Path,
) -> Result<Vec<BlkSupervisor>, VmError> {
    let err = |disk: &'static str, what: String| VmError::Blk {
        name: spec.name.clone(),
        disk,
        what,
    };
    let mut jobs: Vec<(&'static str, Vec<std::ffi::OsString>)> = Vec::new();
    if b.root {
        let Some(rootfs) = &img.rootfs else {
            return Err(err(
                "root",
                format!("profile {} has no root disk", spec.profile),
            ));
        };
        let overlay = new_overlay(rootfs, &dir.join("root.qcow2")).map_err(|e| err("root", e))?;
        jobs.push((
            "root",
            vec![
                "--base".into(),
                rootfs.into(),
                "--overlay".into(),
                overlay.into(),
                "--serial".into(),
                "memfold-root".into(),
            ],
        ));
    }
    if b.data {
        let Some(d) = &spec.data_disk else {
            return Err(err("data", "the guest has no data disk".into()));
        };
        let mut args: Vec<std::ffi::OsString> = vec![
            "--base".into(),
            d.path.clone().into(),
            "--serial".into(),
            DATA_DISK_SERIAL.into(),
        ];
        if b.data_overlay {
            let ov = new_overlay(&d.path, &dir.join("data.qcow2")).map_err(|e| err("data", e))?;
            args.extend(["--overlay".into(), ov.into()]);
        }
        // The same slow disk as QEMU's bps_rd throttle gives the virtio data disk.
        if let Some(bps) = d.read_bytes_per_sec {
            args.extend(["--read-bytes-per-sec".into(), bps.to_string().into()]);
        }
        jobs.push(("data", args));
    }
    if jobs.is_empty() {
        return Ok(Vec::new());
    }
    if spec.ram != RamBackend::Memfd {
        return Err(err(
            jobs[0].0,
            "vhost-user needs memfd guest RAM (RamBackend::Memfd)".into(),
        ));
    }
    let binary = b
        .binary
        .clone()
        .or_else(memfold_blk_binary)
        .ok_or_else(|| {
            err(
                jobs[0].0,
                format!("no memfold-blk binary (set ${MEMFOLD_BLK_ENV})"),
            )
        })?;
    let mut sups: Vec<BlkSupervisor> = Vec::new();
    for (disk, args) in jobs {
        let sock = dir.join(format!("blk-{disk}.sock"));
        let mut argv: Vec<OsString> = args;
        argv.extend([
            "--socket".into(),
            sock.clone().into(),
            "--stats".into(),
            dir.join(format!("blk-{disk}.stats")).into(),
            "--queues".into(),
            spec.cpus.max(1).to_string().into(),
        ]);
        if let Some(l) = &b.landed_socket {
            argv.extend(["--landed-socket".into(), l.clone().into()]);
        }
        let job = Job {
            guest: spec.name.clone(),
            disk,
            binary: binary.clone(),
            args: argv,
            sock,
            log: dir.join(format!("blk-{disk}.log")),
        };
        match BlkSupervisor::start(job) {
            Ok(s) => sups.push(s),
            Err(what) => {
                for s in &mut sups {
                    s.stop();
                }
                return Err(err(disk, what));
            }
        }
    }
    Ok(sups)
}

/// Makes `overlay` anew, a qcow2 image over the raw `base`; returns its path.
///
/// Errors: `qemu-img` missing or failing, in words.
fn new_overlay(base: &Path, overlay: &Path) -> Result<PathBuf, String> {
    let _ = std::fs::remove_file(overlay);
    let out = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-b"])
        .arg(base)
        .args(["-F", "raw"])
        .arg(overlay)
        .output()
        .map_err(|e| format!("qemu-img: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "qemu-img create: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    // A dirty marker a killed memfold-blk left beside the old overlay (memfold-blk's
    // `disk/repair.rs`) is not this one's: it would only cost a needless check.
    let mut marker = overlay.as_os_str().to_owned();
    marker.push(".memfold-dirty");
    let _ = std::fs::remove_file(marker);
    Ok(overlay.to_path_buf())
}

/// Most restarts of one disk's `memfold-blk` over a guest's life.
pub const MAX_RESTARTS: u32 = 5;
/// Wait before a restart (a device that dies at once does not spin).
pub const RESTART_DELAY: Duration = Duration::from_millis(200);
/// How long a `memfold-blk` may take to make its socket.
const SOCKET_WAIT: Duration = Duration::from_secs(10);

/// One disk's `memfold-blk` command.
struct Job {
    guest: String,
    disk: &'static str,
    binary: PathBuf,
    args: Vec<OsString>,
    sock: PathBuf,
    log: PathBuf,
}

impl Job {
    /// Starts the process (its stderr appended to the disk's log, `truncate` the first
    /// time) and waits for its socket.
    ///
    /// Errors: it cannot start, exits, or makes no socket within [`SOCKET_WAIT`].
    fn spawn(&self, truncate: bool) -> Result<Child, String> {
        let _ = std::fs::remove_file(&self.sock);
        let stderr = File::options()
            .create(true)
            .append(true)
            .truncate(false)
            .open(&self.log)
            .and_then(|f| {
                if truncate {
                    f.set_len(0)?;
                }
                Ok(f)
            })
            .map_err(|e| format!("{}: {e}", self.log.display()))?;
        let mut cmd = Command::new(&self.binary);
        cmd.args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        // SAFETY: only prctl between fork and exec. The signal follows the death of the
        // spawning thread: the supervisor's, which lives as long as the process.
        unsafe {
            cmd.pre_exec(|| {
                rustix::process::set_parent_process_death_signal(Some(
                    rustix::process::Signal::KILL,
                ))?;
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .map_err(|e| format!("{}: {e}", self.binary.display()))?;
        let deadline = Instant::now() + SOCKET_WAIT;
        while !self.sock.exists() {
            let exited = child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                let tail = std::fs::read_to_string(&self.log).unwrap_or_default();
                return Err(format!(
                    "no socket {} ({}): {}",
                    self.sock.display(),
                    exited.map_or("timed out".into(), |s| s.to_string()),
                    tail.trim()
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        Ok(child)
    }

    /// Says `line` in the log and in the disk's log file.
    fn note(&self, line: &str) {
        tracing::warn!(
            "guest {}: memfold-blk ({} disk): {line}",
            self.guest,
            self.disk
        );
        if let Ok(mut f) = File::options().append(true).open(&self.log) {
            let _ = writeln!(f, "memfold-vm supervisor: {line}");
        }
    }
}

/// State a supervisor shares with its guest.
#[derive(Default)]
struct Shared {
    stop: AtomicBool,
    /// The running process's pid (0: none).
    pid: AtomicU32,
    restarts: AtomicU32,
}

/// One disk's `memfold-blk` and the thread that owns it: it starts the process, restarts
/// it when it exits while the guest runs (see the module's doc), and kills it at
/// [`BlkSupervisor::stop`].
pub struct BlkSupervisor {
    disk: &'static str,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl BlkSupervisor {
    /// Starts `job` from a new thread and returns once its socket exists.
    ///
    /// Errors: the first start failed (in words).
    fn start(job: Job) -> Result<BlkSupervisor, String> {
        let shared = Arc::new(Shared::default());
        let (tx, rx) = mpsc::channel();
        let sh = shared.clone();
        let disk = job.disk;
        let thread = std::thread::Builder::new()
            .name(format!("blk-{}-{}", job.guest, job.disk))
            .spawn(move || supervise(job, sh, tx))
            .map_err(|e| format!("supervisor thread: {e}"))?;
        match rx.recv() {
            Ok(Ok(())) => Ok(BlkSupervisor {
                disk,
                shared,
                thread: Some(thread),
            }),
            Ok(Err(e)) => {
                let _ = thread.join();
                Err(e)
            }
            Err(_) => Err("supervisor thread ended".into()),
        }
    }

    /// Which disk.
    pub fn disk(&self) -> &'static str {
        self.disk
    }

    /// The running process's pid; `None` between a death and its restart, or after the
    /// supervisor gave up.
    pub fn pid(&self) -> Option<u32> {
        Some(self.shared.pid.load(Ordering::Acquire)).filter(|&p| p != 0)
    }

    /// Restarts so far.
    pub fn restarts(&self) -> u32 {
        self.shared.restarts.load(Ordering::Acquire)
    }

    /// Kills the process and ends the thread. Idempotent.
    pub fn stop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for BlkSupervisor {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The supervisor's thread: starts `job`, tells `ready`, then watches.
fn supervise(job: Job, sh: Arc<Shared>, ready: mpsc::Sender<Result<(), String>>) {
    let mut child = match job.spawn(true) {
        Ok(c) => Some(c),
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    sh.pid
        .store(child.as_ref().map_or(0, Child::id), Ordering::Release);
    let _ = ready.send(Ok(()));
    loop {
        if sh.stop.load(Ordering::Acquire) {
            if let Some(c) = child.as_mut() {
                let _ = c.kill();
                let _ = c.wait();
            }
            sh.pid.store(0, Ordering::Release);
            return;
        }
        // `None`: a restart that failed, as good as an exit.
        let status = match child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => {
                std::thread::sleep(Duration::from_millis(50));
                continue;
            }
            Some(Ok(Some(s))) => s.to_string(),
            Some(Err(e)) => format!("wait failed: {e}"),
            None => "did not start".into(),
        };
        child = None;
        sh.pid.store(0, Ordering::Release);
        let n = sh.restarts.load(Ordering::Acquire);
        if n >= MAX_RESTARTS {
            job.note(&format!(
                "exited ({status}); not restarted: {MAX_RESTARTS} restarts already, the disk stays away"
            ));
            while !sh.stop.load(Ordering::Acquire) {
                std::thread::sleep(Duration::from_millis(50));
            }
            return;
        }
        job.note(&format!(
            "exited ({status}); restart {} of {MAX_RESTARTS} in {} ms",
            n + 1,
            RESTART_DELAY.as_millis()
        ));
        std::thread::sleep(RESTART_DELAY);
        sh.restarts.store(n + 1, Ordering::Release);
        match job.spawn(false) {
            Ok(c) => {
                sh.pid.store(c.id(), Ordering::Release);
                job.note(&format!("restarted as pid {}", c.id()));
                child = Some(c);
            }
            Err(e) => job.note(&format!("restart failed: {e}")),
        }
    }
}
