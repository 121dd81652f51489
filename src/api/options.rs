//! Configuration of a database: window, buckets, durability, clock and limits.

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crate::base::config::{Durability, FullPolicy, RecoveryMode};
use crate::base::error::{Error, Result};
use crate::base::limits::{
    MAX_BUCKETS_PER_WINDOW, MAX_EXPECTED_KEYS, MAX_KEY_BYTES_LIMIT, MAX_RESPONSE_BYTES_LIMIT,
    MAX_SEGMENT_BYTES_LIMIT, MAX_SHARDS,
};
use crate::base::time::{Clock, SystemClock, duration_to_ms};
use crate::base::window::Window;
use crate::engine::Config;
use crate::io::{StdStorage, Storage};

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
    pub(crate) recovery_mode: RecoveryMode,
    pub(crate) stuck_after_ms: u64,
    pub(crate) huge_pages: bool,
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
            .field("recovery_mode", &self.recovery_mode)
            .field("stuck_after_ms", &self.stuck_after_ms)
            .field("huge_pages", &self.huge_pages)
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

    /// Options for the existing durable store in `dir`: the window and bucket width it
    /// was created with (read from its manifest), every other setting at its default.
    /// `Error::Corrupted` if the manifest is damaged, `Error::Io` (not found) if `dir`
    /// holds no store.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let manifest =
            crate::log::manifest::Manifest::load(&StdStorage, dir)?.ok_or_else(|| {
                Error::Io(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("{} holds no oncedb store (no MANIFEST)", dir.display()),
                ))
            })?;
        Ok(Options {
            window_ms: manifest.window_ms,
            bucket_width_ms: manifest.bucket_width_ms,
            ..Options::new(dir)
        })
    }

    /// The window, as configured.
    pub fn window_length(&self) -> Duration {
        Duration::from_millis(self.window_ms)
    }

    /// The bucket width, as configured.
    pub fn bucket_length(&self) -> Duration {
        Duration::from_millis(self.bucket_width_ms)
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
            recovery_mode: RecoveryMode::Strict,
            stuck_after_ms: 5 * 60 * 1000,
            huge_pages: true,
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
    /// while serving. Default 0 (grow as needed). At most [`MAX_EXPECTED_KEYS`]; a size
    /// whose tables cannot be allocated is refused by `Db::open` with
    /// [`Error::InvalidOptions`].
    pub fn expected_keys(mut self, keys: u64) -> Self {
        self.expected_keys = keys;
        self
    }

    /// Whether dedup tables of 2 MiB and more made at open (sized by
    /// [`expected_keys`](Self::expected_keys)) are mapped and advised for transparent huge
    /// pages (`madvise(MADV_HUGEPAGE)`, Linux only; elsewhere, or where the kernel has no
    /// transparent huge pages, they stay on the heap). Default on: a probe of a large
    /// table then needs one TLB entry per 2 MiB instead of per 4 KiB. Tables rebuilt while
    /// growing stay on the heap either way (`docs/performance.md` has the figures).
    pub fn huge_pages(mut self, on: bool) -> Self {
        self.huge_pages = on;
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

    /// What `Db::open` does with damage in the log; see [`RecoveryMode`]. Default
    /// [`RecoveryMode::Strict`].
    pub fn recovery_mode(mut self, mode: RecoveryMode) -> Self {
        self.recovery_mode = mode;
        self
    }

    /// A record in flight at least this long counts as stuck in
    /// [`Stats::stuck_records`](crate::Stats). Default 5 minutes.
    pub fn stuck_after(mut self, age: Duration) -> Self {
        self.stuck_after_ms = duration_to_ms(age);
        self
    }

    /// The per-shard share of `max_keys`.
    fn shard_capacity(&self) -> Option<u64> {
        self.max_keys
            .map(|keys| keys.div_ceil(self.shards as u64).max(1))
    }

    /// Validates the options and turns them into the engine's configuration.
    pub(crate) fn to_config(&self) -> Result<Config> {
        self.validate()?;
        Ok(Config {
            dir: self.dir.clone(),
            window: Window::new(self.window_ms, self.bucket_width_ms),
            durability: self.durability,
            clock: Arc::clone(&self.clock),
            shards: self.shards,
            expected_keys: self.expected_keys,
            max_key_bytes: self.max_key_bytes,
            max_response_bytes: self.max_response_bytes,
            segment_max_bytes: self.segment_max_bytes,
            storage: Arc::clone(&self.storage),
            shard_capacity: self.shard_capacity(),
            full_policy: self.full_policy,
            recovery_mode: self.recovery_mode,
            stuck_after_ms: self.stuck_after_ms,
            huge_pages: self.huge_pages,
        })
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
        rejects(
            Options::in_memory().expected_keys(MAX_EXPECTED_KEYS + 1),
            "expected_keys",
        );
    }
}
