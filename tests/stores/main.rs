//! The `Store` trait and what is built on it, in one test binary: the conformance suite on
//! every implementation, the embedded `Db` behind the trait, PostgreSQL (inbox, outbox,
//! relay), Redis, the JetStream forwarder, the HTTP layer and the payments example. The
//! servers are real, started by the tests on free loopback ports and stopped when a test
//! ends.
//!
//! The relay crash test re-runs this binary as its child process, with
//! `--exact postgres::relay_child`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::indexing_slicing,
    clippy::cast_possible_truncation,
    missing_docs,
    reason = "test code: a panic is the test failing; indices and casts come from the test's own data"
)]

mod support;

#[cfg(feature = "async")]
mod conformance;
#[cfg(feature = "replicate")]
mod faults;
#[cfg(feature = "http")]
mod http;
mod jetstream;
#[cfg(feature = "postgres")]
mod outbox;
#[cfg(feature = "http")]
mod payments;
#[cfg(feature = "postgres")]
mod postgres;
#[cfg(feature = "redis")]
mod redis;
#[cfg(feature = "replicate")]
mod replica;
#[cfg(all(feature = "replicate", feature = "async"))]
mod stall;
#[cfg(feature = "async")]
mod store;
#[cfg(all(feature = "postgres", feature = "redis"))]
mod tls;
#[cfg(feature = "postgres")]
mod transactions;
#[cfg(feature = "http")]
mod webhooks;
#[cfg(all(feature = "postgres", feature = "redis"))]
mod workers;
