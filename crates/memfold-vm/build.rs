//! Builds `memfold-probe` (images/memfold-probe.rs: the side-channel probe the `tiny`
//! image carries, docs/side-channel.md) as a statically linked x86_64 binary into
//! `OUT_DIR`, for `images` to embed and put in the image. A single file with no crates,
//! compiled by the same rustc as the workspace, so the image needs no libc of its own.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let manifest = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"));
    let src = manifest.join("../../images/memfold-probe.rs");
    println!("cargo:rerun-if-changed={}", src.display());
    println!("cargo:rerun-if-changed=build.rs");
    let out =
        PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets it")).join("memfold-probe");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let status = Command::new(&rustc)
        .args([
            "--edition=2021",
            "--crate-name=memfold_probe",
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
            "building the guest probe {} with {} failed ({s}): it needs the static C library (libc6-dev's libc.a; make setup installs it)",
            src.display(),
            rustc.to_string_lossy()
        ),
        Err(e) => panic!("cannot run {}: {e}", rustc.to_string_lossy()),
    }
}
