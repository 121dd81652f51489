//! The engine's configuration: one struct, written by the API's `Options` setters and
//! checked whole before a store opens.

use std::fmt;
use std::path::PathBuf;
use std::sync::Arc;

use crate::base::{
    Clock, DEFAULT_MAX_KEY_BYTES, DEFAULT_MAX_RESPONSE_BYTES, DEFAULT_SEGMENT_MAX_BYTES,
    DEFAULT_SHARDS, Durability, Error, FullPolicy, MAX_BUCKETS_PER_WINDOW, MAX_EXPECTED_KEYS,
    MAX_KEY_BYTES_LIMIT, MAX_RESPONSE_BYTES_LIMIT, MAX_SEGMENT_BYTES_LIMIT, MAX_SHARDS,
    MIN_SEGMENT_BYTES, RecoveryMode, Result, SystemClock, Window,
};
use crate::index::{Index, IndexConfig};
use crate::io::{StdStorage, Storage};

/// Everything the engine is built from, as plain values. Units are in the names.
#[derive(Clone)]
pub(crate) struct Config {
    pub(crate) dir: Option<PathBuf>,
    pub(crate) window_ms: u64,
    pub(crate) bucket_width_ms: u64,
    pub(crate) durability: Durability,
    pub(crate) clock: Arc<dyn Clock>,
    pub(crate) shards: usize,
    pub(crate) expected_keys: u64,
    pub(crate) max_key_bytes: usize,
    pub(crate) max_response_bytes: usize,
    pub(crate) segment_max_bytes: u64,
    pub(crate) storage: Arc<dyn Storage>,
    /// Live keys and records the whole store may hold; `None` for no bound.
    pub(crate) max_keys: Option<u64>,
    pub(crate) full_policy: FullPolicy,
    pub(crate) huge_pages: bool,
    pub(crate) recovery_mode: RecoveryMode,
    /// Records in flight this long are counted as stuck in the stats.
    pub(crate) stuck_after_ms: u64,
    /// How far ahead of the high-water mark a clock reading may be and still move it.
    pub(crate) clock_step: ClockStep,
    /// Set by `Options::clock`: the store runs on a clock of the caller's.
    pub(crate) custom_clock: bool,
    /// A reserve that finds a record in flight this long takes it over.
    pub(crate) lease_timeout_ms: Option<u64>,
    /// Where expired segments are moved instead of unlinked.
    pub(crate) archive_dir: Option<PathBuf>,
    /// How long a finished record keeps its response, if shorter than the window.
    pub(crate) response_retention_ms: Option<u64>,
    /// Dedup tables beyond half of this are sealed into runs on disk.
    pub(crate) memory_budget_bytes: Option<u64>,
    /// Where the log is replicated.
    #[cfg(feature = "replicate")]
    pub(crate) replication: Option<crate::replica::Replication>,
}

/// The smallest memory budget: a few tables of the smallest size per shard.
pub(crate) const MIN_MEMORY_BUDGET_BYTES: u64 = 1 << 16;

/// The largest forward step of the clock the store adopts; see `Options::max_clock_step`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ClockStep {
    /// One window on the system clock; no limit on a caller's clock (event time may
    /// jump by design).
    Default,
    /// At most this many milliseconds.
    Limit(u64),
    /// Every reading is adopted.
    Unlimited,
}

impl Default for Config {
    /// A 24-hour window of 15-minute buckets in memory, `Sync`, on the system clock.
    fn default() -> Self {
        Config {
            dir: None,
            window_ms: 24 * 3600 * 1000,
            bucket_width_ms: 15 * 60 * 1000,
            durability: Durability::Sync,
            clock: Arc::new(SystemClock),
            shards: DEFAULT_SHARDS,
            expected_keys: 0,
            max_key_bytes: DEFAULT_MAX_KEY_BYTES,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            segment_max_bytes: DEFAULT_SEGMENT_MAX_BYTES,
            storage: Arc::new(StdStorage),
            max_keys: None,
            full_policy: FullPolicy::Reject,
            huge_pages: true,
            recovery_mode: RecoveryMode::Strict,
            stuck_after_ms: 5 * 60 * 1000,
            clock_step: ClockStep::Default,
            custom_clock: false,
            lease_timeout_ms: None,
            archive_dir: None,
            #[cfg(feature = "replicate")]
            replication: None,
            response_retention_ms: None,
            memory_budget_bytes: None,
        }
    }
}

impl fmt::Debug for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Options")
            .field("dir", &self.dir)
            .field("window_ms", &self.window_ms)
            .field("bucket_width_ms", &self.bucket_width_ms)
            .field("durability", &self.durability)
            .field("shards", &self.shards)
            .field("expected_keys", &self.expected_keys)
            .field("max_key_bytes", &self.max_key_bytes)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("segment_max_bytes", &self.segment_max_bytes)
            .field("max_keys", &self.max_keys)
            .field("full_policy", &self.full_policy)
            .field("recovery_mode", &self.recovery_mode)
            .field("stuck_after_ms", &self.stuck_after_ms)
            .field("huge_pages", &self.huge_pages)
            .field("clock_step", &self.clock_step)
            .finish_non_exhaustive()
    }
}

impl Config {
    /// The window in buckets.
    pub(crate) fn window(&self) -> Window {
        Window::new(self.window_ms, self.bucket_width_ms)
    }

    /// The largest forward step of the clock adopted at once, in buckets.
    pub(crate) fn max_step_buckets(&self) -> u64 {
        let width = self.bucket_width_ms.max(1);
        match self.clock_step {
            ClockStep::Default if self.custom_clock => u64::MAX,
            ClockStep::Default => self.window_ms.div_ceil(width),
            ClockStep::Limit(ms) => ms.div_ceil(width).max(1),
            ClockStep::Unlimited => u64::MAX,
        }
    }

    /// The per-shard share of `max_keys`.
    fn shard_capacity(&self) -> Option<u64> {
        let shards = u64::try_from(self.shards).unwrap_or(u64::MAX);
        self.max_keys.map(|keys| keys.div_ceil(shards).max(1))
    }

    fn index_config(&self, expected_keys: u64) -> IndexConfig {
        IndexConfig {
            window: self.window(),
            retention: self
                .response_retention_ms
                .map(|ms| Window::new(ms, self.bucket_width_ms)),
            shards: self.shards,
            expected_keys,
            shard_capacity: self.shard_capacity(),
            full_policy: self.full_policy,
            huge_pages: self.huge_pages,
        }
    }

    /// An empty index at `bucket`, sized for `expected_keys`.
    pub(crate) fn build_index(&self, expected_keys: u64, bucket: u64) -> Result<Index> {
        Index::new(self.index_config(expected_keys), bucket).map_err(|_| {
            Error::InvalidOptions(format!(
                "tables for {expected_keys} expected keys cannot be allocated"
            ))
        })
    }

    /// Replication needs a durable store whose commits fsync: sync mode on `Sync`, async
    /// mode on `Sync` or `Interval` (a `Buffered` log is never fsynced between
    /// roll-overs, so nothing would ship).
    #[cfg(feature = "replicate")]
    fn validate_replication(&self) -> Result<()> {
        use crate::replica::ReplicaMode;
        let Some(replication) = &self.replication else {
            return Ok(());
        };
        replication.check()?;
        if self.dir.is_none() {
            return Err(Error::InvalidOptions(
                "replication needs a durable store (Options::new)".into(),
            ));
        }
        match (replication.mode, self.durability) {
            (ReplicaMode::Sync, Durability::Sync)
            | (ReplicaMode::Async, Durability::Sync | Durability::Interval(_)) => Ok(()),
            (mode, durability) => Err(Error::InvalidOptions(format!(
                "replication ships fsynced groups: {mode:?} mode cannot run on {durability:?} \
                 durability (sync mode needs Sync; async mode needs Sync or Interval)"
            ))),
        }
    }

    /// Checks every setting; the error names the first one out of range.
    pub(crate) fn validate(&self) -> Result<()> {
        let invalid = |why: String| Err(Error::InvalidOptions(why));
        if self.bucket_width_ms == 0 {
            return invalid("bucket_width must be at least 1 ms".into());
        }
        if let Some(ms) = self.response_retention_ms
            && (ms == 0 || ms > self.window_ms || !ms.is_multiple_of(self.bucket_width_ms.max(1)))
        {
            return invalid(format!(
                "response_retention ({ms} ms) must be a whole number of buckets ({} ms) within the window ({} ms)",
                self.bucket_width_ms, self.window_ms
            ));
        }
        #[cfg(feature = "replicate")]
        self.validate_replication()?;
        if self.archive_dir.is_some() && self.dir.is_none() {
            return invalid("archive_dir needs a durable store (Options::new)".into());
        }
        if let Some(bytes) = self.memory_budget_bytes {
            if self.dir.is_none() {
                return invalid("memory_budget needs a durable store (Options::new)".into());
            }
            if self.max_keys.is_some() {
                return invalid("memory_budget and max_keys cannot be combined".into());
            }
            if bytes < MIN_MEMORY_BUDGET_BYTES {
                return invalid(format!(
                    "memory_budget ({bytes} bytes) must be at least {MIN_MEMORY_BUDGET_BYTES} bytes"
                ));
            }
        }
        if self.window_ms == 0 {
            return invalid("window must be at least 1 ms".into());
        }
        if self.bucket_width_ms > self.window_ms {
            return invalid(format!(
                "bucket_width ({} ms) is larger than the window ({} ms)",
                self.bucket_width_ms, self.window_ms
            ));
        }
        if !self.window_ms.is_multiple_of(self.bucket_width_ms) {
            return invalid(format!(
                "window ({} ms) is not a whole multiple of bucket_width ({} ms)",
                self.window_ms, self.bucket_width_ms
            ));
        }
        if self.window_ms / self.bucket_width_ms > MAX_BUCKETS_PER_WINDOW {
            return invalid(format!(
                "window spans {} buckets; at most {MAX_BUCKETS_PER_WINDOW} are allowed",
                self.window_ms / self.bucket_width_ms
            ));
        }
        if !self.shards.is_power_of_two() || self.shards > MAX_SHARDS {
            return invalid(format!(
                "shards ({}) must be a power of two between 1 and {MAX_SHARDS}",
                self.shards
            ));
        }
        if self.max_key_bytes == 0 || self.max_key_bytes > MAX_KEY_BYTES_LIMIT {
            return invalid(format!(
                "max_key_bytes ({}) must be between 1 and {MAX_KEY_BYTES_LIMIT}",
                self.max_key_bytes
            ));
        }
        if self.max_response_bytes > MAX_RESPONSE_BYTES_LIMIT {
            return invalid(format!(
                "max_response_bytes ({}) exceeds {MAX_RESPONSE_BYTES_LIMIT}",
                self.max_response_bytes
            ));
        }
        if self.expected_keys > MAX_EXPECTED_KEYS {
            return invalid(format!(
                "expected_keys ({}) exceeds {MAX_EXPECTED_KEYS}",
                self.expected_keys
            ));
        }
        if self.max_keys == Some(0) {
            return invalid("max_keys must be at least 1".into());
        }
        if let Durability::Interval(interval) = self.durability
            && interval.is_zero()
        {
            return invalid("Durability::Interval needs a non-zero interval".into());
        }
        if !(MIN_SEGMENT_BYTES..=MAX_SEGMENT_BYTES_LIMIT).contains(&self.segment_max_bytes) {
            return invalid(format!(
                "segment_max_bytes ({}) must be between {MIN_SEGMENT_BYTES} and {MAX_SEGMENT_BYTES_LIMIT}",
                self.segment_max_bytes
            ));
        }
        Ok(())
    }
}
