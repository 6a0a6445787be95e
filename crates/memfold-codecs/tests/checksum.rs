//! What the page checksum catches that the decoders cannot (issue 14). Every single-bit
//! flip of a valid blob, in every codec, fails to decode, decodes to the stored page
//! itself, or decodes to a page whose `page_checksum` differs from the stored one; and a
//! patch applied to the wrong reference page is caught the same way. Each test also
//! asserts that some of these blobs do decode, to other bytes: a decoder's own checks
//! are not enough, the checksum is what keeps a wrong page out of the guest.

use memfold_codecs::{page_checksum, CompressCodec, Encoding, Page, PatchCodec, PAGE_SIZE};
use rand::{rngs::SmallRng, Rng, SeedableRng};

/// Half text, half pointer-like words: every codec finds something to compress.
fn mixed_page(seed: u64) -> Box<Page> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut p = Box::new([0u8; PAGE_SIZE]);
    let words = [&b"memory "[..], b"page ", b"share ", b"guest ", b"frame\n"];
    let mut i = 0;
    while i < PAGE_SIZE / 2 {
        for &b in words[rng.gen_range(0..words.len())] {
            if i < PAGE_SIZE / 2 {
                p[i] = b;
                i += 1;
            }
        }
    }
    for w in p[PAGE_SIZE / 2..].chunks_exact_mut(8) {
        let v: u64 = match rng.gen_range(0..3) {
            0 => 0,
            1 => rng.gen_range(0..1024),
            _ => 0xffff_8880_0000_0000 | (rng.gen_range(0..1u64 << 16) << 6),
        };
        w.copy_from_slice(&v.to_le_bytes());
    }
    p
}

/// `base` with `runs` 8-byte runs rewritten: a page the guest wrote in place.
fn edited(base: &Page, seed: u64, runs: usize) -> Box<Page> {
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut p = Box::new(*base);
    for _ in 0..runs {
        let at = rng.gen_range(0..PAGE_SIZE - 8);
        rng.fill(&mut p[at..at + 8]);
    }
    p
}

fn every_encoding() -> Vec<Encoding> {
    CompressCodec::ALL
        .iter()
        .map(|&c| Encoding::Compressed(c))
        .chain(PatchCodec::ALL.iter().map(|&p| Encoding::Patch(p)))
        .collect()
}

fn encode(e: Encoding, reference: &Page, page: &Page) -> Vec<u8> {
    let mut out = Vec::new();
    e.encode(reference, page, &mut out).unwrap();
    out
}

/// What decoding `blob` gave, as the agent sees it after its checksum check.
#[derive(Debug, PartialEq)]
enum Outcome {
    /// The decoder refused the blob.
    Error,
    /// The stored page itself.
    Same,
    /// Another page, whose checksum differs: the agent refuses to install it.
    Caught,
}

fn outcome(e: Encoding, blob: &[u8], reference: &Page, stored: &Page) -> Outcome {
    let mut out = [0u8; PAGE_SIZE];
    match e.decode(blob, Some(reference), &mut out) {
        Err(_) => Outcome::Error,
        Ok(()) if out == *stored => Outcome::Same,
        Ok(()) => {
            assert_ne!(
                page_checksum(&out),
                page_checksum(stored),
                "{e:?}: a changed blob decodes to another page with the stored checksum"
            );
            Outcome::Caught
        }
    }
}

#[test]
fn every_single_bit_flip_in_every_codec_is_refused_or_caught_by_the_checksum() {
    let reference = mixed_page(1);
    let page = edited(&reference, 2, 12);
    for e in every_encoding() {
        let blob = encode(e, &reference, &page);
        let mut counts = [0usize; 3];
        for bit in 0..blob.len() * 8 {
            let mut b = blob.clone();
            b[bit / 8] ^= 1 << (bit % 8);
            counts[outcome(e, &b, &reference, &page) as usize] += 1;
        }
        let [errors, same, caught] = counts;
        assert!(
            caught > 0,
            "{e:?}: no flip of {} decoded to another page ({errors} errors, {same} same): \
             this test no longer shows what the checksum is for",
            blob.len() * 8
        );
    }
}

#[test]
fn truncated_and_extended_blobs_are_refused_or_caught_by_the_checksum() {
    let reference = mixed_page(3);
    let page = edited(&reference, 4, 5);
    for e in every_encoding() {
        let blob = encode(e, &reference, &page);
        for cut in 0..blob.len() {
            outcome(e, &blob[..cut], &reference, &page);
        }
        for extra in [&[0u8][..], &[0x80], &[1, 2, 3, 4, 5, 6, 7, 8]] {
            let mut b = blob.clone();
            b.extend_from_slice(extra);
            outcome(e, &b, &reference, &page);
        }
    }
}

#[test]
fn a_patch_applied_to_the_wrong_reference_is_caught_by_the_page_checksum() {
    let reference = mixed_page(5);
    let target = edited(&reference, 6, 12);
    let mut outside = Box::new(*reference); // a byte the patch does not rewrite
    let at = (0..PAGE_SIZE).find(|&i| target[i] == reference[i]).unwrap();
    outside[at] ^= 0xFF;
    let mut inside = Box::new(*reference); // a byte the patch rewrites
    let at = (0..PAGE_SIZE).find(|&i| target[i] != reference[i]).unwrap();
    inside[at] ^= 0xFF;
    let mut shifted = Box::new([0u8; PAGE_SIZE]);
    shifted[64..].copy_from_slice(&reference[..PAGE_SIZE - 64]);
    let wrong = [
        ("a byte outside the patched runs changed", outside),
        ("a byte inside a patched run changed", inside),
        ("shifted by 64 bytes", shifted),
        ("another page", mixed_page(7)),
        ("the zero page", Box::new([0u8; PAGE_SIZE])),
    ];
    for p in PatchCodec::ALL {
        let e = Encoding::Patch(p);
        let patch = encode(e, &reference, &target);
        assert_eq!(outcome(e, &patch, &reference, &target), Outcome::Same);
        for (what, w) in &wrong {
            let o = outcome(e, &patch, w, &target);
            // run-diff and xor-lz4 carry nothing of the reference: such a patch always
            // decodes, and only the checksum can tell.
            if p != PatchCodec::ZstdRef && what.starts_with("a byte outside") {
                assert_eq!(o, Outcome::Caught, "{p:?} against {what}");
            }
        }
    }
}
