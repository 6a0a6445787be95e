//! Round trips of every codec on every page type (zero, random, text-like, sparse words,
//! similar pairs, shifted pairs, a page that begins with zstd's dictionary magic), plus
//! corrupt-blob handling.

use memfold_codecs::{CodecError, CompressCodec, Page, PatchCodec, PAGE_SIZE};
use proptest::prelude::*;
use rand::{rngs::SmallRng, Rng, SeedableRng};

fn page_types(seed: u64) -> Vec<(&'static str, Box<Page>)> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut out: Vec<(&'static str, Box<Page>)> = Vec::new();
    out.push(("zero", Box::new([0u8; PAGE_SIZE])));
    let mut random = Box::new([0u8; PAGE_SIZE]);
    rng.fill(&mut random[..]);
    out.push(("random", random));
    let words = [&b"memory "[..], b"page ", b"share ", b"guest ", b"frame\n"];
    let mut text = Box::new([0u8; PAGE_SIZE]);
    let mut i = 0;
    while i < PAGE_SIZE {
        for &b in words[rng.gen_range(0..words.len())] {
            if i < PAGE_SIZE {
                text[i] = b;
                i += 1;
            }
        }
    }
    // zstd's dictionary magic at the start: a page a guest can write, which zstd would
    // take for a formatted dictionary if handed to it as one (zstd-ref's reference).
    let mut magic = text.clone();
    magic[..4].copy_from_slice(&0xEC30_A437u32.to_le_bytes());
    out.push(("text", text));
    // Kernel-like data: small integers and pointers with shared high bits.
    let mut sparse = Box::new([0u8; PAGE_SIZE]);
    for w in sparse.chunks_exact_mut(8) {
        let v: u64 = match rng.gen_range(0..4) {
            0 => 0,
            1 => rng.gen_range(0..1024),
            2 => 0xffff_8880_0000_0000 | (rng.gen_range(0..1u64 << 20) << 6),
            _ => rng.gen(),
        };
        w.copy_from_slice(&v.to_le_bytes());
    }
    out.push(("sparse", sparse));
    let mut ones = Box::new([0xFFu8; PAGE_SIZE]);
    ones[100] = 7;
    out.push(("ones", ones));
    out.push(("zstd-magic", magic));
    out
}

#[test]
fn compress_roundtrip_every_codec_every_page_type() {
    for seed in 0..20 {
        for (kind, page) in page_types(seed) {
            for codec in CompressCodec::ALL {
                let mut blob = Vec::new();
                codec.compress(&page, &mut blob).unwrap();
                let mut back = [0xAAu8; PAGE_SIZE];
                codec
                    .decompress(&blob, &mut back)
                    .unwrap_or_else(|e| panic!("{codec:?} {kind}: {e}"));
                assert!(
                    back[..] == page[..],
                    "{codec:?} on {kind} page (seed {seed}) did not round-trip"
                );
            }
        }
    }
}

#[test]
fn compression_ratios_have_the_expected_shape() {
    let pages = page_types(1);
    let size = |codec: CompressCodec, kind: &str| {
        let page = &pages.iter().find(|(k, _)| *k == kind).unwrap().1;
        let mut blob = Vec::new();
        codec.compress(page, &mut blob).unwrap();
        blob.len()
    };
    for codec in CompressCodec::ALL {
        assert!(size(codec, "zero") <= 300, "{codec:?} zero page");
        if codec != CompressCodec::Wkdm {
            assert!(size(codec, "text") < PAGE_SIZE / 2, "{codec:?} text page");
        }
        assert!(
            size(codec, "random") > PAGE_SIZE - 64,
            "{codec:?} random page cannot shrink"
        );
    }
    // WKdm's strength is words sharing high bits; byte-oriented text is not its case
    // (Wilson et al. §4 target in-memory data, not text).
    assert!(size(CompressCodec::Wkdm, "sparse") < PAGE_SIZE * 3 / 4);
    assert!(size(CompressCodec::Wkdm, "sparse") < size(CompressCodec::Lz4, "sparse"));
}

fn similar(base: &Page, rng: &mut SmallRng, changed_runs: usize) -> Box<Page> {
    let mut p = Box::new(*base);
    for _ in 0..changed_runs {
        let at = rng.gen_range(0..PAGE_SIZE - 8);
        rng.fill(&mut p[at..at + 8]);
    }
    p
}

#[test]
fn patch_roundtrip_every_codec_on_similar_shifted_and_unrelated_pages() {
    let mut rng = SmallRng::seed_from_u64(7);
    for (kind, base) in page_types(3) {
        let mut shifted = Box::new([0u8; PAGE_SIZE]);
        shifted[16..].copy_from_slice(&base[..PAGE_SIZE - 16]);
        let targets = vec![
            ("identical", Box::new(*base)),
            ("similar-1", similar(&base, &mut rng, 1)),
            ("similar-26", similar(&base, &mut rng, 26)),
            ("shifted", shifted),
            ("unrelated", page_types(99).remove(1).1),
        ];
        for (tkind, target) in targets {
            for codec in PatchCodec::ALL {
                let mut patch = Vec::new();
                codec.encode(&base, &target, &mut patch).unwrap();
                let mut back = [0x55u8; PAGE_SIZE];
                codec.decode(&base, &patch, &mut back).unwrap();
                assert!(
                    back[..] == target[..],
                    "{codec:?}: {tkind} against {kind} did not round-trip"
                );
            }
        }
    }
}

#[test]
fn run_diff_patch_of_a_95_percent_similar_page_is_small() {
    let mut rng = SmallRng::seed_from_u64(11);
    let mut base = [0u8; PAGE_SIZE];
    rng.fill(&mut base[..]);
    let target = similar(&base, &mut rng, 26); // ~5% of bytes
    let mut patch = Vec::new();
    PatchCodec::RunDiff
        .encode(&base, &target, &mut patch)
        .unwrap();
    assert!(patch.len() <= 26 * 11, "patch of {} bytes", patch.len());
    PatchCodec::RunDiff
        .encode(&base, &base, &mut patch)
        .unwrap();
    assert!(patch.is_empty());
}

#[test]
fn corrupt_blobs_are_errors_not_pages() {
    let (_, page) = page_types(5).remove(2);
    for codec in CompressCodec::ALL {
        let mut blob = Vec::new();
        codec.compress(&page, &mut blob).unwrap();
        let mut out = [0u8; PAGE_SIZE];
        let truncated = &blob[..blob.len() / 2];
        assert!(
            codec.decompress(truncated, &mut out).is_err(),
            "{codec:?} accepted a truncated blob"
        );
        assert!(
            codec.decompress(&[], &mut out).is_err(),
            "{codec:?} accepted an empty blob"
        );
    }
    let mut out = [0u8; PAGE_SIZE];
    let err = PatchCodec::RunDiff
        .decode(&page, &[0x80, 0x40, 5, 1, 2, 3, 4, 5], &mut out)
        .unwrap_err();
    assert!(
        matches!(
            err,
            CodecError::Corrupt {
                codec: "run-diff",
                ..
            }
        ),
        "{err}"
    );
    assert!(PatchCodec::RunDiff
        .decode(&page, &[3, 9, 1], &mut out)
        .is_err());
}

proptest! {
    #[test]
    fn wkdm_and_run_diff_roundtrip_arbitrary_pages(
        words in proptest::collection::vec(prop_oneof![Just(0u32), 0u32..2048, any::<u32>()], PAGE_SIZE / 4),
        edits in proptest::collection::vec((0usize..PAGE_SIZE, any::<u8>()), 0..64),
    ) {
        let mut page = [0u8; PAGE_SIZE];
        for (c, w) in page.chunks_exact_mut(4).zip(&words) {
            c.copy_from_slice(&w.to_le_bytes());
        }
        let mut blob = Vec::new();
        memfold_codecs::wkdm::compress(&page, &mut blob);
        let mut back = [0u8; PAGE_SIZE];
        memfold_codecs::wkdm::decompress(&blob, &mut back).unwrap();
        prop_assert!(back[..] == page[..]);

        let mut target = page;
        for (at, b) in edits { target[at] = b; }
        PatchCodec::RunDiff.encode(&page, &target, &mut blob).unwrap();
        PatchCodec::RunDiff.decode(&page, &blob, &mut back).unwrap();
        prop_assert!(back[..] == target[..]);
    }
}
