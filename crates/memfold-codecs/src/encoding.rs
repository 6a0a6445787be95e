//! What a stored blob encodes: a patch against a reference page (DE §3.2) or a
//! compressed page (DE §3.3). The engine chooses it, the store records it, the agent
//! decodes by it.

use serde::{Deserialize, Serialize};

use crate::{CodecError, CompressCodec, Page, PatchCodec};

/// A blob's encoding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    /// A patch against a reference page.
    Patch(PatchCodec),
    /// A compressed page.
    Compressed(CompressCodec),
}

impl Encoding {
    /// The encoding as one byte (0..16 compression codecs, 16.. patch codecs), for blob
    /// headers.
    pub fn to_byte(self) -> u8 {
        match self {
            Encoding::Compressed(c) => CompressCodec::ALL
                .iter()
                .position(|&x| x == c)
                .expect("every codec is in ALL") as u8,
            Encoding::Patch(p) => {
                16 + PatchCodec::ALL
                    .iter()
                    .position(|&x| x == p)
                    .expect("every codec is in ALL") as u8
            }
        }
    }

    /// The encoding a byte of [`Encoding::to_byte`] names; `None` for an unknown byte.
    pub fn from_byte(b: u8) -> Option<Encoding> {
        if b >= 16 {
            PatchCodec::ALL
                .get((b - 16) as usize)
                .map(|&p| Encoding::Patch(p))
        } else {
            CompressCodec::ALL
                .get(b as usize)
                .map(|&c| Encoding::Compressed(c))
        }
    }

    /// Whether the blob is a patch (and so needs its reference page to decode).
    pub fn is_patch(self) -> bool {
        matches!(self, Encoding::Patch(_))
    }

    /// Encodes `page` as a blob of this encoding into `out` (cleared first); a patch is
    /// made against `reference`, which a compressed page ignores. The inverse of
    /// [`Encoding::decode`].
    ///
    /// Errors: [`CodecError::Encode`] if the library codec fails.
    pub fn encode(
        self,
        reference: &Page,
        page: &Page,
        out: &mut Vec<u8>,
    ) -> Result<(), CodecError> {
        match self {
            Encoding::Patch(codec) => codec.encode(reference, page, out),
            Encoding::Compressed(codec) => codec.compress(page, out),
        }
    }

    /// Decodes a blob of this encoding into `out`; a patch needs its reference page.
    ///
    /// Errors: [`CodecError::Corrupt`] if the blob does not decode to a whole page, or a
    /// patch comes without a reference.
    pub fn decode(
        self,
        blob: &[u8],
        reference: Option<&Page>,
        out: &mut Page,
    ) -> Result<(), CodecError> {
        match self {
            Encoding::Patch(codec) => codec.decode(
                reference.ok_or_else(|| {
                    CodecError::corrupt(
                        codec.name(),
                        blob.len(),
                        "a patch without its reference page",
                    )
                })?,
                blob,
                out,
            ),
            Encoding::Compressed(codec) => codec.decompress(blob, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_encoding_round_trips_through_its_byte() {
        for c in CompressCodec::ALL {
            assert_eq!(
                Encoding::from_byte(Encoding::Compressed(c).to_byte()),
                Some(Encoding::Compressed(c))
            );
        }
        for p in PatchCodec::ALL {
            assert_eq!(
                Encoding::from_byte(Encoding::Patch(p).to_byte()),
                Some(Encoding::Patch(p))
            );
        }
        assert_eq!(Encoding::from_byte(15), None);
        assert_eq!(Encoding::from_byte(255), None);
    }
}
