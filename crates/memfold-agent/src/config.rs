//! What the agent is told (its environment, [`AgentConfig`]) and what it finds (the guest
//! RAM mapping QEMU made, [`find_ram`]).

use std::io;
use std::os::fd::OwnedFd;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

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
}

impl AgentConfig {
    /// Reads the configuration from the environment; `None` when `MEMFOLD_SOCKET` is unset
    /// (the library is then inert).
    pub fn from_env() -> Option<AgentConfig> {
        let socket = std::env::var_os("MEMFOLD_SOCKET")?;
        Some(AgentConfig {
            socket: socket.into(),
            name: std::env::var("MEMFOLD_VM_NAME").unwrap_or_else(|_| "guest".into()),
            ram_bytes: std::env::var("MEMFOLD_RAM_BYTES")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(0),
            vma_budget: std::env::var("MEMFOLD_VMA_BUDGET")
                .ok()
                .and_then(|v| v.parse().ok()),
        })
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
