//! Configuration values that the lower rooms act on. The public `Options` builder sets
//! them; the journal, the index and recovery read them as plain values.

use std::time::Duration;

/// How far an acknowledged write has travelled when the call returns.
///
/// Every mode makes `Db::flush` a full barrier: when it returns, everything acknowledged
/// before it is on stable storage.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    /// The record is handed to the operating system (`write(2)`) before the call returns.
    ///
    /// Survives a process crash (`kill -9`): the kernel still holds the page cache.
    /// A power loss or kernel crash may lose anything written since the last fsync
    /// (`flush`, a segment roll-over or a clean close).
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

/// What a store at its key limit (`Options::max_keys`) does with a new key: the
/// fail-closed or fail-open choice for a full deduplication store.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum FullPolicy {
    /// Fail closed: the write returns `Error::Full`; nothing is admitted and nothing
    /// already stored is lost. For payments, payouts, inventory.
    #[default]
    Reject,
    /// Fail open: the oldest bucket of the full shard is dropped early (counted in
    /// `Stats::buckets_evicted` and logged at `warn`), so duplicates older than the
    /// remaining window may be admitted again. If the current bucket alone fills the
    /// shard, the write returns `Error::Full`.
    EvictOldest,
}

/// What `Db::open` does with damage it finds in the log.
///
/// Either way a torn tail (bytes written after the last fsync that a crash cut short) is
/// cut off and reported; the modes differ only for damage to bytes that were durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum RecoveryMode {
    /// Damage to any byte that was acknowledged as durable fails the open with
    /// `Error::Corrupted { path, offset, reason }`: nothing is dropped silently.
    #[default]
    Strict,
    /// The store opens with every frame that still verifies, including those after the
    /// damage (keeping an extra key is the safe side for deduplication), and
    /// `Db::recovery_report` lists every byte range that was skipped. Damaged files are
    /// left as they are; until their bucket expires, a `Strict` open reports them again.
    Salvage,
}
