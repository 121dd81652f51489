//! The engine's semantics through its public API, in one test binary: the API contract,
//! bad input, the window, hash flooding, the library's layering, the key bound, a
//! proptest model, the record lifecycle and ordering guard, races and a history-checked
//! stress run. Every store here is in memory or in a temp dir, and nothing spawns a
//! process.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    missing_docs,
    reason = "test code: a panic is the test failing; indices and casts come from the test's own data"
)]

mod support;

mod api;
mod errors;
mod expiry;
mod hashdos;
mod layering;
mod memory_bound;
mod model;
mod once;
mod operations;
mod races;
mod records;
mod stress;
