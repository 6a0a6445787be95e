//! Page codecs for memfold: whole-page compression and page patches.
//!
//! Everything here works on one 4 KiB page at a time ([`PAGE_SIZE`] bytes) and is
//! pure computation: no allocation of host frames, no OS calls. The engine core
//! decides *which* page gets *which* encoding; this crate only encodes and decodes.
//!
//! - [`CompressCodec`]: self-contained page compression (Difference Engine §3.3):
//!   LZ4, zstd and LZO from maintained crates, and [`wkdm`], written here from
//!   Wilson, Kaplan & Smaragdakis (USENIX 1999).
//! - [`PatchCodec`]: a page stored as a delta against a reference page
//!   (Difference Engine §3.2): our own run diff, XOR + LZ4, and zstd with the
//!   reference page as a raw-content dictionary.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod compress;
mod encoding;
mod patch;
pub mod wkdm;

pub use compress::CompressCodec;
pub use encoding::Encoding;
pub use patch::PatchCodec;

/// Size of a guest page and of a host frame, in bytes.
pub const PAGE_SIZE: usize = 4096;

/// One page of memory.
pub type Page = [u8; PAGE_SIZE];

/// A page's checksum (xxh3-64), kept with every stored blob: whoever decodes the blob
/// checks the page it gets against it before installing it, so a blob changed in its
/// store or swap file (or a patch applied to a changed reference) is an error, never a
/// wrong page.
pub fn page_checksum(page: &Page) -> u64 {
    xxhash_rust::xxh3::xxh3_64(page)
}

/// Why a blob could not be encoded or decoded.
///
/// Decoding errors mean the stored blob is corrupt or was produced by another
/// codec; the engine treats them as a bug and never maps such a page.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CodecError {
    /// The encoded blob is malformed (truncated, wrong counts, bad offsets).
    #[error("{codec}: corrupt blob of {len} bytes: {what}")]
    Corrupt {
        /// Codec name.
        codec: &'static str,
        /// Length of the blob, bytes.
        len: usize,
        /// What was wrong.
        what: String,
    },
    /// The library codec reported an error while encoding.
    #[error("{codec}: encode failed: {what}")]
    Encode {
        /// Codec name.
        codec: &'static str,
        /// The library's message.
        what: String,
    },
}

/// Finds the codec in `all` whose `name` is `s`; the error lists the names accepted.
pub(crate) fn parse_by_name<T: Copy>(
    all: &[T],
    name: fn(T) -> &'static str,
    s: &str,
    what: &str,
) -> Result<T, String> {
    all.iter().copied().find(|&c| name(c) == s).ok_or_else(|| {
        let names: Vec<_> = all.iter().map(|&c| name(c)).collect();
        format!(
            "unknown {what} codec '{s}' (expected one of: {})",
            names.join(", ")
        )
    })
}

impl CodecError {
    pub(crate) fn corrupt(codec: &'static str, len: usize, what: impl Into<String>) -> Self {
        CodecError::Corrupt {
            codec,
            len,
            what: what.into(),
        }
    }
}
