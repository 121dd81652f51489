//! Interleaved client lifecycles, clock moves, crashes and reopens against a model.
//! The harness is shared with the corpus replay test `tests/durability/fuzz_corpus.rs`.
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../../tests/fuzzing/reservation_races.rs"]
mod logic;

fuzz_target!(|data: &[u8]| logic::run(data));
