//! Benchmark subcommands.

pub mod disk_io;
pub mod fault_path;
pub mod micro;
pub mod read_share;
pub mod scale;
pub mod side_channel;

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::Context;

/// What every guest benchmark starts with: its output folder (`out`, else
/// `out/<default>`) made and canonical, the images of `profiles` built in the image cache,
/// and the acceleration this host gives. Returns (output folder, image cache, accel).
///
/// Errors: the folder cannot be made, an image does not build.
pub(crate) fn prepare(
    out: &Option<PathBuf>,
    default: &str,
    profiles: &[&str],
) -> anyhow::Result<(PathBuf, PathBuf, memfold_vm::launcher::Accel)> {
    let out = out.clone().unwrap_or_else(|| crate::default_out(default));
    std::fs::create_dir_all(&out).with_context(|| format!("cannot create {}", out.display()))?;
    let out = std::fs::canonicalize(&out)?;
    let cache = memfold_vm::images::cache_dir();
    for p in profiles {
        memfold_vm::images::build(&cache, p, |l| {
            eprintln!("  [{p}] {}", l.trim_start_matches("== step: "))
        })?;
    }
    let accel = memfold_vm::launcher::detect_accel(&cache);
    Ok((out, cache, accel))
}

/// A data disk of `mib` MiB of random bytes at `out/data-disk.img` (kept when it is
/// already of that size): no two of its pages are equal, none is zero, so only the
/// guests' reads of it make duplicates. Returns its canonical path.
///
/// Errors: the file cannot be written, /dev/urandom cannot be read.
pub(crate) fn data_file(out: &Path, mib: u64) -> anyhow::Result<PathBuf> {
    let path = out.join("data-disk.img");
    if std::fs::metadata(&path).map(|m| m.len()).ok() != Some(mib << 20) {
        let mut f = std::fs::File::create(&path)
            .with_context(|| format!("cannot create {}", path.display()))?;
        let mut rng = std::fs::File::open("/dev/urandom").context("/dev/urandom")?;
        let mut buf = vec![0u8; 1 << 20];
        for _ in 0..mib {
            rng.read_exact(&mut buf).context("/dev/urandom")?;
            f.write_all(&buf)
                .with_context(|| format!("cannot write {}", path.display()))?;
        }
    }
    Ok(std::fs::canonicalize(&path)?)
}
