//! A page whose first access waits for the caller: how the write fence's tests hold a
//! writer between its pin and its copy (`memfold_sys::fence`).

use std::io;

use super::{Event, Uffd, UffdError, MODE_MISSING};

/// A new page of this process whose first access waits until [`HeldPage::release`] fills
/// it. A `process_vm_writev` whose source it is stops there after the kernel pinned the
/// copy's target and before copying: how the write fence's tests hold a writer in that
/// window (`memfold_sys::fence`). Unmapped when dropped; keep it until every access has
/// returned.
#[derive(Debug)]
pub struct HeldPage {
    uffd: Uffd,
    addr: u64,
}

impl HeldPage {
    /// Maps a private anonymous page and registers it (missing) with a new userfaultfd.
    ///
    /// Errors: the userfaultfd's open or registration ([`UffdError`]'s text), or the
    /// mapping (the `mmap` error, named).
    pub fn new() -> io::Result<HeldPage> {
        let uffd = Uffd::open(0)?;
        // SAFETY: a new private anonymous page at an address the kernel picks.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            let e = io::Error::last_os_error();
            return Err(io::Error::new(
                e.kind(),
                format!("mmap of a held page: {e}"),
            ));
        }
        let page = HeldPage {
            uffd,
            addr: p as u64,
        };
        // SAFETY: the page is this value's own; its only accesses are the caller's,
        // which wait for `release`.
        unsafe { page.uffd.register(page.addr, 4096, MODE_MISSING) }?;
        Ok(page)
    }

    /// The page's address in this process.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Waits up to `timeout` for the page's first access to fault; whether it did.
    ///
    /// Errors: reading the userfaultfd.
    pub fn wait_for_access(&self, timeout: std::time::Duration) -> Result<bool, UffdError> {
        let t = std::time::Instant::now();
        while t.elapsed() < timeout {
            if let Some(Event::Fault { .. }) = self.uffd.read_event()? {
                return Ok(true);
            }
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        Ok(false)
    }

    /// Fills the page with `bytes`: the waiting access goes on with them.
    ///
    /// Errors: `UFFDIO_COPY`.
    pub fn release(&self, bytes: &[u8; 4096]) -> Result<(), UffdError> {
        self.uffd.copy(self.addr, bytes, false)
    }
}

impl Drop for HeldPage {
    fn drop(&mut self) {
        // SAFETY: the page mapped in `new`, this value's own.
        unsafe { libc::munmap(self.addr as *mut libc::c_void, 4096) };
    }
}
