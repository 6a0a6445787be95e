//! A tiny guest whose data disk memfold-blk serves (the launcher's `GuestSpec::memfold_blk`):
//! the guest reads the whole disk (64 MiB of random bytes, serial `memfold-data`) and
//! prints its md5 (`MEMFOLD-DATA-SUM`), which must be the host file's; the device must
//! have reported at least every page of the disk landed from the base, and have served
//! every read without an error.
//!
//! Boots a QEMU guest under TCG: run it under the measurement lock on a shared host,
//! with an image cache of this branch's recipes (tiny-init prints the sum):
//! `MEMFOLD_IMAGES=/work/images-blk flock /tmp/measure.lock cargo test --release -p
//! memfold-blk --test live_tiny`. About 30 s once the image is built.

use std::io::Read;
use std::time::{Duration, Instant};

use memfold_vm::images;
use memfold_vm::launcher::{Accel, BlkDisks, DataDisk, Guest, GuestSpec, RamBackend};

const DISK_MIB: u64 = 64;

fn md5_of(path: &std::path::Path) -> String {
    let out = std::process::Command::new("md5sum")
        .arg(path)
        .output()
        .unwrap();
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

/// `key=value` of the device's stats file.
fn stat(stats: &str, key: &str) -> u64 {
    stats
        .split_whitespace()
        .find_map(|kv| kv.strip_prefix(key)?.strip_prefix('='))
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

#[test]
fn a_tiny_guest_reads_its_data_disk_through_memfold_blk() {
    let cache = images::cache_dir();
    images::build(&cache, "tiny", |l| eprintln!("{l}")).expect("tiny image builds");
    let work = tempfile::tempdir_in("/var/tmp").unwrap();
    let data = work.path().join("data.img");
    let mut bytes = vec![0u8; (DISK_MIB << 20) as usize];
    std::fs::File::open("/dev/urandom")
        .unwrap()
        .read_exact(&mut bytes)
        .unwrap();
    std::fs::write(&data, &bytes).unwrap();
    drop(bytes);
    let want = md5_of(&data);
    let spec = GuestSpec {
        data_disk: Some(DataDisk {
            path: data.clone(),
            read_bytes_per_sec: None,
        }),
        memfold_blk: Some(BlkDisks {
            data: true,
            binary: Some(env!("CARGO_BIN_EXE_memfold-blk").into()),
            ..BlkDisks::default()
        }),
        ..GuestSpec::new("blk-1", "tiny", 256, RamBackend::Memfd)
    };
    let mut g = Guest::start(&spec, &cache, work.path(), Accel::Tcg).unwrap();
    g.wait_ready(Duration::from_secs(90)).unwrap();
    let t = Instant::now();
    let sum = loop {
        if let Some(s) = g.serial().lines().find_map(|l| {
            l.split("MEMFOLD-DATA-SUM ")
                .nth(1)
                .map(|s| s.trim().to_string())
        }) {
            break s;
        }
        g.check_alive().unwrap();
        assert!(
            t.elapsed() < Duration::from_secs(120),
            "no MEMFOLD-DATA-SUM:\n{}",
            g.serial()
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    assert_eq!(sum, want, "the guest's md5 of its data disk");
    // The stats file is rewritten every 200 ms (later on a loaded host): read it until
    // it shows the whole disk read, 10 s at most.
    let pages = (DISK_MIB << 20) / 4096;
    let t = Instant::now();
    let stats = loop {
        let stats = std::fs::read_to_string(work.path().join("blk-1/blk-data.stats")).unwrap();
        let whole =
            stat(&stats, "landed_base") >= pages && stat(&stats, "read_bytes") >= DISK_MIB << 20;
        if whole || t.elapsed() > Duration::from_secs(10) {
            break stats;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    g.stop();
    assert!(stat(&stats, "landed_base") >= pages, "{stats}");
    assert!(stat(&stats, "read_bytes") >= DISK_MIB << 20, "{stats}");
    assert_eq!(stat(&stats, "io_errors"), 0, "{stats}");
    assert_eq!(stat(&stats, "dropped"), 0, "{stats}");
}
