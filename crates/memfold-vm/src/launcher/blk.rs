//! Disks served by memfold-blk (issue 16, Satori §4.1): which of a guest's disks it
//! serves, where its binary is, and starting one process per disk before QEMU.

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
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
) -> Result<Vec<Child>, VmError> {
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
        let overlay = dir.join("root.qcow2");
        let _ = std::fs::remove_file(&overlay);
        let out = Command::new("qemu-img")
            .args(["create", "-q", "-f", "qcow2", "-b"])
            .arg(rootfs)
            .args(["-F", "raw"])
            .arg(&overlay)
            .output()
            .map_err(|e| err("root", format!("qemu-img: {e}")))?;
        if !out.status.success() {
            return Err(err(
                "root",
                format!(
                    "qemu-img create: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                ),
            ));
        }
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
    let mut children: Vec<Child> = Vec::new();
    let kill_all = |children: &mut Vec<Child>| {
        for c in children.iter_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    };
    for (disk, args) in jobs {
        let sock = dir.join(format!("blk-{disk}.sock"));
        let _ = std::fs::remove_file(&sock);
        let log = dir.join(format!("blk-{disk}.log"));
        let stderr = File::create(&log).map_err(|source| VmError::Io {
            path: log.clone(),
            source,
        })?;
        let mut cmd = Command::new(&binary);
        cmd.args(&args)
            .arg("--socket")
            .arg(&sock)
            .arg("--stats")
            .arg(dir.join(format!("blk-{disk}.stats")))
            .args(["--queues", &spec.cpus.max(1).to_string()]);
        if let Some(l) = &b.landed_socket {
            cmd.arg("--landed-socket").arg(l);
        }
        cmd.stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(stderr);
        // SAFETY: only prctl between fork and exec.
        unsafe {
            cmd.pre_exec(|| {
                rustix::process::set_parent_process_death_signal(Some(
                    rustix::process::Signal::KILL,
                ))?;
                Ok(())
            });
        }
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => {
                kill_all(&mut children);
                return Err(err(disk, format!("{}: {e}", binary.display())));
            }
        };
        let deadline = Instant::now() + Duration::from_secs(10);
        while !sock.exists() {
            let exited = child.try_wait().ok().flatten();
            if exited.is_some() || Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                kill_all(&mut children);
                let tail = std::fs::read_to_string(&log).unwrap_or_default();
                return Err(err(
                    disk,
                    format!(
                        "no socket {} ({}): {}",
                        sock.display(),
                        exited.map_or("timed out".into(), |s| s.to_string()),
                        tail.trim()
                    ),
                ));
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        children.push(child);
    }
    Ok(children)
}
