//! Configuration of a database: window, buckets, durability, clock and limits.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::base::{Clock, Durability, Error, FullPolicy, RecoveryMode, Result, duration_to_ms};
use crate::engine::{ClockStep, Config, Storage, stored_window};

/// Settings for [`Db::open`](crate::Db::open), built with chained calls. Each setter
/// writes the engine's configuration directly; [`Db::open`](crate::Db::open) checks it
/// whole and names the first setting out of range.
#[derive(Clone, Debug)]
pub struct Options {
    config: Config,
}

impl Options {
    /// A durable store kept in directory `dir` (created if missing).
    pub fn new(dir: impl AsRef<Path>) -> Self {
        let mut options = Options::in_memory();
        options.config.dir = Some(dir.as_ref().to_path_buf());
        options
    }

    /// Options for the existing durable store in `dir`: the window and bucket width it
    /// was created with (read from its manifest), every other setting at its default.
    /// `Error::Corrupted` if the manifest is damaged, `Error::Io` (not found) if `dir`
    /// holds no store.
    pub fn from_dir(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        let (window_ms, bucket_width_ms) = stored_window(dir)?.ok_or_else(|| {
            Error::Io(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                format!("{} holds no oncedb store (no MANIFEST)", dir.display()),
            ))
        })?;
        let mut options = Options::new(dir);
        options.config.window_ms = window_ms;
        options.config.bucket_width_ms = bucket_width_ms;
        Ok(options)
    }

    /// A store held in memory only; everything is lost when the last handle drops.
    pub fn in_memory() -> Self {
        Options {
            config: Config::default(),
        }
    }

    /// How long a key is remembered after its admission. Default 24 hours.
    /// Must be a whole multiple of the bucket width.
    pub fn window(mut self, window: Duration) -> Self {
        self.config.window_ms = duration_to_ms(window);
        self
    }

    /// Width of one time bucket, the unit in which expired keys are dropped. Default 15
    /// minutes. A key is forgotten between `window` and `window + bucket_width` after its
    /// admission.
    pub fn bucket_width(mut self, width: Duration) -> Self {
        self.config.bucket_width_ms = duration_to_ms(width);
        self
    }

    /// What survives a crash; see [`Durability`]. Default [`Durability::Sync`].
    /// Ignored by in-memory stores.
    pub fn durability(mut self, durability: Durability) -> Self {
        self.config.durability = durability;
        self
    }

    /// The time source. Default [`SystemClock`](crate::SystemClock).
    pub fn clock(mut self, clock: impl Clock) -> Self {
        self.config.clock = Arc::new(clock);
        self.config.custom_clock = true;
        self
    }

    /// Takes over records left in flight: a reserve that finds the key's record in
    /// flight under a lease granted at least `timeout` ago acquires it as a take-over (a
    /// higher epoch; the old lease is fenced from then on, durably), instead of answering
    /// `InFlight`. Off by default: a record in flight stays so until a
    /// [`Db::take_over`](crate::Db::take_over) or the end of the window.
    ///
    /// Safe only when running the operation twice is harmless downstream: the side effect
    /// is idempotent by the same key (a provider that dedups on the operation id), since
    /// the first attempt may still be running, or may have succeeded without recording
    /// it. Choose a timeout above the longest a live attempt can take.
    ///
    /// The timeout counts in whole milliseconds, rounded up (as on every store): a
    /// timeout under 1 ms is 1 ms, never 0.
    pub fn lease_timeout(mut self, timeout: Duration) -> Self {
        self.config.lease_timeout_ms = Some(duration_to_ms(timeout).max(1));
        self
    }

    /// Keeps the responses of finished records for `retention` only, a whole number of
    /// buckets no longer than the window: keys outlive responses. Once a record's
    /// response has aged out (from its reservation, to the bucket, as a key ages out of
    /// the window), a reserve of its key answers [`Reservation::Expired`](crate::Reservation::Expired)
    /// (the operation happened, there is nothing to replay, do not run it again) until
    /// the window ends, and the response's bytes leave memory. Default: the window.
    pub fn response_retention(mut self, retention: Duration) -> Self {
        self.config.response_retention_ms = Some(duration_to_ms(retention));
        self
    }

    /// Bounds the memory of the dedup keys and the idempotency records to `bytes`.
    ///
    /// Once the dedup tables reach half of what the runs' filters leave of it, every key
    /// in memory is sealed into an immutable run on disk (sorted, with fence pointers and
    /// one binary fuse filter per shard kept in memory, about 1.1 bytes a key) and the
    /// tables start empty. Once the records memory holds reach a quarter of it, every
    /// settled record (finished, its response and key in the log) is sealed into a record
    /// run the same way (about 1.5 bytes a record stay in memory); records in flight stay
    /// in memory. A lookup that misses reads nothing from disk except on a filter false
    /// positive (about 1 in 256 per run); a hit costs one page read (and, for a record,
    /// the reads of its key and response from the log, as for any finished record).
    /// Answers stay exact.
    ///
    /// A seal (and any merge of runs it makes due) runs on a thread of its own while
    /// writers go on. Writers that find the tables at the whole budget (half of it while
    /// a merge of key runs runs, which holds old and new filters together), or the
    /// records at half of it, wait for the task to move on
    /// ([`Stats::budget_waits`](crate::Stats)); [`Db::flush`](crate::Db::flush) and
    /// closing the store wait for it to end. Runs are removed (or archived, with
    /// [`archive_dir`](Self::archive_dir)) whole once their newest bucket leaves the
    /// window. Durable stores only, and not with [`max_keys`](Self::max_keys). Default:
    /// no budget (every key and record in memory).
    pub fn memory_budget(mut self, bytes: u64) -> Self {
        self.config.memory_budget_bytes = Some(bytes);
        self
    }

    /// Moves the segments of expired buckets into `dir` instead of unlinking them: an
    /// audit trail of every key and record, in the documented segment format, readable
    /// with `oncedb verify` and `oncedb inspect` (the archive holds a copy of the
    /// manifest, whose secret keys the checksums). Off by default.
    ///
    /// `dir` must be on the store's file system (each segment moves by one rename; open
    /// refuses a directory that cannot take one) and belong to this store alone (open
    /// refuses an archive of another store). The archive is never expired, compacted or
    /// read by the store: it grows until the application prunes it. `Db::open` refuses
    /// an archive directory, since opening it as a store would expire it. Durable stores
    /// only.
    pub fn archive_dir(mut self, dir: impl AsRef<Path>) -> Self {
        self.config.archive_dir = Some(dir.as_ref().to_path_buf());
        self
    }

    /// Replicates the store's log to NATS JetStream (feature `replicate`): every fsynced
    /// group is published to the replica's stream, and [`Db::restore`](crate::Db::restore)
    /// rebuilds the store from it on another node. At open the store claims the replica
    /// (a new one) or checks that its claim stands: a replica another store claimed since
    /// is refused with [`Error::NotOwner`](crate::Error::NotOwner). Sync mode needs
    /// `Durability::Sync`; async mode `Sync` or `Interval`. `docs/scaling.md` says what
    /// survives the loss of a node in each mode.
    #[cfg(feature = "replicate")]
    pub fn replicate(mut self, replication: crate::engine::Replication) -> Self {
        self.config.replication = Some(replication);
        self
    }

    /// The largest forward step of the clock the store adopts at once. A reading further
    /// ahead of the store's time (the newest bucket it has seen) is held back: it neither
    /// expires keys nor stamps new ones in a far-future bucket, it is counted in
    /// [`Stats::clock_readings_held_back`](crate::Stats) and logged, and the store's time
    /// moves again once the clock is back within the step (a restart adopts the clock
    /// as it stands). `None` adopts every reading. Default: one window on the system
    /// clock, which protects a store from a bad NTP step; no limit on a clock set with
    /// [`Options::clock`], since event time may jump by design.
    pub fn max_clock_step(mut self, step: Option<Duration>) -> Self {
        self.config.clock_step = match step {
            Some(step) => ClockStep::Limit(duration_to_ms(step)),
            None => ClockStep::Unlimited,
        };
        self
    }

    /// Number of independently locked shards, a power of two. Default: 64.
    pub fn shards(mut self, shards: usize) -> Self {
        self.config.shards = shards;
        self
    }

    /// Sizes the tables up front for about this many live keys, so they never grow
    /// while serving. Default 0 (grow as needed: a table grows one 48 KiB segment at a
    /// time, so no write waits for a whole table's rebuild; a presized table is one
    /// segment, which splits at once if it outgrows its size). At most [`MAX_EXPECTED_KEYS`](crate::MAX_EXPECTED_KEYS); a size
    /// whose tables cannot be allocated is refused by `Db::open` with
    /// [`Error::InvalidOptions`].
    pub fn expected_keys(mut self, keys: u64) -> Self {
        self.config.expected_keys = keys;
        self
    }

    /// Whether dedup tables of 2 MiB and more made at open (sized by
    /// [`expected_keys`](Self::expected_keys)) are mapped and advised for transparent huge
    /// pages (`madvise(MADV_HUGEPAGE)`, Linux only; elsewhere, or where the kernel has no
    /// transparent huge pages, they stay on the heap). Default on: a probe of a large
    /// table then needs one TLB entry per 2 MiB instead of per 4 KiB. Segments made while
    /// growing stay on the heap either way (`docs/performance.md` has the figures).
    pub fn huge_pages(mut self, on: bool) -> Self {
        self.config.huge_pages = on;
        self
    }

    /// Longest key accepted, in bytes (default 1024, at most [`MAX_KEY_BYTES_LIMIT`](crate::MAX_KEY_BYTES_LIMIT)).
    pub fn max_key_bytes(mut self, bytes: usize) -> Self {
        self.config.max_key_bytes = bytes;
        self
    }

    /// Longest stored response accepted, in bytes (default 1 MiB, at most
    /// [`MAX_RESPONSE_BYTES_LIMIT`](crate::MAX_RESPONSE_BYTES_LIMIT)).
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.config.max_response_bytes = bytes;
        self
    }

    /// Size at which a segment file is closed and the next one of its bucket is started
    /// (default 64 MiB).
    pub fn segment_max_bytes(mut self, bytes: u64) -> Self {
        self.config.segment_max_bytes = bytes;
        self
    }

    /// The file-system layer a durable store does its I/O through. Default: the real
    /// file system. Tests pass a [`crate::io::FaultyStorage`] or [`crate::io::MemStorage`].
    pub fn storage(mut self, storage: Arc<dyn Storage>) -> Self {
        self.config.storage = storage;
        self
    }

    /// Bounds memory: at most about this many live dedup keys and records together
    /// (enforced per shard, `ceil(max_keys / shards)` each). Default: unbounded.
    pub fn max_keys(mut self, keys: u64) -> Self {
        self.config.max_keys = Some(keys);
        self
    }

    /// What happens to a new key when the store is full. Default [`FullPolicy::Reject`].
    pub fn full_policy(mut self, policy: FullPolicy) -> Self {
        self.config.full_policy = policy;
        self
    }

    /// What `Db::open` does with damage in the log; see [`RecoveryMode`]. Default
    /// [`RecoveryMode::Strict`].
    pub fn recovery_mode(mut self, mode: RecoveryMode) -> Self {
        self.config.recovery_mode = mode;
        self
    }

    /// A record in flight at least this long counts as stuck in
    /// [`Stats::stuck_records`](crate::Stats). Default 5 minutes.
    pub fn stuck_after(mut self, age: Duration) -> Self {
        self.config.stuck_after_ms = duration_to_ms(age);
        self
    }

    /// Validates the options and turns them into the engine's configuration.
    pub(crate) fn to_config(&self) -> Result<Config> {
        self.config.validate()?;
        Ok(self.config.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::{MAX_EXPECTED_KEYS, MAX_RESPONSE_BYTES_LIMIT};

    fn rejects(options: Options, needle: &str) {
        match options.to_config() {
            Err(Error::InvalidOptions(why)) => assert!(why.contains(needle), "{why}"),
            other => panic!("expected InvalidOptions({needle}), got {:?}", other.err()),
        }
    }

    #[test]
    fn defaults_are_valid() {
        Options::in_memory().to_config().unwrap();
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
