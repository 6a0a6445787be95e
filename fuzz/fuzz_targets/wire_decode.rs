//! `memfold_wire::decode` on arbitrary packets, as memfoldd (`ToDaemon`), an agent
//! (`ToAgent`) and a client (`ToClient`) read them: a typed error, or a message that
//! re-encodes to bytes decoding to the same message (`memfold_fuzz::wire::check_message_bytes`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| memfold_fuzz::wire::check_message_bytes(data));
