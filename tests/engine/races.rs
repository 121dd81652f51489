//! Concurrent callers racing on the same keys: exactly one wins each key.

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Barrier, Mutex};

use crate::support::{manual_clock, memory_db};
use oncedb::{Reservation, Scope};

const THREADS: usize = 8;
const KEYS: u32 = 2_000;

fn winners_table() -> Vec<AtomicU32> {
    (0..KEYS).map(|_| AtomicU32::new(0)).collect()
}

/// Runs `body(thread)` on `THREADS` threads released at once by a barrier.
fn race(body: impl Fn(usize) + Sync) {
    let barrier = Barrier::new(THREADS);
    std::thread::scope(|s| {
        for thread in 0..THREADS {
            let (barrier, body) = (&barrier, &body);
            s.spawn(move || {
                barrier.wait();
                body(thread);
            });
        }
    });
}

fn assert_one_winner_each(winners: &[AtomicU32]) {
    for (key, count) in winners.iter().enumerate() {
        assert_eq!(count.load(Ordering::Relaxed), 1, "key {key}");
    }
}

#[test]
fn insert_if_absent_admits_each_key_once() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let winners = winners_table();
    race(|thread| {
        // Each thread walks the keys from a different starting point.
        for step in 0..KEYS {
            let key = (step + thread as u32 * 251) % KEYS;
            if db.insert_if_absent(&key.to_le_bytes()).unwrap() {
                winners[key as usize].fetch_add(1, Ordering::Relaxed);
            }
        }
    });
    assert_one_winner_each(&winners);
    let stats = db.stats();
    assert_eq!(stats.admitted, u64::from(KEYS));
    assert_eq!(stats.duplicates, u64::from(KEYS) * (THREADS as u64 - 1));
}

#[test]
fn insert_many_admits_each_key_once() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let winners = winners_table();
    race(|thread| {
        let keys: Vec<[u8; 4]> = (0..KEYS)
            .map(|step| ((step + thread as u32 * 97) % KEYS).to_le_bytes())
            .collect();
        for batch in keys.chunks(64) {
            let admitted = db.insert_many(batch).unwrap();
            for (key, yes) in batch.iter().zip(admitted) {
                if yes {
                    winners[u32::from_le_bytes(*key) as usize].fetch_add(1, Ordering::Relaxed);
                }
            }
        }
    });
    assert_one_winner_each(&winners);
}

#[test]
fn reserve_grants_one_lease_per_key() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let scope = Scope::new("org", "op");
    let winners = winners_table();
    let leases = Mutex::new(Vec::new());
    race(|thread| {
        for step in 0..KEYS {
            let key = (step + thread as u32 * 13) % KEYS;
            match db.reserve(&scope, &key.to_le_bytes(), b"req").unwrap() {
                Reservation::Acquired(lease) => {
                    winners[key as usize].fetch_add(1, Ordering::Relaxed);
                    // Finish half the leases while others still race.
                    if key.is_multiple_of(2) {
                        lease.complete(b"done").unwrap();
                    } else {
                        leases.lock().unwrap().push(lease);
                    }
                }
                Reservation::InFlight { .. } | Reservation::Completed(_) => {}
                other => panic!("unexpected {other:?}"),
            }
        }
    });
    assert_one_winner_each(&winners);
    assert_eq!(leases.lock().unwrap().len() as u32, KEYS / 2);
}

#[test]
fn release_races_grant_at_most_one_live_lease() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let scope = Scope::new("org", "op");
    let holders = AtomicU32::new(0);
    let acquired = AtomicU32::new(0);
    race(|_| {
        for _ in 0..2_000 {
            if let Reservation::Acquired(lease) = db.reserve(&scope, b"hot", b"req").unwrap() {
                assert_eq!(holders.fetch_add(1, Ordering::SeqCst), 0, "two live leases");
                acquired.fetch_add(1, Ordering::Relaxed);
                holders.fetch_sub(1, Ordering::SeqCst);
                lease.release().unwrap();
            }
        }
    });
    assert!(acquired.load(Ordering::Relaxed) >= 1);
    assert_eq!(
        db.stats().released,
        u64::from(acquired.load(Ordering::Relaxed))
    );
}
