//! Identifiers: guest frames, host frames, VMs, and the P2M entry.

use serde::Serialize;

pub use memfold_codecs::{Page, PAGE_SIZE};

/// Guest frame number: index of a 4 KiB page within one VM's guest-physical memory.
pub type Gfn = u32;

/// A virtual machine managed by the engine. Ids are never reused within one engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct VmId(pub u32);

impl std::fmt::Display for VmId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "vm{}", self.0)
    }
}

/// A host frame (the paper's machine frame, mfn): one 4 KiB page of host memory held by
/// the engine. Valid frame numbers are below [`P2mEntry::MAX_PAYLOAD`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
pub struct Frame(pub u32);

/// Global page number: a VM's gfn offset by the VM's base in one engine-wide page space.
/// Hash-table hints and similarity candidates name pages by gpn so that they fit in 32 bits
/// (ESX §4.3 packs a VM id and PPN into its 16-byte hint frames for the same reason).
pub type Gpn = u32;

/// Index of a sub-page blob (patch or compressed page) in the blob store.
pub type BlobId = u32;

/// Index of a page-sized slot in the swap file.
pub type SwapSlot = u32;

/// What backs one guest page: one P2M entry (Difference Engine §4.1 manipulates the Xen
/// P2M map the same way). Packed into 32 bits: 3 bits of kind, 29 bits of payload.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct P2mEntry(u32);

/// Unpacked view of a [`P2mEntry`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub enum PageState {
    /// Never written (or discarded by the guest): reads as zeros, backed by nothing.
    Unbacked,
    /// Found to be all zeros and reclaimed (ESX §4.3's shared zero page): reads as zeros.
    Zero,
    /// Backed by a host frame of its own, writable in place.
    Private(Frame),
    /// Mapped read-only onto a frame shared copy-on-write (ESX §4.3, DE §3.1).
    Shared(Frame),
    /// Stored as a patch against a reference frame (DE §3.2).
    Patched(BlobId),
    /// Stored compressed (DE §3.3).
    Compressed(BlobId),
    /// Written to the swap file (DE §3.4).
    Swapped(SwapSlot),
}

impl P2mEntry {
    /// Largest payload (frame, blob id or swap slot) an entry can hold, exclusive.
    pub const MAX_PAYLOAD: u32 = 1 << 29;
    /// The entry of a page that was never written.
    pub const UNBACKED: P2mEntry = P2mEntry(0);

    /// Packs a state. Panics if the payload is not below [`Self::MAX_PAYLOAD`]; allocators
    /// never hand out such numbers.
    pub fn new(state: PageState) -> Self {
        let (tag, payload) = match state {
            PageState::Unbacked => (0, 0),
            PageState::Zero => (1, 0),
            PageState::Private(f) => (2, f.0),
            PageState::Shared(f) => (3, f.0),
            PageState::Patched(b) => (4, b),
            PageState::Compressed(b) => (5, b),
            PageState::Swapped(s) => (6, s),
        };
        assert!(
            payload < Self::MAX_PAYLOAD,
            "P2M payload {payload} out of range"
        );
        P2mEntry(tag << 29 | payload)
    }

    /// Unpacks the entry.
    pub fn state(self) -> PageState {
        let payload = self.0 & (Self::MAX_PAYLOAD - 1);
        match self.0 >> 29 {
            0 => PageState::Unbacked,
            1 => PageState::Zero,
            2 => PageState::Private(Frame(payload)),
            3 => PageState::Shared(Frame(payload)),
            4 => PageState::Patched(payload),
            5 => PageState::Compressed(payload),
            _ => PageState::Swapped(payload),
        }
    }
}

impl std::fmt::Debug for P2mEntry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.state().fmt(f)
    }
}

/// True if every byte of the page is zero (word at a time).
pub fn is_zero_page(page: &Page) -> bool {
    page.chunks_exact(8)
        .all(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")) == 0)
}
