//! # memfold-wire
//!
//! What memfoldd, the agents in QEMU and the command-line clients say to each other, and
//! nothing of how any of them works inside: the messages ([`ToDaemon`], [`ToAgent`],
//! [`ToClient`]) with their limits, the statistics a client gets ([`Stats`]), the
//! latency histograms agents report ([`OpLatency`]), the re-attach list ([`reattach`]),
//! and typed connections ([`Conn`], [`Listener`]) that send one message with file
//! descriptors per packet.
//!
//! Messages are JSON (one per `SOCK_SEQPACKET` packet, at most [`MAX_MESSAGE`] bytes);
//! pages and frames are `memfold-ids`' typed ids, plain numbers on the wire. A peer of
//! another [`PROTOCOL_VERSION`] is refused at its hello.
//!
//! | module | what |
//! |---|---|
//! | [`messages`] | the messages, the stash blob types, the limits |
//! | [`reattach`] | the binary list of pages an agent has mapped, passed in a memfd |
//! | [`stats`] | memfoldd's statistics, per guest and in total |
//! | [`stats_parts`] | statistics too large for one message, sent and read in parts |
//! | [`name`] | the bound on a guest's name, and how a peer's words are shown |
//! | [`hello`] | a first message's kind and version, read before it is decoded whole |
//! | [`metrics`] | the statistics as a Prometheus (OpenMetrics) exposition |
//! | [`latency`] | latency histograms (HDR) and their percentiles |
//! | [`conn`] | [`Conn`] and [`Listener`], over `memfold_sys::socket` |
//! | [`guest`] | the guest channel: memfoldd and `memfold-guest` inside an enlightened guest, over virtio-serial (issue 17) |
//! | [`keyval`] | QEMU's `key=value,...` option syntax, which the agent and memfoldd both read on QEMU's command line |

#![forbid(unsafe_code)]
#![deny(missing_docs)]

use std::io;

use serde::{de::DeserializeOwned, Serialize};

pub mod conn;
pub mod device;
pub mod guest;
pub mod hello;
pub mod keyval;
pub mod latency;
pub mod messages;
pub mod metrics;
pub mod name;
pub mod reattach;
pub mod stats;
pub mod stats_parts;

pub use conn::{Conn, Listener};
pub use device::LandedReporter;
pub use latency::{LatencySummary, OpBuckets, OpLatency, LATENCY_BUCKETS_S};
pub use memfold_ids::{BaseBlock, BatchId, DiskId, FillId, FrameId, Gfn};
pub use messages::{
    AgentReport, Blob, BlobHome, CensusStats, Discarded, RamFile, StashPage, ToAgent, ToClient,
    ToDaemon, ToDevice, CLOCK_SLICE, MAX_BATCH, MAX_MESSAGE, PROTOCOL_VERSION,
};
pub use name::{check_name, shown, shown_within, NameError, MAX_NAME_BYTES};
pub use reattach::Mapped;
pub use stats::{
    GuestPages, HeldBytes, KernelSwapStats, LifetimeCdf, MetadataBy, OpLatencies, SavedBy, Stats,
    SwapStats, VmStats, AGENT_OPS,
};
pub use stats_parts::{
    assemble_stats, stats_messages, StatsPartsError, MAX_STATS_VMS, MAX_VM_STRING_BYTES,
    STATS_PART_BYTES,
};

/// Wire errors.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// A message larger than [`MAX_MESSAGE`], sent or received.
    #[error("message of {size} bytes exceeds {MAX_MESSAGE}")]
    TooLarge {
        /// The message's size, bytes.
        size: usize,
    },
    /// Bytes that are not a message of the expected kind.
    #[error("malformed memfoldd message ({len} bytes): {source}")]
    Malformed {
        /// The message's size, bytes.
        len: usize,
        /// What could not be parsed.
        source: serde_json::Error,
    },
    /// A re-attach list whose length is not a whole number of entries, or not the
    /// number the hello announced.
    #[error(
        "re-attach list of {len} bytes: {}",
        match expected {
            Some(n) => format!("expected {n} entries of {} bytes", reattach::ENTRY_BYTES),
            None => format!("not a whole number of {}-byte entries", reattach::ENTRY_BYTES),
        }
    )]
    BadListLength {
        /// The list's length, bytes.
        len: usize,
        /// The entries announced, if known.
        expected: Option<u64>,
    },
    /// A frame number the re-attach list cannot carry.
    #[error("{0} cannot be in a re-attach list")]
    FrameOutOfRange(FrameId),
    /// The socket or a memfd failed.
    #[error(transparent)]
    Io(#[from] io::Error),
}

impl From<WireError> for io::Error {
    fn from(e: WireError) -> io::Error {
        match e {
            WireError::Io(e) => e,
            e => io::Error::new(io::ErrorKind::InvalidData, e),
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for crate::ToDaemon {}
    impl Sealed for crate::ToAgent {}
    impl Sealed for crate::ToClient {}
    impl Sealed for crate::ToDevice {}
}

/// A message of the protocol: [`ToDaemon`], [`ToAgent`] or [`ToClient`].
pub trait Message: Serialize + DeserializeOwned + sealed::Sealed {}
impl Message for ToDaemon {}
impl Message for ToAgent {}
impl Message for ToClient {}
impl Message for ToDevice {}

/// The bytes of `msg` (JSON). A message over [`MAX_MESSAGE`] is refused when sent.
pub fn encode<M: Message>(msg: &M) -> Vec<u8> {
    serde_json::to_vec(msg).expect("protocol messages always serialize")
}

/// The message in `bytes`.
///
/// Errors: more than [`MAX_MESSAGE`] bytes ([`WireError::TooLarge`]), or not a message
/// of this kind ([`WireError::Malformed`] says what could not be parsed).
pub fn decode<M: Message>(bytes: &[u8]) -> Result<M, WireError> {
    if bytes.len() > MAX_MESSAGE {
        return Err(WireError::TooLarge { size: bytes.len() });
    }
    serde_json::from_slice(bytes).map_err(|source| WireError::Malformed {
        len: bytes.len(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use memfold_codecs::{CompressCodec, Encoding, PatchCodec};
    use std::os::fd::AsFd;

    fn round_trip<M: Message + PartialEq + std::fmt::Debug>(m: M) {
        let bytes = encode(&m);
        assert!(bytes.len() <= MAX_MESSAGE);
        assert_eq!(
            decode::<M>(&bytes).unwrap(),
            m,
            "{}",
            String::from_utf8_lossy(&bytes)
        );
    }

    fn stash_pages() -> Vec<StashPage> {
        let page = |gfn, blob, home, moving| StashPage {
            gfn: Gfn(gfn),
            blob,
            home,
            offset: 4096 * gfn as u64,
            len: 300,
            moving,
            checksum: 0x5eed,
        };
        vec![
            page(
                1,
                Blob::Patch {
                    codec: PatchCodec::ZstdRef,
                    reference: FrameId(9),
                },
                BlobHome::Store,
                false,
            ),
            page(
                2,
                Blob::Compressed(CompressCodec::Lz4),
                BlobHome::Store,
                false,
            ),
            page(3, Blob::Raw, BlobHome::Swap, false),
            page(
                4,
                Blob::Compressed(CompressCodec::Zstd),
                BlobHome::Swap,
                true,
            ),
        ]
    }

    #[test]
    fn every_message_kind_round_trips() {
        let gfns = || vec![Gfn(1), Gfn(2)];
        let batch = BatchId(7);
        for m in [
            ToDaemon::AgentHello {
                version: PROTOCOL_VERSION,
                name: "web".into(),
                pid: 42,
                ram_bytes: 1 << 29,
                shared: 3,
                opted_out: true,
            },
            ToDaemon::ShareDone {
                batch,
                shared: gfns(),
                changed: vec![Gfn(3)],
                refused: vec![],
            },
            ToDaemon::CowBroken {
                breaks: vec![(Gfn(5), FrameId(6))],
            },
            ToDaemon::ReclaimDone {
                batch,
                reclaimed: gfns(),
                changed: vec![],
                refused: vec![Gfn(9)],
            },
            ToDaemon::StashDone {
                batch,
                stashed: gfns(),
                changed: vec![],
                refused: vec![],
            },
            ToDaemon::Unstashed { gfns: gfns() },
            ToDaemon::Refilled { gfns: gfns() },
            ToDaemon::Discarded {
                pages: vec![
                    (Gfn(1), Discarded::Frame(FrameId(3))),
                    (Gfn(2), Discarded::Zero),
                    (Gfn(4), Discarded::Stashed),
                ],
            },
            ToDaemon::ClockBits {
                batch,
                first: Gfn(128),
                count: 70,
                referenced: vec![1, 2],
                modified: vec![0, u64::MAX],
            },
            ToDaemon::AgentStats(AgentReport {
                wp_faults: 1,
                missing_faults: 2,
                minor_faults: 3,
                share_ns: vec![(100, 2)],
                ..Default::default()
            }),
            ToDaemon::ClientHello {
                version: PROTOCOL_VERSION,
            },
            ToDaemon::Stats,
            ToDaemon::RegionUnmapped,
        ] {
            let head = hello::HelloHead::of(&encode(&m)).unwrap();
            assert_eq!(head.kind, m.kind(), "{m:?}");
            round_trip(m);
        }
        for m in [
            ToAgent::Welcome {
                version: PROTOCOL_VERSION,
            },
            ToAgent::OptedOut { out: true },
            ToAgent::LeavePool {
                message: "kept alone".into(),
            },
            ToAgent::Share {
                batch,
                pages: vec![(Gfn(1), FrameId(0)), (Gfn(2), FrameId(1))],
            },
            ToAgent::Fill {
                batch,
                pages: vec![(Gfn(7), FrameId(3))],
                nonce: [u64::MAX, 9],
            },
            ToAgent::ReclaimZero {
                batch,
                gfns: gfns(),
            },
            ToAgent::Stash {
                batch,
                pages: stash_pages(),
            },
            ToAgent::ClockScan {
                batch,
                first: Gfn(0),
                count: CLOCK_SLICE,
                arm: vec![u64::MAX, 5],
                wp_only: vec![3],
                zap_shared: true,
            },
        ] {
            round_trip(m);
        }
        let mut stats = Stats {
            uptime_s: 1.5,
            policy: "de".into(),
            vms: vec![VmStats {
                name: "web".into(),
                nru_pages: [1, 2, 3, 4],
                ..Default::default()
            }],
            ..Default::default()
        };
        stats.swap.budget_pages = Some(100);
        stats.lifetime.restored_before = vec![(1.0, 0.5)];
        round_trip(ToClient::Stats(Box::new(stats.clone())));
        stats.vms_following = 3;
        round_trip(ToClient::Stats(Box::new(stats.clone())));
        round_trip(ToClient::StatsVms {
            vms: std::mem::take(&mut stats.vms),
        });
        round_trip(ToClient::Error {
            message: "no".into(),
        });
    }

    /// The region notice, added within version 9, is one tag and nothing else.
    #[test]
    fn the_region_notice_is_one_tag() {
        assert_eq!(
            String::from_utf8(encode(&ToDaemon::RegionUnmapped)).unwrap(),
            r#"{"type":"region_unmapped"}"#
        );
    }

    #[test]
    fn ids_are_plain_numbers_and_blobs_are_typed_on_the_wire() {
        let m = ToAgent::Share {
            batch: BatchId(3),
            pages: vec![(Gfn(1), FrameId(2))],
        };
        assert_eq!(
            String::from_utf8(encode(&m)).unwrap(),
            r#"{"type":"share","batch":3,"pages":[[1,2]]}"#
        );
        let json = serde_json::to_string(&stash_pages()[0]).unwrap();
        assert_eq!(
            json,
            r#"{"gfn":1,"blob":{"patch":{"codec":"zstd-ref","reference":9}},"home":"store","offset":4096,"len":300,"moving":false,"checksum":24301}"#
        );
        let raw = serde_json::to_string(&stash_pages()[2].blob).unwrap();
        assert_eq!(raw, r#""raw""#);
        let b = Blob::Patch {
            codec: PatchCodec::RunDiff,
            reference: FrameId(4),
        };
        assert_eq!(b.reference(), Some(FrameId(4)));
        assert_eq!(b.encoding(), Some(Encoding::Patch(PatchCodec::RunDiff)));
        assert_eq!(Blob::Raw.encoding(), None);
        assert_eq!(Blob::Raw.reference(), None);
    }

    #[test]
    fn malformed_and_oversized_messages_are_clear_errors() {
        let e = decode::<ToDaemon>(br#"{"type":"share_done","batch":"x"}"#).unwrap_err();
        assert!(matches!(e, WireError::Malformed { len: 33, .. }), "{e}");
        assert!(
            e.to_string()
                .starts_with("malformed memfoldd message (33 bytes): "),
            "{e}"
        );
        let e = decode::<ToAgent>(br#"{"type":"stats"}"#).unwrap_err();
        assert!(e.to_string().contains("unknown variant"), "{e}");
        let big = vec![b' '; MAX_MESSAGE + 1];
        let e = decode::<ToDaemon>(&big).unwrap_err();
        assert_eq!(
            e.to_string(),
            format!("message of {} bytes exceeds {MAX_MESSAGE}", MAX_MESSAGE + 1)
        );
        let io: io::Error = e.into();
        assert_eq!(io.kind(), io::ErrorKind::InvalidData);
    }

    #[test]
    fn messages_and_descriptors_cross_the_socket() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let l = Listener::bind(&path).unwrap();
        let c = Conn::connect(&path).unwrap();
        let s = l.accept().unwrap();
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        let hello = ToDaemon::AgentHello {
            version: PROTOCOL_VERSION,
            name: "g".into(),
            pid: 1,
            ram_bytes: 4096,
            opted_out: false,
            shared: 0,
        };
        c.send(&hello, &[f.as_fd()]).unwrap();
        let (m, fds): (ToDaemon, _) = s.recv().unwrap().unwrap();
        assert_eq!(m, hello);
        assert_eq!(fds.len(), 1);
        // Too large to send: refused before it reaches the socket, saying its size.
        let huge = ToAgent::ReclaimZero {
            batch: BatchId(1),
            gfns: (0..100_000).map(Gfn).collect(),
        };
        let e = s.send(&huge, &[]).unwrap_err();
        assert!(
            matches!(e, WireError::TooLarge { size } if size > MAX_MESSAGE),
            "{e}"
        );
        // Garbage on the socket is a clear error for the receiver, not a hang or a panic.
        let raw = memfold_sys::socket::Seqpacket::connect(&path).unwrap();
        let s2 = l.accept().unwrap();
        raw.send(b"not json", &[]).unwrap();
        let e = s2.recv::<ToDaemon>().unwrap_err();
        assert!(matches!(e, WireError::Malformed { len: 8, .. }), "{e}");
        drop(c);
        assert!(s.recv::<ToDaemon>().unwrap().is_none(), "end of connection");
    }
}
