//! Configuration of a database: window, buckets, durability, clock and limits.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::clock::{Clock, SystemClock, duration_to_ms};
use crate::error::{Error, Result};
use crate::io::{StdStorage, Storage};

/// Most time buckets one window may span (`window / bucket_width`).
pub const MAX_BUCKETS_PER_WINDOW: u64 = 4096;
/// Largest value accepted for [`Options::max_key_bytes`].
pub const MAX_KEY_BYTES_LIMIT: usize = 64 * 1024;
/// Largest value accepted for [`Options::max_response_bytes`].
pub const MAX_RESPONSE_BYTES_LIMIT: usize = 16 * 1024 * 1024;
/// Most keys one [`Db::insert_many`](crate::Db::insert_many) call may carry.
pub const MAX_BATCH_KEYS: usize = 65_536;
/// Longest tenant or operation name of a [`Scope`](crate::Scope), in bytes.
pub const MAX_SCOPE_PART_BYTES: usize = 1024;
/// Largest value accepted for [`Options::segment_max_bytes`].
pub const MAX_SEGMENT_BYTES_LIMIT: u64 = 1 << 30;
/// Most shards a database may have.
pub const MAX_SHARDS: usize = 4096;

/// How far an acknowledged write has travelled when the call returns.
///
/// Every mode makes `Db::flush` a full barrier: when it returns, everything acknowledged
/// before it is on stable storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// The record is handed to the operating system (`write(2)`) before the call returns.
    ///
    /// Survives a process crash (`kill -9`): the kernel still holds the page cache.
    /// A power loss or kernel crash may lose anything written since the last `flush`.
    Buffered,
    /// Records are buffered in the process; a background thread writes and fsyncs them at
    /// least every interval.
    ///
    /// A process crash or a power loss loses at most the writes acknowledged during the
    /// last interval (plus the time one fsync takes). Highest throughput.
    Interval(Duration),
    /// The call returns only after its record is fsynced. Concurrent callers share one
    /// fsync (group commit) and a batch pays one fsync.
    ///
    /// Survives a process crash and a power loss: nothing acknowledged is lost.
    Sync,
}

/// What a store at its key limit ([`Options::max_keys`]) does with a new key: the
/// fail-closed or fail-open choice for a full deduplication store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FullPolicy {
    /// Fail closed: the write returns [`Error::Full`]; nothing is admitted and nothing
    /// already stored is lost. For payments, payouts, inventory.
    #[default]
    Reject,
    /// Fail open: the oldest bucket of the full shard is dropped early (counted in
    /// [`Stats::buckets_evicted`](crate::Stats) and logged at `warn`), so duplicates older
    /// than the remaining window may be admitted again. If the current bucket alone fills
    /// the shard, the write returns [`Error::Full`].
    EvictOldest,
}

/// Settings for [`Db::open`](crate::Db::open), built with chained calls.
#[derive(Clone)]
pub struct Options {
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
    pub(crate) max_keys: Option<u64>,
    pub(crate) full_policy: FullPolicy,
}

impl fmt::Debug for Options {
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
            .finish_non_exhaustive()
    }
}

impl Options {
    /// A durable store kept in directory `dir` (created if missing).
    pub fn new(dir: impl AsRef<Path>) -> Self {
        Options {
            dir: Some(dir.as_ref().to_path_buf()),
            ..Options::in_memory()
        }
    }

    /// A store held in memory only; everything is lost when the last handle drops.
    pub fn in_memory() -> Self {
        Options {
            dir: None,
            window_ms: 24 * 3600 * 1000,
            bucket_width_ms: 15 * 60 * 1000,
            durability: Durability::Sync,
            clock: Arc::new(SystemClock),
            shards: default_shards(),
            expected_keys: 0,
            max_key_bytes: 1024,
            max_response_bytes: 1024 * 1024,
            segment_max_bytes: 64 * 1024 * 1024,
            storage: Arc::new(StdStorage),
            max_keys: None,
            full_policy: FullPolicy::Reject,
        }
    }

    /// How long a key is remembered after its admission. Default 24 hours.
    /// Must be a whole multiple of the bucket width.
    pub fn window(mut self, window: Duration) -> Self {
        self.window_ms = duration_to_ms(window);
        self
    }

    /// Width of one time bucket, the unit in which expired keys are dropped. Default 15
    /// minutes. A key is forgotten between `window` and `window + bucket_width` after its
    /// admission.
    pub fn bucket_width(mut self, width: Duration) -> Self {
        self.bucket_width_ms = duration_to_ms(width);
        self
    }

    /// What survives a crash; see [`Durability`]. Default [`Durability::Sync`].
    /// Ignored by in-memory stores.
    pub fn durability(mut self, durability: Durability) -> Self {
        self.durability = durability;
        self
    }

    /// The time source. Default [`SystemClock`].
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.clock = Arc::new(clock);
        self
    }

    /// Number of independently locked shards, a power of two. Default: 64.
    pub fn shards(mut self, shards: usize) -> Self {
        self.shards = shards;
        self
    }

    /// Sizes the tables up front for about this many live keys, so they never grow
    /// while serving. Default 0 (grow as needed).
    pub fn expected_keys(mut self, keys: u64) -> Self {
        self.expected_keys = keys;
        self
    }

    /// Longest key accepted, in bytes (default 1024, at most [`MAX_KEY_BYTES_LIMIT`]).
    pub fn max_key_bytes(mut self, bytes: usize) -> Self {
        self.max_key_bytes = bytes;
        self
    }

    /// Longest stored response accepted, in bytes (default 1 MiB, at most
    /// [`MAX_RESPONSE_BYTES_LIMIT`]).
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    /// Size at which a segment file is closed and the next one of its bucket is started
    /// (default 64 MiB).
    pub fn segment_max_bytes(mut self, bytes: u64) -> Self {
        self.segment_max_bytes = bytes;
        self
    }

    /// The file-system layer a durable store does its I/O through. Default: the real
    /// file system. Tests pass a [`crate::io::FaultyStorage`] or [`crate::io::MemStorage`].
    pub fn storage(mut self, storage: Arc<dyn Storage>) -> Self {
        self.storage = storage;
        self
    }

    /// Bounds memory: at most about this many live dedup keys and records together
    /// (enforced per shard, `ceil(max_keys / shards)` each). Default: unbounded.
    pub fn max_keys(mut self, keys: u64) -> Self {
        self.max_keys = Some(keys);
        self
    }

    /// What happens to a new key when the store is full. Default [`FullPolicy::Reject`].
    pub fn full_policy(mut self, policy: FullPolicy) -> Self {
        self.full_policy = policy;
        self
    }

    /// The per-shard share of `max_keys`.
    pub(crate) fn shard_capacity(&self) -> Option<u64> {
        self.max_keys
            .map(|keys| keys.div_ceil(self.shards as u64).max(1))
    }

    /// Checks every setting; the error names the first one out of range.
    pub(crate) fn validate(&self) -> Result<()> {
        let invalid = |why: String| Err(Error::InvalidOptions(why));
        if self.bucket_width_ms == 0 {
            return invalid("bucket_width must be at least 1 ms".into());
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
        if self.max_keys == Some(0) {
            return invalid("max_keys must be at least 1".into());
        }
        if let Durability::Interval(interval) = self.durability
            && interval.is_zero()
        {
            return invalid("Durability::Interval needs a non-zero interval".into());
        }
        if !(4096..=MAX_SEGMENT_BYTES_LIMIT).contains(&self.segment_max_bytes) {
            return invalid(format!(
                "segment_max_bytes ({}) must be between 4096 and {MAX_SEGMENT_BYTES_LIMIT}",
                self.segment_max_bytes
            ));
        }
        Ok(())
    }
}

fn default_shards() -> usize {
    64
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rejects(options: Options, needle: &str) {
        match options.validate() {
            Err(Error::InvalidOptions(why)) => assert!(why.contains(needle), "{why}"),
            other => panic!("expected InvalidOptions({needle}), got {other:?}"),
        }
    }

    #[test]
    fn defaults_are_valid() {
        Options::in_memory().validate().unwrap();
    }

    #[test]
    fn bad_windows_are_rejected() {
        let secs = Duration::from_secs;
        rejects(Options::in_memory().window(Duration::ZERO), "window");
        rejects(
            Options::in_memory().bucket_width(Duration::ZERO),
            "bucket_width",
        );
        rejects(
            Options::in_memory()
                .window(secs(60))
                .bucket_width(secs(120)),
            "larger than the window",
        );
        rejects(
            Options::in_memory()
                .window(secs(100))
                .bucket_width(secs(30)),
            "whole multiple",
        );
        rejects(
            Options::in_memory()
                .window(secs(100_000))
                .bucket_width(secs(1)),
            "buckets",
        );
    }

    #[test]
    fn bad_limits_are_rejected() {
        rejects(Options::in_memory().shards(3), "power of two");
        rejects(Options::in_memory().shards(0), "power of two");
        rejects(Options::in_memory().max_key_bytes(0), "max_key_bytes");
        rejects(
            Options::in_memory().max_response_bytes(MAX_RESPONSE_BYTES_LIMIT + 1),
            "max_response_bytes",
        );
        rejects(
            Options::in_memory().durability(Durability::Interval(Duration::ZERO)),
            "Interval",
        );
    }
}
