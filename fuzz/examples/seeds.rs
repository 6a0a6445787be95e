//! Writes the checked-in seed corpora, `fuzz/seeds/<target>/<name>`: valid blobs of each
//! codec for a few sample pages, every message kind, a few re-attach lists. The fuzzer
//! starts from them so that it mutates real encodings rather than finding the formats
//! from nothing. Run from `fuzz/`: `cargo run --example seeds` (stable is enough).

use std::fs;
use std::path::Path;

use memfold_codecs::{CompressCodec, Encoding, PatchCodec};
use memfold_fuzz::{every_encoding, sample_blobs};
use memfold_wire::{
    encode, reattach, BatchId, Blob, BlobHome, FrameId, Gfn, Mapped, StashPage, ToAgent, ToDaemon,
    PROTOCOL_VERSION,
};

fn write(target: &str, name: &str, bytes: &[u8]) {
    let dir = Path::new("seeds").join(target);
    fs::create_dir_all(&dir).expect("create the seed folder");
    fs::write(dir.join(name), bytes).expect("write a seed");
}

fn main() {
    for enc in every_encoding() {
        let target = match enc {
            Encoding::Compressed(CompressCodec::Lz4) => "decode_lz4",
            Encoding::Compressed(CompressCodec::Zstd) => "decode_zstd",
            Encoding::Compressed(CompressCodec::Lzo) => "decode_lzo",
            Encoding::Compressed(CompressCodec::Wkdm) => "decode_wkdm",
            Encoding::Patch(PatchCodec::RunDiff) => "decode_run_diff",
            Encoding::Patch(PatchCodec::XorLz4) => "decode_xor_lz4",
            Encoding::Patch(PatchCodec::ZstdRef) => "decode_zstd_ref",
        };
        for (name, blob) in sample_blobs(enc) {
            if name == "random" && enc.is_patch() {
                continue; // a patch to a random page is the page itself, 4 KiB of noise
            }
            write(target, name, &blob);
            // decode_encoding: the encoding byte, "with reference", the blob.
            if name == "edited" || name == "words" {
                let mut framed = vec![enc.to_byte(), 1];
                framed.extend_from_slice(&blob);
                write(
                    "decode_encoding",
                    &format!("{}-{name}", enc.to_byte()),
                    &framed,
                );
            }
        }
    }

    let stash = StashPage {
        gfn: Gfn(3),
        blob: Blob::Patch {
            codec: PatchCodec::ZstdRef,
            reference: FrameId(9),
        },
        home: BlobHome::Store,
        offset: 4096,
        len: 100,
        moving: false,
        checksum: 0x5eed,
    };
    let daemon = [
        ToDaemon::AgentHello {
            version: PROTOCOL_VERSION,
            name: "web".into(),
            pid: 42,
            ram_bytes: 1 << 29,
            shared: 2,
            opted_out: false,
        },
        ToDaemon::ShareDone {
            batch: BatchId(7),
            shared: vec![Gfn(1), Gfn(2)],
            changed: vec![Gfn(3)],
            refused: vec![],
        },
        ToDaemon::CowBroken {
            breaks: vec![(Gfn(5), FrameId(6))],
        },
        ToDaemon::ClockBits {
            batch: BatchId(1),
            first: Gfn(0),
            count: 128,
            referenced: vec![u64::MAX, 0],
            modified: vec![1, 2],
        },
        ToDaemon::AgentStats(memfold_wire::AgentReport {
            wp_faults: 3,
            share_ns: vec![(1000, 2)],
            ..Default::default()
        }),
        ToDaemon::ClientHello {
            version: PROTOCOL_VERSION,
        },
        ToDaemon::Stats,
    ];
    for (i, m) in daemon.iter().enumerate() {
        write("wire_decode", &format!("daemon-{i}"), &encode(m));
    }
    let agent = [
        ToAgent::Welcome {
            version: PROTOCOL_VERSION,
        },
        ToAgent::Refused {
            message: "version 5 \"old\"".into(),
        },
        ToAgent::Share {
            batch: BatchId(3),
            pages: vec![(Gfn(1), FrameId(2))],
        },
        ToAgent::Stash {
            batch: BatchId(2),
            pages: vec![
                stash,
                StashPage {
                    blob: Blob::Compressed(CompressCodec::Wkdm),
                    home: BlobHome::Swap,
                    moving: true,
                    ..stash
                },
            ],
        },
        ToAgent::ClockScan {
            batch: BatchId(4),
            first: Gfn(16384),
            count: 16384,
            arm: vec![u64::MAX; 256],
            wp_only: vec![],
            zap_shared: true,
        },
    ];
    for (i, m) in agent.iter().enumerate() {
        write("wire_decode", &format!("agent-{i}"), &encode(m));
    }
    // The guest channel's lines (issue 17), read by the same target.
    use memfold_wire::guest::{encode_from_guest, FromGuest, GuestMeminfo};
    let guest = [
        FromGuest::Ram {
            v: 1,
            seq: 1,
            agent: "memfold-guest 1".into(),
            kernel: "6.1.0".into(),
            ranges: vec![[1, 159], [256, 524256], [1048576, 1310720]],
            meminfo: GuestMeminfo {
                mem_total: 2977208,
                ..Default::default()
            },
            discard: true,
        },
        FromGuest::Runs {
            v: 1,
            seq: 1,
            first: 256,
            runs: vec![[1, 100], [26, 3], [4, 1]],
        },
        FromGuest::End {
            v: 1,
            seq: 1,
            chunks: 1,
            frames: 104,
            walk_us: 1_200,
        },
        FromGuest::Error {
            v: 1,
            seq: 2,
            what: "/proc/kpageflags: \"denied\"".into(),
        },
    ];
    for (i, m) in guest.iter().enumerate() {
        let line = encode_from_guest(m);
        write(
            "wire_decode",
            &format!("guest-{i}"),
            &line[..line.len() - 1],
        );
    }

    let list = [
        (Gfn(0), Mapped::Frame(FrameId(0))),
        (Gfn(7), Mapped::ReclaimedZero),
        (
            Gfn(u32::MAX),
            Mapped::Frame(FrameId(reattach::RECLAIMED_ZERO_CODE - 1)),
        ),
    ];
    write(
        "reattach",
        "three",
        &reattach::encode(&list).expect("encode"),
    );
    write(
        "reattach",
        "one",
        &reattach::encode(&list[1..2]).expect("encode"),
    );
}
