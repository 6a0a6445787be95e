//! Checks of the wire's decoders: [`memfold_wire::decode`] (the bytes of one packet to a
//! [`ToDaemon`], [`ToAgent`] or [`ToClient`]) and [`reattach::decode`] (the re-attach
//! list), and messages built from `arbitrary` input for the encode/decode round trip.

use std::fmt::Debug;

use arbitrary::Arbitrary;
use memfold_codecs::{CompressCodec, PatchCodec};
use memfold_wire::{
    decode, encode, guest, reattach, AgentReport, BaseBlock, BatchId, Blob, BlobHome, Discarded,
    DiskId, FillId, FrameId, Gfn, Mapped, Message, StashPage, ToAgent, ToClient, ToDaemon,
    ToDevice, WireError, MAX_MESSAGE,
};

/// A decode that failed must say why in the wire's terms: too large only over
/// [`MAX_MESSAGE`], otherwise malformed with the packet's length.
fn assert_decode_error(e: &WireError, len: usize) {
    match e {
        WireError::TooLarge { size } => assert!(*size == len && len > MAX_MESSAGE, "{e}"),
        WireError::Malformed { len: l, .. } => assert!(*l == len && len <= MAX_MESSAGE, "{e}"),
        other => panic!("decode failed with a non-decode error: {other}"),
    }
}

/// A message decoded from a peer's bytes encodes to bytes that decode to the same
/// message, and encoding it again gives the same bytes (what memfoldd logs or forwards
/// is what it understood).
fn assert_stable<M: Message + PartialEq + Debug>(data: &[u8]) {
    match decode::<M>(data) {
        Err(e) => assert_decode_error(&e, data.len()),
        Ok(m) => {
            let bytes = encode(&m);
            let again = decode::<M>(&bytes)
                .unwrap_or_else(|e| panic!("{m:?} re-encoded does not decode: {e}"));
            assert_eq!(
                again, m,
                "a decoded message changed through encode and decode"
            );
            assert_eq!(encode(&again), bytes, "encoding is not stable");
        }
    }
}

/// The checks of `wire_decode` on one packet's bytes, as each side reads them: a
/// [`ToDaemon`] (memfoldd reading an agent or client) and a [`ToAgent`] (an agent reading
/// memfoldd) decode to a message that round-trips, or to a typed error; a [`ToClient`]
/// decodes or fails without panicking, and what decodes encodes to bytes that decode
/// (its floats are not compared: serde_json's default float parsing may differ from the
/// shortest representation in the last bit).
pub fn check_message_bytes(data: &[u8]) {
    assert_stable::<ToDaemon>(data);
    assert_stable::<ToAgent>(data);
    assert_stable::<ToDevice>(data);
    check_guest_line(data);
    match decode::<ToClient>(data) {
        Err(e) => assert_decode_error(&e, data.len()),
        Ok(m) => {
            decode::<ToClient>(&encode(&m)).expect("a decoded ToClient re-encodes to a message");
        }
    }
}

/// The guest channel's checks on bytes from an enlightened guest (issue 17): as one line,
/// [`guest::decode_from_guest`] gives a typed error saying why, or a message within the
/// limits that re-encodes to a line decoding to the same message; as a stream,
/// [`guest::LineReader`] yields lines within [`guest::MAX_GUEST_LINE`] and without
/// newlines, then ends with a typed error.
pub fn check_guest_line(data: &[u8]) {
    use guest::{FromGuest, GuestWireError as E};
    match guest::decode_from_guest(data) {
        Ok(m) => {
            if let FromGuest::Runs { runs, .. } = &m {
                assert!(runs.len() <= guest::MAX_RUNS);
            }
            if let FromGuest::Ram { ranges, .. } = &m {
                assert!(ranges.len() <= guest::MAX_RANGES);
            }
            let line = guest::encode_from_guest(&m);
            assert_eq!(line.last(), Some(&b'\n'));
            let again = guest::decode_from_guest(&line[..line.len() - 1])
                .unwrap_or_else(|e| panic!("{m:?} re-encoded does not decode: {e}"));
            assert_eq!(again, m, "a guest line changed through encode and decode");
        }
        Err(E::TooLong) => assert!(data.len() > guest::MAX_GUEST_LINE),
        Err(E::Malformed { len, .. }) => assert_eq!(len, data.len()),
        Err(E::Version { got }) => assert_ne!(got, guest::GUEST_PROTOCOL_VERSION),
        Err(E::Limit { .. }) => {}
        Err(e) => panic!("a guest line failed with a non-decode error: {e}"),
    }
    let mut r = guest::LineReader::new(data);
    loop {
        match r.line() {
            Ok(l) => assert!(l.len() <= guest::MAX_GUEST_LINE && !l.contains(&b'\n')),
            Err(E::Closed | E::TooLong) => break,
            Err(e) => panic!("reading lines from memory failed: {e}"),
        }
    }
}

/// The checks of `reattach` on arbitrary bytes. Decoding: a list decodes iff its length
/// is whole entries and no frame is above [`reattach::RECLAIMED_ZERO_CODE`]; what decodes
/// encodes back to the same bytes (the format has one spelling per list). Encoding: the
/// same bytes read as (gfn, frame) entries encode iff no frame is reserved, and decode
/// back to those entries.
pub fn check_reattach(data: &[u8]) {
    const CODE: u32 = reattach::RECLAIMED_ZERO_CODE;
    let raw: Vec<(u32, u32)> = data
        .chunks_exact(reattach::ENTRY_BYTES)
        .map(|c| {
            let g = u32::from_le_bytes(c[..4].try_into().expect("4 bytes"));
            let f = u32::from_le_bytes(c[4..].try_into().expect("4 bytes"));
            (g, f)
        })
        .collect();
    let whole = data.len() % reattach::ENTRY_BYTES == 0;
    match reattach::decode(data) {
        Ok(list) => {
            assert!(whole, "a list of {} bytes decoded", data.len());
            assert_eq!(list.len(), raw.len());
            for (&(g, m), &(rg, rf)) in list.iter().zip(&raw) {
                assert_eq!(g, Gfn(rg));
                match m {
                    Mapped::ReclaimedZero => assert_eq!(rf, CODE),
                    Mapped::Frame(f) => assert!(f == FrameId(rf) && rf < CODE),
                }
            }
            assert_eq!(
                reattach::encode(&list).expect("a decoded list encodes"),
                data
            );
        }
        Err(WireError::BadListLength {
            len,
            expected: None,
        }) => {
            assert!(!whole && len == data.len());
        }
        Err(WireError::FrameOutOfRange(f)) => {
            assert!(whole && f.0 > CODE && raw.iter().any(|&(_, rf)| rf == f.0));
        }
        Err(e) => panic!("re-attach decode failed with an unexpected error: {e}"),
    }

    let entries: Vec<(Gfn, Mapped)> = raw
        .iter()
        .map(|&(g, f)| (Gfn(g), Mapped::Frame(FrameId(f))))
        .collect();
    match reattach::encode(&entries) {
        Ok(bytes) => {
            assert!(
                raw.iter().all(|&(_, f)| f < CODE),
                "a reserved frame number was encoded"
            );
            assert_eq!(bytes.len(), entries.len() * reattach::ENTRY_BYTES);
            assert_eq!(
                reattach::decode(&bytes).expect("an encoded list decodes"),
                entries
            );
        }
        Err(WireError::FrameOutOfRange(f)) => assert!(f.0 >= CODE),
        Err(e) => panic!("re-attach encode failed with an unexpected error: {e}"),
    }
}

/// A [`ToDaemon`] described by a fuzzer (ids as plain numbers).
#[derive(Arbitrary, Debug)]
#[allow(missing_docs)]
pub enum DaemonMsg {
    AgentHello {
        version: u32,
        name: String,
        pid: u32,
        ram_bytes: u64,
        shared: u64,
        opted_out: bool,
    },
    ShareDone {
        batch: u64,
        shared: Vec<u32>,
        changed: Vec<u32>,
        refused: Vec<u32>,
    },
    CowBroken(Vec<(u32, u32)>),
    ReclaimDone {
        batch: u64,
        reclaimed: Vec<u32>,
        changed: Vec<u32>,
        refused: Vec<u32>,
    },
    StashDone {
        batch: u64,
        stashed: Vec<u32>,
        changed: Vec<u32>,
        refused: Vec<u32>,
    },
    Unstashed(Vec<u32>),
    Refilled(Vec<u32>),
    /// (gfn, 0 frame / 1 zero / 2 stashed, frame).
    Discarded(Vec<(u32, u8, u32)>),
    ClockBits {
        batch: u64,
        first: u32,
        count: u32,
        referenced: Vec<u64>,
        modified: Vec<u64>,
    },
    AgentStats {
        /// wp, missing, minor faults; state bytes; mappings; run breaks; ahead breaks; VMA
        /// budget; no-copy breaks; clock zaps done and skipped.
        faults: [u64; 11],
        hists: [Vec<(u64, u64)>; 7],
    },
    ClientHello(u32),
    Stats,
    Census,
    OptOut {
        name: String,
        out: bool,
    },
    TakeBackDone {
        batch: u64,
        taken: Vec<u32>,
        refused: Vec<u32>,
    },
    WatchDone {
        batch: u64,
        watched: Vec<u32>,
        refused: Vec<u32>,
    },
    PageOutDone {
        batch: u64,
        paged: Vec<u32>,
        resident: Vec<u32>,
        refused: Vec<u32>,
    },
    PagedIn(Vec<u32>),
    DiscardDone {
        batch: u64,
        discarded: Vec<u32>,
        changed: Vec<u32>,
        refused: Vec<u32>,
    },
    RegionUnmapped,
    DeviceHello(u32, Vec<u64>),
    ReadLanded {
        dev: u64,
        ino: u64,
        gfns: Vec<u32>,
        landed_ns: u64,
        bases: Vec<(u32, u64, u64)>,
    },
    FillRead {
        dev: u64,
        ino: u64,
        fill: u64,
        nonce: [u64; 2],
        pages: Vec<(u32, u64, u64)>,
    },
}

/// A [`ToDevice`] described by a fuzzer.
#[derive(Arbitrary, Debug)]
#[allow(missing_docs)]
pub enum DeviceMsg {
    Held(Vec<(u64, u64)>),
    Filled { fill: u64, gfns: Vec<u32> },
}

fn base_block(disk: u64, block: u64) -> BaseBlock {
    BaseBlock {
        disk: DiskId(disk),
        block,
    }
}

impl DeviceMsg {
    /// The message.
    pub fn build(&self) -> ToDevice {
        match self {
            DeviceMsg::Held(b) => ToDevice::Held {
                blocks: b.iter().map(|&(d, k)| base_block(d, k)).collect(),
            },
            DeviceMsg::Filled { fill, gfns: g } => ToDevice::Filled {
                fill: FillId(*fill),
                gfns: gfns(g),
            },
        }
    }
}

/// A [`ToAgent`] described by a fuzzer.
#[derive(Arbitrary, Debug)]
#[allow(missing_docs)]
pub enum AgentMsg {
    Welcome(u32),
    Refused(String),
    LeavePool(String),
    Share {
        batch: u64,
        pages: Vec<(u32, u32)>,
    },
    Fill {
        batch: u64,
        pages: Vec<(u32, u32)>,
        nonce: [u64; 2],
    },
    ReclaimZero {
        batch: u64,
        gfns: Vec<u32>,
    },
    Stash {
        batch: u64,
        pages: Vec<StashSpec>,
    },
    ClockScan {
        batch: u64,
        first: u32,
        count: u32,
        arm: Vec<u64>,
        wp_only: Vec<u64>,
        zap_shared: bool,
    },
    TakeBack {
        batch: u64,
        gfns: Vec<u32>,
    },
    Watch {
        batch: u64,
        gfns: Vec<u32>,
    },
    DiscardFree {
        batch: u64,
        gfns: Vec<u32>,
    },
    PageOut {
        batch: u64,
        gfns: Vec<u32>,
    },
    OptedOut(bool),
}

/// A [`StashPage`] described by a fuzzer; codecs by index into their `ALL`.
#[derive(Arbitrary, Debug)]
#[allow(missing_docs)]
pub struct StashSpec {
    gfn: u32,
    blob: BlobSpec,
    swap: bool,
    offset: u64,
    len: u32,
    moving: bool,
    checksum: u64,
}

/// A [`Blob`] described by a fuzzer.
#[derive(Arbitrary, Debug)]
#[allow(missing_docs)]
pub enum BlobSpec {
    Patch { codec: u8, reference: u32 },
    Compressed(u8),
    Raw,
}

/// One message for each side, for `wire_roundtrip`.
#[derive(Arbitrary, Debug)]
pub enum AnyMsg {
    /// To memfoldd.
    Daemon(DaemonMsg),
    /// To an agent.
    Agent(AgentMsg),
    /// To a block device.
    Device(DeviceMsg),
}

fn gfns(v: &[u32]) -> Vec<Gfn> {
    v.iter().map(|&g| Gfn(g)).collect()
}

impl DaemonMsg {
    /// The message.
    pub fn build(&self) -> ToDaemon {
        match self {
            DaemonMsg::AgentHello {
                version,
                name,
                pid,
                ram_bytes,
                shared,
                opted_out,
            } => ToDaemon::AgentHello {
                version: *version,
                name: name.clone(),
                pid: *pid,
                ram_bytes: *ram_bytes,
                shared: *shared,
                opted_out: *opted_out,
            },
            DaemonMsg::ShareDone {
                batch,
                shared,
                changed,
                refused,
            } => ToDaemon::ShareDone {
                batch: BatchId(*batch),
                shared: gfns(shared),
                changed: gfns(changed),
                refused: gfns(refused),
            },
            DaemonMsg::CowBroken(b) => ToDaemon::CowBroken {
                breaks: b.iter().map(|&(g, f)| (Gfn(g), FrameId(f))).collect(),
            },
            DaemonMsg::ReclaimDone {
                batch,
                reclaimed,
                changed,
                refused,
            } => ToDaemon::ReclaimDone {
                batch: BatchId(*batch),
                reclaimed: gfns(reclaimed),
                changed: gfns(changed),
                refused: gfns(refused),
            },
            DaemonMsg::StashDone {
                batch,
                stashed,
                changed,
                refused,
            } => ToDaemon::StashDone {
                batch: BatchId(*batch),
                stashed: gfns(stashed),
                changed: gfns(changed),
                refused: gfns(refused),
            },
            DaemonMsg::Unstashed(g) => ToDaemon::Unstashed { gfns: gfns(g) },
            DaemonMsg::Refilled(g) => ToDaemon::Refilled { gfns: gfns(g) },
            DaemonMsg::Discarded(p) => ToDaemon::Discarded {
                pages: p
                    .iter()
                    .map(|&(g, k, f)| {
                        let what = match k % 3 {
                            0 => Discarded::Frame(FrameId(f)),
                            1 => Discarded::Zero,
                            _ => Discarded::Stashed,
                        };
                        (Gfn(g), what)
                    })
                    .collect(),
            },
            DaemonMsg::ClockBits {
                batch,
                first,
                count,
                referenced,
                modified,
            } => ToDaemon::ClockBits {
                batch: BatchId(*batch),
                first: Gfn(*first),
                count: *count,
                referenced: referenced.clone(),
                modified: modified.clone(),
            },
            DaemonMsg::AgentStats { faults, hists } => ToDaemon::AgentStats(AgentReport {
                wp_faults: faults[0],
                missing_faults: faults[1],
                minor_faults: faults[2],
                share_ns: hists[0].clone(),
                cow_break_ns: hists[1].clone(),
                fault_ns: hists[2].clone(),
                reclaim_ns: hists[3].clone(),
                track_ns: hists[4].clone(),
                stash_ns: hists[5].clone(),
                unstash_ns: hists[6].clone(),
                state_bytes: faults[3],
                mappings: faults[4],
                run_breaks: faults[5],
                ahead_breaks: faults[6],
                vma_budget: faults[7],
                nocopy_breaks: faults[8],
                clock_zaps: faults[9],
                clock_zaps_skipped: faults[10],
            }),
            DaemonMsg::ClientHello(v) => ToDaemon::ClientHello { version: *v },
            DaemonMsg::DeviceHello(v, b) => ToDaemon::DeviceHello {
                version: *v,
                bases: b.iter().map(|&d| DiskId(d)).collect(),
            },
            DaemonMsg::ReadLanded {
                dev,
                ino,
                gfns: g,
                landed_ns,
                bases,
            } => ToDaemon::ReadLanded {
                ram: memfold_wire::RamFile {
                    dev: *dev,
                    ino: *ino,
                },
                gfns: gfns(g),
                landed_ns: *landed_ns,
                bases: bases
                    .iter()
                    .map(|&(i, d, k)| (i, base_block(d, k)))
                    .collect(),
            },
            DaemonMsg::FillRead {
                dev,
                ino,
                fill,
                nonce,
                pages,
            } => ToDaemon::FillRead {
                ram: memfold_wire::RamFile {
                    dev: *dev,
                    ino: *ino,
                },
                fill: FillId(*fill),
                nonce: *nonce,
                pages: pages
                    .iter()
                    .map(|&(g, d, k)| (Gfn(g), base_block(d, k)))
                    .collect(),
            },
            DaemonMsg::Stats => ToDaemon::Stats,
            DaemonMsg::Census => ToDaemon::Census,
            DaemonMsg::OptOut { name, out } => ToDaemon::OptOut {
                name: name.clone(),
                out: *out,
            },
            DaemonMsg::TakeBackDone {
                batch,
                taken,
                refused,
            } => ToDaemon::TakeBackDone {
                batch: BatchId(*batch),
                taken: gfns(taken),
                refused: gfns(refused),
            },
            DaemonMsg::WatchDone {
                batch,
                watched,
                refused,
            } => ToDaemon::WatchDone {
                batch: BatchId(*batch),
                watched: gfns(watched),
                refused: gfns(refused),
            },
            DaemonMsg::PageOutDone {
                batch,
                paged,
                resident,
                refused,
            } => ToDaemon::PageOutDone {
                batch: BatchId(*batch),
                paged: gfns(paged),
                resident: gfns(resident),
                refused: gfns(refused),
            },
            DaemonMsg::PagedIn(g) => ToDaemon::PagedIn { gfns: gfns(g) },
            DaemonMsg::DiscardDone {
                batch,
                discarded,
                changed,
                refused,
            } => ToDaemon::DiscardDone {
                batch: BatchId(*batch),
                discarded: gfns(discarded),
                changed: gfns(changed),
                refused: gfns(refused),
            },
            DaemonMsg::RegionUnmapped => ToDaemon::RegionUnmapped,
        }
    }
}

impl AgentMsg {
    /// The message.
    pub fn build(&self) -> ToAgent {
        match self {
            AgentMsg::Welcome(v) => ToAgent::Welcome { version: *v },
            AgentMsg::Refused(m) => ToAgent::Refused { message: m.clone() },
            AgentMsg::LeavePool(m) => ToAgent::LeavePool { message: m.clone() },
            AgentMsg::Share { batch, pages } => ToAgent::Share {
                batch: BatchId(*batch),
                pages: pages.iter().map(|&(g, f)| (Gfn(g), FrameId(f))).collect(),
            },
            AgentMsg::Fill {
                batch,
                pages,
                nonce,
            } => ToAgent::Fill {
                batch: BatchId(*batch),
                pages: pages.iter().map(|&(g, f)| (Gfn(g), FrameId(f))).collect(),
                nonce: *nonce,
            },
            AgentMsg::ReclaimZero { batch, gfns: g } => ToAgent::ReclaimZero {
                batch: BatchId(*batch),
                gfns: gfns(g),
            },
            AgentMsg::Stash { batch, pages } => ToAgent::Stash {
                batch: BatchId(*batch),
                pages: pages.iter().map(StashSpec::build).collect(),
            },
            AgentMsg::ClockScan {
                batch,
                first,
                count,
                arm,
                wp_only,
                zap_shared,
            } => ToAgent::ClockScan {
                batch: BatchId(*batch),
                first: Gfn(*first),
                count: *count,
                arm: arm.clone(),
                wp_only: wp_only.clone(),
                zap_shared: *zap_shared,
            },
            AgentMsg::TakeBack { batch, gfns: g } => ToAgent::TakeBack {
                batch: BatchId(*batch),
                gfns: gfns(g),
            },
            AgentMsg::Watch { batch, gfns: g } => ToAgent::Watch {
                batch: BatchId(*batch),
                gfns: gfns(g),
            },
            AgentMsg::DiscardFree { batch, gfns: g } => ToAgent::DiscardFree {
                batch: BatchId(*batch),
                gfns: gfns(g),
            },
            AgentMsg::PageOut { batch, gfns: g } => ToAgent::PageOut {
                batch: BatchId(*batch),
                gfns: gfns(g),
            },
            AgentMsg::OptedOut(out) => ToAgent::OptedOut { out: *out },
        }
    }
}

impl StashSpec {
    fn build(&self) -> StashPage {
        let blob = match self.blob {
            BlobSpec::Patch { codec, reference } => Blob::Patch {
                codec: PatchCodec::ALL[codec as usize % PatchCodec::ALL.len()],
                reference: FrameId(reference),
            },
            BlobSpec::Compressed(c) => {
                Blob::Compressed(CompressCodec::ALL[c as usize % CompressCodec::ALL.len()])
            }
            BlobSpec::Raw => Blob::Raw,
        };
        StashPage {
            gfn: Gfn(self.gfn),
            blob,
            home: if self.swap {
                BlobHome::Swap
            } else {
                BlobHome::Store
            },
            offset: self.offset,
            len: self.len,
            moving: self.moving,
            checksum: self.checksum,
        }
    }
}

/// Fails to compile when a message kind is added, so that the builders above (and the
/// round trip) cover it.
#[allow(dead_code)]
fn every_kind_is_built(d: &ToDaemon, a: &ToAgent) {
    match d {
        ToDaemon::AgentHello { .. }
        | ToDaemon::ShareDone { .. }
        | ToDaemon::CowBroken { .. }
        | ToDaemon::ReclaimDone { .. }
        | ToDaemon::StashDone { .. }
        | ToDaemon::Unstashed { .. }
        | ToDaemon::Refilled { .. }
        | ToDaemon::Discarded { .. }
        | ToDaemon::ClockBits { .. }
        | ToDaemon::AgentStats(_)
        | ToDaemon::ClientHello { .. }
        | ToDaemon::Stats
        | ToDaemon::Census
        | ToDaemon::OptOut { .. }
        | ToDaemon::TakeBackDone { .. }
        | ToDaemon::WatchDone { .. }
        | ToDaemon::DiscardDone { .. }
        | ToDaemon::PageOutDone { .. }
        | ToDaemon::PagedIn { .. }
        | ToDaemon::DeviceHello { .. }
        | ToDaemon::ReadLanded { .. }
        | ToDaemon::FillRead { .. }
        | ToDaemon::RegionUnmapped => {}
    }
    match a {
        ToAgent::Welcome { .. }
        | ToAgent::Refused { .. }
        | ToAgent::LeavePool { .. }
        | ToAgent::Share { .. }
        | ToAgent::Fill { .. }
        | ToAgent::ReclaimZero { .. }
        | ToAgent::Stash { .. }
        | ToAgent::ClockScan { .. }
        | ToAgent::TakeBack { .. }
        | ToAgent::Watch { .. }
        | ToAgent::DiscardFree { .. }
        | ToAgent::PageOut { .. }
        | ToAgent::OptedOut { .. } => {}
    }
}

fn assert_round_trip<M: Message + PartialEq + Debug>(m: &M) {
    let bytes = encode(m);
    match decode::<M>(&bytes) {
        Ok(back) => assert_eq!(&back, m, "the message changed on the wire"),
        Err(e) => {
            assert!(bytes.len() > MAX_MESSAGE, "{m:?} does not decode: {e}");
            assert!(matches!(e, WireError::TooLarge { .. }), "{e}");
        }
    }
}

/// The checks of `wire_roundtrip`: any message (any strings, any numbers) decodes from
/// its encoding to itself, or is refused as too large.
pub fn check_message_roundtrip(m: &AnyMsg) {
    match m {
        AnyMsg::Daemon(d) => assert_round_trip(&d.build()),
        AnyMsg::Agent(a) => assert_round_trip(&a.build()),
        AnyMsg::Device(d) => assert_round_trip(&d.build()),
    }
}
