//! Finished records whose response and key are both in the log, packed: 84 bytes each in
//! one ring of fixed-size chunks, in the order they settled, found through a table of
//! 4-byte positions.
//!
//! Nearly every record of a durable store ends here once its lease ends: such a record
//! never changes again, so it needs no map slot sized for the other forms (in flight,
//! holding bytes, fenced leases), no expiry queue entry (the ring is that queue) and no
//! heap block. `RecordMap` keeps the other forms and moves a record here when it settles.

use std::collections::VecDeque;

use hashbrown::HashTable;

use crate::base::{LogSpan, RecordStatus, SettledRecord, Window};

/// A frame's place relative to its record: its segment's bucket as an offset from the
/// record's bucket (a frame lies in a segment whose bucket is at least the record's), the
/// segment's sequence, and its byte range. 12 bytes where a `LogSpan` takes 20.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PackedSpan {
    bucket_after: u16,
    seq: u16,
    start: u32,
    len: u32,
}

impl PackedSpan {
    /// `span` relative to a record of `bucket`; `None` if it does not fit (a segment more
    /// than 65,535 buckets after the record, or a sequence past 65,535).
    fn pack(span: LogSpan, bucket: u64) -> Option<PackedSpan> {
        Some(PackedSpan {
            bucket_after: u16::try_from(span.bucket.checked_sub(bucket)?).ok()?,
            seq: u16::try_from(span.seq).ok()?,
            start: span.start,
            len: span.len,
        })
    }

    fn unpack(self, bucket: u64) -> LogSpan {
        LogSpan {
            bucket: bucket + u64::from(self.bucket_after),
            seq: u32::from(self.seq),
            start: self.start,
            len: self.len,
        }
    }
}

/// The two top bits of `Packed::lease`: which ending the record had (none: a vacated slot).
const STATUS_SHIFT: u32 = 62;
const COMPLETED: u64 = 1 << STATUS_SHIFT;
const FAILED: u64 = 2 << STATUS_SHIFT;
const LEASE_MASK: u64 = COMPLETED - 1;

/// A finished record, packed to an alignment of 4 (its fields sum to 76 bytes, which 8-byte
/// alignment would pad to 80, and a `u128` field to 96). Fields are read by copy.
#[derive(Debug, Clone, Copy)]
#[repr(C, packed(4))]
struct Packed {
    fingerprint: [u64; 2],
    request_hash: [u64; 2],
    /// When it was reserved; its bucket is the one this falls in (a record stamped with
    /// another bucket is not packed).
    created_ms: u64,
    /// The lease that ended the record (below 2^62), with the ending in the top bits;
    /// zero there marks a slot whose record was removed or replaced.
    lease: u64,
    /// When it ended, after `created_ms`.
    finished_after_ms: u32,
    response: PackedSpan,
    key: PackedSpan,
}

#[expect(
    clippy::cast_possible_truncation,
    reason = "the low half is taken on purpose"
)]
fn split(value: u128) -> [u64; 2] {
    [value as u64, (value >> 64) as u64]
}

fn join([low, high]: [u64; 2]) -> u128 {
    u128::from(low) | (u128::from(high) << 64)
}

/// The table's hash of a fingerprint: its high half, as the record map's hasher takes it.
fn hash_of(fingerprint: [u64; 2]) -> u64 {
    fingerprint[1]
}

impl Packed {
    fn pack(fingerprint: u128, record: &SettledRecord, window: Window) -> Option<Packed> {
        if window.bucket_of(record.created_ms) != record.bucket {
            return None;
        }
        let ending = match record.status {
            RecordStatus::Completed => COMPLETED,
            RecordStatus::Failed => FAILED,
            RecordStatus::InFlight => return None,
        };
        if record.lease_id > LEASE_MASK {
            return None;
        }
        Some(Packed {
            fingerprint: split(fingerprint),
            request_hash: split(record.request_hash),
            created_ms: record.created_ms,
            lease: record.lease_id | ending,
            finished_after_ms: u32::try_from(record.finished_ms.checked_sub(record.created_ms)?)
                .ok()?,
            response: PackedSpan::pack(record.response, record.bucket)?,
            key: PackedSpan::pack(record.key, record.bucket)?,
        })
    }

    fn bucket(&self, window: Window) -> u64 {
        window.bucket_of(self.created_ms)
    }

    fn unpack(&self, window: Window) -> SettledRecord {
        let bucket = self.bucket(window);
        SettledRecord {
            request_hash: join(self.request_hash),
            bucket,
            created_ms: self.created_ms,
            lease_id: self.lease & LEASE_MASK,
            status: if self.lease & !LEASE_MASK == FAILED {
                RecordStatus::Failed
            } else {
                RecordStatus::Completed
            },
            finished_ms: self.created_ms + u64::from(self.finished_after_ms),
            response: self.response.unpack(bucket),
            key: self.key.unpack(bucket),
        }
    }

    fn is_vacant(&self) -> bool {
        self.lease & !LEASE_MASK == 0
    }
}

/// Records a chunk of the ring holds (a power of two, which a vector filled one by one
/// reaches exactly): a shard's ring keeps at most one chunk partly filled at each end,
/// 42 KiB.
const CHUNK: u32 = 512;

/// The records in the order they settled, at consecutive positions from `first` (the
/// position of the first chunk's first slot), every chunk but the last full; the slots
/// from `head` to `tail` are the ring's (`first <= head < first + CHUNK`). Positions wrap
/// at 2^32, and the ring never spans more than `MAX_POSITIONS`.
#[derive(Debug, Default)]
struct Ring {
    chunks: VecDeque<Vec<Packed>>,
    first: u32,
    head: u32,
    tail: u32,
}

/// Positions the ring may span, well inside 2^32 so that wrapped offsets stay unambiguous.
const MAX_POSITIONS: u32 = u32::MAX - 2 * CHUNK;

impl Ring {
    /// Where `position` lies, if it is inside the ring: (chunk, slot).
    fn place(&self, position: u32) -> Option<(usize, usize)> {
        if position.wrapping_sub(self.head) >= self.tail.wrapping_sub(self.head) {
            return None;
        }
        let offset = position.wrapping_sub(self.first);
        Some(((offset / CHUNK) as usize, (offset % CHUNK) as usize))
    }

    fn slot(&self, position: u32) -> Option<&Packed> {
        let (chunk, slot) = self.place(position)?;
        self.chunks.get(chunk)?.get(slot)
    }

    fn slot_mut(&mut self, position: u32) -> Option<&mut Packed> {
        let (chunk, slot) = self.place(position)?;
        self.chunks.get_mut(chunk)?.get_mut(slot)
    }

    /// The table's hash of the record at `position` (any value for one outside the ring,
    /// which the table never holds).
    fn hash_at(&self, position: u32) -> u64 {
        self.slot(position)
            .map_or(0, |slot| hash_of(slot.fingerprint))
    }

    fn is_full(&self) -> bool {
        self.tail.wrapping_sub(self.head) >= MAX_POSITIONS
    }

    /// Appends `packed`; returns its position.
    fn push(&mut self, packed: Packed) -> u32 {
        match self.chunks.back_mut() {
            Some(chunk) if chunk.len() < CHUNK as usize => chunk.push(packed),
            _ => {
                if self.chunks.is_empty() {
                    self.first = self.tail;
                }
                // Grown as it fills (doubling up to exactly `CHUNK`), so that a shard
                // with few records holds few bytes.
                self.chunks.push_back(vec![packed]);
            }
        }
        let position = self.tail;
        self.tail = self.tail.wrapping_add(1);
        position
    }

    /// Drops the front slot, and its chunk once that chunk is all dropped.
    fn pop(&mut self) {
        self.head = self.head.wrapping_add(1);
        if self.head == self.tail {
            self.chunks.clear();
            self.first = self.head;
        } else if self.head.wrapping_sub(self.first) == CHUNK {
            self.chunks.pop_front();
            self.first = self.head;
        }
    }

    /// Drops the back slot (the ring is not empty).
    fn pop_back(&mut self) {
        self.tail = self.tail.wrapping_sub(1);
        if let Some(chunk) = self.chunks.back_mut() {
            chunk.pop();
            if chunk.is_empty() {
                self.chunks.pop_back();
            }
        }
        if self.head == self.tail {
            self.chunks.clear();
            self.first = self.head;
        }
    }

    fn heap_bytes(&self) -> usize {
        let slots: usize = self.chunks.iter().map(Vec::capacity).sum();
        slots * size_of::<Packed>() + self.chunks.capacity() * size_of::<Vec<Packed>>()
    }
}

/// The settled records of one shard: the ring, and `index`, which holds the position of
/// every slot of the ring that is not vacant, exactly once, hashed by its fingerprint's
/// high half. One fingerprint has at most one slot that is not vacant.
#[derive(Debug, Default)]
pub(super) struct DenseRecords {
    ring: Ring,
    index: HashTable<u32>,
}

impl DenseRecords {
    fn find(&self, fingerprint: [u64; 2]) -> Option<u32> {
        self.index
            .find(hash_of(fingerprint), |&position| {
                self.ring
                    .slot(position)
                    .is_some_and(|slot| { slot.fingerprint } == fingerprint)
            })
            .copied()
    }

    /// The record of `fingerprint`, if it is here and its bucket is live.
    pub(super) fn get(
        &self,
        fingerprint: u128,
        window: Window,
        current: u64,
    ) -> Option<SettledRecord> {
        let slot = self.ring.slot(self.find(split(fingerprint))?)?;
        window
            .is_live(slot.bucket(window), current)
            .then(|| slot.unpack(window))
    }

    /// Takes the record of `fingerprint` out (live or expired), if it is here.
    pub(super) fn remove(&mut self, fingerprint: u128, window: Window) -> Option<SettledRecord> {
        let fingerprint = split(fingerprint);
        let ring = &self.ring;
        let (position, _) = self
            .index
            .find_entry(hash_of(fingerprint), |&at| {
                ring.slot(at)
                    .is_some_and(|slot| { slot.fingerprint } == fingerprint)
            })
            .ok()?
            .remove();
        let slot = self.ring.slot_mut(position)?;
        let record = slot.unpack(window);
        slot.lease = 0;
        Some(record)
    }

    /// [`DenseRecords::remove`], and if the record held the newest slot, that slot goes
    /// at once (an older one waits, vacant, for expiry). For replay, which drops each
    /// record a record run holds right after settling it: no seal is under way then, so
    /// no seal's mark (`live_records`) names the position a later record takes again.
    pub(super) fn remove_reclaiming(
        &mut self,
        fingerprint: u128,
        window: Window,
    ) -> Option<SettledRecord> {
        let newest = self.ring.tail.wrapping_sub(1);
        let reclaims = self.ring.tail != self.ring.head
            && self
                .ring
                .slot(newest)
                .is_some_and(|slot| join(slot.fingerprint) == fingerprint && !slot.is_vacant());
        let record = self.remove(fingerprint, window)?;
        if reclaims {
            self.ring.pop_back();
        }
        Some(record)
    }

    /// Adds `record` of `fingerprint` (whose earlier record, if any, the caller removed);
    /// gives it back if it does not pack (see `Packed::pack`: a record stamped with
    /// another bucket than its time falls in, as a clock reading older than another
    /// thread's may be) or the ring is full.
    pub(super) fn add(
        &mut self,
        fingerprint: u128,
        record: SettledRecord,
        window: Window,
    ) -> Result<(), SettledRecord> {
        let Some(packed) = Packed::pack(fingerprint, &record, window) else {
            return Err(record);
        };
        if self.ring.is_full() {
            return Err(record);
        }
        let position = self.ring.push(packed);
        // A growing table rehashes through the ring, borrowed apart from the table.
        let ring = &self.ring;
        self.index
            .insert_unique(hash_of(packed.fingerprint), position, |&at| {
                ring.hash_at(at)
            });
        Ok(())
    }

    /// Drops up to `budget` slots from the front whose record expired (or was vacated),
    /// stopping at the first live one: records settle nearly in bucket order, so an
    /// expired record behind a live one (which settled first, from a newer bucket) waits
    /// at most as long as it was itself in flight (lookups already answer it absent).
    pub(super) fn expire(&mut self, budget: usize, window: Window, current: u64) -> bool {
        let idle = self.expire_front(budget, window, current);
        self.give_back();
        idle
    }

    /// [`DenseRecords::expire`]'s drops.
    fn expire_front(&mut self, budget: usize, window: Window, current: u64) -> bool {
        for _ in 0..budget {
            let Some(front) = self.ring.slot(self.ring.head).copied() else {
                return true;
            };
            if !front.is_vacant() && window.is_live(front.bucket(window), current) {
                return true;
            }
            self.pop_front(window);
        }
        false
    }

    /// Gives back the table's memory once it holds under a quarter of its capacity (the
    /// ring gives back its chunks as they empty): records that left, sealed or expired,
    /// leave no peak behind for the memory budget to weigh.
    fn give_back(&mut self) {
        if self.index.len() * 4 < self.index.capacity() {
            let ring = &self.ring;
            self.index
                .shrink_to(2 * self.index.len(), |&position| ring.hash_at(position));
        }
    }

    /// Drops the front slot and its table entry; returns its record's bucket if it
    /// was not vacant.
    fn pop_front(&mut self, window: Window) -> Option<u64> {
        let head = self.ring.head;
        let front = self
            .ring
            .slot(head)
            .copied()
            .filter(|front| !front.is_vacant());
        if let Some(front) = front
            && let Ok(entry) = self
                .index
                .find_entry(hash_of(front.fingerprint), |&position| position == head)
        {
            entry.remove();
        }
        self.ring.pop();
        front.map(|front| front.bucket(window))
    }

    /// Every live record here, with its fingerprint, and the position past the last
    /// slot: [`DenseRecords::drop_before`] that position drops exactly these slots (and
    /// vacant or expired ones among them) once a record run holds them.
    pub(super) fn live_records(
        &self,
        window: Window,
        current: u64,
    ) -> (Vec<(u128, SettledRecord)>, u32) {
        let ring = &self.ring;
        let records = (0..ring.tail.wrapping_sub(ring.head))
            .filter_map(|offset| ring.slot(ring.head.wrapping_add(offset)))
            .filter(|slot| !slot.is_vacant() && window.is_live(slot.bucket(window), current))
            .map(|slot| (join(slot.fingerprint), slot.unpack(window)))
            .collect();
        (records, ring.tail)
    }

    /// Drops every slot before position `end` (one `live_records` returned), unless
    /// expiry already dropped past it, handing each dropped record's bucket to `dropped`.
    pub(super) fn drop_before(&mut self, end: u32, window: Window, mut dropped: impl FnMut(u64)) {
        loop {
            let (head, tail) = (self.ring.head, self.ring.tail);
            // Zero once `end` is reached; past the ring's length if expiry passed it.
            let left = end.wrapping_sub(head);
            if left == 0 || left > tail.wrapping_sub(head) {
                self.give_back();
                return;
            }
            if let Some(bucket) = self.pop_front(window) {
                dropped(bucket);
            }
        }
    }

    /// Records held, live or expired but not yet dropped.
    pub(super) fn len(&self) -> usize {
        self.index.len()
    }

    /// The bytes its records take, counted by record (a slot and its index entry), not by
    /// the capacity the ring and table keep once records leave.
    pub(super) fn record_bytes(&self) -> usize {
        self.len() * (size_of::<Packed>() + size_of::<u32>())
    }

    /// Heap bytes held: the chunks' capacity and the table's.
    pub(super) fn heap_bytes(&self) -> usize {
        self.ring.heap_bytes() + self.index.allocation_size()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settled(bucket: u64, lease_id: u64) -> SettledRecord {
        let span = |start| LogSpan {
            bucket: bucket + 1,
            seq: 3,
            start,
            len: 300,
        };
        SettledRecord {
            request_hash: u128::MAX - 5,
            bucket,
            created_ms: 1_000 * bucket + 10,
            lease_id,
            status: RecordStatus::Failed,
            finished_ms: 1_000 * bucket + 70,
            response: span(4_096),
            key: span(64),
        }
    }

    #[test]
    fn a_packed_record_is_76_bytes_and_unpacks_to_what_went_in() {
        assert_eq!(size_of::<Packed>(), 76);
        let mut dense = DenseRecords::default();
        let window = Window::new(4_000, 1_000);
        let record = settled(2, LEASE_MASK);
        dense.add(u128::MAX, record, window).unwrap();
        assert_eq!(dense.get(u128::MAX, window, 2), Some(record));
        assert_eq!(dense.get(u128::MAX - 1, window, 2), None);
        let completed = SettledRecord {
            status: RecordStatus::Completed,
            ..settled(3, 7)
        };
        dense.add(5, completed, window).unwrap();
        assert_eq!(dense.get(5, window, 3), Some(completed));
    }

    /// Records that leave, expired or sealed, give their memory back: the ring its
    /// chunks, the table its capacity.
    #[test]
    fn memory_records_leave_is_given_back() {
        let window = Window::new(4_000, 1_000);
        let mut dense = DenseRecords::default();
        let empty = dense.heap_bytes();
        // Fingerprints spread over both halves, as hashed keys are.
        let fingerprint = |n: u128| n.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
        for n in 0..50_000 {
            dense.add(fingerprint(n), settled(2, 1), window).unwrap();
        }
        let peak = dense.heap_bytes();
        assert!(dense.expire(60_000, window, 9));
        assert_eq!(dense.len(), 0);
        assert!(
            dense.heap_bytes() < empty + peak / 100,
            "{} of {peak}",
            dense.heap_bytes()
        );
        for n in 0..50_000 {
            dense.add(fingerprint(n), settled(20, 1), window).unwrap();
        }
        let (_, end) = dense.live_records(window, 20);
        dense.drop_before(end, window, |_| {});
        assert_eq!(dense.len(), 0);
        assert!(
            dense.heap_bytes() < empty + peak / 100,
            "{} of {peak}",
            dense.heap_bytes()
        );
    }

    #[test]
    fn a_record_that_does_not_pack_is_given_back() {
        let mut dense = DenseRecords::default();
        let far = LogSpan {
            bucket: 2 + 65_536,
            ..settled(2, 1).response
        };
        let refused = [
            SettledRecord {
                response: far,
                ..settled(2, 1)
            },
            SettledRecord {
                finished_ms: 1,
                ..settled(2, 1)
            },
            settled(2, LEASE_MASK + 1),
            SettledRecord {
                bucket: 3,
                ..settled(2, 1)
            },
        ];
        let window = Window::new(4_000, 1_000);
        for record in refused {
            assert_eq!(dense.add(9, record, window), Err(record));
        }
        assert_eq!(dense.len(), 0);
    }

    /// A seal marks the ring's end when it takes the live records and drops the slots
    /// before that mark once its run holds them. A record removed from the newest slot
    /// meanwhile (replaced after it expired) leaves that slot vacant, so a record that
    /// settles after the mark never takes a position before it and is never dropped.
    #[test]
    fn a_seal_mark_never_covers_a_record_settled_after_it() {
        let window = Window::new(4_000, 1_000);
        let mut dense = DenseRecords::default();
        for fingerprint in 1..=3u128 {
            dense.add(fingerprint, settled(2, 1), window).unwrap();
        }
        let (taken, end) = dense.live_records(window, 2);
        assert_eq!(taken.len(), 3);
        assert!(dense.remove(3, window).is_some());
        dense.add(4, settled(2, 2), window).unwrap();
        let mut dropped = 0;
        dense.drop_before(end, window, |_| dropped += 1);
        assert_eq!(dropped, 2, "the vacated slot counts no record");
        assert_eq!(dense.get(4, window, 2), Some(settled(2, 2)));
        assert_eq!(dense.get(1, window, 2), None);
        // Replay reclaims the newest slot: the ring holds one record again.
        assert!(dense.remove_reclaiming(4, window).is_some());
        assert_eq!(dense.ring.tail.wrapping_sub(dense.ring.head), 0);
    }

    #[test]
    fn removed_and_expired_records_are_absent_and_their_slots_drained() {
        let window = Window::new(1_000, 1_000);
        let mut dense = DenseRecords::default();
        for bucket in 0..2u64 {
            for fingerprint in 5 * u128::from(bucket)..5 * u128::from(bucket) + 5 {
                dense.add(fingerprint, settled(bucket, 1), window).unwrap();
            }
        }
        assert_eq!(dense.remove(7, window).map(|r| r.bucket), Some(1));
        assert_eq!(dense.remove(7, window), None);
        assert_eq!(dense.get(7, window, 1), None);
        assert!(dense.get(2, window, 1).is_some());
        assert!(
            dense.get(2, window, 2).is_none(),
            "bucket 0 left the window"
        );
        dense.expire(100, window, 2);
        assert_eq!(dense.len(), 4, "bucket 0 dropped, bucket 1 less one");
        assert!(dense.get(6, window, 2).is_some());
        dense.add(2, settled(2, 1), window).unwrap();
        assert!(dense.get(2, window, 2).is_some(), "a new record of the key");
        dense.expire(100, window, 3);
        assert_eq!(dense.len(), 1);
        assert!(dense.get(2, window, 3).is_some());
    }

    #[test]
    fn positions_wrap_around() {
        let window = Window::new(1_000, 1_000);
        let mut dense = DenseRecords::default();
        (dense.ring.first, dense.ring.head, dense.ring.tail) =
            (u32::MAX - 2, u32::MAX - 2, u32::MAX - 2);
        for fingerprint in 0..8 {
            dense.add(fingerprint, settled(0, 1), window).unwrap();
        }
        for fingerprint in 0..8 {
            assert!(dense.get(fingerprint, window, 0).is_some(), "{fingerprint}");
        }
        dense.expire(3, window, 2);
        assert_eq!(dense.ring.head, 0);
        dense.expire(100, window, 2);
        assert_eq!(dense.len(), 0);
    }
}
