//! Under `Sync`, the dedup keys of a shard whose writes may not be acknowledged yet, so
//! that a duplicate waits for its own key's write and not for the shard's newest.
//!
//! A key is noted with the log position past the entry that admitted it, or, when a
//! batch admitted it and has not logged yet, with the batch's mark: a slot of
//! [`BatchMarks`] that the batch publishes its position to once logged. A batch that
//! marks its keys releases each shard right after its inserts (concurrent batches
//! overlap across shards), and a duplicate that finds a mark waits, outside the shard
//! lock, for the batch to log before it waits for the log.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use parking_lot::{Condvar, Mutex};

/// Entries a shard's queue holds without growing (16 bytes each, reserved under `Sync`
/// only, at the first note): a batch of 16 Ki keys over 64 shards puts 256 in each.
const RESERVED: usize = 256;
/// Set in a noted position that is a batch's mark, not a log position.
const MARK_BIT: u64 = 1 << 63;
/// A mark holds its slot's number above this many bits and the low bits of its claim.
const CLAIM_BITS: u32 = 40;
const CLAIM_MASK: u64 = (1 << CLAIM_BITS) - 1;
/// A slot's position while its batch is admitting and has not logged.
const UNLOGGED: u64 = 0;
/// A slot's position once its batch logged nothing, or the log refused it (its keys
/// were taken back first): nothing to wait for, and a waiter checks its answer again.
const NOTHING_LOGGED: u64 = u64::MAX;
/// How many batches may be marking at once; one that finds every slot busy holds its
/// shards instead (the path without marks).
pub(crate) const BATCH_SLOTS: usize = 256;

/// One batch's slot: the claims made of it, and where its current batch's write ended.
struct Slot {
    claims: AtomicU64,
    position: AtomicU64,
}

impl Default for Slot {
    fn default() -> Self {
        Slot {
            claims: AtomicU64::new(0),
            // Free: no batch of it waits for anything.
            position: AtomicU64::new(NOTHING_LOGGED),
        }
    }
}

/// The slots batches mark their keys with, shared by every shard of a store.
pub(crate) struct BatchMarks {
    slots: Box<[Slot]>,
    next: AtomicUsize,
    /// Held by a waiter between its look at a slot and its sleep, and by a batch that
    /// publishes, so that no publication is missed.
    lock: Mutex<()>,
    published: Condvar,
}

/// A claimed slot: what a batch marks its keys with until it publishes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BatchMark(u64);

/// What the write that admitted a key is, as a duplicate finds it under the shard lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PendingWrite {
    /// Logged up to this position, not acknowledged yet.
    Logged(u64),
    /// A batch's, not logged yet: [`BatchMarks::wait_logged`] outside the lock.
    Batch(BatchMark),
}

impl Default for BatchMarks {
    fn default() -> Self {
        BatchMarks {
            slots: (0..BATCH_SLOTS).map(|_| Slot::default()).collect(),
            next: AtomicUsize::new(0),
            lock: Mutex::new(()),
            published: Condvar::new(),
        }
    }
}

impl BatchMarks {
    /// Claims a slot whose last batch is done (its write acknowledged up to
    /// `acknowledged`, or nothing logged), or `None` if every slot is busy. The claim
    /// count moves after the slot is taken: a reader that sees the old count with the new
    /// batch's state waits for the new batch, longer than needed and never too short.
    pub(crate) fn claim(&self, acknowledged: u64) -> Option<BatchMark> {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        (0..BATCH_SLOTS).find_map(|step| {
            let index = start.wrapping_add(step) % BATCH_SLOTS;
            let slot = self.slots.get(index)?;
            let position = slot.position.load(Ordering::Acquire);
            if !done(position, acknowledged) {
                return None;
            }
            slot.position
                .compare_exchange(position, UNLOGGED, Ordering::AcqRel, Ordering::Relaxed)
                .ok()?;
            let claim = slot.claims.fetch_add(1, Ordering::AcqRel).wrapping_add(1);
            Some(BatchMark(
                MARK_BIT | (index as u64) << CLAIM_BITS | (claim & CLAIM_MASK),
            ))
        })
    }

    /// The batch of `mark` logged up to `position` (`None`: it logged nothing, or the
    /// log refused it after its keys were taken back). Wakes the duplicates waiting.
    pub(crate) fn publish(&self, mark: BatchMark, position: Option<u64>) {
        if let Some(slot) = self.slot(mark) {
            slot.position.store(
                position
                    .filter(|&at| at != UNLOGGED)
                    .unwrap_or(NOTHING_LOGGED),
                Ordering::Release,
            );
        }
        drop(self.lock.lock());
        self.published.notify_all();
    }

    /// Waits until the batch of `mark` has logged: the position past its write, or
    /// `None` if it logged nothing or was refused (the key was taken back: the answer that
    /// found it is checked again). Returns at once if the slot moved on to another batch.
    pub(crate) fn wait_logged(&self, mark: BatchMark) -> Option<u64> {
        let mut guard = self.lock.lock();
        loop {
            match self.position(mark.0) {
                UNLOGGED => self.published.wait(&mut guard),
                NOTHING_LOGGED => return None,
                position => return Some(position),
            }
        }
    }

    /// Where the batch of `mark` stands without waiting: its position, `UNLOGGED`, or
    /// `NOTHING_LOGGED` (also once the slot moved on: its batch was done).
    fn position(&self, mark: u64) -> u64 {
        let Some(slot) = self.slot(BatchMark(mark)) else {
            return NOTHING_LOGGED;
        };
        let position = slot.position.load(Ordering::Acquire);
        if slot.claims.load(Ordering::Acquire) & CLAIM_MASK == mark & CLAIM_MASK {
            position
        } else {
            NOTHING_LOGGED
        }
    }

    fn slot(&self, mark: BatchMark) -> Option<&Slot> {
        let index = usize::try_from((mark.0 & !MARK_BIT) >> CLAIM_BITS).ok()?;
        self.slots.get(index)
    }
}

/// Whether a slot at `position` needs no one's wait any more.
fn done(position: u64, acknowledged: u64) -> bool {
    position == NOTHING_LOGGED || (position != UNLOGGED && position <= acknowledged)
}

/// One shard's keys whose writes may not be acknowledged yet: (tag, position past the
/// entry, or a batch's mark), oldest first. Entries leave once the log is acknowledged
/// past them.
#[derive(Debug, Default)]
pub(crate) struct PendingKeys {
    keys: VecDeque<(u64, u64)>,
    /// How many entries are marks: while any is, the shard's logged position does not
    /// tell whether its keys' writes are acknowledged.
    marks: usize,
}

impl PendingKeys {
    /// Notes every key of `tags`, admitted by write `at` (logged, or a batch's still
    /// admitting), after forgetting the keys acknowledged up to `acknowledged` once for
    /// all of them.
    pub(crate) fn note(
        &mut self,
        tags: impl Iterator<Item = u64>,
        at: PendingWrite,
        acknowledged: u64,
        marks: &BatchMarks,
    ) {
        self.forget_acknowledged(acknowledged, marks);
        for tag in tags {
            self.push(tag, at);
        }
    }

    fn forget_acknowledged(&mut self, acknowledged: u64, marks: &BatchMarks) {
        if self.keys.capacity() == 0 {
            // Once, so that a shard's queue does not grow batch after batch.
            self.keys.reserve(RESERVED);
        }
        while let Some(&(_, front)) = self.keys.front() {
            let position = if front & MARK_BIT == 0 {
                front
            } else {
                marks.position(front)
            };
            if !done(position, acknowledged) {
                break;
            }
            self.keys.pop_front();
            self.marks -= usize::from(front & MARK_BIT != 0);
        }
    }

    fn push(&mut self, tag: u64, at: PendingWrite) {
        let at = match at {
            PendingWrite::Logged(position) => position,
            PendingWrite::Batch(BatchMark(mark)) => {
                self.marks += 1;
                mark
            }
        };
        self.keys.push_back((tag, at));
    }

    /// Whether any entry is a batch's mark.
    pub(crate) fn has_marks(&self) -> bool {
        self.marks > 0
    }

    /// The write that admitted key `tag`, if it may not be acknowledged up to
    /// `acknowledged` yet.
    pub(crate) fn find(
        &self,
        tag: u64,
        acknowledged: u64,
        marks: &BatchMarks,
    ) -> Option<PendingWrite> {
        let &(_, at) = self
            .keys
            .iter()
            .rev()
            .find(|&&(pending, _)| pending == tag)?;
        if at & MARK_BIT == 0 {
            return (at > acknowledged).then_some(PendingWrite::Logged(at));
        }
        match marks.position(at) {
            UNLOGGED => Some(PendingWrite::Batch(BatchMark(at))),
            position if done(position, acknowledged) => None,
            position => Some(PendingWrite::Logged(position)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_marked_key_resolves_to_its_batchs_position_once_published() {
        let marks = BatchMarks::default();
        let mut keys = PendingKeys::default();
        let mark = marks.claim(0).unwrap();
        keys.note(std::iter::once(7), PendingWrite::Batch(mark), 0, &marks);
        assert_eq!(keys.find(7, 0, &marks), Some(PendingWrite::Batch(mark)));
        assert_eq!(keys.find(8, 0, &marks), None);
        marks.publish(mark, Some(100));
        assert_eq!(marks.wait_logged(mark), Some(100));
        assert_eq!(keys.find(7, 0, &marks), Some(PendingWrite::Logged(100)));
        assert_eq!(keys.find(7, 100, &marks), None, "acknowledged");
        // Acknowledged, the entry leaves at the next note, and the slot is free again.
        keys.note(std::iter::once(9), PendingWrite::Logged(200), 100, &marks);
        assert!(!keys.has_marks());
    }

    #[test]
    fn a_slot_is_not_claimed_again_before_its_write_is_acknowledged() {
        let marks = BatchMarks::default();
        let held: Vec<BatchMark> = (0..BATCH_SLOTS).map(|_| marks.claim(0).unwrap()).collect();
        assert_eq!(marks.claim(0), None, "every slot busy");
        for (n, &mark) in held.iter().enumerate() {
            marks.publish(mark, Some(10 + n as u64));
        }
        assert_eq!(marks.claim(9), None, "logged, not acknowledged");
        let again = marks.claim(10).unwrap();
        // The old mark of a reused slot reads as done: nothing to wait for.
        let old = held.first().copied().unwrap();
        assert_ne!(again, old);
        assert_eq!(marks.wait_logged(old), None);
    }

    #[test]
    fn a_refused_batch_leaves_nothing_to_wait_for() {
        let marks = BatchMarks::default();
        let mut keys = PendingKeys::default();
        let mark = marks.claim(0).unwrap();
        keys.note(std::iter::once(7), PendingWrite::Batch(mark), 0, &marks);
        marks.publish(mark, None);
        assert_eq!(marks.wait_logged(mark), None);
        assert_eq!(keys.find(7, 0, &marks), None);
    }

    #[test]
    fn a_waiter_wakes_when_the_batch_publishes() {
        let marks = BatchMarks::default();
        let mark = marks.claim(0).unwrap();
        std::thread::scope(|scope| {
            let waiter = scope.spawn(|| marks.wait_logged(mark));
            marks.publish(mark, Some(42));
            assert_eq!(waiter.join().unwrap(), Some(42));
        });
    }
}
