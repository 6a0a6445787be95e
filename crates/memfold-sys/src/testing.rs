//! Helpers for memfold's own tests.
//!
//! A test that cannot check what it is about on this host (the kernel lacks a feature, a
//! tool is not installed) returns early and passes; [`skipped`] makes that visible. It
//! says so on stderr and, where the environment names a file in [`SKIP_LOG`], appends one
//! line `test: reason` to it, so CI (`.ci/run`) can list every skip beside its totals.

use std::io::Write;
use std::path::Path;

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
