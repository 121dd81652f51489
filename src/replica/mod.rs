//! Replication of a store's log to NATS JetStream (feature `replicate`), so that a
//! store's window outlives its node: every fsynced group of the log is published to the
//! replica's stream, segment by segment, and [`restore`](crate::Db::restore) rebuilds the
//! store elsewhere from it. JetStream replicates the stream itself (R3 on a cluster of
//! three): oncedb writes no replication protocol of its own.
//!
//! - **Layout** (`docs/format.md`, "Replica"): one stream, `ONCEDB_<name>`; each segment's
//!   bytes on the subject `oncedb.<name>.seg.<bucket>.<seq>`, in chunks that carry their
//!   byte offset; the manifest on `oncedb.<name>.manifest`; the owner's token on
//!   `oncedb.<name>.owner`. A segment whose bucket leaves the window is removed from the
//!   stream (purged by subject, or deleted message by message on the servers whose
//!   purges are unsafe, `removal.rs`), so the stream holds the live window and nothing
//!   older.
//! - **Modes**: [`ReplicaMode::Sync`] acknowledges a write only once JetStream
//!   acknowledged the group that holds it (the group commit covers the round trip, as it
//!   covers the fsync); [`ReplicaMode::Async`] ships behind the local commit and refuses
//!   writes while more than `max_lag_bytes` wait to be shipped.
//! - **One owner**: every publish carries the stream's expected last sequence, so once
//!   another store restored the replica and claimed it (its owner message moved the
//!   sequence on), the old owner's next publish is refused and its store refuses every
//!   write with [`Error::NotOwner`](crate::Error::NotOwner). A store remembers its claim
//!   in the file `REPLICA` of its directory, and reopening checks it against the stream.
//!
//! The shipper runs on a thread of its own with a tokio runtime of its own; the engine and
//! the synchronous API never await anything.

mod held;
mod layout;
mod owner;
mod removal;
mod restore;
mod runs;
mod shipper;

use std::time::Duration;

pub(crate) use restore::{Follower, fetch};
pub use restore::{RestoreReport, StandbyLag};
pub(crate) use shipper::Shipper;

use crate::base::{Error, Result};
use crate::wal::ReplicaGate;

/// When a write counts as replicated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaMode {
    /// A write is acknowledged once it is fsynced locally and JetStream acknowledged it
    /// (needs `Durability::Sync`). While JetStream cannot be reached, writes are answered
    /// `Error::Unavailable` after the acknowledgement timeout (their outcome unknown, as
    /// over any network: they are in the local log and shipped once JetStream is back).
    Sync,
    /// A write is acknowledged after the local commit; the log is shipped behind it. At a
    /// node's loss, what was not yet shipped is lost: at most `max_lag_bytes` of log.
    /// Writes are refused with `Error::Unavailable` while more than that waits.
    Async,
}

/// Where and how a store replicates its log: `Options::replicate`.
#[derive(Clone)]
pub struct Replication {
    pub(crate) url: String,
    pub(crate) name: String,
    pub(crate) mode: ReplicaMode,
    pub(crate) replicas: usize,
    pub(crate) max_lag_bytes: u64,
    pub(crate) ack_timeout: Duration,
}

/// Everything but the URL, which may carry credentials.
impl std::fmt::Debug for Replication {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Replication")
            .field("name", &self.name)
            .field("mode", &self.mode)
            .field("replicas", &self.replicas)
            .field("max_lag_bytes", &self.max_lag_bytes)
            .field("ack_timeout", &self.ack_timeout)
            .finish_non_exhaustive()
    }
}

/// Stream replicas JetStream keeps unless told otherwise: a node lost with its disk
/// leaves two copies.
pub const DEFAULT_REPLICAS: usize = 3;

/// Longest replica name.
const MAX_NAME_BYTES: usize = 64;

impl Replication {
    /// The replica `name` (ASCII letters, digits, `-` and `_`; at most 64 bytes) on the
    /// NATS servers at `url` (`nats://host:port`, several separated by commas): sync
    /// mode, three stream replicas (a cluster of three nodes or more; a single server
    /// needs [`Replication::replicas`]`(1)`), 64 MiB of lag allowed in async mode, 5 s
    /// to wait for an acknowledgement.
    pub fn new(url: impl Into<String>, name: impl Into<String>) -> Replication {
        Replication {
            url: url.into(),
            name: name.into(),
            mode: ReplicaMode::Sync,
            replicas: DEFAULT_REPLICAS,
            max_lag_bytes: 64 << 20,
            ack_timeout: Duration::from_secs(5),
        }
    }

    /// When a write counts as replicated. Default [`ReplicaMode::Sync`].
    pub fn mode(mut self, mode: ReplicaMode) -> Self {
        self.mode = mode;
        self
    }

    /// How many copies JetStream keeps of the stream (its `num_replicas`, 1 to 5). Used
    /// when the stream is created; an existing stream that keeps another number is
    /// refused, with both named. Default 3: the window outlives the loss of one node
    /// with its disk. On a cluster with fewer nodes than copies, opening the store
    /// fails with `InvalidOptions` naming this setting.
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas;
        self
    }

    /// In async mode, the most log bytes that may wait to be shipped before writes are
    /// refused. Default 64 MiB.
    pub fn max_lag_bytes(mut self, bytes: u64) -> Self {
        self.max_lag_bytes = bytes;
        self
    }

    /// In sync mode, how long a write waits for JetStream's acknowledgement before it is
    /// answered `Error::Unavailable`. Default 5 s.
    pub fn ack_timeout(mut self, timeout: Duration) -> Self {
        self.ack_timeout = timeout;
        self
    }

    /// The replica's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Refuses a name JetStream subjects and stream names cannot carry, and replica
    /// counts JetStream refuses.
    pub(crate) fn check(&self) -> Result<()> {
        let valid = !self.name.is_empty()
            && self.name.len() <= MAX_NAME_BYTES
            && self
                .name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
        if !valid {
            return Err(Error::InvalidOptions(format!(
                "replica name {:?}: 1 to {MAX_NAME_BYTES} ASCII letters, digits, '-' or '_'",
                self.name
            )));
        }
        if !(1..=5).contains(&self.replicas) {
            return Err(Error::InvalidOptions(format!(
                "{} stream replicas: JetStream keeps 1 to 5",
                self.replicas
            )));
        }
        Ok(())
    }

    /// How the replica gates the journal's writers.
    pub(crate) fn gate(&self) -> ReplicaGate {
        ReplicaGate {
            name: self.name.as_str().into(),
            sync: self.mode == ReplicaMode::Sync,
            max_lag_bytes: self.max_lag_bytes,
            ack_timeout: self.ack_timeout,
        }
    }
}

/// A client of the servers `replication` names (one URL, or several separated by
/// commas: the client reaches whichever is up).
pub(crate) async fn connect(replication: &Replication) -> Result<async_nats::Client> {
    let servers = replication
        .url
        .split(',')
        .map(|url| url.trim().parse::<async_nats::ServerAddr>())
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|err| Error::InvalidOptions(format!("bad NATS server URL: {err}")))?;
    async_nats::ConnectOptions::new()
        .connection_timeout(replication.ack_timeout)
        .connect(servers)
        .await
        .map_err(unavailable)
}

/// A JetStream failure as an oncedb error: the replica cannot be reached.
pub(crate) fn unavailable(err: impl std::fmt::Display) -> Error {
    Error::Unavailable {
        engine: "jetstream",
        message: err.to_string(),
    }
}
