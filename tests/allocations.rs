//! `insert_many_into` allocates nothing in steady state: its buffers are reused across
//! calls. Counted by a per-thread counting global allocator, so the test harness and the
//! store's background threads do not enter the count.
//!
//! A test binary of its own: the `#[global_allocator]` below serves the whole process, so
//! folded into another binary it would put every allocation of every other test through
//! its counting, slowing and disturbing them.

#![expect(clippy::unwrap_used, reason = "test code: a panic is the test failing")]

use std::time::Duration;

use densa_alloc::{CountingAllocator, measure};
use oncedb::{Db, Durability, Options};

#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator::system();

const BATCH: usize = 1024;

/// Batch `n` of 16-byte ids: the even places new, the odd ones repeating the new ids of
/// batch `n - 1`.
fn batch(n: u64, ids: &mut Vec<[u8; 16]>) {
    ids.clear();
    for i in 0..BATCH as u64 {
        let id = if i % 2 == 0 {
            n * 1024 + i
        } else {
            (n.max(1) - 1) * 1024 + i - 1
        };
        let mut key = [0u8; 16];
        key[..8].copy_from_slice(&id.to_le_bytes());
        key[8..].copy_from_slice(&(!id).to_le_bytes());
        ids.push(key);
    }
}

/// Warms the thread's buffers up with a few batches, then counts the heap operations of
/// 200 more.
fn steady_state_allocations(db: &Db) -> (u64, usize) {
    assert!(
        densa_alloc::is_active(),
        "the counting allocator is not installed"
    );
    let mut ids = Vec::with_capacity(BATCH);
    let mut admitted = Vec::with_capacity(BATCH);
    for n in 0..8 {
        batch(n, &mut ids);
        db.insert_many_into(&ids, &mut admitted).unwrap();
    }
    let mut new = 0;
    let ((), stats) = measure(|| {
        for n in 8..208 {
            batch(n, &mut ids);
            db.insert_many_into(&ids, &mut admitted).unwrap();
            new += admitted.iter().filter(|&&a| a).count();
        }
    });
    (stats.allocs + stats.reallocs, new)
}

#[test]
fn insert_many_into_allocates_nothing_in_memory() {
    let db = Db::open(Options::in_memory().expected_keys(1 << 20)).unwrap();
    let (allocations, new) = steady_state_allocations(&db);
    assert_eq!(new, 200 * BATCH / 2, "half of each batch is new");
    assert_eq!(allocations, 0);
}

fn on_disk(durability: Durability) -> (u64, usize) {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(
        Options::new(dir.path())
            .durability(durability)
            .expected_keys(1 << 20),
    )
    .unwrap();
    steady_state_allocations(&db)
}

#[test]
fn insert_many_into_allocates_nothing_on_disk() {
    for durability in [Durability::Buffered, Durability::Sync] {
        let (allocations, new) = on_disk(durability);
        assert_eq!(new, 200 * BATCH / 2);
        assert_eq!(allocations, 0, "{durability:?}");
    }
}

#[test]
fn with_interval_durability_only_the_log_buffers_grow() {
    // An interval's appends accumulate in the log buffer until the flusher takes it, so
    // the buffers grow (by doubling) until they hold the largest interval seen; every
    // other buffer is reused. 200 batches of 512 new keys are about 2 MiB of log, a few
    // doublings of each of the two buffers; without reuse it would be thousands.
    let (allocations, new) = on_disk(Durability::Interval(Duration::from_millis(10)));
    assert_eq!(new, 200 * BATCH / 2);
    assert!(
        allocations <= 40,
        "{allocations} allocations in 200 batches"
    );
}

/// A record keeps one heap buffer: its scoped key while in flight, replaced at
/// completion by one holding the key and the response. Reserve and complete allocate
/// those two buffers and nothing else (no box for the record's fields, no copy of the
/// response made before the store's own).
#[test]
fn a_completed_record_holds_one_buffer() {
    use oncedb::{Reservation, Scope};
    const RECORDS: usize = 1000;
    let db = Db::open(Options::in_memory()).unwrap();
    let scope = Scope::new("tenant", "create_payment");
    let response = vec![7u8; 256];
    let keys: Vec<String> = (0..2 * RECORDS).map(|i| format!("key-{i:056}")).collect();
    let (warm_up, measured) = keys.split_at(RECORDS);
    let run = |keys: &[String]| {
        for key in keys {
            let Reservation::Acquired(lease) = db.reserve(&scope, key.as_bytes(), b"r").unwrap()
            else {
                panic!("{key} is new");
            };
            lease.complete(&response).unwrap();
        }
    };
    // The first records grow the shard maps and queues; those growths are not counted.
    run(warm_up);
    let ((), stats) = measure(|| run(measured));
    // Growth still under way: each of the 64 shards' record maps may grow once more
    // (a block) and its expiry queue with it (a reallocation, not counted here).
    let slack = 2 * 64;
    // With the `metrics` feature, each reserve and each complete also builds its counter
    // labels (the operation's name and the label list): four blocks a record, freed at
    // once, so they count here but are not held.
    let labels = if cfg!(feature = "metrics") { 4 } else { 0 };
    assert!(
        stats.allocs <= (2 + labels) * RECORDS as u64 + slack,
        "{} allocations for {RECORDS} records",
        stats.allocs
    );
    let held = stats.allocs.saturating_sub(stats.deallocs);
    assert!(
        held <= RECORDS as u64 + slack,
        "{held} blocks held for {RECORDS} records"
    );
    assert_eq!(
        db.get(&scope, measured[7].as_bytes())
            .unwrap()
            .unwrap()
            .response(),
        Some(&response[..])
    );
}
