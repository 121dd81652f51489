//! The dedup table of one shard: open addressing with linear probing over 12-byte slots.
//!
//! A slot holds a 64-bit tag (0 = empty) and the 32-bit bucket of the key's admission.
//! The home slot is derived from the tag alone (`tag * capacity >> 64`), so entries can be
//! moved and rehashed without the original key. Expired entries stay in place until the
//! incremental sweep removes them with backward-shift deletion: there are no tombstones,
//! and an insert may reuse an expired slot it passes.

use std::collections::TryReserveError;

use super::slots::{EMPTY, Slot, SlotMemory};
use crate::base::{Liveness, prefetch_read};

/// Slots in one 64-byte cache line (rounded up).
const SLOTS_PER_LINE: usize = 64 / 12 + 1;

/// Highest load before the table grows, as a fraction. Linear probing reads about
/// `(1 + 1 / (1 - load)^2) / 2` slots for an absent key: 13 at 4/5, 32 at 7/8.
const MAX_LOAD_NUM: usize = 4;
const MAX_LOAD_DEN: usize = 5;

/// Smallest table allocated.
const MIN_CAPACITY: usize = 16;

const _: () = assert!(size_of::<Slot>() == 12);

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

/// The table. `used` counts non-empty slots, live or expired.
#[derive(Debug)]
pub(crate) struct DedupTable {
    slots: SlotMemory,
    used: usize,
    sweep_cursor: Option<usize>,
    probes: u64,
    /// Whether large slot arrays are mapped and advised for huge pages.
    huge_pages: bool,
}

impl DedupTable {
    /// A table that holds `keys` live keys without growing.
    /// Fails, without aborting the process, if the slots cannot be allocated.
    pub(crate) fn with_keys(keys: usize, huge_pages: bool) -> Result<Self, TryReserveError> {
        Ok(DedupTable {
            slots: SlotMemory::try_zeroed(capacity_for(keys), huge_pages)?,
            huge_pages,
            used: 0,
            sweep_cursor: None,
            probes: 0,
        })
    }

    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    pub(crate) fn used(&self) -> usize {
        self.used
    }

    /// Slots inspected by all lookups so far (a measure of probe length).
    pub(crate) fn probes(&self) -> u64 {
        self.probes
    }

    /// Bytes of memory held by the slot array.
    pub(crate) fn heap_bytes(&self) -> usize {
        self.slots.len() * size_of::<Slot>()
    }

    #[inline]
    #[expect(
        clippy::cast_possible_truncation,
        reason = "bucket stamps are 32 bits by design; indices fit the tables they index"
    )]
    fn home(&self, tag: u64) -> usize {
        ((u128::from(tag) * self.slots.len() as u128) >> 64) as usize
    }

    #[inline]
    fn next(&self, index: usize) -> usize {
        let next = index + 1;
        if next == self.slots.len() { 0 } else { next }
    }

    /// The address of the first slot and the number of slots, for a prefetch taken
    /// without the shard lock ([`home_address`]).
    pub(crate) fn place_of_slots(&self) -> (usize, usize) {
        (self.slots.as_ptr().addr(), self.slots.len())
    }

    /// Prefetches the home slot of `tag` and the slot one cache line further, so that
    /// the lines a probe is likely to read are on their way before it starts. Unlike a
    /// load, a prefetch does not hold up the instructions after it when it misses.
    #[inline]
    pub(crate) fn prefetch(&self, tag: u64) {
        let home = self.home(tag);
        if let Some(slot) = self.slots.get(home) {
            prefetch_read(slot);
        }
        if let Some(slot) = self.slots.get(home + SLOTS_PER_LINE) {
            prefetch_read(slot);
        }
    }

    /// Whether `tag` is present and live.
    pub(crate) fn contains(&mut self, tag: u64, live: Liveness) -> bool {
        let (found, probes) = self.find(tag, live);
        self.probes += probes;
        found
    }

    /// As [`DedupTable::contains`], on a table nobody writes any more (a frozen one).
    pub(crate) fn contains_frozen(&self, tag: u64, live: Liveness) -> bool {
        self.find(tag, live).0
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

    /// Every live entry, as (tag, 32-bit bucket stamp), in slot order.
    pub(crate) fn live_entries(&self, live: Liveness) -> impl Iterator<Item = (u64, u32)> + '_ {
        self.slots
            .iter()
            .filter(move |&&slot| !slot_is_empty(slot) && live.is_live(slot_bucket(slot)))
            .map(|&slot| (slot_tag(slot), slot_bucket(slot)))
    }

    /// Inserts `tag` admitted in the current bucket of `live` unless a live copy exists.
    /// The caller keeps the load below the limit with [`DedupTable::needs_growth`].
    #[cfg(test)]
    pub(crate) fn insert(&mut self, tag: u64, live: Liveness) -> Inserted {
        self.insert_stamped(tag, live, live.current())
    }

    /// Inserts `tag` stamped with bucket `stamp` (live under `live`) unless a live copy
    /// exists.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    pub(crate) fn insert_stamped(&mut self, tag: u64, live: Liveness, stamp: u32) -> Inserted {
        let mut index = self.home(tag);
        let mut reusable = None;
        loop {
            self.probes += 1;
            let slot = self.slots[index];
            if slot_is_empty(slot) {
                break;
            }
            if live.is_live(slot_bucket(slot)) {
                if slot_tag(slot) == tag {
                    return Inserted::Present;
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
        Inserted::New
    }

    /// Removes the live entry of `tag`, if any, and returns its 32-bit bucket stamp: an
    /// admission whose write failed is taken back (backward-shift deletion, as the sweep's).
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    pub(crate) fn remove(&mut self, tag: u64, live: Liveness) -> Option<u32> {
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

    /// Whether one more insert would push the load above `MAX_LOAD`.
    pub(crate) fn needs_growth(&self) -> bool {
        (self.used + 1) * MAX_LOAD_DEN > self.slots.len() * MAX_LOAD_NUM
    }

    /// Rebuilds the table for `live_keys + 1` keys at two thirds of `MAX_LOAD`, dropping expired
    /// entries on the way. Ends any sweep pass: the new table holds no expired entry.
    pub(crate) fn rebuild(&mut self, live_keys: usize, live: Liveness) {
        self.rebuild_into(capacity_for(live_keys + 1), live);
    }

    /// Grows the table (it reached `MAX_LOAD`) for `live_keys + 1` keys at half of
    /// `MAX_LOAD`, dropping expired entries: a doubling when most entries are live, so
    /// that a table growing from empty moves each key about once (1/2 + 1/4 + …), where
    /// a growth to two thirds of the load moved it about twice.
    pub(crate) fn grow(&mut self, live_keys: usize, live: Liveness) {
        self.rebuild_into(grown_capacity(live_keys + 1), live);
    }

    fn rebuild_into(&mut self, capacity: usize, live: Liveness) {
        let old = std::mem::replace(&mut self.slots, SlotMemory::written(capacity));
        self.used = 0;
        self.sweep_cursor = None;
        // The old slots are read in order, the new ones written at random: request the
        // home slot of the entry `REBUILD_PREFETCH_AHEAD` places on while placing this
        // one, so that the writes' cache misses overlap.
        for (index, &slot) in old.iter().enumerate() {
            if let Some(&ahead) = old.get(index + REBUILD_PREFETCH_AHEAD)
                && !slot_is_empty(ahead)
                && let Some(home) = self.slots.get(self.home(slot_tag(ahead)))
            {
                prefetch_read(home);
            }
            if !slot_is_empty(slot) && live.is_live(slot_bucket(slot)) {
                self.place(slot);
            }
        }
    }

    /// Drops every entry at once (all of them expired), keeping the allocation size. The
    /// new table is a lazily zeroed allocation, so this costs O(1) in the table size.
    pub(crate) fn clear(&mut self) {
        // A mapped table stays mapped (lazily zeroed by the kernel), a heap one on the heap.
        let huge_pages = self.huge_pages && self.slots.is_mapped();
        self.slots = SlotMemory::zeroed(self.slots.len(), huge_pages);
        self.used = 0;
        self.sweep_cursor = None;
    }

    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn place(&mut self, slot: Slot) {
        let mut index = self.home(slot_tag(slot));
        while !slot_is_empty(self.slots[index]) {
            index = self.next(index);
        }
        self.slots[index] = slot;
        self.used += 1;
    }

    /// Whether a sweep pass is under way.
    pub(crate) fn sweeping(&self) -> bool {
        self.sweep_cursor.is_some()
    }

    /// Starts a sweep pass from slot 0 unless one is under way.
    pub(crate) fn start_sweep(&mut self) {
        if self.sweep_cursor.is_none() {
            self.sweep_cursor = Some(0);
        }
    }

    /// Advances the sweep pass by up to `budget` slots, removing expired entries.
    /// Returns the number removed and whether the pass has reached the end of the table.
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    pub(crate) fn sweep(&mut self, budget: usize, live: Liveness) -> (usize, bool) {
        let Some(mut cursor) = self.sweep_cursor else {
            return (0, true);
        };
        let end = (cursor + budget).min(self.slots.len());
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
        let done = cursor == self.slots.len();
        self.sweep_cursor = if done { None } else { Some(cursor) };
        (removed, done)
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
            if self.may_move(home, hole, index) {
                self.slots[hole] = slot;
                hole = index;
            }
            index = self.next(index);
        }
        self.slots[hole] = EMPTY;
        self.used -= 1;
    }

    /// Whether an entry at `index` with home `home` may move back to `hole`, that is,
    /// `home` does not lie cyclically in `(hole, index]`.
    #[inline]
    fn may_move(&self, home: usize, hole: usize, index: usize) -> bool {
        if hole <= index {
            !(hole < home && home <= index)
        } else {
            !(home <= index || hole < home)
        }
    }
}

/// A table of empty slots whose pages are written now. A lazily zeroed allocation would
/// map the shared zero page on the first read (the batch prefetch reads before it
/// writes) and take a copy-on-write fault with a cross-CPU TLB flush on the first write.
/// The address of the home slot of `tag` in a table of `slots` slots starting at `base`
/// (the same multiply-shift as [`DedupTable::home`]). Only a prefetch address.
#[expect(
    clippy::cast_possible_truncation,
    reason = "bucket stamps are 32 bits by design; indices fit the tables they index"
)]
pub(crate) fn home_address(base: usize, slots: usize, tag: u64) -> usize {
    let home = ((u128::from(tag) * slots as u128) >> 64) as usize;
    base.wrapping_add(home.wrapping_mul(size_of::<Slot>()))
}

/// Capacity for `keys` keys at two thirds of `MAX_LOAD`, the load right after a 1.5x
/// growth.
/// Bytes of the slot array of a table built for `keys` keys.
pub(crate) fn bytes_for(keys: usize) -> usize {
    capacity_for(keys).saturating_mul(size_of::<Slot>())
}

/// Capacity for `keys` keys at half of `MAX_LOAD`, the load right after a doubling.
fn grown_capacity(keys: usize) -> usize {
    (keys.saturating_mul(2 * MAX_LOAD_DEN) / MAX_LOAD_NUM + 1).max(MIN_CAPACITY)
}

fn capacity_for(keys: usize) -> usize {
    (keys.saturating_mul(3 * MAX_LOAD_DEN) / (2 * MAX_LOAD_NUM) + 1).max(MIN_CAPACITY)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::Window;

    fn window() -> Window {
        Window::new(4, 1)
    }

    /// `count` distinct tags whose home is slot `home`.
    #[expect(
        clippy::cast_possible_truncation,
        reason = "the quotient is below 2^64: home < slots"
    )]
    fn tags_with_home(table: &DedupTable, home: usize, count: u64) -> Vec<u64> {
        let first = ((home as u128) << 64).div_ceil(table.slots.len() as u128) as u64;
        let tags: Vec<u64> = (0..count).map(|i| first + 1 + i).collect();
        assert!(tags.iter().all(|&tag| table.home(tag) == home));
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
            table.insert(
                tag.wrapping_mul(0x9e37_79b9_7f4a_7c15),
                window().liveness(bucket),
            );
        }
        let now = window().liveness(9);
        table.rebuild(5, now);
        assert_eq!(table.used(), 5);
        for tag in 6..=10u64 {
            assert!(table.contains(tag.wrapping_mul(0x9e37_79b9_7f4a_7c15), now));
        }
    }

    /// A table growing from empty moves fewer than two keys for each key it ends with
    /// (about 1 to 2, by where the last growth fell); growing to two thirds of the load
    /// instead of half moved 2 to 3.
    #[test]
    fn a_table_growing_from_empty_moves_each_key_less_than_twice() {
        let mut table = DedupTable::with_keys(0, false).unwrap();
        let live = window().liveness(0);
        let keys = 200_000u64;
        let mut moved = 0;
        for n in 1..=keys {
            if table.needs_growth() {
                moved += table.used() as u64;
                table.grow(table.used(), live);
            }
            assert_eq!(
                table.insert(n.wrapping_mul(0x9e37_79b9_7f4a_7c15), live),
                Inserted::New
            );
        }
        assert!(moved < 2 * keys, "{moved} moves for {keys} keys");
    }

    #[test]
    fn may_move_respects_cyclic_order() {
        let table = DedupTable::with_keys(10, false).unwrap();
        // No wrap: hole 2, entry at 5.
        assert!(table.may_move(1, 2, 5));
        assert!(table.may_move(2, 2, 5));
        assert!(!table.may_move(3, 2, 5));
        assert!(!table.may_move(5, 2, 5));
        // Wrap: hole at 14, entry at 1 of a 16-slot table.
        assert!(table.may_move(13, 14, 1));
        assert!(table.may_move(14, 14, 1));
        assert!(!table.may_move(15, 14, 1));
        assert!(!table.may_move(0, 14, 1));
    }
}
