//! The bottom room: small types every other room shares. Nothing here names a type of
//! the index, the log, the engine or the API.
//!
//! - [`error`]: the crate's `Error` and `Result`.
//! - [`fingerprint`]: keyed 128-bit hashes and the seeds derived from a database secret.
//! - [`time`] and [`window`]: clocks, milliseconds, buckets and the liveness rule.
//! - [`config`]: the configuration values lower rooms act on (durability, full policy,
//!   recovery mode).
//! - [`limits`]: every size limit, shared by encoders and decoders.
//! - [`finish`]: how a lease ends.
//! - [`prefetch`]: cache prefetch hints (the crate's only `unsafe`).

pub(crate) mod config;
pub(crate) mod error;
pub(crate) mod fingerprint;
pub(crate) mod finish;
pub(crate) mod limits;
pub(crate) mod prefetch;
pub(crate) mod time;
pub(crate) mod window;
