//! The database handle and its operations.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::{Mutex, MutexGuard};

use crate::clock::{Clock, ms_to_system_time};
use crate::error::{Error, Result};
use crate::fingerprint::{Fingerprint, Hasher, random_secret};
use crate::index::shard::{Reserved, Shard};
use crate::index::window::Window;
use crate::journal::{Journal, LogEntry};
use crate::options::{MAX_BATCH_KEYS, MAX_SCOPE_PART_BYTES, Options};
use crate::record::{Finish, Lease, Record, Reservation, Scope};
use crate::stats::{Counters, Stats};

/// An embedded store of dedup keys and idempotency records over a sliding time window.
///
/// `Db` is a cheap handle: clones share one database, and it is `Send + Sync`.
#[derive(Clone)]
pub struct Db {
    pub(crate) inner: Arc<Inner>,
}

/// Keeps each shard lock on its own cache lines so that shards do not false-share.
#[repr(align(128))]
pub(crate) struct Padded<T>(pub(crate) T);

pub(crate) struct Inner {
    shards: Box<[Padded<Mutex<Shard>>]>,
    shard_bits: u32,
    pub(crate) hasher: Hasher,
    pub(crate) window: Window,
    clock: Arc<dyn Clock>,
    /// Highest bucket any operation has seen; time never moves backwards past it.
    high_water: AtomicU64,
    opened_bucket: u64,
    next_lease: AtomicU64,
    max_key_bytes: usize,
    max_response_bytes: usize,
    /// A key limit is set: batches check room in every shard first.
    bounded: bool,
    pub(crate) journal: Option<Journal>,
}

impl Db {
    /// Opens (or creates) the database described by `options`.
    ///
    /// A durable store replays its live segments before this returns; see
    /// `docs/design.md` for what recovery checks.
    pub fn open(options: Options) -> Result<Db> {
        options.validate()?;
        let inner = match &options.dir {
            None => Inner::new(&options, random_secret(), None, None),
            Some(_) => crate::recovery::open(&options)?,
        };
        Ok(Db {
            inner: Arc::new(inner),
        })
    }

    /// Admits `key` if it is not already inside the window: `true` the first time
    /// (admitted), `false` for a duplicate. Atomic: of any number of concurrent callers
    /// with one key, exactly one gets `true`.
    pub fn insert_if_absent(&self, key: &[u8]) -> Result<bool> {
        let inner = &self.inner;
        inner.check_key(key)?;
        inner.check_writable()?;
        let bucket = inner.current_bucket();
        let fingerprint = inner.hasher.key(key);
        let admitted = {
            let mut shard = inner.lock_shard(fingerprint, bucket);
            let admitted = shard.insert_key(fingerprint)?;
            shard.after_writes(1);
            admitted
        };
        if admitted {
            inner.log(&LogEntry::Keys(&[fingerprint]))?;
        }
        Ok(admitted)
    }

    /// [`insert_if_absent`](Db::insert_if_absent) for many keys at once: the answers are
    /// the ones calling it for each key in order would give. Each shard is locked once
    /// per batch, and a durable store appends one log record and pays at most one fsync.
    /// At most [`MAX_BATCH_KEYS`] keys; on any invalid key nothing is inserted.
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
        let inner = &self.inner;
        if keys.len() > MAX_BATCH_KEYS {
            return Err(Error::BatchTooLarge {
                len: keys.len(),
                max: MAX_BATCH_KEYS,
            });
        }
        for key in keys {
            inner.check_key(key.as_ref())?;
        }
        inner.check_writable()?;
        admitted.clear();
        admitted.resize(keys.len(), false);
        let fingerprints: Vec<Fingerprint> =
            keys.iter().map(|k| inner.hasher.key(k.as_ref())).collect();
        let bucket = inner.current_bucket();
        let order = inner.group_by_shard(&fingerprints);
        let groups: Vec<&[u32]> = inner.shard_groups(&fingerprints, &order).collect();
        let lock_group = |group: &[u32]| inner.lock_shard(fingerprints[group[0] as usize], bucket);
        if inner.bounded {
            // Hold every shard of the batch (in ascending order, so batches cannot
            // deadlock) until all have room: a full store admits none of the batch.
            let mut shards = Vec::with_capacity(groups.len());
            for group in &groups {
                let mut shard = lock_group(group);
                shard.reserve_room(group.iter().map(|&i| fingerprints[i as usize]))?;
                shards.push(shard);
            }
            for (group, mut shard) in groups.iter().zip(shards) {
                insert_group(&mut shard, group, &fingerprints, admitted);
            }
        } else if !groups.is_empty() {
            // Start at a shard that depends on the batch, so that concurrent batches do
            // not walk the shards in lockstep and queue behind each other.
            let start = (fingerprints[0].tag() % groups.len() as u64) as usize;
            for group in groups[start..].iter().chain(&groups[..start]) {
                insert_group(&mut lock_group(group), group, &fingerprints, admitted);
            }
        }
        if inner.journal.is_some() {
            let new: Vec<Fingerprint> = fingerprints
                .iter()
                .zip(admitted.iter())
                .filter(|&(_, &yes)| yes)
                .map(|(&fp, _)| fp)
                .collect();
            if !new.is_empty() {
                inner.log(&LogEntry::Keys(&new))?;
            }
        }
        Ok(())
    }

    /// Whether `key` is inside the window. Read only.
    pub fn contains(&self, key: &[u8]) -> Result<bool> {
        let inner = &self.inner;
        inner.check_key(key)?;
        let bucket = inner.current_bucket();
        let fingerprint = inner.hasher.key(key);
        Ok(inner
            .lock_shard(fingerprint, bucket)
            .contains_key(fingerprint))
    }

    /// Atomically reserves `key` in `scope` for the request whose canonical bytes are
    /// `request`, or reports what an earlier attempt left: see [`Reservation`].
    ///
    /// The record binds the key to a 128-bit hash of `request`: a retry with different
    /// bytes gets [`Reservation::Mismatch`], never the stored response.
    pub fn reserve(&self, scope: &Scope, key: &[u8], request: &[u8]) -> Result<Reservation> {
        let inner = &self.inner;
        let scoped_key = inner.scoped_key(scope, key)?;
        inner.check_writable()?;
        let fingerprint = inner.hasher.record(&scoped_key);
        let request_hash = inner.hasher.request(request);
        let lease_id = inner.next_lease.fetch_add(1, Ordering::Relaxed);
        let now_ms = inner.clock.now_ms();
        let bucket = inner.current_bucket();
        let reserved = inner.lock_shard(fingerprint, bucket).reserve(
            fingerprint,
            &scoped_key,
            request_hash,
            lease_id,
            now_ms,
        )?;
        Ok(match reserved {
            Reserved::Acquired => {
                inner.log(&LogEntry::Reserve {
                    fingerprint,
                    lease_id,
                    request_hash,
                    created_ms: now_ms,
                    scoped_key: &scoped_key,
                })?;
                Reservation::Acquired(Lease {
                    db: Arc::clone(&self.inner),
                    fingerprint,
                    lease_id,
                    since_ms: now_ms,
                })
            }
            Reserved::InFlight { since_ms } => Reservation::InFlight {
                since: ms_to_system_time(since_ms),
            },
            Reserved::Completed(record) => Reservation::Completed(record),
            Reserved::Failed(record) => Reservation::Failed(record),
            Reserved::Mismatch => Reservation::Mismatch,
        })
    }

    /// The record of `key` in `scope`, if one is inside the window.
    pub fn get(&self, scope: &Scope, key: &[u8]) -> Result<Option<Record>> {
        let inner = &self.inner;
        let scoped_key = inner.scoped_key(scope, key)?;
        let fingerprint = inner.hasher.record(&scoped_key);
        let bucket = inner.current_bucket();
        inner
            .lock_shard(fingerprint, bucket)
            .get(fingerprint, &scoped_key)
    }

    /// Durability barrier: when it returns, everything acknowledged before the call is on
    /// stable storage. A no-op for in-memory stores.
    pub fn flush(&self) -> Result<()> {
        match &self.inner.journal {
            Some(journal) => journal.flush(),
            None => Ok(()),
        }
    }

    /// Counters and sizes; see [`Stats`].
    pub fn stats(&self) -> Stats {
        let inner = &self.inner;
        let bucket = inner.current_bucket();
        let mut stats = Stats::default();
        let mut counters = Counters::default();
        let mut live_buckets = vec![false; inner.window.live_buckets() as usize];
        for padded in inner.shards.iter() {
            let mut shard = padded.0.lock();
            shard.advance(bucket);
            counters.add(&shard.counters);
            stats.live_keys += shard.live_keys();
            stats.live_records += shard.live_records();
            stats.table_slots_used += shard.table_slots_used() as u64;
            stats.table_probes += shard.table_probes();
            stats.index_bytes += shard.heap_bytes() as u64;
            shard.mark_live_buckets(&mut live_buckets);
        }
        counters.report(&mut stats);
        stats.buckets_live = live_buckets.iter().filter(|&&live| live).count() as u64;
        stats.buckets_dropped = bucket - inner.opened_bucket;
        if let Some(journal) = &inner.journal {
            journal.add_stats(&mut stats);
        }
        stats
    }
}

/// Admits the keys of one shard's group, in order, after loading their home slots.
fn insert_group(
    shard: &mut Shard,
    group: &[u32],
    fingerprints: &[Fingerprint],
    admitted: &mut [bool],
) {
    touch_group(shard, group, fingerprints);
    for &index in group {
        admitted[index as usize] = shard.insert_key_unchecked(fingerprints[index as usize]);
    }
    shard.after_writes(group.len());
}

/// Starts every slot load of a group before any of them is probed, so that the cache
/// misses overlap instead of queueing one after another.
fn touch_group(shard: &Shard, group: &[u32], fingerprints: &[Fingerprint]) {
    let mut touched = 0u32;
    for &index in group {
        touched = touched.wrapping_add(shard.touch(fingerprints[index as usize]));
    }
    std::hint::black_box(touched);
}

impl Inner {
    /// An empty index at `start_bucket`, or at the clock's current bucket.
    pub(crate) fn new(
        options: &Options,
        secret: u64,
        start_bucket: Option<u64>,
        journal: Option<Journal>,
    ) -> Inner {
        let window = Window::new(options.window_ms, options.bucket_width_ms);
        let bucket = start_bucket.unwrap_or_else(|| window.bucket_of(options.clock.now_ms()));
        let per_shard = options.expected_keys.div_ceil(options.shards as u64) as usize;
        let shards = (0..options.shards)
            .map(|_| {
                Padded(Mutex::new(Shard::new(
                    window,
                    per_shard,
                    bucket,
                    options.shard_capacity(),
                    options.full_policy,
                )))
            })
            .collect();
        Inner {
            shards,
            shard_bits: options.shards.trailing_zeros(),
            hasher: Hasher::new(secret),
            window,
            clock: Arc::clone(&options.clock),
            high_water: AtomicU64::new(bucket),
            opened_bucket: bucket,
            next_lease: AtomicU64::new(1),
            max_key_bytes: options.max_key_bytes,
            max_response_bytes: options.max_response_bytes,
            bounded: options.max_keys.is_some(),
            journal,
        }
    }

    /// The current bucket, never lower than one already seen.
    pub(crate) fn current_bucket(&self) -> u64 {
        let now = self.window.bucket_of(self.clock.now_ms());
        let seen = self.high_water.load(Ordering::Acquire);
        if now > seen {
            self.high_water.fetch_max(now, Ordering::AcqRel).max(now)
        } else {
            seen
        }
    }

    /// Locks the shard owning `fingerprint`, moved to `bucket`.
    pub(crate) fn lock_shard(
        &self,
        fingerprint: Fingerprint,
        bucket: u64,
    ) -> MutexGuard<'_, Shard> {
        let mut shard = self.shards[fingerprint.shard(self.shard_bits)].0.lock();
        shard.advance(bucket);
        shard
    }

    /// Indices of `fingerprints` ordered by shard (counting sort), stable within a shard.
    fn group_by_shard(&self, fingerprints: &[Fingerprint]) -> Vec<u32> {
        let mut starts = vec![0u32; self.shards.len() + 1];
        for fp in fingerprints {
            starts[fp.shard(self.shard_bits) + 1] += 1;
        }
        for i in 1..starts.len() {
            starts[i] += starts[i - 1];
        }
        let mut order = vec![0u32; fingerprints.len()];
        for (index, fp) in fingerprints.iter().enumerate() {
            let slot = &mut starts[fp.shard(self.shard_bits)];
            order[*slot as usize] = index as u32;
            *slot += 1;
        }
        order
    }

    /// The runs of `order` (from [`Inner::group_by_shard`]) that share a shard.
    fn shard_groups<'a>(
        &self,
        fingerprints: &'a [Fingerprint],
        order: &'a [u32],
    ) -> impl Iterator<Item = &'a [u32]> + 'a {
        let bits = self.shard_bits;
        order.chunk_by(move |&a, &b| {
            fingerprints[a as usize].shard(bits) == fingerprints[b as usize].shard(bits)
        })
    }

    pub(crate) fn check_key(&self, key: &[u8]) -> Result<()> {
        if key.is_empty() {
            return Err(Error::EmptyKey);
        }
        if key.len() > self.max_key_bytes {
            return Err(Error::KeyTooLong {
                len: key.len(),
                max: self.max_key_bytes,
            });
        }
        Ok(())
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

    fn scoped_key(&self, scope: &Scope, key: &[u8]) -> Result<Box<[u8]>> {
        self.check_key(key)?;
        for part in [scope.tenant(), scope.operation()] {
            if part.len() > MAX_SCOPE_PART_BYTES {
                return Err(Error::ScopeTooLong { len: part.len() });
            }
        }
        Ok(scope.encode_key(key))
    }

    /// Appends `entry` to the log and waits as the durability mode requires.
    fn log(&self, entry: &LogEntry<'_>) -> Result<()> {
        match &self.journal {
            Some(journal) => journal.append(self.high_water.load(Ordering::Acquire), entry),
            None => Ok(()),
        }
    }

    /// Ends a lease: the shared path of complete, fail and release.
    pub(crate) fn finish(
        &self,
        fingerprint: Fingerprint,
        lease_id: u64,
        finish: Finish,
    ) -> Result<()> {
        self.check_writable()?;
        let now_ms = self.clock.now_ms();
        let bucket = self.current_bucket();
        self.lock_shard(fingerprint, bucket)
            .finish(fingerprint, lease_id, &finish, now_ms)?;
        self.log(&LogEntry::Finish {
            fingerprint,
            lease_id,
            at_ms: now_ms,
            finish: &finish,
        })
    }

    /// Recovery: re-admits logged keys in `bucket`, locking each shard once.
    pub(crate) fn restore_keys(&self, bucket: u64, fingerprints: &[Fingerprint]) {
        let order = self.group_by_shard(fingerprints);
        for group in self.shard_groups(fingerprints, &order) {
            let mut shard = self.lock_shard(fingerprints[group[0] as usize], bucket);
            touch_group(&shard, group, fingerprints);
            for &index in group {
                shard.restore_key(fingerprints[index as usize]);
            }
        }
    }

    /// Recovery: the shard of `fingerprint` moved to `bucket`, for replaying a segment.
    pub(crate) fn restore_shard(
        &self,
        fingerprint: Fingerprint,
        bucket: u64,
    ) -> MutexGuard<'_, Shard> {
        self.lock_shard(fingerprint, bucket)
    }

    /// Recovery: lease ids continue after the highest one replayed.
    pub(crate) fn bump_lease_ids(&self, seen: u64) {
        self.next_lease
            .fetch_max(seen.saturating_add(1), Ordering::Relaxed);
    }

    /// Recovery: buckets dropped are counted from here.
    pub(crate) fn set_opened_bucket(&mut self, bucket: u64) {
        self.opened_bucket = bucket;
    }

    /// Recovery: raise the high-water bucket to one found on disk.
    pub(crate) fn raise_high_water(&self, bucket: u64) {
        self.high_water.fetch_max(bucket, Ordering::AcqRel);
    }
}
