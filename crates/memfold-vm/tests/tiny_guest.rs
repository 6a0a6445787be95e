//! Integration tests with the `tiny` guest (Debian kernel + busybox initramfs): boot,
//! capture, analyse, stop, with both RAM backings. Bounded: each guest boots in seconds
//! under TCG and the test gives it 180 s.

use std::time::Duration;

use memfold_core::analysis::{analyze, AnalysisConfig, GuestMemory};
use memfold_vm::capture::capture;
use memfold_vm::hostmem::guest_ram_usage;
use memfold_vm::images;
use memfold_vm::launcher::{Accel, Guest, GuestSpec, RamBackend, VmError};

/// Waits (up to `within`) for the guest's first passed self-check round
/// (`MEMFOLD-CHECK ok`, images/tiny-init), failing at a mismatch: that no mismatch was
/// printed means nothing until a round has run.
fn checked_once(g: &Guest, within: Duration) {
    let t = std::time::Instant::now();
    while !g
        .serial()
        .lines()
        .any(|l| l.starts_with("MEMFOLD-CHECK ok"))
    {
        assert!(g.mismatches().is_empty(), "{:?}", g.mismatches());
        assert!(
            t.elapsed() < within,
            "no self-check round within {within:?}: {}",
            g.serial()
        );
        std::thread::sleep(Duration::from_millis(500));
    }
}

fn boot_capture_analyse(ram: RamBackend, name: &str) {
    let cache = images::cache_dir();
    images::build(&cache, "tiny", |l| eprintln!("{l}")).expect("tiny image builds");
    let work = tempfile::tempdir().unwrap();
    let spec = GuestSpec::new(name, "tiny", 128, ram);
    // TCG: the KVM probe is exercised by the commands; tests must not depend on it.
    let mut g = Guest::start(&spec, &cache, work.path(), Accel::Tcg).unwrap();
    let pid = g.pid;
    g.wait_ready(Duration::from_secs(180)).unwrap();
    std::thread::sleep(Duration::from_secs(2));

    let usage = guest_ram_usage(pid, g.mem_bytes / 2).unwrap();
    assert!(
        usage.rss > 8 << 20,
        "guest RAM resident on the host: {usage:?}"
    );

    let snap = capture(&g, &work.path().join("snap"), true).unwrap();
    assert_eq!(snap.pages, 32768);
    assert!(
        snap.resident_pages > 1000 && snap.resident_pages <= snap.pages,
        "{snap:?}"
    );
    let ram = std::fs::read(&snap.ram).unwrap();
    assert_eq!(ram.len(), 128 << 20);
    // The capture holds the guest's memory: its init script (unpacked from the initramfs
    // into guest RAM) is in there.
    assert!(
        ram.windows(13).any(|w| w == b"MEMFOLD-READY"),
        "the guest's own bytes are in the snapshot"
    );
    let resident = std::fs::read(&snap.resident).unwrap();
    assert_eq!(resident.len(), 32768 / 8);

    let sets = analyze(
        &[GuestMemory {
            name: name.into(),
            ram: &ram,
            resident: Some(&resident),
        }],
        &AnalysisConfig::default(),
    )
    .unwrap();
    let all = sets.iter().find(|s| s.basis == "all").unwrap();
    let res = sets.iter().find(|s| s.basis == "resident").unwrap();
    assert_eq!(all.pages, 32768);
    assert_eq!(
        all.zero_pages + all.duplicate_pages + all.unique_pages,
        all.pages
    );
    assert_eq!(res.pages, snap.resident_pages);
    assert!(
        all.pages_with_compression <= all.pages_with_patching
            && all.pages_with_patching <= all.pages_sharing_only
    );

    checked_once(&g, Duration::from_secs(120));
    assert!(
        g.mismatches().is_empty(),
        "guest self-check: {:?}",
        g.mismatches()
    );
    g.stop();
    drop(g);
    let gone = !std::path::Path::new(&format!("/proc/{pid}")).exists()
        || std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map(|s| s.contains(") Z "))
            .unwrap_or(true);
    assert!(gone, "QEMU {pid} still running after stop");
}

#[test]
fn tiny_guest_with_memfd_ram_boots_is_captured_and_analysed() {
    boot_capture_analyse(RamBackend::Memfd, "t-memfd");
}

#[test]
fn tiny_guest_with_anonymous_ram_is_captured_with_pmemsave_and_pagemap() {
    boot_capture_analyse(RamBackend::Anonymous, "t-anon");
}

#[test]
fn missing_images_and_profiles_are_clear_errors() {
    let empty = tempfile::tempdir().unwrap();
    let work = tempfile::tempdir().unwrap();
    let spec = GuestSpec::new("x", "web", 128, RamBackend::Memfd);
    let err = Guest::start(&spec, empty.path(), work.path(), Accel::Tcg)
        .err()
        .unwrap();
    assert!(
        matches!(err, VmError::Image(images::ImageError::NotBuilt { .. })),
        "{err}"
    );
    assert!(err.to_string().contains("memfold image build web"), "{err}");
    let spec = GuestSpec {
        profile: "nope".into(),
        ..spec
    };
    let err = Guest::start(&spec, empty.path(), work.path(), Accel::Tcg)
        .err()
        .unwrap();
    assert!(
        err.to_string().contains("unknown image profile 'nope'"),
        "{err}"
    );
}

/// The tiny image's page-cache workload and its two one-shot events: with a data disk it
/// reads the disk whole, pass after pass, and the disk stays in its cache between passes
/// (the kernel drops a block device's cache at its last close: the reader holds it
/// open); at `memfold.break_at` it writes over its duplicates and at
/// `memfold.drop_caches_at` it drops its cache — and its self-checks pass throughout.
#[test]
fn tiny_guest_reads_its_data_disk_from_its_cache_breaks_and_drops_on_cue() {
    use memfold_vm::launcher::DataDisk;
    use std::io::Write;
    let cache = images::cache_dir();
    images::build(&cache, "tiny", |l| eprintln!("{l}")).expect("tiny image builds");
    let work = tempfile::tempdir().unwrap();
    let disk = work.path().join("data.img");
    let mut f = std::fs::File::create(&disk).unwrap();
    for i in 0..16u8 {
        f.write_all(&vec![i.wrapping_mul(37) | 1; 1 << 20]).unwrap();
    }
    drop(f);
    let spec = GuestSpec {
        data_disk: Some(DataDisk {
            path: disk,
            read_bytes_per_sec: Some(32 << 20),
        }),
        kernel_args: Some("memfold.break_at=1 memfold.drop_caches_at=1".into()),
        ..GuestSpec::new("cache", "tiny", 256, RamBackend::Memfd)
    };
    let mut g = Guest::start(&spec, &cache, work.path(), Accel::Tcg).unwrap();
    g.wait_ready(Duration::from_secs(180)).unwrap();
    let t = std::time::Instant::now();
    let (rates, cached) = loop {
        let serial = g.serial();
        let rates: Vec<f64> = serial
            .lines()
            .filter_map(|l| l.strip_prefix("MEMFOLD-RATE cache-MiB/s "))
            .filter_map(|r| r.split_whitespace().next()?.parse().ok())
            .collect();
        let cached: Vec<u64> = serial
            .lines()
            .filter_map(|l| l.strip_prefix("MEMFOLD-DISK-CACHE-KIB "))
            .filter_map(|r| r.trim().parse().ok())
            .collect();
        let done = serial.contains("MEMFOLD-BROKE-SHARING")
            && serial.contains("MEMFOLD-DROPPED-CACHES")
            && rates.len() >= 6;
        if done || t.elapsed() > Duration::from_secs(120) {
            break (rates, cached);
        }
        std::thread::sleep(Duration::from_millis(500));
    };
    let serial = g.serial();
    assert!(
        serial.contains("MEMFOLD-DATA-DISK /dev/vda 16 MiB"),
        "{serial}"
    );
    assert!(serial.contains("MEMFOLD-BROKE-SHARING"), "{serial}");
    assert!(serial.contains("MEMFOLD-DROPPED-CACHES"), "{serial}");
    assert!(rates.len() >= 6, "{rates:?}");
    // The first pass reads the throttled disk (32 MiB/s: about half a second for 16
    // MiB); later ones the cache, several times faster even under TCG.
    let best = rates.iter().copied().fold(0.0, f64::max);
    assert!(best > 3.0 * 32.0, "no pass ran from the cache: {rates:?}");
    assert!(cached.iter().any(|&k| k >= 16 * 1024), "{cached:?}");
    checked_once(&g, Duration::from_secs(60));
    assert!(g.mismatches().is_empty(), "{:?}", g.mismatches());
    g.stop();
}
