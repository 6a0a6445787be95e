//! What the agent is told (its environment, [`AgentConfig`]) and what it finds (the guest
//! RAM mapping QEMU made, [`find_ram`]).

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::str::FromStr;

/// What the agent needs to know, from its environment.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// memfoldd's socket (`MEMFOLD_SOCKET`).
    pub socket: PathBuf,
    /// Guest name (`MEMFOLD_VM_NAME`).
    pub name: String,
    /// Guest RAM, bytes (`MEMFOLD_RAM_BYTES`).
    pub ram_bytes: u64,
    /// Most mappings (VMAs) the agent lets QEMU have (`MEMFOLD_VMA_BUDGET`); `None`:
    /// vm.max_map_count less 4096 left for QEMU's own mappings.
    pub vma_budget: Option<usize>,
    /// What failing closed does (`MEMFOLD_FAIL`: `pause`, the default, or `abort`).
    pub on_failure: FailMode,
}

/// What the agent does to QEMU when it fails closed (`MEMFOLD_FAIL`): either way no
/// guest runs on without the agent's protection.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FailMode {
    /// Stop the whole QEMU process (`SIGSTOP`), guest RAM mapped and intact, for the
    /// operator to inspect (`gcore`, `/proc/PID/mem`) or end (`kill -9`).
    #[default]
    Pause,
    /// Abort QEMU (`SIGABRT`): the guest is gone; its RAM stays in its memfd only as
    /// long as another process holds it.
    Abort,
}

impl FromStr for FailMode {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<FailMode, ConfigError> {
        match s {
            "pause" => Ok(FailMode::Pause),
            "abort" => Ok(FailMode::Abort),
            other => Err(ConfigError::FailMode(other.into())),
        }
    }
}

/// The environment asks for something the agent does not know.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// `MEMFOLD_FAIL` is neither `pause` nor `abort`.
    #[error("MEMFOLD_FAIL={0:?}: expected pause or abort")]
    FailMode(String),
}

impl AgentConfig {
    /// Reads the configuration from the environment; `Ok(None)` when `MEMFOLD_SOCKET` is
    /// unset (the library is then inert).
    ///
    /// Errors: [`ConfigError::FailMode`]: a mistyped failure mode is refused rather than
    /// guessed (the caller leaves the guest unmanaged, which needs no failure mode).
    pub fn from_env() -> Result<Option<AgentConfig>, ConfigError> {
        let Some(socket) = std::env::var_os("MEMFOLD_SOCKET") else {
            return Ok(None);
        };
        let on_failure = match std::env::var("MEMFOLD_FAIL") {
            Ok(v) => v.parse()?,
            Err(std::env::VarError::NotPresent) => FailMode::default(),
            Err(std::env::VarError::NotUnicode(v)) => {
                return Err(ConfigError::FailMode(v.to_string_lossy().into()))
            }
        };
        Ok(Some(AgentConfig {
            socket: socket.into(),
            name: std::env::var("MEMFOLD_VM_NAME").unwrap_or_else(|_| "guest".into()),
            ram_bytes: std::env::var("MEMFOLD_RAM_BYTES")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            vma_budget: std::env::var("MEMFOLD_VMA_BUDGET")
                .ok()
                .and_then(|v| v.parse().ok()),
            on_failure,
        }))
    }
}

/// Finds the guest RAM mapping: a shared memfd mapping of `ram_bytes`. Returns its start
/// address and an fd of the memfd (matched by inode among this process's descriptors);
/// `None` while there is none.
///
/// Errors: `/proc/self/maps` or `/proc/self/fd` cannot be read.
pub(crate) fn find_ram(ram_bytes: u64) -> io::Result<Option<(u64, OwnedFd)>> {
    let maps = std::fs::read_to_string("/proc/self/maps")?;
    for line in maps.lines() {
        let mut parts = line.split_whitespace();
        let (Some(range), Some(perms), _, _, Some(inode)) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            continue;
        };
        let path: String = parts.collect::<Vec<_>>().join(" ");
        if !path.starts_with("/memfd:") || !perms.starts_with("rw") || !perms.ends_with('s') {
            continue;
        }
        let (s, e) = range.split_once('-').unwrap_or(("0", "0"));
        let (s, e) = (
            u64::from_str_radix(s, 16).unwrap_or(0),
            u64::from_str_radix(e, 16).unwrap_or(0),
        );
        if e - s != ram_bytes {
            continue;
        }
        let inode: u64 = inode.parse().unwrap_or(0);
        for entry in std::fs::read_dir("/proc/self/fd")?.flatten() {
            let Ok(target) = std::fs::read_link(entry.path()) else {
                continue;
            };
            if !target.to_string_lossy().starts_with("/memfd:") {
                continue;
            }
            // Read-write: CoW breaks write the private copy with pwrite.
            let Ok(file) = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(entry.path())
            else {
                continue;
            };
            let Ok(meta) = file.metadata() else { continue };
            if meta.ino() == inode && meta.len() == ram_bytes {
                return Ok(Some((s, OwnedFd::from(file))));
            }
        }
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_failure_mode_is_pause_or_abort_and_nothing_else() {
        assert_eq!("pause".parse::<FailMode>().unwrap(), FailMode::Pause);
        assert_eq!("abort".parse::<FailMode>().unwrap(), FailMode::Abort);
        assert_eq!(FailMode::default(), FailMode::Pause);
        for bad in ["", "Pause", "abrot", "kill"] {
            let e = bad.parse::<FailMode>().unwrap_err();
            assert!(e.to_string().contains("expected pause or abort"), "{e}");
        }
    }
}
