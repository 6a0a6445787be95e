//! Tests of the disk images.

use super::*;
use std::os::unix::fs::FileExt;

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u32 * 31 + seed as u32 * 7 + (i as u32 >> 12)) as u8)
        .collect()
}

/// `base.img` (1 MiB of `pattern(.., seed)`) and `ov.qcow2` over it, in a new folder.
fn base_and_overlay(seed: u8) -> (tempfile::TempDir, PathBuf, PathBuf, Vec<u8>) {
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let (base, ov) = (d.path().join("base.img"), d.path().join("ov.qcow2"));
    let data = pattern(1 << 20, seed);
    std::fs::write(&base, &data).unwrap();
    create_overlay(&base, &ov).unwrap();
    (d, base, ov, data)
}

#[test]
fn a_raw_disk_reads_any_range_and_names_its_base() {
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let p = d.path().join("base.img");
    let data = pattern(64 << 10, 1);
    std::fs::write(&p, &data).unwrap();
    let r = RawDisk::open(&p).unwrap();
    let mut b = vec![0u8; 5000];
    let e = r.read(1000, &mut b).unwrap();
    assert_eq!(b, data[1000..6000]);
    assert_eq!(e.len(), 1);
    assert_eq!(e[0].source, ExtentSource::Base(r.id()));
    assert!(matches!(
        r.read(60 << 10, &mut b),
        Err(DiskError::OutOfRange { .. })
    ));
    assert!(matches!(r.write(0, &b), Err(DiskError::ReadOnly { .. })));
}

/// The device's reads land in its reused aligned buffer, holding an earlier request's
/// bytes (`blk/read.rs`), which the disks read into straight (`O_DIRECT`, no bounce):
/// every byte of the range is the disk's — the base, an overlay cluster, a discarded
/// one, zeroed ones — whatever the buffer held, at aligned offsets and not.
#[test]
fn reads_into_a_reused_aligned_buffer_get_every_byte_from_the_disk() {
    use crate::aligned::{fits_direct, Aligned};
    let (_d, base, ov, data) = base_and_overlay(3);
    let raw = RawDisk::open(&base).unwrap();
    let mut o = OverlayDisk::open(&base, &ov).unwrap();
    // Written in the overlay: one cluster of 7s (64 KiB), and one written then
    // discarded, which reads the base again.
    o.write(128 << 10, &[7u8; 64 << 10]).unwrap();
    o.write(64 << 10, &[8u8; 64 << 10]).unwrap();
    o.discard(64 << 10, 64 << 10).unwrap();
    // Zeroed: a whole cluster the base held (a zero cluster), and a page inside a
    // cluster of 7s (zeros written into it).
    o.write_zeroes(192 << 10, 64 << 10, true).unwrap();
    o.write_zeroes(132 << 10, 4096, false).unwrap();
    let mut expect = data.clone();
    expect[128 << 10..192 << 10].fill(7);
    expect[132 << 10..136 << 10].fill(0);
    expect[192 << 10..256 << 10].fill(0);
    let mut buf = Aligned::new(0);
    for (off, len) in [
        (0u64, 256usize << 10),
        (4096, 8192),
        (120 << 10, 80 << 10),
        (512, 4096),
    ] {
        for (disk, want) in [(&raw as &dyn Disk, &data), (&o as &dyn Disk, &expect)] {
            buf.reuse(len);
            buf.bytes_mut().fill(0xAA);
            let aligned = off % BLOCK == 0 && fits_direct(buf.bytes());
            disk.read(off, buf.bytes_mut()).unwrap();
            let (o0, o1) = (off as usize, off as usize + len);
            assert!(
                buf.bytes() == &want[o0..o1],
                "{off}+{len} (aligned {aligned}): not the disk's bytes"
            );
        }
    }
}

#[test]
fn an_overlay_reads_the_base_until_written_and_discard_brings_the_base_back() {
    let (_d, base, ov, data) = base_and_overlay(2);
    let mut o = OverlayDisk::open(&base, &ov).unwrap();
    let id = RawDisk::open(&base).unwrap().id();
    let mut b = vec![0u8; 8192];
    let e = o.read(65536, &mut b).unwrap();
    assert_eq!(b, data[65536..65536 + 8192]);
    assert_eq!(
        e,
        vec![Extent {
            off: 65536,
            len: 8192,
            source: ExtentSource::Base(id)
        }]
    );
    o.write(65536 + 4096, &[7u8; 4096]).unwrap();
    o.flush().unwrap();
    let e = o.read(0, &mut vec![0u8; 1 << 20]).unwrap();
    assert!(
        e.iter().any(|x| x.source == ExtentSource::Overlay
            && x.off <= 65536 + 4096
            && x.off + x.len >= 65536 + 8192),
        "{e:?}"
    );
    let mut b = vec![0u8; 8192];
    o.read(65536, &mut b).unwrap();
    assert_eq!(b[..4096], data[65536..65536 + 4096]);
    assert_eq!(b[4096..], [7u8; 4096]);
    // The base is untouched.
    assert_eq!(std::fs::read(&base).unwrap(), data);
    // qcow2 clusters are 64 KiB: the whole cluster went to the overlay, a discard of
    // it reads the base again.
    o.discard(65536, 65536).unwrap();
    o.read(65536, &mut b).unwrap();
    assert_eq!(b, data[65536..65536 + 8192]);
    // QEMU can open what imago wrote.
    drop(o);
    let st = std::process::Command::new("qemu-img")
        .args(["check", "-q"])
        .arg(&ov)
        .status()
        .unwrap();
    assert!(st.success());
}

/// md5 and mtime of a file: what a "nothing written" check compares.
fn fingerprint(p: &Path) -> (String, std::time::SystemTime) {
    let out = std::process::Command::new("md5sum")
        .arg(p)
        .output()
        .unwrap();
    let sum = String::from_utf8(out.stdout).unwrap();
    let sum = sum.split_whitespace().next().unwrap().to_string();
    (sum, std::fs::metadata(p).unwrap().modified().unwrap())
}

fn qemu_img(args: &[&str]) {
    let out = std::process::Command::new("qemu-img")
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "qemu-img {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `qemu-img create` of a qcow2 overlay `out` over the raw base `base` (as named in its
/// header: relative to `out`'s folder, or absolute), with options `opts` (`-o ...`) and
/// a virtual size (`None`: the base's).
fn qcow2_over(base: &str, out: &str, opts: &[&str], size: Option<&str>) {
    let mut args = vec!["create", "-q", "-f", "qcow2"];
    args.extend_from_slice(opts);
    args.extend(["-b", base, "-F", "raw", out]);
    args.extend(size);
    qemu_img(&args);
}

#[test]
fn an_overlay_that_does_not_match_its_base_is_refused_and_neither_file_is_written() {
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let p = |n: &str| d.path().join(n);
    let s = |n: &str| p(n).to_str().unwrap().to_string();
    std::fs::write(p("a.img"), pattern(1 << 20, 3)).unwrap();
    std::fs::write(p("b.img"), pattern(1 << 20, 4)).unwrap();
    std::fs::write(p("big.img"), pattern(2 << 20, 5)).unwrap();
    // Over a, named relatively as qemu-img users do: the good case.
    qcow2_over("a.img", &s("good.qcow2"), &[], None);
    // Over a, given b (the same size).
    qcow2_over(&s("a.img"), &s("over-a.qcow2"), &[], None);
    // No backing file.
    qemu_img(&["create", "-q", "-f", "qcow2", &s("alone.qcow2"), "1M"]);
    // Backing format qcow2 (-u: not opened, it is raw).
    qemu_img(&[
        "create",
        "-q",
        "-f",
        "qcow2",
        "-u",
        "-b",
        &s("a.img"),
        "-F",
        "qcow2",
        &s("fmt.qcow2"),
        "1M",
    ]);
    // Over a but larger than it.
    qcow2_over(&s("a.img"), &s("large.qcow2"), &[], Some("2M"));
    // Over big, given as big but the base truncated since (a base that was replaced).
    qcow2_over(&s("big.img"), &s("shrunk.qcow2"), &[], None);
    std::fs::OpenOptions::new()
        .write(true)
        .open(p("big.img"))
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    assert!(OverlayDisk::open(&p("a.img"), &p("good.qcow2")).is_ok());
    // (base, overlay, the mismatch expected)
    type Case = (&'static str, &'static str, fn(&Mismatch) -> bool);
    let cases: [Case; 5] = [
        ("b.img", "over-a.qcow2", |m| {
            matches!(m, Mismatch::BackingFile { .. })
        }),
        ("a.img", "alone.qcow2", |m| matches!(m, Mismatch::NoBacking)),
        (
            "a.img",
            "fmt.qcow2",
            |m| matches!(m, Mismatch::BackingFormat(Some(f)) if f == "qcow2"),
        ),
        (
            "a.img",
            "large.qcow2",
            |m| matches!(m, Mismatch::Size { base, overlay } if *base == 1 << 20 && *overlay == 2 << 20),
        ),
        ("big.img", "shrunk.qcow2", |m| {
            matches!(m, Mismatch::Size { .. })
        }),
    ];
    for (base, ov, want) in cases {
        let before = (fingerprint(&p(base)), fingerprint(&p(ov)));
        match OverlayDisk::open(&p(base), &p(ov)) {
            Err(e @ DiskError::OverlayMismatch { .. }) => {
                let DiskError::OverlayMismatch { why, .. } = &e else {
                    unreachable!()
                };
                assert!(want(why), "{base} {ov}: {e}");
                // The message names both files.
                let msg = e.to_string();
                assert!(msg.contains(ov) && msg.contains(base), "{msg}");
            }
            Err(e) => panic!("{base} {ov}: another error: {e}"),
            Ok(_) => panic!("{base} {ov}: opened"),
        }
        assert_eq!(before, (fingerprint(&p(base)), fingerprint(&p(ov))), "{ov}");
    }
}

/// Writes `data` at `off` into `path` in place (no truncation).
fn overwrite(path: &Path, off: u64, data: &[u8]) {
    let f = std::fs::OpenOptions::new().write(true).open(path).unwrap();
    f.write_all_at(data, off).unwrap();
}

#[test]
fn a_base_that_changes_under_the_device_is_refused_and_the_overlay_is_untouched() {
    let (d, base, ov, data) = base_and_overlay(6);
    let mut o = OverlayDisk::open(&base, &ov).unwrap();
    o.write(0, &[9u8; 65536]).unwrap();
    let mut b = vec![0u8; 8192];
    o.read(131072, &mut b).unwrap();
    assert_eq!(b, data[131072..131072 + 8192]);
    assert!(!o.base_changed());
    // Past a coarse timestamp tick (kernels without fine-grained timestamps).
    std::thread::sleep(std::time::Duration::from_millis(20));
    let ov_before = fingerprint(&ov);
    // The same size, one byte rewritten with its own value: only the times change.
    overwrite(&base, 200_000, &data[200_000..200_001]);
    let e = o.read(131072, &mut b).unwrap_err();
    assert!(matches!(e, DiskError::BaseChanged { .. }), "{e}");
    let msg = e.to_string();
    assert!(msg.contains("base.img") && msg.contains("mtime"), "{msg}");
    assert!(o.base_changed());
    // Writes (a partial cluster copies from the base), discards and write-zeroes are
    // refused too...
    assert!(matches!(
        o.write(300_000, &[1u8; 512]),
        Err(DiskError::BaseChanged { .. })
    ));
    assert!(matches!(
        o.discard(0, 65536),
        Err(DiskError::BaseChanged { .. })
    ));
    for unmap in [true, false] {
        assert!(matches!(
            o.write_zeroes(0, 65536, unmap),
            Err(DiskError::BaseChanged { .. })
        ));
    }
    // ...the overlay's own clusters still read, and the overlay is untouched.
    o.read(0, &mut b).unwrap();
    assert_eq!(b, [9u8; 8192]);
    drop(o);
    assert_eq!(fingerprint(&ov), ov_before);
    // A restart refuses it too: the stamp of the first open still names the old base.
    assert!(matches!(
        OverlayDisk::open(&base, &ov),
        Err(DiskError::BaseChangedSinceStamp { .. })
    ));
    assert_eq!(fingerprint(&ov), ov_before);

    // A raw disk whose base is truncated, or replaced by another file at its path.
    let r = RawDisk::open(&base).unwrap();
    r.read(0, &mut b).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    std::fs::OpenOptions::new()
        .write(true)
        .open(&base)
        .unwrap()
        .set_len(4096)
        .unwrap();
    let e = r.read(0, &mut b).unwrap_err();
    assert!(e.to_string().contains("size 1048576 → 4096"), "{e}");
    assert!(r.base_changed());
    let r = RawDisk::open(&base).unwrap();
    let other = d.path().join("other.img");
    std::fs::write(&other, vec![0u8; 4096]).unwrap();
    std::fs::rename(&other, &base).unwrap();
    // The open file's ctime moves as its last name goes (fstat sees that first), and the
    // path names another file.
    let e = r.read(0, &mut b[..4096]).unwrap_err();
    assert!(matches!(e, DiskError::BaseChanged { .. }), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("ctime") && msg.contains("another file at its path"),
        "{msg}"
    );
}

#[test]
fn a_chmod_a_link_or_times_set_on_the_base_are_no_change_and_a_rewrite_after_them_is() {
    use std::os::unix::fs::PermissionsExt;
    let (d, base, ov, data) = base_and_overlay(7);
    let o = OverlayDisk::open(&base, &ov).unwrap();
    let mut b = vec![0u8; 4096];
    let read0 = |b: &mut Vec<u8>| {
        let r = o.read(0, b);
        assert!(r.is_ok(), "{}", r.unwrap_err());
        assert_eq!(b[..], data[..4096]);
    };
    read0(&mut b);
    // Past a coarse timestamp tick, so that each ctime below is a new one.
    let tick = || std::thread::sleep(std::time::Duration::from_millis(20));
    tick();
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o444)).unwrap();
    read0(&mut b);
    tick();
    std::fs::hard_link(&base, d.path().join("link.img")).unwrap();
    read0(&mut b);
    // Times set as `tar` restores them: mtime as it was, ctime now.
    tick();
    let mtime = std::fs::metadata(&base).unwrap().modified().unwrap();
    let f = std::fs::File::open(&base).unwrap();
    f.set_times(std::fs::FileTimes::new().set_modified(mtime))
        .unwrap();
    read0(&mut b);
    o.write(65536, &[3u8; 4096]).unwrap();
    assert!(!o.base_changed());
    // A rewrite of a byte with its own value (a new mtime) is still refused.
    tick();
    std::fs::set_permissions(&base, std::fs::Permissions::from_mode(0o644)).unwrap();
    overwrite(&base, 100, &data[100..101]);
    let e = o.read(0, &mut b).unwrap_err();
    assert!(matches!(e, DiskError::BaseChanged { .. }), "{e}");
    assert!(e.to_string().contains("mtime"), "{e}");
    assert!(o.base_changed());
}

#[test]
fn after_a_failed_sync_the_overlay_fails_every_flush() {
    let (_d, base, ov, _) = base_and_overlay(3);
    let o = OverlayDisk::open(&base, &ov).unwrap();
    o.write(0, &[5u8; 4096]).unwrap();
    o.flush().unwrap();
    // An fsync's EIO (which no file system here can be made to give on demand), as the
    // overlay's latch sees it.
    let eio = o
        .sync_latch
        .sync(|| Err(std::io::Error::from_raw_os_error(libc::EIO)));
    assert!(eio.is_err());
    o.write(4096, &[6u8; 4096]).unwrap();
    // The kernel's next fsync would succeed; the guest must not be told its write is on
    // disk.
    let e = o
        .flush()
        .expect_err("a flush after a failed sync must fail");
    assert!(e.to_string().contains("earlier flush"), "{e}");
}

mod across_opens;
mod one_open;
mod planted;
mod repair;
mod two_guests;
