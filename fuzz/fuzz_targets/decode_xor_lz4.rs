//! The xor-lz4 patch decoder on arbitrary patches against a fixed reference page
//! (`memfold_fuzz::check_patch`): never panics; without its reference a patch is an error;
//! a success is the same whole page whatever the output held, agrees with
//! `Encoding::decode`, is exactly one page, and against a changed reference fails, gives
//! the same page, or gives one whose `page_checksum` differs (the agent's check catches it).
#![no_main]

use libfuzzer_sys::fuzz_target;

use memfold_codecs::PatchCodec;

fuzz_target!(|patch: &[u8]| memfold_fuzz::check_patch(PatchCodec::XorLz4, patch));
