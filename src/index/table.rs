//! The dedup table of one shard: open addressing with linear probing over 12-byte slots,
//! in segments that grow and split one at a time (extendible hashing).
//!
//! A slot holds a 64-bit tag (0 = empty) and the 32-bit bucket of the key's admission.
//! A directory of `2^depth` entries sends a tag, by its leading `depth` bits, to a
//! segment; a segment of local depth `d` holds the tags sharing their leading `d` bits,
//! and a tag's home in it comes from the bits after those (`(tag << d) * len >> 64`), so
//! entries can be moved and rehashed without the original key. Expired entries stay in
//! place until the incremental sweep removes them with backward-shift deletion: there are
//! no tombstones, and an insert may reuse an expired slot it passes.
//!
//! Growth is bounded per write: a segment that reaches its limit doubles while it is
//! smaller than [`SEGMENT_SLOTS`], and from then on splits into two segments of its own
//! size by the next tag bit, moving only its own entries. Each segment draws its limit
//! between [`MIN_SPLIT_LOAD_PERCENT`] and `MAX_LOAD`, so that segments filled at the same
//! rate split in different batches instead of the same one. A table sized up front
//! ([`DedupTable::with_keys`]) is one segment of the size asked for; if it outgrows that
//! size, it splits into two of the same size at once.

use std::collections::TryReserveError;
use std::sync::atomic::{AtomicU64, Ordering};

use super::slots::{EMPTY, Slot, SlotMemory};
use crate::base::{Liveness, prefetch_read};
use crate::io::SplitMix64;

/// Slots in one 64-byte cache line (rounded up).
const SLOTS_PER_LINE: usize = 64 / 12 + 1;

/// Highest load before a segment grows or splits, in percent. Linear probing reads about
/// `(1 + 1 / (1 - load)^2) / 2` slots for an absent key: 13 at 80%, 32 at 87.5%.
const MAX_LOAD_PERCENT: usize = 80;

/// Lowest load at which a grown segment may split or double: each draws its own limit
/// between this and `MAX_LOAD_PERCENT`.
pub(crate) const MIN_SPLIT_LOAD_PERCENT: usize = 60;

/// Slots of a segment from which it splits instead of doubling: 48 KiB, whose entries a
/// split moves in some 10–20 µs, about a third of a presized batch of 1024 keys.
pub(crate) const SEGMENT_SLOTS: usize = 4096;

/// Smallest segment allocated.
const MIN_CAPACITY: usize = 16;

const _: () = assert!(size_of::<Slot>() == 12);
const _: () = assert!(MIN_SPLIT_LOAD_PERCENT <= MAX_LOAD_PERCENT && MAX_LOAD_PERCENT < 100);

/// Source of table layout identities ([`DedupTable::layout`]): unique in the process.
static NEXT_LAYOUT: AtomicU64 = AtomicU64::new(1);

fn next_layout() -> u64 {
    NEXT_LAYOUT.fetch_add(1, Ordering::Relaxed)
}

#[inline]
fn slot_tag(slot: Slot) -> u64 {
    (u64::from(slot[1]) << 32) | u64::from(slot[0])
}

#[inline]
#[expect(
    clippy::cast_possible_truncation,
    reason = "bucket stamps are 32 bits by design; indices fit the tables they index"
)]
fn slot_new(tag: u64, bucket: u32) -> Slot {
    [tag as u32, (tag >> 32) as u32, bucket]
}

#[inline]
fn slot_is_empty(slot: Slot) -> bool {
    slot[0] | slot[1] == 0
}

#[inline]
fn slot_bucket(slot: Slot) -> u32 {
    slot[2]
}

/// The home slot of `tag` in a segment of `len` slots and local depth `depth`.
#[inline]
#[expect(
    clippy::cast_possible_truncation,
    reason = "the product shifted right by 64 is below `len`"
)]
fn home_in(tag: u64, depth: u32, len: usize) -> usize {
    let bits = tag.checked_shl(depth).unwrap_or(0);
    ((u128::from(bits) * len as u128) >> 64) as usize
}

/// The directory entry of `tag` in a directory of depth `depth`: its leading bits.
#[inline]
#[expect(
    clippy::cast_possible_truncation,
    reason = "the result is below 2^depth, the directory's length"
)]
pub(crate) fn prefix(tag: u64, depth: u32) -> usize {
    // `checked_shr` covers depth 0 (a shift by 64).
    tag.checked_shr(64 - depth).unwrap_or(0) as usize
}

/// What an insert found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Inserted {
    /// The tag was live already: a duplicate.
    Present,
    /// A new entry was written.
    New,
}

/// How many old slots ahead a rebuild prefetches the new home of (about two thirds of
/// them are occupied, so some ten requests are in flight).
const REBUILD_PREFETCH_AHEAD: usize = 16;

/// Where a segment is, for a prefetch taken without the shard lock: the address of its
/// first slot, its slot count and its local depth ([`home_address`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(crate) struct SegmentPlace {
    pub(crate) base: usize,
    pub(crate) slots: usize,
    pub(crate) depth: u32,
}

/// One segment: a linear-probing table of the tags that share its leading `depth` bits.
/// `used` counts non-empty slots, live or expired.
#[derive(Debug)]
struct Segment {
    slots: SlotMemory,
    used: usize,
    /// Leading tag bits every tag of this segment shares (its local depth).
    depth: u32,
    /// `used` from which the next insert first grows or splits the segment.
    limit: usize,
}

impl Segment {
    fn new(slots: SlotMemory, depth: u32, limit: usize) -> Segment {
        let limit = limit.min(slots.len() - 1);
        Segment {
            slots,
            used: 0,
            depth,
            limit,
        }
    }

    #[inline]
    fn home(&self, tag: u64) -> usize {
        home_in(tag, self.depth, self.slots.len())
    }

    #[inline]
    fn next(&self, index: usize) -> usize {
        let next = index + 1;
        if next == self.slots.len() { 0 } else { next }
    }

    fn place(&self) -> SegmentPlace {
        SegmentPlace {
            base: self.slots.as_ptr().addr(),
            slots: self.slots.len(),
            depth: self.depth,
        }
    }

    #[inline]
    fn prefetch(&self, tag: u64) {
        let home = self.home(tag);
        if let Some(slot) = self.slots.get(home) {
            prefetch_read(slot);
        }
        if let Some(slot) = self.slots.get(home + SLOTS_PER_LINE) {
            prefetch_read(slot);
        }
    }

    /// Whether `tag` is present and live, and the slots read to tell.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn find(&self, tag: u64, live: Liveness) -> (bool, u64) {
        let mut index = self.home(tag);
        let mut probes = 0;
        loop {
            probes += 1;
            let slot = self.slots[index];
            if slot_is_empty(slot) {
                return (false, probes);
            }
            if slot_tag(slot) == tag && live.is_live(slot_bucket(slot)) {
                return (true, probes);
            }
            index = self.next(index);
        }
    }

    /// Inserts `tag` stamped `stamp` unless a live copy exists; the slots read. The
    /// segment is below its limit, so an empty slot ends every probe.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn insert(&mut self, tag: u64, live: Liveness, stamp: u32) -> (Inserted, u64) {
        let mut index = self.home(tag);
        let mut reusable = None;
        let mut probes = 0;
        loop {
            probes += 1;
            let slot = self.slots[index];
            if slot_is_empty(slot) {
                break;
            }
            if live.is_live(slot_bucket(slot)) {
                if slot_tag(slot) == tag {
                    return (Inserted::Present, probes);
                }
            } else if reusable.is_none() {
                reusable = Some(index);
            }
            index = self.next(index);
        }
        let target = match reusable {
            Some(expired) => expired,
            None => {
                self.used += 1;
                index
            }
        };
        self.slots[target] = slot_new(tag, stamp);
        (Inserted::New, probes)
    }

    /// Removes the live entry of `tag`, if any, and returns its bucket stamp.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn remove(&mut self, tag: u64, live: Liveness) -> Option<u32> {
        let mut index = self.home(tag);
        loop {
            let slot = self.slots[index];
            if slot_is_empty(slot) {
                return None;
            }
            if slot_tag(slot) == tag && live.is_live(slot_bucket(slot)) {
                self.remove_at(index);
                return Some(slot_bucket(slot));
            }
            index = self.next(index);
        }
    }

    /// Writes `slot` at the first empty slot from its home (a rebuild or a split: the
    /// tag is known to be absent).
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn place_entry(&mut self, slot: Slot) {
        let mut index = self.home(slot_tag(slot));
        while !slot_is_empty(self.slots[index]) {
            index = self.next(index);
        }
        self.slots[index] = slot;
        self.used += 1;
    }

    /// Prefetches the home of the entry `REBUILD_PREFETCH_AHEAD` slots after `index` in
    /// `old`, if it will land in this segment: the old slots are read in order and the
    /// new ones written at random, so that the writes' cache misses overlap.
    #[inline]
    fn prefetch_ahead(&self, old: &[Slot], index: usize, lands: impl Fn(u64) -> bool) {
        if let Some(&ahead) = old.get(index + REBUILD_PREFETCH_AHEAD)
            && !slot_is_empty(ahead)
            && lands(slot_tag(ahead))
            && let Some(home) = self.slots.get(self.home(slot_tag(ahead)))
        {
            prefetch_read(home);
        }
    }

    /// Advances a sweep from `cursor` up to `end`, removing expired entries; returns the
    /// cursor reached and the number removed.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn sweep(&mut self, mut cursor: usize, end: usize, live: Liveness) -> (usize, usize) {
        let mut removed = 0;
        while cursor < end {
            let slot = self.slots[cursor];
            if !slot_is_empty(slot) && !live.is_live(slot_bucket(slot)) {
                self.remove_at(cursor);
                removed += 1;
                // The shift may have moved another expired entry into `cursor`.
                continue;
            }
            cursor += 1;
        }
        (cursor, removed)
    }

    /// Backward-shift deletion: pulls each following entry of the cluster one step back
    /// while that brings it no earlier than its home, then empties the last hole.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn remove_at(&mut self, mut hole: usize) {
        let mut index = self.next(hole);
        loop {
            let slot = self.slots[index];
            if slot_is_empty(slot) {
                break;
            }
            let home = self.home(slot_tag(slot));
            if may_move(home, hole, index) {
                self.slots[hole] = slot;
                hole = index;
            }
            index = self.next(index);
        }
        self.slots[hole] = EMPTY;
        self.used -= 1;
    }

    /// The live entries.
    fn live_count(&self, live: Liveness) -> usize {
        self.slots
            .iter()
            .filter(|&&slot| !slot_is_empty(slot) && live.is_live(slot_bucket(slot)))
            .count()
    }
}

/// Whether an entry at `index` with home `home` may move back to `hole`, that is, `home`
/// does not lie cyclically in `(hole, index]`.
#[inline]
fn may_move(home: usize, hole: usize, index: usize) -> bool {
    if hole <= index {
        !(hole < home && home <= index)
    } else {
        !(home <= index || hole < home)
    }
}

/// Deepest directory: a segment whose tags share this many leading bits doubles instead
/// of splitting (keyed tags make this unreachable in practice; it bounds the directory).
const MAX_DEPTH: u32 = 24;

/// The table: segments, and the directory that sends each tag to one of them.
#[derive(Debug)]
pub(crate) struct DedupTable {
    segments: Vec<Segment>,
    /// `2^depth` entries: the index in `segments` of each leading-bits prefix's segment.
    directory: Vec<u32>,
    depth: u32,
    /// The sweep pass under way: the segment and slot it resumes at.
    sweep_cursor: Option<(usize, usize)>,
    probes: u64,
    /// Entries moved by growth, and the most one insert moved.
    moved: u64,
    largest_move: usize,
    /// Whether large slot arrays are mapped and advised for huge pages.
    huge_pages: bool,
    /// The identity of where the segments are now: it changes whenever one moves.
    layout: u64,
    /// The generator of segment limits.
    draws: SplitMix64,
}

impl DedupTable {
    /// A table that holds `keys` live keys without growing: one segment.
    /// Fails, without aborting the process, if the slots cannot be allocated.
    pub(crate) fn with_keys(keys: usize, huge_pages: bool) -> Result<Self, TryReserveError> {
        let slots = SlotMemory::try_zeroed(capacity_for(keys), huge_pages)?;
        let limit = slots.len() * MAX_LOAD_PERCENT / 100;
        let layout = next_layout();
        Ok(DedupTable {
            segments: vec![Segment::new(slots, 0, limit)],
            directory: vec![0],
            depth: 0,
            sweep_cursor: None,
            probes: 0,
            moved: 0,
            largest_move: 0,
            huge_pages,
            layout,
            // Distinct per table, so that shards filled at the same rate draw different
            // limits.
            draws: SplitMix64::new(layout),
        })
    }

    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.segments
            .iter()
            .map(|segment| segment.slots.len())
            .sum()
    }

    /// Non-empty slots of every segment, live or expired.
    pub(crate) fn used(&self) -> usize {
        self.segments.iter().map(|segment| segment.used).sum()
    }

    /// Slots inspected by all lookups so far (a measure of probe length).
    pub(crate) fn probes(&self) -> u64 {
        self.probes
    }

    /// Entries growth has moved so far, and the most a single insert moved.
    #[cfg(test)]
    pub(crate) fn moved(&self) -> (u64, usize) {
        (self.moved, self.largest_move)
    }

    /// The address of `tag`'s home slot, for tests of the lock-free prefetch.
    #[cfg(test)]
    pub(crate) fn home_slot_address(&self, tag: u64) -> usize {
        let segment = self.segment(tag);
        segment.place().base + segment.home(tag) * size_of::<Slot>()
    }

    #[cfg(test)]
    pub(crate) fn segment_count(&self) -> usize {
        self.segments.len()
    }

    /// Bytes of memory held by the slot arrays and the directory.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.segments
            .iter()
            .map(|segment| segment.slots.len() * size_of::<Slot>())
            .sum::<usize>()
            + self.directory.len() * size_of::<u32>()
    }

    /// The identity of the segments' current places: equal values, equal places.
    pub(crate) fn layout(&self) -> u64 {
        self.layout
    }

    /// The segment of each of the `2^hint_depth` leading-bits prefixes, for a prefetch
    /// without the lock ([`home_address`]); `None` where several segments share the
    /// prefix.
    #[expect(
        clippy::indexing_slicing,
        reason = "directory entries index `segments`; prefixes are below the directory's length"
    )]
    pub(crate) fn places(&self, hint_depth: u32) -> impl Iterator<Item = Option<SegmentPlace>> {
        (0..1usize << hint_depth).map(move |hint| {
            let entry = if self.depth >= hint_depth {
                hint << (self.depth - hint_depth)
            } else {
                hint >> (hint_depth - self.depth)
            };
            let segment = &self.segments[self.directory[entry] as usize];
            (segment.depth <= hint_depth).then(|| segment.place())
        })
    }

    #[inline]
    #[expect(
        clippy::indexing_slicing,
        reason = "a prefix is below the directory's length, and its entry indexes `segments`"
    )]
    fn segment_of(&self, tag: u64) -> usize {
        self.directory[prefix(tag, self.depth)] as usize
    }

    #[inline]
    #[expect(
        clippy::indexing_slicing,
        reason = "a prefix is below the directory's length, and its entry indexes `segments`"
    )]
    fn segment(&self, tag: u64) -> &Segment {
        &self.segments[self.segment_of(tag)]
    }

    /// Prefetches the home slot of `tag` and the slot one cache line further, so that
    /// the lines a probe is likely to read are on their way before it starts. Unlike a
    /// load, a prefetch does not hold up the instructions after it when it misses.
    #[inline]
    pub(crate) fn prefetch(&self, tag: u64) {
        self.segment(tag).prefetch(tag);
    }

    /// Whether `tag` is present and live.
    pub(crate) fn contains(&mut self, tag: u64, live: Liveness) -> bool {
        let (found, probes) = self.segment(tag).find(tag, live);
        self.probes += probes;
        found
    }

    /// As [`DedupTable::contains`], on a table nobody writes any more (a frozen one).
    pub(crate) fn contains_frozen(&self, tag: u64, live: Liveness) -> bool {
        self.segment(tag).find(tag, live).0
    }

    /// Every live entry, as (tag, 32-bit bucket stamp), segment by segment in slot order.
    pub(crate) fn live_entries(&self, live: Liveness) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.segments
            .iter()
            .flat_map(|segment| segment.slots.iter())
            .filter(move |&&slot| !slot_is_empty(slot) && live.is_live(slot_bucket(slot)))
            .map(|&slot| (slot_tag(slot), slot_bucket(slot)))
    }

    /// Inserts `tag` admitted in the current bucket of `live` unless a live copy exists.
    #[cfg(test)]
    pub(crate) fn insert(&mut self, tag: u64, live: Liveness) -> Inserted {
        self.insert_stamped(tag, live, live.current())
    }

    /// Inserts `tag` stamped with bucket `stamp` (live under `live`) unless a live copy
    /// exists. A segment at its limit first grows or splits, moving its own entries only.
    #[expect(clippy::indexing_slicing, reason = "`segment_of` indexes `segments`")]
    pub(crate) fn insert_stamped(&mut self, tag: u64, live: Liveness, stamp: u32) -> Inserted {
        let mut index = self.segment_of(tag);
        if self.segments[index].used >= self.segments[index].limit {
            self.make_room(index, tag, live);
            index = self.segment_of(tag);
        }
        let (inserted, probes) = self.segments[index].insert(tag, live, stamp);
        self.probes += probes;
        inserted
    }

    /// Removes the live entry of `tag`, if any, and returns its 32-bit bucket stamp: an
    /// admission whose write failed is taken back (backward-shift deletion, as the sweep's).
    #[expect(clippy::indexing_slicing, reason = "`segment_of` indexes `segments`")]
    pub(crate) fn remove(&mut self, tag: u64, live: Liveness) -> Option<u32> {
        let index = self.segment_of(tag);
        self.segments[index].remove(tag, live)
    }

    /// Rebuilds every segment at its size, dropping expired entries. Ends any sweep pass:
    /// the table holds no expired entry after it.
    #[expect(
        clippy::indexing_slicing,
        reason = "`index` runs below the segment count"
    )]
    pub(crate) fn rebuild(&mut self, live: Liveness) {
        for index in 0..self.segments.len() {
            let segment = &self.segments[index];
            let (len, limit) = (segment.slots.len(), segment.limit);
            self.rebuild_segment(index, len, limit, live);
        }
        self.sweep_cursor = None;
        self.layout = next_layout();
    }

    /// Makes room in the full segment `index` (holding `tag`'s prefix): rebuilt at its size
    /// if most of it expired, doubled while small, split in two otherwise.
    #[expect(clippy::indexing_slicing, reason = "`index` comes from `segment_of`")]
    fn make_room(&mut self, index: usize, tag: u64, live: Liveness) {
        let segment = &self.segments[index];
        let (len, depth) = (segment.slots.len(), segment.depth);
        let before = self.moved;
        if segment.live_count(live) < segment.limit / 2 {
            let limit = self.draw_limit(len);
            self.rebuild_segment(index, len, limit, live);
        } else if len < SEGMENT_SLOTS || depth == MAX_DEPTH {
            let grown = (len * 2).max(MIN_CAPACITY);
            let grown = if len < SEGMENT_SLOTS {
                grown.min(SEGMENT_SLOTS)
            } else {
                grown
            };
            let limit = self.draw_limit(grown);
            self.rebuild_segment(index, grown, limit, live);
        } else {
            self.split(index, tag, live);
        }
        let moved = usize::try_from(self.moved - before).unwrap_or(usize::MAX);
        self.largest_move = self.largest_move.max(moved);
        self.layout = next_layout();
    }

    /// A limit for a segment of `len` slots, between `MIN_SPLIT_LOAD_PERCENT` and
    /// `MAX_LOAD_PERCENT` of them.
    fn draw_limit(&mut self, len: usize) -> usize {
        let lowest = len * MIN_SPLIT_LOAD_PERCENT / 100;
        lowest + self.draws.upto(len * MAX_LOAD_PERCENT / 100 - lowest)
    }

    /// Rebuilds segment `index` into `len` fresh slots with a limit of `limit` entries,
    /// keeping its live entries only.
    #[expect(
        clippy::indexing_slicing,
        reason = "`index` is below the segment count"
    )]
    fn rebuild_segment(&mut self, index: usize, len: usize, limit: usize, live: Liveness) {
        let depth = self.segments[index].depth;
        let fresh = Segment::new(SlotMemory::written(len), depth, limit);
        let old = std::mem::replace(&mut self.segments[index], fresh);
        let segment = &mut self.segments[index];
        for (at, &slot) in old.slots.iter().enumerate() {
            segment.prefetch_ahead(&old.slots, at, |_| true);
            if !slot_is_empty(slot) && live.is_live(slot_bucket(slot)) {
                segment.place_entry(slot);
            }
        }
        self.moved += segment.used as u64;
    }

    /// Splits segment `index` (holding `tag`'s prefix) into two of its size by the next
    /// tag bit, keeping live entries only; doubles the directory first if the segment is
    /// as deep as it.
    #[expect(
        clippy::indexing_slicing,
        reason = "`index` is below the segment count; the prefix range lies in the directory"
    )]
    fn split(&mut self, index: usize, tag: u64, live: Liveness) {
        let (depth, len) = (self.segments[index].depth, self.segments[index].slots.len());
        if depth == self.depth {
            self.directory = self
                .directory
                .iter()
                .flat_map(|&entry| [entry, entry])
                .collect();
            self.depth += 1;
        }
        let (low_limit, high_limit) = (self.draw_limit(len), self.draw_limit(len));
        let mut low = Segment::new(SlotMemory::written(len), depth + 1, low_limit);
        let mut high = Segment::new(SlotMemory::written(len), depth + 1, high_limit);
        let is_high = |tag: u64| tag.checked_shl(depth).unwrap_or(0) >> 63 == 1;
        let old = &self.segments[index];
        for (at, &slot) in old.slots.iter().enumerate() {
            low.prefetch_ahead(&old.slots, at, |ahead| !is_high(ahead));
            high.prefetch_ahead(&old.slots, at, is_high);
            if !slot_is_empty(slot) && live.is_live(slot_bucket(slot)) {
                if is_high(slot_tag(slot)) {
                    high.place_entry(slot);
                } else {
                    low.place_entry(slot);
                }
            }
        }
        self.moved += (low.used + high.used) as u64;
        self.segments[index] = low;
        let high_index = u32::try_from(self.segments.len()).unwrap_or(u32::MAX);
        self.segments.push(high);
        // The directory entries of the old segment are those of its prefix; the upper
        // half of them now go to the high segment.
        let span = 1usize << (self.depth - depth);
        let first = prefix(tag, depth) << (self.depth - depth);
        for entry in &mut self.directory[first + span / 2..first + span] {
            *entry = high_index;
        }
    }

    /// Drops every entry at once (all of them expired), keeping the segments' sizes. The
    /// new slots are lazily zeroed allocations, so this costs O(1) in the slots' count.
    pub(crate) fn clear(&mut self) {
        for segment in &mut self.segments {
            // A mapped segment stays mapped (lazily zeroed by the kernel), a heap one on
            // the heap.
            let huge_pages = self.huge_pages && segment.slots.is_mapped();
            segment.slots = SlotMemory::zeroed(segment.slots.len(), huge_pages);
            segment.used = 0;
        }
        self.sweep_cursor = None;
        self.layout = next_layout();
    }

    /// Whether a sweep pass is under way.
    pub(crate) fn sweeping(&self) -> bool {
        self.sweep_cursor.is_some()
    }

    /// Starts a sweep pass from the first slot unless one is under way.
    pub(crate) fn start_sweep(&mut self) {
        if self.sweep_cursor.is_none() {
            self.sweep_cursor = Some((0, 0));
        }
    }

    /// Advances the sweep pass by up to `budget` slots, removing expired entries.
    /// Returns the number removed and whether the pass has reached the end of the table.
    /// A split during a pass leaves the pass valid: the split segments hold no expired
    /// entry, and a new segment is appended behind the others.
    pub(crate) fn sweep(&mut self, budget: usize, live: Liveness) -> (usize, bool) {
        let Some((mut index, mut cursor)) = self.sweep_cursor else {
            return (0, true);
        };
        let mut budget = budget;
        let mut removed = 0;
        while let Some(segment) = self.segments.get_mut(index) {
            let len = segment.slots.len();
            let end = cursor.saturating_add(budget).min(len);
            let (reached, count) = segment.sweep(cursor, end, live);
            removed += count;
            budget -= reached.saturating_sub(cursor);
            if reached < len {
                self.sweep_cursor = Some((index, reached));
                return (removed, false);
            }
            index += 1;
            cursor = 0;
        }
        self.sweep_cursor = None;
        (removed, true)
    }
}

/// The address of the home slot of `tag` in the segment at `place` (the same
/// multiply-shift as a segment's). Only a prefetch address.
pub(crate) fn home_address(place: SegmentPlace, tag: u64) -> usize {
    let home = home_in(tag, place.depth, place.slots);
    place
        .base
        .wrapping_add(home.wrapping_mul(size_of::<Slot>()))
}

/// Bytes of the slot array of a table built for `keys` keys.
pub(crate) fn bytes_for(keys: usize) -> usize {
    capacity_for(keys).saturating_mul(size_of::<Slot>())
}

/// Capacity for `keys` keys at two thirds of `MAX_LOAD_PERCENT`.
fn capacity_for(keys: usize) -> usize {
    (keys.saturating_mul(3 * 100) / (2 * MAX_LOAD_PERCENT) + 1).max(MIN_CAPACITY)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::Window;

    fn window() -> Window {
        Window::new(4, 1)
    }

    fn spread(n: u64) -> u64 {
        n.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
    }

    /// A table grown from empty by the keys `spread(n)` for `n` in `keys`, each new,
    /// admitted under `live`.
    fn grown(keys: std::ops::RangeInclusive<u64>, live: Liveness) -> DedupTable {
        let mut table = DedupTable::with_keys(0, false).unwrap();
        for n in keys {
            assert_eq!(table.insert(spread(n), live), Inserted::New, "key {n}");
        }
        table
    }

    /// `count` distinct tags whose home is slot `home` of the first segment (a table of
    /// one segment).
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the quotient is below 2^64: home < slots"
    )]
    fn tags_with_home(table: &DedupTable, home: usize, count: u64) -> Vec<u64> {
        let slots = table.segments[0].slots.len();
        let first = ((home as u128) << 64).div_ceil(slots as u128) as u64;
        let tags: Vec<u64> = (0..count).map(|i| first + 1 + i).collect();
        assert!(tags.iter().all(|&tag| table.segments[0].home(tag) == home));
        tags
    }

    #[test]
    fn a_removed_entry_is_absent_and_its_cluster_stays_reachable() {
        let mut table = DedupTable::with_keys(64, false).unwrap();
        let live = window().liveness(10);
        let tags = tags_with_home(&table, 3, 4);
        for &tag in &tags {
            assert_eq!(table.insert(tag, live), Inserted::New);
        }
        assert_eq!(table.remove(tags[1], live), Some(10));
        assert_eq!(table.remove(tags[1], live), None);
        assert!(!table.contains(tags[1], live));
        for &tag in [tags[0], tags[2], tags[3]].iter() {
            assert!(table.contains(tag, live), "{tag} lost by the shift");
        }
        assert_eq!(table.used(), 3);
        assert_eq!(table.insert(tags[1], live), Inserted::New);
    }

    #[test]
    fn insert_then_duplicate() {
        let mut table = DedupTable::with_keys(10, false).unwrap();
        let live = window().liveness(0);
        assert_eq!(table.insert(42, live), Inserted::New);
        assert_eq!(table.insert(42, live), Inserted::Present);
        assert!(table.contains(42, live));
        assert!(!table.contains(43, live));
    }

    #[test]
    fn expired_entries_are_absent_and_reused() {
        let mut table = DedupTable::with_keys(10, false).unwrap();
        assert_eq!(table.insert(42, window().liveness(0)), Inserted::New);
        let later = window().liveness(5);
        assert!(!table.contains(42, later));
        assert_eq!(table.insert(42, later), Inserted::New);
        assert_eq!(table.used(), 1, "the expired slot was reused");
    }

    #[test]
    fn sweep_removes_expired_and_keeps_live_reachable() {
        let mut table = DedupTable::with_keys(64, false).unwrap();
        let tags = tags_with_home(&table, 3, 12);
        // Old entries (even) first, then new ones (odd) in one cluster; bucket 0 is still
        // live at bucket 3, so no insert reuses an old slot.
        for parity in [0, 1] {
            for (i, &tag) in tags.iter().enumerate().filter(|(i, _)| i % 2 == parity) {
                let bucket = if i % 2 == 0 { 0 } else { 3 };
                assert_eq!(table.insert(tag, window().liveness(bucket)), Inserted::New);
            }
        }
        let now = window().liveness(7);
        table.start_sweep();
        let (removed, done) = table.sweep(usize::MAX, now);
        assert!(done);
        assert_eq!(removed, 6);
        assert_eq!(table.used(), 6);
        for (i, &tag) in tags.iter().enumerate() {
            assert_eq!(table.contains(tag, now), i % 2 == 1, "tag {i}");
        }
    }

    #[test]
    fn sweep_handles_clusters_that_wrap() {
        let mut table = DedupTable::with_keys(8, false).unwrap();
        let last = table.capacity() - 1;
        let tags = tags_with_home(&table, last, 5);
        for (i, &tag) in tags.iter().enumerate() {
            let bucket = if i < 2 { 0 } else { 3 };
            table.insert(tag, window().liveness(bucket));
        }
        let now = window().liveness(7);
        table.start_sweep();
        while table.sweeping() {
            table.sweep(3, now);
        }
        assert_eq!(table.used(), 3);
        for &tag in &tags[2..] {
            assert!(table.contains(tag, now));
        }
    }

    #[test]
    fn rebuild_keeps_live_entries_only() {
        let mut table = DedupTable::with_keys(4, false).unwrap();
        for tag in 1..=10u64 {
            let bucket = if tag <= 5 { 0 } else { 9 };
            table.insert(spread(tag), window().liveness(bucket));
        }
        let now = window().liveness(9);
        table.rebuild(now);
        assert_eq!(table.used(), 5);
        for tag in 6..=10u64 {
            assert!(table.contains(spread(tag), now));
        }
    }

    /// A table growing from empty moves fewer than two keys for each key it ends with,
    /// and no single insert moves more than one segment's entries: growth is paid in
    /// steps of a segment, never by a rebuild of the whole table.
    #[test]
    fn a_growing_table_moves_each_key_less_than_twice_and_at_most_a_segment_at_once() {
        let live = window().liveness(0);
        let keys = 200_000u64;
        let mut table = grown(1..=keys, live);
        let (moved, largest) = table.moved();
        assert!(moved < 2 * keys, "{moved} moves for {keys} keys");
        assert!(
            largest <= SEGMENT_SLOTS * MAX_LOAD_PERCENT / 100,
            "one insert moved {largest} entries"
        );
        assert!(
            table.segments.len() > 32,
            "{} segments",
            table.segments.len()
        );
        for n in 1..=keys {
            assert!(table.contains(spread(n), live), "key {n} lost by a split");
        }
        assert_eq!(table.used(), 200_000);
    }

    /// A segment whose limit is reached mostly by expired entries is rebuilt at its size
    /// (dropping them) instead of split: expiry does not make the table grow.
    #[test]
    fn a_segment_full_of_expired_entries_is_rebuilt_not_split() {
        let mut table = grown(1..=20_000, window().liveness(0));
        let (segments, capacity) = (table.segment_count(), table.capacity());
        // Bucket 0 is past the window at bucket 10: the old entries are all expired.
        let later = window().liveness(10);
        for n in 20_001..=40_000u64 {
            assert_eq!(table.insert(spread(n), later), Inserted::New);
        }
        assert_eq!(table.segment_count(), segments, "no segment split");
        assert_eq!(table.capacity(), capacity, "no segment grew");
        for n in 20_001..=40_000u64 {
            assert!(table.contains(spread(n), later));
        }
    }

    /// Segments filled at the same rate split at different loads: their limits are drawn
    /// apart, so a table's splits spread over many batches instead of a few.
    #[test]
    fn segments_draw_different_limits() {
        let table = grown(1..=100_000, window().liveness(0));
        let limits: std::collections::BTreeSet<usize> =
            table.segments.iter().map(|segment| segment.limit).collect();
        assert!(limits.len() > table.segments.len() / 2, "{limits:?}");
        let lowest = SEGMENT_SLOTS * MIN_SPLIT_LOAD_PERCENT / 100;
        assert!(limits.iter().all(|&limit| limit >= lowest), "{limits:?}");
    }

    /// A seeded mix of inserts, removals, sweeps and time passing, checked against a
    /// model after every step, across many splits.
    #[test]
    fn a_splitting_table_answers_as_a_model() {
        let seed = std::env::var("ONCEDB_SEED")
            .ok()
            .and_then(|seed| seed.parse().ok())
            .unwrap_or(0x5eed_u64);
        println!("seed {seed}");
        let mut rng = SplitMix64::new(seed);
        let window = Window::new(4, 1);
        let mut table = DedupTable::with_keys(0, false).unwrap();
        let mut model: std::collections::HashMap<u64, u32> = std::collections::HashMap::new();
        let mut bucket = 10u32;
        for step in 0..200_000u32 {
            let live = window.liveness(u64::from(bucket));
            let tag = spread(1 + rng.below(40_000));
            let in_model = model.get(&tag).is_some_and(|&stamp| live.is_live(stamp));
            match rng.below(5000) {
                0..3500 => {
                    let expected = if in_model {
                        Inserted::Present
                    } else {
                        Inserted::New
                    };
                    assert_eq!(table.insert(tag, live), expected, "seed {seed} step {step}");
                    if !in_model {
                        model.insert(tag, bucket);
                    }
                }
                3500..4000 => {
                    let expected = in_model.then(|| model[&tag]);
                    assert_eq!(table.remove(tag, live), expected, "seed {seed} step {step}");
                    model.remove(&tag);
                }
                4000..4999 => assert_eq!(table.contains(tag, live), in_model, "seed {seed}"),
                _ => {
                    bucket += 1;
                    table.start_sweep();
                    table.sweep(rng.upto(20_000), window.liveness(u64::from(bucket)));
                }
            }
        }
        let live = window.liveness(u64::from(bucket));
        let expected: usize = model.values().filter(|&&stamp| live.is_live(stamp)).count();
        assert_eq!(table.live_entries(live).count(), expected, "seed {seed}");
        assert!(table.segments.len() > 4, "the run split segments");
    }

    #[test]
    fn may_move_respects_cyclic_order() {
        // No wrap: hole 2, entry at 5.
        assert!(may_move(1, 2, 5));
        assert!(may_move(2, 2, 5));
        assert!(!may_move(3, 2, 5));
        assert!(!may_move(5, 2, 5));
        // Wrap: hole at 14, entry at 1 of a 16-slot table.
        assert!(may_move(13, 14, 1));
        assert!(may_move(14, 14, 1));
        assert!(!may_move(15, 14, 1));
        assert!(!may_move(0, 14, 1));
    }
}
