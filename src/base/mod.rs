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
//! - [`record`]: a record's status and snapshot, and the ordering guard's answer.
//! - [`prefetch`]: cache prefetch hints (the crate's only `unsafe`).

mod config;
mod error;
mod fingerprint;
mod finish;
mod limits;
mod prefetch;
mod record;
mod time;
mod window;

pub use config::{Durability, FullPolicy, RecoveryMode};
pub use error::{Error, Result};
pub(crate) use fingerprint::{Fingerprint, Hasher, random_secret};
pub(crate) use finish::Finish;
pub(crate) use limits::{
    DEFAULT_MAX_KEY_BYTES, DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_SEGMENT_MAX_BYTES, DEFAULT_SHARDS,
    LEASE_ID_LIMIT, MAX_SCOPED_KEY_BYTES, MIN_SEGMENT_BYTES, check_key,
};
pub use limits::{
    MAX_BATCH_KEYS, MAX_BUCKETS_PER_WINDOW, MAX_EXPECTED_KEYS, MAX_KEY_BYTES_LIMIT, MAX_NOTE_BYTES,
    MAX_RESPONSE_BYTES_LIMIT, MAX_SCOPE_PART_BYTES, MAX_SEGMENT_BYTES_LIMIT, MAX_SHARDS,
};
pub(crate) use prefetch::{prefetch_address, prefetch_read};
pub use record::{Advance, Record, RecordStatus};
pub(crate) use record::{LogSpan, ResponseBytes, SettledRecord};
#[cfg(any(feature = "redis", feature = "postgres"))]
#[cfg(feature = "postgres")]
pub(crate) use time::system_time_to_ms;
pub use time::{Clock, ManualClock, SystemClock};
pub(crate) use time::{deadline_after, duration_to_ms, ms_to_system_time};
pub(crate) use window::{Liveness, Window};
