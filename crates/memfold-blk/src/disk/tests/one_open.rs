//! Files named in an overlay's header are never opened, and the files checked are the
//! files served (a read-only review: the check and the open were two parses by path, and
//! imago opened the external data file a header named, read-write).
//!
//! The races are run, not simulated: a thread keeps swapping a symlink at the path given
//! to [`OverlayDisk::open`] between a good file and a bad one, while the test opens through
//! it again and again, until it has seen both files served or refused often enough. A
//! device that checks one file and serves another serves the bad one in some of them.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};

use super::*;

/// Opens served and opens refused through a swapping path before a race counts as run.
const EACH: usize = 50;
/// How long a race may take to see both (the swaps and the opens share 2 cores with
/// other tests).
const RACE: std::time::Duration = std::time::Duration::from_secs(60);

/// Whether to go on racing: until both outcomes were seen `EACH` times.
fn racing(t: std::time::Instant, served: usize, refused: usize) -> bool {
    assert!(
        t.elapsed() < RACE,
        "the race did not run: served {served}, refused {refused} in {RACE:?}"
    );
    served < EACH || refused < EACH
}

/// Tells whether a file was opened (`IN_OPEN`), by anyone, since [`Opens::of`].
struct Opens {
    inotify: std::os::fd::OwnedFd,
    path: PathBuf,
}

impl Opens {
    fn of(path: &Path) -> Opens {
        use rustix::fs::inotify;
        let inotify =
            inotify::init(inotify::CreateFlags::NONBLOCK | inotify::CreateFlags::CLOEXEC).unwrap();
        inotify::add_watch(&inotify, path, inotify::WatchFlags::OPEN).unwrap();
        Opens {
            inotify,
            path: path.to_path_buf(),
        }
    }

    /// Whether the file was opened since the watch began.
    fn opened(&self) -> bool {
        let mut buf = [std::mem::MaybeUninit::uninit(); 1024];
        let mut r = rustix::fs::inotify::Reader::new(&self.inotify, &mut buf);
        match r.next() {
            Ok(e) => e.events().contains(rustix::fs::inotify::ReadFlags::OPEN),
            Err(rustix::io::Errno::AGAIN) => false,
            Err(e) => panic!("inotify of {}: {e}", self.path.display()),
        }
    }
}

/// Keeps pointing the symlink `link` at `a`, then `b`, then `a`... (each switch an atomic
/// rename) until dropped.
struct Swapper {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Swapper {
    fn start(link: &Path, a: &Path, b: &Path) -> Swapper {
        let link_exists = |l: &Path| std::fs::symlink_metadata(l).is_ok();
        let (a, b) = (a.to_path_buf(), b.to_path_buf());
        let link = link.to_path_buf();
        let thread_link = link.clone();
        let stop = Arc::new(AtomicBool::new(false));
        let s = stop.clone();
        let thread = std::thread::spawn(move || {
            let link = thread_link;
            let tmp = link.with_extension("swap");
            for to in [&a, &b].iter().cycle() {
                if s.load(Ordering::Relaxed) {
                    break;
                }
                let _ = std::fs::remove_file(&tmp);
                std::os::unix::fs::symlink(to, &tmp).unwrap();
                std::fs::rename(&tmp, &link).unwrap();
            }
        });
        // The link is there from now on (each swap replaces it at once).
        while !link_exists(&link) {
            std::thread::yield_now();
        }
        Swapper {
            stop,
            thread: Some(thread),
        }
    }

    /// Stops swapping.
    fn stop(mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.thread.take().unwrap().join().unwrap();
    }
}

impl Drop for Swapper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// In `dir`: `base.img` (1 MiB of `pattern(.., 11)`), `good.qcow2` over it, `evil.qcow2`
/// over it whose clusters live in the external data file `victim.img` (another guest's
/// disk, 1 MiB of `pattern(.., 12)`; named by its absolute path, which qemu-img takes
/// from its working folder), the base named relatively as qemu-img users do.
fn good_and_evil(dir: &Path) {
    let s = |n: &str| dir.join(n).to_str().unwrap().to_string();
    std::fs::write(dir.join("base.img"), pattern(1 << 20, 11)).unwrap();
    qcow2_over("base.img", &s("good.qcow2"), &[], None);
    // qemu-img makes the data file; the other guest's bytes go in after.
    let data_file = format!("data_file={}", s("victim.img"));
    qcow2_over("base.img", &s("evil.qcow2"), &["-o", &data_file], None);
    std::fs::write(dir.join("victim.img"), pattern(1 << 20, 12)).unwrap();
}

#[test]
fn an_overlay_swapped_at_its_path_during_the_open_never_gets_its_data_file_opened() {
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let p = |n: &str| d.path().join(n);
    good_and_evil(d.path());
    let victim = p("victim.img");
    let before = fingerprint(&victim);
    let opens = Opens::of(&victim);
    let swapper = Swapper::start(&p("ov.qcow2"), &p("good.qcow2"), &p("evil.qcow2"));
    let (mut served, mut refused) = (0, 0);
    let t = std::time::Instant::now();
    while racing(t, served, refused) {
        match OverlayDisk::open(&p("base.img"), &p("ov.qcow2")) {
            Ok(o) => {
                served += 1;
                o.write(0, &[0x5a; 4096]).unwrap();
                o.flush().unwrap();
            }
            Err(DiskError::OverlayMismatch {
                why: Mismatch::DataFile,
                ..
            }) => refused += 1,
            // The swap's rename can leave no file at the path for an instant.
            Err(e) => panic!("{e}"),
        }
        assert!(
            !opens.opened(),
            "the external data file the swapped-in overlay names was opened (served {served} opens)"
        );
    }
    swapper.stop();
    assert_eq!(
        fingerprint(&victim),
        before,
        "the other guest's disk was written"
    );
}

#[test]
fn a_base_swapped_at_its_path_during_the_open_is_never_served() {
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let p = |n: &str| d.path().join(n);
    let real = pattern(1 << 20, 13);
    std::fs::write(p("real.img"), &real).unwrap();
    // Another file of the same size: what the overlay is not over.
    std::fs::write(p("fake.img"), pattern(1 << 20, 14)).unwrap();
    qcow2_over("real.img", p("ov.qcow2").to_str().unwrap(), &[], None);
    let swapper = Swapper::start(&p("base.img"), &p("real.img"), &p("fake.img"));
    const C: u64 = 65536;
    let (mut served, mut refused) = (0, 0);
    let t = std::time::Instant::now();
    let mut i = 0;
    while racing(t, served, refused) {
        i += 1;
        let mut o = match OverlayDisk::open(&p("base.img"), &p("ov.qcow2")) {
            Ok(o) => o,
            Err(DiskError::OverlayMismatch {
                why: Mismatch::BackingFile { .. },
                ..
            }) => {
                refused += 1;
                continue;
            }
            Err(e) => panic!("{e}"),
        };
        served += 1;
        // A cluster the overlay does not hold: read from the base by this crate.
        let mut b = vec![0u8; C as usize];
        o.read(C, &mut b).unwrap();
        assert!(
            b == real[C as usize..2 * C as usize],
            "open {i}: the base read is another file's"
        );
        // A partial write: imago copies the rest of the cluster from its base.
        o.write(2 * C, &[1u8; 512]).unwrap();
        o.read(2 * C, &mut b).unwrap();
        assert!(
            b[512..] == real[2 * C as usize + 512..3 * C as usize],
            "open {i}: imago's copy-on-write read another file"
        );
        o.discard(2 * C, C).unwrap();
    }
    swapper.stop();
}

#[test]
fn an_external_data_file_in_the_header_is_refused_by_the_open_itself_and_never_opened() {
    let d = tempfile::tempdir_in("/var/tmp").unwrap();
    let p = |n: &str| d.path().join(n);
    good_and_evil(d.path());
    let (base, evil, victim) = (p("base.img"), p("evil.qcow2"), p("victim.img"));
    let before = (fingerprint(&victim), fingerprint(&evil), fingerprint(&base));
    let opens = Opens::of(&victim);
    // The open itself, on files already open: no check by path before it.
    for direct in [true, false] {
        let raw = RawDisk::open_with(&base, direct).unwrap();
        let (file, direct) = crate::disk::open::open_overlay_file(&evil, direct).unwrap();
        match crate::disk::open::served(&raw, &file, &evil, direct) {
            Err(e @ DiskError::OverlayMismatch { .. }) => {
                let DiskError::OverlayMismatch { why, .. } = &e else {
                    unreachable!()
                };
                assert!(matches!(why, Mismatch::DataFile), "{e}");
                let msg = e.to_string();
                assert!(
                    msg.contains("evil.qcow2") && msg.contains("base.img"),
                    "{msg}"
                );
            }
            Err(e) => panic!("another error: {e}"),
            Ok(_) => panic!("an overlay with an external data file was served (O_DIRECT {direct})"),
        }
    }
    // And through the public open and check.
    assert!(matches!(
        OverlayDisk::open(&base, &evil),
        Err(DiskError::OverlayMismatch {
            why: Mismatch::DataFile,
            ..
        })
    ));
    assert!(matches!(
        check_overlay(&base, &evil),
        Err(DiskError::OverlayMismatch {
            why: Mismatch::DataFile,
            ..
        })
    ));
    assert!(!opens.opened(), "the data file the header names was opened");
    let after = (fingerprint(&victim), fingerprint(&evil), fingerprint(&base));
    assert_eq!(before, after, "a file was written");
}
