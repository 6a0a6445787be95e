//! WKdm: the word-oriented in-memory page compressor of Wilson, Kaplan and Smaragdakis,
//! "The Case for Compressed Caching in Virtual Memory Systems" (USENIX 1999, §4), which
//! Difference Engine uses for compression (§3.3). Written for memfold from that description.
//!
//! The page is read as 1024 little-endian 32-bit words. A 16-entry direct-mapped
//! dictionary of recently seen words is indexed by a hash of a word's high 22 bits.
//! Each word gets a 2-bit tag:
//!
//! | tag | meaning | payload |
//! |-----|---------|---------|
//! | 0 `ZERO` | the word is 0 | none |
//! | 1 `EXACT` | equals the dictionary entry | 4-bit index |
//! | 2 `PARTIAL` | high 22 bits equal the entry | 4-bit index + low 10 bits; entry replaced |
//! | 3 `MISS` | no match | the full word; entry replaced |
//!
//! As in the paper the four kinds of output are segregated into separate packed arrays
//! (tags 4 per byte, indices 2 per byte, low bits 3 per 32-bit word, full words), which is
//! what makes WKdm fast: no bit-serial decoding of mixed fields.
//!
//! Blob layout (little-endian): `u16 n_index, u16 n_low, u16 n_full`, then 256 bytes of
//! tags, `ceil(n_index/2)` bytes of indices, `4*ceil(n_low/3)` bytes of low bits, and
//! `4*n_full` bytes of full words. A zero page compresses to 262 bytes.

use crate::{CodecError, Page, PAGE_SIZE};

const WORDS: usize = PAGE_SIZE / 4;
const HEADER: usize = 6;
const TAG_BYTES: usize = WORDS / 4;
const DICT_SIZE: usize = 16;
/// Dictionary entries start non-zero so that a page's first words are honest misses
/// (zero words never reach the dictionary: they have their own tag).
const DICT_INIT: u32 = 1;

const ZERO: u8 = 0;
const EXACT: u8 = 1;
const PARTIAL: u8 = 2;
const MISS: u8 = 3;

#[inline(always)]
fn dict_index(word: u32) -> usize {
    // Multiplicative hash of the high 22 bits: words that differ only in their low
    // 10 bits land on the same entry, so they can match partially.
    ((word >> 10).wrapping_mul(0x9E37_79B1) >> 28) as usize
}

/// Compresses one page with WKdm into `out` (cleared first).
///
/// Output length in bytes is between 262 (zero page) and 6 + 256 + 512 + 4096
/// (incompressible page; the engine's cut-off rejects such blobs).
pub fn compress(page: &Page, out: &mut Vec<u8>) {
    let mut tags = [0u8; TAG_BYTES];
    let mut indices = [0u8; WORDS]; // one index per byte here, packed below
    let mut lows = [0u16; WORDS];
    let mut fulls = [0u32; WORDS];
    let (mut n_idx, mut n_low, mut n_full) = (0usize, 0usize, 0usize);
    let mut dict = [DICT_INIT; DICT_SIZE];

    for (i, chunk) in page.chunks_exact(4).enumerate() {
        let w = u32::from_le_bytes(chunk.try_into().expect("4-byte chunk"));
        let tag = if w == 0 {
            ZERO
        } else {
            let d = dict_index(w);
            let entry = dict[d];
            if entry == w {
                indices[n_idx] = d as u8;
                n_idx += 1;
                EXACT
            } else if entry >> 10 == w >> 10 {
                indices[n_idx] = d as u8;
                n_idx += 1;
                lows[n_low] = (w & 0x3FF) as u16;
                n_low += 1;
                dict[d] = w;
                PARTIAL
            } else {
                fulls[n_full] = w;
                n_full += 1;
                dict[d] = w;
                MISS
            }
        };
        tags[i / 4] |= tag << ((i % 4) * 2);
    }

    out.clear();
    out.reserve(HEADER + TAG_BYTES + n_idx.div_ceil(2) + 4 * n_low.div_ceil(3) + 4 * n_full);
    out.extend_from_slice(&(n_idx as u16).to_le_bytes());
    out.extend_from_slice(&(n_low as u16).to_le_bytes());
    out.extend_from_slice(&(n_full as u16).to_le_bytes());
    out.extend_from_slice(&tags);
    for pair in indices[..n_idx].chunks(2) {
        out.push(pair[0] | pair.get(1).map_or(0, |b| b << 4));
    }
    for triple in lows[..n_low].chunks(3) {
        let mut packed = 0u32;
        for (k, &low) in triple.iter().enumerate() {
            packed |= (low as u32) << (10 * k);
        }
        out.extend_from_slice(&packed.to_le_bytes());
    }
    for &w in &fulls[..n_full] {
        out.extend_from_slice(&w.to_le_bytes());
    }
}

/// Decompresses a WKdm blob into one page.
///
/// Errors: [`CodecError::Corrupt`] if the header counts disagree with the blob length or
/// with the tags (a truncated or foreign blob never yields a page).
pub fn decompress(blob: &[u8], out: &mut Page) -> Result<(), CodecError> {
    let bad = |what: String| CodecError::corrupt("wkdm", blob.len(), what);
    if blob.len() < HEADER + TAG_BYTES {
        return Err(bad(format!(
            "shorter than the {} byte header and tags",
            HEADER + TAG_BYTES
        )));
    }
    let rd16 = |o: usize| u16::from_le_bytes([blob[o], blob[o + 1]]) as usize;
    let (n_idx, n_low, n_full) = (rd16(0), rd16(2), rd16(4));
    let tags = &blob[HEADER..HEADER + TAG_BYTES];
    let idx_off = HEADER + TAG_BYTES;
    let low_off = idx_off + n_idx.div_ceil(2);
    let full_off = low_off + 4 * n_low.div_ceil(3);
    let end = full_off + 4 * n_full;
    if end != blob.len() {
        return Err(bad(format!(
            "counts ({n_idx} indices, {n_low} low, {n_full} full) need {end} bytes"
        )));
    }

    // Count tags first so that a corrupt blob cannot index out of its arrays.
    let mut counts = [0usize; 4];
    for &b in tags {
        for k in 0..4 {
            counts[((b >> (2 * k)) & 3) as usize] += 1;
        }
    }
    if counts[EXACT as usize] + counts[PARTIAL as usize] != n_idx
        || counts[PARTIAL as usize] != n_low
        || counts[MISS as usize] != n_full
    {
        return Err(bad(format!("tag counts {counts:?} disagree with header")));
    }

    let mut dict = [DICT_INIT; DICT_SIZE];
    let (mut i_idx, mut i_low, mut i_full) = (0usize, 0usize, 0usize);
    for (i, word_out) in out.chunks_exact_mut(4).enumerate() {
        let tag = (tags[i / 4] >> ((i % 4) * 2)) & 3;
        let w = match tag {
            ZERO => 0,
            EXACT | PARTIAL => {
                let b = blob[idx_off + i_idx / 2];
                let d = if i_idx % 2 == 0 { b & 0xF } else { b >> 4 } as usize;
                i_idx += 1;
                if tag == EXACT {
                    dict[d]
                } else {
                    let o = low_off + 4 * (i_low / 3);
                    let packed = u32::from_le_bytes(blob[o..o + 4].try_into().expect("4 bytes"));
                    let low = (packed >> (10 * (i_low % 3))) & 0x3FF;
                    i_low += 1;
                    let w = (dict[d] & !0x3FF) | low;
                    dict[d] = w;
                    w
                }
            }
            _ => {
                let o = full_off + 4 * i_full;
                i_full += 1;
                let w = u32::from_le_bytes(blob[o..o + 4].try_into().expect("4 bytes"));
                dict[dict_index(w)] = w;
                w
            }
        };
        word_out.copy_from_slice(&w.to_le_bytes());
    }
    Ok(())
}
