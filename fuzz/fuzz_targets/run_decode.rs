//! Damaged sealed key runs must open to `Ok` or an error, and answer lookups with an
//! answer or `Corrupted`, never a panic. The harness is shared with the corpus replay
//! test `tests/durability/fuzz_corpus.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/fuzzing/run_decode.rs"]
mod logic;

fuzz_target!(|data: &[u8]| logic::run(data));
