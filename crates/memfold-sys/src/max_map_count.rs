//! The kernel's `vm.max_map_count`: how many mappings (VMAs) one process may have. Each run
//! of guest pages mapped onto pool frames is a mapping in QEMU, so this limit is where a
//! guest's mapped sharing stops (issue 19's VMA wall: at the mixed set's density, ~10 000
//! mappings a GiB of guest RAM, the default 65 530 binds near 6 GiB). Read by the agent to
//! size its VMA budget; raised by memfoldd only when the operator asks
//! (`memfoldd --max-map-count`), never lowered.

use std::path::{Path, PathBuf};

/// Where the kernel exposes the limit.
pub const PATH: &str = "/proc/sys/vm/max_map_count";

/// The kernel's default (`DEFAULT_MAX_MAP_COUNT`), taken when the limit cannot be read.
pub const KERNEL_DEFAULT: u64 = 65_530;

/// Largest value the kernel takes (the sysctl is a C `int`).
pub const MAX: u64 = i32::MAX as u64;

/// Why the limit could not be read or raised. Each names the file.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The file could not be read or written (e.g. `EACCES`: memfoldd is not root).
    #[error("{path}: {source}")]
    Io {
        /// The sysctl's file.
        path: PathBuf,
        /// What the kernel said.
        source: std::io::Error,
    },
    /// The file did not hold a number.
    #[error("{path}: not a number: {text:?}")]
    NotANumber {
        /// The sysctl's file.
        path: PathBuf,
        /// What it held.
        text: String,
    },
    /// A value the kernel cannot hold was asked for.
    #[error("{path}: {asked} is over the kernel's largest value, {MAX}")]
    TooLarge {
        /// The sysctl's file.
        path: PathBuf,
        /// The value asked for.
        asked: u64,
    },
    /// The write went through but the limit read back is still under what was asked.
    #[error("{path}: asked for {asked}, the kernel holds {now}")]
    NotTaken {
        /// The sysctl's file.
        path: PathBuf,
        /// The value asked for.
        asked: u64,
        /// The value read back.
        now: u64,
    },
}

/// What [`raise_at`] did: the limit before and after (equal: left as it was, already at
/// least what was asked).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Raised {
    /// The limit before, mappings.
    pub was: u64,
    /// The limit now, mappings.
    pub now: u64,
}

/// The limit held in `path` (the kernel's: [`PATH`]), mappings.
///
/// Errors: the file cannot be read, or holds no number.
pub fn read_at(path: &Path) -> Result<u64, Error> {
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.into(),
        source,
    })?;
    text.trim().parse().map_err(|_| Error::NotANumber {
        path: path.into(),
        text,
    })
}

/// The kernel's limit, or [`KERNEL_DEFAULT`] if it cannot be read (no `/proc/sys`).
pub fn read() -> u64 {
    read_at(Path::new(PATH)).unwrap_or(KERNEL_DEFAULT)
}

/// Raises the limit in `path` (the kernel's: [`PATH`]) to `at_least` mappings if it is
/// lower; never lowers it (other processes may already have more mappings than a lower
/// limit would allow, and may need them). Reads the limit back after writing.
///
/// Errors: `at_least` over [`MAX`]; the file cannot be read or written (memfoldd not root);
/// the kernel kept a lower value than asked.
pub fn raise_at(path: &Path, at_least: u64) -> Result<Raised, Error> {
    if at_least > MAX {
        return Err(Error::TooLarge {
            path: path.into(),
            asked: at_least,
        });
    }
    let was = read_at(path)?;
    if was >= at_least {
        return Ok(Raised { was, now: was });
    }
    std::fs::write(path, format!("{at_least}\n")).map_err(|source| Error::Io {
        path: path.into(),
        source,
    })?;
    let now = read_at(path)?;
    if now < at_least {
        return Err(Error::NotTaken {
            path: path.into(),
            asked: at_least,
            now,
        });
    }
    Ok(Raised { was, now })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(text: &str) -> (tempfile::TempDir, PathBuf) {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("max_map_count");
        std::fs::write(&p, text).unwrap();
        (d, p)
    }

    #[test]
    fn a_lower_limit_is_raised_and_a_higher_one_left() {
        let (_d, p) = file("65530\n");
        // (asked, was, now): never lowered, a smaller ask leaves it.
        for (asked, was, now) in [
            (1_000_000, 65_530, 1_000_000),
            (100_000, 1_000_000, 1_000_000),
        ] {
            assert_eq!(
                raise_at(&p, asked).unwrap(),
                Raised { was, now },
                "asked {asked}"
            );
            assert_eq!(read_at(&p).unwrap(), now);
        }
    }

    #[test]
    fn every_failure_names_the_file() {
        let (_d, p) = file("many\n");
        let e = raise_at(&p, 10).unwrap_err();
        assert!(matches!(e, Error::NotANumber { .. }), "{e}");
        assert!(e.to_string().contains("max_map_count"), "{e}");
        let e = raise_at(&p, MAX + 1).unwrap_err();
        assert!(matches!(e, Error::TooLarge { .. }), "{e}");
        let gone = p.with_file_name("absent");
        let e = raise_at(&gone, 10).unwrap_err();
        assert!(e.to_string().contains("absent"), "{e}");
    }
}
