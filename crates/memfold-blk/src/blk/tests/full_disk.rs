//! A full disk (issue 16, "Correct": bad input loses nothing): writes that the overlay's
//! file cannot grow to hold get `VIRTIO_BLK_S_IOERR` and a log line naming the overlay,
//! and every write completed before them — and after them, into clusters already
//! held — reads back, through the device and from a fresh open; `qemu-img check` passes.
//!
//! The file size limit (`RLIMIT_FSIZE`, `EFBIG` with `SIGXFSZ` ignored) stands in for a
//! full file system (`ENOSPC`): both fail the `pwrite` that grows the file, which is
//! what imago sees. It is a process-wide limit, so the test runs itself again as a child
//! process (`FULL_DISK_CHILD` set) that sets it and drives the device; the parent checks.

use super::*;

const CHILD: &str = "MEMFOLD_BLK_FULL_DISK_CHILD";
const CLUSTER: u64 = 65536;
const TEST: &str = "blk::tests::full_disk::a_write_to_a_full_disk_gets_ioerr_and_loses_nothing";

fn seeded(seed: u8) -> Vec<u8> {
    (0..CLUSTER as usize)
        .map(|i| (i as u8).wrapping_mul(13) ^ seed)
        .collect()
}

/// Writes cluster `k` with `seeded(seed)` through the device; returns its status.
fn write_cluster(r: &mut Rig, k: u64, seed: u8) -> u8 {
    r.gm.write_slice(&seeded(seed), GuestAddress(DATA)).unwrap();
    r.header(0x8000, vb::VIRTIO_BLK_T_OUT, k * CLUSTER / SECTOR);
    r.submit(&[
        (0x8000, 16, false),
        (DATA, CLUSTER as u32, false),
        (STATUS, 1, true),
    ]);
    assert_eq!(r.run(), vec![1]);
    r.status()
}

/// Reads cluster `k` through the device.
fn read_cluster(r: &mut Rig, k: u64) -> Vec<u8> {
    r.header(0x8000, vb::VIRTIO_BLK_T_IN, k * CLUSTER / SECTOR);
    r.submit(&[
        (0x8000, 16, false),
        (DATA, CLUSTER as u32, true),
        (STATUS, 1, true),
    ]);
    assert_eq!(r.run(), vec![CLUSTER as u32 + 1]);
    assert_eq!(r.status(), vb::VIRTIO_BLK_S_OK as u8);
    r.local.bytes()[DATA as usize..(DATA + CLUSTER) as usize].to_vec()
}

/// The child: room for four more clusters in the overlay's file, then writes until
/// they fail. Prints `DIR`, `OK k seed` and `FAILED k` lines; leaves its files.
fn child() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .init();
    let mut r = rig(true);
    let ov = r._dir.path().join("ov.qcow2");
    let room = std::fs::metadata(&ov).unwrap().len() + 4 * CLUSTER;
    // SAFETY: plain libc calls; SIG_IGN installs no handler code.
    unsafe {
        libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
        let lim = libc::rlimit {
            rlim_cur: room,
            rlim_max: room,
        };
        assert_eq!(libc::setrlimit(libc::RLIMIT_FSIZE, &lim), 0);
    }
    println!("DIR {}", r._dir.path().display());
    // (The mock queue takes 8 requests per rig: writes until the first failure, a
    // rewrite, 4 reads.)
    for k in 0..3u64 {
        let s = write_cluster(&mut r, k, k as u8 + 1);
        if s == vb::VIRTIO_BLK_S_OK as u8 {
            println!("OK {k} {}", k + 1);
        } else {
            assert_eq!(s, vb::VIRTIO_BLK_S_IOERR as u8);
            println!("FAILED {k}");
            break;
        }
    }
    // A cluster the overlay holds takes a rewrite: the file need not grow.
    assert_eq!(write_cluster(&mut r, 0, 77), vb::VIRTIO_BLK_S_OK as u8);
    println!("OK 0 77");
    for k in 0..4u64 {
        println!(
            "READ {k} {}",
            xxhash_rust::xxh3::xxh3_64(&read_cluster(&mut r, k))
        );
    }
    std::mem::forget(r);
}

#[test]
fn a_write_to_a_full_disk_gets_ioerr_and_loses_nothing() {
    if std::env::var_os(CHILD).is_some() {
        return child();
    }
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args([TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD, "1")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "child: {stdout}\n{stderr}");
    let dir = PathBuf::from(
        stdout
            .lines()
            .find_map(|l| l.split_once("DIR ").map(|x| x.1))
            .unwrap_or_else(|| panic!("no DIR from the child: {stdout}\n{stderr}")),
    );
    let words = |tag: &str| -> Vec<Vec<u64>> {
        stdout
            .lines()
            .filter_map(|l| l.strip_prefix(tag))
            .map(|l| l.split_whitespace().map(|w| w.parse().unwrap()).collect())
            .collect()
    };
    let ok = words("OK ");
    let failed = words("FAILED ");
    let read = words("READ ");
    // Some writes fit, then the disk is full: both happen.
    assert!(ok.len() >= 2 && failed.len() == 1, "{stdout}");
    assert_eq!(read.len(), 4, "{stdout}");
    // The log line says what failed where, and why.
    assert!(
        stderr.contains(&format!(
            "ov.qcow2: write of {CLUSTER} bytes at byte {}",
            failed[0][0] * CLUSTER
        )),
        "{stderr}"
    );
    let base = pattern(1 << 20);
    let mut want: BTreeMap<u64, Vec<u8>> = (0..4u64)
        .map(|k| {
            let b = &base[(k * CLUSTER) as usize..((k + 1) * CLUSTER) as usize];
            (k, b.to_vec())
        })
        .collect();
    for w in &ok {
        want.insert(w[0], seeded(w[1] as u8));
    }
    // Through the device, in the child: every completed write, the failed ones the base.
    for r in &read {
        assert_eq!(
            r[1],
            xxhash_rust::xxh3::xxh3_64(&want[&r[0]]),
            "cluster {}",
            r[0]
        );
    }
    // QEMU's check of the overlay, and a fresh open of it.
    let ov = dir.join("ov.qcow2");
    let chk = std::process::Command::new("qemu-img")
        .args(["check"])
        .arg(&ov)
        .output()
        .unwrap();
    assert!(
        chk.status.success(),
        "qemu-img check: {}",
        String::from_utf8_lossy(&chk.stdout)
    );
    let d = OverlayDisk::open(&dir.join("base.img"), &ov).unwrap();
    for (k, w) in &want {
        let mut b = vec![0u8; CLUSTER as usize];
        d.read(k * CLUSTER, &mut b).unwrap();
        assert!(b == *w, "cluster {k} after a fresh open");
    }
    drop(d);
    std::fs::remove_dir_all(&dir).unwrap();
}
