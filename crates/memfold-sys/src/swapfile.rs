//! A swap file of fixed size, read and written a page at a time with pread/pwrite.

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use memfold_core::{swap::SwapDevice, Page, PAGE_SIZE};

/// Why a swap file could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum SwapFileError {
    /// The file could not be created or opened.
    #[error("swap file {path}: cannot open: {source}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The OS error.
        source: std::io::Error,
    },
    /// An existing file has a size that is not a whole number of pages.
    #[error("swap file {path}: size {size} bytes is not a multiple of the 4096-byte page")]
    BadSize {
        /// The file.
        path: PathBuf,
        /// Its size, bytes.
        size: u64,
    },
    /// Space for the file could not be reserved (disk full, quota).
    #[error("swap file {path}: cannot reserve {bytes} bytes: {source}")]
    Reserve {
        /// The file.
        path: PathBuf,
        /// Bytes asked for.
        bytes: u64,
        /// The OS error.
        source: std::io::Error,
    },
    /// Zero slots, or more than 2^29.
    #[error("swap file {path}: {slots} slots; a swap file has 1..=2^29 page slots")]
    BadSlots {
        /// The file.
        path: PathBuf,
        /// Slots asked for.
        slots: u64,
    },
}

/// A flat swap file of `slots` pages (DE §4.6). Slot `s` lives at byte offset `s * 4096`.
/// Its content does not outlive the engine: it is scratch space, not a persistent store.
pub struct FileSwapDevice {
    file: File,
    path: PathBuf,
    slots: u32,
}

impl FileSwapDevice {
    /// Creates (or truncates) a swap file of `slots` pages at `path` and reserves its space
    /// with `set_len` (sparse; the disk fills as pages are written).
    ///
    /// Errors: [`SwapFileError::Open`], [`SwapFileError::Reserve`], [`SwapFileError::BadSlots`].
    pub fn create(path: &Path, slots: u64) -> Result<Self, SwapFileError> {
        if slots == 0 || slots > 1 << 29 {
            return Err(SwapFileError::BadSlots {
                path: path.into(),
                slots,
            });
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(path)
            .map_err(|source| SwapFileError::Open {
                path: path.into(),
                source,
            })?;
        let bytes = slots * PAGE_SIZE as u64;
        file.set_len(bytes)
            .map_err(|source| SwapFileError::Reserve {
                path: path.into(),
                bytes,
                source,
            })?;
        Ok(FileSwapDevice {
            file,
            path: path.into(),
            slots: slots as u32,
        })
    }

    /// Opens an existing swap file, using its whole size.
    ///
    /// Errors: [`SwapFileError::Open`], [`SwapFileError::BadSize`], [`SwapFileError::BadSlots`].
    pub fn open(path: &Path) -> Result<Self, SwapFileError> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(|source| SwapFileError::Open {
                path: path.into(),
                source,
            })?;
        let size = file
            .metadata()
            .map_err(|source| SwapFileError::Open {
                path: path.into(),
                source,
            })?
            .len();
        if size % PAGE_SIZE as u64 != 0 {
            return Err(SwapFileError::BadSize {
                path: path.into(),
                size,
            });
        }
        let slots = size / PAGE_SIZE as u64;
        if slots == 0 || slots > 1 << 29 {
            return Err(SwapFileError::BadSlots {
                path: path.into(),
                slots,
            });
        }
        Ok(FileSwapDevice {
            file,
            path: path.into(),
            slots: slots as u32,
        })
    }
}

impl SwapDevice for FileSwapDevice {
    fn capacity(&self) -> u32 {
        self.slots
    }

    fn write(&mut self, slot: u32, page: &Page) -> Result<(), String> {
        self.file
            .write_all_at(page, slot as u64 * PAGE_SIZE as u64)
            .map_err(|e| format!("{}: write of slot {slot}: {e}", self.path.display()))
    }

    fn read(&self, slot: u32, out: &mut Page) -> Result<(), String> {
        self.file
            .read_exact_at(out, slot as u64 * PAGE_SIZE as u64)
            .map_err(|e| format!("{}: read of slot {slot}: {e}", self.path.display()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memfold_core::{Engine, EngineConfig, SwapOutcome};

    #[test]
    fn pages_round_trip_through_the_file_and_the_engine() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("swap");
        let dev = FileSwapDevice::create(&path, 4).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 4 * 4096);
        let mut e = Engine::new(EngineConfig::default(), Box::new(dev)).unwrap();
        let vm = e.create_vm(8).unwrap();
        for g in 0..5u32 {
            e.write(vm, g, 0, &[g as u8 + 1; PAGE_SIZE]).unwrap();
        }
        for g in 0..4 {
            assert!(matches!(
                e.swap_out(vm, g).unwrap(),
                SwapOutcome::Swapped(_)
            ));
        }
        assert_eq!(
            e.swap_out(vm, 4).unwrap(),
            SwapOutcome::SwapFull,
            "a full swap file is a normal outcome"
        );
        for g in 0..5u32 {
            let mut b = [0u8; PAGE_SIZE];
            e.read(vm, g, 0, &mut b).unwrap();
            assert!(b.iter().all(|&x| x == g as u8 + 1));
        }
        e.check_invariants().unwrap();
    }

    #[test]
    fn bad_files_get_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no/such/dir/swap");
        let err = FileSwapDevice::create(&missing, 4).err().unwrap();
        assert!(matches!(err, SwapFileError::Open { .. }));
        assert!(err.to_string().contains("no/such/dir/swap"), "{err}");
        let odd = dir.path().join("odd");
        std::fs::write(&odd, [0u8; 5000]).unwrap();
        assert!(matches!(
            FileSwapDevice::open(&odd).err().unwrap(),
            SwapFileError::BadSize { size: 5000, .. }
        ));
        assert!(matches!(
            FileSwapDevice::create(&odd, 0).err().unwrap(),
            SwapFileError::BadSlots { .. }
        ));
        let ok = dir.path().join("ok");
        std::fs::write(&ok, vec![0u8; 8192]).unwrap();
        assert_eq!(FileSwapDevice::open(&ok).unwrap().capacity(), 2);
    }

    #[test]
    fn a_read_past_a_truncated_file_is_an_error_not_zeros() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("swap");
        let mut dev = FileSwapDevice::create(&path, 2).unwrap();
        dev.write(1, &[7u8; PAGE_SIZE]).unwrap();
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(4096)
            .unwrap();
        let mut out = [0u8; PAGE_SIZE];
        let err = dev.read(1, &mut out).unwrap_err();
        assert!(err.contains("read of slot 1"), "{err}");
    }
}
