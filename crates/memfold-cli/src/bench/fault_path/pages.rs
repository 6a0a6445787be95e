//! Page contents of the fault-path benchmark: a seeded mix of text-like pages that
//! compress 2–4:1 and near-random ones, the same for both sides.

use memfold_core::{Page, PAGE_SIZE};
use rand::{rngs::SmallRng, Rng, SeedableRng};
use serde::Serialize;

/// What a generated page is like.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum PageKind {
    /// Text-like: words of a vocabulary, numbers, identifiers; compresses 2–4:1.
    Text,
    /// Near-random: random bytes with a few zero runs; compresses just under a page.
    Random,
}

/// A seeded generator of page contents: page `i` is the same for the same seed, whatever
/// else was generated.
pub struct PageGen {
    seed: u64,
    random_pct: u32,
    vocabulary: Vec<Vec<u8>>,
}

/// Words in a generator's vocabulary.
const VOCABULARY: usize = 1024;
/// Text-like pages: tokens that are words, percent (minus one: a match arm's bound).
const TEXT_WORDS_PCT: u32 = 89;
/// Tokens that are numbers (1–8 digits): this range of the percent draw; the rest are
/// hex identifiers.
const TEXT_NUMBER_FROM: u32 = TEXT_WORDS_PCT + 1;
const TEXT_NUMBER_TO: u32 = 97;
/// Text-like pages: tokens that repeat a phrase from earlier in the page, percent.
const TEXT_REPEAT_PCT: u32 = 33;
/// Skew of the word choice: word `⌊u^k · VOCABULARY⌋` for uniform `u`.
const TEXT_SKEW: i32 = 4;

impl PageGen {
    /// A generator for `seed`; `random_pct` percent of pages (0..=100) are near-random.
    pub fn new(seed: u64, random_pct: u32) -> PageGen {
        let mut r = SmallRng::seed_from_u64(seed);
        let vocabulary = (0..VOCABULARY)
            .map(|_| {
                let len = r.gen_range(2..=10);
                (0..len).map(|_| r.gen_range(b'a'..=b'z')).collect()
            })
            .collect();
        PageGen {
            seed,
            random_pct: random_pct.min(100),
            vocabulary,
        }
    }

    fn rng(&self, i: u32) -> SmallRng {
        SmallRng::seed_from_u64(self.seed ^ (u64::from(i) + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15))
    }

    /// The kind of page `i`.
    pub fn kind(&self, i: u32) -> PageKind {
        if self.rng(i).gen_range(0..100) < self.random_pct {
            PageKind::Random
        } else {
            PageKind::Text
        }
    }

    /// Page `i`'s contents.
    pub fn page(&self, i: u32) -> Box<Page> {
        let kind = self.kind(i);
        let mut r = self.rng(i);
        r.gen::<u64>(); // the draw that decided the kind
        let mut p = Box::new([0u8; PAGE_SIZE]);
        match kind {
            PageKind::Random => {
                r.fill(&mut p[..]);
                // Eight zero runs of 64 bytes: 1/8 of the page, so every codec gets it
                // under a page, barely.
                for _ in 0..8 {
                    let at = r.gen_range(0..PAGE_SIZE / 64) * 64;
                    p[at..at + 64].fill(0);
                }
            }
            PageKind::Text => {
                let mut text = Vec::with_capacity(PAGE_SIZE + 32);
                while text.len() < PAGE_SIZE {
                    // A phrase seen earlier in the page, repeated (log lines, markup, code
                    // repeat whole phrases): what gives LZ codecs long matches.
                    if text.len() > 256 && r.gen_range(0..100) < TEXT_REPEAT_PCT {
                        let len = r.gen_range(16..=48);
                        let from = r.gen_range(0..text.len() - len);
                        text.extend_from_within(from..from + len);
                        continue;
                    }
                    match r.gen_range(0..100) {
                        0..=TEXT_WORDS_PCT => {
                            // Skewed towards the first words, as text is (Zipf-like):
                            // words repeat within a page, which is what LZ codecs find.
                            let u: f64 = r.gen();
                            let w = (u.powi(TEXT_SKEW) * VOCABULARY as f64) as usize;
                            text.extend_from_slice(&self.vocabulary[w.min(VOCABULARY - 1)])
                        }
                        TEXT_NUMBER_FROM..=TEXT_NUMBER_TO => {
                            let digits = r.gen_range(1..=8);
                            text.extend((0..digits).map(|_| r.gen_range(b'0'..=b'9')));
                        }
                        _ => {
                            let hex = b"0123456789abcdef";
                            let n = r.gen_range(8..=16);
                            text.extend((0..n).map(|_| hex[r.gen_range(0..16)]));
                        }
                    }
                    text.push(match r.gen_range(0..20) {
                        0 => b'\n',
                        1 => b',',
                        2 => b'=',
                        _ => b' ',
                    });
                }
                p.copy_from_slice(&text[..PAGE_SIZE]);
            }
        }
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use memfold_core::CompressCodec;

    fn ratio(codec: CompressCodec, p: &Page) -> f64 {
        let mut out = Vec::new();
        codec.compress(p, &mut out).unwrap();
        PAGE_SIZE as f64 / out.len() as f64
    }

    #[test]
    fn text_pages_compress_two_to_four_and_random_ones_barely() {
        let g = PageGen::new(7, 20);
        let (mut text, mut random) = (0, 0);
        for i in 0..400 {
            let p = g.page(i);
            assert_eq!(*p, *g.page(i), "page {i} is the same each time");
            match g.kind(i) {
                PageKind::Text => {
                    text += 1;
                    for c in [CompressCodec::Zstd, CompressCodec::Lz4, CompressCodec::Lzo] {
                        let r = ratio(c, &p);
                        assert!(
                            (2.0..=4.0).contains(&r),
                            "text page {i}, {}: {r:.2}",
                            c.name()
                        );
                    }
                }
                PageKind::Random => {
                    random += 1;
                    for c in [CompressCodec::Zstd, CompressCodec::Lz4, CompressCodec::Lzo] {
                        let r = ratio(c, &p);
                        assert!(
                            (1.0..1.3).contains(&r),
                            "random page {i}, {}: {r:.2}",
                            c.name()
                        );
                    }
                }
            }
        }
        // 20% near-random, give or take the draw.
        assert!((50..110).contains(&random), "{random} near-random of 400");
        assert_eq!(text + random, 400);
        assert_ne!(*PageGen::new(8, 20).page(0), *g.page(0), "the seed matters");
        assert!((0..100).all(|i| PageGen::new(1, 0).kind(i) == PageKind::Text));
        assert!((0..100).all(|i| PageGen::new(1, 100).kind(i) == PageKind::Random));
    }
}
