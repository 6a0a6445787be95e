//! Guest page data for tests: pages every mechanism takes some of (zeros, duplicates,
//! near-duplicates, text, random), shared by the engine's tests and memfold-live's so
//! both exercise the same mix.

use crate::PAGE_SIZE;

/// Fills `out` with text-like bytes (words drawn from `rng`) that LZ4 and zstd compress
/// well under the Difference Engine's cut-off (DE §4.4), and that no two pages share.
pub fn texty(rng: &mut impl rand::Rng, out: &mut [u8]) {
    let words: [&[u8]; 6] = [
        b"memory ", b"page ", b"guest ", b"frame ", b"share ", b"0x1f ",
    ];
    let mut i = 0;
    while i < out.len() {
        let w = words[rng.gen_range(0..words.len())];
        let n = w.len().min(out.len() - i);
        out[i..i + n].copy_from_slice(&w[..n]);
        i += n;
    }
}

/// `pages` pages ([`PAGE_SIZE`] bytes each) of data every mechanism takes some of, by
/// `g % 5`: zeros (reclaimed), copies of one random page (shared), near-copies of it with
/// two bytes changed (patched against it, DE §4.3), text (compressed, DE §4.4), random
/// (kept). The fill of the tests that need every mechanism at work on one guest, drawn
/// from `seed`.
pub fn every_mechanism_pages(pages: usize, seed: u64) -> Vec<Vec<u8>> {
    use rand::{Rng, SeedableRng};
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed);
    let mut base = vec![0u8; PAGE_SIZE];
    rng.fill(&mut base[..]);
    let mut want = vec![vec![0u8; PAGE_SIZE]; pages];
    for (g, p) in want.iter_mut().enumerate() {
        match g % 5 {
            0 => {}
            1 => p.copy_from_slice(&base),
            2 => {
                p.copy_from_slice(&base);
                p[g % PAGE_SIZE] ^= 0x5a;
                p[(g * 7) % PAGE_SIZE] ^= 0xa5;
            }
            3 => texty(&mut rng, p),
            _ => rng.fill(&mut p[..]),
        }
    }
    want
}
