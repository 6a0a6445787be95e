//! QEMU's own split of a guest's RAM below and above 4 GiB, asked over QMP
//! (`Qmp::ram_split`; issue 17: how an enlightened guest's frames map to gfns). Each
//! QEMU here is stopped before its first instruction (`-S`) and never touches its RAM:
//! a second of CPU each, no guest run.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use memfold_vm::qmp::Qmp;

const GIB: u64 = 1 << 30;

struct Stopped(Child);

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// QEMU's answer for `-machine MACHINE -m MEM`.
fn split(machine: &str, mem: &str) -> Option<(u64, u64)> {
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("qmp.sock");
    let child = Command::new("qemu-system-x86_64")
        .args(["-machine", machine, "-m", mem, "-S", "-nodefaults"])
        .args(["-display", "none", "-accel", "tcg"])
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", sock.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("qemu-system-x86_64 runs (scripts/setup.sh installs it)");
    let _qemu = Stopped(child);
    let mut q = Qmp::connect(&sock, Duration::from_secs(20)).expect("QMP answers");
    q.ram_split().expect("qom-get answers")
}

#[test]
fn qemu_says_where_it_put_the_ram_of_q35_and_pc_guests() {
    // q35: all low below 2.75 GiB; 2 GiB low from there.
    assert_eq!(split("q35", "512M"), Some((GIB / 2, 0)));
    assert_eq!(split("q35", "3G"), Some((2 * GIB, GIB)));
    assert_eq!(split("q35", "6G"), Some((2 * GIB, 4 * GIB)));
    // The operator's own split.
    assert_eq!(split("q35,max-ram-below-4g=1G", "3G"), Some((GIB, 2 * GIB)));
    // pc (i440fx) keeps more low, and says so from QEMU 8 on (7.2's host bridge has no
    // such properties: no answer, and memfoldd infers the split). An answer adds up.
    match split("pc", "5G") {
        Some((below, above)) => {
            assert_eq!(below + above, 5 * GIB);
            assert!(below > 2 * GIB && below < 4 * GIB, "{below:#x}");
        }
        None => eprintln!("this QEMU's pc machine does not say where its RAM lies"),
    }
}
