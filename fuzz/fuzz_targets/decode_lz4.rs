//! The LZ4 page decompressor on arbitrary blobs (`memfold_fuzz::check_compressed`):
//! never panics; a failure is a typed error naming the codec; a success is the same whole
//! page whatever the output buffer held, agrees with `Encoding::decode`, is exactly one
//! page of the codec's stream (no more), and survives a round trip through every codec.
#![no_main]

use libfuzzer_sys::fuzz_target;

use memfold_codecs::CompressCodec;

fuzz_target!(|blob: &[u8]| memfold_fuzz::check_compressed(CompressCodec::Lz4, blob));
