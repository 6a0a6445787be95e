//! The `memfold-blk` binary given an overlay that is not over its base (issue 16, "bad
//! input"): it refuses to start — exit status 1, an error line naming both files and how
//! they differ, no socket made — and neither file is written.

use std::path::Path;
use std::process::Command;

fn qemu_img(args: &[&str]) {
    let st = Command::new("qemu-img").args(args).status().unwrap();
    assert!(st.success(), "qemu-img {args:?}");
}

fn bytes_and_mtime(p: &Path) -> (Vec<u8>, std::time::SystemTime) {
    (
        std::fs::read(p).unwrap(),
        std::fs::metadata(p).unwrap().modified().unwrap(),
    )
}

#[test]
fn memfold_blk_refuses_to_start_on_an_overlay_of_another_base() {
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let (a, b) = (d.path().join("a.img"), d.path().join("b.img"));
    std::fs::write(&a, vec![1u8; 1 << 20]).unwrap();
    std::fs::write(&b, vec![2u8; 1 << 20]).unwrap();
    let ov = d.path().join("ov.qcow2");
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-b",
        "a.img",
        "-F",
        "raw",
        ov.to_str().unwrap(),
    ]);
    let sock = d.path().join("blk.sock");
    let before = (bytes_and_mtime(&b), bytes_and_mtime(&ov));
    let log = d.path().join("blk.log");
    let mut child = Command::new(env!("CARGO_BIN_EXE_memfold-blk"))
        .arg("--socket")
        .arg(&sock)
        .arg("--base")
        .arg(&b)
        .arg("--overlay")
        .arg(&ov)
        .env("NO_COLOR", "1")
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    // It must exit by itself; one that serves is killed after 10 s and fails the test.
    let t = std::time::Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break Some(s);
        }
        if t.elapsed() > std::time::Duration::from_secs(10) {
            child.kill().unwrap();
            child.wait().unwrap();
            break None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    let err = std::fs::read_to_string(&log).unwrap();
    assert!(
        status.is_some(),
        "memfold-blk serves an overlay of another base: {err}"
    );
    let status = status.unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("does not match the base")
            && err.contains("ov.qcow2")
            && err.contains("b.img")
            && err.contains("backing file a.img"),
        "{err}"
    );
    assert!(!sock.exists());
    assert!(before == (bytes_and_mtime(&b), bytes_and_mtime(&ov)));
    // The right base starts (and is stopped at once).
    let mut ok = Command::new(env!("CARGO_BIN_EXE_memfold-blk"))
        .arg("--socket")
        .arg(&sock)
        .arg("--base")
        .arg(&a)
        .arg("--overlay")
        .arg(&ov)
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t = std::time::Instant::now();
    while !sock.exists() && t.elapsed() < std::time::Duration::from_secs(10) {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let made = sock.exists();
    ok.kill().unwrap();
    ok.wait().unwrap();
    assert!(made, "memfold-blk over its own base made no socket");
}
