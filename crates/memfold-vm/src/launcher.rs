//! Starting, watching and stopping QEMU guests.
//!
//! Each guest gets a work folder with its QMP socket and serial log. QEMU runs with the
//! parent-death signal set to SIGKILL, so it dies with the process that started it even
//! on a crash or `kill -9` (the signal follows the *thread* that spawned it: spawn guests
//! from a thread that lives as long as they do). [`Guest`] stops its QEMU on drop.

use std::fs::File;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::images::{self, ImageError};
use crate::qmp::{Qmp, QmpError};

mod args;
mod blk;
mod probe;
mod selfcheck;
pub use args::qemu_args;
use blk::start_blk;
pub use blk::{
    memfold_blk_binary, BlkDisks, BlkSupervisor, MAX_RESTARTS, MEMFOLD_BLK_ENV, RESTART_DELAY,
};
use probe::{probe_and_stamp, probe_dir};
use selfcheck::SelfCheckWatch;
pub use selfcheck::SELF_CHECK_STALL;

/// How guest RAM is backed on the host.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum RamBackend {
    /// `memory-backend-memfd,share=on`: what memfold manages (it reads the memfd).
    Memfd,
    /// Anonymous private memory, which QEMU marks MADV_MERGEABLE: what KSM scans.
    /// QEMU also marks it MADV_HUGEPAGE, so with the host's THP setting on `madvise` or
    /// `always` a guest's first touch allocates 2 MiB.
    Anonymous,
    /// [`RamBackend::Anonymous`] with transparent huge pages off for this QEMU
    /// (PR_SET_THP_DISABLE): 4 KiB pages, as memfd RAM has, so that KSM's saving does not
    /// include undoing huge-page bloat (docs/live.md).
    AnonymousNoThp,
}

/// CPU virtualization.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum Accel {
    /// Hardware virtualization.
    Kvm,
    /// Emulation, with the translation cache limited to `tb-size` MiB (QEMU's default
    /// cache made TCG guests use 1.4–1.6 GB RSS each here).
    Tcg,
}

/// Translation block cache for TCG, MiB.
pub const TCG_TB_MIB: u32 = 64;

/// What to start.
#[derive(Clone, Debug)]
pub struct GuestSpec {
    /// Unique name in the set (folder and log names).
    pub name: String,
    /// Image profile.
    pub profile: String,
    /// RAM, MiB.
    pub mem_mib: u32,
    /// RAM backing.
    pub ram: RamBackend,
    /// Virtual CPUs.
    pub cpus: u32,
    /// A cgroup's `cgroup.procs` file that QEMU joins before it execs ("from birth": all
    /// it allocates is charged there; the kernel-kit peer of `memfold compare`).
    pub cgroup_procs: Option<PathBuf>,
    /// Whether KSM may merge this guest's anonymous RAM (QEMU's `mem-merge`, which marks
    /// it MADV_MERGEABLE). Only [`RamBackend::Anonymous`] and
    /// [`RamBackend::AnonymousNoThp`] read it; off for an unmanaged twin beside KSM.
    pub mem_merge: bool,
    /// A virtio-balloon device with free page reporting (`free-page-reporting=on`): the
    /// guest kernel's `virtio_balloon` driver reports free 2 MiB blocks and QEMU discards
    /// them from guest RAM (the kernel-kit peer's `fpr`). Never inflated.
    pub free_page_reporting: bool,
    /// A virtio-balloon device that memfoldd inflates and deflates (sharing entitlements,
    /// Satori §4.2), and a QMP monitor of memfoldd's own, `memfold-qmp.sock` in the
    /// guest's folder (chardev id `memfold-qmp`; the launcher keeps `qmp.sock`). With
    /// [`GuestSpec::free_page_reporting`] too, one balloon does both.
    pub memfold_balloon: bool,
    /// A read-only data disk the guest's workload reads through its page cache (the
    /// `tiny` image's cache reader: docs/entitlements.md); `None`: none.
    pub data_disk: Option<DataDisk>,
    /// Guest kernel arguments of this guest alone, appended (e.g. the `tiny` image's
    /// `memfold.break_at=SECS`); `None`: none.
    pub kernel_args: Option<String>,
    /// QEMU reads its [`GuestSpec::data_disk`] with `O_DIRECT` (`cache.direct=on`), not
    /// through the host's page cache: as memfold-blk reads its disks, for a like-for-like
    /// comparison of the two devices (`memfold bench disk-io`). Off by default.
    pub data_disk_direct: bool,
    /// Disks served by memfold-blk (vhost-user-blk, Satori §4.1) instead of QEMU's own
    /// virtio-blk; `None`: QEMU serves them all (the default).
    pub memfold_blk: Option<BlkDisks>,
    /// The enlightened guest's channel (issue 17, docs/enlightened.md): a virtio-serial
    /// port `org.memfold.guest.0` whose host side QEMU serves on this Unix socket
    /// (`server=on,wait=off`), for memfoldd's `--guest-channels` folder
    /// (`DIR/NAME.sock`); `None`: none. With it QEMU also gets memfoldd's monitor (as
    /// with [`GuestSpec::memfold_balloon`], no balloon), where memfoldd asks how QEMU laid
    /// out the guest's RAM.
    pub guest_channel: Option<std::path::PathBuf>,
}

impl GuestSpec {
    /// A plain guest `name` of `profile` with `mem_mib` MiB of RAM backed by `ram`: one
    /// vCPU, no cgroup, RAM mergeable, no balloon, no data disk, no kernel arguments of
    /// its own. Callers change what differs with struct update syntax.
    pub fn new(name: &str, profile: &str, mem_mib: u32, ram: RamBackend) -> GuestSpec {
        GuestSpec {
            name: name.into(),
            profile: profile.into(),
            mem_mib,
            ram,
            cpus: 1,
            cgroup_procs: None,
            mem_merge: true,
            free_page_reporting: false,
            memfold_balloon: false,
            data_disk: None,
            data_disk_direct: false,
            kernel_args: None,
            memfold_blk: None,
            guest_channel: None,
        }
    }
}

/// A read-only virtio disk of data for a page-cache workload. The guest finds it by its
/// serial, [`DATA_DISK_SERIAL`] (`/sys/block/vdX/serial`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DataDisk {
    /// The raw image file, read only (several guests may read one file).
    pub path: PathBuf,
    /// QEMU's read throttle (`bps_rd`), bytes per second: the speed of the disk the
    /// workload stands on; `None`: as fast as the host's file (its page cache).
    pub read_bytes_per_sec: Option<u64>,
}

/// The virtio serial of a [`DataDisk`].
pub const DATA_DISK_SERIAL: &str = "memfold-data";

/// Launcher errors.
#[derive(Debug, thiserror::Error)]
pub enum VmError {
    /// No QEMU binary.
    #[error("qemu-system-x86_64 not found: install Debian's qemu-system-x86 (make setup does)")]
    QemuMissing,
    /// Image problem.
    #[error(transparent)]
    Image(#[from] ImageError),
    /// QEMU could not be started.
    #[error("guest {name}: cannot start QEMU: {source}")]
    Spawn {
        /// Guest.
        name: String,
        /// OS error.
        source: std::io::Error,
    },
    /// QEMU exited.
    #[error("guest {name}: QEMU exited ({status}); serial log ends:\n{tail}")]
    Exited {
        /// Guest.
        name: String,
        /// Exit status.
        status: String,
        /// End of the serial log and QEMU's stderr.
        tail: String,
    },
    /// No readiness marker in time.
    #[error("guest {name}: not ready after {secs} s; serial log ends:\n{tail}")]
    NotReady {
        /// Guest.
        name: String,
        /// Timeout, s.
        secs: u64,
        /// End of the serial log.
        tail: String,
    },
    /// QMP failed.
    #[error("guest {name}: {source}")]
    Qmp {
        /// Guest.
        name: String,
        /// QMP error.
        source: QmpError,
    },
    /// A memfold-blk device could not be set up.
    #[error("guest {name}: memfold-blk for its {disk} disk: {what}")]
    Blk {
        /// Guest.
        name: String,
        /// `data` or `root`.
        disk: &'static str,
        /// What went wrong.
        what: String,
    },
    /// Work folder I/O.
    #[error("guest work folder {path}: {source}")]
    Io {
        /// Path.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
}

/// A running guest.
pub struct Guest {
    /// Its name.
    pub name: String,
    /// Its profile.
    pub profile: String,
    /// RAM size, bytes.
    pub mem_bytes: u64,
    /// RAM backing.
    pub ram: RamBackend,
    /// QEMU's pid.
    pub pid: u32,
    /// QMP socket.
    pub qmp_path: PathBuf,
    /// Serial console log.
    pub serial_path: PathBuf,
    stderr_path: PathBuf,
    child: Option<Child>,
    /// The memfold-blk processes serving its disks (restarted if they die), killed after
    /// QEMU stops.
    blk: Vec<BlkSupervisor>,
    /// When QEMU was started.
    pub started: Instant,
    /// Its self-check's progress, read from the console at each look
    /// ([`Guest::check_alive`], [`Guest::mismatches`]).
    self_check: std::sync::Mutex<SelfCheckWatch>,
}

fn qemu_binary() -> Result<PathBuf, VmError> {
    let name = "qemu-system-x86_64";
    std::env::var_os("PATH")
        .and_then(|paths| {
            std::env::split_paths(&paths)
                .map(|d| d.join(name))
                .find(|p| p.is_file())
        })
        .ok_or(VmError::QemuMissing)
}

/// Whether KVM can run guests here: `/dev/kvm` opens and a tiny guest reaches its
/// readiness marker under KVM within 20 s (on some nested hosts KVM opens but guests hang).
/// The answer is cached per host boot in the image cache. Needs the `tiny` image; without
/// it, TCG.
pub fn detect_accel(cache: &Path) -> Accel {
    if std::env::var("MEMFOLD_ACCEL").as_deref() == Ok("tcg") {
        return Accel::Tcg;
    }
    if std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open("/dev/kvm")
        .is_err()
    {
        return Accel::Tcg;
    }
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap_or_default();
    let stamp = cache.join("accel-probe");
    if let Ok(s) = std::fs::read_to_string(&stamp) {
        if let Some((b, a)) = s.split_once(' ') {
            if b == boot.trim() {
                return if a.trim() == "kvm" {
                    Accel::Kvm
                } else {
                    Accel::Tcg
                };
            }
        }
    }
    probe_and_stamp(&stamp, boot.trim(), || {
        // A new private folder: the probe runs as root, and a folder of a predictable name
        // in /tmp could be another user's, with links planted where QEMU writes.
        let dir = probe_dir(&std::env::temp_dir())
            .map_err(|e| tracing::warn!("KVM probe: {e}; using TCG"))
            .ok()?;
        let spec = GuestSpec::new("kvm-probe", "tiny", 128, RamBackend::Anonymous);
        let mut g = Guest::start(&spec, cache, dir.path(), Accel::Kvm)
            .map_err(|e| tracing::warn!("KVM probe: {e}; using TCG this time"))
            .ok()?;
        let ok = g.wait_ready(Duration::from_secs(20)).is_ok();
        g.stop();
        Some(ok)
    })
}

/// Environment that loads memfold's agent (`libmemfold_agent.so` at `agent`) into a
/// guest's QEMU and points it at memfoldd's `socket`. The guest needs [`RamBackend::Memfd`].
pub fn agent_env(agent: &Path, socket: &Path, spec: &GuestSpec) -> Vec<(String, String)> {
    vec![
        ("LD_PRELOAD".into(), agent.display().to_string()),
        ("MEMFOLD_SOCKET".into(), socket.display().to_string()),
        ("MEMFOLD_VM_NAME".into(), spec.name.clone()),
        (
            "MEMFOLD_RAM_BYTES".into(),
            (spec.mem_mib as u64 * 1024 * 1024).to_string(),
        ),
    ]
}

impl Guest {
    /// Starts QEMU for `spec` with its work files under `workdir/<name>`.
    ///
    /// Errors: [`VmError::QemuMissing`], [`VmError::Image`] (unknown or unbuilt profile),
    /// [`VmError::Spawn`], [`VmError::Io`].
    pub fn start(
        spec: &GuestSpec,
        cache: &Path,
        workdir: &Path,
        accel: Accel,
    ) -> Result<Guest, VmError> {
        Self::start_with_env(spec, cache, workdir, accel, &[])
    }

    /// [`Guest::start`] with extra environment variables for QEMU (memfold's agent is
    /// attached this way: `LD_PRELOAD`, `MEMFOLD_SOCKET`, see [`agent_env`]).
    ///
    /// Errors: as [`Guest::start`].
    pub fn start_with_env(
        spec: &GuestSpec,
        cache: &Path,
        workdir: &Path,
        accel: Accel,
        env: &[(String, String)],
    ) -> Result<Guest, VmError> {
        let qemu = qemu_binary()?;
        let img = images::image(cache, &spec.profile)?;
        let dir = workdir.join(&spec.name);
        std::fs::create_dir_all(&dir).map_err(|source| VmError::Io {
            path: dir.clone(),
            source,
        })?;
        let qmp_path = dir.join("qmp.sock");
        let serial_path = dir.join("serial.log");
        let stderr_path = dir.join("qemu.stderr");
        let _ = std::fs::remove_file(&qmp_path);
        // A folder's earlier guest left its console: its MEMFOLD-READY (and its rounds)
        // would be read as this guest's until QEMU truncates the file, later.
        if let Err(source) = std::fs::remove_file(&serial_path) {
            if source.kind() != std::io::ErrorKind::NotFound {
                return Err(VmError::Io {
                    path: serial_path,
                    source,
                });
            }
        }
        let mut blk = Vec::new();
        if let Some(b) = &spec.memfold_blk {
            blk = start_blk(spec, b, &img, &dir)?;
        }
        let mut cmd = Command::new(qemu);
        cmd.envs(env.iter().map(|(k, v)| (k, v)));
        // Experiments (e.g. `init_on_alloc=0`, docs/live.md) add guest kernel arguments.
        let extra = std::env::var("MEMFOLD_KERNEL_ARGS").ok();
        cmd.args(qemu_args(
            spec,
            &img,
            accel,
            &serial_path,
            &qmp_path,
            extra.as_deref(),
        ));
        let stderr = File::create(&stderr_path).map_err(|source| VmError::Io {
            path: stderr_path.clone(),
            source,
        })?;
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        let no_thp = spec.ram == RamBackend::AnonymousNoThp;
        let cgroup = spec
            .cgroup_procs
            .as_ref()
            .map(|p| std::ffi::CString::new(p.as_os_str().as_encoded_bytes()))
            .transpose()
            .map_err(|e| VmError::Io {
                path: spec.cgroup_procs.clone().unwrap_or_default(),
                source: e.into(),
            })?;
        // SAFETY: only async-signal-safe calls (open, write, close, prctl, setsid) between
        // fork and exec, on memory made before the fork.
        unsafe {
            cmd.pre_exec(move || {
                if let Some(procs) = &cgroup {
                    // "0": the writing process itself joins.
                    let fd = libc::open(procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                    if fd < 0 || libc::write(fd, b"0".as_ptr().cast(), 1) != 1 {
                        return Err(std::io::Error::last_os_error());
                    }
                    libc::close(fd);
                }
                // Inherited across execve: QEMU's MADV_HUGEPAGE then has no effect.
                if no_thp {
                    rustix::thread::disable_transparent_huge_pages(true)?;
                }
                rustix::process::set_parent_process_death_signal(Some(
                    rustix::process::Signal::KILL,
                ))?;
                rustix::process::setsid()?;
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(|source| VmError::Spawn {
            name: spec.name.clone(),
            source,
        })?;
        Ok(Guest {
            name: spec.name.clone(),
            profile: spec.profile.clone(),
            mem_bytes: spec.mem_mib as u64 * 1024 * 1024,
            ram: spec.ram,
            pid: child.id(),
            qmp_path,
            serial_path,
            stderr_path,
            child: Some(child),
            blk,
            started: Instant::now(),
            self_check: Default::default(),
        })
    }

    /// QEMU's standard error so far, where a preloaded agent logs (empty if unreadable).
    pub fn qemu_log(&self) -> String {
        std::fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }

    /// The serial log so far.
    pub fn serial(&self) -> String {
        console_since(&self.serial_path, 0)
    }

    /// Bytes of the serial log file so far: a mark for [`Guest::serial_since`].
    pub fn serial_len(&self) -> u64 {
        console_len(&self.serial_path)
    }

    /// The serial log from byte `offset` of the file on (a [`Guest::serial_len`] mark).
    pub fn serial_since(&self, offset: u64) -> String {
        console_since(&self.serial_path, offset)
    }

    fn tail(&self) -> String {
        let serial = self.serial();
        let lines: Vec<&str> = serial.lines().collect();
        let mut t = lines[lines.len().saturating_sub(12)..].join("\n");
        if let Ok(e) = std::fs::read_to_string(&self.stderr_path) {
            if !e.trim().is_empty() {
                t.push_str("\nqemu: ");
                t.push_str(e.trim());
            }
        }
        t
    }

    /// Pins every thread of this guest's QEMU (and so the threads it starts later, which
    /// inherit the mask) to host CPU `cpu`. Side-by-side measurements pin two guests to
    /// one CPU so that they get equal shares of it.
    ///
    /// Errors: the threads cannot be listed or a mask cannot be set (QEMU gone, no such
    /// CPU).
    pub fn pin_to_cpu(&self, cpu: usize) -> std::io::Result<()> {
        let mut set = rustix::thread::CpuSet::new();
        set.set(cpu);
        for t in std::fs::read_dir(format!("/proc/{}/task", self.pid))? {
            let tid: i32 = t?.file_name().to_string_lossy().parse().unwrap_or(0);
            if let Some(tid) = rustix::process::Pid::from_raw(tid) {
                rustix::thread::sched_setaffinity(Some(tid), &set)?;
            }
        }
        Ok(())
    }

    /// Checks QEMU still runs.
    ///
    /// Errors: [`VmError::Exited`] with the log's end.
    pub fn check_alive(&mut self) -> Result<(), VmError> {
        self.watch_self_check();
        if let Some(c) = self.child.as_mut() {
            if let Ok(Some(status)) = c.try_wait() {
                self.child = None;
                return Err(VmError::Exited {
                    name: self.name.clone(),
                    status: status.to_string(),
                    tail: self.tail(),
                });
            }
        }
        Ok(())
    }

    /// Waits until the guest prints `MEMFOLD-READY` on its console; returns the time
    /// since start.
    ///
    /// Errors: [`VmError::Exited`], [`VmError::NotReady`] after `timeout`.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<Duration, VmError> {
        let deadline = Instant::now() + timeout;
        loop {
            if self.serial().contains("MEMFOLD-READY") {
                return Ok(self.started.elapsed());
            }
            self.check_alive()?;
            if Instant::now() > deadline {
                return Err(VmError::NotReady {
                    name: self.name.clone(),
                    secs: timeout.as_secs(),
                    tail: self.tail(),
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// Its virtio balloon as the guest reported it on its console ([`balloon_report`]).
    pub fn balloon(&self) -> Option<BalloonReport> {
        balloon_report(&self.serial())
    }

    /// Self-check failures: the mismatches the guest reported on its console (lines with
    /// `MEMFOLD-MISMATCH`), then a line `MEMFOLD-SELF-CHECK-STALLED: …` if its self-check
    /// went [`SELF_CHECK_STALL`] or longer without a new pass after its first, as seen
    /// by the looks so far (this one and every [`Guest::check_alive`]): a run that looks
    /// every second sees a stall to the second.
    pub fn mismatches(&self) -> Vec<String> {
        let stall = self.watch_self_check();
        self.serial()
            .lines()
            .filter(|l| l.contains("MEMFOLD-MISMATCH"))
            .map(String::from)
            .chain(stall)
            .collect()
    }

    /// Reads the console written since the last look into the self-check watch; returns
    /// its stall line, if any.
    fn watch_self_check(&self) -> Option<String> {
        let mut w = self
            .self_check
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let new = console_bytes_since(&self.serial_path, w.read);
        w.observe(&new, Instant::now());
        w.stall_line()
    }

    /// A QMP session.
    ///
    /// Errors: [`VmError::Qmp`].
    pub fn qmp(&self) -> Result<Qmp, VmError> {
        Qmp::connect(&self.qmp_path, Duration::from_secs(10)).map_err(|source| VmError::Qmp {
            name: self.name.clone(),
            source,
        })
    }

    /// Whether QEMU is stopped (state `T`): paused by its memfold agent failing closed
    /// (`SIGSTOP`), or by someone else's stop signal.
    pub fn is_stopped(&self) -> bool {
        self.child.is_some()
            && std::fs::read_to_string(format!("/proc/{}/stat", self.pid))
                .is_ok_and(|s| stat_state(&s) == Some('T'))
    }

    /// Stops QEMU: QMP `quit`, then SIGKILL if it has not exited within 5 s; a stopped
    /// QEMU (which cannot answer QMP) gets SIGKILL at once. Idempotent.
    pub fn stop(&mut self) {
        self.stop_qemu();
        for mut s in self.blk.drain(..) {
            s.stop();
        }
    }

    /// The memfold-blk processes serving its disks: (disk, pid now, restarts so far); pid
    /// `None` while one is being restarted.
    pub fn blk_processes(&self) -> Vec<(&'static str, Option<u32>, u32)> {
        self.blk
            .iter()
            .map(|s| (s.disk(), s.pid(), s.restarts()))
            .collect()
    }

    fn stop_qemu(&mut self) {
        let stopped = self.is_stopped();
        let Some(mut child) = self.child.take() else {
            return;
        };
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        if stopped {
            let _ = child.kill();
            let _ = child.wait();
            return;
        }
        // Bounded as a whole (greeting, capabilities, the answer): a QEMU whose main loop
        // is stuck, or a monitor another client holds, is killed below, not waited on.
        if let Ok(mut q) = Qmp::connect_within(&self.qmp_path, Duration::from_secs(2)) {
            let _ = q.execute("quit", None);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

/// A guest's virtio balloon as its init reports it on the console before it is ready
/// (`MEMFOLD-BALLOON driver=<driver> reporting=<0|1>`, images/guest-init).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BalloonReport {
    /// The driver bound to the balloon device (`virtio_balloon`; `none`: not loaded).
    pub driver: String,
    /// Whether the driver negotiated free page reporting (VIRTIO_BALLOON_F_REPORTING).
    pub reporting: bool,
}

/// The first `MEMFOLD-BALLOON` line of a guest's console text (`None`: the guest saw no
/// balloon device, or its init does not look).
pub fn balloon_report(serial: &str) -> Option<BalloonReport> {
    let rest = serial
        .lines()
        .find_map(|l| l.split("MEMFOLD-BALLOON ").nth(1))?;
    let field = |k: &str| {
        rest.split_whitespace()
            .find_map(|f| f.strip_prefix(k)?.strip_prefix('='))
    };
    Some(BalloonReport {
        driver: field("driver")?.to_string(),
        reporting: field("reporting")? == "1",
    })
}

/// The state letter of a `/proc/PID/stat` line: `R` running, `S` sleeping, `D` waiting
/// on I/O, `T` stopped, `t` stopped by a tracer, `Z` a zombie. The command before it is
/// in parentheses and may itself hold spaces and parentheses: the state follows the last
/// `) `. `None` for a line without one.
pub fn stat_state(stat: &str) -> Option<char> {
    stat.rsplit_once(") ")?.1.chars().next()
}

/// Bytes of the console log at `path` (0 if unreadable).
fn console_len(path: &Path) -> u64 {
    std::fs::metadata(path).map_or(0, |m| m.len())
}

/// The console log at `path` from byte `offset` on, cut before it is decoded (read from
/// there, not read whole and sliced): a mark taken mid-character (lossy decoding makes
/// one byte three) would fall inside a later character and lose all the text after it.
fn console_since(path: &Path, offset: u64) -> String {
    String::from_utf8_lossy(&console_bytes_since(path, offset)).into_owned()
}

/// The console log's bytes at `path` from byte `offset` on (none if unreadable).
fn console_bytes_since(path: &Path, offset: u64) -> Vec<u8> {
    use std::io::{Seek, SeekFrom};
    let mut b = Vec::new();
    if let Ok(mut f) = File::open(path) {
        // Past the end, a read gives nothing.
        if f.seek(SeekFrom::Start(offset)).is_ok() {
            let _ = f.read_to_end(&mut b);
        }
    }
    b
}

impl Drop for Guest {
    fn drop(&mut self) {
        self.stop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_console_mark_taken_mid_character_keeps_the_rounds_after_it() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("serial.log");
        std::fs::write(&path, b"MEMFOLD-RATE web-req/s 10\n\xC3").unwrap();
        let mark = console_len(&path);
        // The rest of "é", then "€": the old mark (in lossy text) fell inside "€".
        let mut all = std::fs::read(&path).unwrap();
        all.extend_from_slice(b"\xA9\xE2\x82\xAC\nMEMFOLD-RATE web-req/s 20\n");
        std::fs::write(&path, &all).unwrap();
        let since = console_since(&path, mark);
        assert!(since.contains("MEMFOLD-RATE web-req/s 20\n"), "{since:?}");
        assert!(!since.contains("web-req/s 10"), "{since:?}");
    }

    #[test]
    fn the_balloon_line_is_read_from_the_console() {
        let serial =
            "boot\n[ 1.0] x MEMFOLD-BALLOON driver=virtio_balloon reporting=1\nMEMFOLD-READY web\n";
        assert_eq!(
            balloon_report(serial),
            Some(BalloonReport {
                driver: "virtio_balloon".into(),
                reporting: true
            })
        );
        assert_eq!(
            balloon_report("MEMFOLD-BALLOON driver=none reporting=0"),
            Some(BalloonReport {
                driver: "none".into(),
                reporting: false
            })
        );
        assert_eq!(balloon_report("MEMFOLD-READY web"), None);
        assert_eq!(balloon_report("MEMFOLD-BALLOON driver=x"), None);
    }

    #[test]
    fn the_state_is_read_after_the_command_whatever_it_holds() {
        assert_eq!(
            stat_state("4242 (qemu-system-x86) T 1 4242 4242 0 -1 4194560 9 0"),
            Some('T')
        );
        assert_eq!(stat_state("17 (bash) S 16 17"), Some('S'));
        // A command may hold spaces and ") " itself (comm is up to 15 bytes of anything).
        assert_eq!(stat_state("9 (a) R (b c) t 1 9"), Some('t'));
        assert_eq!(stat_state("9 (x)) Z 1"), Some('Z'));
        assert_eq!(stat_state(""), None);
        assert_eq!(stat_state("9 (no state)"), None);
    }

    #[test]
    fn a_stopped_process_reads_as_stopped() {
        struct Killed(Child);
        impl Drop for Killed {
            fn drop(&mut self) {
                let _ = self.0.kill();
                let _ = self.0.wait();
            }
        }
        let p = Killed(Command::new("sleep").arg("30").spawn().unwrap());
        let pid = rustix::process::Pid::from_child(&p.0);
        let state =
            || stat_state(&std::fs::read_to_string(format!("/proc/{}/stat", p.0.id())).unwrap());
        rustix::process::kill_process(pid, rustix::process::Signal::STOP).unwrap();
        let t = Instant::now();
        while state() != Some('T') {
            assert!(t.elapsed() < Duration::from_secs(5), "state {:?}", state());
            std::thread::sleep(Duration::from_millis(10));
        }
        rustix::process::kill_process(pid, rustix::process::Signal::CONT).unwrap();
        while state() == Some('T') {
            assert!(t.elapsed() < Duration::from_secs(5), "still stopped");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}
