//! memfold on QEMU command lines it did not write (issue 20). Each test writes a plain
//! QEMU command line itself — not memfold's launcher — for the `tiny` guest, and runs it
//! through `memfold qemu` (this crate's binary), which checks guest RAM and execs QEMU
//! with the agent preloaded; memfoldd is this crate's too. No RAM size is given to the
//! agent anywhere: it finds guest RAM itself.
//!
//! - one memory backend (`-machine memory-backend=`): the guest attaches under its
//!   `-name`, memfoldd's books show pages shared and zero pages reclaimed, and the
//!   guest's self-checks keep passing;
//! - two memory backends (two NUMA nodes, a vCPU on each): the agent attaches both
//!   regions, as `NAME/ram0` and `NAME/ram1`, each with its own size, each showing
//!   savings, and the self-checks pass;
//! - a memory backend added with QMP `object-add` while the guest runs: attached as
//!   `NAME/ram1`; after `object-del` its agent detaches and memfoldd releases it;
//! - RAM that is not shareable: `memfold qemu` refuses a plain `-m` with exit status 2 and
//!   the exact fix, starting nothing; and QEMU started by hand with the agent preloaded
//!   on such RAM runs unmanaged with one log line that says what to add.
//!
//! Each is bounded (90 s at most under TCG). Run them one at a time with other
//! guest-booting tests (`flock /tmp/measure.lock cargo test ...` on a shared host).

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use memfold_live::query_stats;
use memfold_vm::images;
use memfold_wire::Stats;

mod common;
use common::{agent_lib, Killed};

/// memfoldd at `socket`, sharing and reclaiming zero pages at full speed.
fn memfoldd(socket: &Path) -> Killed {
    memfoldd_logged(socket, None)
}

/// As [`memfoldd`], its log written to `log` if given (inherited otherwise).
fn memfoldd_logged(socket: &Path, log: Option<&Path>) -> Killed {
    let dir = socket
        .parent()
        .expect("in a folder")
        .to_str()
        .expect("UTF-8");
    let start = |args: &[&str]| match log {
        Some(log) => common::memfoldd_logged(socket, args, log),
        None => common::memfoldd(socket, args),
    };
    start(&[
        "--rate",
        "0",
        "--min-scan-interval-ms",
        "500",
        "--policy",
        "sharing",
        "--swap-dir",
        dir,
    ])
}

/// The `tiny` image, built if needed.
fn tiny() -> images::Image {
    let cache = images::cache_dir();
    images::build(&cache, "tiny", |l| eprintln!("{l}")).expect("tiny image builds");
    images::image(&cache, "tiny").expect("tiny image")
}

/// A plain QEMU command line for the tiny guest, as an operator would write it, with
/// `ram` (the RAM options) in the middle; console to `serial`.
fn qemu_line(name: &str, ram: &str, smp: u32, serial: &Path, img: &images::Image) -> Vec<String> {
    let mut v: Vec<String> = format!(
        "qemu-system-x86_64 -name {name} -accel tcg -machine q35 {ram} -smp {smp} -display none -vga none -nodefaults -no-reboot"
    )
    .split_whitespace()
    .map(String::from)
    .collect();
    v.push("-serial".into());
    v.push(format!("file:{}", serial.display()));
    v.push("-kernel".into());
    v.push(img.kernel.display().to_string());
    v.push("-initrd".into());
    v.push(img.initrd.display().to_string());
    v.push("-append".into());
    v.push("console=ttyS0 panic=-1 quiet".into());
    v
}

/// Runs `memfold qemu --socket S -- LINE`, QEMU's stderr to `log`.
fn memfold_qemu(socket: &Path, line: &[String], log: &Path) -> Killed {
    Killed(
        Command::new(env!("CARGO_BIN_EXE_memfold"))
            .arg("qemu")
            .arg("--socket")
            .arg(socket)
            .arg("--")
            .args(line)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(log).unwrap())
            .spawn()
            .expect("memfold qemu starts"),
    )
}

/// Lines of the console starting with `marker`.
fn count(serial: &Path, marker: &str) -> usize {
    std::fs::read_to_string(serial)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.starts_with(marker))
        .count()
}

/// The console's mismatch lines (the guest's self-check failing).
fn mismatches(serial: &Path) -> Vec<String> {
    std::fs::read_to_string(serial)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains("MEMFOLD-MISMATCH"))
        .map(String::from)
        .collect()
}

/// Waits (120 s at most: a TCG boot on a loaded host) until the guest is up: `MEMFOLD-READY` on its console.
fn wait_ready(qemu: &mut Killed, serial: &Path, log: &Path) {
    wait_console(
        qemu,
        serial,
        log,
        "MEMFOLD-READY",
        1,
        Duration::from_secs(120),
    );
}

/// Waits (90 s at most) for `rounds` more self-check rounds, and checks none of the
/// guest's self-checks ever failed.
fn checks_pass(qemu: &mut Killed, serial: &Path, log: &Path, rounds: usize) {
    let n = count(serial, "MEMFOLD-CHECK ok");
    wait_console(
        qemu,
        serial,
        log,
        "MEMFOLD-CHECK ok",
        n + rounds,
        Duration::from_secs(90),
    );
    assert!(mismatches(serial).is_empty(), "{:?}", mismatches(serial));
}

/// Waits until `qemu` (still running) has printed `marker` `n` times in all; panics with
/// the console and log after `within`.
fn wait_console(
    qemu: &mut Killed,
    serial: &Path,
    log: &Path,
    marker: &str,
    n: usize,
    within: Duration,
) {
    let t = Instant::now();
    while count(serial, marker) < n {
        let tail = || {
            format!(
                "console: {}\nlog: {}",
                std::fs::read_to_string(serial).unwrap_or_default(),
                std::fs::read_to_string(log).unwrap_or_default()
            )
        };
        assert!(
            qemu.0.try_wait().unwrap().is_none(),
            "QEMU exited; {}",
            tail()
        );
        assert!(mismatches(serial).is_empty(), "{:?}", mismatches(serial));
        assert!(
            t.elapsed() < within,
            "no {n}× {marker} within {within:?}; {}",
            tail()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// Polls memfoldd's statistics until `done` holds; panics with them after `within`.
fn wait_stats(socket: &Path, within: Duration, done: impl Fn(&Stats) -> bool) -> Stats {
    let t = Instant::now();
    loop {
        let s = query_stats(socket);
        if let Ok(s) = &s {
            if done(s) {
                return s.clone();
            }
        }
        assert!(
            t.elapsed() < within,
            "not reached within {within:?}: {s:#?}"
        );
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// Savings memfoldd booked for a guest: pages shared or reclaimed.
fn saved(s: &Stats, name: &str) -> u64 {
    s.vms
        .iter()
        .filter(|v| v.name == name)
        .map(|v| v.shared_pages + v.zero_reclaimed_pages)
        .sum()
}

/// The work folder of a test: memfoldd's socket, the console, QEMU's log.
fn work() -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().to_path_buf();
    (
        dir,
        p.join("memfoldd.sock"),
        p.join("serial.log"),
        p.join("qemu.log"),
    )
}

#[test]
fn a_hand_written_command_line_runs_through_memfold_qemu_and_saves_memory() {
    let img = tiny();
    let (_dir, socket, serial, log) = work();
    let _daemon = memfoldd(&socket);
    let ram = "-object memory-backend-memfd,id=mem,size=256M,share=on -machine memory-backend=mem -m 256M";
    let line = qemu_line("own1", ram, 1, &serial, &img);
    let mut qemu = memfold_qemu(&socket, &line, &log);
    wait_ready(&mut qemu, &serial, &log);
    let s = wait_stats(&socket, Duration::from_secs(40), |s| {
        s.vms.iter().any(|v| {
            v.name == "own1"
                && v.pid == qemu.0.id()
                && v.shared_pages > 0
                && v.zero_reclaimed_pages > 0
        })
    });
    let v = s.vms.iter().find(|v| v.name == "own1").unwrap();
    assert_eq!(
        v.pages,
        256 * 256,
        "the whole backend, found without a size"
    );
    eprintln!(
        "own1: {} pages shared, {} zero pages reclaimed",
        v.shared_pages, v.zero_reclaimed_pages
    );
    // Self-checks pass over the managed RAM (CoW breaks and refills included).
    checks_pass(&mut qemu, &serial, &log, 2);
}

#[test]
fn a_guest_with_two_memory_backends_has_both_regions_managed() {
    let img = tiny();
    let (_dir, socket, serial, log) = work();
    let _daemon = memfoldd(&socket);
    // Two NUMA nodes of different sizes, a vCPU on each, so that both nodes' memory is
    // used by the guest's workload.
    let ram = "-object memory-backend-memfd,id=m0,size=160M -object memory-backend-memfd,id=m1,size=96M,share=on -m 256M -numa node,nodeid=0,cpus=0,memdev=m0 -numa node,nodeid=1,cpus=1,memdev=m1";
    let line = qemu_line("own2", ram, 2, &serial, &img);
    let mut qemu = memfold_qemu(&socket, &line, &log);
    wait_ready(&mut qemu, &serial, &log);
    let s = wait_stats(&socket, Duration::from_secs(45), |s| {
        saved(s, "own2/ram0") > 0 && saved(s, "own2/ram1") > 0
    });
    let mut pages: Vec<u64> = ["own2/ram0", "own2/ram1"]
        .iter()
        .map(|n| s.vms.iter().find(|v| &v.name == n).unwrap().pages)
        .collect();
    pages.sort_unstable();
    assert_eq!(
        pages,
        [96 * 256, 160 * 256],
        "each region with its own size"
    );
    assert!(
        s.vms.iter().all(|v| v.name.starts_with("own2/ram")),
        "only the two regions attached: {:?}",
        s.vms.iter().map(|v| &v.name).collect::<Vec<_>>()
    );
    eprintln!(
        "own2: ram0 saved {} pages, ram1 saved {} pages",
        saved(&s, "own2/ram0"),
        saved(&s, "own2/ram1")
    );
    checks_pass(&mut qemu, &serial, &log, 2);
}

#[test]
fn ram_that_is_not_shareable_is_refused_or_left_alone_with_what_to_add() {
    let img = tiny();
    let (dir, socket, serial, log) = work();
    // memfold qemu refuses plain -m RAM: exit status 2, the fix, no QEMU started.
    let line = qemu_line("plain", "-m 128M", 1, &serial, &img);
    let mut refused = memfold_qemu(&socket, &line, &log);
    let t = Instant::now();
    let status = loop {
        if let Some(st) = refused.0.try_wait().unwrap() {
            break st;
        }
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "memfold qemu started QEMU"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let err = std::fs::read_to_string(&log).unwrap();
    assert_eq!(status.code(), Some(2), "{err}");
    assert!(
        err.contains("add `-object memory-backend-memfd,id=ram0,size=128M,share=on -machine memory-backend=ram0`"),
        "{err}"
    );
    assert!(!serial.exists(), "QEMU did not run");

    // The same line started by hand with the agent preloaded: the guest runs, unmanaged,
    // and QEMU's log says why in one line.
    let _daemon = memfoldd(&socket);
    let agent = agent_lib();
    let qlog = dir.path().join("qemu-plain.log");
    let mut qemu = Killed(
        Command::new(&line[0])
            .args(&line[1..])
            .env("LD_PRELOAD", &agent)
            .env("MEMFOLD_SOCKET", &socket)
            .env("MEMFOLD_VM_NAME", "plain")
            .stderr(std::fs::File::create(&qlog).unwrap())
            .spawn()
            .unwrap(),
    );
    wait_console(
        &mut qemu,
        &serial,
        &qlog,
        "MEMFOLD-CHECK ok",
        1,
        Duration::from_secs(60),
    );
    let text = std::fs::read_to_string(&qlog).unwrap();
    let lines: Vec<&str> = text.lines().filter(|l| l.contains("memfold")).collect();
    assert_eq!(lines.len(), 1, "one log line: {text}");
    assert!(
        lines[0].contains("guest RAM is not shareable, memfold leaves this guest alone: guest RAM is QEMU's anonymous memory (-m 128M without a memory backend); add `-object memory-backend-memfd,id=ram0,size=128M,share=on -machine memory-backend=ram0`"),
        "{text}"
    );
    let s = query_stats(&socket).unwrap();
    assert!(s.vms.is_empty(), "nothing attached: {:?}", s.vms);
}

#[test]
fn a_memory_backend_added_at_run_time_is_attached_and_detached_when_deleted() {
    let img = tiny();
    let (dir, socket, serial, log) = work();
    let daemon_log = dir.path().join("memfoldd.log");
    let _daemon = memfoldd_logged(&socket, Some(&daemon_log));
    let qmp = dir.path().join("qmp.sock");
    let ram = "-object memory-backend-memfd,id=mem,size=128M -machine memory-backend=mem -m 128M,slots=2,maxmem=1G";
    let mut line = qemu_line("own3", ram, 1, &serial, &img);
    line.push("-qmp".into());
    line.push(format!("unix:{},server=on,wait=off", qmp.display()));
    let mut qemu = memfold_qemu(&socket, &line, &log);
    wait_ready(&mut qemu, &serial, &log);
    wait_stats(&socket, Duration::from_secs(20), |s| {
        s.vms.iter().any(|v| v.name == "own3")
    });
    // A backend for a DIMM, created while the guest runs: QEMU maps it at once.
    let mut q = memfold_vm::qmp::Qmp::connect(&qmp, Duration::from_secs(10)).unwrap();
    q.execute(
        "object-add",
        Some(serde_json::json!({
            "qom-type": "memory-backend-memfd", "id": "hp1", "size": 64u64 << 20, "share": true
        })),
    )
    .unwrap();
    let s = wait_stats(&socket, Duration::from_secs(15), |s| {
        s.vms.iter().any(|v| v.name == "own3/ram1")
    });
    let v = s.vms.iter().find(|v| v.name == "own3/ram1").unwrap();
    assert_eq!(v.pages, 64 * 256, "the hot-plugged backend, whole");
    assert_eq!(v.pid, qemu.0.id());
    // Deleted again (never plugged into the guest): QEMU unmaps it, its agent detaches.
    q.execute("object-del", Some(serde_json::json!({ "id": "hp1" })))
        .unwrap();
    wait_stats(&socket, Duration::from_secs(15), |s| {
        s.vms.iter().all(|v| v.name != "own3/ram1") && s.vms.iter().any(|v| v.name == "own3")
    });
    // Seen at QEMU's munmap (the agent's interposer), or by the watcher's look after;
    // logged once the region's thread ends, which may be after memfoldd released it.
    let t = Instant::now();
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap();
        if text.contains("was unmapped (hot-unplug): detached")
            || t.elapsed() > Duration::from_secs(10)
        {
            break text;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(text.contains("appeared (hot-plug)"), "{text}");
    assert!(
        text.contains("was unmapped (hot-unplug): detached"),
        "{text}"
    );
    // memfoldd logs a region released, not a QEMU gone: the agent told it, and QEMU runs.
    let pid = qemu.0.id();
    let t = Instant::now();
    let released = format!("released (unmapped; QEMU pid {pid} runs on, its agent said so)");
    let daemon_text = loop {
        let d = std::fs::read_to_string(&daemon_log).unwrap();
        if d.contains(&released) || t.elapsed() > Duration::from_secs(5) {
            break d;
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(
        daemon_text
            .lines()
            .any(|l| l.contains("region own3/ram1 (") && l.contains(&released)),
        "{daemon_text}"
    );
    assert!(
        !daemon_text.contains("has exited"),
        "QEMU runs on: {daemon_text}"
    );
    // The guest runs on, its self-checks passing.
    checks_pass(&mut qemu, &serial, &log, 1);
}
