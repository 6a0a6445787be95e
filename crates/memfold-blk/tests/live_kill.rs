//! kill -9 of memfold-blk under I/O (issue 16, "Correct"): a tiny guest writes its data
//! disk (a memfold-blk qcow2 overlay over a random base) and reads it back with
//! `O_DIRECT`, round after round (images/tiny-init, `memfold.disk_rw`); the device is
//! killed with SIGKILL four times while it does (once anywhere, twice while it sleeps
//! inside a read request under its read throttle, once inside the system call that
//! writes a request's bytes or the overlay's metadata); the launcher's supervisor restarts it
//! on the same socket and QEMU reconnects. Checked: every read the guest made of every
//! slot it wrote and of the never-written base matched (no `MEMFOLD-RW-MISMATCH`); the
//! base's sums the guest read are the host's; every I/O error the guest saw was retried
//! and succeeded; the guest's rounds went on after each kill; after the guest stops,
//! each slot in the overlay (read through a fresh open) holds the bytes of the guest's
//! last completed write to it, and `qemu-img check` passes.
//!
//! Boots a QEMU guest under TCG (about 60 s): run it under the measurement lock on a
//! shared host, with an image cache of this branch's recipes:
//! `MEMFOLD_IMAGES=/work/images-blkfault flock /tmp/measure.lock cargo test --release
//! -p memfold-blk --test live_kill`.

use std::collections::BTreeMap;
use std::io::Read;
use std::time::{Duration, Instant};

use memfold_blk::disk::{Disk, OverlayDisk};
use memfold_vm::images;
use memfold_vm::launcher::{Accel, BlkDisks, DataDisk, Guest, GuestSpec, RamBackend};

const DISK_MIB: u64 = 16;
const SLOT: u64 = 256 << 10;
/// Rounds the guest runs (each: a slot written, every written slot and a base MiB read).
const ROUNDS: usize = 60;
/// Kills, and the rounds done before each.
const KILL_AT: [usize; 4] = [8, 20, 32, 38];
/// The device's read rate, bytes/s: each read request sleeps in the device (256 KiB:
/// 16 ms), so that a kill can be made inside one.
const READ_RATE: u64 = 16 << 20;

/// Waits until a `vring_worker` thread of `pid` is in one of the system calls `nrs`
/// (x86-64 numbers, as `/proc/PID/task/TID/syscall` shows them), for at most `within`,
/// looking every `pause`. The stats thread makes system calls too, but is not named so.
fn wait_worker_in(pid: u32, nrs: &[&str], within: Duration, pause: Duration) -> bool {
    let t = Instant::now();
    while t.elapsed() < within {
        for task in std::fs::read_dir(format!("/proc/{pid}/task"))
            .unwrap()
            .flatten()
        {
            let p = task.path();
            let comm = std::fs::read_to_string(p.join("comm")).unwrap_or_default();
            let sys = std::fs::read_to_string(p.join("syscall")).unwrap_or_default();
            let nr = sys.split_whitespace().next().unwrap_or("");
            if comm.trim() == "vring_worker" && nrs.contains(&nr) {
                return true;
            }
        }
        if pause.is_zero() {
            std::thread::yield_now();
        } else {
            std::thread::sleep(pause);
        }
    }
    false
}

/// Waits until the device is asleep in the read throttle (`clock_nanosleep`): inside a
/// read request it has taken and not completed.
fn wait_mid_request(pid: u32) -> bool {
    let ms = Duration::from_millis;
    wait_worker_in(pid, &["230"], ms(30_000), ms(1))
}

/// Waits until the device is inside a write system call (`pwrite64`, `pwritev`,
/// `pwritev2`, `fsync`, `fdatasync`: the guest's bytes, or imago's metadata after them,
/// going to the overlay): inside a write request, between taking it and completing it.
/// A write takes ~1 ms of a round of ~1 s, so the wait looks again at once (yielding the
/// core), up to 60 s.
fn wait_mid_write(pid: u32) -> bool {
    let writes = ["18", "296", "328", "74", "75"];
    wait_worker_in(pid, &writes, Duration::from_secs(60), Duration::ZERO)
}

fn md5(bytes: &[u8]) -> String {
    let mut c = std::process::Command::new("md5sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write;
    c.stdin.take().unwrap().write_all(bytes).unwrap();
    let out = c.wait_with_output().unwrap();
    String::from_utf8(out.stdout).unwrap()[..32].to_string()
}

/// The lines of `serial` after `tag`, split in words.
fn tagged(serial: &str, tag: &str) -> Vec<Vec<String>> {
    serial
        .lines()
        .filter_map(|l| l.split(tag).nth(1))
        .map(|l| l.split_whitespace().map(str::to_string).collect())
        .collect()
}

fn rounds(g: &Guest) -> usize {
    tagged(&g.serial(), "MEMFOLD-RW-WROTE ").len()
}

/// Waits until the guest has written `n` rounds (or is done).
fn wait_rounds(g: &mut Guest, n: usize, within: Duration) {
    let t = Instant::now();
    while rounds(g) < n && !g.serial().contains("MEMFOLD-RW-DONE") {
        g.check_alive().unwrap();
        let serial = g.serial();
        assert!(
            !serial.contains("MEMFOLD-RW-MISMATCH"),
            "the guest read wrong bytes:\n{serial}"
        );
        assert!(
            t.elapsed() < within,
            "{} rounds of {n} after {within:?}:\n{}",
            rounds(g),
            g.serial()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn memfold_blk_killed_under_io_is_restarted_and_the_guest_loses_nothing() {
    let cache = images::cache_dir();
    images::build(&cache, "tiny", |l| eprintln!("{l}")).expect("tiny image builds");
    let work = tempfile::tempdir_in("/var/tmp").unwrap();
    let data = work.path().join("data.img");
    let mut base = vec![0u8; (DISK_MIB << 20) as usize];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut base)
        .unwrap();
    std::fs::write(&data, &base).unwrap();
    let spec = GuestSpec {
        data_disk: Some(DataDisk {
            path: data.clone(),
            read_bytes_per_sec: Some(READ_RATE),
        }),
        memfold_blk: Some(BlkDisks {
            data: true,
            data_overlay: true,
            binary: Some(env!("CARGO_BIN_EXE_memfold-blk").into()),
            ..BlkDisks::default()
        }),
        kernel_args: Some(format!("memfold.disk_rw={ROUNDS}")),
        ..GuestSpec::new("blk-kill", "tiny", 256, RamBackend::Memfd)
    };
    let mut g = Guest::start(&spec, &cache, work.path(), Accel::Tcg).unwrap();
    g.wait_ready(Duration::from_secs(90)).unwrap();
    let stats = work.path().join("blk-kill/blk-data.stats");
    let requests = || {
        let s = std::fs::read_to_string(&stats).unwrap_or_default();
        ["reads=", "writes="]
            .iter()
            .map(|k| {
                s.split_whitespace()
                    .find_map(|kv| kv.strip_prefix(k))
                    .and_then(|v| v.parse::<u64>().ok())
                    .unwrap_or(0)
            })
            .sum::<u64>()
    };
    for (i, &at) in KILL_AT.iter().enumerate() {
        wait_rounds(&mut g, at, Duration::from_secs(120));
        // Under I/O: the device serves requests (its stats file is rewritten every
        // 200 ms; a TCG guest between reads may take longer on a loaded host).
        let r0 = requests();
        let t = Instant::now();
        while requests() <= r0 {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "the device is idle before kill {i}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        let (_, pid, restarts) = g.blk_processes()[0];
        let pid = pid.expect("memfold-blk runs");
        assert_eq!(restarts as usize, i);
        assert!(
            !g.serial().contains("MEMFOLD-RW-DONE"),
            "the guest finished before kill {i}: raise ROUNDS"
        );
        // Kill 0 wherever the device is; kills 1 and 2 inside a read request, kill 3
        // inside a write.
        let (mid, inside) = match i {
            0 => (true, ""),
            3 => (wait_mid_write(pid), ", inside a write"),
            _ => (wait_mid_request(pid), ", inside a read request"),
        };
        assert!(mid, "kill {i}: never inside a request");
        rustix::process::kill_process(
            rustix::process::Pid::from_raw(pid as i32).unwrap(),
            rustix::process::Signal::KILL,
        )
        .unwrap();
        eprintln!(
            "kill {i}: memfold-blk pid {pid} at round {}{inside}",
            rounds(&g)
        );
        // Restarted, and the guest goes on.
        let t = Instant::now();
        loop {
            let (_, p, n) = g.blk_processes()[0];
            if p.is_some_and(|p| p != pid) && n as usize == i + 1 {
                break;
            }
            assert!(
                t.elapsed() < Duration::from_secs(15),
                "no restart after kill {i}"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let r = rounds(&g);
        wait_rounds(&mut g, r + 2, Duration::from_secs(60));
        eprintln!("kill {i}: back after {:.1} s", t.elapsed().as_secs_f64());
    }
    let t = Instant::now();
    while !g.serial().contains("MEMFOLD-RW-DONE") {
        g.check_alive().unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(180),
            "not done:\n{}",
            g.serial()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let serial = g.serial();
    let log = std::fs::read_to_string(work.path().join("blk-kill/blk-data.log")).unwrap();
    g.stop();
    assert_eq!(
        tagged(&serial, "MEMFOLD-RW-DONE ")[0][0],
        ROUNDS.to_string()
    );
    // The guest's own checks: no read of any written slot or of the base differed.
    assert!(!serial.contains("MEMFOLD-RW-MISMATCH"), "{serial}");
    assert!(!serial.contains("MEMFOLD-RW-GAVE-UP"), "{serial}");
    // Every I/O error the guest saw was retried until it succeeded.
    let errors = tagged(&serial, "MEMFOLD-RW-IOERR ");
    let retried = tagged(&serial, "MEMFOLD-RW-RETRIED-OK ");
    eprintln!(
        "I/O errors seen by the guest: {}, retried OK: {}",
        errors.len(),
        retried.len()
    );
    for e in &errors {
        let what = e[..e.len() - 2].join(" ");
        assert!(
            retried.iter().any(|r| r.join(" ").starts_with(&what)),
            "{what}: not retried to success\n{serial}"
        );
    }
    // What the guest read of the base is the host's base.
    let sums = tagged(&serial, "MEMFOLD-RW-BASE ");
    assert_eq!(sums.len() as u64, DISK_MIB / 2);
    for s in &sums {
        let i: usize = s[0].parse().unwrap();
        assert_eq!(s[1], md5(&base[i << 20..(i + 1) << 20]), "base MiB {i}");
    }
    // The supervisor logged each restart.
    assert_eq!(
        log.matches("memfold-vm supervisor: restarted as pid")
            .count(),
        KILL_AT.len(),
        "{log}"
    );
    // What each restarted device found waiting in the ring: the requests the killed one
    // had taken and not completed, and those the guest queued meanwhile.
    let waiting: Vec<u64> = log
        .split("memfold-vm supervisor: restarted as pid")
        .skip(1)
        .map(|after| {
            after
                .split(" requests waiting")
                .next()
                .and_then(|l| l.rsplit(": ").next())
                .and_then(|n| n.trim().parse().ok())
                .unwrap_or(0)
        })
        .collect();
    eprintln!("requests waiting at each restart: {waiting:?}");
    // Kills 1, 2 and 3 were inside a request: it waits at the restart, served again.
    assert!(
        waiting.len() == KILL_AT.len() && waiting[1..].iter().all(|&w| w > 0),
        "{waiting:?}: {log}"
    );
    // Each slot holds the guest's last completed write to it, the rest the base.
    let mut last: BTreeMap<u64, String> = BTreeMap::new();
    for w in tagged(&serial, "MEMFOLD-RW-WROTE ") {
        last.insert(w[1].parse().unwrap(), w[2].clone());
    }
    let ov = work.path().join("blk-kill/data.qcow2");
    let chk = std::process::Command::new("qemu-img")
        .arg("check")
        .arg(&ov)
        .output()
        .unwrap();
    assert!(
        chk.status.success(),
        "qemu-img check: {}",
        String::from_utf8_lossy(&chk.stdout)
    );
    let d = OverlayDisk::open(&data, &ov).unwrap();
    let half = (DISK_MIB << 20) / 2;
    for k in 0..16u64 {
        let mut b = vec![0u8; SLOT as usize];
        let off = half + k * SLOT;
        d.read(off, &mut b).unwrap();
        let want = last
            .get(&k)
            .cloned()
            .unwrap_or_else(|| md5(&base[off as usize..(off + SLOT) as usize]));
        assert_eq!(md5(&b), want, "slot {k}");
    }
    let mut b = vec![0u8; half as usize];
    d.read(0, &mut b).unwrap();
    assert!(b == base[..half as usize], "the lower half is the base's");
}
