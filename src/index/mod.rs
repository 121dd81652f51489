//! The in-memory index: hash-sharded tables of fingerprints and records, time-bucketed.
//!
//! Below the engine, above `base`: it knows fingerprints, buckets and lease endings, and
//! nothing of the log, the API or the configuration builder.

mod counters;
mod dense;
mod marks;
mod pending;
mod records;
mod shard;
mod slots;
mod table;

pub(crate) use pending::{BatchMark, BatchMarks, PendingWrite};
pub(crate) use records::{SealMark, Sealable};
pub(crate) use shard::{Grant, InFlightRecord, NewRecord, Reserved, Shard};
pub(crate) use table::DedupTable;

/// Dedup keys that left memory for sealed runs on disk, as the index asks for them: the
/// engine implements this over the log's runs.
pub(crate) trait SealedKeys {
    /// No run is live: every key is in memory.
    fn is_empty(&self) -> bool;
    /// Whether a run holds `fingerprint` stamped with a bucket live at `current`.
    fn contains(
        &self,
        fingerprint: Fingerprint,
        window: Window,
        current: u64,
    ) -> crate::base::Result<bool>;
    /// Of the keys `fingerprints[i]` for `i` in `pending`, removes those a run holds
    /// stamped with a bucket live at `current`: one pass per run, newest first, with
    /// each data page read once for all the keys that may be in it.
    fn retain_absent(
        &self,
        fingerprints: &[Fingerprint],
        pending: &mut Vec<u32>,
        window: Window,
        current: u64,
    ) -> crate::base::Result<()>;
}

/// Settled idempotency records that left memory for record runs on disk, as the index
/// asks for them: the engine implements this over the log's runs.
pub(crate) trait SealedRecords {
    /// The settled record of `fingerprint` a run holds, if its bucket is live at
    /// `current` (the newest run first).
    fn find(
        &self,
        fingerprint: Fingerprint,
        window: Window,
        current: u64,
    ) -> crate::base::Result<Option<crate::base::SettledRecord>>;
}

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::{Mutex, MutexGuard};

use crate::base::{Fingerprint, FullPolicy, Window, prefetch_address};
use counters::Counters;

/// The memory the budget weighs ([`Index::budget_bytes`]).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct BudgetBytes {
    /// The dedup tables, frozen ones included.
    pub(crate) tables: u64,
    /// The idempotency records memory holds.
    pub(crate) records: u64,
    /// Of those, the bytes of settled records: what a record seal would take.
    pub(crate) sealable_records: u64,
}

/// Keeps each shard lock on its own cache lines so that shards do not false-share.
#[repr(align(128))]
struct Padded<T>(T);

/// Hint entries one index holds in all, at most `2^MAX_HINT_DEPTH` a shard: 128 a shard
/// at the default 64 shards, fewer with more shards (16 bytes each, 128 KiB an index).
const HINT_ENTRIES_PER_INDEX: usize = 8192;

/// Most leading tag bits a table hint resolves: segments deeper than this (a shard of
/// more than about 300 000 keys) are not prefetched before the lock.
const MAX_HINT_DEPTH: u32 = 7;

/// Where the segments of a shard's dedup table were when its lock was last released by a
/// writer: lets a batch prefetch the home slots of its next shard before it takes that
/// shard's lock, and a single call prefetch its home slot before it reads the clock.
/// Only ever used as a prefetch address, so a stale or torn value costs a useless
/// prefetch, never a wrong answer.
struct TableHint {
    /// The table layout the entries describe ([`DedupTable::layout`]).
    layout: AtomicU64,
    /// One entry per leading-bits prefix of the index's hint depth.
    entries: Box<[HintEntry]>,
}

/// One segment's place: the address of its first slot (0: none), and its slot count
/// with its local depth in the top byte.
#[derive(Default)]
struct HintEntry {
    base: AtomicUsize,
    slots_and_depth: AtomicUsize,
}

/// Bit position of a segment's local depth in [`HintEntry::slots_and_depth`].
const HINT_DEPTH_SHIFT: u32 = usize::BITS - 8;

impl TableHint {
    fn new(hint_depth: u32) -> TableHint {
        TableHint {
            layout: AtomicU64::new(0),
            entries: (0..1usize << hint_depth)
                .map(|_| HintEntry::default())
                .collect(),
        }
    }

    /// Writes the places of `table`'s segments unless they are written already, so that
    /// callers on other threads keep their copy of the lines.
    fn publish(&self, table: &DedupTable, hint_depth: u32) {
        let layout = table.layout();
        if self.layout.load(Ordering::Relaxed) == layout {
            return;
        }
        for (entry, place) in self.entries.iter().zip(table.places(hint_depth)) {
            let place = place.unwrap_or_default();
            entry.base.store(place.base, Ordering::Relaxed);
            let packed = place.slots | (place.depth as usize) << HINT_DEPTH_SHIFT;
            entry.slots_and_depth.store(packed, Ordering::Relaxed);
        }
        self.layout.store(layout, Ordering::Relaxed);
    }

    /// The published place of the segment of `tag`, if one is known.
    #[inline]
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the top byte holds a depth below 64"
    )]
    fn place(&self, tag: u64, hint_depth: u32) -> Option<table::SegmentPlace> {
        let entry = self.entries.get(table::prefix(tag, hint_depth))?;
        let base = entry.base.load(Ordering::Relaxed);
        let packed = entry.slots_and_depth.load(Ordering::Relaxed);
        (base != 0).then_some(table::SegmentPlace {
            base,
            slots: packed & ((1 << HINT_DEPTH_SHIFT) - 1),
            depth: (packed >> HINT_DEPTH_SHIFT) as u32,
        })
    }

    /// Prefetches the home slot of `tag` in its published segment, if one is known.
    #[inline]
    fn prefetch_home(&self, tag: u64, hint_depth: u32) {
        if let Some(place) = self.place(tag, hint_depth) {
            prefetch_address(table::home_address(place, tag));
        }
    }
}

/// One shard and its table hint, on cache lines of its own.
struct ShardCell {
    lock: Mutex<Shard>,
    hint: TableHint,
}

/// How the index is sized and bounded.
#[derive(Debug, Clone, Copy)]
pub(crate) struct IndexConfig {
    pub(crate) window: Window,
    /// How long finished records keep their responses, if shorter than the window.
    pub(crate) retention: Option<Window>,
    /// A power of two.
    pub(crate) shards: usize,
    pub(crate) expected_keys: u64,
    /// Most live keys plus records per shard (`None`: unbounded).
    pub(crate) shard_capacity: Option<u64>,
    pub(crate) full_policy: FullPolicy,
    /// Map large tables and advise them for transparent huge pages.
    pub(crate) huge_pages: bool,
}

/// Sizes and counters summed over every shard.
#[derive(Debug, Clone, Default)]
pub(crate) struct IndexStats {
    pub(crate) counters: Counters,
    pub(crate) live_keys: u64,
    pub(crate) live_records: u64,
    pub(crate) live_marks: u64,
    pub(crate) table_slots_used: u64,
    pub(crate) table_probes: u64,
    pub(crate) heap_bytes: u64,
    /// Bytes of the tables frozen for a seal (included in `heap_bytes`).
    pub(crate) frozen_bytes: u64,
    pub(crate) buckets_live: u64,
}

/// The shards. Every method locks one shard at a time, or several in ascending order.
pub(crate) struct Index {
    shards: Box<[Padded<ShardCell>]>,
    shard_bits: u32,
    /// Leading tag bits each shard's table hint resolves.
    hint_depth: u32,
    window: Window,
    bounded: bool,
}

impl Index {
    /// An empty index whose shards start at `bucket`. Fails only if the tables for
    /// `expected_keys` cannot be allocated.
    pub(crate) fn new(
        config: IndexConfig,
        bucket: u64,
    ) -> Result<Index, std::collections::TryReserveError> {
        let per_shard = config.expected_keys.div_ceil(config.shards as u64);
        let per_shard = usize::try_from(per_shard).unwrap_or(usize::MAX);
        // Ask for the whole index's memory once, without touching it, so that a size the
        // system cannot provide fails here instead of after some shards were written.
        let total = table::bytes_for(per_shard).saturating_mul(config.shards);
        Vec::<u8>::new().try_reserve_exact(total)?;
        let mut shards = Vec::with_capacity(config.shards);
        let hint_depth = (HINT_ENTRIES_PER_INDEX / config.shards.max(1))
            .max(1)
            .ilog2()
            .min(MAX_HINT_DEPTH);
        for _ in 0..config.shards {
            let shard = Shard::new(
                (config.window, config.retention),
                per_shard,
                bucket,
                config.shard_capacity,
                config.full_policy,
                config.huge_pages,
            )?;
            let hint = TableHint::new(hint_depth);
            hint.publish(shard.table(), hint_depth);
            shards.push(Padded(ShardCell {
                lock: Mutex::new(shard),
                hint,
            }));
        }
        Ok(Index {
            shards: shards.into_boxed_slice(),
            shard_bits: config.shards.trailing_zeros(),
            hint_depth,
            window: config.window,
            bounded: config.shard_capacity.is_some(),
        })
    }

    /// Hands every shard's dedup table over to be sealed (see [`Shard::freeze`]), in
    /// shard order: per shard, the frozen table (if it held anything), the liveness its
    /// stamps are read with, and the shard's bucket then.
    pub(crate) fn freeze_all(
        &self,
    ) -> Vec<Option<(std::sync::Arc<DedupTable>, crate::base::Liveness, u64)>> {
        (0..self.shards.len())
            .map(|index| self.lock_index(index).freeze())
            .collect()
    }

    /// Drops every frozen table: their keys are in a sealed run.
    pub(crate) fn release_frozen(&self) {
        for index in 0..self.shards.len() {
            self.lock_index(index).release_frozen();
        }
    }

    /// Shards (the sections of a run).
    pub(crate) fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// What a record seal takes from shard `index` (locked meanwhile).
    pub(crate) fn sealable_records(&self, index: usize) -> Sealable {
        self.lock_index(index).sealable_records()
    }

    /// Drops from shard `index` the records a record run now holds.
    pub(crate) fn drop_sealed_records(&self, index: usize, mark: &SealMark) {
        self.lock_index(index).drop_sealed_records(mark);
    }

    /// What the memory budget weighs, in one pass over the shards (each locked once):
    /// the bytes of every dedup table (frozen ones included), and of the records held.
    pub(crate) fn budget_bytes(&self) -> BudgetBytes {
        let mut bytes = BudgetBytes::default();
        for index in 0..self.shards.len() {
            let shard = self.lock_index(index);
            bytes.tables += shard.table_bytes() as u64;
            let (records, sealable) = shard.record_bytes();
            bytes.records += records as u64;
            bytes.sealable_records += sealable as u64;
        }
        bytes
    }

    /// Shards, as a power of two.
    pub(crate) fn shard_bits(&self) -> u32 {
        self.shard_bits
    }

    /// Whether shards hold a key limit (batches then check room in every shard first).
    pub(crate) fn bounded(&self) -> bool {
        self.bounded
    }

    /// Locks the shard owning `fingerprint`, moved to `bucket`.
    pub(crate) fn lock(&self, fingerprint: Fingerprint, bucket: u64) -> MutexGuard<'_, Shard> {
        let mut shard = self.lock_index(fingerprint.shard(self.shard_bits));
        shard.rotate_to(bucket);
        shard
    }

    fn lock_index(&self, index: usize) -> MutexGuard<'_, Shard> {
        match self.shards.get(index) {
            Some(padded) => padded.0.lock.lock(),
            None => unreachable!("a fingerprint's shard is below the shard count"),
        }
    }

    /// Records where the table segments of `shard` (locked, owning `fingerprint`) are
    /// now, for [`Index::prefetch_group`] and [`Index::prefetch_home`].
    pub(crate) fn publish_table(&self, fingerprint: Fingerprint, shard: &Shard) {
        if let Some(padded) = self.shards.get(fingerprint.shard(self.shard_bits)) {
            padded.0.hint.publish(shard.table(), self.hint_depth);
        }
    }

    /// Prefetches, without the lock, the home slot of `fingerprint` in the table segment
    /// last published for its shard. A single-key call issues it first, so that its one
    /// DRAM miss is under way while it reads the clock and takes the lock.
    pub(crate) fn prefetch_home(&self, fingerprint: Fingerprint) {
        if let Some(padded) = self.shards.get(fingerprint.shard(self.shard_bits)) {
            padded
                .0
                .hint
                .prefetch_home(fingerprint.tag(), self.hint_depth);
        }
    }

    /// Admits one dedup key in `shard` (locked, owning `fingerprint`): whether it was
    /// absent. Publishes the table's place, which an insert that grew the table has moved.
    /// The caller logs the admission before it lets the lock go.
    pub(crate) fn admit_one(
        &self,
        shard: &mut Shard,
        fingerprint: Fingerprint,
        sealed: Option<&dyn SealedKeys>,
    ) -> crate::base::Result<bool> {
        let admitted = shard.insert_key(fingerprint, sealed)?;
        shard.after_writes(1);
        self.publish_table(fingerprint, shard);
        Ok(admitted)
    }

    /// Takes back the admissions of `fingerprints` (a write that failed) if `still()`,
    /// asked once with every shard they live in locked (in ascending order, as batches
    /// lock them): so that nobody sees some taken back and others not. Returns how many
    /// the live tables no longer held (a seal took them meanwhile).
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    pub(crate) fn revoke_keys(
        &self,
        fingerprints: &[Fingerprint],
        bucket: u64,
        still: impl FnOnce() -> bool,
    ) -> usize {
        let mut groups = ShardGroups::default();
        self.group_by_shard(fingerprints, &mut groups);
        let mut shards: Vec<MutexGuard<'_, Shard>> = groups
            .iter()
            .map(|group| self.lock(fingerprints[group[0] as usize], bucket))
            .collect();
        if !still() {
            return 0;
        }
        let mut missing = 0;
        for (group, shard) in groups.iter().zip(shards.iter_mut()) {
            for &index in group {
                if !shard.revoke_key(fingerprints[index as usize]) {
                    missing += 1;
                }
            }
        }
        missing
    }

    /// Prefetches, without the lock, the home slots of up to `PREFETCH_AHEAD` members of
    /// `group` (one shard's keys) in the table segments last published for that shard.
    pub(crate) fn prefetch_group(&self, group: &[u32], fingerprints: &[Fingerprint]) {
        let Some(first) = group.first().and_then(|&i| fingerprints.get(i as usize)) else {
            return;
        };
        let Some(padded) = self.shards.get(first.shard(self.shard_bits)) else {
            return;
        };
        for &index in group.iter().take(PREFETCH_AHEAD) {
            if let Some(fp) = fingerprints.get(index as usize) {
                padded.0.hint.prefetch_home(fp.tag(), self.hint_depth);
            }
        }
    }

    /// Orders the indices of `fingerprints` by shard into `groups`, reusing its buffers.
    #[expect(
        clippy::cast_possible_truncation,
        reason = "bucket stamps are 32 bits by design; indices fit the tables they index"
    )]
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    pub(crate) fn group_by_shard(&self, fingerprints: &[Fingerprint], groups: &mut ShardGroups) {
        let ShardGroups {
            starts,
            order,
            runs,
        } = groups;
        starts.clear();
        starts.resize(self.shards.len() + 1, 0);
        for fp in fingerprints {
            starts[fp.shard(self.shard_bits) + 1] += 1;
        }
        for i in 1..starts.len() {
            starts[i] += starts[i - 1];
        }
        runs.clear();
        runs.extend(
            starts
                .windows(2)
                .filter(|w| w[0] < w[1])
                .map(|w| (w[0], w[1])),
        );
        order.clear();
        order.resize(fingerprints.len(), 0);
        for (index, fp) in fingerprints.iter().enumerate() {
            let slot = &mut starts[fp.shard(self.shard_bits)];
            order[*slot as usize] = index as u32;
            *slot += 1;
        }
    }

    /// Recovery: re-admits logged keys stamped `stamp`, locking each shard once.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    pub(crate) fn restore_keys(&self, stamp: u64, fingerprints: &[Fingerprint]) {
        let mut groups = ShardGroups::default();
        self.group_by_shard(fingerprints, &mut groups);
        for group in groups.iter() {
            let mut shard = self.lock(fingerprints[group[0] as usize], stamp);
            for_each_prefetched(&mut shard, group, fingerprints, |shard, index| {
                shard.restore_key(fingerprints[index], stamp);
            });
        }
    }

    /// Records in flight reserved at or before `before_ms`, one shard locked at a time.
    pub(crate) fn in_flight(&self, bucket: u64, before_ms: u64) -> Vec<shard::InFlightRecord> {
        let mut found = Vec::new();
        for padded in self.shards.iter() {
            let mut shard = padded.0.lock.lock();
            shard.rotate_to(bucket);
            found.extend(shard.in_flight(before_ms));
        }
        found
    }

    /// How many records are in flight since at or before `before_ms`.
    pub(crate) fn count_in_flight(&self, bucket: u64, before_ms: u64) -> u64 {
        self.shards
            .iter()
            .map(|padded| {
                let mut shard = padded.0.lock.lock();
                shard.rotate_to(bucket);
                shard.count_in_flight(before_ms)
            })
            .sum()
    }

    /// Live keys, records and aggregates per absolute bucket, every shard moved to
    /// `bucket` first.
    pub(crate) fn bucket_counts(&self, bucket: u64) -> std::collections::BTreeMap<u64, [u64; 3]> {
        let mut counts = std::collections::BTreeMap::new();
        for padded in self.shards.iter() {
            let mut shard = padded.0.lock.lock();
            shard.rotate_to(bucket);
            shard.add_bucket_counts(&mut counts);
        }
        counts
    }

    /// Sums every shard, each moved to `bucket` first.
    #[expect(
        clippy::cast_possible_truncation,
        reason = "bucket stamps are 32 bits by design; indices fit the tables they index"
    )]
    pub(crate) fn stats(&self, bucket: u64) -> IndexStats {
        let mut stats = IndexStats::default();
        let mut live_buckets = vec![false; self.window.live_buckets() as usize];
        for padded in self.shards.iter() {
            let mut shard = padded.0.lock.lock();
            shard.rotate_to(bucket);
            stats.counters.add(&shard.counters);
            stats.live_keys += shard.live_keys();
            stats.live_records += shard.live_records();
            stats.live_marks += shard.live_marks();
            stats.table_slots_used += shard.table_slots_used() as u64;
            stats.table_probes += shard.table_probes();
            stats.heap_bytes += shard.heap_bytes() as u64;
            stats.frozen_bytes += shard.frozen_bytes() as u64;
            shard.mark_live_buckets(&mut live_buckets);
        }
        stats.buckets_live = live_buckets.iter().filter(|&&live| live).count() as u64;
        stats
    }
}

/// The indices of a batch grouped by shard ([`Index::group_by_shard`]): buffers a caller
/// keeps across batches so that grouping allocates nothing once they have grown.
#[derive(Default, Debug)]
pub(crate) struct ShardGroups {
    /// Per shard, the running offset into `order` while it is filled.
    starts: Vec<u32>,
    /// Batch indices, shard by shard.
    order: Vec<u32>,
    /// `(start, end)` in `order` of each shard that has members, by ascending shard.
    runs: Vec<(u32, u32)>,
}

impl ShardGroups {
    /// How many shards the batch touches.
    pub(crate) fn len(&self) -> usize {
        self.runs.len()
    }

    /// The batch indices of the `n`th shard touched.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    pub(crate) fn get(&self, n: usize) -> &[u32] {
        let (start, end) = self.runs[n];
        &self.order[start as usize..end as usize]
    }

    /// The groups, by ascending shard.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &[u32]> {
        (0..self.len()).map(|n| self.get(n))
    }
}

/// How many keys ahead of the one being inserted the batch path prefetches: enough to
/// cover a DRAM miss with the work of the keys in between, few enough that the
/// prefetches fit the core's line-fill buffers (10 to 16 on current cores).
const PREFETCH_AHEAD: usize = 8;

/// Calls `visit` for each member of `group` in order, with the home slots of the key
/// `PREFETCH_AHEAD` places later already requested, so that cache misses overlap instead
/// of queueing one after another.
pub(crate) fn for_each_prefetched(
    shard: &mut Shard,
    group: &[u32],
    fingerprints: &[Fingerprint],
    mut visit: impl FnMut(&mut Shard, usize),
) {
    let fingerprint = |index: u32| fingerprints.get(index as usize).copied();
    for &index in group.iter().take(PREFETCH_AHEAD) {
        if let Some(fp) = fingerprint(index) {
            shard.prefetch(fp);
        }
    }
    for (n, &index) in group.iter().enumerate() {
        if let Some(fp) = group
            .get(n + PREFETCH_AHEAD)
            .and_then(|&ahead| fingerprint(ahead))
        {
            shard.prefetch(fp);
        }
        visit(shard, index as usize);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Single-key admissions that grow and split their shard's table publish the new
    /// places, so that the next call's lock-free prefetch reads the slot the probe will.
    #[test]
    fn single_key_admissions_keep_the_table_hint_current_as_tables_split() {
        let config = IndexConfig {
            window: Window::new(4, 1),
            retention: None,
            shards: 4,
            expected_keys: 0,
            shard_capacity: None,
            full_policy: FullPolicy::Reject,
            huge_pages: false,
        };
        let index = Index::new(config, 0).unwrap();
        let fingerprints: Vec<Fingerprint> = (0..40_000u64)
            .map(|n| Fingerprint(xxhash_rust::xxh3::xxh3_128(&n.to_le_bytes())))
            .collect();
        for &fingerprint in &fingerprints {
            let mut shard = index.lock(fingerprint, 0);
            assert!(index.admit_one(&mut shard, fingerprint, None).unwrap());
        }
        for &fingerprint in &fingerprints {
            let shard = fingerprint.shard(index.shard_bits);
            let tag = fingerprint.tag();
            let place = index.shards[shard].0.hint.place(tag, index.hint_depth);
            let place = place.expect("every prefix's segment is published");
            let actual = index.lock_index(shard).table().home_slot_address(tag);
            assert_eq!(table::home_address(place, tag), actual, "shard {shard}");
        }
        assert!(
            index.lock_index(0).table().segment_count() > 2,
            "the tables split"
        );
    }
}
