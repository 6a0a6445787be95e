//! The checks behind memfold's fuzz targets (`fuzz_targets/`): each target only feeds
//! bytes or an `arbitrary` input to one `check_*` function here, which asserts what the
//! decoder promises. A blob or message comes from a store, swap file or socket a
//! compromised QEMU can write, so "no panic" is the least of it: a decode is a whole page
//! or a typed error, never a page made partly of the output buffer's old bytes, and a
//! patch against the wrong reference never passes the page checksum as another page.

use std::cell::RefCell;
use std::sync::OnceLock;

use arbitrary::Arbitrary;
use memfold_codecs::{
    page_checksum, CodecError, CompressCodec, Encoding, Page, PatchCodec, PAGE_SIZE,
};

pub mod wire;

/// The reference page the patch decode targets decode against (their seeds were made
/// against it): text-like, so that patches of pages near it are small.
pub fn reference_page() -> &'static Page {
    static REF: OnceLock<Page> = OnceLock::new();
    REF.get_or_init(|| {
        let words: [&[u8]; 5] = [b"memory ", b"page ", b"share ", b"guest ", b"frame\n"];
        let mut p = [0u8; PAGE_SIZE];
        let mut x = 0x2545_F491_4F6C_DD1Du64;
        let mut i = 0;
        while i < PAGE_SIZE {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            for &b in words[(x % 5) as usize] {
                if i < PAGE_SIZE {
                    p[i] = b;
                    i += 1;
                }
            }
        }
        p
    })
}

/// The reference page with eight bytes changed: the reference a patch meets if its pool
/// frame was written after the patch was made.
pub fn other_reference() -> &'static Page {
    static OTHER: OnceLock<Page> = OnceLock::new();
    OTHER.get_or_init(|| {
        let mut p = *reference_page();
        for b in &mut p[1000..1008] {
            *b ^= 0x5A;
        }
        p
    })
}

/// Every encoding, compression codecs first.
pub fn every_encoding() -> Vec<Encoding> {
    CompressCodec::ALL
        .iter()
        .map(|&c| Encoding::Compressed(c))
        .chain(PatchCodec::ALL.iter().map(|&p| Encoding::Patch(p)))
        .collect()
}

/// A decode error must say which codec refused the blob and how long the blob was
/// (the agent's log line is all an operator gets).
fn assert_corrupt(e: &CodecError, codec: &str, len: usize) {
    match e {
        CodecError::Corrupt {
            codec: c, len: l, ..
        } => {
            assert_eq!((*c, *l), (codec, len), "{e}");
        }
        other => panic!("{codec}: a decode failed with a non-decode error: {other}"),
    }
}

/// `blob`, a patch that decodes to `original` against its own reference, decoded against
/// `wrong` instead: it must fail, give `original`, or give a page whose checksum differs
/// (the agent checks the checksum before installing, so no other page passes as it).
fn assert_wrong_reference_caught(p: PatchCodec, blob: &[u8], wrong: &Page, original: &Page) {
    let mut out = [0u8; PAGE_SIZE];
    if p.decode(wrong, blob, &mut out).is_ok() {
        assert!(
            out == *original || page_checksum(&out) != page_checksum(original),
            "{}: a patch against the wrong reference decodes to another page with the same checksum",
            p.name()
        );
    }
}

thread_local! {
    // Library contexts made once: a zstd context per input would dominate the run time.
    static ZSTD: RefCell<zstd::bulk::Decompressor<'static>> =
        RefCell::new(zstd::bulk::Decompressor::new().expect("zstd context"));
    static ZSTD_REF: RefCell<zstd::bulk::Decompressor<'static>> = RefCell::new(
        zstd::bulk::Decompressor::with_dictionary(reference_page()).expect("zstd context"),
    );
}

/// What the library behind `c` decodes `blob` to when given room for two pages; `None`
/// if it fails. WKdm is ours and has a fixed output size, so it is not asked.
fn library_len(c: CompressCodec, blob: &[u8]) -> Option<usize> {
    let mut big = [0u8; 2 * PAGE_SIZE];
    match c {
        CompressCodec::Lz4 => lz4_flex::block::decompress_into(blob, &mut big).ok(),
        CompressCodec::Zstd => {
            ZSTD.with(|d| d.borrow_mut().decompress_to_buffer(blob, &mut big[..]).ok())
        }
        // lzo1x fills its output exactly or fails: a blob of one page fails for one more.
        CompressCodec::Lzo => match lzo1x::decompress(blob, &mut big[..PAGE_SIZE + 1]) {
            Ok(()) => Some(PAGE_SIZE + 1),
            Err(_) => Some(PAGE_SIZE),
        },
        CompressCodec::Wkdm => Some(PAGE_SIZE),
    }
}

/// The checks of a `decode_<compression codec>` target on an arbitrary blob: the codec
/// and the [`Encoding`] entry point agree; a failure is a typed error naming the codec; a
/// success fills the whole page (the same page whatever the output held before), the
/// blob encodes exactly one page (the library, given room for more, gives 4096 bytes),
/// and the page survives a round trip through the codec.
pub fn check_compressed(c: CompressCodec, blob: &[u8]) {
    let mut a = [0u8; PAGE_SIZE];
    let mut b = [0xFFu8; PAGE_SIZE];
    let mut e = [0x5Au8; PAGE_SIZE];
    let mut f = [0xA5u8; PAGE_SIZE];
    let ra = c.decompress(blob, &mut a);
    let rb = c.decompress(blob, &mut b);
    let re = Encoding::Compressed(c).decode(blob, None, &mut e);
    // A reference handed to a compressed blob is ignored.
    let rf = Encoding::Compressed(c).decode(blob, Some(reference_page()), &mut f);
    match ra {
        Err(err) => {
            assert_corrupt(&err, c.name(), blob.len());
            assert!(
                rb.is_err() && re.is_err() && rf.is_err(),
                "{}: decode is not deterministic",
                c.name()
            );
        }
        Ok(()) => {
            assert!(
                rb.is_ok() && re.is_ok() && rf.is_ok(),
                "{}: decode is not deterministic",
                c.name()
            );
            assert!(
                a == b,
                "{}: the decoded page keeps bytes the output held before",
                c.name()
            );
            assert!(
                a == e && a == f,
                "{}: Encoding::decode differs from the codec",
                c.name()
            );
            assert_eq!(
                library_len(c, blob),
                Some(PAGE_SIZE),
                "{}: the blob does not encode exactly one page",
                c.name()
            );
            compress_roundtrip(c, &a);
        }
    }
}

/// The checks of a `decode_<patch codec>` target on an arbitrary patch against
/// [`reference_page`]: as [`check_compressed`], plus: without its reference a patch is
/// an error; for run-diff and xor-lz4 whether a patch decodes does not depend on the
/// reference (xor-lz4 decodes to the same delta); against [`other_reference`] it fails,
/// gives the same page, or gives one whose checksum differs; the decoded page survives a
/// patch round trip against the reference with the codec.
pub fn check_patch(p: PatchCodec, blob: &[u8]) {
    let r = reference_page();
    let r2 = other_reference();
    let mut a = [0u8; PAGE_SIZE];
    let mut b = [0xFFu8; PAGE_SIZE];
    let mut e = [0x5Au8; PAGE_SIZE];
    let ra = p.decode(r, blob, &mut a);
    let rb = p.decode(r, blob, &mut b);
    let re = Encoding::Patch(p).decode(blob, Some(r), &mut e);
    let none = Encoding::Patch(p).decode(blob, None, &mut [0u8; PAGE_SIZE]);
    assert_corrupt(
        &none.expect_err("a patch without its reference decoded"),
        p.name(),
        blob.len(),
    );
    let mut a2 = [0u8; PAGE_SIZE];
    let ra2 = p.decode(r2, blob, &mut a2);
    let reference_free = matches!(p, PatchCodec::RunDiff | PatchCodec::XorLz4);
    match ra {
        Err(err) => {
            assert_corrupt(&err, p.name(), blob.len());
            assert!(
                rb.is_err() && re.is_err(),
                "{}: decode is not deterministic",
                p.name()
            );
            if reference_free {
                assert!(
                    ra2.is_err(),
                    "{}: validity depends on the reference",
                    p.name()
                );
            }
        }
        Ok(()) => {
            assert!(
                rb.is_ok() && re.is_ok(),
                "{}: decode is not deterministic",
                p.name()
            );
            assert!(
                a == b,
                "{}: the decoded page keeps bytes the output held before",
                p.name()
            );
            assert!(
                a == e,
                "{}: Encoding::decode differs from the codec",
                p.name()
            );
            let mut big = [0u8; 2 * PAGE_SIZE];
            let n = match p {
                PatchCodec::RunDiff => Some(PAGE_SIZE),
                PatchCodec::XorLz4 => lz4_flex::block::decompress_into(blob, &mut big).ok(),
                PatchCodec::ZstdRef => {
                    ZSTD_REF.with(|d| d.borrow_mut().decompress_to_buffer(blob, &mut big[..]).ok())
                }
            };
            assert_eq!(
                n,
                Some(PAGE_SIZE),
                "{}: the patch does not encode exactly one page",
                p.name()
            );
            if reference_free {
                assert!(
                    ra2.is_ok(),
                    "{}: validity depends on the reference",
                    p.name()
                );
            }
            if p == PatchCodec::XorLz4 {
                let same_delta = (0..PAGE_SIZE).all(|i| a[i] ^ r[i] == a2[i] ^ r2[i]);
                assert!(same_delta, "xor-lz4: the delta depends on the reference");
            }
            assert_wrong_reference_caught(p, blob, r2, &a);
            patch_roundtrip(p, r, &a, r2);
        }
    }
}

/// The checks of `decode_encoding`: byte 0 names the encoding ([`Encoding::from_byte`]),
/// bit 0 of byte 1 says whether a reference page is given, the rest is the blob.
/// `from_byte` and `to_byte` are inverses; [`Encoding::decode`] gives what the codec
/// gives; a patch without a reference is an error.
pub fn check_encoding(data: &[u8]) {
    let Some((&byte, rest)) = data.split_first() else {
        return;
    };
    let Some(enc) = Encoding::from_byte(byte) else {
        assert!(
            every_encoding().iter().all(|e| e.to_byte() != byte),
            "from_byte({byte}) is None but an encoding has that byte"
        );
        return;
    };
    assert_eq!(enc.to_byte(), byte, "to_byte(from_byte(b)) != b");
    let (with_ref, blob) = match rest.split_first() {
        Some((&flags, blob)) => (flags & 1 == 1, blob),
        None => (false, rest),
    };
    let reference = with_ref.then(reference_page);
    let mut out = [0x33u8; PAGE_SIZE];
    let r = enc.decode(blob, reference, &mut out);
    let mut direct = [0xCCu8; PAGE_SIZE];
    let d = match (enc, reference) {
        (Encoding::Compressed(c), _) => c.decompress(blob, &mut direct),
        (Encoding::Patch(p), Some(r)) => p.decode(r, blob, &mut direct),
        (Encoding::Patch(p), None) => {
            assert_corrupt(
                &r.expect_err("a patch without its reference decoded"),
                p.name(),
                blob.len(),
            );
            return;
        }
    };
    assert_eq!(
        r.is_ok(),
        d.is_ok(),
        "{enc:?}: Encoding::decode and the codec disagree"
    );
    if r.is_ok() {
        assert!(
            out == direct,
            "{enc:?}: Encoding::decode and the codec give other pages"
        );
    }
}

/// Room an encoder may need for one page, bytes: each library's documented worst case;
/// WKdm's is its module doc's (header, tags, 512 index bytes, every word in full).
fn max_blob(c: CompressCodec) -> usize {
    match c {
        CompressCodec::Lz4 => lz4_flex::block::get_maximum_output_size(PAGE_SIZE),
        CompressCodec::Zstd => zstd::zstd_safe::compress_bound(PAGE_SIZE),
        // LZO1X's documented bound: n + n/16 + 64 + 3.
        CompressCodec::Lzo => PAGE_SIZE + PAGE_SIZE / 16 + 64 + 3,
        CompressCodec::Wkdm => 6 + 256 + 512 + 4096,
    }
}

/// Every compression codec gives `page` back exactly, through the codec and through
/// [`Encoding::decode`], from a blob within the codec's worst-case size.
pub fn check_compress_roundtrip(page: &Page) {
    for c in CompressCodec::ALL {
        compress_roundtrip(c, page);
    }
}

fn compress_roundtrip(c: CompressCodec, page: &Page) {
    let mut blob = Vec::new();
    c.compress(page, &mut blob)
        .expect("compression never fails on a page");
    assert!(
        blob.len() <= max_blob(c),
        "{}: blob of {} bytes",
        c.name(),
        blob.len()
    );
    if c == CompressCodec::Wkdm {
        assert!(blob.len() >= 262, "wkdm: blob of {} bytes", blob.len());
    }
    let mut out = [0xA5u8; PAGE_SIZE];
    c.decompress(&blob, &mut out)
        .unwrap_or_else(|e| panic!("{}: {e}", c.name()));
    assert!(out == *page, "{}: the page did not round-trip", c.name());
    let mut out = [0x5Au8; PAGE_SIZE];
    Encoding::Compressed(c)
        .decode(&blob, None, &mut out)
        .expect("decoded above");
    assert!(
        out == *page,
        "{}: Encoding::decode did not round-trip",
        c.name()
    );
}

/// Every patch codec gives `target` back exactly from a patch against `reference`
/// (through the codec and [`Encoding::decode`]); the same patch without a reference is
/// an error and against `wrong` is caught by the checksum; run-diff of a page against
/// itself is empty.
pub fn check_patch_roundtrip(reference: &Page, target: &Page, wrong: &Page) {
    for p in PatchCodec::ALL {
        patch_roundtrip(p, reference, target, wrong);
    }
}

fn patch_roundtrip(p: PatchCodec, reference: &Page, target: &Page, wrong: &Page) {
    let mut blob = Vec::new();
    p.encode(reference, target, &mut blob)
        .expect("patch encoding never fails on pages");
    if p == PatchCodec::RunDiff {
        assert_eq!(
            blob.is_empty(),
            reference == target,
            "run-diff: empty patch iff identical"
        );
    }
    let mut out = [0xA5u8; PAGE_SIZE];
    p.decode(reference, &blob, &mut out)
        .unwrap_or_else(|e| panic!("{}: {e}", p.name()));
    assert!(out == *target, "{}: the page did not round-trip", p.name());
    let mut out = [0x5Au8; PAGE_SIZE];
    Encoding::Patch(p)
        .decode(&blob, Some(reference), &mut out)
        .expect("decoded above");
    assert!(
        out == *target,
        "{}: Encoding::decode did not round-trip",
        p.name()
    );
    assert!(Encoding::Patch(p).decode(&blob, None, &mut out).is_err());
    if wrong != reference {
        assert_wrong_reference_caught(p, &blob, wrong, target);
    }
}

/// A page a fuzzer describes: raw bytes, or words of the kinds WKdm tells apart.
#[derive(Arbitrary, Debug)]
pub enum PageSpec {
    /// The bytes, then zeros.
    Bytes(Vec<u8>),
    /// The bytes repeated over the page (a zero page if empty).
    Repeated(Vec<u8>),
    /// 32-bit words, repeated over the page.
    Words(Vec<WordSpec>),
}

/// One 32-bit word: zero, small, near a few pointer-like bases (same high 22 bits, so
/// WKdm's partial matches), or anything.
#[derive(Arbitrary, Debug, Clone, Copy)]
pub enum WordSpec {
    /// 0.
    Zero,
    /// A small integer.
    Small(u16),
    /// One of four bases with these low 10 bits.
    Near(u8, u16),
    /// Any word.
    Any(u32),
}

impl PageSpec {
    /// The page.
    pub fn build(&self) -> Box<Page> {
        let mut p = Box::new([0u8; PAGE_SIZE]);
        match self {
            PageSpec::Bytes(b) => {
                let n = b.len().min(PAGE_SIZE);
                p[..n].copy_from_slice(&b[..n]);
            }
            PageSpec::Repeated(b) if !b.is_empty() => {
                for (o, &v) in p.iter_mut().zip(b.iter().cycle()) {
                    *o = v;
                }
            }
            PageSpec::Repeated(_) => {}
            PageSpec::Words(w) if !w.is_empty() => {
                const BASES: [u32; 4] = [0x8880_0000, 0xdead_b000, 0x0040_1000, 0xffff_fc00];
                for (o, spec) in p.chunks_exact_mut(4).zip(w.iter().cycle()) {
                    let v = match *spec {
                        WordSpec::Zero => 0,
                        WordSpec::Small(s) => s as u32,
                        WordSpec::Near(b, low) => {
                            (BASES[b as usize % 4] & !0x3FF) | (low as u32 & 0x3FF)
                        }
                        WordSpec::Any(v) => v,
                    };
                    o.copy_from_slice(&v.to_le_bytes());
                }
            }
            PageSpec::Words(_) => {}
        }
        p
    }
}

/// Bytes written into a page at `at` (cut at the page's end).
#[derive(Arbitrary, Debug)]
pub struct Edit {
    /// Offset, modulo the page size.
    pub at: u16,
    /// Bytes to write.
    pub bytes: Vec<u8>,
}

fn apply(page: &mut Page, edits: &[Edit]) {
    for e in edits {
        let at = e.at as usize % PAGE_SIZE;
        let n = e.bytes.len().min(PAGE_SIZE - at);
        page[at..at + n].copy_from_slice(&e.bytes[..n]);
    }
}

/// The target page of a patch: the reference edited, shifted, or another page.
#[derive(Arbitrary, Debug)]
pub enum TargetSpec {
    /// The reference with these edits (the common case: in-place writes).
    Edited(Vec<Edit>),
    /// The reference moved by this many bytes (zstd-ref finds moved content).
    Shifted(u16),
    /// An unrelated page.
    Other(PageSpec),
}

/// A patch round trip: reference, target, and a wrong reference (the reference with
/// these edits; one bit flipped if they change nothing).
#[derive(Arbitrary, Debug)]
pub struct PatchCase {
    /// The reference page.
    pub reference: PageSpec,
    /// The target page.
    pub target: TargetSpec,
    /// Edits that make the wrong reference.
    pub wrong: Vec<Edit>,
}

impl PatchCase {
    /// Runs [`check_patch_roundtrip`] on the pages this case describes.
    pub fn check(&self) {
        let reference = self.reference.build();
        let target = match &self.target {
            TargetSpec::Edited(edits) => {
                let mut t = reference.clone();
                apply(&mut t, edits);
                t
            }
            TargetSpec::Shifted(by) => {
                let by = *by as usize % PAGE_SIZE;
                let mut t = Box::new([0u8; PAGE_SIZE]);
                t[by..].copy_from_slice(&reference[..PAGE_SIZE - by]);
                t
            }
            TargetSpec::Other(spec) => spec.build(),
        };
        let mut wrong = reference.clone();
        apply(&mut wrong, &self.wrong);
        if wrong == reference {
            wrong[0] ^= 1;
        }
        check_patch_roundtrip(&reference, &target, &wrong);
    }
}

/// Sample pages for seed corpora: zero, text-like, pointer-like words, random-looking,
/// and the reference page with a few edits.
pub fn sample_pages() -> Vec<(&'static str, Box<Page>)> {
    let mut random = Box::new([0u8; PAGE_SIZE]);
    let mut x = 0x9E37_79B9_7F4A_7C15u64;
    for b in random.iter_mut() {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = (x >> 24) as u8;
    }
    let mut edited = Box::new(*reference_page());
    for at in [17, 900, 901, 2048, 4000] {
        edited[at] ^= 0x20;
    }
    let words = PageSpec::Words(vec![
        WordSpec::Zero,
        WordSpec::Near(0, 5),
        WordSpec::Small(7),
        WordSpec::Near(0, 900),
        WordSpec::Any(0x1234_5678),
        WordSpec::Near(1, 3),
        WordSpec::Zero,
    ])
    .build();
    vec![
        ("zero", Box::new([0u8; PAGE_SIZE])),
        ("text", Box::new(*other_reference())),
        ("words", words),
        ("random", random),
        ("edited", edited),
    ]
}

/// Valid blobs of `enc` for [`sample_pages`] (patches against [`reference_page`]).
pub fn sample_blobs(enc: Encoding) -> Vec<(&'static str, Vec<u8>)> {
    sample_pages()
        .into_iter()
        .map(|(name, page)| {
            let mut out = Vec::new();
            enc.encode(reference_page(), &page, &mut out)
                .expect("encode");
            (name, out)
        })
        .collect()
}
