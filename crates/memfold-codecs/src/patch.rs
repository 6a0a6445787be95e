//! Page patches: a page stored as the difference to a reference page (Difference Engine §3.2).

use std::cell::RefCell;

use serde::{Deserialize, Serialize};

use crate::{CodecError, Page, PAGE_SIZE};

/// How a patch encodes a target page against a reference page (Difference Engine §3.2;
/// the paper used Xdelta).
///
/// `encode` writes the patch into `out` (cleared first); the engine keeps it only under
/// its cut-off (2 KiB by default, as in the paper). `decode` rebuilds the exact target from
/// the same reference bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum PatchCodec {
    /// Our run diff: the byte runs where the pages differ, as `(skip, len, bytes)` records
    /// with varint headers. Fastest; best for in-place edits (the common case in guest RAM).
    RunDiff,
    /// XOR with the reference, then LZ4: runs of equal bytes become zero runs.
    XorLz4,
    /// zstd level 1 with the reference page as a raw-content prefix (whatever its bytes):
    /// also finds content that moved within the page. Smallest, slowest.
    ZstdRef,
}

/// Two differing runs closer than this many equal bytes are merged into one record:
/// a new record header costs at least two bytes.
const RUN_GAP: usize = 4;

/// zstd's dictionary magic (0xEC30A437, little-endian): a "dictionary" that begins with
/// it is parsed as a formatted one, so a reference page that does is given to zstd as a
/// raw prefix instead.
const ZSTD_DICT_MAGIC: [u8; 4] = 0xEC30_A437u32.to_le_bytes();

thread_local! {
    static ZSTD_C: RefCell<Option<zstd::bulk::Compressor<'static>>> = const { RefCell::new(None) };
    static ZSTD_D: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

impl PatchCodec {
    /// All codecs, in the order reports list them.
    pub const ALL: [PatchCodec; 3] = [PatchCodec::RunDiff, PatchCodec::XorLz4, PatchCodec::ZstdRef];

    /// Short name (`run-diff`, `xor-lz4`, `zstd-ref`).
    pub fn name(self) -> &'static str {
        match self {
            PatchCodec::RunDiff => "run-diff",
            PatchCodec::XorLz4 => "xor-lz4",
            PatchCodec::ZstdRef => "zstd-ref",
        }
    }

    /// Encodes `target` as a patch against `reference` into `out` (cleared first); length
    /// in bytes, 0 for identical pages with [`PatchCodec::RunDiff`].
    ///
    /// Errors: [`CodecError::Encode`] if the library codec fails.
    pub fn encode(
        self,
        reference: &Page,
        target: &Page,
        out: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        out.clear();
        match self {
            PatchCodec::RunDiff => run_diff_encode(reference, target, out),
            PatchCodec::XorLz4 => {
                let x = xor_pages(reference, target);
                out.resize(lz4_flex::block::get_maximum_output_size(PAGE_SIZE), 0);
                let n =
                    lz4_flex::block::compress_into(&x, out).map_err(|e| CodecError::Encode {
                        codec: "xor-lz4",
                        what: e.to_string(),
                    })?;
                out.truncate(n);
            }
            PatchCodec::ZstdRef if reference[..4] == ZSTD_DICT_MAGIC => {
                zstd_prefix_encode(reference, target, out)?
            }
            PatchCodec::ZstdRef => ZSTD_C.with(|c| {
                let enc = |e: std::io::Error| CodecError::Encode {
                    codec: "zstd-ref",
                    what: e.to_string(),
                };
                let mut c = c.borrow_mut();
                if c.is_none() {
                    *c = Some(zstd::bulk::Compressor::new(1).map_err(enc)?);
                }
                let comp = c.as_mut().expect("set above");
                // Raw content: the reference does not begin with the magic (above).
                comp.set_dictionary(1, reference).map_err(enc)?;
                out.reserve(zstd::zstd_safe::compress_bound(PAGE_SIZE));
                comp.compress_to_buffer(&target[..], out).map_err(enc)?;
                Ok::<(), CodecError>(())
            })?,
        }
        Ok(())
    }

    /// Rebuilds the target page from `reference` and `patch` into `out`.
    ///
    /// Errors: [`CodecError::Corrupt`] if the patch is malformed (out-of-page runs, wrong
    /// decoded length, trailing bytes).
    pub fn decode(self, reference: &Page, patch: &[u8], out: &mut Page) -> Result<(), CodecError> {
        let name = self.name();
        let bad = |what: String| CodecError::corrupt(name, patch.len(), what);
        match self {
            PatchCodec::RunDiff => run_diff_decode(reference, patch, out),
            PatchCodec::XorLz4 => {
                let n =
                    lz4_flex::block::decompress_into(patch, out).map_err(|e| bad(e.to_string()))?;
                if n != PAGE_SIZE {
                    return Err(bad(format!("decoded {n} bytes, expected {PAGE_SIZE}")));
                }
                for (o, r) in out.iter_mut().zip(reference.iter()) {
                    *o ^= r;
                }
                Ok(())
            }
            PatchCodec::ZstdRef if reference[..4] == ZSTD_DICT_MAGIC => {
                zstd_prefix_decode(reference, patch, out)
            }
            PatchCodec::ZstdRef => ZSTD_D.with(|d| {
                let mut d = d.borrow_mut();
                if d.is_none() {
                    *d = Some(zstd::bulk::Decompressor::new().map_err(|e| bad(e.to_string()))?);
                }
                let dec = d.as_mut().expect("set above");
                dec.set_dictionary(reference)
                    .map_err(|e| bad(e.to_string()))?;
                let n = dec
                    .decompress_to_buffer(patch, &mut out[..])
                    .map_err(|e| bad(e.to_string()))?;
                if n != PAGE_SIZE {
                    return Err(bad(format!("decoded {n} bytes, expected {PAGE_SIZE}")));
                }
                Ok(())
            }),
        }
    }
}

/// zstd-ref against a reference that begins with zstd's dictionary magic: the reference as
/// a one-frame raw prefix (the same frame a raw dictionary gives), in a context of its
/// own — it borrows the reference, so it lives one call (~2× the time of the pooled one).
fn zstd_prefix_encode(
    reference: &Page,
    target: &Page,
    out: &mut Vec<u8>,
) -> Result<(), CodecError> {
    let enc = |what: String| CodecError::Encode {
        codec: "zstd-ref",
        what,
    };
    let name = |e: usize| enc(zstd::zstd_safe::get_error_name(e).to_string());
    let mut cctx = zstd::zstd_safe::CCtx::try_create()
        .ok_or_else(|| enc("no memory for a zstd context".into()))?;
    cctx.set_parameter(zstd::zstd_safe::CParameter::CompressionLevel(1))
        .map_err(name)?;
    cctx.ref_prefix(&reference[..]).map_err(name)?;
    out.reserve(zstd::zstd_safe::compress_bound(PAGE_SIZE));
    cctx.compress2(out, &target[..]).map_err(name)?;
    Ok(())
}

/// Decodes what [`zstd_prefix_encode`] wrote.
fn zstd_prefix_decode(reference: &Page, patch: &[u8], out: &mut Page) -> Result<(), CodecError> {
    let bad = |what: String| CodecError::corrupt("zstd-ref", patch.len(), what);
    let name = |e: usize| bad(zstd::zstd_safe::get_error_name(e).to_string());
    let mut dctx = zstd::zstd_safe::DCtx::try_create()
        .ok_or_else(|| bad("no memory for a zstd context".into()))?;
    dctx.ref_prefix(&reference[..]).map_err(name)?;
    let n = dctx.decompress(&mut out[..], patch).map_err(name)?;
    if n != PAGE_SIZE {
        return Err(bad(format!("decoded {n} bytes, expected {PAGE_SIZE}")));
    }
    Ok(())
}

impl std::str::FromStr for PatchCodec {
    type Err = String;
    /// Parses a codec name as printed by [`PatchCodec::name`].
    fn from_str(s: &str) -> Result<Self, String> {
        crate::parse_by_name(&Self::ALL, Self::name, s, "patch")
    }
}

fn xor_pages(a: &Page, b: &Page) -> Page {
    let mut x = [0u8; PAGE_SIZE];
    for ((o, a), b) in x.iter_mut().zip(a.iter()).zip(b.iter()) {
        *o = a ^ b;
    }
    x
}

/// Index of the first byte at or after `from` where the pages differ, comparing 8 bytes at
/// a time; `PAGE_SIZE` if none.
fn next_diff(a: &Page, b: &Page, from: usize) -> usize {
    let mut i = from;
    while i % 8 != 0 && i < PAGE_SIZE {
        if a[i] != b[i] {
            return i;
        }
        i += 1;
    }
    while i < PAGE_SIZE {
        let wa = u64::from_le_bytes(a[i..i + 8].try_into().expect("8 bytes"));
        let wb = u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let x = wa ^ wb;
        if x != 0 {
            return i + (x.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    PAGE_SIZE
}

fn put_varint(out: &mut Vec<u8>, mut v: usize) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

fn get_varint(buf: &[u8], pos: &mut usize) -> Option<usize> {
    let mut v = 0usize;
    for shift in [0, 7] {
        let b = *buf.get(*pos)?;
        *pos += 1;
        v |= ((b & 0x7F) as usize) << shift;
        if b & 0x80 == 0 {
            return Some(v);
        }
    }
    None // offsets within a page never need more than two varint bytes
}

fn run_diff_encode(reference: &Page, target: &Page, out: &mut Vec<u8>) {
    let mut last_end = 0;
    let mut start = next_diff(reference, target, 0);
    while start < PAGE_SIZE {
        // Extend the run until RUN_GAP equal bytes in a row (or the page end).
        let mut end = start + 1;
        let mut equal = 0;
        let mut k = end;
        while k < PAGE_SIZE {
            if reference[k] == target[k] {
                equal += 1;
                if equal == RUN_GAP {
                    break;
                }
            } else {
                equal = 0;
                end = k + 1;
            }
            k += 1;
        }
        put_varint(out, start - last_end);
        put_varint(out, end - start);
        out.extend_from_slice(&target[start..end]);
        last_end = end;
        start = next_diff(reference, target, end);
    }
}

fn run_diff_decode(reference: &Page, patch: &[u8], out: &mut Page) -> Result<(), CodecError> {
    let bad = |what: &str| CodecError::corrupt("run-diff", patch.len(), what);
    out.copy_from_slice(reference);
    let (mut pos, mut at) = (0usize, 0usize);
    while pos < patch.len() {
        let skip = get_varint(patch, &mut pos).ok_or_else(|| bad("truncated skip"))?;
        let len = get_varint(patch, &mut pos).ok_or_else(|| bad("truncated length"))?;
        let start = at + skip;
        let end = start + len;
        if len == 0 || end > PAGE_SIZE {
            return Err(bad("run outside the page"));
        }
        let bytes = patch
            .get(pos..pos + len)
            .ok_or_else(|| bad("truncated run bytes"))?;
        out[start..end].copy_from_slice(bytes);
        pos += len;
        at = end;
    }
    Ok(())
}
