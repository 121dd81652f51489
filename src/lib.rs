//! oncedb: an embedded store for deduplication windows and idempotency records.
//!
//! - [`Db::insert_if_absent`]: atomic create-if-absent over a time window, the in-process
//!   `SET NX EX`.
//! - [`Db::reserve`]: idempotency records scoped by tenant and operation, bound to a
//!   request hash, with an in-flight / completed / failed lifecycle and stored responses
//!   replayed to retries.
//! - Keys live in time buckets; a bucket that leaves the window is dropped whole.
//! - [`Options::new`] stores everything in append-only segment files with the chosen
//!   [`Durability`].
//! - [`verify`] checks a store's files without changing them.
//!
//! # What survives which damage
//!
//! | damage | `Sync` | `Buffered` | `Interval(d)` |
//! |---|---|---|---|
//! | process crash (`kill -9`) | everything acknowledged | everything acknowledged | all but the last `d` |
//! | power loss | everything acknowledged | everything up to the last fsync (`flush`, roll-over, close) | all but the last `d` |
//! | a flipped or lost byte that an fsync covered | [`Error::Corrupted`] naming the file and byte ([`RecoveryMode::Strict`]), or every frame that still verifies kept and the skipped ranges reported ([`RecoveryMode::Salvage`]) | the same | the same |
//! | damage past the last fsync of the newest segment (a torn write) | cut, fsynced and reported in [`Db::recovery_report`]: never acknowledged as durable | the same | the same |
//!
//! Recovery never drops an acknowledged write silently. The cases no check can tell from
//! a torn write are damage inside the last commit group written before a crash (cut and
//! reported) and the newest segment of a crashed store cut exactly at a frame boundary;
//! `docs/guarantees.md` has the details and the tests behind each line.
//!
//! # Layering
//!
//! The modules form one-way rooms: `http` (the Idempotency-Key layer) and `backend`
//! (PostgreSQL, Redis) → `store` (the asynchronous `Store` trait) → `api` (the public
//! types) → `engine` (ordering of index, log and durability; the configuration;
//! recovery) → `index` (shards, tables, records) and `wal` (the segment log: format,
//! journal, scan) → `base` (errors, fingerprints, time, records, limits, configuration
//! values) and `io` (the file-system trait). Each room shows a narrow front in its
//! `mod.rs`. `tests/engine/layering.rs` fails on any reference that points upwards or
//! sideways, or past a room's front.
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
mod api;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod backend;
mod base;
mod engine;
#[cfg(feature = "http")]
pub mod http;
mod index;
pub mod io;
#[cfg(feature = "replicate")]
mod replica;
#[cfg(feature = "async")]
mod store;
mod wal;

#[cfg(feature = "replicate")]
pub use api::Standby;
pub use api::{
    Advance, BucketInfo, Db, InFlight, Lease, LeaseError, LeaseWatch, Lost, OnError, Once, Options,
    Record, RecordStatus, Reservation, RunOnce, Scope, Stats, is_archive, verify, verify_with,
};
#[cfg(feature = "postgres")]
pub use backend::postgres;
#[cfg(feature = "postgres")]
pub use backend::postgres::{MAX_POSTGRES_VERSION, PostgresLease, PostgresStore};
#[cfg(feature = "redis")]
pub use backend::redis::{MAX_REDIS_VERSION, RedisLease, RedisStore};
pub use base::{
    Clock, Durability, Error, FullPolicy, MAX_BATCH_KEYS, MAX_BUCKETS_PER_WINDOW,
    MAX_EXPECTED_KEYS, MAX_KEY_BYTES_LIMIT, MAX_NOTE_BYTES, MAX_RESPONSE_BYTES_LIMIT,
    MAX_SCOPE_PART_BYTES, MAX_SEGMENT_BYTES_LIMIT, MAX_SHARDS, ManualClock, RecoveryMode, Result,
    SystemClock,
};
#[cfg(feature = "replicate")]
pub use replica::{DEFAULT_REPLICAS, ReplicaMode, Replication, RestoreReport, StandbyLag};
#[cfg(feature = "async")]
pub use store::{Guarded, GuardedLease, HeldLease, OutagePolicy, Store, StoreLease, StoreOptions};
pub use wal::{
    Checkpoint, LogPosition, RecoveryReport, RunReport, SegmentReport, SegmentState, SkippedRange,
    TornTail, VerifyReport,
};

/// Compiles and runs the README's examples as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
