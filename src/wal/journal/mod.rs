//! The journal writer: appends log entries to the active segment with group commit and
//! rolls segments over per bucket and size. A worker thread ([`worker`]) prepares the
//! next segments ahead of need and deletes the segments of expired buckets, so neither
//! runs on a writer's path.
//!
//! Every group of frames written at once starts with a durability mark: a frame saying
//! how many bytes of the segment the last completed fsync covered when the group was
//! written. Recovery uses the marks to tell a torn tail (bytes no fsync ever covered)
//! from damage to acknowledged bytes (see `docs/design.md`).

pub(crate) use gate::ReplicaGate;
#[cfg(feature = "replicate")]
pub(crate) use shipping::{FeedSnapshot, LogFeed};
use std::any::Any;
#[cfg(feature = "async")]
mod commit;
mod gate;
mod readers;
#[cfg(feature = "replicate")]
mod shipping;
mod worker;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;
use std::time::Instant;

use parking_lot::{Condvar, Mutex, MutexGuard};

use super::entry::{LogEntry, encode_mark};
use super::format::{MARK_FRAME_LEN, MAX_APPEND_BYTES, SEGMENT_HEADER_LEN, SegmentHeader, put};
use super::manifest::Manifest;
use super::names::{prepared_path, segment_path};
use super::response::FrameSource;
use crate::base::{Durability, Error, Fingerprint, LogSpan, Result, Window};
use crate::io::{Storage, StorageFile};

/// In `Interval` mode, a writer that finds this much buffered writes it out itself.
const INTERVAL_BUFFER_BYTES: usize = 1 << 20;

/// What recovery hands to the writer.
pub(crate) struct JournalConfig {
    pub(crate) storage: Arc<dyn Storage>,
    pub(crate) dir: PathBuf,
    /// Where expired segments go instead of being unlinked.
    pub(crate) archive: Option<PathBuf>,
    pub(crate) durability: Durability,
    pub(crate) window: Window,
    /// The manifest as recovery found or wrote it; the journal rewrites it to raise the
    /// lease floor.
    pub(crate) manifest: Manifest,
    pub(crate) frame_seed: u64,
    pub(crate) segment_max_bytes: u64,
    /// Segments on disk after recovery, as (bucket, seq) → length in bytes.
    pub(crate) segments: BTreeMap<(u64, u32), u64>,
    pub(crate) lock: Box<dyn Any + Send + Sync>,
    pub(crate) segments_deleted: u64,
    /// The newest segment, if it holds only its header: appends continue in it.
    /// Otherwise, if any segment exists, the journal starts a new one at once, so that
    /// every segment but the newest ends with a seal.
    pub(crate) adopt: Option<(u64, u32)>,
    /// The bucket a segment started at open is named after.
    pub(crate) bucket: u64,
    /// New segments are named after this one (a sealed run's position lies in it), even
    /// if it is not on disk: appends never land at a position a run covers.
    pub(crate) names_after: Option<(u64, u32)>,
    /// A replica whose acknowledgements gate writers, if the store replicates.
    pub(crate) replica: Option<ReplicaGate>,
}

/// The log as a checkpoint copies it ([`Journal::checkpoint_view`]).
pub(crate) struct LogView {
    /// Sealed segments, oldest first: immutable, to be linked or copied whole.
    pub(crate) sealed: Vec<PathBuf>,
    /// The active segment and the length to copy: the end of its last fsynced group.
    pub(crate) active: Option<(PathBuf, u64)>,
    pub(crate) manifest: Manifest,
    /// The end of what the copy holds.
    pub(crate) position: super::LogPosition,
}

/// Counters of the writer since open.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct JournalStats {
    pub(crate) fsyncs: u64,
    /// Times a caller slept until a group commit covered its entries.
    pub(crate) commit_waits: u64,
    /// Sleepers the end of a group commit woke.
    pub(crate) commit_wakeups: u64,
    pub(crate) log_records: u64,
    pub(crate) log_bytes: u64,
    pub(crate) segments_deleted: u64,
    /// Bytes fsynced and not yet acknowledged by the replica (0 without one).
    pub(crate) replica_lag_bytes: u64,
    /// Bytes of all segment files.
    pub(crate) segment_bytes: u64,
    /// Segment files.
    pub(crate) segment_count: u64,
    /// fsync latencies: `fsync_micros[i]` counts syncs that took less than `2^i` µs
    /// (and at least `2^(i-1)`).
    pub(crate) fsync_micros: [u64; FSYNC_BUCKETS],
}

/// Buckets of the fsync latency histogram: powers of two up to about 35 minutes.
pub(crate) const FSYNC_BUCKETS: usize = 32;

/// A histogram of fsync latencies in power-of-two microsecond buckets; lock-free.
struct SyncTimes([AtomicU64; FSYNC_BUCKETS]);

impl SyncTimes {
    fn new() -> Self {
        SyncTimes(std::array::from_fn(|_| AtomicU64::new(0)))
    }

    /// Runs `sync`, counting it and its duration.
    fn time<T>(&self, fsyncs: &AtomicU64, sync: impl FnOnce() -> T) -> T {
        let started = Instant::now();
        let result = sync();
        let elapsed = started.elapsed();
        #[cfg(feature = "metrics")]
        metrics::histogram!("oncedb_fsync_seconds").record(elapsed.as_secs_f64());
        let micros = u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX);
        let bucket = (u64::BITS - micros.leading_zeros()) as usize;
        if let Some(count) = self.0.get(bucket.min(FSYNC_BUCKETS - 1)) {
            count.fetch_add(1, Ordering::Relaxed);
        }
        fsyncs.fetch_add(1, Ordering::Relaxed);
        result
    }

    fn snapshot(&self) -> [u64; FSYNC_BUCKETS] {
        std::array::from_fn(|i| self.0.get(i).map_or(0, |c| c.load(Ordering::Relaxed)))
    }
}

/// The name of the segment after `newest` for entries of `bucket`: sequence 0 of
/// `bucket` if it is newer, else the next sequence of the newest bucket, or sequence 0 of
/// the bucket after it once the sequence numbers run out (a segment's bucket only needs
/// to be at least its entries' stamps; it decides when the file is deleted). `None` only
/// past the last bucket number.
pub(crate) fn next_segment(newest: Option<(u64, u32)>, bucket: u64) -> Option<(u64, u32)> {
    match newest {
        Some((last, seq)) if last >= bucket => match seq.checked_add(1) {
            Some(seq) => Some((last, seq)),
            None => Some((last.checked_add(1)?, 0)),
        },
        _ => Some((bucket, 0)),
    }
}

/// A segment offset as a frame header stores it: segments stay below 4 GiB.
fn segment_offset(offset: u64) -> u32 {
    const _: () = assert!(super::format::MAX_SEGMENT_FILE_BYTES <= u32::MAX as u64);
    u32::try_from(offset).unwrap_or(u32::MAX)
}

/// A position in the log to wait for: everything appended up to it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[must_use = "an appended entry is acknowledged only after waiting for its ticket"]
pub(crate) struct Ticket(u64);

impl Ticket {
    /// The log position it stands for (bytes appended since open).
    pub(crate) fn position(self) -> u64 {
        self.0
    }

    /// The ticket of log position `position`, as [`Ticket::position`] gave it.
    pub(crate) fn at(position: u64) -> Ticket {
        Ticket(position)
    }
}

struct Active {
    bucket: u64,
    seq: u32,
    /// Taken by the group-commit leader while it writes outside the lock.
    file: Option<Box<dyn StorageFile>>,
    /// Segment offset past everything appended: written, being written, or buffered.
    appended_len: u64,
    /// Segment offset the last completed fsync covered.
    synced_len: u64,
    /// Segment offset of the mark opening the buffered group, which the leader fills in
    /// when it writes the group.
    group_mark: Option<u64>,
    /// Whether the segment's directory entry is durable. A prepared segment renamed into
    /// the log is not until a directory fsync; every fsync of the segment's data (a group
    /// commit, a seal) is followed by one while this is false, so a synced byte never
    /// depends on a directory entry that a power loss could undo.
    entry_durable: bool,
    /// Whether the worker was asked to prepare the segment a size roll-over takes: once
    /// the segment is half full (a bucket roll-over's is prepared at once).
    size_successor_asked: bool,
}

impl Active {
    /// A segment holding only its header, fsynced, to append to.
    fn empty(bucket: u64, seq: u32, file: Box<dyn StorageFile>, entry_durable: bool) -> Active {
        let header_len = SEGMENT_HEADER_LEN as u64;
        Active {
            bucket,
            seq,
            file: Some(file),
            appended_len: header_len,
            synced_len: header_len,
            group_mark: None,
            entry_durable,
            size_successor_asked: false,
        }
    }
}

/// The group-gathering policy of `Sync` commits. In a closed loop (each caller appends
/// again once its write is acknowledged), the callers a group covers come back while the
/// next group is already being synced, so groups alternate between two halves of the
/// callers. The first leader after a group waits for them instead, at most a quarter of the
/// last fsync's time, and skips the wait once after a wait that timed out (callers that
/// did not come back), so an open workload pays at most that every other group.
#[derive(Debug, Default)]
struct Gather {
    /// Appends in the buffer since a leader last took it.
    buffered: u64,
    /// Callers the last `Sync` group covered, until a leader gathers for them.
    returning: u64,
    /// How long the last `Sync` group's write and fsync took.
    last_sync: Duration,
    /// While a leader gathers: the appends it waits for.
    wanted: u64,
    /// Whether the last gathering timed out short of its callers.
    missed: bool,
}

impl Gather {
    /// Counts an append; wakes a gathering leader once its callers are in.
    fn appended(&mut self, gathered: &Condvar) {
        self.buffered += 1;
        if self.wanted != 0 && self.buffered == self.wanted {
            gathered.notify_one();
        }
    }

    /// A `Sync` group of `callers` appends finished after `took`.
    fn synced(&mut self, callers: u64, took: Duration) {
        self.returning = callers;
        self.last_sync = took;
    }

    /// The appends to wait for and how long, if a wait is due.
    fn plan(&mut self) -> Option<(u64, Duration)> {
        let returning = std::mem::take(&mut self.returning);
        if std::mem::take(&mut self.missed) || returning <= 1 {
            return None;
        }
        Some((self.buffered + returning, self.last_sync / 4))
    }
}

struct WriterState {
    buffer: Vec<u8>,
    /// The other half of a double buffer: a leader writes one while appenders fill the
    /// other, so in steady state a commit allocates nothing.
    spare: Vec<u8>,
    /// Where a leader encodes the group's mark (kept for its capacity).
    mark: Vec<u8>,
    /// Log positions (bytes since open): appended to the buffer, written, synced.
    appended: u64,
    written: u64,
    synced: u64,
    /// Log position the replica acknowledged (see [`feed`]).
    shipped: u64,
    leader: bool,
    /// Group commits started so far; while `leader` is set, the number of the one being
    /// written, which covers the log up to `group_end` (synced if `group_syncs`).
    group: u64,
    group_end: u64,
    group_syncs: bool,
    /// Callers in the buffer and callers coming back: the next `Sync` group waits a
    /// little for the latter (see [`Gather`]).
    gather: Gather,
    active: Option<Active>,
    /// Every segment on disk, as (bucket, seq) → length in bytes.
    segments: BTreeMap<(u64, u32), u64>,
    /// Segments the worker prepared ahead of need, by the name they take in the log:
    /// header written and fsynced, file still under its prepared name.
    prepared: BTreeMap<(u64, u32), Box<dyn StorageFile>>,
    /// Rounds of background work asked for (one per roll-over) and finished; the worker
    /// runs while `work_done < work_requested`.
    work_requested: u64,
    work_done: u64,
    /// Asynchronous callers waiting on a commit (see [`commit::Commit`]).
    #[cfg(feature = "async")]
    commits: Vec<commit::PendingCommit>,
}

struct Shared {
    state: Mutex<WriterState>,
    changed: Condvar,
    /// Wakes a leader gathering its group once the callers it waits for appended.
    gathered: Condvar,
    /// Waiters on a group commit, by the parity of the group's number: those the group
    /// being written covers wait on its slot, the others on the next group's. A leader
    /// that is done wakes its own slot's waiters and one of the next slot's, who leads
    /// the next group; no waiter is woken only to wait again.
    group_done: [Condvar; 2],
    /// Wakes the interval flusher for shutdown.
    flusher_wake: Condvar,
    /// Wakes the committer thread: a commit is pending, or shutdown.
    #[cfg(feature = "async")]
    commit_wanted: Condvar,
    /// Ids of [`commit::Commit`]s, to find a pending one's waker.
    #[cfg(feature = "async")]
    next_commit: AtomicU64,
    /// Wakes the segment worker for a round of work or for shutdown.
    worker_wake: Condvar,
    poisoned: AtomicBool,
    shutdown: AtomicBool,
    /// The replica gating writers, if any, and what it reported.
    replica: Option<ReplicaGate>,
    /// Wakes writers waiting for the replica's acknowledgement.
    shipped_changed: Condvar,
    /// Why the replica could not be reached, while it cannot.
    replica_down: Mutex<Option<String>>,
    /// An async replica lags by more than it may: writes are refused.
    lagging: AtomicBool,
    /// Another store took the replica over: writes are refused for good.
    not_owner: AtomicBool,
    /// The sealed runs on the replica, as its shipper last saw them.
    runs_shipped: Mutex<RunsOnReplica>,
    /// `WriterState::written`, readable without the lock.
    written_to: AtomicU64,
    /// [`Shared::acknowledged`], readable without the lock: how far the log is as
    /// durable as `Sync` acknowledges.
    acknowledged_to: AtomicU64,
    /// Bytes of the log from before this open that the replica lacks, until a round of
    /// shipping covers them: part of the lag.
    backlog: AtomicU64,
    storage: Arc<dyn Storage>,
    dir: PathBuf,
    archive: Option<PathBuf>,
    durability: Durability,
    window: Window,
    database_id: u64,
    names_after: Option<(u64, u32)>,
    /// The manifest on disk; its lock serializes floor raises.
    manifest: Mutex<Manifest>,
    seed: u64,
    segment_max_bytes: u64,
    fsyncs: AtomicU64,
    commit_waits: AtomicU64,
    commit_wakeups: AtomicU64,
    records: AtomicU64,
    bytes: AtomicU64,
    segments_deleted: AtomicU64,
    sync_times: SyncTimes,
    /// Segment files kept open for replays.
    readers: readers::SegmentReaders,
}

/// The sealed runs as the shipper last saw them on the replica.
#[derive(Debug, Clone, Default)]
pub(crate) struct RunsOnReplica {
    /// The runs the replica holds whole, by id.
    pub(crate) whole: Vec<u64>,
    /// Runs held back because the log their cover names is not on the replica yet (a
    /// restore would refuse a run whose cover the log it fetched does not reach): under
    /// `Interval`, until the fsync that ships that log.
    pub(crate) awaiting_log: u64,
}

/// The journal as a thread outside it (the one sealing runs) uses it: to fsync the log
/// before a run that rests on it is published, and to fail the store closed, as
/// [`Journal::fail`] does.
pub(crate) struct SealHandle(Arc<Shared>);

impl SealHandle {
    /// Writes and fsyncs everything appended so far (a group commit), whatever the
    /// durability mode: a run sealed now names log positions (its cover, its records'
    /// response frames) that must survive a power loss before the run does.
    pub(crate) fn sync_appended(&self) -> Result<()> {
        let shared = &*self.0;
        let mut state = shared.state.lock();
        let target = state.appended;
        shared.persist(&mut state, target, true)
    }

    /// `err`, after poisoning the store whatever its kind: the memory budget's work
    /// (a seal task, a merge, retiring runs) that failed may have left frozen tables the
    /// next seal would drop, so the store takes no more writes until a reopen rebuilds
    /// memory from the log and the runs.
    pub(crate) fn poison_with(&self, err: Error) -> Error {
        self.0.poison_any(err)
    }
}

/// The append side of a durable store.
pub(crate) struct Journal {
    shared: Arc<Shared>,
    flusher: Option<JoinHandle<()>>,
    worker: Option<JoinHandle<()>>,
    /// Leads group commits for asynchronous callers.
    #[cfg(feature = "async")]
    committer: Option<JoinHandle<()>>,
    _lock: Box<dyn Any + Send + Sync>,
}

impl Journal {
    pub(crate) fn new(config: JournalConfig) -> Result<Journal> {
        let shared = Arc::new(Shared {
            state: Mutex::new(WriterState {
                buffer: Vec::new(),
                spare: Vec::new(),
                mark: Vec::with_capacity(MARK_FRAME_LEN),
                appended: 0,
                written: 0,
                synced: 0,
                shipped: 0,
                leader: false,
                group: 0,
                group_end: 0,
                group_syncs: false,
                gather: Gather::default(),
                active: None,
                segments: config.segments,
                prepared: BTreeMap::new(),
                work_requested: 0,
                work_done: 0,
                #[cfg(feature = "async")]
                commits: Vec::new(),
            }),
            changed: Condvar::new(),
            gathered: Condvar::new(),
            group_done: [Condvar::new(), Condvar::new()],
            flusher_wake: Condvar::new(),
            #[cfg(feature = "async")]
            commit_wanted: Condvar::new(),
            #[cfg(feature = "async")]
            next_commit: AtomicU64::new(0),
            worker_wake: Condvar::new(),
            poisoned: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            replica: config.replica,
            shipped_changed: Condvar::new(),
            replica_down: Mutex::new(None),
            lagging: AtomicBool::new(false),
            not_owner: AtomicBool::new(false),
            runs_shipped: Mutex::new(RunsOnReplica::default()),
            written_to: AtomicU64::new(0),
            acknowledged_to: AtomicU64::new(0),
            backlog: AtomicU64::new(0),
            storage: config.storage,
            dir: config.dir,
            archive: config.archive,
            names_after: config.names_after,
            durability: config.durability,
            window: config.window,
            database_id: config.manifest.database_id(),
            manifest: Mutex::new(config.manifest),
            seed: config.frame_seed,
            segment_max_bytes: config.segment_max_bytes,
            fsyncs: AtomicU64::new(0),
            commit_waits: AtomicU64::new(0),
            commit_wakeups: AtomicU64::new(0),
            records: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            segments_deleted: AtomicU64::new(config.segments_deleted),
            sync_times: SyncTimes::new(),
            readers: readers::SegmentReaders::default(),
        });
        shared.start(config.adopt, config.bucket)?;
        let flusher = match config.durability {
            Durability::Interval(interval) => {
                let shared = Arc::clone(&shared);
                Some(
                    std::thread::Builder::new()
                        .name("oncedb-flusher".into())
                        .spawn(move || shared.run_flusher(interval))?,
                )
            }
            Durability::Buffered | Durability::Sync => None,
        };
        let worker = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("oncedb-segments".into())
                .spawn(move || shared.run_worker())?
        };
        #[cfg(feature = "async")]
        let committer = {
            let shared = Arc::clone(&shared);
            std::thread::Builder::new()
                .name("oncedb-committer".into())
                .spawn(move || shared.run_committer())?
        };
        {
            // The worker's first round prepares the segments after the active one.
            let mut state = shared.state.lock();
            state.work_requested += 1;
            shared.worker_wake.notify_one();
        }
        Ok(Journal {
            shared,
            flusher,
            worker: Some(worker),
            #[cfg(feature = "async")]
            committer: Some(committer),
            _lock: config.lock,
        })
    }

    /// Raises the manifest's lease floor to `floor` (never lowers it), durably: the
    /// manifest is rewritten atomically before this returns. A failure poisons the store,
    /// like any failed write.
    pub(crate) fn raise_lease_floor(&self, floor: u64) -> Result<()> {
        self.raise_manifest(|manifest| {
            (floor > manifest.lease_floor).then_some(Manifest {
                lease_floor: floor,
                ..*manifest
            })
        })
    }

    /// Raises the manifest's run floor to `floor` (never lowers it), durably, as
    /// [`Journal::raise_lease_floor`] does the lease floor.
    pub(crate) fn raise_run_floor(&self, floor: u64) -> Result<()> {
        self.raise_manifest(|manifest| {
            (floor > manifest.run_floor).then_some(Manifest {
                run_floor: floor,
                ..*manifest
            })
        })
    }

    /// Rewrites the manifest as `raise` changes it, if it does (under the manifest's
    /// lock, so two raises never write over each other's field).
    fn raise_manifest(&self, raise: impl FnOnce(&Manifest) -> Option<Manifest>) -> Result<()> {
        self.shared.check_writable()?;
        let mut manifest = self.shared.manifest.lock();
        let Some(raised) = raise(&manifest) else {
            return Ok(());
        };
        raised
            .store(&*self.shared.storage, &self.shared.dir)
            .map_err(|err| match err {
                Error::Io(err) => self.shared.poison(err),
                other => other,
            })?;
        *manifest = raised;
        Ok(())
    }

    /// Whether a write may start: the store is not poisoned and still owns its replica,
    /// and an async replica does not lag by more than it may (checked before a write
    /// changes anything, so a refused write changes nothing).
    pub(crate) fn check_writable(&self) -> Result<()> {
        let shared = &*self.shared;
        shared.check_writable()?;
        if shared.lagging.load(Ordering::Acquire) {
            return shared.check_lag(&shared.state.lock());
        }
        Ok(())
    }

    /// Whether appending `bytes` more for `bucket` would roll the active segment over.
    #[cfg(feature = "async")]
    pub(crate) fn rolls_over_within(&self, bucket: u64, bytes: u64) -> bool {
        let shared = &*self.shared;
        let state = shared.state.lock();
        shared.needs_roll_over(state.active.as_ref(), bucket, bytes)
    }

    /// Appends `entries` to the buffer, in order and contiguously, into a segment whose
    /// bucket is at least `bucket`. Returns at once (unless a roll-over is due); the
    /// entries are acknowledged after [`Journal::wait`] on the ticket. Callers that need
    /// log order to follow memory order call this under the lock that orders them.
    pub(crate) fn enqueue(&self, bucket: u64, entries: &[LogEntry<'_>]) -> Result<Ticket> {
        self.enqueue_located(bucket, entries)
            .map(|(ticket, _)| ticket)
    }

    /// As [`Journal::enqueue`], also saying where the last entry's frame lies, so that
    /// its bytes can be read back once the log is written past the ticket.
    pub(crate) fn enqueue_located(
        &self,
        bucket: u64,
        entries: &[LogEntry<'_>],
    ) -> Result<(Ticket, LogSpan)> {
        let shared = &*self.shared;
        let needed: usize = entries.iter().map(LogEntry::encoded_len).sum();
        assert!(
            needed <= MAX_APPEND_BYTES,
            "one append is bounded by the frame limit"
        );
        let mut state = shared.state.lock();
        shared.check_writable()?;
        shared.ensure_segment(&mut state, bucket, needed as u64)?;
        let state = &mut *state;
        let Some(active) = state.active.as_mut() else {
            unreachable!("ensure_segment leaves an active segment");
        };
        let before = state.buffer.len();
        if state.buffer.is_empty() {
            // The group's mark; the leader fills in the durable length when it writes.
            active.group_mark = Some(active.appended_len);
            encode_mark(
                &mut state.buffer,
                shared.seed,
                active.appended_len,
                active.synced_len,
                false,
            );
            active.appended_len += MARK_FRAME_LEN as u64;
        }
        let mut span = LogSpan {
            bucket: active.bucket,
            seq: active.seq,
            start: 0,
            len: 0,
        };
        for entry in entries {
            let position = active.appended_len;
            let start = state.buffer.len();
            entry.encode(&mut state.buffer, shared.seed, position);
            let len = state.buffer.len() - start;
            active.appended_len += len as u64;
            span.start = segment_offset(position);
            span.len = segment_offset(len as u64);
        }
        if !active.size_successor_asked && shared.half_full(active) {
            active.size_successor_asked = true;
            state.work_requested += 1;
            shared.worker_wake.notify_one();
        }
        let added = (state.buffer.len() - before) as u64;
        state.appended += added;
        state.gather.appended(&shared.gathered);
        shared
            .records
            .fetch_add(entries.len() as u64, Ordering::Relaxed);
        shared.bytes.fetch_add(added, Ordering::Relaxed);
        Ok((Ticket(state.appended), span))
    }

    /// The log position just past everything appended so far.
    pub(crate) fn position(&self) -> super::LogPosition {
        let state = self.shared.state.lock();
        state
            .active
            .as_ref()
            .map_or_else(super::LogPosition::default, |active| super::LogPosition {
                bucket: active.bucket,
                seq: active.seq,
                offset: segment_offset(active.appended_len),
            })
    }

    /// `err`, after poisoning the store if it is an I/O error: a failed write outside the
    /// journal (a sealed run) fails the store closed like a failed append.
    pub(crate) fn fail(&self, err: Error) -> Error {
        self.shared.fail(err)
    }

    /// `err`, after poisoning the store whatever its kind ([`SealHandle::poison_with`]).
    pub(crate) fn poison_with(&self, err: Error) -> Error {
        self.shared.poison_any(err)
    }

    /// The handle the thread sealing runs uses ([`SealHandle`]).
    pub(crate) fn seal_handle(&self) -> SealHandle {
        SealHandle(Arc::clone(&self.shared))
    }

    /// Whether everything up to `ticket` has reached the segment files (written, if not
    /// yet synced): its frames can be read back.
    pub(crate) fn is_written(&self, ticket: Ticket) -> bool {
        self.shared.written_to.load(Ordering::Acquire) >= ticket.0
    }

    /// Reads the frame at `span` and returns the response of the finish entry it holds,
    /// checking that the frame verifies and ends lease `lease_id` of `fingerprint`;
    /// `None` if the segment is gone because its bucket left the window (the record
    /// expired with it). Any other failed read poisons the store, like any failed I/O
    /// call.
    pub(crate) fn read_response(
        &self,
        span: LogSpan,
        fingerprint: Fingerprint,
        lease_id: u64,
    ) -> Result<Option<Arc<[u8]>>> {
        self.read_logged(span, |source, seed| {
            super::response::read(source, seed, span, (fingerprint, lease_id))
        })
    }

    /// Reads the frame at `span` and returns the scoped key of the reserve entry it
    /// holds for `fingerprint`; `None` and failures as for [`Journal::read_response`].
    pub(crate) fn read_key(
        &self,
        span: LogSpan,
        fingerprint: Fingerprint,
    ) -> Result<Option<Box<[u8]>>> {
        self.read_logged(span, |source, seed| {
            super::response::read_key(source, seed, span, fingerprint)
        })
    }

    fn read_logged<T>(
        &self,
        span: LogSpan,
        read: impl FnOnce(FrameSource<'_>, u64) -> Result<T>,
    ) -> Result<Option<T>> {
        let shared = &*self.shared;
        let path = segment_path(&shared.dir, span.bucket, span.seq);
        let segment = (span.bucket, span.seq);
        let found = shared
            .readers
            .get(&*shared.storage, (segment, &path), || {
                shared.expired(span.bucket)
            })
            .map_err(Error::Io)
            .and_then(|file| {
                let source = FrameSource {
                    path: &path,
                    storage: &*shared.storage,
                    file: file.as_deref(),
                };
                read(source, shared.seed)
            });
        match found {
            Ok(found) => Ok(Some(found)),
            Err(Error::Io(err))
                if err.kind() == std::io::ErrorKind::NotFound && shared.expired(span.bucket) =>
            {
                Ok(None)
            }
            Err(Error::Io(err)) => Err(shared.poison(err)),
            Err(other) => Err(other),
        }
    }

    /// Whether an answer that depends on another call's write waits until that write is
    /// as durable as this mode acknowledges writes: under `Sync` only (fsynced, and
    /// acknowledged by a replica in sync mode). `Buffered` and `Interval` acknowledge
    /// before durability, and answers that depend on their writes do not wait either.
    pub(crate) fn answers_wait(&self) -> bool {
        matches!(self.shared.durability, Durability::Sync)
    }

    /// Whether the log up to `ticket` is as durable as `Sync` acknowledges: fsynced, and
    /// acknowledged by a replica in sync mode.
    pub(crate) fn is_acknowledged(&self, ticket: Ticket) -> bool {
        self.acknowledged_position() >= ticket.0
    }

    /// The log position up to which the log is as durable as `Sync` acknowledges, read
    /// without the journal's lock (it only grows).
    pub(crate) fn acknowledged_position(&self) -> u64 {
        self.shared.acknowledged_to.load(Ordering::Acquire)
    }

    /// Waits until the entries up to `ticket` are as durable as the mode promises.
    pub(crate) fn wait(&self, ticket: Ticket) -> Result<()> {
        let shared = &*self.shared;
        let mut state = shared.state.lock();
        match shared.durability {
            Durability::Sync => {
                shared.persist(&mut state, ticket.0, true)?;
                shared.wait_shipped(&mut state, ticket.0)
            }
            Durability::Buffered => shared.persist(&mut state, ticket.0, false),
            Durability::Interval(_) if state.buffer.len() >= INTERVAL_BUFFER_BYTES => {
                shared.persist(&mut state, ticket.0, false)
            }
            Durability::Interval(_) => shared.check_writable(),
        }
    }

    /// Writes and fsyncs everything appended so far, then waits for the worker to finish
    /// the background work asked for so far (expired segments deleted, the next segments
    /// prepared), reporting its failure.
    pub(crate) fn flush(&self) -> Result<()> {
        let shared = &*self.shared;
        let mut state = shared.state.lock();
        shared.check_writable()?;
        let target = state.appended;
        shared.persist(&mut state, target, true)?;
        shared.drain_worker(&mut state)
    }

    /// What a checkpoint copies of the log: everything appended so far is written and
    /// fsynced first (a group commit), then, under the writer's lock, the segments are
    /// listed and the active one's length taken at the end of its last fsynced group.
    /// The bytes before that length never change again (the log only appends), and the
    /// other segments are sealed: a copy may be taken from them while writers go on.
    pub(crate) fn checkpoint_view(&self) -> Result<LogView> {
        let shared = &*self.shared;
        let (active, sealed) = {
            let mut state = shared.state.lock();
            shared.check_writable()?;
            let target = state.appended;
            shared.persist(&mut state, target, true)?;
            let active = state
                .active
                .as_ref()
                .map(|active| ((active.bucket, active.seq), active.synced_len));
            let sealed: Vec<PathBuf> = state
                .segments
                .keys()
                .filter(|&&id| Some(id) != active.map(|(id, _)| id))
                .map(|&(bucket, seq)| segment_path(&shared.dir, bucket, seq))
                .collect();
            (active, sealed)
        };
        // After the log: ids the copied entries carry were all below the floor read here.
        let manifest = *shared.manifest.lock();
        let position = active.map_or_else(super::LogPosition::default, |((bucket, seq), len)| {
            super::LogPosition {
                bucket,
                seq,
                offset: segment_offset(len),
            }
        });
        Ok(LogView {
            sealed,
            active: active
                .map(|((bucket, seq), len)| (segment_path(&shared.dir, bucket, seq), len)),
            manifest,
            position,
        })
    }

    /// The storage the store's files are reached through.
    pub(crate) fn storage(&self) -> &dyn Storage {
        &*self.shared.storage
    }

    /// Every segment on disk: (bucket, seq) and its length.
    pub(crate) fn segment_sizes(&self) -> Vec<((u64, u32), u64)> {
        let state = self.shared.state.lock();
        state.segments.iter().map(|(&id, &len)| (id, len)).collect()
    }

    /// With a replica: the sealed runs on it, as its shipper last saw them.
    pub(crate) fn replica_runs_shipped(&self) -> Option<RunsOnReplica> {
        let shared = &*self.shared;
        shared
            .replica
            .is_some()
            .then(|| shared.runs_shipped.lock().clone())
    }

    pub(crate) fn stats(&self) -> JournalStats {
        let shared = &*self.shared;
        let (segment_bytes, segment_count, replica_lag_bytes) = {
            let state = shared.state.lock();
            (
                state.segments.values().sum(),
                state.segments.len() as u64,
                shared.replica_lag(&state),
            )
        };
        JournalStats {
            segment_bytes,
            segment_count,
            replica_lag_bytes,
            fsync_micros: shared.sync_times.snapshot(),
            fsyncs: shared.fsyncs.load(Ordering::Relaxed),
            commit_waits: shared.commit_waits.load(Ordering::Relaxed),
            commit_wakeups: shared.commit_wakeups.load(Ordering::Relaxed),
            log_records: shared.records.load(Ordering::Relaxed),
            log_bytes: shared.bytes.load(Ordering::Relaxed),
            segments_deleted: shared.segments_deleted.load(Ordering::Relaxed),
        }
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        {
            let _state = self.shared.state.lock();
            self.shared.flusher_wake.notify_all();
            self.shared.worker_wake.notify_all();
            #[cfg(feature = "async")]
            self.shared.commit_wanted.notify_all();
        }
        #[cfg(feature = "async")]
        if let Some(committer) = self.committer.take() {
            let _ = committer.join();
        }
        if let Some(flusher) = self.flusher.take() {
            let _ = flusher.join();
        }
        if let Some(worker) = self.worker.take() {
            let _ = worker.join();
        }
        // A clean close persists what is buffered, seals the segment and starts an empty
        // one, so that a sealed segment is never the newest and a cut one is detected; a
        // failure has poisoned the store and there is no caller left to tell.
        let shared = &*self.shared;
        let mut state = shared.state.lock();
        let target = state.appended;
        let _ = shared
            .check_writable()
            .and_then(|()| shared.persist(&mut state, target, true));
        drop(state);
        let _ = shared.close();
    }
}

impl Shared {
    /// Whether the segments of `bucket` have left the window of the active segment, so
    /// that the worker may have retired them.
    fn expired(&self, bucket: u64) -> bool {
        let state = self.state.lock();
        state
            .active
            .as_ref()
            .is_some_and(|active| !self.window.is_live(bucket, active.bucket))
    }

    fn check_writable(&self) -> Result<()> {
        if self.poisoned.load(Ordering::Acquire) {
            Err(Error::Poisoned)
        } else if self.not_owner.load(Ordering::Acquire) {
            Err(Error::NotOwner {
                replica: self
                    .replica
                    .as_ref()
                    .map_or_else(String::new, |gate| gate.name.to_string()),
            })
        } else {
            Ok(())
        }
    }

    /// The condition variable that waiters on group commit `group` sleep on: groups
    /// alternate between two, so a leader wakes its own group's waiters without waking
    /// those already queued for the next.
    fn group_done(&self, group: u64) -> &Condvar {
        let [even, odd] = &self.group_done;
        if group.is_multiple_of(2) { even } else { odd }
    }

    /// `err`, after poisoning the store if it is an I/O error.
    fn fail(&self, err: Error) -> Error {
        match err {
            Error::Io(err) => self.poison(err),
            other => other,
        }
    }

    fn poison(&self, err: std::io::Error) -> Error {
        self.poison_any(Error::Io(err))
    }

    /// `err`, after poisoning the store whatever its kind.
    fn poison_any(&self, err: Error) -> Error {
        self.poisoned.store(true, Ordering::Release);
        self.changed.notify_all();
        #[cfg(feature = "async")]
        self.commit_wanted.notify_all();
        for slot in &self.group_done {
            slot.notify_all();
        }
        err
    }

    /// Waits until the log is written (and synced, if `sync`) up to `target`. The first
    /// waiter without a leader becomes one and writes everything buffered for all.
    fn persist(
        &self,
        state: &mut MutexGuard<'_, WriterState>,
        target: u64,
        sync: bool,
    ) -> Result<()> {
        loop {
            self.check_writable()?;
            let reached = if sync { state.synced } else { state.written };
            if reached >= target {
                return Ok(());
            }
            if state.leader {
                let covered = target <= state.group_end && (state.group_syncs || !sync);
                let group = state.group + u64::from(!covered);
                self.commit_waits.fetch_add(1, Ordering::Relaxed);
                self.group_done(group).wait(state);
                continue;
            }
            if sync && self.gather(state) {
                continue;
            }
            self.lead(state, sync)?;
        }
    }

    /// Before a `Sync` group starts, waits (as its leader, so that nobody else leads)
    /// for the callers the previous group covered to append again, at most a quarter of the
    /// previous fsync's time: a closed loop of writers then fills one group instead of
    /// alternating between two half groups. Whether it waited.
    fn gather(&self, state: &mut MutexGuard<'_, WriterState>) -> bool {
        let Some((want, budget)) = state.gather.plan() else {
            return false;
        };
        let deadline = Instant::now() + budget;
        state.leader = true;
        state.gather.wanted = want;
        let mut gathered = true;
        while state.gather.buffered < want && !self.poisoned.load(Ordering::Acquire) {
            if self.gathered.wait_until(state, deadline).timed_out() {
                gathered = state.gather.buffered >= want;
                break;
            }
        }
        state.gather.wanted = 0;
        state.gather.missed = !gathered;
        state.leader = false;
        true
    }

    /// One group commit: stamp the group's mark with the durable length, then write the
    /// buffer (and fsync) outside the lock.
    fn lead(&self, state: &mut MutexGuard<'_, WriterState>, sync: bool) -> Result<()> {
        let seed = self.seed;
        let state_ref = &mut **state;
        let Some(active) = state_ref.active.as_mut() else {
            return Ok(());
        };
        let Some(mut file) = active.file.take() else {
            unreachable!("only the leader takes the file, and there is one leader");
        };
        if let Some(position) = active.group_mark.take() {
            let mark = &mut state_ref.mark;
            mark.clear();
            encode_mark(mark, seed, position, active.synced_len, false);
            put(&mut state_ref.buffer, 0, mark);
        }
        let segment_end = active.appended_len;
        let sync_entry = sync && !active.entry_durable;
        state_ref.leader = true;
        state_ref.group += 1;
        state_ref.group_end = state_ref.appended;
        state_ref.group_syncs = sync;
        let spare = std::mem::take(&mut state_ref.spare);
        let data = std::mem::replace(&mut state_ref.buffer, spare);
        let callers = std::mem::take(&mut state_ref.gather.buffered);
        let end = state_ref.appended;
        let started = Instant::now();
        let result = MutexGuard::unlocked(state, || {
            if !data.is_empty() {
                file.append(&data)?;
            }
            if sync {
                self.sync_times.time(&self.fsyncs, || file.sync())?;
            }
            if sync_entry {
                self.sync_times
                    .time(&self.fsyncs, || self.storage.sync_dir(&self.dir))?;
            }
            Ok(())
        });
        state.leader = false;
        let state_ref = &mut **state;
        if let Some(active) = state_ref.active.as_mut() {
            active.file = Some(file);
            if result.is_ok() {
                *state_ref
                    .segments
                    .entry((active.bucket, active.seq))
                    .or_default() += data.len() as u64;
                if sync {
                    active.synced_len = segment_end;
                    active.entry_durable = true;
                    state_ref.gather.synced(callers, started.elapsed());
                }
            }
        }
        if let Err(err) = result {
            return Err(self.poison(err));
        }
        state.written = end;
        self.written_to.store(end, Ordering::Release);
        if sync {
            state.synced = end;
            self.publish_acknowledged(state);
            self.update_lag(state);
        }
        self.changed.notify_all();
        #[cfg(feature = "async")]
        self.wake_commits(state);
        let covered = self.group_done(state.group).notify_all();
        let next_leader = self.group_done(state.group + 1).notify_one();
        self.commit_wakeups.fetch_add(
            (covered + usize::from(next_leader)) as u64,
            Ordering::Relaxed,
        );
        // Keep both buffers' capacity: the written one becomes the buffer again if nobody
        // appended meanwhile, else the spare.
        let mut data = data;
        data.clear();
        if state.buffer.is_empty() {
            std::mem::swap(&mut state.buffer, &mut data);
        }
        state.spare = data;
        Ok(())
    }

    /// Whether `active` is at least half its size limit: time to prepare the segment a
    /// roll-over at the limit will take.
    fn half_full(&self, active: &Active) -> bool {
        active.appended_len >= self.segment_max_bytes / 2
    }

    /// Whether an append of `needed` bytes for `bucket` must go to a new segment: none is
    /// open, the bucket is newer, or the segment already holds data and would pass its
    /// size limit. `appended_len` counts the bytes a leader is writing too, so a segment
    /// never grows past the limit by more than one append (and its group mark).
    fn needs_roll_over(&self, active: Option<&Active>, bucket: u64, needed: u64) -> bool {
        let Some(active) = active else {
            return true;
        };
        let holds_data = active.appended_len > SEGMENT_HEADER_LEN as u64;
        bucket > active.bucket
            || (holds_data
                && active.appended_len + needed + MARK_FRAME_LEN as u64 > self.segment_max_bytes)
    }

    /// Rolls over to a new segment when [`Shared::needs_roll_over`] says so. The check is
    /// repeated after every wait, so writers queued at a boundary create one segment.
    fn ensure_segment(
        &self,
        state: &mut MutexGuard<'_, WriterState>,
        bucket: u64,
        needed: u64,
    ) -> Result<()> {
        loop {
            if !self.needs_roll_over(state.active.as_ref(), bucket, needed) {
                return Ok(());
            }
            self.check_writable()?;
            if state.leader {
                self.changed.wait(state);
                continue;
            }
            // Only the newest segment may hold unsynced bytes: sync the old one first.
            if state.active.is_some() && state.synced < state.appended {
                let target = state.appended;
                self.persist(state, target, true)?;
                continue;
            }
            return self.roll_over(state, bucket);
        }
    }

    /// Seals the active segment (all synced by the caller) and starts the next one: the
    /// worker's prepared file renamed into the log if it has the right name, else a file
    /// created here. Then asks the worker to delete expired segments and prepare more.
    fn roll_over(&self, state: &mut WriterState, bucket: u64) -> Result<()> {
        self.seal_active(state)?;
        let newest = state
            .segments
            .keys()
            .next_back()
            .copied()
            .max(self.names_after);
        let (bucket, seq) = next_segment(newest, bucket)
            .ok_or_else(|| self.poison(std::io::Error::other("segment names are exhausted")))?;
        let (file, entry_durable) = match state.prepared.remove(&(bucket, seq)) {
            Some(file) => {
                let from = prepared_path(&self.dir, bucket, seq);
                let to = segment_path(&self.dir, bucket, seq);
                self.storage
                    .rename(&from, &to)
                    .map_err(|err| self.poison(err))?;
                (file, false)
            }
            None => {
                let file = self
                    .create_segment(bucket, seq)
                    .map_err(|err| self.poison(err))?;
                (file, true)
            }
        };
        state
            .segments
            .insert((bucket, seq), SEGMENT_HEADER_LEN as u64);
        state.active = Some(Active::empty(bucket, seq, file, entry_durable));
        state.work_requested += 1;
        self.worker_wake.notify_one();
        Ok(())
    }

    /// Creates segment `(bucket, seq)` in the log: file and header fsynced, then the
    /// directory.
    fn create_segment(&self, bucket: u64, seq: u32) -> std::io::Result<Box<dyn StorageFile>> {
        let file = self.create_with_header(&segment_path(&self.dir, bucket, seq), bucket, seq)?;
        self.sync_times
            .time(&self.fsyncs, || self.storage.sync_dir(&self.dir))?;
        Ok(file)
    }

    /// Creates `path` holding the header of segment `(bucket, seq)`, fsynced.
    fn create_with_header(
        &self,
        path: &std::path::Path,
        bucket: u64,
        seq: u32,
    ) -> std::io::Result<Box<dyn StorageFile>> {
        let mut file = self.storage.open_append(path, true)?;
        let header = SegmentHeader {
            bucket,
            seq,
            database_id: self.database_id,
        };
        file.append(&header.encode())?;
        self.sync_times.time(&self.fsyncs, || file.sync())?;
        Ok(file)
    }

    /// Makes `active`'s directory entry durable if it is not yet.
    fn sync_entry(&self, active: &mut Active) -> Result<()> {
        if !active.entry_durable {
            self.sync_times
                .time(&self.fsyncs, || self.storage.sync_dir(&self.dir))
                .map_err(|err| self.poison(err))?;
            active.entry_durable = true;
        }
        Ok(())
    }

    /// The segment appends go to after open: the empty newest segment, or a new one if
    /// any segment holds data (its predecessor was sealed by recovery).
    fn start(&self, adopt: Option<(u64, u32)>, bucket: u64) -> Result<()> {
        let mut state = self.state.lock();
        if let Some((bucket, seq)) = adopt {
            let file = self
                .storage
                .open_append(&segment_path(&self.dir, bucket, seq), false)?;
            state.active = Some(Active::empty(bucket, seq, file, true));
        } else if !state.segments.is_empty() || self.names_after.is_some() {
            self.roll_over(&mut state, bucket)?;
        }
        Ok(())
    }

    /// Seals the active segment: after everything in it is fsynced (the caller made
    /// sure), a seal vouching for every byte before it is written and fsynced. Every
    /// segment but the newest ends with one, so a segment cut short at a frame boundary
    /// is found out.
    fn seal_active(&self, state: &mut WriterState) -> Result<()> {
        let Some(active) = state.active.as_mut() else {
            return Ok(());
        };
        let Some(file) = active.file.as_mut() else {
            unreachable!("no leader runs while the segment is sealed");
        };
        let position = active.appended_len;
        debug_assert_eq!(active.synced_len, position, "sealed only when synced");
        let mut seal = Vec::with_capacity(MARK_FRAME_LEN);
        encode_mark(&mut seal, self.seed, position, position, true);
        file.append(&seal)
            .and_then(|()| self.sync_times.time(&self.fsyncs, || file.sync()))
            .map_err(|err| self.poison(err))?;
        self.sync_entry(active)?;
        let len = seal.len() as u64;
        *state
            .segments
            .entry((active.bucket, active.seq))
            .or_default() += len;
        active.appended_len += len;
        active.synced_len += len;
        state.appended += len;
        state.written += len;
        self.written_to.store(state.written, Ordering::Release);
        state.synced += len;
        self.update_lag(state);
        self.bytes.fetch_add(len, Ordering::Relaxed);
        Ok(())
    }

    /// A clean close after a flush, with the worker stopped: if the active segment holds
    /// frames, seal it and start an empty one of the same bucket whose directory entry is
    /// durable; then remove the prepared segments nobody will use.
    fn close(&self) -> Result<()> {
        let mut state = self.state.lock();
        self.check_writable()?;
        let Some(active) = state.active.as_ref() else {
            return Ok(());
        };
        if active.appended_len != SEGMENT_HEADER_LEN as u64 && state.synced == state.appended {
            let bucket = active.bucket;
            self.roll_over(&mut state, bucket)?;
            if let Some(active) = state.active.as_mut() {
                self.sync_entry(active)?;
            }
        }
        // Left-over prepared files are also removed by the next open.
        for ((bucket, seq), file) in std::mem::take(&mut state.prepared) {
            drop(file);
            self.storage
                .remove(&prepared_path(&self.dir, bucket, seq))
                .map_err(|err| self.poison(err))?;
        }
        Ok(())
    }

    fn run_flusher(&self, interval: Duration) {
        let mut state = self.state.lock();
        while !self.shutdown.load(Ordering::Acquire) {
            self.flusher_wake.wait_for(&mut state, interval);
            if self.poisoned.load(Ordering::Acquire) {
                return;
            }
            let target = state.appended;
            if state.synced < target {
                // An error has poisoned the store; writers report it.
                let _ = self.persist(&mut state, target, true);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{Gather, next_segment};
    use std::time::Duration;

    /// After a `Sync` group of 8 callers, the next leader waits for those 8 to append
    /// again (on top of what is buffered) for a quarter of that group's fsync; not after
    /// a group of one, and not right after a wait that timed out.
    #[test]
    fn a_leader_gathers_the_callers_the_last_group_covered() {
        let condvar = parking_lot::Condvar::new();
        let mut gather = Gather::default();
        assert_eq!(gather.plan(), None, "no group yet");
        gather.synced(8, Duration::from_millis(4));
        gather.appended(&condvar);
        assert_eq!(gather.plan(), Some((9, Duration::from_millis(1))));
        assert_eq!(gather.plan(), None, "one leader gathers per group");
        gather.synced(1, Duration::from_millis(4));
        assert_eq!(gather.plan(), None, "a lone caller is not waited for");
        gather.synced(8, Duration::from_millis(4));
        gather.missed = true;
        assert_eq!(gather.plan(), None, "a timed-out wait skips the next one");
        gather.synced(8, Duration::from_millis(4));
        assert!(gather.plan().is_some(), "and only that one");
    }

    #[test]
    fn segment_names_continue_past_an_exhausted_sequence() {
        assert_eq!(next_segment(None, 7), Some((7, 0)));
        assert_eq!(next_segment(Some((5, 3)), 7), Some((7, 0)));
        assert_eq!(next_segment(Some((7, 3)), 7), Some((7, 4)));
        assert_eq!(next_segment(Some((9, 3)), 7), Some((9, 4)));
        assert_eq!(next_segment(Some((7, u32::MAX)), 7), Some((8, 0)));
        assert_eq!(next_segment(Some((u64::MAX, u32::MAX)), 7), None);
    }
}
