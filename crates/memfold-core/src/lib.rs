//! # memfold-core
//!
//! The engine that decides what each guest page becomes and keeps the books. It holds
//! every mechanism of the papers in `shared/papers/`, as pure data structures and
//! policies: no OS calls, so that it can be proven against a reference model here and
//! driven by the live layer's fault handlers later.
//!
//! | module | what | paper |
//! |---|---|---|
//! | [`types`] | gfn, frame (mfn), the packed P2M entry | DE §4.1 |
//! | [`frames`] | host frames, 16-bit refcounts with overflow table | ESX §4.3 |
//! | [`share`] | hash table of shared and hint entries, 5-pass partitioning | ESX §4.3, DE §4.3 |
//! | [`similarity`] | HashSimilarityDetector(k, s), c candidates | DE §3.2, §4.3 |
//! | [`blobstore`] | sub-page storage for patches and compressed pages | DE §4.1 |
//! | [`swap`] | swap slots over a swap device | DE §3.4, §4.6 |
//! | [`clock`] | NRU clock C1–C4 and policies | DE §4.2 |
//! | [`engine`] | P2M maps, guest access API, mechanisms, clock sweep | all |
//! | [`accounting`] | savings by mechanism and VM, metadata, counters | DE §3.2 |
//! | [`analysis`] | static analysis of RAM snapshots: zero, duplicate, unique; pages needed with sharing, + patching, + compression | DE §3.2, Table 1 |
//!
//! Codecs (LZ4, zstd, LZO, WKdm; patch codecs) live in `memfold-codecs`.

pub mod accounting;
pub mod analysis;
pub mod blobstore;
pub mod clock;
pub mod engine;
pub mod error;
pub mod frames;
pub mod share;
pub mod similarity;
pub mod slab;
pub mod swap;
pub mod types;

pub use accounting::{Accounting, Counters, MetadataUsage, Savings};
pub use clock::{NruState, Policy};
pub use engine::{
    Access, CompressOutcome, Engine, EngineConfig, PatchOutcome, ShareOutcome, SwapOutcome,
    TickReport, ZeroPolicy,
};
pub use error::{EngineError, Result};
pub use memfold_codecs::{CompressCodec, PatchCodec};
pub use similarity::SimilarityConfig;
pub use swap::{MemSwapDevice, SwapDevice};
pub use types::{Frame, Gfn, Page, PageState, VmId, PAGE_SIZE};
