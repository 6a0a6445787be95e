//! `memfold analyze SNAPSHOT...`: Difference Engine Table 1 on captured guest RAM.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use memfold_core::analysis::{analyze, AnalysisConfig, GuestMemory, SetAnalysis};
use memfold_core::{CompressCodec, PatchCodec, SimilarityConfig};

use crate::plot;

/// Arguments of `memfold analyze`.
#[derive(Args, Clone, Debug)]
pub struct AnalyzeArgs {
    /// Snapshot files (`NAME.ram`; a `NAME.resident` beside it gives host residency).
    #[arg(required = true)]
    pub snapshots: Vec<PathBuf>,
    /// HashSimilarityDetector k: indexes per page.
    #[arg(long, default_value_t = 2)]
    pub k: u8,
    /// HashSimilarityDetector s: 64-byte blocks per index.
    #[arg(long, default_value_t = 1)]
    pub s: u8,
    /// Candidates per bucket.
    #[arg(long, default_value_t = 1)]
    pub candidates: u8,
    /// Similarity hash width, bits.
    #[arg(long, default_value_t = 32)]
    pub hash_bits: u8,
    /// Patch codec: run-diff, xor-lz4, zstd-ref.
    #[arg(long, default_value = "run-diff")]
    pub patch_codec: PatchCodec,
    /// Compression codec: lz4, zstd, lzo, wkdm.
    #[arg(long, default_value = "lz4")]
    pub codec: CompressCodec,
    /// Cut-off for patches and compressed pages, bytes (at most 4088: a blob and its
    /// 8-byte header in one page).
    #[arg(long, default_value_t = 2048)]
    pub cutoff: usize,
    /// Print JSON instead of the table.
    #[arg(long)]
    pub json: bool,
    /// Write a bar chart here.
    #[arg(long)]
    pub png: Option<PathBuf>,
}

/// A file of a snapshot that cannot be read as one.
#[derive(Debug, thiserror::Error)]
pub enum InputError {
    /// The file could not be opened.
    #[error("{role} {path}: cannot open: {source}")]
    Open {
        /// What the file is to `load`: `snapshot` or `residency bitmap`.
        role: &'static str,
        /// The file.
        path: PathBuf,
        /// Cause.
        source: std::io::Error,
    },
    /// The file is no regular file: a FIFO would wait for a writer, a device might
    /// never end.
    #[error("{role} {path}: not a regular file but {what}")]
    NotRegular {
        /// What the file is to `load`: `snapshot` or `residency bitmap`.
        role: &'static str,
        /// The file.
        path: PathBuf,
        /// What it is instead (`a FIFO`, `a directory`, ...).
        what: &'static str,
    },
}

/// Opens the regular file `path` (a `role` of a snapshot) to read, with its length.
/// `O_NONBLOCK`, because opening a FIFO would otherwise wait for a writer; it changes
/// nothing for a regular file.
///
/// Errors: [`InputError`]: it cannot be opened (missing too), or is not a regular file.
fn open_regular(path: &Path, role: &'static str) -> Result<(std::fs::File, u64), InputError> {
    use std::os::unix::fs::{FileTypeExt, OpenOptionsExt};
    let open_err = |source| InputError::Open {
        role,
        path: path.to_owned(),
        source,
    };
    let f = std::fs::File::options()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)
        .map_err(open_err)?;
    let m = f.metadata().map_err(open_err)?;
    let t = m.file_type();
    let what = match () {
        _ if t.is_file() => return Ok((f, m.len())),
        _ if t.is_fifo() => "a FIFO",
        _ if t.is_dir() => "a directory",
        _ if t.is_char_device() => "a character device",
        _ if t.is_block_device() => "a block device",
        _ if t.is_socket() => "a socket",
        _ => "another kind of file",
    };
    Err(InputError::NotRegular {
        role,
        path: path.to_owned(),
        what,
    })
}

/// A snapshot read into memory.
pub struct Loaded {
    pub name: String,
    pub ram: Vec<u8>,
    pub resident: Option<Vec<u8>>,
}

/// Reads a snapshot and its residency bitmap, checking both. Read, not mapped: a snapshot
/// truncated while mapped would kill this process with SIGBUS; one truncated while it is
/// read is an error that says so, and the copy cannot change afterwards.
pub fn load(path: &Path) -> Result<Loaded> {
    use std::io::Read;
    let (mut f, len) = open_regular(path, "snapshot")?;
    if len == 0 || len % 4096 != 0 {
        bail!("snapshot {}: {len} bytes is not a whole, non-zero number of 4096-byte pages (truncated or not a RAM snapshot?)", path.display());
    }
    let mut ram = Vec::new();
    ram.try_reserve_exact(len as usize)
        .with_context(|| format!("snapshot {}: no memory for its {len} bytes", path.display()))?;
    (&mut f)
        .take(len)
        .read_to_end(&mut ram)
        .with_context(|| format!("snapshot {}: cannot read", path.display()))?;
    if ram.len() as u64 != len {
        bail!(
            "snapshot {}: {} bytes read of {len}: it was truncated while being read",
            path.display(),
            ram.len()
        );
    }
    let res_path = path.with_extension("resident");
    let resident = match open_regular(&res_path, "residency bitmap") {
        Err(InputError::Open { source, .. }) if source.kind() == std::io::ErrorKind::NotFound => {
            None
        }
        Err(e) => return Err(e.into()),
        Ok((f, res_len)) => {
            // Its size checked before it is read: a huge (or sparse) one is refused.
            let want = (len / 4096).div_ceil(8);
            if res_len != want {
                bail!(
                    "{}: {res_len} bytes, but the snapshot's {} pages need {want}",
                    res_path.display(),
                    len / 4096
                );
            }
            let mut b = Vec::new();
            f.take(want)
                .read_to_end(&mut b)
                .with_context(|| format!("{}: cannot read", res_path.display()))?;
            if b.len() as u64 != want {
                bail!(
                    "{}: {} bytes read of {want}: it was truncated while being read",
                    res_path.display(),
                    b.len()
                );
            }
            Some(b)
        }
    };
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    Ok(Loaded {
        name,
        ram,
        resident,
    })
}

/// The analysis configuration of the arguments.
pub fn config(a: &AnalyzeArgs) -> AnalysisConfig {
    AnalysisConfig {
        similarity: SimilarityConfig {
            groups: a.k,
            blocks_per_group: a.s,
            candidates: a.candidates,
            hash_bits: a.hash_bits,
            ..Default::default()
        },
        patch_codec: a.patch_codec,
        patch_cutoff: a.cutoff,
        compress_codec: a.codec,
        compress_cutoff: a.cutoff,
        ..AnalysisConfig::default()
    }
}

/// Runs the analysis over loaded snapshots.
pub fn run_on(loaded: &[Loaded], cfg: &AnalysisConfig) -> Result<Vec<SetAnalysis>> {
    let guests: Vec<GuestMemory> = loaded
        .iter()
        .map(|l| GuestMemory {
            name: l.name.clone(),
            ram: &l.ram[..],
            resident: l.resident.as_deref(),
        })
        .collect();
    analyze(&guests, cfg).map_err(anyhow::Error::msg)
}

/// Prints the DE Table 1 style table.
pub fn print_table(sets: &[SetAnalysis]) {
    println!(
        "{:<14} {:<8} {:>9} {:>8} {:>9} {:>9} {:>8} {:>10} {:>10} {:>10} {:>12}",
        "set",
        "basis",
        "pages",
        "zero",
        "dup",
        "dist.dup",
        "unique",
        "sharing",
        "+patching",
        "+compress",
        "frames-cmp"
    );
    for s in sets {
        let pct = |x: f64| {
            if s.pages == 0 {
                0.0
            } else {
                100.0 * (1.0 - x / s.pages as f64)
            }
        };
        println!(
            "{:<14} {:<8} {:>9} {:>8} {:>9} {:>9} {:>8} {:>9.1}% {:>9.1}% {:>9.1}% {:>11.1}%",
            s.name,
            s.basis,
            s.pages,
            s.zero_pages,
            s.duplicate_pages,
            s.distinct_duplicate_pages,
            s.unique_pages,
            pct(s.pages_sharing_only),
            pct(s.pages_with_patching),
            pct(s.pages_with_compression),
            100.0 * s.shared_frames_compressed_saving / (s.pages as f64).max(1.0)
        );
    }
    println!("(sharing / +patching / +compress: memory saved, as % of the pages considered; frames-cmp: what keeping every shared frame compressed would save on top of sharing, % of the pages — live DE never compresses a shared frame)");
}

/// A grouped bar chart: per set (resident basis), pages needed by each scheme.
pub fn chart(path: &Path, sets: &[SetAnalysis]) -> Result<()> {
    let groups: Vec<(String, Vec<(String, f64)>)> = sets
        .iter()
        .filter(|s| s.basis == "resident")
        .map(|s| {
            (
                s.name.clone(),
                vec![
                    ("pages".into(), s.pages as f64),
                    ("sharing".into(), s.pages_sharing_only),
                    ("+patching".into(), s.pages_with_patching),
                    ("+compression".into(), s.pages_with_compression),
                ],
            )
        })
        .collect();
    plot::bars(
        path,
        "memfold analyze (DE Table 1): host-resident pages needed",
        "pages (4 KiB)",
        &groups,
    )
}

/// `memfold analyze`.
pub fn run(a: &AnalyzeArgs) -> Result<()> {
    let t = std::time::Instant::now();
    let loaded: Vec<Loaded> = a.snapshots.iter().map(|p| load(p)).collect::<Result<_>>()?;
    let bytes: u64 = loaded.iter().map(|l| l.ram.len() as u64).sum();
    let sets = run_on(&loaded, &config(a))?;
    let secs = t.elapsed().as_secs_f64();
    if let Some(png) = &a.png {
        chart(png, &sets)?;
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(
                &serde_json::json!({ "sets": sets, "bytes": bytes, "seconds": secs })
            )?
        );
    } else {
        print_table(&sets);
        eprintln!(
            "analysed {:.2} GiB in {secs:.2} s ({:.2} GB/s)",
            bytes as f64 / (1u64 << 30) as f64,
            bytes as f64 / secs / 1e9
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn snapshots_that_are_not_whole_pages_are_clear_errors_and_copies_do_not_change() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g.ram");
        std::fs::write(&p, vec![7u8; 3 * 4096]).unwrap();
        let l = load(&p).unwrap();
        assert_eq!((l.name.as_str(), l.ram.len()), ("g", 3 * 4096));
        // Truncated afterwards: the loaded copy is what was read (a mapping would SIGBUS).
        std::fs::File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(4096)
            .unwrap();
        assert!(l.ram.iter().all(|&b| b == 7));
        std::fs::write(&p, vec![7u8; 4097]).unwrap();
        let e = load(&p).err().unwrap().to_string();
        assert!(e.contains("4097 bytes is not a whole"), "{e}");
        let e = load(&dir.path().join("none.ram"))
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("cannot open"), "{e}");
    }

    /// A FIFO at `p` (nothing writes to it: opening it plainly would wait for a writer).
    fn fifo(p: &Path) {
        use rustix::fs::{mknodat, FileType, Mode, CWD};
        mknodat(CWD, p, FileType::Fifo, Mode::RUSR | Mode::WUSR, 0).unwrap();
    }

    /// `load(p)`'s error, with its causes.
    /// `load`'s error for `p`, within 10 s: a load that blocks (on a FIFO) fails the
    /// test instead of hanging it.
    fn load_err(p: &Path) -> String {
        let (tx, rx) = std::sync::mpsc::channel();
        let p = p.to_owned();
        std::thread::spawn(move || {
            let _ = tx.send(load(&p).err().map(|e| format!("{e:#}")));
        });
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .expect("load hung")
            .expect("load succeeded")
    }

    #[test]
    fn a_huge_residency_file_is_refused_by_its_size_before_it_is_read() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g.ram");
        std::fs::write(&p, vec![7u8; 4096]).unwrap();
        let r = std::fs::File::create(dir.path().join("g.resident")).unwrap();
        r.set_len(1 << 40).unwrap();
        let e = load_err(&p);
        assert!(
            e.contains("g.resident: 1099511627776 bytes, but the snapshot's 1 pages need 1"),
            "{e}"
        );
    }

    #[test]
    fn a_fifo_as_the_residency_file_is_an_error_not_a_hang() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g.ram");
        std::fs::write(&p, vec![7u8; 4096]).unwrap();
        fifo(&dir.path().join("g.resident"));
        let e = load_err(&p);
        assert!(e.contains("g.resident: not a regular file"), "{e}");
    }

    #[test]
    fn a_fifo_as_the_snapshot_is_an_error_not_a_hang() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("g.ram");
        fifo(&p);
        let e = load_err(&p);
        assert!(e.contains("g.ram: not a regular file"), "{e}");
    }
}
