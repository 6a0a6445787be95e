//! Every `ToDaemon` and `ToAgent` built from arbitrary fields (any strings, any numbers)
//! decodes from its encoding to itself, or is refused as too large
//! (`memfold_fuzz::wire::check_message_roundtrip`).
#![no_main]

use libfuzzer_sys::fuzz_target;

use memfold_fuzz::wire::AnyMsg;

fuzz_target!(|m: AnyMsg| memfold_fuzz::wire::check_message_roundtrip(&m));
