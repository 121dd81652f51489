//! Helpers shared by the integration tests.

#![expect(clippy::expect_used, reason = "test code: a panic is the test failing")]
#![allow(dead_code)]

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oncedb::{Db, ManualClock, Options};

/// The tests' window: one hour.
pub const WINDOW: Duration = Duration::from_secs(3600);
/// The tests' bucket width: one minute.
pub const BUCKET: Duration = Duration::from_secs(60);

/// A fixed start time, aligned to a bucket boundary plus `offset`.
pub fn start_at(offset: Duration) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(1_700_000_040) + offset
}

/// A manual clock at [`start_at`] with no offset.
pub fn manual_clock() -> ManualClock {
    ManualClock::new(start_at(Duration::ZERO))
}

/// An in-memory store with a one-hour window of one-minute buckets on `clock`.
pub fn memory_db(clock: &ManualClock) -> Db {
    Db::open(
        Options::in_memory()
            .window(WINDOW)
            .bucket_width(BUCKET)
            .clock(clock.clone()),
    )
    .expect("open in-memory db")
}

/// Options for a durable store in `dir` with the test window on `clock`.
pub fn durable_options(dir: &std::path::Path, clock: &ManualClock) -> Options {
    Options::new(dir)
        .window(WINDOW)
        .bucket_width(BUCKET)
        .clock(clock.clone())
}
