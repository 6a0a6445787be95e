//! Builds the `tiny` image's two programs as statically linked x86_64 binaries into
//! `OUT_DIR`, for `images` to embed and put in the image: `memfold-probe`
//! (images/memfold-probe.rs: the side-channel probe, docs/side-channel.md) and
//! `memfold-guest` (images/memfold-guest.rs: the enlightened guest's agent, issue 17,
//! docs/enlightened.md). Each a single file with no crates, compiled by the same rustc as
//! the workspace, so the image needs no libc of its own.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    // memfold-guest's module of never-share marks (images/memfold-guest-marks.rs).
    println!("cargo:rerun-if-changed=../../images/memfold-guest-marks.rs");
    for (name, crate_name) in [
        ("memfold-probe", "memfold_probe"),
        ("memfold-guest", "memfold_guest"),
    ] {
        build(name, crate_name);
    }
}

/// Builds images/`name`.rs into `OUT_DIR`/`name`.
fn build(name: &str, crate_name: &str) {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let src = manifest.join(format!("../../images/{name}.rs"));
    println!("cargo:rerun-if-changed={}", src.display());
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets it")).join(name);
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let status = Command::new(&rustc)
        .args([
            "--edition=2021",
            &format!("--crate-name={crate_name}"),
            "--crate-type=bin",
            "--target=x86_64-unknown-linux-gnu",
            "-Copt-level=2",
            "-Ctarget-feature=+crt-static",
            "-Cdebuginfo=0",
            "-Cstrip=symbols",
        ])
        .arg("-o")
        .arg(&out)
        .arg(&src)
        .status();
    match status {
        Ok(s) if s.success() => {}
        Ok(s) => panic!(
            "building the guest program {} with {} failed ({s}): it needs the static C library (libc6-dev's libc.a; make setup installs it)",
            src.display(),
            rustc.to_string_lossy()
        ),
        Err(e) => panic!("cannot run {}: {e}", rustc.to_string_lossy()),
    }
}
