//! Guest RAM leaves a managed QEMU only for memfold-blk (the agent's `ram_sends`, in a
//! real QEMU): a `tiny` guest with memfold's agent preloaded and its data disk on a
//! vhost-user-blk back end. Served by memfold-blk, the guest reads the disk's exact bytes.
//! Served by the very same program under another name — a back end the agent cannot tell
//! from virtiofsd or SPDK, which map guest RAM and write it outside QEMU's page tables —
//! QEMU's `SET_MEM_TABLE` carrying the RAM memfd is refused (`EPERM`), the agent says so in
//! QEMU's log naming the receiver, and the guest never reads the disk. No memfoldd: the
//! agent manages the region from the moment it registers it.
//!
//! Two boots under TCG, about 30 s each.

use std::io::Read;
use std::path::Path;
use std::time::{Duration, Instant};

use memfold_vm::images;
use memfold_vm::launcher::{agent_env, Accel, BlkDisks, DataDisk, Guest, GuestSpec, RamBackend};

mod common;
use common::agent_lib;

const DISK_MIB: usize = 8;

/// Boots a `tiny` guest whose data disk `data` is served by the program at `blk`, with
/// the agent preloaded; returns its serial and QEMU's log `linger` after `done` first
/// says so of them, or after 120 s.
fn boot(
    work: &Path,
    blk: &Path,
    data: &Path,
    linger: Duration,
    done: impl Fn(&str, &str) -> bool,
) -> (String, String) {
    let cache = images::cache_dir();
    let spec = GuestSpec {
        data_disk: Some(DataDisk {
            path: data.to_path_buf(),
            read_bytes_per_sec: None,
        }),
        memfold_blk: Some(BlkDisks {
            data: true,
            binary: Some(blk.to_path_buf()),
            ..BlkDisks::default()
        }),
        ..GuestSpec::new("fb", "tiny", 256, RamBackend::Memfd)
    };
    let env = agent_env(&agent_lib(), &work.join("no-memfoldd.sock"), &spec);
    let mut g = Guest::start_with_env(&spec, &cache, work, Accel::Tcg, &env).unwrap();
    let log = work.join("fb/qemu.stderr");
    let t = Instant::now();
    let mut since: Option<Instant> = None;
    loop {
        let (serial, qemu) = (
            g.serial(),
            std::fs::read_to_string(&log).unwrap_or_default(),
        );
        if since.is_none() && done(&serial, &qemu) {
            since = Some(Instant::now());
        }
        if since.is_some_and(|s| s.elapsed() >= linger) || t.elapsed() > Duration::from_secs(120) {
            g.stop();
            return (serial, qemu);
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// The guest's md5 of its data disk, if it printed one.
fn sum_of(serial: &str) -> Option<String> {
    serial.lines().find_map(|l| {
        l.split("MEMFOLD-DATA-SUM ")
            .nth(1)
            .map(|s| s.trim().to_string())
    })
}

#[test]
fn guest_ram_goes_to_memfold_blk_and_to_no_other_back_end() {
    let cache = images::cache_dir();
    images::build(&cache, "tiny", |l| eprintln!("{l}")).expect("tiny image builds");
    let blk = memfold_vm::launcher::memfold_blk_binary()
        .or_else(|| Some(Path::new(env!("CARGO_BIN_EXE_memfold")).with_file_name("memfold-blk")))
        .filter(|p| p.is_file())
        .expect("memfold-blk built beside memfold (make test builds the workspace)");
    let work = tempfile::tempdir_in("/var/tmp").unwrap();
    let data = work.path().join("data.img");
    let mut bytes = vec![0u8; DISK_MIB << 20];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut bytes)
        .unwrap();
    std::fs::write(&data, &bytes).unwrap();
    drop(bytes);
    let md5sum = std::process::Command::new("md5sum")
        .arg(&data)
        .output()
        .unwrap();
    let want = String::from_utf8(md5sum.stdout).unwrap();
    let want = want.split_whitespace().next().unwrap().to_string();

    // memfold-blk: served, every byte.
    let ours = tempfile::tempdir_in(work.path()).unwrap();
    let (serial, qemu) = boot(ours.path(), &blk, &data, Duration::ZERO, |s, _| {
        sum_of(s).is_some()
    });
    assert_eq!(
        sum_of(&serial).as_deref(),
        Some(want.as_str()),
        "{serial}\n{qemu}"
    );
    assert!(!qemu.contains("refused to send guest RAM"), "{qemu}");

    // The same program under another name: refused, and the guest reads nothing.
    let foreign = work.path().join("foreign-blk");
    std::fs::copy(&blk, &foreign).unwrap();
    let theirs = tempfile::tempdir_in(work.path()).unwrap();
    // Refused at the driver's start; the guest then has 20 s to read its disk.
    let (serial, qemu) = boot(
        theirs.path(),
        &foreign,
        &data,
        Duration::from_secs(20),
        |_, q| q.contains("refused to send guest RAM"),
    );
    assert!(
        qemu.contains("refused to send guest RAM of fb") && qemu.contains("(foreign-blk)"),
        "no refusal in QEMU's log:\n{qemu}"
    );
    assert_ne!(sum_of(&serial).as_deref(), Some(want.as_str()), "{serial}");
}
