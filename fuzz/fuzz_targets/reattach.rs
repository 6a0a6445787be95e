//! The re-attach list codec (`memfold_wire::reattach`) on arbitrary bytes: decodes iff whole
//! entries with no reserved frame, and then re-encodes to the same bytes; the same bytes as
//! entries encode iff no frame is reserved, and decode back (`memfold_fuzz::wire::check_reattach`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| memfold_fuzz::wire::check_reattach(data));
