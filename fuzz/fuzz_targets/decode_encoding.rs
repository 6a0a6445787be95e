//! `Encoding::decode`, the entry point the agent decodes every stored blob through: byte 0
//! names the encoding, bit 0 of byte 1 whether a reference page is given, the rest is the
//! blob (`memfold_fuzz::check_encoding`). `from_byte`/`to_byte` are inverses, a patch
//! without a reference is an error, and the result is the codec's own.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| memfold_fuzz::check_encoding(data));
