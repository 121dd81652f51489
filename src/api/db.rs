//! The database handle.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use super::observe;
use super::options::Options;
use super::record::{InFlight, Lease, Reservation, Scope};
use super::stats::Stats;
use crate::base::{Advance, Record, RecordStatus, Result, duration_to_ms, ms_to_system_time};
use crate::engine::{Engine, Grant, RecoveryReport, Reserved, VerifyReport};

/// An embedded store of dedup keys and idempotency records over a sliding time window.
///
/// `Db` is a cheap handle: clones share one database, and it is `Send + Sync`.
#[derive(Clone)]
pub struct Db {
    pub(super) engine: Arc<Engine>,
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
        let admitted = self.engine.insert_if_absent(key)?;
        observe::keys(&[admitted]);
        Ok(admitted)
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
        self.engine.insert_many(keys, admitted)?;
        observe::keys(admitted);
        Ok(())
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
        let reserved = with_scoped_key(scope, key, |scoped| self.engine.reserve(scoped, request))?;
        Ok(self.reservation(scope, key, reserved))
    }

    /// What the engine's answer to a reserve means to the caller (observed).
    pub(crate) fn reservation(&self, scope: &Scope, key: &[u8], reserved: Reserved) -> Reservation {
        let answer = match reserved {
            Reserved::Acquired(grant) => Reservation::Acquired(self.lease(scope, key, grant)),
            Reserved::TakenOver { grant, .. } => {
                observe::take_over(scope, key, grant.lease_id);
                Reservation::Acquired(self.lease(scope, key, grant))
            }
            Reserved::InFlight { since_ms, note } => Reservation::InFlight {
                since: ms_to_system_time(since_ms),
                note: note.map(|note| note.to_vec()),
            },
            // Existing records are finished; one without its response aged out.
            Reserved::Existing(record) if record.response.is_none() => Reservation::Expired(record),
            Reserved::Existing(record) => match record.status {
                RecordStatus::Failed => Reservation::Failed(record),
                _ => Reservation::Completed(record),
            },
            Reserved::Mismatch { .. } => Reservation::Mismatch,
        };
        observe::reservation(scope, key, &answer);
        answer
    }

    /// The record of `key` in `scope`, if one is inside the window.
    pub fn get(&self, scope: &Scope, key: &[u8]) -> Result<Option<Record>> {
        self.engine.check_key(key)?;
        let record = with_scoped_key(scope, key, |scoped| self.engine.get(scoped))?;
        Ok(record)
    }

    /// Records in flight for at least `older_than` (by the database clock): stuck
    /// records whose outcome is unknown, for a reconciliation worker. Each shard is
    /// locked only while its own records are copied.
    pub fn in_flight(&self, older_than: std::time::Duration) -> Vec<InFlight> {
        self.engine
            .in_flight(duration_to_ms(older_than))
            .into_iter()
            .filter_map(|record| {
                let (scope, key) = Scope::decode_key(&record.scoped_key)?;
                Some(InFlight {
                    scope,
                    key: key.to_vec(),
                    since: ms_to_system_time(record.since_ms),
                    epoch: record.lease_id,
                    note: record.note.map(|note| note.to_vec()),
                })
            })
            .collect()
    }

    /// Takes over the record of `key` in `scope` if it is in flight: a new lease with a
    /// higher fencing epoch. From then on the old lease's `complete`, `fail`, `release`
    /// and `note` return [`Error::Fenced`](crate::Error::Fenced) and change nothing; the
    /// new lease finishes the record as usual. The take-over is logged like a reserve,
    /// so fencing holds across a reopen and a crash. `None` if the record is not in
    /// flight (absent, completed or failed). Of concurrent take-overs, each gets a
    /// lease, and only the last one's epoch holds the record.
    pub fn take_over(&self, scope: &Scope, key: &[u8]) -> Result<Option<Lease>> {
        self.engine.check_key(key)?;
        let taken = with_scoped_key(scope, key, |scoped| self.engine.take_over(scoped))?;
        Ok(self.taken_over(scope, key, taken))
    }

    /// The lease a take-over granted, if any, observed.
    pub(super) fn taken_over(
        &self,
        scope: &Scope,
        key: &[u8],
        taken: Option<Grant>,
    ) -> Option<Lease> {
        taken.map(|taken| {
            observe::take_over(scope, key, taken.lease_id);
            self.lease(scope, key, taken)
        })
    }

    /// The lease of epoch `epoch` on the record of `key` in `scope`, for a worker that
    /// restarted and kept its epoch ([`Lease::epoch`]). `Error::Fenced` if the record was
    /// taken over since, `Error::LeaseLost` if it is no longer in flight.
    pub fn resume(&self, scope: &Scope, key: &[u8], epoch: u64) -> Result<Lease> {
        self.engine.check_key(key)?;
        let taken = with_scoped_key(scope, key, |scoped| self.engine.resume(scoped, epoch))?;
        Ok(self.lease(scope, key, taken))
    }

    pub(super) fn lease(&self, scope: &Scope, key: &[u8], taken: Grant) -> Lease {
        Lease {
            engine: Arc::clone(&self.engine),
            scope: scope.clone(),
            key_hash: observe::key_hash_of(key),
            fingerprint: taken.fingerprint,
            lease_id: taken.lease_id,
            since_ms: taken.since_ms,
        }
    }

    /// The ordering guard: keeps a version high-water mark per aggregate (`aggregate_id`
    /// in `scope`) inside the window and says what to do with an event of `version`;
    /// see [`Advance`]. Atomic under races like every other call and durable like keys.
    /// An aggregate without a live mark accepts any version as its first.
    pub fn advance(&self, scope: &Scope, aggregate_id: &[u8], version: u64) -> Result<Advance> {
        self.engine.check_key(aggregate_id)?;
        let answer = with_scoped_key(scope, aggregate_id, |scoped| {
            self.engine.advance(scoped, version)
        })?;
        observe::version(scope, answer);
        Ok(answer)
    }

    /// The time buckets that hold live entries or segment files, oldest first: what
    /// `oncedb inspect` shows. Each shard is locked only while its counts are read.
    pub fn buckets(&self) -> Vec<BucketInfo> {
        let window = self.engine.window();
        self.engine
            .buckets()
            .into_iter()
            .map(|(bucket, [keys, records, aggregates], bytes)| BucketInfo {
                start: ms_to_system_time(bucket.saturating_mul(window.width_ms)),
                end: ms_to_system_time(bucket.saturating_add(1).saturating_mul(window.width_ms)),
                expires: ms_to_system_time(
                    bucket
                        .saturating_add(window.span + 1)
                        .saturating_mul(window.width_ms),
                ),
                keys,
                records,
                aggregates,
                bytes,
            })
            .collect()
    }

    /// Durability barrier: when it returns, everything acknowledged before the call is on
    /// stable storage, the segment worker has finished the work asked of it so far
    /// (expired segments unlinked, the next segments prepared), and so has the seal
    /// under way with a memory budget (its run published, the tables it sealed freed;
    /// its error, if it failed, is this call's). A no-op for in-memory stores.
    pub fn flush(&self) -> Result<()> {
        self.engine.flush()
    }

    /// Copies the store into `dir` (created if missing; it must hold no file) while
    /// writers go on, and returns the log position the copy covers. Opening the copy
    /// gives every write acknowledged before the call (and every write appended before
    /// it, whatever the durability), none after the position, and the lease floor.
    ///
    /// Sealed segments and sealed runs are immutable: they are hard-linked into `dir`
    /// where the file system allows (the copy then shares their bytes with the store,
    /// and takes no room of its own until the store deletes them), and copied and
    /// fsynced otherwise (another file system). The active segment is copied up to the
    /// end of its last fsynced group (the call first commits everything appended, as
    /// [`flush`](Self::flush) does), and the manifest last: a copy interrupted part-way
    /// has no manifest, and opening it is refused as
    /// [`Error::Corrupted`](crate::Error::Corrupted) once it holds a segment, never a
    /// silently smaller window. `dir` (and its entry in its parent) is fsynced before the
    /// call returns.
    ///
    /// Writers are held only while the log is listed and committed; the copying runs
    /// beside them. Refused with [`Error::InvalidOptions`](crate::Error::InvalidOptions)
    /// for an in-memory store or a `dir` holding files; I/O errors in `dir` are returned
    /// and leave the store as it was.
    pub fn checkpoint(
        &self,
        dir: impl AsRef<std::path::Path>,
    ) -> Result<crate::engine::Checkpoint> {
        self.engine.checkpoint(dir.as_ref())
    }

    /// Rebuilds a store from its replica on this node (feature `replicate`): fetches the
    /// replica named by `options`' [`replicate`](crate::Options::replicate) into
    /// `options`' directory (new, empty, or left by an interrupted restore), then opens it, which
    /// verifies every frame's checksum as any open does, and claims the replica: from
    /// then on the store that shipped it is refused every write
    /// ([`Error::NotOwner`](crate::Error::NotOwner)). Only the live window is fetched:
    /// segments whose bucket left the window are skipped. The window and bucket width
    /// are the replica's (its manifest's), whatever `options` say; every other option
    /// is `options`'. A restore interrupted part-way leaves segment files and no
    /// manifest (it is written last), which nothing opens as a store: run it again on
    /// the same directory, and it completes them. `progress` is called with the
    /// messages read so far and the stream's total.
    #[cfg(feature = "replicate")]
    pub fn restore(
        options: Options,
        progress: &mut (dyn FnMut(u64, u64) + Send),
    ) -> Result<(Db, crate::engine::RestoreReport)> {
        let config = options.to_config()?;
        let (engine, report) = Engine::restore(config, progress)?;
        Ok((
            Db {
                engine: Arc::new(engine),
            },
            report,
        ))
    }

    /// Starts a standby of the replica named by `options`'
    /// [`replicate`](crate::Options::replicate) in `options`' directory (new, empty, or a
    /// standby's from an earlier run): a thread of its own applies the replica's chunks
    /// to the segment files as they arrive, so that [`Standby::promote`] has little
    /// left to copy. The standby writes no manifest and claims nothing until promoted.
    #[cfg(feature = "replicate")]
    pub fn standby(options: Options) -> Result<Standby> {
        let config = options.to_config()?;
        let follower = Engine::standby(&config)?;
        Ok(Standby { follower, config })
    }

    /// What the open of a durable store found: entries replayed, a torn tail cut, ranges
    /// skipped by [`RecoveryMode::Salvage`](crate::RecoveryMode::Salvage). `None` for
    /// in-memory stores.
    pub fn recovery_report(&self) -> Option<&RecoveryReport> {
        self.engine.recovery_report()
    }

    /// How long a key is remembered: the setting of [`Options::window`] the store was
    /// opened (or created, for a reopened durable store) with.
    pub fn window(&self) -> Duration {
        let window = self.engine.window();
        Duration::from_millis(window.span * window.width_ms)
    }

    /// The width of one time bucket: [`Options::bucket_width`].
    pub fn bucket_width(&self) -> Duration {
        Duration::from_millis(self.engine.window().width_ms)
    }

    /// The largest response a lease stores: [`Options::max_response_bytes`].
    pub fn max_response_bytes(&self) -> usize {
        self.engine.max_response_bytes()
    }

    /// The lease timeout after which a record in flight is taken over:
    /// [`Options::lease_timeout`]; `None` if it never is.
    pub fn lease_timeout(&self) -> Option<Duration> {
        self.engine.lease_timeout()
    }

    /// Whether the store keeps files (and so its writes may wait for an fsync).
    pub fn is_durable(&self) -> bool {
        self.engine.is_durable()
    }

    /// Counters and sizes; see [`Stats`].
    pub fn stats(&self) -> Stats {
        let stats = Stats::from_engine(&self.engine.stats(), self.engine.recovery_report());
        observe::gauges(&stats);
        stats
    }
}

/// One time bucket of a store, as [`Db::buckets`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct BucketInfo {
    /// When the bucket begins.
    pub start: std::time::SystemTime,
    /// When the next bucket begins.
    pub end: std::time::SystemTime,
    /// When everything admitted in this bucket is forgotten (the bucket leaves the
    /// window and its segment files are deleted).
    pub expires: std::time::SystemTime,
    /// Live dedup keys admitted in the bucket.
    pub keys: u64,
    /// Live records reserved in the bucket.
    pub records: u64,
    /// Ordering-guard aggregates last advanced in the bucket.
    pub aggregates: u64,
    /// Bytes of the bucket's segment files.
    pub bytes: u64,
}

/// Checks every file of the store in `dir` without changing anything (no truncation, no
/// deletion, no lock taken from a live process: an open store gives
/// [`Error::Locked`](crate::Error::Locked)), and reports per segment what `Db::open`
/// would find. `oncedb verify --dir D` prints it.
pub fn verify(dir: impl AsRef<Path>) -> Result<VerifyReport> {
    crate::engine::verify_with(&crate::engine::StdStorage, dir.as_ref())
}

/// Whether `dir` is an archive of expired segments ([`Options::archive_dir`]) rather
/// than a store: [`verify`] reads both, `Db::open` refuses an archive.
pub fn is_archive(dir: impl AsRef<Path>) -> Result<bool> {
    crate::engine::is_archive(&crate::engine::StdStorage, dir.as_ref())
}

/// [`verify`] through a given storage layer (for tests on a simulated disk).
pub fn verify_with(
    storage: &dyn crate::engine::Storage,
    dir: impl AsRef<Path>,
) -> Result<VerifyReport> {
    crate::engine::verify_with(storage, dir.as_ref())
}

thread_local! {
    /// Where the calling thread encodes scoped keys, kept for its capacity: a record call
    /// allocates only what it stores.
    static SCOPED_KEY: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Runs `f` with `key` encoded in `scope` ([`Scope::encode_key`]) in this thread's buffer.
/// The buffer is taken out for the call, so a nested call would get a fresh one.
pub(crate) fn with_scoped_key<T>(
    scope: &Scope,
    key: &[u8],
    f: impl FnOnce(&[u8]) -> Result<T>,
) -> Result<T> {
    /// A buffer grown past this by a long key is not kept.
    const KEEP_BYTES: usize = 4096;
    let mut buffer = SCOPED_KEY.take();
    let answer = scope
        .encode_key_into(key, &mut buffer)
        .and_then(|()| f(&buffer));
    if buffer.capacity() <= KEEP_BYTES {
        SCOPED_KEY.set(buffer);
    }
    answer
}

/// A warm copy of a replica kept in a directory ([`Db::standby`]); dropping it stops
/// the copying and leaves the directory as it is (a later standby resumes from it).
#[cfg(feature = "replicate")]
pub struct Standby {
    follower: crate::engine::Follower,
    config: crate::engine::Config,
}

#[cfg(feature = "replicate")]
impl Standby {
    /// How far behind the replica the standby is; `Error::Unavailable` while it is not
    /// following (it lost the replica: it follows again by itself once it can; or it
    /// stopped for good on a damaged chunk), saying why. Sets the gauges
    /// `oncedb_standby_pending_messages` and `oncedb_standby_following` (feature
    /// `metrics`).
    pub fn lag(&self) -> Result<crate::engine::StandbyLag> {
        let lag = self.follower.lag();
        super::observe::standby(&lag);
        lag
    }

    /// Promotes the standby: stops following, copies only what it still lacks (from the
    /// stream sequence it reached), writes the manifest, and opens the store, which
    /// checks every frame and claims the replica (the old owner is refused its next
    /// write). The window and bucket width are the replica's.
    pub fn promote(self) -> Result<(Db, crate::engine::RestoreReport)> {
        let (engine, report) = Engine::promote(self.config, self.follower)?;
        Ok((
            Db {
                engine: Arc::new(engine),
            },
            report,
        ))
    }
}

#[cfg(feature = "replicate")]
impl std::fmt::Debug for Standby {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Standby")
            .field("lag", &self.lag())
            .finish_non_exhaustive()
    }
}
