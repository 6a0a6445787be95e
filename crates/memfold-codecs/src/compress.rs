//! Whole-page compression (Difference Engine §3.3).

use std::cell::RefCell;

use serde::{Deserialize, Serialize};

use crate::{wkdm, CodecError, Page, PAGE_SIZE};

/// A self-contained page compressor (Difference Engine §3.3: the paper used LZO and WKdm).
///
/// `compress` writes the blob into `out` (cleared first); the engine keeps the blob only
/// if it is under its cut-off. `decompress` fills a whole page and fails with
/// [`CodecError::Corrupt`] if the blob does not decode to exactly [`PAGE_SIZE`] bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CompressCodec {
    /// LZ4 block format (`lz4_flex`).
    Lz4,
    /// zstd level 1 (`zstd`).
    Zstd,
    /// LZO1X-1 (`lzo1x`).
    Lzo,
    /// WKdm, our implementation ([`crate::wkdm`]).
    Wkdm,
}

thread_local! {
    static ZSTD_C: RefCell<Option<zstd::bulk::Compressor<'static>>> = const { RefCell::new(None) };
    static ZSTD_D: RefCell<Option<zstd::bulk::Decompressor<'static>>> = const { RefCell::new(None) };
}

impl CompressCodec {
    /// All codecs, in the order reports list them.
    pub const ALL: [CompressCodec; 4] = [
        CompressCodec::Lz4,
        CompressCodec::Zstd,
        CompressCodec::Lzo,
        CompressCodec::Wkdm,
    ];

    /// Short lowercase name (`lz4`, `zstd`, `lzo`, `wkdm`).
    pub fn name(self) -> &'static str {
        match self {
            CompressCodec::Lz4 => "lz4",
            CompressCodec::Zstd => "zstd",
            CompressCodec::Lzo => "lzo",
            CompressCodec::Wkdm => "wkdm",
        }
    }

    /// Compresses one page into `out` (cleared first). Output length is in bytes and may
    /// exceed [`PAGE_SIZE`] for incompressible pages.
    ///
    /// Errors: [`CodecError::Encode`] if the library codec fails.
    pub fn compress(self, page: &Page, out: &mut Vec<u8>) -> Result<(), CodecError> {
        out.clear();
        match self {
            CompressCodec::Lz4 => {
                out.resize(lz4_flex::block::get_maximum_output_size(PAGE_SIZE), 0);
                let n =
                    lz4_flex::block::compress_into(page, out).map_err(|e| CodecError::Encode {
                        codec: "lz4",
                        what: e.to_string(),
                    })?;
                out.truncate(n);
            }
            CompressCodec::Zstd => ZSTD_C.with(|c| {
                let mut c = c.borrow_mut();
                if c.is_none() {
                    *c = Some(zstd_compressor()?);
                }
                let comp = c.as_mut().expect("set above");
                out.reserve(zstd::zstd_safe::compress_bound(PAGE_SIZE));
                comp.compress_to_buffer(&page[..], out)
                    .map_err(|e| CodecError::Encode {
                        codec: "zstd",
                        what: e.to_string(),
                    })?;
                Ok::<(), CodecError>(())
            })?,
            CompressCodec::Lzo => {
                *out = lzo1x::compress(page, lzo1x::CompressLevel::default());
            }
            CompressCodec::Wkdm => wkdm::compress(page, out),
        }
        Ok(())
    }

    /// Decompresses `blob` into `out`, which receives exactly one page.
    ///
    /// Errors: [`CodecError::Corrupt`] if the blob is malformed or does not decode to
    /// exactly [`PAGE_SIZE`] bytes.
    pub fn decompress(self, blob: &[u8], out: &mut Page) -> Result<(), CodecError> {
        let name = self.name();
        let bad = |what: String| CodecError::corrupt(name, blob.len(), what);
        match self {
            CompressCodec::Lz4 => {
                let n =
                    lz4_flex::block::decompress_into(blob, out).map_err(|e| bad(e.to_string()))?;
                check_len(n, bad)
            }
            CompressCodec::Zstd => ZSTD_D.with(|d| {
                let mut d = d.borrow_mut();
                if d.is_none() {
                    *d = Some(zstd::bulk::Decompressor::new().map_err(|e| bad(e.to_string()))?);
                }
                let n = d
                    .as_mut()
                    .expect("set above")
                    .decompress_to_buffer(blob, &mut out[..])
                    .map_err(|e| bad(e.to_string()))?;
                check_len(n, bad)
            }),
            CompressCodec::Lzo => lzo1x::decompress(blob, out).map_err(|e| bad(format!("{e:?}"))),
            CompressCodec::Wkdm => wkdm::decompress(blob, out),
        }
    }
}

impl std::str::FromStr for CompressCodec {
    type Err = String;
    /// Parses a codec name as printed by [`CompressCodec::name`].
    fn from_str(s: &str) -> Result<Self, String> {
        crate::parse_by_name(&Self::ALL, Self::name, s, "compression")
    }
}

fn zstd_compressor() -> Result<zstd::bulk::Compressor<'static>, CodecError> {
    // Level 1: pages are compressed on the fault path's counterpart, speed matters more than ratio.
    zstd::bulk::Compressor::new(1).map_err(|e| CodecError::Encode {
        codec: "zstd",
        what: e.to_string(),
    })
}

fn check_len(n: usize, bad: impl Fn(String) -> CodecError) -> Result<(), CodecError> {
    if n == PAGE_SIZE {
        Ok(())
    } else {
        Err(bad(format!("decoded {n} bytes, expected {PAGE_SIZE}")))
    }
}
