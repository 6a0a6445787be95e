//! The command line on bad input and on synthetic snapshots with known answers.

use std::process::Command;

fn memfold(args: &[&str]) -> (i32, String, String) {
    let o = Command::new(env!("CARGO_BIN_EXE_memfold"))
        .args(args)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    (
        o.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&o.stdout).into(),
        String::from_utf8_lossy(&o.stderr).into(),
    )
}

#[test]
fn bad_snapshots_are_clear_errors() {
    let d = tempfile::tempdir().unwrap();
    let missing = d.path().join("missing.ram");
    let (code, _, err) = memfold(&["analyze", missing.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("missing.ram: cannot open"), "{err}");

    let odd = d.path().join("odd.ram");
    std::fs::write(&odd, vec![0u8; 5000]).unwrap();
    let (code, _, err) = memfold(&["analyze", odd.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(err.contains("5000 bytes is not a whole"), "{err}");

    let empty = d.path().join("empty.ram");
    std::fs::write(&empty, b"").unwrap();
    assert_eq!(memfold(&["analyze", empty.to_str().unwrap()]).0, 1);

    let ok = d.path().join("g.ram");
    std::fs::write(&ok, vec![0u8; 8 * 4096]).unwrap();
    std::fs::write(d.path().join("g.resident"), [0xFF, 0xFF]).unwrap();
    let (code, _, err) = memfold(&["analyze", ok.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("g.resident: 2 bytes, but the snapshot's 8 pages need 1"),
        "{err}"
    );
}

#[test]
fn unknown_profiles_and_missing_qemu_are_clear_errors() {
    let (code, _, err) = memfold(&["capture", "--profiles", "nope"]);
    assert_eq!(code, 1);
    assert!(err.contains("unknown image profile 'nope'"), "{err}");
    let (code, _, err) = memfold(&["ksm", "--mode", "sometimes", "--profiles", "tiny"]);
    assert_eq!(code, 1);
    assert!(err.contains("unknown KSM mode"), "{err}");
    // No QEMU on PATH: with the tiny image built (normal PATH), starting the guest fails,
    // saying so. The image is current (just built by this binary), so capture builds
    // nothing: it fails at QEMU, not at a build that lacks the tools PATH hides.
    let (code, _, err) = memfold(&["image", "build", "tiny"]);
    assert_eq!(code, 0, "{err}");
    let o = Command::new(env!("CARGO_BIN_EXE_memfold"))
        .args(["capture", "--profiles", "tiny", "--settle", "0"])
        .env("PATH", "/nonexistent-bin:/usr/sbin:/sbin")
        .env("MEMFOLD_ACCEL", "tcg")
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("qemu-system-x86_64 not found"), "{err}");
}

#[test]
fn analysis_of_synthetic_snapshots_is_exact() {
    let d = tempfile::tempdir().unwrap();
    let page = |b: u8| vec![b; 4096];
    let mut rnd = vec![0u8; 4096];
    for (i, x) in rnd.iter_mut().enumerate() {
        *x = (i * 7919 % 251) as u8 ^ (i / 256) as u8;
    }
    // a: zero, zero, A, A, B, rnd ; b: zero, A, C, C
    let a: Vec<u8> = [page(0), page(0), page(1), page(1), page(2), rnd.clone()].concat();
    let b: Vec<u8> = [page(0), page(1), page(3), page(3)].concat();
    std::fs::write(d.path().join("a.ram"), &a).unwrap();
    std::fs::write(d.path().join("b.ram"), &b).unwrap();
    std::fs::write(d.path().join("b.resident"), [0b0111u8]).unwrap();
    let (code, out, err) = memfold(&[
        "analyze",
        "--json",
        d.path().join("a.ram").to_str().unwrap(),
        d.path().join("b.ram").to_str().unwrap(),
    ]);
    assert_eq!(code, 0, "{err}");
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let set = |name: &str, basis: &str| {
        v["sets"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| s["name"] == name && s["basis"] == basis)
            .unwrap()
            .clone()
    };
    let all = set("all", "all");
    for (k, want) in [
        ("pages", 10),
        ("zero_pages", 3),
        ("duplicate_pages", 5),
        ("distinct_duplicate_pages", 2),
        ("unique_pages", 2),
    ] {
        assert_eq!(all[k], want, "{k}: {all}");
    }
    assert_eq!(
        all["pages_sharing_only"],
        1.0 + 4.0,
        "zero page + A, B, C, rnd"
    );
    let res = set("all", "resident");
    for (k, want) in [
        ("pages", 9),
        ("zero_pages", 3),
        ("duplicate_pages", 3),
        ("distinct_duplicate_pages", 1),
        ("unique_pages", 3),
    ] {
        assert_eq!(res[k], want, "{k}: {res}");
    }
    assert_eq!(set("a", "all")["pages_sharing_only"], 1.0 + 3.0);
    for k in [
        "name",
        "pages",
        "zero_pages",
        "duplicate_pages",
        "distinct_duplicate_pages",
        "unique_pages",
        "pages_sharing_only",
        "pages_with_patching",
        "pages_with_compression",
    ] {
        assert!(!all[k].is_null(), "JSON field {k}");
    }
}

/// Building an image where there is no room fails with the build's own complaint, and
/// leaves no half-built image that would later pass for a built one.
#[test]
fn no_space_for_an_image_is_a_clear_error() {
    let d = tempfile::tempdir().unwrap();
    let mnt = d.path().join("small");
    std::fs::create_dir(&mnt).unwrap();
    let st = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=1m", "tmpfs"])
        .arg(&mnt)
        .status()
        .unwrap();
    assert!(
        st.success(),
        "mounting a 1 MiB tmpfs (the test runs as root, as CI does)"
    );
    let o = Command::new(env!("CARGO_BIN_EXE_memfold"))
        .args(["image", "build", "tiny"])
        .env("MEMFOLD_IMAGES", &mnt)
        .env_remove("RUST_BACKTRACE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr).to_string();
    let listed = Command::new(env!("CARGO_BIN_EXE_memfold"))
        .args(["image", "list"])
        .env("MEMFOLD_IMAGES", &mnt)
        .output()
        .unwrap();
    let _ = Command::new("umount").arg(&mnt).status();
    assert_eq!(o.status.code(), Some(1), "{err}");
    // The build script runs out of space, or writing the recipe's files (the static probe,
    // ~0.5 MiB) before it does: either names what failed.
    assert!(
        err.contains("building image 'tiny' failed")
            || (err.contains("image cache") && err.contains(mnt.to_str().unwrap())),
        "{err}"
    );
    assert!(
        err.contains("No space left on device")
            || err.contains("not enough space")
            || err.contains("No space"),
        "{err}"
    );
    assert!(
        String::from_utf8_lossy(&listed.stdout).contains("tiny        -         not built"),
        "no half-built image"
    );
}

#[test]
fn unmerge_without_a_memfoldd_names_the_socket() {
    let d = tempfile::tempdir().unwrap();
    let sock = d.path().join("none.sock");
    let (code, _, err) = memfold(&["unmerge", "web-1", "--socket", sock.to_str().unwrap()]);
    assert_eq!(code, 1);
    assert!(
        err.contains("none.sock") && err.contains("No such file"),
        "{err}"
    );
}

/// Every command that talks to memfoldd, and memfoldd itself, defaults to the one socket
/// (`memfold_cli::DEFAULT_SOCKET`; it was a literal in five places).
#[test]
fn every_command_defaults_to_the_one_socket() {
    let default = format!("[default: {}]", memfold_cli::DEFAULT_SOCKET);
    for cmd in ["qemu", "status", "top", "merge", "unmerge"] {
        let (code, out, err) = memfold(&[cmd, "--help"]);
        assert_eq!(code, 0, "{cmd}: {err}");
        assert!(out.contains(&default), "memfold {cmd}: {out}");
    }
    let o = Command::new(env!("CARGO_BIN_EXE_memfoldd"))
        .arg("--help")
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains(&default), "memfoldd: {out}");
}
