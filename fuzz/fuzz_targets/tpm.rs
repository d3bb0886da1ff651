#![no_main]
libfuzzer_sys::fuzz_target!(|data: &[u8]| bca::fuzzing::tpm(data));
