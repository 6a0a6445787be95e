//! A guest started in a folder an earlier guest used is not ready by that guest's
//! console: a `QEMU` that never boots (a script that sleeps, first on `PATH` in this
//! test's own process) must not be found ready by the `MEMFOLD-READY` left in
//! `serial.log`. Fails with the old console kept.

use std::os::unix::fs::PermissionsExt;
use std::time::Duration;

use memfold_vm::images;
use memfold_vm::launcher::{Accel, Guest, GuestSpec, RamBackend, VmError};

#[test]
fn an_earlier_guests_console_does_not_make_a_new_one_ready() {
    let cache = images::cache_dir();
    images::build(&cache, "tiny", |l| eprintln!("{l}")).expect("tiny image builds");
    let bin = tempfile::tempdir().unwrap();
    let qemu = bin.path().join("qemu-system-x86_64");
    std::fs::write(&qemu, "#!/bin/sh\nexec sleep 30\n").unwrap();
    std::fs::set_permissions(&qemu, std::fs::Permissions::from_mode(0o755)).unwrap();
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut paths = vec![bin.path().to_path_buf()];
    paths.extend(std::env::split_paths(&path));
    // This test binary runs this one test: no other thread reads PATH meanwhile.
    std::env::set_var("PATH", std::env::join_paths(paths).unwrap());

    let work = tempfile::tempdir().unwrap();
    let folder = work.path().join("stale");
    std::fs::create_dir_all(&folder).unwrap();
    std::fs::write(
        folder.join("serial.log"),
        "MEMFOLD-CHECK ok 1\nMEMFOLD-READY\n",
    )
    .unwrap();
    let spec = GuestSpec::new("stale", "tiny", 128, RamBackend::Anonymous);
    let mut g = Guest::start(&spec, &cache, work.path(), Accel::Tcg).unwrap();
    let r = g.wait_ready(Duration::from_secs(2));
    g.stop();
    assert!(
        matches!(r, Err(VmError::NotReady { .. })),
        "ready by the earlier guest's console: {r:?}"
    );
}
