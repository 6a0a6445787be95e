//! The KVM probe's work folder (new and private, so that no other user can plant links
//! where the probe's QEMU, run as root, writes its files) and its per-boot stamp.

use std::io;
use std::path::Path;

use super::Accel;

/// A new folder `memfold-kvm-probe-<random>` in `parent`, mode 0700, removed on drop
/// (`tempfile`, which creates it with `mkdir`: an existing entry of that name, a folder
/// or a link another user planted, is never taken).
///
/// Errors: the folder cannot be made (the parent named).
pub(super) fn probe_dir(parent: &Path) -> io::Result<tempfile::TempDir> {
    use std::os::unix::fs::PermissionsExt;
    tempfile::Builder::new()
        .prefix("memfold-kvm-probe-")
        .permissions(std::fs::Permissions::from_mode(0o700))
        .tempdir_in(parent)
        .map_err(|e| {
            io::Error::new(
                e.kind(),
                format!("cannot make a folder in {}: {e}", parent.display()),
            )
        })
}

/// Runs the KVM probe (`probe`: `Some(whether a guest came up under KVM)`, or `None` if
/// it could not run at all — no work folder, no tiny image, no QEMU) and stamps the
/// verdict for boot `boot` at `stamp`. A probe that could not run stamps nothing: a
/// "tcg" stamp would keep a KVM host on TCG until it reboots, after the cause (say, the
/// image not built yet) is gone.
pub(super) fn probe_and_stamp(
    stamp: &Path,
    boot: &str,
    probe: impl FnOnce() -> Option<bool>,
) -> Accel {
    let Some(verdict) = probe() else {
        return Accel::Tcg;
    };
    let _ = std::fs::write(
        stamp,
        format!("{boot} {}", if verdict { "kvm" } else { "tcg" }),
    );
    if verdict {
        Accel::Kvm
    } else {
        Accel::Tcg
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    #[test]
    fn the_kvm_probe_works_in_a_new_private_folder_never_through_planted_links() {
        let parent = tempfile::tempdir().unwrap();
        // What a local user could plant where the probe used to work: its old folder,
        // with QEMU's stderr file a link to a file root owns.
        let victim = parent.path().join("shadow");
        std::fs::write(&victim, "secret").unwrap();
        let old = parent
            .path()
            .join(format!("memfold-kvm-probe-{}", std::process::id()));
        std::fs::create_dir_all(old.join("kvm-probe")).unwrap();
        std::os::unix::fs::symlink(&victim, old.join("kvm-probe/qemu.stderr")).unwrap();

        let a = probe_dir(parent.path()).unwrap();
        // The probe's guest writes as Guest::start does: never through the planted link.
        let guest = a.path().join("kvm-probe");
        std::fs::create_dir_all(&guest).unwrap();
        std::fs::write(guest.join("qemu.stderr"), "qemu says").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "secret");
        let b = probe_dir(parent.path()).unwrap();
        assert_ne!(a.path(), b.path(), "a random name each time");
        for d in [&a, &b] {
            assert_ne!(d.path(), old, "not the predictable folder");
            assert_eq!(d.path().parent(), Some(parent.path()));
            let mode = std::fs::metadata(d.path()).unwrap().permissions().mode();
            assert_eq!(mode & 0o777, 0o700, "{mode:o}");
        }
        assert_eq!(std::fs::read_dir(b.path()).unwrap().count(), 0, "new");
        // Removed after, with what the probe wrote.
        let (pa, pb) = (a.path().to_path_buf(), b.path().to_path_buf());
        drop((a, b));
        assert!(!pa.exists() && !pb.exists());
    }

    #[test]
    fn a_folder_that_cannot_be_made_is_named_in_the_error() {
        let parent = tempfile::tempdir().unwrap();
        let missing = parent.path().join("missing");
        let e = probe_dir(&missing).unwrap_err();
        let want = format!("cannot make a folder in {}", missing.display());
        assert!(e.to_string().contains(&want), "{e}");
    }

    #[test]
    fn a_probe_that_could_not_run_stamps_nothing_a_probe_that_ran_stamps_its_verdict() {
        let dir = tempfile::tempdir().unwrap();
        let stamp = dir.path().join("accel-probe");
        assert_eq!(probe_and_stamp(&stamp, "b1", || None), Accel::Tcg);
        assert!(!stamp.exists(), "no verdict: asked again next time");
        assert_eq!(probe_and_stamp(&stamp, "b1", || Some(false)), Accel::Tcg);
        assert_eq!(std::fs::read_to_string(&stamp).unwrap(), "b1 tcg");
        assert_eq!(probe_and_stamp(&stamp, "b2", || Some(true)), Accel::Kvm);
        assert_eq!(std::fs::read_to_string(&stamp).unwrap(), "b2 kvm");
    }
}
