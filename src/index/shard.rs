//! One shard: a dedup table, a record map, and per-bucket live counts, behind one lock.

use std::collections::TryReserveError;

use super::counters::Counters;
use super::marks::MarkMap;
use super::pending::{BatchMarks, PendingKeys, PendingWrite};
use super::records::{Ending, RecordMap, StoredRecord};
use super::table::{DedupTable, Inserted};
use std::sync::Arc;

use super::records::{SealMark, Sealable};
use super::{PREFETCH_AHEAD, SealedKeys, SealedRecords};
use crate::base::{Advance, Liveness, LogSpan, Record, RecordStatus};
use crate::base::{Error, Fingerprint, Finish, FullPolicy, Result, Window};

/// Table slots swept per write while a sweep pass is under way.
pub(crate) const SWEEP_SLOTS_PER_WRITE: usize = 16;
/// Expired records removed per write.
const EXPIRE_RECORDS_PER_WRITE: usize = 4;
/// A shard whose oldest possible entry is this many buckets old is swept at once, so
/// that 32-bit bucket numbers in slots never become ambiguous (they wrap at 2^32).
const MAX_UNSWEPT_AGE_BUCKETS: u64 = 1 << 30;

/// What `reserve` found: a new lease, the live record of the key (whose status says
/// in flight, completed or failed), or a record bound to another request. The API turns
/// it into a `Reservation`.
#[derive(Debug)]
pub(crate) enum Reserved {
    /// A new record in flight under the grant's lease, stamped with the current bucket.
    Acquired(Grant),
    /// The key's record was in flight for longer than the lease timeout: it is now
    /// under the grant's lease, and lease `old` is fenced.
    TakenOver { grant: Grant, old: u64 },
    /// The key's live record is in flight under another lease, bound to the same
    /// request: reserved at `since_ms`, with its lease holder's note.
    InFlight {
        since_ms: u64,
        note: Option<std::sync::Arc<[u8]>>,
    },
    /// The key's finished record (completed or failed), bound to the same request.
    Existing(Record),
    /// The key's live record is bound to another request. A record in compact form
    /// names the frame that holds its key (`key_logged`), for the engine to compare
    /// before it answers.
    Mismatch { key_logged: Option<LogSpan> },
}

/// A lease on one record in flight: from a reserve, a take-over or a resume.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Grant {
    pub(crate) fingerprint: Fingerprint,
    pub(crate) lease_id: u64,
    /// When the record was reserved (a take-over keeps the reserve's time).
    pub(crate) since_ms: u64,
}

/// A record to store: what a reserve (live or replayed) knows about it.
#[derive(Debug)]
pub(crate) struct NewRecord<'a> {
    pub(crate) fingerprint: Fingerprint,
    pub(crate) scoped_key: &'a [u8],
    pub(crate) request_hash: u128,
    pub(crate) lease_id: u64,
    pub(crate) created_ms: u64,
    /// The reserve entry's frame, when it is already in the log (recovery); a live
    /// reserve's frame is located after it is appended (`Shard::locate_key`).
    pub(crate) key_at: Option<LogSpan>,
}

/// Live entries of one bucket: dedup keys and records.
#[derive(Debug, Clone, Copy, Default)]
struct BucketCount {
    keys: u32,
    records: u32,
    marks: u32,
}

impl BucketCount {
    fn is_empty(self) -> bool {
        self.keys == 0 && self.records == 0 && self.marks == 0
    }
}

/// A record still in flight, as `in_flight` lists it.
#[derive(Debug, Clone)]
pub(crate) struct InFlightRecord {
    pub(crate) scoped_key: Box<[u8]>,
    pub(crate) since_ms: u64,
    pub(crate) lease_id: u64,
    pub(crate) note: Option<std::sync::Arc<[u8]>>,
}

#[derive(Debug)]
pub(crate) struct Shard {
    window: Window,
    /// How long finished records keep their responses, if shorter than the window.
    retention: Option<Window>,
    /// Highest bucket this shard has seen; entries are stamped with it.
    current: u64,
    table: DedupTable,
    records: RecordMap,
    /// Live counts per bucket, at `bucket % live_buckets`.
    ring: Box<[BucketCount]>,
    /// `ring_index(current)`, kept to spare a division per insert.
    current_ring_index: usize,
    live_keys: u64,
    live_records: u64,
    live_marks: u64,
    marks: MarkMap,
    /// No table entry is older than this bucket.
    oldest_bucket: u64,
    /// `current` when the running sweep pass started.
    sweep_started: u64,
    /// A `current` at which every expiry queue (records, their aging, marks) was found
    /// with nothing due; `u64::MAX` when none was (or an eviction narrowed the window
    /// since). While `current` stays there the queues need no look: their fronts were live at it, and an entry queued since
    /// is stamped at it or carries the bucket of a record that was live at it. (A
    /// record that settles after its bucket left the window, or its response's
    /// retention, onto an empty queue waits for the next bucket to be reclaimed or
    /// aged; lookups answer it absent, or its response expired, meanwhile.)
    expiry_idle_at: u64,
    /// Buckets below this were evicted early by `FullPolicy::EvictOldest`.
    evicted_below: u64,
    /// Most live keys plus records this shard holds (`None`: unbounded).
    capacity: Option<u64>,
    policy: FullPolicy,
    pub(crate) counters: Counters,
    /// The table being written out as a sealed run: read, never written, until the run
    /// is in place.
    frozen: Option<Arc<DedupTable>>,
    huge_pages: bool,
    /// The log position just past the newest entry logged for this shard (its writes are
    /// logged under its lock): an answer that depends on an earlier write of this shard
    /// (a key seen, a record found) waits until the log is acknowledged up to here.
    logged_to: u64,
    /// Under `Sync`: the keys admitted here whose writes may not be acknowledged yet. A
    /// duplicate waits for its own key's write, not the shard's newest.
    pending_keys: PendingKeys,
}

impl Shard {
    #[expect(
        clippy::cast_possible_truncation,
        reason = "bucket stamps are 32 bits by design; indices fit the tables they index"
    )]
    pub(crate) fn new(
        (window, retention): (Window, Option<Window>),
        expected_keys: usize,
        current: u64,
        capacity: Option<u64>,
        policy: FullPolicy,
        huge_pages: bool,
    ) -> Result<Self, TryReserveError> {
        Ok(Shard {
            window,
            retention,
            current,
            table: DedupTable::with_keys(expected_keys, huge_pages)?,
            records: RecordMap::new(retention.is_some()),
            ring: vec![BucketCount::default(); window.live_buckets() as usize].into_boxed_slice(),
            current_ring_index: (current % window.live_buckets()) as usize,
            live_keys: 0,
            live_records: 0,
            live_marks: 0,
            marks: MarkMap::default(),
            oldest_bucket: current,
            sweep_started: current,
            expiry_idle_at: u64::MAX,
            evicted_below: 0,
            capacity,
            policy,
            counters: Counters::default(),
            frozen: None,
            huge_pages,
            logged_to: 0,
            pending_keys: PendingKeys::default(),
        })
    }

    /// Under `Sync`: the keys `fingerprints` were admitted by write `at` (logged, or a
    /// batch's not yet), not acknowledged yet; the keys whose writes are acknowledged up
    /// to `acknowledged` are forgotten first.
    pub(crate) fn note_pending_keys(
        &mut self,
        fingerprints: impl Iterator<Item = Fingerprint>,
        at: PendingWrite,
        (acknowledged, marks): (u64, &BatchMarks),
    ) {
        self.pending_keys.note(
            fingerprints.map(|fingerprint| fingerprint.tag()),
            at,
            acknowledged,
            marks,
        );
    }

    /// The write that admitted `fingerprint`, if it may not be acknowledged up to
    /// `acknowledged` yet.
    pub(crate) fn pending_write(
        &self,
        fingerprint: Fingerprint,
        (acknowledged, marks): (u64, &BatchMarks),
    ) -> Option<PendingWrite> {
        if self.logged_to <= acknowledged && !self.pending_keys.has_marks() {
            return None;
        }
        self.pending_keys
            .find(fingerprint.tag(), acknowledged, marks)
    }

    /// A write of this shard was logged up to `position` (called under the shard lock
    /// that ordered it in memory).
    pub(crate) fn logged(&mut self, position: u64) {
        self.logged_to = self.logged_to.max(position);
    }

    /// The log position past the newest entry logged for this shard.
    pub(crate) fn logged_to(&self) -> u64 {
        self.logged_to
    }

    /// Takes back the admission of a dedup key whose write failed: it leaves the live
    /// table and its bucket's count. False if the live table does not hold it (a seal
    /// took the table meanwhile, or it expired).
    #[expect(
        clippy::cast_possible_truncation,
        reason = "bucket stamps are 32 bits by design; indices fit the tables they index"
    )]
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    pub(crate) fn revoke_key(&mut self, fingerprint: Fingerprint) -> bool {
        let live = self.view().liveness(self.current);
        let Some(stamp) = self.table.remove(fingerprint.tag(), live) else {
            return false;
        };
        // The stamp is the low 32 bits of a live bucket, at most the current one.
        let age = (self.current as u32).wrapping_sub(stamp);
        let bucket = self.current.saturating_sub(u64::from(age));
        let index = self.ring_index(bucket);
        self.ring[index].keys = self.ring[index].keys.saturating_sub(1);
        self.live_keys = self.live_keys.saturating_sub(1);
        self.counters.admitted = self.counters.admitted.saturating_sub(1);
        true
    }

    /// The bucket new entries are stamped with.
    pub(crate) fn current(&self) -> u64 {
        self.current
    }

    /// The window as this shard applies it: shortened while early-evicted buckets would
    /// otherwise still be inside it.
    fn view(&self) -> Window {
        let mut view = self.window;
        view.span = view
            .span
            .min(self.current.saturating_sub(self.evicted_below));
        view
    }

    /// Makes room for `new_entries` more live entries, or says the shard is full.
    fn make_room(&mut self, new_entries: u64) -> Result<()> {
        let Some(capacity) = self.capacity else {
            return Ok(());
        };
        while self.live_keys + self.live_records + self.live_marks + new_entries > capacity {
            if self.policy == FullPolicy::Reject || !self.evict_oldest_bucket() {
                self.counters.full_rejections += 1;
                return Err(Error::Full);
            }
        }
        Ok(())
    }

    /// Drops the oldest bucket holding entries, unless that is the current bucket.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn evict_oldest_bucket(&mut self) -> bool {
        let first = self
            .current
            .saturating_sub(self.window.span)
            .max(self.evicted_below);
        let Some(oldest) = (first..self.current).find(|&b| {
            let count = self.ring[self.ring_index(b)];
            !count.is_empty()
        }) else {
            return false;
        };
        let mut evicted = 0;
        for bucket in first..=oldest {
            let index = self.ring_index(bucket);
            let count = std::mem::take(&mut self.ring[index]);
            self.live_keys -= u64::from(count.keys);
            self.live_records -= u64::from(count.records);
            self.live_marks -= u64::from(count.marks);
            evicted += u64::from(count.keys) + u64::from(count.records) + u64::from(count.marks);
        }
        self.evicted_below = oldest + 1;
        // The window narrowed under the queues: entries may be due at this `current`.
        self.expiry_idle_at = u64::MAX;
        self.counters.buckets_evicted += 1;
        self.counters.keys_evicted += evicted;
        log::warn!("oncedb: shard full, evicted bucket {oldest} early ({evicted} entries)");
        self.schedule_sweep();
        true
    }

    #[expect(
        clippy::cast_possible_truncation,
        reason = "bucket stamps are 32 bits by design; indices fit the tables they index"
    )]
    fn ring_index(&self, bucket: u64) -> usize {
        (bucket % self.window.live_buckets()) as usize
    }

    /// Moves the shard to bucket `now` (never backwards): buckets that left the window
    /// stop counting at once, and their table slots are queued for the sweep.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    pub(crate) fn rotate_to(&mut self, now: u64) {
        if now <= self.current {
            return;
        }
        let span = self.window.span;
        let first_leaving = self.current.saturating_sub(span);
        let end_leaving = now.saturating_sub(span);
        let leaving = end_leaving.saturating_sub(first_leaving);
        if leaving >= self.window.live_buckets() {
            self.ring.fill(BucketCount::default());
            self.live_keys = 0;
            self.live_records = 0;
            self.live_marks = 0;
        } else {
            for bucket in first_leaving..end_leaving {
                let index = self.ring_index(bucket);
                let count = std::mem::take(&mut self.ring[index]);
                self.live_keys -= u64::from(count.keys);
                self.live_records -= u64::from(count.records);
                self.live_marks -= u64::from(count.marks);
            }
        }
        self.current = now;
        self.current_ring_index = self.ring_index(now);
        self.schedule_sweep();
    }

    fn schedule_sweep(&mut self) {
        let garbage = self.table.used() as u64 > self.live_keys;
        if self.live_keys == 0 && garbage {
            // Everything expired: drop the table whole instead of sweeping it.
            self.table.clear();
            self.oldest_bucket = self.current;
        } else if self.current - self.oldest_bucket >= MAX_UNSWEPT_AGE_BUCKETS {
            self.table.rebuild(self.view().liveness(self.current));
            self.oldest_bucket = self.current.saturating_sub(self.window.span);
        } else if garbage && !self.table.sweeping() {
            self.table.start_sweep();
            self.sweep_started = self.current;
        }
    }

    /// Background work each write pays for: a step of the sweep, a few record expiries.
    pub(crate) fn after_writes(&mut self, writes: usize) {
        if self.table.sweeping() {
            let live = self.view().liveness(self.current);
            let (_, done) = self.table.sweep(SWEEP_SLOTS_PER_WRITE * writes, live);
            if done {
                self.oldest_bucket = self
                    .oldest_bucket
                    .max(self.sweep_started.saturating_sub(self.window.span));
                self.schedule_sweep();
            }
        }
        let (window, current) = (self.view(), self.current);
        if self.expiry_idle_at == current {
            return;
        }
        let budget = EXPIRE_RECORDS_PER_WRITE * writes;
        let records_idle = self.records.expire(budget, window, current);
        let aging_idle = self
            .retention
            .is_none_or(|retention| self.records.age(budget, retention, current));
        let marks_idle = self.marks.expire(budget, window, current);
        if records_idle && aging_idle && marks_idle {
            self.expiry_idle_at = current;
        }
    }

    /// The dedup table, for the places its segments are at ([`DedupTable::places`]).
    pub(crate) fn table(&self) -> &DedupTable {
        &self.table
    }

    /// Requests the home slots of `fingerprint` ahead of a probe (batch prefetch).
    #[inline]
    pub(crate) fn prefetch(&self, fingerprint: Fingerprint) {
        self.table.prefetch(fingerprint.tag());
    }

    /// Admits a dedup key; false if it is live already, in memory or in `sealed`.
    pub(crate) fn insert_key(
        &mut self,
        fingerprint: Fingerprint,
        sealed: Option<&dyn SealedKeys>,
    ) -> Result<bool> {
        if self.capacity.is_some() && !self.contains_key(fingerprint) {
            self.make_room(1)?;
        }
        self.insert_key_unchecked(fingerprint, sealed)
    }

    /// Counts the distinct keys of `fingerprints` that are not live yet and makes room
    /// for them, so that a batch is admitted whole or not at all.
    pub(crate) fn reserve_room(
        &mut self,
        fingerprints: impl Iterator<Item = Fingerprint>,
    ) -> Result<()> {
        if self.capacity.is_none() {
            return Ok(());
        }
        let mut new: Vec<u64> = fingerprints
            .filter(|&fp| !self.contains_key(fp))
            .map(Fingerprint::tag)
            .collect();
        new.sort_unstable();
        new.dedup();
        self.make_room(new.len() as u64)
    }

    /// Admits a dedup key without the capacity check (done by the caller). With sealed
    /// keys (or a table being sealed), the key is new only if no level holds it live:
    /// memory first, then the frozen table, then the sealed runs.
    pub(crate) fn insert_key_unchecked(
        &mut self,
        fingerprint: Fingerprint,
        sealed: Option<&dyn SealedKeys>,
    ) -> Result<bool> {
        let sealed = sealed.filter(|sealed| !sealed.is_empty());
        let admitted = if sealed.is_none() && self.frozen.is_none() {
            self.admit(fingerprint)
        } else {
            // Older levels first: a new key then costs their filters and one probe of
            // memory, not two.
            !self.in_older_levels(fingerprint, sealed)? && self.admit(fingerprint)
        };
        if admitted {
            self.counters.admitted += 1;
        } else {
            self.counters.duplicates += 1;
        }
        Ok(admitted)
    }

    /// Whether the batch path must look past memory's live table: a table is being
    /// sealed, or runs are live.
    pub(crate) fn has_older_levels(&self, sealed: Option<&dyn SealedKeys>) -> bool {
        self.frozen.is_some() || sealed.is_some_and(|sealed| !sealed.is_empty())
    }

    /// The batch form of the older levels' check, for the members of `group` (batch
    /// indices into `fingerprints`): leaves in `pending` those that neither the frozen
    /// table nor a sealed run holds live, in `group`'s order, and counts the others as
    /// duplicates. The runs are checked one pass each for the whole group.
    pub(crate) fn absent_from_older_levels(
        &mut self,
        (group, fingerprints): (&[u32], &[Fingerprint]),
        sealed: Option<&dyn SealedKeys>,
        pending: &mut Vec<u32>,
    ) -> Result<()> {
        let view = self.view();
        let liveness = view.liveness(self.current);
        pending.clear();
        let tag_at = |n: usize| {
            let index = *group.get(n)?;
            Some((index, fingerprints.get(index as usize)?.tag()))
        };
        match self.frozen.as_deref() {
            // The frozen table is as large as the live one: load the home slots of the
            // key `PREFETCH_AHEAD` places on while checking this one, as inserts do.
            Some(frozen) => {
                for (_, tag) in (0..PREFETCH_AHEAD).filter_map(tag_at) {
                    frozen.prefetch(tag);
                }
                for n in 0..group.len() {
                    if let Some((_, ahead)) = tag_at(n + PREFETCH_AHEAD) {
                        frozen.prefetch(ahead);
                    }
                    if let Some((index, tag)) = tag_at(n)
                        && !frozen.contains_frozen(tag, liveness)
                    {
                        pending.push(index);
                    }
                }
            }
            None => pending.extend((0..group.len()).filter_map(tag_at).map(|(index, _)| index)),
        }
        if let Some(sealed) = sealed.filter(|sealed| !sealed.is_empty()) {
            sealed.retain_absent(fingerprints, pending, view, self.current)?;
        }
        self.counters.duplicates += (group.len() - pending.len()) as u64;
        Ok(())
    }

    /// Admits a dedup key that no older level holds (the caller checked, and made room):
    /// new unless memory's live table holds it.
    pub(crate) fn insert_key_in_memory(&mut self, fingerprint: Fingerprint) -> bool {
        let admitted = self.admit(fingerprint);
        if admitted {
            self.counters.admitted += 1;
        } else {
            self.counters.duplicates += 1;
        }
        admitted
    }

    /// Whether the frozen table or a sealed run holds `fingerprint` live.
    fn in_older_levels(
        &self,
        fingerprint: Fingerprint,
        sealed: Option<&dyn SealedKeys>,
    ) -> Result<bool> {
        let view = self.view();
        if let Some(frozen) = &self.frozen
            && frozen.contains_frozen(fingerprint.tag(), view.liveness(self.current))
        {
            return Ok(true);
        }
        match sealed {
            Some(sealed) => sealed.contains(fingerprint, view, self.current),
            None => Ok(false),
        }
    }

    /// Whether `fingerprint` is live in any level.
    pub(crate) fn contains_key_anywhere(
        &mut self,
        fingerprint: Fingerprint,
        sealed: Option<&dyn SealedKeys>,
    ) -> Result<bool> {
        Ok(self.contains_key(fingerprint) || self.in_older_levels(fingerprint, sealed)?)
    }

    /// Hands the dedup table over to be sealed: a fresh table takes the writes, and the
    /// old one answers lookups, unchanged, until [`Shard::release_frozen`]. Its keys stop
    /// counting as live in memory. `None` if the table holds nothing.
    pub(crate) fn freeze(&mut self) -> Option<(Arc<DedupTable>, Liveness, u64)> {
        if self.frozen.is_some() || self.table.used() == 0 {
            return None;
        }
        let fresh = DedupTable::with_keys(0, self.huge_pages).ok()?;
        let frozen = Arc::new(std::mem::replace(&mut self.table, fresh));
        for count in &mut self.ring {
            count.keys = 0;
        }
        self.live_keys = 0;
        self.oldest_bucket = self.current;
        self.frozen = Some(Arc::clone(&frozen));
        Some((frozen, self.view().liveness(self.current), self.current))
    }

    /// Drops the frozen table: its keys are in a sealed run now.
    pub(crate) fn release_frozen(&mut self) {
        self.frozen = None;
    }

    /// Bytes of the frozen table, if any.
    pub(crate) fn frozen_bytes(&self) -> usize {
        self.frozen.as_ref().map_or(0, |table| table.heap_bytes())
    }

    /// Bytes of the dedup tables: the one taking writes and any frozen one.
    pub(crate) fn table_bytes(&self) -> usize {
        self.table.heap_bytes() + self.frozen_bytes()
    }

    /// Re-admits a key during recovery with the bucket it was stamped with when it was
    /// admitted (`stamp <= current` after the caller's advance). A key whose stamp has
    /// left the window is skipped; a live copy with any stamp makes this a no-op.
    pub(crate) fn restore_key(&mut self, fingerprint: Fingerprint, stamp: u64) {
        if self.view().is_live(stamp, self.current) {
            self.admit_at(fingerprint, stamp);
        }
    }

    /// Stores the tag of `fingerprint` in the current bucket unless it is live; counts it.
    fn admit(&mut self, fingerprint: Fingerprint) -> bool {
        self.admit_at(fingerprint, self.current)
    }

    /// Stores the tag of `fingerprint` stamped `stamp` (a live bucket) unless it is live.
    #[expect(
        clippy::cast_possible_truncation,
        reason = "bucket stamps are 32 bits by design; indices fit the tables they index"
    )]
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn admit_at(&mut self, fingerprint: Fingerprint, stamp: u64) -> bool {
        let admitted = self.table.insert_stamped(
            fingerprint.tag(),
            self.view().liveness(self.current),
            stamp as u32,
        ) == Inserted::New;
        if admitted {
            let index = if stamp == self.current {
                self.current_ring_index
            } else {
                self.oldest_bucket = self.oldest_bucket.min(stamp);
                self.ring_index(stamp)
            };
            self.ring[index].keys += 1;
            self.live_keys += 1;
        }
        admitted
    }

    pub(crate) fn contains_key(&mut self, fingerprint: Fingerprint) -> bool {
        self.table
            .contains(fingerprint.tag(), self.view().liveness(self.current))
    }

    /// Atomically looks up or creates the record of `scoped_key`. A new record takes its
    /// lease id from `next_lease` here, under the shard lock, so that the lease ids of one
    /// key grow in the order its records were created.
    pub(crate) fn reserve(
        &mut self,
        fingerprint: Fingerprint,
        scoped_key: &[u8],
        request_hash: u128,
        (now_ms, lease_timeout_ms): (u64, Option<u64>),
        (sealed, next_lease): (Option<&dyn SealedRecords>, impl FnOnce() -> Result<u64>),
    ) -> Result<Reserved> {
        let (window, current) = (self.view(), self.current);
        let outcome = match self.records.live_mut(
            fingerprint.0,
            Some(scoped_key),
            (window, current),
            sealed,
        )? {
            Some(record) if record.request_hash != request_hash => Reserved::Mismatch {
                key_logged: record.key_logged(),
            },
            // A noted record (an outcome unknown) waits for a reconciler's explicit
            // take-over: taking it over here could run its operation twice.
            Some(record)
                if !record.has_note()
                    && record.leased_ms().is_some_and(|leased_ms| {
                        lease_timeout_ms
                            .is_some_and(|timeout| now_ms.saturating_sub(leased_ms) >= timeout)
                    }) =>
            {
                let old = record.lease_id;
                let lease_id = next_lease()?;
                record.hand_over(lease_id, now_ms);
                let grant = Grant {
                    fingerprint,
                    lease_id,
                    since_ms: record.created_ms,
                };
                Reserved::TakenOver { grant, old }
            }
            Some(record) if record.is_in_flight() => Reserved::InFlight {
                since_ms: record.created_ms,
                note: record.note(),
            },
            Some(record) => Reserved::Existing(record.snapshot(self.retention, current)),
            None => {
                // The id first: if ids ran out, nothing (no early eviction) happened.
                let lease_id = next_lease()?;
                self.make_room(1)?;
                self.store_record(&NewRecord {
                    fingerprint,
                    scoped_key,
                    request_hash,
                    lease_id,
                    created_ms: now_ms,
                    key_at: None,
                });
                Reserved::Acquired(Grant {
                    fingerprint,
                    lease_id,
                    since_ms: now_ms,
                })
            }
        };
        self.count_reservation(&outcome);
        self.after_writes(1);
        Ok(outcome)
    }

    fn count_reservation(&mut self, outcome: &Reserved) {
        let counters = &mut self.counters;
        match outcome {
            Reserved::Acquired(_) => counters.acquired += 1,
            Reserved::TakenOver { .. } => counters.take_overs += 1,
            Reserved::InFlight { .. } => counters.in_flight_hits += 1,
            Reserved::Existing(_) => counters.replays += 1,
            Reserved::Mismatch { .. } => counters.mismatches += 1,
        }
    }

    /// Stores a new in-flight record in the current bucket, replacing any older one.
    fn store_record(&mut self, new: &NewRecord<'_>) {
        self.store_record_at(new, self.current);
    }

    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn store_record_at(&mut self, new: &NewRecord<'_>, stamp: u64) {
        let record = StoredRecord::in_flight(
            new.scoped_key,
            new.key_at,
            (new.request_hash, new.lease_id),
            (stamp, new.created_ms),
        );
        if let Some(old) = self.records.insert(new.fingerprint.0, record, self.view()) {
            self.uncount_record(old.bucket);
        }
        let index = self.ring_index(stamp);
        self.ring[index].records += 1;
        self.live_records += 1;
    }

    /// Recovery: replays a logged reserve stamped `stamp` (`<= current` after the
    /// caller's advance). It replaces the live record of the key only if that record was
    /// created under an older lease: log order within a key follows memory order, and
    /// this keeps a reserve that somehow reached the log late from undoing a newer one.
    /// The record runs (`sealed`) count: a settled record a run holds under a newer
    /// lease is not hidden by a late reserve (a take-over would run its operation again).
    pub(crate) fn restore_record(
        &mut self,
        new: &NewRecord<'_>,
        stamp: u64,
        sealed: Option<&dyn SealedRecords>,
    ) {
        let (window, current) = (self.view(), self.current);
        if !window.is_live(stamp, current) {
            return;
        }
        let newer_exists =
            match self
                .records
                .live_mut(new.fingerprint.0, None, (window, current), sealed)
            {
                Ok(Some(record)) => record.lease_id >= new.lease_id,
                // A run page that cannot be read is reported by the lookups that need
                // it, as `Corrupted`; replay goes on as without the runs.
                Ok(None) | Err(_) => false,
            };
        if !newer_exists {
            self.store_record_at(new, stamp);
        }
    }

    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn uncount_record(&mut self, bucket: u64) {
        if self.view().is_live(bucket, self.current) {
            let index = self.ring_index(bucket);
            self.ring[index].records -= 1;
            self.live_records -= 1;
        }
    }

    /// Ends the lease `lease_id` on the record of `fingerprint`.
    pub(crate) fn finish(
        &mut self,
        fingerprint: Fingerprint,
        lease_id: u64,
        finish: &Finish,
        now_ms: u64,
    ) -> Result<()> {
        let ending = match *finish {
            Finish::Complete(bytes) => Some((RecordStatus::Completed, Ending::Held(bytes))),
            Finish::Fail(bytes) => Some((RecordStatus::Failed, Ending::Held(bytes))),
            Finish::Release => None,
        };
        self.end_lease(fingerprint, lease_id, ending, now_ms)
    }

    /// Ends a lease as completed or failed with `response`, or, with `None`, releases
    /// the record.
    fn end_lease(
        &mut self,
        fingerprint: Fingerprint,
        lease_id: u64,
        ending: Option<(RecordStatus, Ending<'_>)>,
        now_ms: u64,
    ) -> Result<()> {
        let (retention, current) = (self.retention, self.current);
        let record = self.owned_record(fingerprint, lease_id)?;
        match ending {
            Some((status, response)) => {
                record.finish(status, response, now_ms);
                // Its aging entry may have passed while it was in flight: a response
                // past the retention is never kept (it answers `Expired` already).
                if let Some(retention) = retention
                    && !retention.is_live(record.bucket, current)
                {
                    record.drop_response();
                }
                if status == RecordStatus::Failed {
                    self.counters.failed += 1;
                } else {
                    self.counters.completed += 1;
                }
                // A recovery's ending is in the log already; a call's response waits
                // in memory for the log to be written past it (`log_response`).
                if matches!(response, Ending::Logged(_)) {
                    self.records.settle(fingerprint.0, self.view());
                }
            }
            None => {
                if let Some(removed) = self.records.remove(fingerprint.0, self.view()) {
                    self.uncount_record(removed.bucket);
                }
                self.counters.released += 1;
            }
        }
        self.after_writes(1);
        Ok(())
    }

    /// The response lease `lease_id` stored on the record of `fingerprint` is now in the
    /// log at `span`: memory lets go of its bytes (unless the record has moved on).
    pub(crate) fn log_response(&mut self, fingerprint: Fingerprint, lease_id: u64, span: LogSpan) {
        self.records
            .log_response(fingerprint.0, (lease_id, span), self.view());
    }

    /// The reserve entry lease `lease_id` logged for the record of `fingerprint` is at
    /// `span`: where the record's key is read back from once it keeps only spans.
    pub(crate) fn locate_key(&mut self, fingerprint: Fingerprint, lease_id: u64, span: LogSpan) {
        let (window, current) = (self.view(), self.current);
        if let Ok(Some(record)) =
            self.records
                .live_mut(fingerprint.0, None, (window, current), None)
        {
            record.locate_key(lease_id, span);
        }
    }

    /// The live record that lease `lease_id` holds in flight. A newer lease on the same
    /// record (a take-over) makes this `Fenced`; a record that expired (even if the key
    /// was reserved again since), was released, or already ended under this lease makes
    /// it `LeaseLost`. Either way nothing changes.
    fn owned_record(
        &mut self,
        fingerprint: Fingerprint,
        lease_id: u64,
    ) -> Result<&mut StoredRecord> {
        let (window, current) = (self.view(), self.current);
        match self
            .records
            .live_mut(fingerprint.0, None, (window, current), None)?
        {
            Some(record) if record.fences(lease_id) => {
                self.counters.fenced += 1;
                Err(Error::Fenced)
            }
            Some(record) if record.in_flight_under(lease_id) => Ok(record),
            _ => {
                self.counters.leases_lost += 1;
                Err(Error::LeaseLost)
            }
        }
    }

    /// Attaches `note` to the record lease `lease_id` holds in flight.
    pub(crate) fn note(
        &mut self,
        fingerprint: Fingerprint,
        lease_id: u64,
        note: &std::sync::Arc<[u8]>,
    ) -> Result<()> {
        self.owned_record(fingerprint, lease_id)?
            .set_note(note.clone());
        Ok(())
    }

    /// Whether lease `lease_id` holds the record of `scoped_key` in flight (for resuming
    /// a lease by its epoch): `Fenced` if a newer lease does, `LeaseLost` if none does.
    pub(crate) fn check_lease(
        &mut self,
        fingerprint: Fingerprint,
        scoped_key: &[u8],
        lease_id: u64,
    ) -> Result<u64> {
        let (window, current) = (self.view(), self.current);
        if self
            .records
            .live_mut(fingerprint.0, Some(scoped_key), (window, current), None)?
            .is_none()
        {
            return Err(Error::LeaseLost);
        }
        self.owned_record(fingerprint, lease_id)
            .map(|record| record.created_ms)
    }

    /// A new lease on the record of `scoped_key` if it is in flight: the record's lease
    /// id becomes `next_lease()`, higher than every earlier one, which fences the old
    /// lease. Returns the old and new lease ids and when the record was reserved.
    pub(crate) fn take_over(
        &mut self,
        fingerprint: Fingerprint,
        scoped_key: &[u8],
        now_ms: u64,
        next_lease: impl FnOnce() -> Result<u64>,
    ) -> Result<Option<(u64, u64, u64)>> {
        let (window, current) = (self.view(), self.current);
        let Some(record) = self
            .records
            .live_mut(fingerprint.0, Some(scoped_key), (window, current), None)?
            .filter(|record| record.is_in_flight())
        else {
            return Ok(None);
        };
        let old = record.lease_id;
        let new = next_lease()?;
        record.hand_over(new, now_ms);
        let since_ms = record.created_ms;
        self.counters.take_overs += 1;
        self.after_writes(1);
        Ok(Some((old, new, since_ms)))
    }

    /// Renews lease `lease_id` of the record: its timeout counts from `now_ms`.
    /// `Fenced` if a newer lease holds the record, `LeaseLost` if none does.
    pub(crate) fn renew(
        &mut self,
        fingerprint: Fingerprint,
        lease_id: u64,
        now_ms: u64,
    ) -> Result<()> {
        self.owned_record(fingerprint, lease_id)?.renew(now_ms);
        Ok(())
    }

    /// Recovery: a logged take-over moves the record from lease `old` to lease `new`;
    /// one whose `old` and `new` are the same lease is a renewal of it.
    pub(crate) fn restore_take_over(
        &mut self,
        fingerprint: Fingerprint,
        (old, new): (u64, u64),
        at_ms: u64,
    ) {
        let (window, current) = (self.view(), self.current);
        if let Ok(Some(record)) =
            self.records
                .live_mut(fingerprint.0, None, (window, current), None)
            && record.in_flight_under(old)
        {
            if old == new {
                record.renew(at_ms);
            } else {
                record.hand_over(new, at_ms);
            }
        }
    }

    /// Recovery: a logged note.
    pub(crate) fn restore_note(
        &mut self,
        fingerprint: Fingerprint,
        lease_id: u64,
        note: &std::sync::Arc<[u8]>,
    ) {
        let before = self.counters;
        let _ = self.note(fingerprint, lease_id, note);
        self.counters = before;
    }

    /// Records in flight reserved at or before `before_ms`.
    pub(crate) fn in_flight(&mut self, before_ms: u64) -> Vec<InFlightRecord> {
        let (window, current) = (self.view(), self.current);
        self.records.in_flight(before_ms, window, current)
    }

    /// The ordering guard: answers `version` for the aggregate of `scoped_key` and, if it
    /// is applied, makes it the mark, stamped with the current bucket.
    pub(crate) fn advance_version(
        &mut self,
        fingerprint: Fingerprint,
        scoped_key: &[u8],
        version: u64,
    ) -> Result<Advance> {
        let (window, current) = (self.view(), self.current);
        let (answer, old_bucket) =
            self.marks
                .check(fingerprint.0, scoped_key, version, window, current)?;
        if answer == Advance::Applied {
            if old_bucket.is_none() {
                self.make_room(1)?;
            }
            self.set_mark(fingerprint, scoped_key, version, current);
        }
        let counters = &mut self.counters;
        match answer {
            Advance::Applied => counters.advance_applied += 1,
            Advance::Duplicate => counters.advance_duplicates += 1,
            Advance::Stale { .. } => counters.advance_stale += 1,
            Advance::Gap { .. } => counters.advance_gaps += 1,
        }
        self.after_writes(1);
        Ok(answer)
    }

    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn set_mark(&mut self, fingerprint: Fingerprint, scoped_key: &[u8], version: u64, stamp: u64) {
        if let Some(old) = self.marks.set(fingerprint.0, scoped_key, version, stamp)
            && self.view().is_live(old, self.current)
        {
            let index = self.ring_index(old);
            self.ring[index].marks -= 1;
            self.live_marks -= 1;
        }
        let index = self.ring_index(stamp);
        self.ring[index].marks += 1;
        self.live_marks += 1;
    }

    /// Recovery: a logged applied version stamped `stamp`; a mark only moves forward.
    pub(crate) fn restore_mark(
        &mut self,
        fingerprint: Fingerprint,
        scoped_key: &[u8],
        version: u64,
        stamp: u64,
    ) {
        let (window, current) = (self.view(), self.current);
        if !window.is_live(stamp, current) {
            return;
        }
        let existing = self
            .marks
            .version(fingerprint.0, scoped_key, window, current);
        if existing.is_none_or(|existing| existing < version) {
            self.set_mark(fingerprint, scoped_key, version, stamp);
        }
    }

    /// Stuck records: in flight since at or before `before_ms`.
    pub(crate) fn count_in_flight(&mut self, before_ms: u64) -> u64 {
        self.in_flight(before_ms).len() as u64
    }

    /// Live ordering marks.
    pub(crate) fn live_marks(&self) -> u64 {
        self.live_marks
    }

    /// Applies a logged lease ending during recovery; a record that is gone is skipped.
    /// With `sealed` (the ending lies before the record runs' cover), a record the
    /// ending settles is dropped: a record run holds it.
    pub(crate) fn restore_finish(
        &mut self,
        fingerprint: Fingerprint,
        (lease_id, ending): (u64, Option<(RecordStatus, LogSpan)>),
        at_ms: u64,
        sealed: bool,
    ) {
        let before = self.counters;
        let ending = ending.map(|(status, span)| (status, Ending::Logged(span)));
        let _ = self.end_lease(fingerprint, lease_id, ending, at_ms);
        self.counters = before;
        if sealed && let Some(bucket) = self.records.drop_settled(fingerprint.0, self.view()) {
            self.uncount_record(bucket);
        }
    }

    pub(crate) fn get(
        &mut self,
        fingerprint: Fingerprint,
        scoped_key: &[u8],
        sealed: Option<&dyn SealedRecords>,
    ) -> Result<Option<Record>> {
        let (window, current) = (self.view(), self.current);
        let record =
            self.records
                .live_mut(fingerprint.0, Some(scoped_key), (window, current), sealed)?;
        let retention = self.retention;
        Ok(record.map(|r| r.snapshot(retention, current)))
    }

    /// The lease holding the live record of `scoped_key` in flight: when it was granted
    /// or last renewed, and whether its holder noted the record. `None` if the record is
    /// not in flight.
    pub(crate) fn lease_of(
        &mut self,
        fingerprint: Fingerprint,
        scoped_key: &[u8],
        sealed: Option<&dyn SealedRecords>,
    ) -> Result<Option<(u64, bool)>> {
        let (window, current) = (self.view(), self.current);
        let record =
            self.records
                .live_mut(fingerprint.0, Some(scoped_key), (window, current), sealed)?;
        Ok(record.and_then(|r| Some((r.leased_ms()?, r.has_note()))))
    }

    /// What a record seal takes from this shard ([`RecordMap::sealable`]).
    pub(crate) fn sealable_records(&self) -> Sealable {
        self.records.sealable(self.view(), self.current)
    }

    /// Drops the records a record run now holds: they stop counting as live in memory.
    pub(crate) fn drop_sealed_records(&mut self, mark: &SealMark) {
        let window = self.view();
        let mut dropped = Vec::new();
        self.records
            .drop_sealed(mark, window, |bucket| dropped.push(bucket));
        for bucket in dropped {
            self.uncount_record(bucket);
        }
    }

    /// The records' heap bytes, and of those the bytes a record seal would take
    /// ([`RecordMap::heap_bytes`]).
    pub(crate) fn record_bytes(&self) -> (usize, usize) {
        self.records.heap_bytes()
    }

    pub(crate) fn live_keys(&self) -> u64 {
        self.live_keys
    }

    pub(crate) fn live_records(&self) -> u64 {
        self.live_records
    }

    /// Adds this shard's live counts per bucket (keys, records, aggregates) to `out`,
    /// keyed by absolute bucket number.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    pub(crate) fn add_bucket_counts(&self, out: &mut std::collections::BTreeMap<u64, [u64; 3]>) {
        let first = self.current.saturating_sub(self.view().span);
        for bucket in first..=self.current {
            let count = self.ring[self.ring_index(bucket)];
            if !count.is_empty() {
                let entry = out.entry(bucket).or_default();
                entry[0] += u64::from(count.keys);
                entry[1] += u64::from(count.records);
                entry[2] += u64::from(count.marks);
            }
        }
    }

    /// Marks `live[i]` for every ring position holding a live entry.
    pub(crate) fn mark_live_buckets(&self, live: &mut [bool]) {
        for (mark, count) in live.iter_mut().zip(self.ring.iter()) {
            *mark |= !count.is_empty();
        }
    }

    /// Bytes of the shard's tables, any frozen one included.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.table_bytes()
            + self.records.heap_bytes().0
            + self.marks.heap_bytes()
            + self.ring.len() * size_of::<BucketCount>()
    }

    pub(crate) fn table_probes(&self) -> u64 {
        self.table.probes()
    }

    pub(crate) fn table_slots_used(&self) -> usize {
        self.table.used()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::SettledRecord;

    fn shard_with_marks(count: u64) -> Shard {
        let window = Window::new(4, 1);
        let mut shard = Shard::new(
            (window, None),
            0,
            0,
            Some(8),
            FullPolicy::EvictOldest,
            false,
        )
        .unwrap();
        for n in 0..count {
            let key = n.to_le_bytes();
            let fingerprint = Fingerprint(u128::from(n) + 1);
            assert_eq!(
                shard.advance_version(fingerprint, &key, 1).unwrap(),
                Advance::Applied
            );
        }
        shard
    }

    /// Expiry skips its queues while the bucket stays where it last found nothing due,
    /// and looks again once the bucket moves on.
    #[test]
    fn expiry_looks_again_once_the_bucket_moves() {
        let mut shard = shard_with_marks(8);
        shard.after_writes(1);
        assert_eq!(shard.marks.len(), 8, "nothing is due inside the window");
        shard.rotate_to(5);
        shard.after_writes(1);
        shard.after_writes(1);
        assert_eq!(
            shard.marks.len(),
            0,
            "bucket 0 left the window: all drained"
        );
    }

    /// A record run holding the key's settled record under a newer lease.
    struct OneSettled(SettledRecord);

    impl SealedRecords for OneSettled {
        fn find(
            &self,
            fingerprint: Fingerprint,
            _window: Window,
            _current: u64,
        ) -> Result<Option<SettledRecord>> {
            Ok((fingerprint == Fingerprint(7)).then_some(self.0))
        }
    }

    /// Replay of a reserve that reached the log late (an older lease) never hides the
    /// completed record a record run holds under a newer lease.
    #[test]
    fn a_late_reserve_does_not_hide_a_sealed_record() {
        let mut shard = shard_with_marks(0);
        let span = LogSpan {
            bucket: 0,
            seq: 0,
            start: 0,
            len: 1,
        };
        let sealed = OneSettled(SettledRecord {
            request_hash: 1,
            bucket: 0,
            created_ms: 0,
            lease_id: 10,
            status: RecordStatus::Completed,
            finished_ms: 1,
            response: span,
            key: span,
        });
        let late = NewRecord {
            fingerprint: Fingerprint(7),
            scoped_key: b"k",
            request_hash: 1,
            lease_id: 5,
            created_ms: 0,
            key_at: Some(span),
        };
        shard.restore_record(&late, 0, Some(&sealed));
        let record = shard.get(Fingerprint(7), b"k", Some(&sealed)).unwrap();
        assert_eq!(record.map(|r| r.status), Some(RecordStatus::Completed));
    }

    /// An eviction narrows the window under the queues without moving the bucket:
    /// expiry looks again at once.
    #[test]
    fn expiry_looks_again_after_an_eviction() {
        let mut shard = shard_with_marks(6);
        shard.rotate_to(1);
        for n in 6..8u64 {
            let fingerprint = Fingerprint(u128::from(n) + 1);
            let applied = shard.advance_version(fingerprint, &n.to_le_bytes(), 1);
            assert_eq!(applied.unwrap(), Advance::Applied);
        }
        assert_eq!(shard.marks.len(), 8, "nothing is due inside the window");
        // A ninth mark finds the shard full: bucket 0 is evicted early.
        let applied = shard.advance_version(Fingerprint(100), b"ninth", 1);
        assert_eq!(applied.unwrap(), Advance::Applied);
        shard.after_writes(1);
        assert_eq!(shard.marks.len(), 3, "bucket 0's six marks were drained");
    }
}
