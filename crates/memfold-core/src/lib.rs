//! # memfold-core
//!
//! The one engine: it decides what each guest page becomes and keeps the books. memfoldd
//! runs it over live guests; the reference model (`tests/reference_model.rs`) drives the
//! same [`Engine`] over in-memory guests and a simulated agent; `memfold bench micro`
//! times it. It makes no OS call and reads no wall clock: guest memory, the pool, the
//! store and the swap file are behind the traits of [`backing`], and time comes from a
//! [`backing::Clock`] passed in.
//!
//! Data flows one way: guest memory → detection (the sharing scan's hashes, the NRU
//! clock's classes, similarity) → decision (policy) → a plan of [`engine::Command`]s that
//! the agents carry out → their [`engine::Outcome`]s applied back → books.
//!
//! | module | what | paper |
//! |---|---|---|
//! | [`p2m`] | one page's state, packed: private, zero, shared, stored, and in flight | DE §4.1 |
//! | [`frames`] | the pool's frames: sharing rank, requests, patch references, hashes | ESX §4.3 |
//! | [`share`] | hash table of shared frames and hints | ESX §4.3, DE §4.3 |
//! | [`similarity`] | HashSimilarityDetector(k, s), reference candidates | DE §3.2, §4.3 |
//! | [`blobs`], [`slab`] | blobs of patched, compressed and swapped pages, packed in 4 KiB chunks | DE §4.1, §4.6 |
//! | [`categories`] | what an enlightened guest says its pages are; its frames as gfns | PV §3.1 |
//! | [`clock`] | NRU clock C1–C4, the clock hand, policies | DE §4.2 |
//! | [`engine`] | guests, the sharing scan, the Difference Engine, outcomes, budget, books | all |
//! | [`backing`] | where bytes live (traits) and in-memory implementations | |
//! | [`sim`] | an in-memory agent that carries out commands, for the model and benchmarks | |
//! | [`analysis`] | static analysis of RAM snapshots (DE Table 1) | DE §3.2 |
//!
//! Codecs (LZ4, zstd, LZO, WKdm; patch codecs) live in `memfold-codecs`; typed ids in
//! `memfold-ids`.

#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod analysis;
pub mod backing;
pub mod blobs;
pub mod categories;
pub mod census;
pub mod clock;
pub mod engine;
pub mod frames;
pub mod p2m;
pub mod share;
pub mod sim;
pub mod similarity;
pub mod slab;

/// The typed ids (re-exported from `memfold-ids`).
pub mod ids {
    pub use memfold_ids::*;
}

pub use clock::{NruState, Policy};
pub use engine::{
    claim_target, short_of_memory, ClaimPolicy, Command, Engine, EngineConfig, EngineError,
    Outcome, Sharing, SharingRanks, ZeroPolicy, CLAIM_GRAIN,
};
pub use memfold_codecs::{CompressCodec, Encoding, Page, PatchCodec, PAGE_SIZE};
pub use similarity::SimilarityConfig;

/// True if every byte of the page is zero (a word at a time).
pub fn is_zero_page(page: &Page) -> bool {
    page.chunks_exact(8)
        .all(|w| u64::from_ne_bytes(w.try_into().expect("8 bytes")) == 0)
}

/// 64-bit xxh3 of a page: the share table's content hash (ESX §4.3 uses a 64-bit hash).
pub fn page_hash(page: &Page) -> u64 {
    xxhash_rust::xxh3::xxh3_64(page)
}
