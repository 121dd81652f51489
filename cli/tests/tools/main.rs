//! The `oncedb` tool as a process, in one test binary: `dedup`, `inspect` and `verify` on
//! real directories, and `bench --backend` on real servers. Its tests run one at a time
//! (`support::serial`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    missing_docs,
    reason = "test code: a panic is the test failing; indices and casts come from the test's own data"
)]

mod support;

#[cfg(all(feature = "postgres", feature = "redis"))]
mod bench_backends;
mod cli;
mod output;
