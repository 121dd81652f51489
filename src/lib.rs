//! oncedb: an embedded store for deduplication windows and idempotency records.
//!
//! - [`Db::insert_if_absent`]: atomic create-if-absent over a time window, the in-process
//!   `SET NX EX`.
//! - [`Db::reserve`]: idempotency records scoped by tenant and operation, bound to a
//!   request hash, with an in-flight / completed / failed lifecycle and stored responses
//!   replayed to retries.
//! - Keys live in time buckets; a bucket that leaves the window is dropped whole.
//! - [`Options::new`] stores everything in append-only segment files with the chosen
//!   [`Durability`]; recovery never loses an acknowledged write.
//!
//! ```
//! use std::time::{Duration, SystemTime};
//! use oncedb::{Db, ManualClock, Options, Reservation, Scope};
//!
//! let clock = ManualClock::new(SystemTime::now());
//! let db = Db::open(
//!     Options::in_memory()
//!         .window(Duration::from_secs(3600))
//!         .bucket_width(Duration::from_secs(60))
//!         .clock(clock.clone()),
//! )?;
//! assert!(db.insert_if_absent(b"msg_123")?);
//! assert!(!db.insert_if_absent(b"msg_123")?);
//!
//! let scope = Scope::new("org_123", "create_payment");
//! match db.reserve(&scope, b"key-1", b"{\"amount\":5000}")? {
//!     Reservation::Acquired(lease) => lease.complete(b"{\"id\":\"pay_1\"}")?,
//!     other => panic!("first attempt must acquire, got {other:?}"),
//! }
//! let Reservation::Completed(record) = db.reserve(&scope, b"key-1", b"{\"amount\":5000}")? else {
//!     panic!("retry must replay");
//! };
//! assert_eq!(record.response(), Some(&b"{\"id\":\"pay_1\"}"[..]));
//! # Ok::<(), oncedb::Error>(())
//! ```
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod clock;
mod db;
mod error;
mod fingerprint;
mod index;
pub mod io;
mod journal;
mod options;
mod record;
mod recovery;
mod segment;
mod stats;

pub use clock::{Clock, ManualClock, SystemClock};
pub use db::Db;
pub use error::{Error, Result};
pub use options::{
    Durability, FullPolicy, MAX_BATCH_KEYS, MAX_BUCKETS_PER_WINDOW, MAX_KEY_BYTES_LIMIT,
    MAX_RESPONSE_BYTES_LIMIT, MAX_SCOPE_PART_BYTES, MAX_SEGMENT_BYTES_LIMIT, MAX_SHARDS, Options,
};
pub use record::{Lease, Record, RecordStatus, Reservation, Scope};
pub use stats::Stats;

/// Compiles and runs the README's examples as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
