//! Compression round trip on arbitrary pages (bytes, repeated bytes, or WKdm-shaped words):
//! every codec gives the exact page back, through the codec and `Encoding::decode`, from a
//! blob no larger than the codec's worst case (`memfold_fuzz::check_compress_roundtrip`).
#![no_main]

use libfuzzer_sys::fuzz_target;

use memfold_fuzz::PageSpec;

fuzz_target!(|spec: PageSpec| memfold_fuzz::check_compress_roundtrip(&spec.build()));
