//! Linux KSM, the peer memfold is measured against: its settings and counters in
//! `/sys/kernel/mm/ksm`.

use std::path::{Path, PathBuf};

use serde::Serialize;

/// The KSM sysfs folder.
pub const KSM_DIR: &str = "/sys/kernel/mm/ksm";

/// Settings memfold changes (and restores).
const SETTINGS: [&str; 4] = ["run", "pages_to_scan", "sleep_millisecs", "use_zero_pages"];

/// KSM errors.
#[derive(Debug, thiserror::Error)]
pub enum KsmError {
    /// The kernel has no KSM, or sysfs is not mounted.
    #[error("KSM is not available ({0} missing): the host kernel needs CONFIG_KSM")]
    Unavailable(PathBuf),
    /// A setting could not be read or written (not root?).
    #[error("KSM setting {path}: {source}")]
    Io {
        /// File.
        path: PathBuf,
        /// OS error.
        source: std::io::Error,
    },
}

/// KSM's counters at one instant.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct KsmStats {
    /// Shared KSM pages in use.
    pub pages_shared: u64,
    /// Additional sites sharing them (pages saved).
    pub pages_sharing: u64,
    /// Pages changing too fast to merge.
    pub pages_volatile: u64,
    /// Full scans completed.
    pub full_scans: u64,
    /// Zero pages mapped to the kernel's zero page (with `use_zero_pages`).
    pub ksm_zero_pages: u64,
    /// KSM's own net estimate of bytes saved (`None`: a kernel before 6.1, which has no
    /// `general_profit`).
    pub general_profit: Option<i64>,
}

impl KsmStats {
    /// KSM's own memory in the kernel, bytes: its rmap items, one per page it scans, as
    /// the kernel itself weighs them in `general_profit` (pages sharing and zero pages
    /// merged, times the page size, less the profit; Documentation/admin-guide/mm/ksm.rst,
    /// "Monitoring KSM profit"). Stable nodes, one per KSM page, are not in it (under
    /// 2% of the pages shared). 0 where the kernel has no `general_profit` (before 6.1).
    pub fn rmap_bytes(&self) -> u64 {
        let Some(profit) = self.general_profit else {
            return 0;
        };
        let merged = (self.pages_sharing + self.ksm_zero_pages) as i128 * 4096;
        (merged - profit as i128).max(0) as u64
    }
}

/// A KSM configuration to apply.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct KsmMode {
    /// Name for reports.
    pub name: &'static str,
    /// Pages per scan batch.
    pub pages_to_scan: u32,
    /// Sleep between batches, ms.
    pub sleep_millisecs: u32,
}

impl KsmMode {
    /// Aggressive: 10 000 pages every 20 ms (the settings that reached a plateau in 15–50 s
    /// on this machine kind; DE §5.4 ran ESX at 10 000 pages/s).
    pub const AGGRESSIVE: KsmMode = KsmMode {
        name: "aggressive",
        pages_to_scan: 10_000,
        sleep_millisecs: 20,
    };
    /// The kernel's defaults: 100 pages every 20 ms.
    pub const DEFAULT: KsmMode = KsmMode {
        name: "default",
        pages_to_scan: 100,
        sleep_millisecs: 20,
    };
}

/// KSM under memfold's control: the previous settings are saved on creation and written
/// back when this is dropped (also on error paths).
pub struct Ksm {
    dir: PathBuf,
    saved: Vec<(&'static str, String)>,
}

fn read(dir: &Path, f: &str) -> Result<String, KsmError> {
    let p = dir.join(f);
    std::fs::read_to_string(&p)
        .map(|s| s.trim().to_string())
        .map_err(|source| KsmError::Io { path: p, source })
}

fn write(dir: &Path, f: &str, v: &str) -> Result<(), KsmError> {
    let p = dir.join(f);
    std::fs::write(&p, v).map_err(|source| KsmError::Io { path: p, source })
}

impl Ksm {
    /// Saves the current settings.
    ///
    /// Errors: [`KsmError::Unavailable`], [`KsmError::Io`].
    pub fn take_control() -> Result<Self, KsmError> {
        let dir = PathBuf::from(KSM_DIR);
        if !dir.join("run").exists() {
            return Err(KsmError::Unavailable(dir.join("run")));
        }
        let saved = SETTINGS
            .iter()
            .map(|&f| Ok((f, read(&dir, f)?)))
            .collect::<Result<_, KsmError>>()?;
        Ok(Ksm { dir, saved })
    }

    /// Starts KSM with `mode` (zero pages merged like any page, KSM's default).
    ///
    /// Errors: [`KsmError::Io`].
    pub fn start(&self, mode: KsmMode) -> Result<(), KsmError> {
        write(&self.dir, "pages_to_scan", &mode.pages_to_scan.to_string())?;
        write(
            &self.dir,
            "sleep_millisecs",
            &mode.sleep_millisecs.to_string(),
        )?;
        write(&self.dir, "run", "1")
    }

    /// Stops KSM and unmerges every page (`run = 2`), so a next run starts from nothing.
    ///
    /// Errors: [`KsmError::Io`].
    pub fn unmerge(&self) -> Result<(), KsmError> {
        write(&self.dir, "run", "2")
    }

    /// Reads the counters.
    ///
    /// Errors: [`KsmError::Io`].
    pub fn stats(&self) -> Result<KsmStats, KsmError> {
        let n = |f: &str| read(&self.dir, f).map(|v| v.parse::<u64>().unwrap_or(0));
        // The profit and the counts it is made of, read back to back and again while
        // ksmd merged pages between them (on another core): `rmap_bytes` subtracts one
        // from the other, and a page merged in between would be 4 KiB of rmap items.
        let mut tries = 0;
        loop {
            let pages_sharing = n("pages_sharing")?;
            let ksm_zero_pages = n("ksm_zero_pages").unwrap_or(0);
            let general_profit = read(&self.dir, "general_profit")
                .ok()
                .and_then(|v| v.parse().ok());
            tries += 1;
            if tries < 4
                && (n("pages_sharing")? != pages_sharing
                    || n("ksm_zero_pages").unwrap_or(0) != ksm_zero_pages)
            {
                continue;
            }
            return Ok(KsmStats {
                pages_shared: n("pages_shared")?,
                pages_sharing,
                pages_volatile: n("pages_volatile")?,
                full_scans: n("full_scans")?,
                ksm_zero_pages,
                general_profit,
            });
        }
    }
}

impl Drop for Ksm {
    fn drop(&mut self) {
        // Stop before restoring so that `run` is written last, as it was.
        let _ = write(&self.dir, "run", "0");
        for (f, v) in self.saved.iter().rev() {
            let _ = write(&self.dir, f, v);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ksm_s_own_memory_is_the_profit_s_cost_term() {
        // 1000 pages sharing and 24 zero pages merged, 500 000 rmap items of 64 bytes.
        let s = KsmStats {
            pages_sharing: 1000,
            ksm_zero_pages: 24,
            general_profit: Some(1024 * 4096 - 500_000 * 64),
            ..KsmStats::default()
        };
        assert_eq!(s.rmap_bytes(), 500_000 * 64);
        assert_eq!(KsmStats::default().rmap_bytes(), 0, "no profit file");
        // A profit of exactly 0 is a figure, not an absence.
        let even = KsmStats {
            pages_sharing: 16,
            general_profit: Some(0),
            ..KsmStats::default()
        };
        assert_eq!(even.rmap_bytes(), 16 * 4096);
    }
}
