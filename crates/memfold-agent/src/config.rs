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
    /// How the clock's R bits are taken (`MEMFOLD_CLOCK_RBITS`: `userfault`, the default,
    /// or `pagemap`).
    pub clock_rbits: ClockRBits,
}

/// What the agent logs (in QEMU's stderr) when its clock reads R bits from the page
/// tables ([`ClockRBits::Pagemap`] taken, not fallen back): how a launcher tells which
/// mode each agent runs.
pub const PAGEMAP_CLOCK_LOG: &str = "the clock reads R bits from the page tables";

/// How the agent takes the NRU clock's R bits (DE §4.2) of the private pages it arms
/// (`MEMFOLD_CLOCK_RBITS`). Either way arming zaps the pages' PTEs (`MADV_DONTNEED`) and
/// M comes from synchronous write-protect faults.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ClockRBits {
    /// Guest RAM is registered for minor faults: the first access to an armed page is a
    /// minor userfault the agent answers (`UFFDIO_CONTINUE`), setting R. One round trip
    /// through the agent per used page per pass (7–55 µs here, docs/peer.md). A write
    /// through a second mapping of guest RAM's memfd into a hole the agent holds is then
    /// caught at the guest's next access (a stored page fails closed: docs/security.md).
    #[default]
    Userfault,
    /// Guest RAM is registered for missing and write-protect faults only: the first
    /// access to an armed page is an in-kernel minor fault (~1 µs), and R is read back at
    /// the next clock scan as "the PTE is present again" (`PAGEMAP_SCAN`, Linux 6.7+; the
    /// agent falls back to `userfault` without it). The price: a write into a hole of
    /// guest RAM's memfd that bypasses QEMU's mapping (a vhost-user backend other than
    /// memfold-blk; out of scope either way) is no longer caught, so the guest would read
    /// it merged with zeros instead of being paused.
    Pagemap,
}

impl FromStr for ClockRBits {
    type Err = ConfigError;

    fn from_str(s: &str) -> Result<ClockRBits, ConfigError> {
        match s {
            "userfault" => Ok(ClockRBits::Userfault),
            "pagemap" => Ok(ClockRBits::Pagemap),
            other => Err(ConfigError::ClockRBits(other.into())),
        }
    }
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
    /// `MEMFOLD_CLOCK_RBITS` is neither `userfault` nor `pagemap`.
    #[error("MEMFOLD_CLOCK_RBITS={0:?}: expected userfault or pagemap")]
    ClockRBits(String),
    /// A variable that takes a number (`MEMFOLD_RAM_BYTES`, `MEMFOLD_VMA_BUDGET`) holds
    /// something else.
    #[error("{name}={value:?}: expected a whole number")]
    Number {
        /// The variable.
        name: &'static str,
        /// What it holds.
        value: String,
    },
}

impl AgentConfig {
    /// Reads the configuration from the environment; `Ok(None)` when `MEMFOLD_SOCKET` is
    /// unset (the library is then inert).
    ///
    /// Errors: [`ConfigError::FailMode`], [`ConfigError::ClockRBits`],
    /// [`ConfigError::Number`]: a mistyped failure mode, clock mode, RAM size or VMA
    /// budget is refused rather than guessed or ignored (the caller leaves the guest
    /// unmanaged, which needs none of them).
    pub fn from_env() -> Result<Option<AgentConfig>, ConfigError> {
        let Some(socket) = std::env::var_os("MEMFOLD_SOCKET") else {
            return Ok(None);
        };
        let on_failure = choice("MEMFOLD_FAIL", ConfigError::FailMode)?;
        let clock_rbits = choice("MEMFOLD_CLOCK_RBITS", ConfigError::ClockRBits)?;
        Ok(Some(AgentConfig {
            socket: socket.into(),
            name: std::env::var("MEMFOLD_VM_NAME").unwrap_or_else(|_| "guest".into()),
            ram_bytes: number("MEMFOLD_RAM_BYTES", std::env::var_os("MEMFOLD_RAM_BYTES"))?
                .unwrap_or(0),
            vma_budget: number("MEMFOLD_VMA_BUDGET", std::env::var_os("MEMFOLD_VMA_BUDGET"))?
                .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
            on_failure,
            clock_rbits,
        }))
    }
}

/// Environment variable `name`, holding `value`, read as a whole number; `None` when
/// unset (a typo once left the guest managed as if it were unset, silently).
///
/// Errors: [`ConfigError::Number`] for anything but a whole number.
fn number(
    name: &'static str,
    value: Option<std::ffi::OsString>,
) -> Result<Option<u64>, ConfigError> {
    let Some(v) = value else {
        return Ok(None);
    };
    let text = v.to_string_lossy();
    text.trim()
        .parse()
        .map(Some)
        .map_err(|_| ConfigError::Number {
            name,
            value: text.into_owned(),
        })
}

/// Environment variable `name` read as one of `T`'s words, `T::default()` when unset.
///
/// Errors: an unknown word (`T`'s own error), or a value that is not UTF-8 (`bad`).
fn choice<T: FromStr<Err = ConfigError> + Default>(
    name: &str,
    bad: fn(String) -> ConfigError,
) -> Result<T, ConfigError> {
    match std::env::var(name) {
        Ok(v) => v.parse(),
        Err(std::env::VarError::NotPresent) => Ok(T::default()),
        Err(std::env::VarError::NotUnicode(v)) => Err(bad(v.to_string_lossy().into())),
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

    /// A RAM size or VMA budget that is not a number is refused, naming the variable,
    /// not taken as unset.
    #[test]
    fn a_number_that_is_not_one_is_refused() {
        let n = |v: &str| number("MEMFOLD_VMA_BUDGET", Some(v.into()));
        assert_eq!(n("60000").unwrap(), Some(60000));
        assert_eq!(number("MEMFOLD_RAM_BYTES", None).unwrap(), None);
        for bad in ["", "64k", "-1", "1e6", "lots"] {
            let e = n(bad).unwrap_err();
            assert!(
                e.to_string().starts_with("MEMFOLD_VMA_BUDGET=")
                    && e.to_string().contains("expected a whole number"),
                "{e}"
            );
        }
    }

    #[test]
    fn the_clock_mode_is_userfault_or_pagemap_and_nothing_else() {
        assert_eq!(
            "userfault".parse::<ClockRBits>().unwrap(),
            ClockRBits::Userfault
        );
        assert_eq!(
            "pagemap".parse::<ClockRBits>().unwrap(),
            ClockRBits::Pagemap
        );
        assert_eq!(ClockRBits::default(), ClockRBits::Userfault);
        for bad in ["", "Pagemap", "minor", "uffd"] {
            let e = bad.parse::<ClockRBits>().unwrap_err();
            assert!(
                e.to_string().contains("expected userfault or pagemap"),
                "{e}"
            );
        }
    }
}
