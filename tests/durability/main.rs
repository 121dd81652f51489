//! What survives: damaged files, SIGKILLed writers and openers, reopens, failed I/O calls
//! and the fuzz corpus, in one test binary.
//!
//! The crash tests re-run this binary as their child process, with
//! `--exact crash_recovery::crash_writer_child`,
//! `--exact crash_rollover::crash_rollover_child` and
//! `--exact crash_sealing::crash_sealing_child`. A child holds copies of this process's
//! file descriptors until it execs, store locks included, so tests that spawn children and
//! tests that reopen stores on the real file system do not overlap (`support`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    missing_docs,
    reason = "test code: a panic is the test failing; indices and casts come from the test's own data"
)]

mod support;

mod archive;
mod checkpoint;
mod corruption;
mod crash_recovery;
mod crash_rollover;
mod crash_sealing;
mod durability;
mod faults;
mod fuzz_corpus;
mod record_runs;
mod responses;
mod sealing;
