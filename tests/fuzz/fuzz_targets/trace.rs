//! libFuzzer target: `molt_testkit::trace` (see that module for what it checks).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| molt_testkit::trace(data));
