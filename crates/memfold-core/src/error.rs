//! Engine errors.

use memfold_codecs::CodecError;

use crate::types::{Gfn, VmId};

/// Why an engine call failed. A failed call leaves guest memory exactly as it was.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    /// The VM id is not (or no longer) managed.
    #[error("no such VM: {0}")]
    NoSuchVm(VmId),
    /// The gfn is beyond the VM's memory.
    #[error("{vm}: gfn {gfn} is outside its guest memory of {pages} pages")]
    GfnOutOfRange {
        /// The VM.
        vm: VmId,
        /// The gfn asked for.
        gfn: Gfn,
        /// The VM's size, pages.
        pages: u32,
    },
    /// An access runs past the end of the page.
    #[error(
        "{vm} gfn {gfn}: access of {len} bytes at offset {offset} crosses the 4096-byte page end"
    )]
    BadAccess {
        /// The VM.
        vm: VmId,
        /// The gfn.
        gfn: Gfn,
        /// Offset in the page, bytes.
        offset: usize,
        /// Length, bytes.
        len: usize,
    },
    /// A VM size of zero pages, or larger than the engine can address.
    #[error("a VM of {pages} pages cannot be created: sizes are 1..={max} pages")]
    BadVmSize {
        /// Requested size, pages.
        pages: u32,
        /// Largest size, pages.
        max: u32,
    },
    /// The guest page space (2^31 pages over all VMs) is used up.
    #[error(
        "no room for {pages} more guest pages: the engine manages at most 2^31 pages over all VMs"
    )]
    GpnExhausted {
        /// Requested size, pages.
        pages: u32,
    },
    /// The host memory budget is used up and nothing could be swapped out.
    #[error(
        "host memory budget of {limit} frames exhausted and no page could be swapped out: {why}"
    )]
    OutOfHostMemory {
        /// The budget, frames.
        limit: u32,
        /// What stopped swap-out (swap file full, nothing resident, ...).
        why: String,
    },
    /// Host frame numbers (2^29) are used up.
    #[error("host frame numbers exhausted (2^29 frames)")]
    FramesExhausted,
    /// The swap device failed a read or write; the page stays where it was.
    #[error("swap device error: {0}")]
    SwapIo(String),
    /// A stored patch or compressed page failed to decode: an engine bug or memory
    /// corruption. The page is left as stored, never mapped with wrong content.
    #[error("{vm} gfn {gfn}: stored page does not decode: {source}")]
    Corrupt {
        /// The VM.
        vm: VmId,
        /// The gfn.
        gfn: Gfn,
        /// The codec's complaint.
        source: CodecError,
    },
}

/// Result of an engine call.
pub type Result<T, E = EngineError> = std::result::Result<T, E>;
