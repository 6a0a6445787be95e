//! Tests of how anonymous RAM is saved: against monitors served by this process, and one
//! QEMU stopped before its first instruction (`-S`).

use super::*;
use std::io::{BufRead, BufReader};
use std::os::unix::net::UnixListener;
use std::process::{Child, Command, Stdio};
use std::thread::JoinHandle;
use std::time::Duration;

use serde_json::Value;

const MIB: u64 = 1 << 20;

/// A monitor served by this process: greets, then answers every command with
/// `reply(command, arguments)` (its `id` echoed), and does what `pmemsave` asks as QEMU
/// does (the file truncated, then `size` bytes written: here the byte `addr >> 32`, so
/// the part from 4 GiB is told from the part from 0). Ends when the session closes, with
/// the commands it was sent, in order.
fn fake_monitor(
    dir: &Path,
    reply: impl Fn(&str, &Value) -> Value + Send + 'static,
) -> (PathBuf, JoinHandle<Vec<(String, Value)>>) {
    let path = dir.join("qmp.sock");
    let l = UnixListener::bind(&path).unwrap();
    let served = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut r = BufReader::new(s.try_clone().unwrap());
        writeln!(s, r#"{{"QMP": {{"version": {{}}, "capabilities": []}}}}"#).unwrap();
        let mut sent = Vec::new();
        let mut line = String::new();
        while r.read_line(&mut line).unwrap_or(0) > 0 {
            let c: Value = serde_json::from_str(&line).unwrap();
            line.clear();
            let command = c["execute"].as_str().unwrap().to_string();
            let args = c.get("arguments").cloned().unwrap_or(Value::Null);
            if command == "pmemsave" {
                let fill = (args["val"].as_u64().unwrap() >> 32) as u8;
                let size = args["size"].as_u64().unwrap() as usize;
                std::fs::write(args["filename"].as_str().unwrap(), vec![fill; size]).unwrap();
            }
            let mut answer = reply(&command, &args);
            answer["id"] = c["id"].clone();
            writeln!(s, "{answer}").unwrap();
            sent.push((command, args));
        }
        sent
    });
    (path, served)
}

/// A q35 monitor whose host bridge says `below` and `above` bytes.
fn q35(below: u64, above: u64) -> impl Fn(&str, &Value) -> Value + Send + 'static {
    move |command, args| match (command, args["path"].as_str()) {
        ("qom-get", Some("/machine/q35")) => match args["property"].as_str() {
            Some("below-4g-mem-size") => json!({ "return": below }),
            _ => json!({ "return": above }),
        },
        _ => json!({ "return": {} }),
    }
}

/// `ram_ranges`, `pmemsave_ranges` and `join_parts` in capture's order, against the
/// monitor at `sock`, for a guest of `mem_bytes`.
fn save(sock: &Path, ram: &Path, mem_bytes: u64) -> Result<(), CaptureError> {
    let mut q = Qmp::connect(sock, Duration::from_secs(20)).expect("QMP answers");
    let ranges = ram_ranges(&mut q, "g", mem_bytes)?;
    let parts = pmemsave_ranges(&mut q, "g", &ranges, ram)?;
    join_parts(ram, &parts)
}

/// The `pmemsave`s a monitor was sent, as (address, bytes, file).
fn pmemsaves(sent: &[(String, Value)]) -> Vec<(u64, u64, String)> {
    sent.iter()
        .filter(|(c, _)| c == "pmemsave")
        .map(|(_, a)| {
            let n = |k: &str| a[k].as_u64().unwrap();
            (n("val"), n("size"), a["filename"].as_str().unwrap().into())
        })
        .collect()
}

/// A q35 guest whose RAM QEMU splits around the PCI hole (3 pages: 2 from 0, 1 from 4
/// GiB) is saved in RAM-offset order: [0, below) from 0, then [below, RAM) from 4 GiB,
/// joined into one file. Seen failing with one `pmemsave` of [0, RAM) from 0 (the old
/// code): the PCI hole's bytes were saved and the RAM past 4 GiB never.
#[test]
fn split_ram_is_saved_in_ram_offset_order() {
    let dir = tempfile::tempdir().unwrap();
    let (sock, served) = fake_monitor(dir.path(), q35(2 * PAGE, PAGE));
    let ram = std::path::absolute(dir.path().join("g.ram")).unwrap();
    save(&sock, &ram, 3 * PAGE).unwrap();
    let part = format!("{}.part1", ram.display());
    assert_eq!(
        pmemsaves(&served.join().unwrap()),
        [
            (0, 2 * PAGE, ram.display().to_string()),
            (ABOVE_4G, PAGE, part.clone()),
        ]
    );
    let got = std::fs::read(&ram).unwrap();
    assert_eq!(got.len() as u64, 3 * PAGE);
    assert!(got[..2 * PAGE as usize].iter().all(|&b| b == 0), "from 0");
    assert!(
        got[2 * PAGE as usize..].iter().all(|&b| b == 1),
        "from 4 GiB"
    );
    assert!(!Path::new(&part).exists(), "the part file is left behind");
}

/// Saves a guest of 3 pages against a monitor answering with `reply`, and checks it got
/// one `pmemsave` of the whole RAM from 0.
fn saved_whole_from_0(reply: impl Fn(&str, &Value) -> Value + Send + 'static) {
    let dir = tempfile::tempdir().unwrap();
    let (sock, served) = fake_monitor(dir.path(), reply);
    let ram = std::path::absolute(dir.path().join("g.ram")).unwrap();
    save(&sock, &ram, 3 * PAGE).unwrap();
    assert_eq!(std::fs::metadata(&ram).unwrap().len(), 3 * PAGE);
    let sent = served.join().unwrap();
    assert_eq!(pmemsaves(&sent), [(0, 3 * PAGE, ram.display().to_string())]);
}

/// A q35 guest whose RAM all fits below the hole, and a machine whose host bridge does
/// not say (QEMU 7.2's pc), get one `pmemsave` of the whole RAM from 0.
#[test]
fn unsplit_ram_is_saved_whole_from_0() {
    saved_whole_from_0(q35(3 * PAGE, 0));
    saved_whole_from_0(|command, args| match command {
        "qom-get" => {
            let desc = format!("Device '{}' not found", args["path"].as_str().unwrap());
            json!({ "error": { "class": "DeviceNotFound", "desc": desc } })
        }
        _ => json!({ "return": {} }),
    });
}

/// A split that does not add up to the guest's RAM is refused before anything is saved,
/// naming the guest and the sizes.
#[test]
fn a_split_that_does_not_add_up_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let (sock, served) = fake_monitor(dir.path(), q35(2 * PAGE, 2 * PAGE));
    let ram = dir.path().join("g.ram");
    let e = save(&sock, &ram, 3 * PAGE).unwrap_err();
    assert!(matches!(e, CaptureError::RamSplit { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("guest g") && msg.contains("12288 bytes"),
        "{msg}"
    );
    assert!(pmemsaves(&served.join().unwrap()).is_empty());
    assert!(!ram.exists());
}

struct Stopped(Child);

impl Drop for Stopped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A real QEMU (q35, 128 MiB: 64 below the hole, 64 from 4 GiB by `max-ram-below-4g`,
/// `-S`: it never runs) whose RAM is a file here, with a marker every MiB at its RAM
/// offset: the saved file equals the RAM byte for byte past the first MiB (whose
/// guest-physical reads are the BIOS's and the VGA window's, not RAM). Seen failing with
/// one `pmemsave` of [0, RAM) from 0: [64 MiB, 128 MiB) held the hole's zeros.
#[test]
fn a_stopped_qemus_split_ram_is_saved_as_its_ram_block_holds_it() {
    let dir = tempfile::tempdir().unwrap();
    let (mem, below) = (128 * MIB, 64 * MIB);
    let backing = dir.path().join("backing");
    let mut ram_block = vec![0u8; mem as usize];
    for off in (MIB..mem).step_by(MIB as usize) {
        let marker = format!("RAM-OFFSET-{off:#x}");
        ram_block[off as usize..][..marker.len()].copy_from_slice(marker.as_bytes());
    }
    std::fs::write(&backing, &ram_block).unwrap();
    let sock = dir.path().join("qmp.sock");
    let child = Command::new("qemu-system-x86_64")
        .args([
            "-machine",
            &format!("q35,max-ram-below-4g={below},memory-backend=ram0"),
        ])
        .arg("-object")
        .arg(format!(
            "memory-backend-file,id=ram0,size={mem},share=on,mem-path={}",
            backing.display()
        ))
        .args([
            "-m",
            "128M",
            "-S",
            "-nodefaults",
            "-display",
            "none",
            "-accel",
            "tcg",
        ])
        .arg("-qmp")
        .arg(format!("unix:{},server=on,wait=off", sock.display()))
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .spawn()
        .expect("qemu-system-x86_64 runs (scripts/setup.sh installs it)");
    let _qemu = Stopped(child);
    let ram = dir.path().join("g.ram");
    save(&sock, &ram, mem).unwrap();
    let got = std::fs::read(&ram).unwrap();
    assert_eq!(got.len() as u64, mem);
    let m = MIB as usize;
    assert!(
        got[m..below as usize] == ram_block[m..below as usize],
        "below the hole"
    );
    assert!(
        got[below as usize..] == ram_block[below as usize..],
        "from 4 GiB"
    );
}
