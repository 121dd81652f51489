//! The database handle.

use std::path::Path;
use std::sync::Arc;

use super::options::Options;
use super::record::{Lease, Record, Reservation, Scope};
use super::stats::Stats;
use crate::base::error::Result;
use crate::base::time::ms_to_system_time;
use crate::engine::{self, Engine};
use crate::log::report::{RecoveryReport, VerifyReport};

/// An embedded store of dedup keys and idempotency records over a sliding time window.
///
/// `Db` is a cheap handle: clones share one database, and it is `Send + Sync`.
#[derive(Clone)]
pub struct Db {
    engine: Arc<Engine>,
}

impl Db {
    /// Opens (or creates) the database described by `options`.
    ///
    /// A durable store replays its live segments before this returns; see
    /// `docs/design.md` for what recovery checks and [`Db::recovery_report`] for what it
    /// found.
    pub fn open(options: Options) -> Result<Db> {
        let config = options.to_config()?;
        Ok(Db {
            engine: Arc::new(Engine::open(&config)?),
        })
    }

    /// Admits `key` if it is not already inside the window: `true` the first time
    /// (admitted), `false` for a duplicate. Atomic: of any number of concurrent callers
    /// with one key, exactly one gets `true`.
    pub fn insert_if_absent(&self, key: &[u8]) -> Result<bool> {
        self.engine.insert_if_absent(key)
    }

    /// [`insert_if_absent`](Db::insert_if_absent) for many keys at once: the answers are
    /// the ones calling it for each key in order would give. Each shard is locked once
    /// per batch, and a durable store appends one log record and pays at most one fsync.
    /// At most [`MAX_BATCH_KEYS`](crate::MAX_BATCH_KEYS) keys; on any invalid key
    /// nothing is inserted.
    pub fn insert_many<K: AsRef<[u8]>>(&self, keys: &[K]) -> Result<Vec<bool>> {
        let mut admitted = Vec::new();
        self.insert_many_into(keys, &mut admitted)?;
        Ok(admitted)
    }

    /// [`insert_many`](Db::insert_many) writing the answers into `admitted` (cleared
    /// first), so a caller can reuse one buffer across batches.
    pub fn insert_many_into<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        admitted: &mut Vec<bool>,
    ) -> Result<()> {
        self.engine.insert_many(keys, admitted)
    }

    /// Whether `key` is inside the window. Read only.
    pub fn contains(&self, key: &[u8]) -> Result<bool> {
        self.engine.contains(key)
    }

    /// Atomically reserves `key` in `scope` for the request whose canonical bytes are
    /// `request`, or reports what an earlier attempt left: see [`Reservation`].
    ///
    /// The record binds the key to a 128-bit hash of `request`: a retry with different
    /// bytes gets [`Reservation::Mismatch`], never the stored response.
    pub fn reserve(&self, scope: &Scope, key: &[u8], request: &[u8]) -> Result<Reservation> {
        self.engine.check_key(key)?;
        let scoped_key = scope.encode_key(key)?;
        Ok(match self.engine.reserve(&scoped_key, request)? {
            engine::Reservation::Acquired {
                fingerprint,
                lease_id,
                since_ms,
            } => Reservation::Acquired(Lease {
                engine: Arc::clone(&self.engine),
                fingerprint,
                lease_id,
                since_ms,
            }),
            engine::Reservation::InFlight { since_ms } => Reservation::InFlight {
                since: ms_to_system_time(since_ms),
            },
            engine::Reservation::Completed(record) => Reservation::Completed(record.into()),
            engine::Reservation::Failed(record) => Reservation::Failed(record.into()),
            engine::Reservation::Mismatch => Reservation::Mismatch,
        })
    }

    /// The record of `key` in `scope`, if one is inside the window.
    pub fn get(&self, scope: &Scope, key: &[u8]) -> Result<Option<Record>> {
        self.engine.check_key(key)?;
        let scoped_key = scope.encode_key(key)?;
        Ok(self.engine.get(&scoped_key)?.map(Record::from))
    }

    /// Durability barrier: when it returns, everything acknowledged before the call is on
    /// stable storage. A no-op for in-memory stores.
    pub fn flush(&self) -> Result<()> {
        self.engine.flush()
    }

    /// What the open of a durable store found: entries replayed, a torn tail cut, ranges
    /// skipped by [`RecoveryMode::Salvage`](crate::RecoveryMode::Salvage). `None` for
    /// in-memory stores.
    pub fn recovery_report(&self) -> Option<&RecoveryReport> {
        self.engine.recovery_report()
    }

    /// Counters and sizes; see [`Stats`].
    pub fn stats(&self) -> Stats {
        Stats::from_engine(&self.engine.stats(), self.engine.recovery_report())
    }
}

/// Checks every file of the store in `dir` without changing anything (no truncation, no
/// deletion, no lock taken from a live process: an open store gives
/// [`Error::Locked`](crate::Error::Locked)), and reports per segment what `Db::open`
/// would find. `oncedb verify --dir D` prints it.
pub fn verify(dir: impl AsRef<Path>) -> Result<VerifyReport> {
    crate::log::verify::verify_with(&crate::io::StdStorage, dir.as_ref())
}

/// [`verify`] through a given storage layer (for tests on a simulated disk).
pub fn verify_with(
    storage: &dyn crate::io::Storage,
    dir: impl AsRef<Path>,
) -> Result<VerifyReport> {
    crate::log::verify::verify_with(storage, dir.as_ref())
}
