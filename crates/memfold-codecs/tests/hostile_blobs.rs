//! Decoders against hostile input: arbitrary bytes, and valid blobs with bits flipped,
//! bytes cut or appended, into every compression and patch codec (and a patch against the
//! wrong reference page). A decoder must return a page or a typed error — never panic,
//! never read or write out of bounds — because a blob comes from a store or swap file a
//! compromised QEMU can write. (That a wrong page is *detected* is the page checksum's
//! job, tested in `checksum.rs`; here: no crash. `fuzz/` runs the same inputs for longer.)

use memfold_codecs::{CompressCodec, Encoding, Page, PatchCodec, PAGE_SIZE};
use proptest::prelude::*;
use rand::{rngs::SmallRng, Rng, SeedableRng};

fn every_encoding() -> Vec<Encoding> {
    CompressCodec::ALL
        .iter()
        .map(|&c| Encoding::Compressed(c))
        .chain(PatchCodec::ALL.iter().map(|&p| Encoding::Patch(p)))
        .collect()
}

fn text_page(seed: u64) -> Box<Page> {
    let mut p = Box::new([0u8; PAGE_SIZE]);
    let mut r = SmallRng::seed_from_u64(seed);
    for (i, b) in p.iter_mut().enumerate() {
        *b = if i % 7 == 0 {
            r.gen_range(b'a'..=b'z')
        } else {
            b"guest page "[i % 11]
        };
    }
    p
}

/// A valid blob of `e` for page `p` (against `reference` for a patch).
fn blob(e: Encoding, p: &Page, reference: &Page) -> Vec<u8> {
    let mut out = Vec::new();
    e.encode(reference, p, &mut out).unwrap();
    out
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_crash_a_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..6000), which in 0usize..7) {
        let e = every_encoding()[which % every_encoding().len()];
        let reference = text_page(1);
        let mut out = [0u8; PAGE_SIZE];
        let _ = e.decode(&bytes, Some(&reference), &mut out);
    }

    #[test]
    fn mutated_blobs_never_crash_a_decoder(
        which in 0usize..7,
        seed in any::<u64>(),
        flips in proptest::collection::vec((any::<usize>(), 0u8..8), 1..8),
        cut in any::<usize>(),
        extra in proptest::collection::vec(any::<u8>(), 0..32),
        wrong_reference in any::<bool>(),
    ) {
        let e = every_encoding()[which % every_encoding().len()];
        let reference = text_page(seed);
        let mut page = reference.clone();
        page[seed as usize % PAGE_SIZE] ^= 0x55;
        let mut b = blob(e, &page, &reference);
        for (at, bit) in flips {
            if !b.is_empty() {
                let i = at % b.len();
                b[i] ^= 1 << bit;
            }
        }
        if cut % 3 == 0 {
            b.truncate(cut % (b.len() + 1));
        } else if cut % 3 == 1 {
            b.extend_from_slice(&extra);
        }
        let other = text_page(seed ^ 1);
        let mut out = [0u8; PAGE_SIZE];
        let r = if wrong_reference { &other } else { &reference };
        let _ = e.decode(&b, Some(r), &mut out);
        // A patch without its reference is an error, not a crash.
        if e.is_patch() {
            prop_assert!(e.decode(&b, None, &mut out).is_err());
        }
    }
}
