//! The engine core: hashing, the clock and its high-water bucket, lease ids, and the
//! order of "change the index, then log it, then wait for durability". The API sits on
//! top; the index and the log sit below and do not know each other.

mod config;
mod endings;
mod recovery;
mod responses;
mod sealing;
mod settle;

pub(crate) use config::{ClockStep, Config};
pub(crate) use settle::{Concluded, Settle};
use settle::{Rests, Undo};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use smallvec::SmallVec;

use crate::base::{
    Advance, Clock, Error, Fingerprint, Finish, Hasher, LEASE_ID_LIMIT, MAX_BATCH_KEYS,
    MAX_NOTE_BYTES, Record, RecordStatus, Result, Window, random_secret,
};
// What the API uses of the rooms below: it reaches the index, the log and `io` only
// through these.
use crate::index::{
    BatchMark, BatchMarks, Index, IndexStats, PendingWrite, SealedKeys, SealedRecords, Shard,
    ShardGroups, for_each_prefetched,
};
pub(crate) use crate::index::{Grant, InFlightRecord, Reserved};
pub(crate) use crate::io::{StdStorage, Storage};
#[cfg(feature = "replicate")]
pub(crate) use crate::replica::{Follower, Replication, RestoreReport, StandbyLag};
pub(crate) use crate::wal::{Checkpoint, RecoveryReport, VerifyReport, is_archive, verify_with};
use crate::wal::{Journal, JournalStats, LogEntry, MANIFEST_LEN, Manifest, Ticket};

/// Lease ids reserved by one raise of the floor: 2^24, so the 2^62 ids last 2^38 raises,
/// and a store raising once per restart never runs out.
const LEASE_BLOCK: u64 = 1 << 24;

/// How close to a roll-over, a sealing check and a lease floor raise an asynchronous
/// write must not come to run inline: the room left for writes that race it there.
#[cfg(feature = "async")]
const ROLL_OVER_SLACK_BYTES: u64 = 256 << 10;
#[cfg(feature = "async")]
const SEAL_CHECK_SLACK_KEYS: u64 = 1024;
#[cfg(feature = "async")]
const LEASE_SLACK_IDS: u64 = 1 << 16;

/// What recovery (or a fresh in-memory open) assembles the engine from.
pub(crate) struct Parts {
    pub(crate) index: Index,
    pub(crate) secret: u64,
    pub(crate) high_water: u64,
    pub(crate) next_lease: u64,
    /// The lease floor on disk: ids at or above it need a raise first (`u64::MAX` in
    /// memory, where no id outlives the process).
    pub(crate) lease_floor: u64,
    pub(crate) journal: Option<Journal>,
    pub(crate) recovery: Option<RecoveryReport>,
    pub(crate) sealer: Option<sealing::Sealer>,
    /// Ships the log to the replica, if the store replicates.
    #[cfg(feature = "replicate")]
    pub(crate) shipper: Option<crate::replica::Shipper>,
}

/// A wait registered on the ending of a record: its fingerprint, and the signal.
pub(crate) type Watch = (u128, Arc<endings::Ending>);

/// A database: the index, the journal, and what orders calls between them.
pub(crate) struct Engine {
    /// Shared with the sealing thread, which takes settled records from it.
    index: Arc<Index>,
    hasher: Hasher,
    window: Window,
    clock: Arc<dyn Clock>,
    /// Highest bucket any operation has seen; time never moves backwards past it.
    high_water: AtomicU64,
    /// Readings further ahead of `high_water` than this many buckets are held back.
    max_step_buckets: u64,
    /// Clock readings held back so far.
    clock_held_back: AtomicU64,
    opened_bucket: u64,
    next_lease: AtomicU64,
    /// Every id below it may be handed out; see [`Engine::next_lease_id`].
    lease_floor: AtomicU64,
    /// Serializes raises of the floor.
    floor_raise: parking_lot::Mutex<()>,
    max_key_bytes: usize,
    max_response_bytes: usize,
    stuck_after_ms: u64,
    /// A reserve that finds a record in flight this long takes it over; `None`: never.
    lease_timeout_ms: Option<u64>,
    /// Callers waiting for a record in flight to end.
    endings: endings::Endings,
    /// With a memory budget: the sealed runs. Declared before the journal, so that a
    /// closing store waits for the seal under way while it still holds the directory's
    /// lock (fields drop in declaration order).
    sealer: Option<sealing::Sealer>,
    /// Ships the log to the replica. Declared before the journal: it stops (and its
    /// thread ends) before the journal closes.
    #[cfg(feature = "replicate")]
    _shipper: Option<crate::replica::Shipper>,
    journal: Option<Journal>,
    /// Responses memory holds until the log is written past them.
    unwritten: responses::UnwrittenQueue,
    recovery: Option<RecoveryReport>,
    /// Take-backs of failed writes so far ([`settle`]): an answer that waited for
    /// another call's write stands only if this did not move meanwhile.
    revocations: AtomicU64,
    /// Take-backs under way ([`Engine::counted_take_back`]).
    taking_back: AtomicU64,
    /// Under `Sync`: the marks of batches admitting and not logged yet ([`settle`]).
    batch_marks: BatchMarks,
}

/// Counts and sizes of every room, for the API's `Stats`.
pub(crate) struct EngineStats {
    pub(crate) index: IndexStats,
    pub(crate) journal: Option<JournalStats>,
    pub(crate) buckets_dropped: u64,
    /// Records in flight for at least the configured stuck age.
    pub(crate) stuck_records: u64,
    /// Callers waiting for a record in flight to end.
    pub(crate) outcome_waiters: u64,
    /// Segment files plus the manifest; 0 in memory.
    pub(crate) bytes_on_disk: u64,
    /// Clock readings too far ahead to adopt.
    pub(crate) clock_held_back: u64,
    pub(crate) sealing: sealing::SealStats,
    /// With a replica: live sealed runs it does not hold whole yet.
    pub(crate) replica_runs_unshipped: u64,
    /// With a replica: runs held back until the log their cover names is on it.
    pub(crate) replica_runs_awaiting_log: u64,
}

/// The window and bucket width (in ms) the store in `dir` was created with, from its
/// manifest; `None` if `dir` holds no store.
pub(crate) fn stored_window(dir: &std::path::Path) -> Result<Option<(u64, u64)>> {
    let manifest = Manifest::load(&StdStorage, dir)?;
    Ok(manifest.map(|manifest| (manifest.window_ms, manifest.bucket_width_ms)))
}

impl Engine {
    /// Opens the store `config` describes: in memory, or recovered from its directory.
    pub(crate) fn open(config: &Config) -> Result<Engine> {
        if config.dir.is_some() {
            return recovery::open(config);
        }
        let bucket = config.window().bucket_of(config.clock.now_ms());
        let index = config.build_index(config.expected_keys, bucket)?;
        Ok(Engine::from_parts(
            config,
            Parts {
                index,
                secret: random_secret(),
                high_water: bucket,
                next_lease: 1,
                lease_floor: u64::MAX,
                journal: None,
                recovery: None,
                sealer: None,
                #[cfg(feature = "replicate")]
                shipper: None,
            },
        ))
    }

    /// Assembles an engine; its bucket count starts at `parts.high_water`.
    pub(crate) fn from_parts(config: &Config, parts: Parts) -> Engine {
        Engine {
            index: Arc::new(parts.index),
            hasher: Hasher::new(parts.secret),
            window: config.window(),
            clock: Arc::clone(&config.clock),
            high_water: AtomicU64::new(parts.high_water),
            max_step_buckets: config.max_step_buckets(),
            clock_held_back: AtomicU64::new(0),
            opened_bucket: parts.high_water,
            next_lease: AtomicU64::new(parts.next_lease),
            lease_floor: AtomicU64::new(parts.lease_floor),
            floor_raise: parking_lot::Mutex::new(()),
            max_key_bytes: config.max_key_bytes,
            max_response_bytes: config.max_response_bytes,
            stuck_after_ms: config.stuck_after_ms,
            lease_timeout_ms: config.lease_timeout_ms,
            endings: endings::Endings::default(),
            journal: parts.journal,
            unwritten: responses::UnwrittenQueue::default(),
            sealer: parts.sealer,
            #[cfg(feature = "replicate")]
            _shipper: parts.shipper,
            recovery: parts.recovery,
            revocations: AtomicU64::new(0),
            taking_back: AtomicU64::new(0),
            batch_marks: BatchMarks::default(),
        }
    }

    /// The current bucket, never lower than one already seen. Calls that need no
    /// timestamp ask the clock for its bucket alone, which the system clock answers
    /// from its coarse reading away from a bucket's edges (`Clock::now_bucket`).
    fn current_bucket(&self) -> u64 {
        self.raise_to(self.clock.now_bucket(self.window.width_ms))
    }

    /// The bucket for the clock reading `now_ms`, raising the high-water mark. Record calls
    /// take one reading for both the record's timestamp and its bucket.
    fn bucket_at(&self, now_ms: u64) -> u64 {
        self.raise_to(self.window.bucket_of(now_ms))
    }

    /// The bucket for a clock reading in bucket `now`, raising the high-water mark.
    ///
    /// A reading more than `max_step_buckets` ahead of the high-water mark (a bad clock
    /// step) is held back: the mark stays, so nothing expires early and no entry is
    /// stamped with a far-future bucket, and the reading is counted
    /// (`Stats::clock_readings_held_back`) and logged. Readings move the mark again once
    /// the clock is back within the step; a restart adopts the clock as it stands.
    fn raise_to(&self, now: u64) -> u64 {
        let seen = self.high_water.load(Ordering::Acquire);
        if now <= seen {
            return seen;
        }
        if now - seen > self.max_step_buckets {
            let held = self.clock_held_back.fetch_add(1, Ordering::Relaxed) + 1;
            if held.is_power_of_two() {
                log::warn!(
                    "oncedb: a clock reading in bucket {now} is {} buckets ahead of the store's time; held back ({held} readings so far)",
                    now - seen
                );
            }
            return seen;
        }
        self.high_water.fetch_max(now, Ordering::AcqRel).max(now)
    }

    pub(crate) fn check_key(&self, key: &[u8]) -> Result<()> {
        crate::base::check_key(key, self.max_key_bytes)
    }

    /// The largest response a lease may store.
    pub(crate) fn max_response_bytes(&self) -> usize {
        self.max_response_bytes
    }

    pub(crate) fn check_response(&self, response: &[u8]) -> Result<()> {
        if response.len() > self.max_response_bytes {
            return Err(Error::ResponseTooLarge {
                len: response.len(),
                max: self.max_response_bytes,
            });
        }
        Ok(())
    }

    fn check_writable(&self) -> Result<()> {
        match &self.journal {
            Some(journal) => journal.check_writable(),
            None => Ok(()),
        }
    }

    /// A fresh lease id; ids never reach [`LEASE_ID_LIMIT`], so the counter cannot wrap.
    ///
    /// Ids are unique for the store's lifetime, across reopens and crashes, even once
    /// every entry that carried them has expired: an id is handed out only below the
    /// lease floor on disk, raised [`LEASE_BLOCK`] at a time before the first id that
    /// reaches it (one manifest rewrite per block, under the caller's shard lock).
    fn next_lease_id(&self) -> Result<u64> {
        let id = self.next_lease.fetch_add(1, Ordering::Relaxed);
        if id >= LEASE_ID_LIMIT {
            self.next_lease.store(LEASE_ID_LIMIT, Ordering::Relaxed);
            return Err(Error::LeaseIdsExhausted);
        }
        if id >= self.lease_floor.load(Ordering::Acquire) {
            self.raise_lease_floor(id)?;
        }
        Ok(id)
    }

    /// Makes the floor on disk exceed `id` before `id` is handed out.
    fn raise_lease_floor(&self, id: u64) -> Result<()> {
        let _raising = self.floor_raise.lock();
        if id < self.lease_floor.load(Ordering::Acquire) {
            return Ok(()); // another caller raised it meanwhile
        }
        let floor = id.saturating_add(LEASE_BLOCK).min(LEASE_ID_LIMIT);
        if let Some(journal) = &self.journal {
            journal.raise_lease_floor(floor)?;
        }
        self.lease_floor.store(floor, Ordering::Release);
        Ok(())
    }

    /// Appends `entries` (no-op in memory) and returns what to wait for.
    fn enqueue(&self, entries: &[LogEntry<'_>]) -> Result<Option<Ticket>> {
        match &self.journal {
            Some(journal) => {
                let bucket = self.high_water.load(Ordering::Acquire);
                journal.enqueue(bucket, entries).map(Some)
            }
            None => Ok(None),
        }
    }

    /// Logs a new record's reserve `entry` and tells the record (under the same shard
    /// lock) where the entry's frame lies: its key is read back from there once the
    /// record keeps only spans.
    fn enqueue_reserve(
        &self,
        shard: &mut Shard,
        grant: Grant,
        entry: &LogEntry<'_>,
    ) -> Result<Option<Ticket>> {
        let Some(journal) = &self.journal else {
            return Ok(None);
        };
        let bucket = self.high_water.load(Ordering::Acquire);
        let (ticket, span) = journal.enqueue_located(bucket, std::slice::from_ref(entry))?;
        shard.locate_key(grant.fingerprint, grant.lease_id, span);
        shard.logged(ticket.position());
        Ok(Some(ticket))
    }

    fn wait(&self, ticket: Option<Ticket>) -> Result<()> {
        match (&self.journal, ticket) {
            (Some(journal), Some(ticket)) => journal.wait(ticket),
            _ => Ok(()),
        }
    }

    /// Waits for `ticket` as `settle` says: now, or later through [`Engine::committed`].
    fn settle(&self, ticket: Option<Ticket>, settle: &mut Settle) -> Result<()> {
        match settle {
            Settle::Block => self.wait(ticket),
            #[cfg(feature = "async")]
            Settle::Defer(pending) => {
                pending.ticket = pending.ticket.max(ticket);
                Ok(())
            }
        }
    }

    /// Appends `entries` for a write of `shard` (locked), and has the shard remember how
    /// far its writes are logged: an answer that depends on them waits for that.
    fn enqueue_in(&self, shard: &mut Shard, entries: &[LogEntry<'_>]) -> Result<Option<Ticket>> {
        let ticket = self.enqueue(entries)?;
        if let Some(ticket) = ticket {
            shard.logged(ticket.position());
        }
        Ok(ticket)
    }

    /// Whether a write made now may do blocking file work on the calling thread: a
    /// segment roll-over (it fsyncs the segment it leaves), an expiry or sealing check,
    /// or a lease floor raise (a manifest rewrite). `bytes` is the keys, request and
    /// response the write carries, `keys` how many keys it may admit, `leases` how many
    /// lease ids it may take. The asynchronous API sends such writes
    /// to the blocking pool and runs the others inline.
    #[cfg(feature = "async")]
    pub(crate) fn may_block_on_files(&self, bytes: usize, keys: usize, leases: u64) -> bool {
        let Some(journal) = &self.journal else {
            return false;
        };
        let bucket = self.current_bucket();
        let logged_bytes = (bytes + keys * size_of::<Fingerprint>()) as u64;
        journal.rolls_over_within(bucket, logged_bytes + ROLL_OVER_SLACK_BYTES)
            || self
                .sealer
                .as_ref()
                .is_some_and(|sealer| sealer.checks_within(keys as u64 + SEAL_CHECK_SLACK_KEYS))
            || (leases > 0
                && self.next_lease.load(Ordering::Relaxed) + leases + LEASE_SLACK_IDS
                    >= self.lease_floor.load(Ordering::Acquire))
    }

    /// Admits `key` unless it is live; logs it stamped with the bucket it got.
    pub(crate) fn insert_if_absent(&self, key: &[u8]) -> Result<bool> {
        self.insert_if_absent_settled(key, &mut Settle::Block)
    }

    /// [`Engine::insert_if_absent`], waiting for the log as `settle` says: for its own
    /// write if it admitted the key, else (under `Sync`) for the write that did, which it
    /// then finds again unless that write was taken back ([`settle`]).
    pub(crate) fn insert_if_absent_settled(&self, key: &[u8], settle: &mut Settle) -> Result<bool> {
        self.check_key(key)?;
        // Hash and prefetch before the clock: the home slot's miss overlaps the clock
        // read and the lock instead of following them.
        let fingerprint = self.hasher.key(key);
        loop {
            self.check_writable()?;
            let looked_at = self.looked_at();
            self.index.prefetch_home(fingerprint);
            let bucket = self.current_bucket();
            let (admitted, ticket) = self.admit_one(fingerprint, bucket)?;
            let rests = if admitted {
                Rests {
                    own: ticket,
                    undo: self.undo_keys(ticket, || vec![fingerprint]),
                    dependency: None,
                    looked_at,
                }
            } else {
                Rests::depending(ticket, looked_at)
            };
            let concluded = self.settle_answer(rests, settle);
            self.budget_after_logging(u64::from(admitted));
            if concluded? == Concluded::Stands {
                return Ok(admitted);
            }
        }
    }

    /// Admits one key and logs it under its shard's lock, so that whoever finds it
    /// admitted finds its write logged: whether it was new, and the ticket its answer
    /// waits for (its own write's, or for a duplicate the shard's newest unacknowledged
    /// write). A write the log refuses leaves nothing admitted.
    fn admit_one(&self, fingerprint: Fingerprint, bucket: u64) -> Result<(bool, Option<Ticket>)> {
        let mut shard = self.index.lock(fingerprint, bucket);
        if !self
            .index
            .admit_one(&mut shard, fingerprint, self.sealed_keys())?
        {
            let found = self.key_dependency(&shard, fingerprint);
            drop(shard);
            return Ok((false, self.resolve(found)));
        }
        let stamp = shard.current();
        let logged = self.enqueue_in(
            &mut shard,
            &[LogEntry::Keys {
                bucket: stamp,
                fingerprints: &[fingerprint],
            }],
        );
        match logged {
            Ok(ticket) => {
                if let Some(ticket) = ticket {
                    let at = PendingWrite::Logged(ticket.position());
                    self.note_pending_keys(&mut shard, std::iter::once(fingerprint), at);
                }
                Ok((true, ticket))
            }
            Err(err) => {
                shard.revoke_key(fingerprint);
                Err(err)
            }
        }
    }

    /// What a write that admitted keys (logged up to `ticket`) takes back if its wait
    /// fails: under `Sync` only, where a wait can fail with the store still open.
    fn undo_keys(
        &self,
        ticket: Option<Ticket>,
        fingerprints: impl FnOnce() -> Vec<Fingerprint>,
    ) -> Undo {
        match (ticket, &self.journal) {
            (Some(ticket), Some(journal)) if journal.answers_wait() => {
                Undo::Keys(fingerprints(), ticket)
            }
            _ => Undo::Nothing,
        }
    }

    /// Admits many keys: each shard locked once, one log append, at most one fsync.
    /// Allocates nothing in steady state: its buffers are the calling thread's
    /// [`Scratch`], kept across calls.
    pub(crate) fn insert_many<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        admitted: &mut Vec<bool>,
    ) -> Result<()> {
        self.insert_many_settled(keys, admitted, &mut Settle::Block)
    }

    /// [`Engine::insert_many`], waiting for the log as `settle` says.
    pub(crate) fn insert_many_settled<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        admitted: &mut Vec<bool>,
        settle: &mut Settle,
    ) -> Result<()> {
        if keys.len() > MAX_BATCH_KEYS {
            return Err(Error::BatchTooLarge {
                len: keys.len(),
                max: MAX_BATCH_KEYS,
            });
        }
        for key in keys {
            self.check_key(key.as_ref())?;
        }
        self.check_writable()?;
        admitted.clear();
        admitted.resize(keys.len(), false);
        let concluded =
            Scratch::with(|scratch| self.insert_many_with(keys, admitted, scratch, settle))?;
        if concluded == Concluded::Redo {
            self.redo_duplicates(keys, admitted)?;
        }
        Ok(())
    }

    /// Asks again, blocking, for the keys of a batch answered "seen" whose answer lost
    /// the write it rested on (taken back meanwhile): they may be new now.
    fn redo_duplicates<K: AsRef<[u8]>>(&self, keys: &[K], admitted: &mut [bool]) -> Result<()> {
        let (positions, again) = seen_keys(keys, admitted);
        let mut answers = Vec::with_capacity(again.len());
        self.insert_many_settled(&again, &mut answers, &mut Settle::Block)?;
        merge_answers(admitted, &positions, &answers);
        Ok(())
    }

    fn insert_many_with<K: AsRef<[u8]>>(
        &self,
        keys: &[K],
        admitted: &mut [bool],
        scratch: &mut Scratch,
        settle: &mut Settle,
    ) -> Result<Concluded> {
        let looked_at = self.looked_at();
        let Scratch {
            fingerprints,
            stamps,
            groups,
            logged,
            pending,
            marks,
        } = scratch;
        fingerprints.clear();
        fingerprints.extend(keys.iter().map(|k| self.hasher.key(k.as_ref())));
        // Bucket stamps are only needed to log the admitted keys.
        stamps.clear();
        if self.journal.is_some() {
            stamps.resize(keys.len(), 0);
        }
        let bucket = self.current_bucket();
        self.index.group_by_shard(fingerprints, groups);
        let mut batch = Batch {
            fingerprints,
            stamps,
            admitted,
            pending,
            logged,
            marks,
        };
        let answers_wait = self.journal.as_ref().is_some_and(Journal::answers_wait);
        let (own, dependency) = if self.index.bounded() || self.sealer.is_some() {
            self.insert_held(&mut batch, groups, bucket)?
        } else if answers_wait {
            let acknowledged = self
                .journal
                .as_ref()
                .map_or(0, Journal::acknowledged_position);
            match self.batch_marks.claim(acknowledged) {
                Some(mark) => self.insert_marked(&mut batch, groups, bucket, mark)?,
                // Every slot busy: hold the shards instead.
                None => self.insert_held(&mut batch, groups, bucket)?,
            }
        } else {
            (self.insert_unheld(&mut batch, groups, bucket)?, None)
        };
        let (fingerprints, admitted) = (batch.fingerprints, &*batch.admitted);
        let new_keys = admitted.iter().filter(|&&new| new).count() as u64;
        let taken_back = || admitted_fingerprints(fingerprints, admitted);
        let blocking = matches!(settle, Settle::Block);
        let rests = Rests {
            own,
            // A blocking call lists its keys only if its wait fails (in steady state a
            // batch allocates nothing); a deferred one hands them to its commit.
            undo: if blocking {
                Undo::Nothing
            } else {
                self.undo_keys(own, taken_back)
            },
            dependency,
            looked_at,
        };
        let concluded = self.settle_answer(rests, settle);
        if blocking && concluded.is_err() {
            self.take_back(&self.undo_keys(own, taken_back));
        }
        self.budget_after_logging(new_keys);
        concluded
    }

    /// Admits a batch holding every shard it touches (in ascending order, so batches
    /// cannot deadlock) until all have room, every run lookup it needs has been read, and
    /// its admitted keys are logged: a full store, or a damaged run page, refuses the
    /// whole batch with nothing admitted, and whoever finds a key of the batch admitted
    /// finds its write logged. Returns its own ticket, and the newest unacknowledged
    /// write its duplicates rest on (under `Sync`).
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn insert_held(
        &self,
        batch: &mut Batch<'_>,
        groups: &ShardGroups,
        bucket: u64,
    ) -> Result<(Option<Ticket>, Option<Ticket>)> {
        let fingerprints = batch.fingerprints;
        let mut shards: HeldShards<'_> = SmallVec::new();
        for group in groups.iter() {
            let mut shard = self.index.lock(fingerprints[group[0] as usize], bucket);
            shard.reserve_room(group.iter().map(|&i| fingerprints[i as usize]))?;
            shards.push(shard);
        }
        let mut found = Vec::new();
        // Without a memory budget no older level exists: every member is looked up in
        // memory alone.
        let absent = match self.sealer {
            Some(_) => Some(
                absent_from_older_levels(
                    &mut shards,
                    groups,
                    fingerprints,
                    self.sealed_keys(),
                    &mut found,
                )
                .map_err(|err| self.fail(err))?,
            ),
            None => None,
        };
        for (n, (group, shard)) in groups.iter().zip(shards.iter_mut()).enumerate() {
            let range = absent
                .as_ref()
                .and_then(|absent| absent.get(n).cloned().flatten());
            let members = range.map_or(group, |range| &found[range]);
            self.insert_into(batch, shard, group, Some(members))?;
        }
        let admitted = &*batch.admitted;
        let mut found = Found::default();
        for (group, shard) in groups.iter().zip(shards.iter()) {
            for &i in group.iter().filter(|&&i| !admitted[i as usize]) {
                found.add(
                    self.key_dependency(shard, fingerprints[i as usize]),
                    batch.marks,
                );
            }
        }
        let own = self
            .log_batch(batch)
            .inspect_err(|_| revoke_held(&mut shards, groups, fingerprints, batch.admitted))?;
        if let Some(ticket) = own {
            for (group, shard) in groups.iter().zip(shards.iter_mut()) {
                shard.logged(ticket.position());
                let new = group.iter().filter(|&&i| batch.admitted[i as usize]);
                let at = PendingWrite::Logged(ticket.position());
                self.note_pending_keys(shard, new.map(|&i| fingerprints[i as usize]), at);
            }
        }
        // Marked batches are waited for with no shard held: they take these locks.
        drop(shards);
        Ok((own, self.resolve_found(found, batch.marks)))
    }

    /// Under `Sync`, without a budget or a bound: admits a batch one shard at a time,
    /// marking each key it admits with `mark` (a batch slot) in its shard, then logs it
    /// and publishes its position to the mark. A duplicate that finds a mark waits for
    /// that (outside the shard lock) before it waits for the log, so concurrent batches
    /// overlap across shards as without `Sync`. A write the log refuses is taken back,
    /// counted first, before the mark says so. Returns its own ticket and the newest
    /// unacknowledged write its duplicates rest on.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn insert_marked(
        &self,
        batch: &mut Batch<'_>,
        groups: &ShardGroups,
        bucket: u64,
        mark: BatchMark,
    ) -> Result<(Option<Ticket>, Option<Ticket>)> {
        let fingerprints = batch.fingerprints;
        let mut found = Found::default();
        let mut failed = None;
        for n in batch_order(groups, fingerprints) {
            let group = groups.get(n);
            self.index.prefetch_group(group, fingerprints);
            let mut shard = self.index.lock(fingerprints[group[0] as usize], bucket);
            if let Err(err) = self.insert_into(batch, &mut shard, group, None) {
                failed.get_or_insert(err);
            }
            let members = (group, fingerprints, &*batch.admitted);
            let at = PendingWrite::Batch(mark);
            self.note_group(&mut shard, members, at, (&mut found, batch.marks));
        }
        let logged = match failed {
            Some(err) => Err(self.fail(err)),
            None => self.log_batch(batch),
        };
        match &logged {
            Ok(own) => self.batch_marks.publish(mark, own.map(Ticket::position)),
            Err(_) => {
                self.counted_take_back(|| self.revoke_admitted(fingerprints, batch.admitted));
                self.batch_marks.publish(mark, None);
            }
        }
        let own = logged?;
        Ok((own, self.resolve_found(found, batch.marks)))
    }

    /// The newest ticket among the writes a batch's duplicates found, waiting for the
    /// marked batches among them to log (called with no shard lock held).
    fn resolve_found(&self, found: Found, marks: &mut Vec<BatchMark>) -> Option<Ticket> {
        let mut newest = found.logged;
        for mark in marks.drain(..) {
            newest = newest.max(self.resolve(Some(PendingWrite::Batch(mark))));
        }
        newest
    }

    /// Admits a batch one shard at a time, then logs what it admitted: outside `Sync`,
    /// where answers do not wait for the writes they depend on, and a write the log
    /// refuses (the store failed) is taken back after the fact. Returns its own ticket.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn insert_unheld(
        &self,
        batch: &mut Batch<'_>,
        groups: &ShardGroups,
        bucket: u64,
    ) -> Result<Option<Ticket>> {
        let fingerprints = batch.fingerprints;
        let mut failed = None;
        if groups.len() > 0 {
            let mut order = batch_order(groups, fingerprints).peekable();
            if let Some(&start) = order.peek() {
                self.index.prefetch_group(groups.get(start), fingerprints);
            }
            while let Some(n) = order.next() {
                // The next shard's first home slots are on their way while this one works.
                if let Some(&next) = order.peek() {
                    self.index.prefetch_group(groups.get(next), fingerprints);
                }
                let group = groups.get(n);
                let mut shard = self.index.lock(fingerprints[group[0] as usize], bucket);
                if let Err(err) = self.insert_into(batch, &mut shard, group, None) {
                    failed.get_or_insert(err);
                }
            }
        }
        if let Some(err) = failed {
            return Err(self.fail(err));
        }
        self.log_batch(batch)
            .inspect_err(|_| self.revoke_admitted(fingerprints, batch.admitted))
    }

    /// Admits one shard's `group` of a batch in `shard` (locked): `absent` are the
    /// members no older level holds, read already (the held path), or `None` to look past
    /// memory here. Publishes the table's place and the keys' stamps.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn insert_into(
        &self,
        batch: &mut Batch<'_>,
        shard: &mut Shard,
        group: &[u32],
        absent: Option<&[u32]>,
    ) -> Result<()> {
        let fingerprints = batch.fingerprints;
        let inserted = match absent {
            Some(members) => {
                admit_group(shard, members, fingerprints, batch.admitted);
                shard.after_writes(group.len());
                Ok(())
            }
            None => {
                let sealed = self.sealed_keys();
                insert_group(
                    shard,
                    group,
                    (fingerprints, batch.pending),
                    batch.admitted,
                    sealed,
                )
            }
        };
        self.index
            .publish_table(fingerprints[group[0] as usize], shard);
        for &index in group {
            if let Some(stamp) = batch.stamps.get_mut(index as usize) {
                *stamp = shard.current();
            }
        }
        inserted
    }

    /// Logs the keys a batch admitted (in memory: nothing); the ticket to wait for.
    fn log_batch(&self, batch: &mut Batch<'_>) -> Result<Option<Ticket>> {
        if self.journal.is_none() {
            return Ok(None);
        }
        self.log_admitted(
            batch.fingerprints,
            batch.stamps,
            batch.admitted,
            batch.logged,
        )
    }

    /// Takes back every key a batch admitted, whose write the log refused.
    fn revoke_admitted(&self, fingerprints: &[Fingerprint], admitted: &[bool]) {
        let taken = admitted_fingerprints(fingerprints, admitted);
        self.index
            .revoke_keys(&taken, self.current_bucket(), || true);
    }

    /// The memory budget's work after a write's keys are logged ([`Engine::after_inserts`]:
    /// a seal to start or settle, runs to retire, a wait at the bound). A failure there
    /// poisons the store, whatever its kind, for the calls after; it never fails the call
    /// that met it, whose keys memory admitted and the log holds (a caller told "failed"
    /// would retry and find them duplicates).
    fn budget_after_logging(&self, admitted: u64) {
        if let Err(err) = self.after_inserts(admitted) {
            let err = match &self.journal {
                Some(journal) => journal.poison_with(err),
                None => err,
            };
            log::error!("oncedb: the memory budget's work failed, the store is poisoned: {err}");
        }
    }

    /// Logs the admitted keys of a batch, one entry per bucket stamp (almost always one);
    /// the ticket to wait for, if any was admitted.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn log_admitted(
        &self,
        fingerprints: &[Fingerprint],
        stamps: &[u64],
        admitted: &[bool],
        logged: &mut Vec<(u64, Fingerprint)>,
    ) -> Result<Option<Ticket>> {
        logged.clear();
        logged.extend(
            fingerprints
                .iter()
                .zip(stamps)
                .zip(admitted)
                .filter(|&(_, &yes)| yes)
                .map(|((&fp, &stamp), _)| (stamp, fp)),
        );
        let Some(&(first_stamp, _)) = logged.first() else {
            return Ok(None);
        };
        if logged.iter().all(|&(stamp, _)| stamp == first_stamp) {
            // The common case: one stamp, one entry, nothing to sort or copy out.
            self.enqueue_keys(first_stamp, logged)
        } else {
            // A batch that met a bucket boundary (rare): one entry per stamp.
            logged.sort_by_key(|&(stamp, _)| stamp);
            let fps: Vec<Fingerprint> = logged.iter().map(|&(_, fp)| fp).collect();
            let mut entries = Vec::new();
            let mut start = 0;
            for run in logged.chunk_by(|a, b| a.0 == b.0) {
                entries.push(LogEntry::Keys {
                    bucket: run[0].0,
                    fingerprints: &fps[start..start + run.len()],
                });
                start += run.len();
            }
            self.enqueue(&entries)
        }
    }

    /// Logs one `Keys` entry for `logged`, all stamped `stamp`.
    fn enqueue_keys(&self, stamp: u64, logged: &[(u64, Fingerprint)]) -> Result<Option<Ticket>> {
        KEY_LIST.with(|list| {
            let mut list = list.take();
            list.clear();
            list.extend(logged.iter().map(|&(_, fp)| fp));
            let ticket = self.enqueue(&[LogEntry::Keys {
                bucket: stamp,
                fingerprints: &list,
            }]);
            KEY_LIST.set(list);
            ticket
        })
    }

    /// Whether `key` is live, once the write that admitted it is acknowledged. Read only.
    pub(crate) fn contains(&self, key: &[u8]) -> Result<bool> {
        self.check_key(key)?;
        let fingerprint = self.hasher.key(key);
        loop {
            let looked_at = self.looked_at();
            self.index.prefetch_home(fingerprint);
            let bucket = self.current_bucket();
            let (live, found) = {
                let mut shard = self.index.lock(fingerprint, bucket);
                let live = shard.contains_key_anywhere(fingerprint, self.sealed_keys())?;
                (
                    live,
                    live.then(|| self.key_dependency(&shard, fingerprint))
                        .flatten(),
                )
            };
            let rests = Rests::depending(self.resolve(found), looked_at);
            if self.settle_answer(rests, &mut Settle::Block)? == Concluded::Stands {
                return Ok(live);
            }
        }
    }

    /// Looks up or creates the record of `scoped_key`. A new record is logged under the
    /// shard lock, so the log holds the records of one key in the order memory saw them.
    pub(crate) fn reserve(&self, scoped_key: &[u8], request: &[u8]) -> Result<Reserved> {
        self.reserve_settled(scoped_key, request, &mut Settle::Block)
    }

    /// [`Engine::reserve`], waiting for the log as `settle` says.
    pub(crate) fn reserve_settled(
        &self,
        scoped_key: &[u8],
        request: &[u8],
        settle: &mut Settle,
    ) -> Result<Reserved> {
        let fingerprint = self.hasher.record(scoped_key);
        loop {
            // `None`: the answer found lost the write it rested on; look again.
            let Some(reserved) = self.reserve_once(fingerprint, scoped_key, request, settle)?
            else {
                continue;
            };
            match reserved {
                Reserved::Existing(record) => {
                    if let Some(record) = self.read_back(fingerprint, scoped_key, record)? {
                        return Ok(Reserved::Existing(record));
                    }
                    // The response's segment expired since, and the record with it: the
                    // next round finds the key absent.
                }
                Reserved::Mismatch {
                    key_logged: Some(span),
                } => {
                    if self.key_in_log_is(fingerprint, scoped_key, span)? {
                        return Ok(Reserved::Mismatch { key_logged: None });
                    }
                }
                other => return Ok(other),
            }
        }
    }

    /// One look of [`Engine::reserve_settled`]: the answer, or `None` if it depended on
    /// another call's write that was taken back meanwhile.
    fn reserve_once(
        &self,
        fingerprint: Fingerprint,
        scoped_key: &[u8],
        request: &[u8],
        settle: &mut Settle,
    ) -> Result<Option<Reserved>> {
        self.check_writable()?;
        let looked_at = self.looked_at();
        let request_hash = self.hasher.request(request);
        let now_ms = self.clock.now_ms();
        let bucket = self.bucket_at(now_ms);
        let (reserved, rests) = {
            let mut shard = self.index.lock(fingerprint, bucket);
            let reserved = shard.reserve(
                fingerprint,
                scoped_key,
                request_hash,
                (now_ms, self.lease_timeout_ms),
                (self.sealed_records(), || self.next_lease_id()),
            )?;
            let (own, undo, dependency) = match reserved {
                Reserved::Acquired(grant) => {
                    let entry = LogEntry::Reserve {
                        fingerprint,
                        lease_id: grant.lease_id,
                        request_hash,
                        created_ms: now_ms,
                        bucket: shard.current(),
                        scoped_key,
                    };
                    let ticket = self
                        .enqueue_reserve(&mut shard, grant, &entry)
                        .inspect_err(|_| {
                            // The log refused it: the record was never there.
                            let _ =
                                shard.finish(fingerprint, grant.lease_id, &Finish::Release, now_ms);
                        })?;
                    (ticket, self.undo_record(grant, ticket), None)
                }
                Reserved::TakenOver { grant, old } => {
                    let entry = LogEntry::TakeOver {
                        fingerprint,
                        old,
                        new: grant.lease_id,
                        at_ms: now_ms,
                    };
                    (self.enqueue_in(&mut shard, &[entry])?, Undo::Nothing, None)
                }
                Reserved::InFlight { .. } | Reserved::Existing(_) | Reserved::Mismatch { .. } => {
                    (None, Undo::Nothing, self.dependency(&shard))
                }
            };
            let rests = Rests {
                own,
                undo,
                dependency,
                looked_at,
            };
            (reserved, rests)
        };
        let concluded = self.settle_answer(rests, settle)?;
        if matches!(reserved, Reserved::Acquired(_)) {
            // A new record may bring the records memory holds to the budget's share.
            self.budget_after_logging(1);
        }
        Ok((concluded == Concluded::Stands).then_some(reserved))
    }

    /// What a new record's reserve (logged up to `ticket`) takes back if its wait
    /// fails: under `Sync` only, where a wait can fail with the store still open.
    fn undo_record(&self, grant: Grant, ticket: Option<Ticket>) -> Undo {
        match (ticket, &self.journal) {
            (Some(ticket), Some(journal)) if journal.answers_wait() => {
                Undo::Record(grant.fingerprint, grant.lease_id, ticket)
            }
            _ => Undo::Nothing,
        }
    }

    /// The live record of `scoped_key`, if any, once the write it shows is acknowledged.
    pub(crate) fn get(&self, scoped_key: &[u8]) -> Result<Option<Record>> {
        self.get_settled(scoped_key, &mut Settle::Block)
    }

    /// [`Engine::get`], waiting for the write the record shows as `settle` says (a
    /// deferred caller awaits [`Engine::committed`] and asks again on `Redo`).
    pub(crate) fn get_settled(
        &self,
        scoped_key: &[u8],
        settle: &mut Settle,
    ) -> Result<Option<Record>> {
        let fingerprint = self.hasher.record(scoped_key);
        loop {
            let looked_at = self.looked_at();
            let bucket = self.current_bucket();
            let (record, dependency) = {
                let mut shard = self.index.lock(fingerprint, bucket);
                let record = shard.get(fingerprint, scoped_key, self.sealed_records())?;
                let dependency = record.as_ref().and_then(|_| self.dependency(&shard));
                (record, dependency)
            };
            let rests = Rests::depending(dependency, looked_at);
            if self.settle_answer(rests, settle)? == Concluded::Redo {
                continue;
            }
            return match record {
                Some(record) => self.read_back(fingerprint, scoped_key, record),
                None => Ok(None),
            };
        }
    }

    /// Ends lease `lease_id` of the record of `fingerprint`, logged under the shard lock.
    /// An input error (a response over the limit) is reported before anything changes.
    pub(crate) fn finish(
        &self,
        fingerprint: Fingerprint,
        lease_id: u64,
        finish: Finish,
    ) -> Result<()> {
        self.finish_settled(fingerprint, lease_id, finish, &mut Settle::Block)?;
        self.ended(fingerprint);
        Ok(())
    }

    /// A lease on the record of `fingerprint` ended, its entry committed: wakes the
    /// callers waiting for it.
    pub(crate) fn ended(&self, fingerprint: Fingerprint) {
        self.endings.ended(fingerprint.0);
    }

    /// Registers a wait for the end of the record of `scoped_key`.
    fn watch_ending(&self, scoped_key: &[u8]) -> Watch {
        let key = self.hasher.record(scoped_key).0;
        (key, self.endings.register(key))
    }

    /// Takes back a wait registered by [`Engine::watch_ending`] that gave up.
    pub(crate) fn forget_ending(&self, (key, ending): &Watch) {
        self.endings.forget(*key, ending);
    }

    /// How long a waiter sleeps at most before it looks again: a lease timeout (a
    /// holder that stopped renewing may be taken over then), or `None`.
    pub(crate) fn lease_timeout(&self) -> Option<std::time::Duration> {
        self.lease_timeout_ms.map(std::time::Duration::from_millis)
    }

    /// One look of a wait for the end of the record of `scoped_key`: registered on its
    /// ending first, then the record read, so that no ending between the two is missed.
    /// The record if it is no longer in flight (finished, released, expired), if its
    /// lease lapsed (it may be taken over now), or if `deadline` passed; otherwise the
    /// registration and when to look again (the deadline, or when the holder's lease
    /// runs out: a holder that stopped renewing may be taken over then). A caller that wakes without the ending forgets the
    /// registration ([`Engine::forget_ending`]) and looks again.
    pub(crate) fn look_for_ending(
        &self,
        scoped_key: &[u8],
        deadline: std::time::Instant,
        settle: &mut Settle,
    ) -> std::result::Result<Result<Option<Record>>, (Watch, std::time::Instant)> {
        let watch = self.watch_ending(scoped_key);
        let record = self.get_settled(scoped_key, settle);
        let now = std::time::Instant::now();
        let in_flight = matches!(&record, Ok(Some(r)) if r.status == RecordStatus::InFlight);
        let lease_left = match in_flight {
            true => self.lease_left(scoped_key),
            false => Ok(None),
        };
        // A lapsed lease answers at once: the caller may take the record over now.
        let lapsed = matches!(lease_left, Ok(Some(left)) if left.is_zero());
        if !in_flight || lapsed || now >= deadline {
            self.forget_ending(&watch);
            return Ok(record);
        }
        let wake = match lease_left {
            Ok(Some(left)) => deadline.min(now + left),
            Ok(None) => deadline,
            Err(err) => {
                self.forget_ending(&watch);
                return Ok(Err(err));
            }
        };
        Err((watch, wake))
    }

    /// How long the lease holding the record of `scoped_key` in flight has left before
    /// it may be taken over, on the store's clock: `None` without a lease timeout, for a
    /// noted record (never taken over automatically), or a record not in flight.
    fn lease_left(&self, scoped_key: &[u8]) -> Result<Option<std::time::Duration>> {
        let Some(timeout_ms) = self.lease_timeout_ms else {
            return Ok(None);
        };
        let fingerprint = self.hasher.record(scoped_key);
        let held = {
            let mut shard = self.index.lock(fingerprint, self.current_bucket());
            shard.lease_of(fingerprint, scoped_key, self.sealed_records())?
        };
        Ok(match held {
            Some((leased_ms, false)) => {
                let held_ms = self.clock.now_ms().saturating_sub(leased_ms);
                Some(std::time::Duration::from_millis(
                    timeout_ms.saturating_sub(held_ms),
                ))
            }
            _ => None,
        })
    }

    /// Blocks until the record of `scoped_key` is not in flight or `deadline` passes,
    /// and returns it as it then is ([`Engine::look_for_ending`], woken by the ending).
    pub(crate) fn wait_finished(
        &self,
        scoped_key: &[u8],
        deadline: std::time::Instant,
    ) -> Result<Option<Record>> {
        loop {
            match self.look_for_ending(scoped_key, deadline, &mut Settle::Block) {
                Ok(record) => return record,
                Err((watch, wake)) => {
                    if !watch.1.wait_until(wake) {
                        self.forget_ending(&watch);
                    }
                }
            }
        }
    }

    /// [`Engine::finish`], waiting for the log as `settle` says. A deferred finish
    /// queues its response to move to the log once written, like any other.
    pub(crate) fn finish_settled(
        &self,
        fingerprint: Fingerprint,
        lease_id: u64,
        finish: Finish,
        settle: &mut Settle,
    ) -> Result<()> {
        self.check_response(finish.response())?;
        self.check_writable()?;
        let now_ms = self.clock.now_ms();
        let bucket = self.bucket_at(now_ms);
        let located = {
            let mut shard = self.index.lock(fingerprint, bucket);
            shard.finish(fingerprint, lease_id, &finish, now_ms)?;
            let entry = LogEntry::Finish {
                fingerprint,
                lease_id,
                at_ms: now_ms,
                finish: &finish,
            };
            match &self.journal {
                Some(journal) => {
                    let bucket = self.high_water.load(Ordering::Acquire);
                    let (ticket, span) = journal.enqueue_located(bucket, &[entry])?;
                    shard.logged(ticket.position());
                    Some((ticket, span))
                }
                None => None,
            }
        };
        let Some((ticket, span)) = located else {
            return Ok(());
        };
        self.settle(Some(ticket), settle)?;
        let unwritten = (!matches!(finish, Finish::Release)).then_some(responses::Unwritten {
            ticket,
            fingerprint,
            lease_id,
            span,
        });
        self.log_responses(unwritten);
        Ok(())
    }

    /// Attaches `note` to the record lease `lease_id` holds in flight, durably.
    pub(crate) fn note(&self, fingerprint: Fingerprint, lease_id: u64, note: &[u8]) -> Result<()> {
        self.note_settled((fingerprint, lease_id), note, &mut Settle::Block)
    }

    /// [`Engine::note`], waiting for the log as `settle` says.
    pub(crate) fn note_settled(
        &self,
        (fingerprint, lease_id): (Fingerprint, u64),
        note: &[u8],
        settle: &mut Settle,
    ) -> Result<()> {
        if note.len() > MAX_NOTE_BYTES {
            return Err(Error::NoteTooLong { len: note.len() });
        }
        self.check_writable()?;
        let note: Arc<[u8]> = Arc::from(note);
        let bucket = self.current_bucket();
        let ticket = {
            let mut shard = self.index.lock(fingerprint, bucket);
            shard.note(fingerprint, lease_id, &note)?;
            self.enqueue_in(
                &mut shard,
                &[LogEntry::Note {
                    fingerprint,
                    lease_id,
                    note: &note,
                }],
            )?
        };
        self.settle(ticket, settle)
    }

    /// Renews lease `lease_id`: the lease timeout counts from now, durably (logged as a
    /// take-over of the lease by itself, under the shard lock).
    pub(crate) fn renew_settled(
        &self,
        (fingerprint, lease_id): (Fingerprint, u64),
        settle: &mut Settle,
    ) -> Result<()> {
        self.check_writable()?;
        let now_ms = self.clock.now_ms();
        let bucket = self.bucket_at(now_ms);
        let ticket = {
            let mut shard = self.index.lock(fingerprint, bucket);
            shard.renew(fingerprint, lease_id, now_ms)?;
            self.enqueue_in(
                &mut shard,
                &[LogEntry::TakeOver {
                    fingerprint,
                    old: lease_id,
                    new: lease_id,
                    at_ms: now_ms,
                }],
            )?
        };
        self.settle(ticket, settle)
    }

    /// A new, higher lease on the record of `scoped_key` if it is in flight; the old
    /// lease is fenced from then on, across reopens too (the take-over is logged under
    /// the shard lock, like the reserve it follows).
    pub(crate) fn take_over(&self, scoped_key: &[u8]) -> Result<Option<Grant>> {
        self.take_over_settled(scoped_key, &mut Settle::Block)
    }

    /// [`Engine::take_over`], waiting for the log as `settle` says.
    pub(crate) fn take_over_settled(
        &self,
        scoped_key: &[u8],
        settle: &mut Settle,
    ) -> Result<Option<Grant>> {
        self.check_writable()?;
        let fingerprint = self.hasher.record(scoped_key);
        let now_ms = self.clock.now_ms();
        let bucket = self.bucket_at(now_ms);
        let (taken, ticket) = {
            let mut shard = self.index.lock(fingerprint, bucket);
            match shard.take_over(fingerprint, scoped_key, now_ms, || self.next_lease_id())? {
                None => (None, None),
                Some((old, new, since_ms)) => {
                    let ticket = self.enqueue_in(
                        &mut shard,
                        &[LogEntry::TakeOver {
                            fingerprint,
                            old,
                            new,
                            at_ms: now_ms,
                        }],
                    )?;
                    let taken = Grant {
                        fingerprint,
                        lease_id: new,
                        since_ms,
                    };
                    (Some(taken), ticket)
                }
            }
        };
        self.settle(ticket, settle)?;
        Ok(taken)
    }

    /// The lease `lease_id` on the record of `scoped_key`, if it still holds it in
    /// flight: `Fenced` if a newer lease does, `LeaseLost` if none does.
    pub(crate) fn resume(&self, scoped_key: &[u8], lease_id: u64) -> Result<Grant> {
        let fingerprint = self.hasher.record(scoped_key);
        let bucket = self.current_bucket();
        let since_ms =
            self.index
                .lock(fingerprint, bucket)
                .check_lease(fingerprint, scoped_key, lease_id)?;
        Ok(Grant {
            fingerprint,
            lease_id,
            since_ms,
        })
    }

    /// Records in flight for at least `older_than_ms`, one shard locked at a time.
    pub(crate) fn in_flight(&self, older_than_ms: u64) -> Vec<InFlightRecord> {
        let before_ms = self.clock.now_ms().saturating_sub(older_than_ms);
        self.index.in_flight(self.current_bucket(), before_ms)
    }

    /// The ordering guard for the aggregate of `scoped_key`; an applied version is
    /// logged under the shard lock, stamped with its bucket.
    pub(crate) fn advance(&self, scoped_key: &[u8], version: u64) -> Result<Advance> {
        self.advance_settled(scoped_key, version, &mut Settle::Block)
    }

    /// [`Engine::advance`], waiting for the log as `settle` says.
    pub(crate) fn advance_settled(
        &self,
        scoped_key: &[u8],
        version: u64,
        settle: &mut Settle,
    ) -> Result<Advance> {
        let fingerprint = self.hasher.mark(scoped_key);
        loop {
            self.check_writable()?;
            let looked_at = self.looked_at();
            let bucket = self.current_bucket();
            let (answer, rests) = {
                let mut shard = self.index.lock(fingerprint, bucket);
                let answer = shard.advance_version(fingerprint, scoped_key, version)?;
                let (own, dependency) = match answer {
                    Advance::Applied => {
                        let stamp = shard.current();
                        let entry = LogEntry::Advance {
                            fingerprint,
                            version,
                            bucket: stamp,
                            scoped_key,
                        };
                        (self.enqueue_in(&mut shard, &[entry])?, None)
                    }
                    // A duplicate or stale version rests on the applied one.
                    _ => (None, self.dependency(&shard)),
                };
                let rests = Rests {
                    own,
                    undo: Undo::Nothing,
                    dependency,
                    looked_at,
                };
                (answer, rests)
            };
            if self.settle_answer(rests, settle)? == Concluded::Stands {
                return Ok(answer);
            }
        }
    }

    /// Per live bucket: its number, live keys, records and aggregates, and the bytes of
    /// its segment files.
    pub(crate) fn buckets(&self) -> Vec<(u64, [u64; 3], u64)> {
        let mut counts = self.index.bucket_counts(self.current_bucket());
        let mut bytes = std::collections::BTreeMap::<u64, u64>::new();
        if let Some(journal) = &self.journal {
            for ((bucket, _), len) in journal.segment_sizes() {
                *bytes.entry(bucket).or_default() += len;
                counts.entry(bucket).or_default();
            }
        }
        counts
            .into_iter()
            .map(|(bucket, count)| (bucket, count, bytes.get(&bucket).copied().unwrap_or(0)))
            .collect()
    }

    /// The record runs, for the index to look records up in.
    fn sealed_records(&self) -> Option<&dyn SealedRecords> {
        self.sealer
            .as_ref()
            .map(|sealer| sealer.runs() as &dyn SealedRecords)
    }

    /// The sealed runs, for the index to look keys up in.
    fn sealed_keys(&self) -> Option<&dyn SealedKeys> {
        self.sealer
            .as_ref()
            .map(|sealer| sealer.runs() as &dyn SealedKeys)
    }

    /// Whether calls may write files (and so wait for an fsync).
    pub(crate) fn is_durable(&self) -> bool {
        self.journal.is_some()
    }

    pub(crate) fn window(&self) -> Window {
        self.window
    }

    /// Durability barrier; it also waits for the seal under way, if any.
    pub(crate) fn flush(&self) -> Result<()> {
        match &self.journal {
            Some(journal) => journal.flush()?,
            None => return Ok(()),
        }
        self.log_responses(None);
        self.wait_for_seal()
    }

    /// Copies the store into the empty (or new) directory `dir` while writers go on: the
    /// sealed runs, held while they are linked so that none is merged away meanwhile;
    /// then the log, after a group commit of everything appended so far (sealed segments
    /// linked, the active segment copied to the end of its last fsynced group); then the
    /// manifest. Runs come first: each covers a log position at or before the end of
    /// what was appended when it was sealed, which the log copied afterwards holds. A
    /// failure leaves a partial copy without a manifest (which no open takes for a
    /// store) and never poisons the source, unless its own log fails.
    pub(crate) fn checkpoint(&self, dir: &std::path::Path) -> Result<crate::wal::Checkpoint> {
        let Some(journal) = &self.journal else {
            return Err(Error::InvalidOptions(
                "an in-memory store has no files to checkpoint".to_owned(),
            ));
        };
        let storage = journal.storage();
        crate::wal::prepare_checkpoint_dir(storage, dir)?;
        let mut done = crate::wal::Checkpoint::default();
        let held = self.sealer.as_ref().map(|sealer| sealer.runs().hold());
        for run in held.iter().flat_map(|runs| runs.iter()) {
            if !crate::wal::link_or_copy(storage, run.path(), dir, &mut done)? {
                return Err(Error::Io(std::io::Error::new(
                    std::io::ErrorKind::NotFound,
                    format!("live run {} vanished", run.path().display()),
                )));
            }
        }
        let view = journal.checkpoint_view()?;
        drop(held);
        for segment in &view.sealed {
            // A segment gone meanwhile left the window: it belongs in no copy.
            crate::wal::link_or_copy(storage, segment, dir, &mut done)?;
        }
        if let Some((path, len)) = &view.active {
            let to = dir.join(path.file_name().unwrap_or_default());
            crate::wal::copy_prefix(storage, path, &to, *len, &mut done)?;
        }
        crate::wal::finish_checkpoint(storage, dir, &view.manifest)?;
        done.position = view.position;
        Ok(done)
    }

    /// Fetches the replica `config` names into its directory, then opens the store there
    /// with the replica's window and bucket width, claiming the replica.
    #[cfg(feature = "replicate")]
    pub(crate) fn restore(
        mut config: Config,
        progress: &mut (dyn FnMut(u64, u64) + Send),
    ) -> Result<(Engine, crate::replica::RestoreReport)> {
        let (Some(dir), Some(replication)) = (config.dir.clone(), config.replication.clone())
        else {
            return Err(Error::InvalidOptions(
                "restore needs a durable store (Options::new) and Options::replicate".to_owned(),
            ));
        };
        let now_ms = config.clock.now_ms();
        let report = crate::replica::fetch(&replication, &*config.storage, &dir, now_ms, progress)?;
        Engine::open_claiming(&mut config)?;
        Ok((Engine::open(&config)?, report))
    }

    /// Starts a standby of the replica `config` names in its directory.
    #[cfg(feature = "replicate")]
    pub(crate) fn standby(config: &Config) -> Result<Follower> {
        let (Some(dir), Some(replication)) = (config.dir.clone(), config.replication.clone())
        else {
            return Err(Error::InvalidOptions(
                "a standby needs a durable store (Options::new) and Options::replicate".to_owned(),
            ));
        };
        Follower::start(
            replication,
            Arc::clone(&config.storage),
            dir,
            Arc::clone(&config.clock),
        )
    }

    /// Promotes a standby: copies what it lacks, then opens the store, claiming the
    /// replica, with the replica's window and bucket width.
    #[cfg(feature = "replicate")]
    pub(crate) fn promote(
        mut config: Config,
        follower: Follower,
    ) -> Result<(Engine, crate::replica::RestoreReport)> {
        let report = follower.catch_up(config.clock.now_ms())?;
        Engine::open_claiming(&mut config)?;
        Ok((Engine::open(&config)?, report))
    }

    /// Readies `config` to open a directory just copied from its replica: the replica's
    /// window and bucket width. The copy claimed the replica before it began (its token
    /// is in the directory), so the opening store finds itself the owner.
    #[cfg(feature = "replicate")]
    fn open_claiming(config: &mut Config) -> Result<()> {
        if let Some(dir) = &config.dir
            && let Some(manifest) = Manifest::load(&*config.storage, dir)?
        {
            config.window_ms = manifest.window_ms;
            config.bucket_width_ms = manifest.bucket_width_ms;
        }
        config.validate()
    }

    pub(crate) fn recovery_report(&self) -> Option<&RecoveryReport> {
        self.recovery.as_ref()
    }

    /// Live sealed runs not among the ids `shipped` (those the replica holds whole).
    fn runs_unshipped(&self, shipped: Option<&[u64]>) -> u64 {
        let (Some(shipped), Some(sealer)) = (shipped, &self.sealer) else {
            return 0;
        };
        let runs = sealer.runs().hold();
        runs.iter()
            .filter(|run| !shipped.contains(&run.summary().run_id))
            .count() as u64
    }

    pub(crate) fn stats(&self) -> EngineStats {
        let bucket = self.current_bucket();
        let stuck_before = self.clock.now_ms().saturating_sub(self.stuck_after_ms);
        let journal = self.journal.as_ref().map(Journal::stats);
        let shipped = self
            .journal
            .as_ref()
            .and_then(Journal::replica_runs_shipped);
        let bytes_on_disk = journal.as_ref().map_or(0, |journal| {
            journal.segment_bytes + u64::try_from(MANIFEST_LEN).unwrap_or(u64::MAX)
        });
        EngineStats {
            index: self.index.stats(bucket),
            journal,
            bytes_on_disk,
            clock_held_back: self.clock_held_back.load(Ordering::Relaxed),
            buckets_dropped: bucket - self.opened_bucket,
            stuck_records: self.index.count_in_flight(bucket, stuck_before),
            outcome_waiters: self.endings.waiters(),
            sealing: self
                .sealer
                .as_ref()
                .map(sealing::Sealer::stats)
                .unwrap_or_default(),
            replica_runs_unshipped: self
                .runs_unshipped(shipped.as_ref().map(|runs| &runs.whole[..])),
            replica_runs_awaiting_log: shipped.map_or(0, |runs| runs.awaiting_log),
        }
    }
}

/// The order a batch visits its shard groups in: from one that depends on the batch, so
/// that concurrent batches do not walk the shards in lockstep and queue behind each other.
#[expect(
    clippy::cast_possible_truncation,
    reason = "the remainder is below the group count, a usize"
)]
fn batch_order(groups: &ShardGroups, fingerprints: &[Fingerprint]) -> impl Iterator<Item = usize> {
    let count = groups.len();
    let start = match fingerprints.first() {
        Some(first) if count > 0 => (first.tag() % count as u64) as usize,
        _ => 0,
    };
    (start..count).chain(0..start)
}

/// The batch path's buffers, one set per thread, kept across calls: once they have grown
/// to the largest batch a thread sends, `insert_many` allocates nothing.
#[derive(Default)]
struct Scratch {
    fingerprints: Vec<Fingerprint>,
    stamps: Vec<u64>,
    groups: ShardGroups,
    logged: Vec<(u64, Fingerprint)>,
    /// One group's keys that no older level holds.
    pending: Vec<u32>,
    /// The marked batches a batch's duplicates found, waited for once its shards are
    /// released.
    marks: Vec<BatchMark>,
}

thread_local! {
    static SCRATCH: std::cell::Cell<Scratch> = std::cell::Cell::new(Scratch::default());
    static KEY_LIST: std::cell::Cell<Vec<Fingerprint>> = const { std::cell::Cell::new(Vec::new()) };
}

impl Scratch {
    /// Runs `f` with this thread's buffers. They are taken out of the thread-local for the
    /// call, so a nested call (none exists today) would get fresh ones rather than panic.
    fn with<T>(f: impl FnOnce(&mut Scratch) -> T) -> T {
        let mut scratch = SCRATCH.take();
        let answer = f(&mut scratch);
        SCRATCH.set(scratch);
        answer
    }
}

/// The first pass of a batch over held shards: for each group whose shard has older
/// levels (a frozen table, sealed runs), its members that none holds, appended to `found`
/// (the range of them is returned), read before anything is admitted; `None` for a shard
/// with none (memory alone answers). Nothing of the batch is admitted if a run page fails
/// to read. The answers stay true until the locks drop: no shard held can freeze, and a
/// run published meanwhile holds only keys its shards' frozen tables still hold (they are
/// released under the shard locks).
fn absent_from_older_levels(
    shards: &mut [parking_lot::MutexGuard<'_, Shard>],
    groups: &ShardGroups,
    fingerprints: &[Fingerprint],
    sealed: Option<&dyn SealedKeys>,
    found: &mut Vec<u32>,
) -> Result<Vec<Option<std::ops::Range<usize>>>> {
    let mut absent = Vec::with_capacity(shards.len());
    let mut pending = Vec::new();
    for (shard, group) in shards.iter_mut().zip(groups.iter()) {
        if !shard.has_older_levels(sealed) {
            absent.push(None);
            continue;
        }
        shard.absent_from_older_levels((group, fingerprints), sealed, &mut pending)?;
        let start = found.len();
        found.extend_from_slice(&pending);
        absent.push(Some(start..found.len()));
    }
    Ok(absent)
}

/// The positions and keys of a batch answered "seen", to ask again.
pub(crate) fn seen_keys<'k, K: AsRef<[u8]>>(
    keys: &'k [K],
    admitted: &[bool],
) -> (Vec<usize>, Vec<&'k [u8]>) {
    keys.iter()
        .zip(admitted)
        .enumerate()
        .filter(|&(_, (_, &new))| !new)
        .map(|(position, (key, _))| (position, key.as_ref()))
        .unzip()
}

/// Puts the answers of keys asked again ([`seen_keys`]) back at their positions.
pub(crate) fn merge_answers(admitted: &mut [bool], positions: &[usize], answers: &[bool]) {
    for (&position, &new) in positions.iter().zip(answers) {
        if let Some(slot) = admitted.get_mut(position) {
            *slot = new;
        }
    }
}

/// The fingerprints of a batch's admitted keys.
fn admitted_fingerprints(fingerprints: &[Fingerprint], admitted: &[bool]) -> Vec<Fingerprint> {
    let mut taken = Vec::with_capacity(admitted.iter().filter(|&&new| new).count());
    taken.extend(
        fingerprints
            .iter()
            .zip(admitted)
            .filter(|&(_, &new)| new)
            .map(|(&fp, _)| fp),
    );
    taken
}

/// A batch's keys while they are admitted: the calling thread's scratch buffers.
struct Batch<'s> {
    fingerprints: &'s [Fingerprint],
    /// The bucket stamp each key got (empty in memory, where nothing is logged).
    stamps: &'s mut [u64],
    admitted: &'s mut [bool],
    /// The members of a group no older level holds (the unheld path's lookups).
    pending: &'s mut Vec<u32>,
    /// The admitted keys as logged.
    logged: &'s mut Vec<(u64, Fingerprint)>,
    /// The marked batches its duplicates found (see [`Found`]).
    marks: &'s mut Vec<BatchMark>,
}

/// The unacknowledged writes a batch's duplicates found under their shard locks: the
/// newest logged one here, and the marked batches (each once) in the batch's `marks`, to
/// wait for once no shard is held.
#[derive(Default)]
pub(super) struct Found {
    logged: Option<Ticket>,
}

impl Found {
    pub(super) fn add(&mut self, write: Option<PendingWrite>, marks: &mut Vec<BatchMark>) {
        match write {
            Some(PendingWrite::Logged(position)) => {
                self.logged = self.logged.max(Some(Ticket::at(position)));
            }
            Some(PendingWrite::Batch(mark)) if !marks.contains(&mark) => marks.push(mark),
            Some(PendingWrite::Batch(_)) | None => {}
        }
    }
}

/// The shard locks a batch holds at once, inline for up to the default shard count.
type HeldShards<'a> = SmallVec<[parking_lot::MutexGuard<'a, Shard>; 64]>;

/// Takes back, in the shards a batch still holds, every key it admitted: the log
/// refused its write, and nobody has seen them.
#[expect(
    clippy::indexing_slicing,
    reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
)]
fn revoke_held(
    shards: &mut [parking_lot::MutexGuard<'_, Shard>],
    groups: &ShardGroups,
    fingerprints: &[Fingerprint],
    admitted: &[bool],
) {
    for (shard, group) in shards.iter_mut().zip(groups.iter()) {
        for &index in group {
            if admitted[index as usize] {
                shard.revoke_key(fingerprints[index as usize]);
            }
        }
    }
}

/// Admits `members` of a batch (none of them in an older level) into the held shard's
/// live table.
fn admit_group(
    shard: &mut Shard,
    members: &[u32],
    fingerprints: &[Fingerprint],
    admitted: &mut [bool],
) {
    for_each_prefetched(shard, members, fingerprints, |shard, index| {
        if let (Some(slot), Some(&fingerprint)) = (admitted.get_mut(index), fingerprints.get(index))
        {
            *slot = shard.insert_key_in_memory(fingerprint);
        }
    });
}

/// Admits the keys of one shard's group, in order, after loading their home slots.
#[expect(
    clippy::indexing_slicing,
    reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
)]
fn insert_group(
    shard: &mut Shard,
    group: &[u32],
    (fingerprints, pending): (&[Fingerprint], &mut Vec<u32>),
    admitted: &mut [bool],
    sealed: Option<&dyn SealedKeys>,
) -> Result<()> {
    if shard.has_older_levels(sealed) {
        // Older levels first, for the whole group at once: each run is passed over once
        // and each of its pages read once; what no older level holds goes to memory.
        for &index in group {
            admitted[index as usize] = false;
        }
        shard.absent_from_older_levels((group, fingerprints), sealed, pending)?;
        for_each_prefetched(shard, pending, fingerprints, |shard, index| {
            admitted[index] = shard.insert_key_in_memory(fingerprints[index]);
        });
        shard.after_writes(group.len());
        return Ok(());
    }
    let mut failed = None;
    for_each_prefetched(shard, group, fingerprints, |shard, index| {
        match shard.insert_key_unchecked(fingerprints[index], sealed) {
            Ok(new) => admitted[index] = new,
            Err(err) => {
                failed.get_or_insert(err);
            }
        }
    });
    shard.after_writes(group.len());
    failed.map_or(Ok(()), Err)
}
