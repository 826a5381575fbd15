#![no_main]

// The invariants live in the library's `fuzzing` module, next to the parser they check.
libfuzzer_sys::fuzz_target!(|data: &[u8]| caliban::fuzzing::permission_pattern(data));
