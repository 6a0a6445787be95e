//! Page-aligned byte buffers: what `O_DIRECT` reads into and writes from (its buffers
//! must be aligned to the file system's logical block; 4 KiB covers every one here).

use std::os::unix::fs::FileExt;

use crate::disk::BLOCK;

/// A 4 KiB-aligned buffer of `len` bytes.
pub(crate) struct Aligned {
    blocks: Vec<AlignedBlock>,
    len: usize,
}

#[repr(C, align(4096))]
#[derive(Clone, Copy)]
struct AlignedBlock([u8; BLOCK as usize]);

impl Default for Aligned {
    fn default() -> Aligned {
        Aligned::new(0)
    }
}

impl Aligned {
    /// `len` zero bytes.
    pub(crate) fn new(len: usize) -> Aligned {
        Aligned {
            blocks: vec![AlignedBlock([0; BLOCK as usize]); len.div_ceil(BLOCK as usize)],
            len,
        }
    }

    /// Makes it `len` bytes long, reusing its blocks: the first bytes are whatever its
    /// last user left there (only blocks it grows by are zeroed), so a caller must
    /// write every byte before it reads one. What lets a request's buffer be reused
    /// without a `memset` of up to 1 MiB a request.
    pub(crate) fn reuse(&mut self, len: usize) {
        let need = len.div_ceil(BLOCK as usize);
        if self.blocks.len() < need {
            self.blocks.resize(need, AlignedBlock([0; BLOCK as usize]));
        }
        self.len = len;
    }

    /// Its blocks, bytes (what it keeps allocated).
    pub(crate) fn capacity(&self) -> usize {
        self.blocks.len() * BLOCK as usize
    }

    /// Its bytes.
    pub(crate) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: the blocks are contiguous plain bytes, `len` of them at most
        // `blocks.len() * BLOCK` (`new` and `reuse` keep it so).
        unsafe { std::slice::from_raw_parts_mut(self.blocks.as_mut_ptr().cast(), self.len) }
    }

    /// Its bytes, read-only.
    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: as in `bytes_mut`, shared.
        unsafe { std::slice::from_raw_parts(self.blocks.as_ptr().cast(), self.len) }
    }
}

/// Whether `buf` can take an `O_DIRECT` transfer as it is: it starts on a 4 KiB
/// boundary and is whole 4 KiB blocks.
pub(crate) fn fits_direct(buf: &[u8]) -> bool {
    buf.as_ptr() as usize % BLOCK as usize == 0 && buf.len() as u64 % BLOCK == 0
}

/// Reads `buf.len()` bytes of `file` at `at`, retrying short reads; bytes past the
/// file's end are zeros (written here: `buf` may hold an earlier read's bytes).
pub(crate) fn read_fully(file: &std::fs::File, buf: &mut [u8], at: u64) -> std::io::Result<()> {
    let mut done = 0usize;
    while done < buf.len() {
        match file.read_at(&mut buf[done..], at + done as u64) {
            Ok(0) => {
                buf[done..].fill(0);
                break;
            }
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reused_buffer_is_aligned_keeps_its_bytes_and_zeroes_only_what_it_grows_by() {
        let mut a = Aligned::new(BLOCK as usize);
        assert!(fits_direct(a.bytes()));
        a.bytes_mut().fill(7);
        a.reuse(3 * BLOCK as usize);
        assert!(fits_direct(a.bytes()));
        let b = a.bytes();
        assert!(b[..BLOCK as usize].iter().all(|&x| x == 7));
        assert!(b[BLOCK as usize..].iter().all(|&x| x == 0));
        a.reuse(512);
        assert_eq!(a.bytes().len(), 512);
        assert!(!fits_direct(a.bytes()), "512 bytes are not a whole block");
        assert_eq!(a.capacity(), 3 * BLOCK as usize);
        assert!(!fits_direct(&a.bytes()[1..]));
    }

    #[test]
    fn a_read_past_the_file_s_end_leaves_zeros_not_the_buffer_s_old_bytes() {
        let d = tempfile::tempdir_in("/var/tmp").unwrap();
        let p = d.path().join("short");
        std::fs::write(&p, [5u8; 100]).unwrap();
        let f = std::fs::File::open(&p).unwrap();
        let mut a = Aligned::new(BLOCK as usize);
        a.bytes_mut().fill(0xAA);
        read_fully(&f, a.bytes_mut(), 0).unwrap();
        assert!(a.bytes()[..100].iter().all(|&x| x == 5));
        assert!(
            a.bytes()[100..].iter().all(|&x| x == 0),
            "old bytes past the end of the file"
        );
    }
}
