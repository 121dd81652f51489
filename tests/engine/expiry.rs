//! The window: how long a key is remembered, when it is forgotten, and clocks that jump.

use std::time::Duration;

use crate::support::{BUCKET, WINDOW, manual_clock, memory_db, start_at};
use oncedb::ManualClock;

const MS: Duration = Duration::from_millis(1);

/// Offsets inside a bucket at which keys are first admitted.
fn admission_offsets() -> [Duration; 4] {
    [Duration::ZERO, MS, BUCKET / 2, BUCKET - MS]
}

#[test]
fn duplicate_throughout_the_window() {
    for offset in admission_offsets() {
        let clock = ManualClock::new(start_at(offset));
        let db = memory_db(&clock);
        assert!(db.insert_if_absent(b"msg").unwrap());
        for probe in [Duration::ZERO, MS, BUCKET, WINDOW / 2, WINDOW - MS] {
            clock.set(start_at(offset) + probe);
            assert!(
                !db.insert_if_absent(b"msg").unwrap(),
                "admitted at +{offset:?}, readmitted at +{probe:?}"
            );
            assert!(db.contains(b"msg").unwrap());
        }
    }
}

#[test]
fn admitted_again_after_window_plus_bucket() {
    for offset in admission_offsets() {
        let clock = ManualClock::new(start_at(offset));
        let db = memory_db(&clock);
        assert!(db.insert_if_absent(b"msg").unwrap());
        clock.set(start_at(offset) + WINDOW + BUCKET);
        assert!(!db.contains(b"msg").unwrap(), "offset {offset:?}");
        assert!(db.insert_if_absent(b"msg").unwrap(), "offset {offset:?}");
    }
}

#[test]
fn memory_is_reclaimed_when_the_window_passes() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let keys: Vec<Vec<u8>> = (0..10_000u32).map(|i| i.to_le_bytes().to_vec()).collect();
    db.insert_many(&keys).unwrap();
    let before = db.stats();
    assert_eq!(before.live_keys, 10_000);
    assert!(before.table_slots_used >= 10_000);
    clock.forward(WINDOW + BUCKET);
    let after = db.stats();
    assert_eq!(after.live_keys, 0);
    assert_eq!(
        after.table_slots_used, 0,
        "expired tables are dropped whole"
    );
    assert_eq!(after.buckets_live, 0);
    assert!(after.buckets_dropped >= 61);
}

#[test]
fn sweep_reclaims_slots_while_other_buckets_stay() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    for i in 0..5_000u32 {
        db.insert_if_absent(&i.to_le_bytes()).unwrap();
    }
    clock.forward(WINDOW / 2);
    for i in 5_000..10_000u32 {
        db.insert_if_absent(&i.to_le_bytes()).unwrap();
    }
    clock.forward(WINDOW / 2 + BUCKET);
    // The first half has expired; writes drive the incremental sweep.
    for i in 10_000..40_000u32 {
        db.insert_if_absent(&i.to_le_bytes()).unwrap();
    }
    let stats = db.stats();
    assert_eq!(stats.live_keys, 35_000);
    assert_eq!(stats.buckets_live, 2);
    assert_eq!(
        stats.table_slots_used, 35_000,
        "every expired slot was reused or swept"
    );
    for i in 5_000..10_000u32 {
        assert!(
            db.contains(&i.to_le_bytes()).unwrap(),
            "live key {i} lost by the sweep"
        );
    }
    for i in 0..5_000u32 {
        assert!(
            !db.contains(&i.to_le_bytes()).unwrap(),
            "expired key {i} still present"
        );
    }
}

#[test]
fn clock_going_backwards_never_expires_early() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let t = clock.now();
    assert!(db.insert_if_absent(b"msg").unwrap());
    clock.set(t - Duration::from_secs(30 * 24 * 3600));
    assert!(
        !db.insert_if_absent(b"msg").unwrap(),
        "step back admitted a live key"
    );
    // New keys admitted while the clock is behind are stamped at the high-water time.
    assert!(db.insert_if_absent(b"late").unwrap());
    clock.set(t + WINDOW - MS);
    assert!(!db.insert_if_absent(b"msg").unwrap());
    assert!(!db.insert_if_absent(b"late").unwrap());
}

#[test]
fn buckets_are_counted_and_dropped_whole() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    for minute in 0..3u32 {
        db.insert_if_absent(&minute.to_le_bytes()).unwrap();
        clock.forward(BUCKET);
    }
    let stats = db.stats();
    assert_eq!(stats.buckets_live, 3);
    assert_eq!(stats.live_keys, 3);
    clock.forward(WINDOW - 2 * BUCKET);
    let stats = db.stats();
    assert_eq!(stats.buckets_live, 2, "the first bucket left the window");
    assert_eq!(stats.live_keys, 2);
}

#[test]
fn records_expire_with_the_window() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let scope = oncedb::Scope::new("org", "op");
    let oncedb::Reservation::Acquired(lease) = db.reserve(&scope, b"k", b"req").unwrap() else {
        panic!("first reserve acquires");
    };
    lease.complete(b"resp").unwrap();
    clock.forward(WINDOW - MS);
    assert!(db.get(&scope, b"k").unwrap().is_some());
    clock.forward(BUCKET + MS);
    assert!(db.get(&scope, b"k").unwrap().is_none());
    assert_eq!(db.stats().live_records, 0);
    assert!(matches!(
        db.reserve(&scope, b"k", b"other request").unwrap(),
        oncedb::Reservation::Acquired(_)
    ));
}

#[test]
fn a_lease_outliving_its_record_is_told_so() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let scope = oncedb::Scope::new("org", "op");
    let oncedb::Reservation::Acquired(lease) = db.reserve(&scope, b"k", b"req").unwrap() else {
        panic!("first reserve acquires");
    };
    clock.forward(WINDOW + BUCKET);
    assert!(matches!(
        lease.complete(b"late").map_err(oncedb::Error::from),
        Err(oncedb::Error::LeaseLost)
    ));
    assert_eq!(db.stats().leases_lost, 1);
}
