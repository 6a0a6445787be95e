//! A stop is not a crash: `memfold-blk` sent SIGTERM while serving closes its overlay
//! cleanly — synced, its dirty marker `<overlay>.memfold-dirty` removed — and exits 0, so
//! the next open needs no repair (`disk/repair.rs`). Killed (SIGKILL), the marker stays.

use std::path::Path;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

/// `memfold-blk` serving `ov` over `base`, once its socket exists.
fn serve(dir: &Path, base: &Path, ov: &Path) -> Child {
    let sock = dir.join("blk.sock");
    let _ = std::fs::remove_file(&sock);
    let child = Command::new(env!("CARGO_BIN_EXE_memfold-blk"))
        .arg("--socket")
        .arg(&sock)
        .arg("--base")
        .arg(base)
        .arg("--overlay")
        .arg(ov)
        .env("NO_COLOR", "1")
        .stderr(std::fs::File::create(dir.join("blk.log")).unwrap())
        .spawn()
        .unwrap();
    let t = Instant::now();
    while !sock.exists() {
        assert!(t.elapsed() < Duration::from_secs(10), "no socket");
        std::thread::sleep(Duration::from_millis(20));
    }
    child
}

#[test]
fn a_stopped_device_closes_its_overlay_cleanly_and_a_killed_one_leaves_the_marker() {
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let base = d.path().join("base.img");
    std::fs::write(&base, vec![1u8; 1 << 20]).unwrap();
    let ov = d.path().join("ov.qcow2");
    let st = Command::new("qemu-img")
        .args(["create", "-q", "-f", "qcow2", "-b"])
        .arg(&base)
        .args(["-F", "raw"])
        .arg(&ov)
        .status()
        .expect("qemu-img (scripts/setup.sh installs it)");
    assert!(st.success());
    let marker = d.path().join("ov.qcow2.memfold-dirty");
    let log = || std::fs::read_to_string(d.path().join("blk.log")).unwrap_or_default();

    let mut child = serve(d.path(), &base, &ov);
    assert!(marker.exists(), "no marker while serving: {}", log());
    // SAFETY: a signal to our own child, whose pid is live until we wait for it.
    assert_eq!(unsafe { libc::kill(child.id() as i32, libc::SIGTERM) }, 0);
    let status = child.wait().unwrap();
    assert!(status.success(), "{status:?}: {}", log());
    assert!(!marker.exists(), "marker left after a stop: {}", log());

    let mut child = serve(d.path(), &base, &ov);
    assert!(marker.exists());
    child.kill().unwrap();
    child.wait().unwrap();
    assert!(marker.exists(), "a killed device's marker is gone");
}
