//! The re-attach list: what an agent that re-attaches after a memfoldd restart has mapped
//! onto pool frames or reclaimed, too long for one message, so it travels as a memfd
//! passed with [`crate::ToDaemon::AgentHello`] (whose `shared` says how many entries).
//!
//! Binary: one 8-byte entry per page, the page's gfn then its frame, each a little-endian
//! u32; a reclaimed zero page has the frame [`RECLAIMED_ZERO_CODE`].

use std::io;
use std::os::fd::{BorrowedFd, OwnedFd};

use memfold_ids::{FrameId, Gfn};
use memfold_sys::memfd;

use crate::WireError;

/// Bytes per entry.
pub const ENTRY_BYTES: usize = 8;

/// The frame number that stands for [`Mapped::ReclaimedZero`] in the binary list; no pool
/// frame has it (a pool that large would be 16 TiB).
pub const RECLAIMED_ZERO_CODE: u32 = u32::MAX - 1;

/// What an entry's page is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mapped {
    /// Mapped onto this pool frame.
    Frame(FrameId),
    /// A reclaimed zero page: a hole in the guest memfd the agent fills with zeros on the
    /// next access.
    ReclaimedZero,
}

/// The binary list of `entries`.
///
/// Errors: a frame number the binary form reserves ([`WireError::FrameOutOfRange`]).
pub fn encode(entries: &[(Gfn, Mapped)]) -> Result<Vec<u8>, WireError> {
    let mut out = Vec::with_capacity(entries.len() * ENTRY_BYTES);
    for &(g, m) in entries {
        let f = match m {
            Mapped::Frame(f) if f.0 >= RECLAIMED_ZERO_CODE => {
                return Err(WireError::FrameOutOfRange(f))
            }
            Mapped::Frame(f) => f.0,
            Mapped::ReclaimedZero => RECLAIMED_ZERO_CODE,
        };
        out.extend_from_slice(&g.0.to_le_bytes());
        out.extend_from_slice(&f.to_le_bytes());
    }
    Ok(out)
}

/// The entries of a binary list.
///
/// Errors: the length is not a whole number of entries ([`WireError::BadListLength`]); a
/// frame number above [`RECLAIMED_ZERO_CODE`] ([`WireError::FrameOutOfRange`]).
pub fn decode(bytes: &[u8]) -> Result<Vec<(Gfn, Mapped)>, WireError> {
    if bytes.len() % ENTRY_BYTES != 0 {
        return Err(WireError::BadListLength {
            len: bytes.len(),
            expected: None,
        });
    }
    bytes
        .chunks_exact(ENTRY_BYTES)
        .map(|c| {
            let g = u32::from_le_bytes(c[..4].try_into().expect("4 bytes"));
            let f = u32::from_le_bytes(c[4..].try_into().expect("4 bytes"));
            let m = match f {
                RECLAIMED_ZERO_CODE => Mapped::ReclaimedZero,
                f if f > RECLAIMED_ZERO_CODE => return Err(WireError::FrameOutOfRange(FrameId(f))),
                f => Mapped::Frame(FrameId(f)),
            };
            Ok((Gfn(g), m))
        })
        .collect()
}

/// A new memfd holding the binary list of `entries`, to pass with the hello.
///
/// Errors: see [`encode`]; the memfd cannot be created or written (host out of memory).
pub fn to_memfd(entries: &[(Gfn, Mapped)]) -> Result<OwnedFd, WireError> {
    let bytes = encode(entries)?;
    let fd = memfd::create("memfold-shared-list")?;
    memfd::pwrite_all(std::os::fd::AsFd::as_fd(&fd), &bytes, 0)?;
    Ok(fd)
}

/// Reads the list of `count` entries from memfd `fd`.
///
/// Errors: the file does not hold exactly `count` entries ([`WireError::BadListLength`]),
/// see [`decode`], or the read failed.
pub fn from_memfd(fd: BorrowedFd<'_>, count: u64) -> Result<Vec<(Gfn, Mapped)>, WireError> {
    let expected = count
        .checked_mul(ENTRY_BYTES as u64)
        .filter(|&n| n <= isize::MAX as u64)
        .ok_or(WireError::BadListLength {
            len: 0,
            expected: Some(count),
        })?;
    let len = memfd::size(fd)
        .map_err(|e| io::Error::new(e.kind(), format!("re-attach list: fstat: {e}")))?;
    if len != expected {
        return Err(WireError::BadListLength {
            len: len as usize,
            expected: Some(count),
        });
    }
    let mut bytes = vec![0u8; len as usize];
    memfd::pread_exact(fd, &mut bytes, 0)?;
    decode(&bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsFd;

    #[test]
    fn lists_round_trip_in_bytes_and_through_a_memfd() {
        let list = vec![
            (Gfn(0), Mapped::Frame(FrameId(0))),
            (Gfn(7), Mapped::ReclaimedZero),
            (
                Gfn(u32::MAX),
                Mapped::Frame(FrameId(RECLAIMED_ZERO_CODE - 1)),
            ),
        ];
        let bytes = encode(&list).unwrap();
        assert_eq!(bytes.len(), 3 * ENTRY_BYTES);
        assert_eq!(&bytes[8..16], &[7, 0, 0, 0, 0xfe, 0xff, 0xff, 0xff]);
        assert_eq!(decode(&bytes).unwrap(), list);
        assert_eq!(decode(&[]).unwrap(), vec![]);
        let fd = to_memfd(&list).unwrap();
        assert_eq!(from_memfd(fd.as_fd(), 3).unwrap(), list);
    }

    #[test]
    fn bad_lists_are_clear_errors() {
        let e = decode(&[0u8; 12]).unwrap_err();
        assert!(matches!(e, WireError::BadListLength { len: 12, .. }), "{e}");
        assert!(e.to_string().contains("12 bytes"), "{e}");
        let fd = to_memfd(&[(Gfn(1), Mapped::ReclaimedZero)]).unwrap();
        let e = from_memfd(fd.as_fd(), 2).unwrap_err();
        assert_eq!(
            e.to_string(),
            "re-attach list of 8 bytes: expected 2 entries of 8 bytes"
        );
        let e = encode(&[(Gfn(1), Mapped::Frame(FrameId(RECLAIMED_ZERO_CODE)))]).unwrap_err();
        assert!(matches!(
            e,
            WireError::FrameOutOfRange(FrameId(RECLAIMED_ZERO_CODE))
        ));
        let mut bytes = encode(&[(Gfn(1), Mapped::ReclaimedZero)]).unwrap();
        bytes[4] = 0xff;
        assert!(matches!(
            decode(&bytes),
            Err(WireError::FrameOutOfRange(FrameId(u32::MAX)))
        ));
    }
}
