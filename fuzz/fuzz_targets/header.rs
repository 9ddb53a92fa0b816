//! libFuzzer target: see `Target::Header`.
#![no_main]

use libfuzzer_sys::{fuzz_mutator, fuzz_target, fuzzer_mutate};
use tinyloop_fuzz::{libfuzzer_mutate, Target};

fuzz_target!(|data: &[u8]| {
    if let Err(finding) = Target::Header.run(data) {
        panic!("{finding}");
    }
});

fuzz_mutator!(|data: &mut [u8], size: usize, max_size: usize, seed: u32| {
    libfuzzer_mutate(Target::Header, data, size, max_size, seed, fuzzer_mutate)
});
