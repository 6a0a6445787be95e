//! A failed sync is not forgotten. When `fsync` fails, the kernel may already have marked
//! the dirty pages clean or dropped them, and a second `fsync` returns 0 with those bytes
//! never written: a guest that retried its flush would be told its data is on disk when
//! it is not. As QEMU does for its own drives, the first failure fails every later flush
//! of the same image.

use std::sync::atomic::{AtomicBool, Ordering};

/// Whether an image's sync ever failed; once it has, every flush fails.
#[derive(Debug, Default)]
pub(crate) struct SyncLatch(AtomicBool);

impl SyncLatch {
    /// Runs `sync`, unless a sync of this image failed before.
    ///
    /// Errors: `sync`'s, which latches; or, once latched, an error saying so without
    /// running `sync` (whose success would mean nothing).
    pub(crate) fn sync(&self, sync: impl FnOnce() -> std::io::Result<()>) -> std::io::Result<()> {
        if self.0.load(Ordering::Acquire) {
            return Err(std::io::Error::other(
                "an earlier flush of this image failed: writes since its last good flush \
                 may not be on disk, so no flush succeeds any more (restart the device \
                 to serve the image again)",
            ));
        }
        sync().inspect_err(|_| self.0.store(true, Ordering::Release))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sync_that_failed_once_fails_every_later_flush() {
        let latch = SyncLatch::default();
        assert!(latch.sync(|| Ok(())).is_ok());
        assert!(latch.sync(|| Err(std::io::Error::other("EIO"))).is_err());
        // The kernel's second fsync succeeds; the device must not say so.
        let mut ran = false;
        let again = latch.sync(|| {
            ran = true;
            Ok(())
        });
        assert!(again.is_err() && !ran, "{again:?}");
    }
}
