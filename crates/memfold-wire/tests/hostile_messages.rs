//! The wire's decoder against hostile peers: arbitrary bytes, and valid messages cut,
//! extended or with bytes changed, decoded as every message type and as a re-attach list.
//! Each must be a message or a typed error ([`memfold_wire::WireError`]) — never a panic,
//! never an allocation sized by the peer beyond the message itself.

use memfold_wire::{
    decode, encode, reattach, BatchId, FrameId, Gfn, StashPage, ToAgent, ToClient, ToDaemon,
    PROTOCOL_VERSION,
};
use proptest::prelude::*;

fn samples() -> Vec<Vec<u8>> {
    let stash = StashPage {
        gfn: Gfn(3),
        blob: memfold_wire::Blob::Patch {
            codec: memfold_codecs::PatchCodec::RunDiff,
            reference: FrameId(9),
        },
        home: memfold_wire::BlobHome::Swap,
        offset: 4096,
        len: 100,
        moving: true,
        checksum: 42,
    };
    vec![
        encode(&ToDaemon::AgentHello {
            version: PROTOCOL_VERSION,
            name: "g".into(),
            pid: 1,
            ram_bytes: 1 << 20,
            shared: 2,
            opted_out: false,
        }),
        encode(&ToDaemon::ShareDone {
            batch: BatchId(7),
            shared: vec![Gfn(1), Gfn(2)],
            changed: vec![],
            refused: vec![Gfn(3)],
        }),
        encode(&ToDaemon::ClockBits {
            batch: BatchId(1),
            first: Gfn(0),
            count: 128,
            referenced: vec![u64::MAX, 0],
            modified: vec![1, 2],
        }),
        encode(&ToAgent::Stash {
            batch: BatchId(2),
            pages: vec![stash],
        }),
        encode(&ToAgent::Share {
            batch: BatchId(3),
            pages: vec![(Gfn(1), FrameId(2))],
        }),
    ]
}

fn decode_all(bytes: &[u8]) {
    let _ = decode::<ToDaemon>(bytes);
    let _ = decode::<ToAgent>(bytes);
    let _ = decode::<ToClient>(bytes);
    let _ = reattach::decode(bytes);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 1024, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_are_a_message_or_an_error(bytes in proptest::collection::vec(any::<u8>(), 0..4096)) {
        decode_all(&bytes);
    }

    #[test]
    fn mutated_messages_are_a_message_or_an_error(
        which in 0usize..5,
        edits in proptest::collection::vec((any::<usize>(), any::<u8>()), 1..6),
        cut in any::<usize>(),
    ) {
        let mut b = samples()[which].clone();
        for (at, v) in edits {
            let i = at % b.len();
            b[i] = v;
        }
        decode_all(&b);
        b.truncate(cut % (b.len() + 1));
        decode_all(&b);
    }
}

#[test]
fn an_oversized_message_is_refused_by_its_size() {
    let big = vec![b' '; memfold_wire::MAX_MESSAGE + 1];
    let e = decode::<ToDaemon>(&big).unwrap_err().to_string();
    assert!(
        e.contains(&format!("{}", memfold_wire::MAX_MESSAGE + 1)),
        "{e}"
    );
}
