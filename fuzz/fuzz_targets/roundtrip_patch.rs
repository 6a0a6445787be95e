//! Patch round trip on an arbitrary reference and target (edited, shifted or unrelated):
//! every patch codec gives the exact target back; the patch without a reference is an
//! error; against a wrong reference it fails, gives the target, or gives a page whose
//! `page_checksum` differs from the target's (`memfold_fuzz::check_patch_roundtrip`).
#![no_main]

use libfuzzer_sys::fuzz_target;

use memfold_fuzz::PatchCase;

fuzz_target!(|case: PatchCase| case.check());
