//! libFuzzer target: `molt_testkit::kv_blob` (see that module for what it checks).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| molt_testkit::kv_blob(data));
