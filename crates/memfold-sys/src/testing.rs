//! Helpers for memfold's own tests.
//!
//! A test that cannot check what it is about on this host (the kernel lacks a feature, a
//! tool is not installed) returns early and passes; [`skipped`] makes that visible. It
//! says so on stderr and, where the environment names a file in [`SKIP_LOG`], appends one
//! line `test: reason` to it, so CI (`.ci/run`) can list every skip beside its totals.

use std::io::Write;
use std::path::{Path, PathBuf};

use crate::reclaim::{SwapFile, Zswap, ZSWAP_DIR};

/// The environment variable naming the file [`skipped`] appends its lines to.
pub const SKIP_LOG: &str = "MEMFOLD_SKIP_LOG";

/// Records that `test` checked nothing here because of `reason`: a line on stderr and,
/// where [`SKIP_LOG`] names a file, the line `test: reason` appended to it (created if
/// missing). A log that cannot be written is said on stderr, not a panic: the skip is
/// still reported there.
pub fn skipped(test: &str, reason: &str) {
    let log = std::env::var_os(SKIP_LOG);
    skipped_to(log.as_deref().map(Path::new), test, reason);
}

/// This process's mappings of the file with inode `ino` (`/proc/self/maps`): how many
/// a test's guest RAM still has of a pool it was to leave.
pub fn mappings_of_inode(ino: u64) -> usize {
    let ino = ino.to_string();
    std::fs::read_to_string("/proc/self/maps")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.split_whitespace().nth(4) == Some(ino.as_str()))
        .count()
}

/// A path for a test's swap file: on `/var/tmp`, not the temporary folder, which may be a
/// tmpfs (Debian 13's default), where `swapon` refuses a file. Unique to this process and
/// `test` (a test name; `::` becomes `-`); the [`SwapFile`] guard removes it.
pub fn swap_file_path(test: &str) -> PathBuf {
    PathBuf::from(format!(
        "/var/tmp/memfold-test-{}-{}.swap",
        std::process::id(),
        test.replace("::", "-")
    ))
}

/// What [`zswap_on_one_cpu`] turned on, put back when dropped: zswap's settings first,
/// then the swap file off and removed (the order of the fields).
pub struct ZswapOnOneCpu {
    /// zswap on, lzo-rle or lzo, a pool of at most 20% of RAM.
    pub zswap: Zswap,
    /// The 16 MiB swap file behind it.
    pub swap: SwapFile,
}

/// zswap on and a 16 MiB swap file (on `/var/tmp`, [`swap_file_path`]) for a test that
/// pages out, both put back when the guard drops, with the calling thread and the threads
/// it starts afterwards on one CPU: a page just unmapped or written can wait off the LRU
/// in a CPU's batch, and `MADV_PAGEOUT` drains only its own CPU's, so on two CPUs a page
/// could stay (seen: nothing paged out, now and then).
///
/// The test is named after the calling thread (libtest names each test's thread after
/// the test). `None`, after [`skipped`] says why, where the test cannot check what it is
/// about: not root, or a kernel without zswap (no [`ZSWAP_DIR`]).
///
/// Panics (the test fails) where zswap refuses both compressors or the swap file cannot
/// be made: setup installs what these need.
pub fn zswap_on_one_cpu() -> Option<ZswapOnOneCpu> {
    let test = std::thread::current()
        .name()
        .unwrap_or("zswap_on_one_cpu")
        .to_string();
    if !rustix::process::geteuid().is_root() {
        skipped(&test, "needs root (a swap file and zswap)");
        return None;
    }
    if !Path::new(ZSWAP_DIR).join("enabled").exists() {
        skipped(&test, "the kernel has no zswap (CONFIG_ZSWAP)");
        return None;
    }
    let mut one = rustix::thread::CpuSet::new();
    one.set(rustix::thread::sched_getcpu());
    rustix::thread::sched_setaffinity(None, &one).expect("sched_setaffinity to one CPU");
    let (zswap, _) =
        Zswap::enable_first(&["lzo-rle", "lzo"], 20).expect("zswap with lzo-rle or lzo");
    let swap = SwapFile::create(&swap_file_path(&test), 16 << 20).expect("a 16 MiB swap file");
    Some(ZswapOnOneCpu { zswap, swap })
}

/// [`skipped`] with the log given, not read from the environment.
fn skipped_to(log: Option<&Path>, test: &str, reason: &str) {
    let line = format!("{test}: {reason}");
    eprintln!("skipped: {line}");
    let Some(path) = log else {
        return;
    };
    // One write of one line in append mode: lines of tests running at once do not mix.
    let r = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .and_then(|mut f| f.write_all(format!("{line}\n").as_bytes()));
    if let Err(e) = r {
        eprintln!("{SKIP_LOG}={}: {e}", path.display());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A skip appends its line to the log (the environment is left alone: other tests
    /// of this binary run at once).
    #[test]
    fn a_skip_appends_its_line_to_the_log() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("skips");
        skipped_to(Some(&log), "one_test", "no such thing here");
        skipped_to(Some(&log), "another", "nor this");
        skipped_to(None, "unlogged", "said on stderr only");
        assert_eq!(
            std::fs::read_to_string(&log).unwrap(),
            "one_test: no such thing here\nanother: nor this\n"
        );
        skipped_to(Some(&dir.path().join("no/such/dir")), "t", "r");
    }
}
