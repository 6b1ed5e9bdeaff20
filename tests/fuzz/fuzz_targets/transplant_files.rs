//! libFuzzer target: `molt::fuzzing::transplant_files` (see that module for what it checks).
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| molt::fuzzing::transplant_files(data));
