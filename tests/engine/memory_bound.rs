//! `Options::max_keys` under a key flood of ten times the limit, with both policies.

use crate::support::{BUCKET, WINDOW, manual_clock};
use oncedb::{Db, Error, FullPolicy, ManualClock, Options, Reservation, Scope};

const MAX_KEYS: u64 = 4_096;
const SHARDS: usize = 8;

fn bounded(clock: &ManualClock, policy: FullPolicy) -> Db {
    Db::open(
        Options::in_memory()
            .window(WINDOW)
            .bucket_width(BUCKET)
            .clock(clock.clone())
            .shards(SHARDS)
            .max_keys(MAX_KEYS)
            .full_policy(policy),
    )
    .unwrap()
}

#[test]
fn reject_fails_closed_and_loses_nothing() {
    let clock = manual_clock();
    let db = bounded(&clock, FullPolicy::Reject);
    let mut admitted = Vec::new();
    let mut rejected = 0u64;
    for i in 0..10 * MAX_KEYS {
        match db.insert_if_absent(&i.to_le_bytes()) {
            Ok(true) => admitted.push(i),
            Ok(false) => panic!("fresh key {i} reported as duplicate"),
            Err(Error::Full) => rejected += 1,
            Err(other) => panic!("unexpected {other}"),
        }
    }
    let stats = db.stats();
    assert!(stats.live_keys <= MAX_KEYS, "{} live keys", stats.live_keys);
    assert!(
        admitted.len() as u64 >= MAX_KEYS - MAX_KEYS / 4,
        "shards fill evenly: {}",
        admitted.len()
    );
    assert_eq!(stats.full_rejections, rejected);
    // Everything admitted is still remembered, and a duplicate of it is still answered.
    for &i in &admitted {
        assert!(
            !db.insert_if_absent(&i.to_le_bytes()).unwrap(),
            "admitted key {i} lost"
        );
    }
    // Records obey the same limit.
    let scope = Scope::new("org", "op");
    let mut full = false;
    for i in 0..MAX_KEYS {
        match db.reserve(&scope, &i.to_le_bytes(), b"r") {
            Ok(_) => {}
            Err(Error::Full) => full = true,
            Err(other) => panic!("unexpected {other}"),
        }
    }
    assert!(full);
    // When the window passes, room comes back.
    clock.forward(WINDOW + BUCKET);
    assert!(db.insert_if_absent(b"after the window").unwrap());
}

#[test]
fn reject_admits_a_batch_whole_or_not_at_all() {
    let clock = manual_clock();
    let db = bounded(&clock, FullPolicy::Reject);
    let mut next = 0u64;
    loop {
        let batch: Vec<[u8; 8]> = (next..next + 100).map(u64::to_le_bytes).collect();
        match db.insert_many(&batch) {
            Ok(answers) => {
                assert!(answers.iter().all(|&yes| yes));
                next += 100;
            }
            Err(Error::Full) => {
                for key in &batch {
                    assert!(
                        !db.contains(key).unwrap(),
                        "a refused batch left a key behind"
                    );
                }
                break;
            }
            Err(other) => panic!("unexpected {other}"),
        }
        assert!(next <= 10 * MAX_KEYS, "the limit was never reached");
    }
    assert_eq!(db.stats().live_keys, next);
}

#[test]
fn evict_oldest_stays_bounded_and_keeps_recent_keys() {
    let clock = manual_clock();
    let db = bounded(&clock, FullPolicy::EvictOldest);
    let per_bucket = MAX_KEYS / 4;
    let mut key = 0u64;
    for _ in 0..40 {
        for _ in 0..per_bucket {
            assert!(
                db.insert_if_absent(&key.to_le_bytes()).unwrap(),
                "fresh key {key}"
            );
            key += 1;
        }
        assert!(db.stats().live_keys <= MAX_KEYS);
        clock.forward(BUCKET);
    }
    let stats = db.stats();
    assert!(stats.buckets_evicted > 0);
    assert!(stats.keys_evicted >= 30 * per_bucket);
    assert!(stats.live_keys <= MAX_KEYS);
    // The newest bucket was never evicted.
    for recent in key - per_bucket..key {
        assert!(
            !db.insert_if_absent(&recent.to_le_bytes()).unwrap(),
            "recent key {recent} evicted"
        );
    }
    // The oldest keys were evicted early: a late duplicate is admitted (fail open).
    assert!(db.insert_if_absent(&0u64.to_le_bytes()).unwrap());
}

#[test]
fn evict_oldest_refuses_when_the_current_bucket_alone_is_full() {
    let clock = manual_clock();
    let db = bounded(&clock, FullPolicy::EvictOldest);
    let mut full = false;
    for i in 0..2 * MAX_KEYS {
        match db.insert_if_absent(&i.to_le_bytes()) {
            Ok(yes) => assert!(yes),
            Err(Error::Full) => full = true,
            Err(other) => panic!("unexpected {other}"),
        }
    }
    assert!(full);
    assert!(db.stats().live_keys <= MAX_KEYS);
    let Err(Error::Full) = db
        .reserve(&Scope::new("o", "p"), b"k", b"r")
        .map(|r| matches!(r, Reservation::Acquired(_)))
    else {
        panic!("records are refused too");
    };
}

#[test]
fn zero_max_keys_is_invalid() {
    assert!(matches!(
        Db::open(Options::in_memory().max_keys(0)),
        Err(Error::InvalidOptions(_))
    ));
}
