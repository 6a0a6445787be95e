//! What the agent is told: its environment, [`AgentConfig`]. (What it finds, guest RAM's
//! regions, is `regions.rs`.)

use std::path::PathBuf;
use std::str::FromStr;

/// What the agent needs to know, from its environment.
#[derive(Clone, Debug)]
pub struct AgentConfig {
    /// memfoldd's socket (`MEMFOLD_SOCKET`).
    pub socket: PathBuf,
    /// Guest name (`MEMFOLD_VM_NAME`; `guest` if unset). With several RAM regions, each
    /// is attached as `NAME/ramK`.
    pub name: String,
    /// Guest RAM, bytes (`MEMFOLD_RAM_BYTES`): not needed (the agent finds every region
    /// itself); if not 0, a check that the regions found add up to it. 0: not given.
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
