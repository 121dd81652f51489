//! Idempotency records: scoping, request binding, lifecycle and replay.

use std::time::Duration;

use crate::support::{BUCKET, WINDOW, manual_clock, memory_db};
use oncedb::{Lease, RecordStatus, Reservation, Scope};

fn acquire(db: &oncedb::Db, scope: &Scope, key: &[u8], request: &[u8]) -> Lease {
    match db.reserve(scope, key, request).unwrap() {
        Reservation::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

#[test]
fn completed_response_is_replayed_byte_for_byte() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let scope = Scope::new("org_123", "create_payment");
    let response: Vec<u8> = (0..=255u8).collect();
    acquire(&db, &scope, b"key", b"request")
        .complete(&response)
        .unwrap();
    for _ in 0..3 {
        match db.reserve(&scope, b"key", b"request").unwrap() {
            Reservation::Completed(record) => {
                assert_eq!(record.response(), Some(&response[..]));
                assert_eq!(record.status(), RecordStatus::Completed);
                assert!(record.finished_at().is_some());
            }
            other => panic!("expected Completed, got {other:?}"),
        }
    }
    let stats = db.stats();
    assert_eq!((stats.acquired, stats.completed, stats.replays), (1, 1, 3));
}

#[test]
fn failure_is_stored_and_replayed() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let scope = Scope::new("org", "charge");
    acquire(&db, &scope, b"key", b"req")
        .fail(b"card_declined")
        .unwrap();
    match db.reserve(&scope, b"key", b"req").unwrap() {
        Reservation::Failed(record) => {
            assert_eq!(record.response(), Some(&b"card_declined"[..]));
            assert_eq!(record.status(), RecordStatus::Failed);
        }
        other => panic!("expected Failed, got {other:?}"),
    }
    assert_eq!(db.stats().failed, 1);
}

#[test]
fn in_flight_is_reported_with_its_start() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let scope = Scope::new("org", "op");
    let started = clock.now();
    let lease = acquire(&db, &scope, b"key", b"req");
    clock.forward(Duration::from_secs(5));
    match db.reserve(&scope, b"key", b"req").unwrap() {
        Reservation::InFlight { since, .. } => assert_eq!(since, started),
        other => panic!("expected InFlight, got {other:?}"),
    }
    assert_eq!(lease.since(), started);
    assert_eq!(
        db.get(&scope, b"key").unwrap().unwrap().status(),
        RecordStatus::InFlight
    );
    assert_eq!(db.stats().in_flight_hits, 1);
}

#[test]
fn a_different_request_is_a_mismatch_never_a_replay() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let scope = Scope::new("org", "op");
    let lease = acquire(&db, &scope, b"key", b"amount=10");
    assert!(matches!(
        db.reserve(&scope, b"key", b"amount=99").unwrap(),
        Reservation::Mismatch
    ));
    lease.complete(b"secret response").unwrap();
    assert!(matches!(
        db.reserve(&scope, b"key", b"amount=99").unwrap(),
        Reservation::Mismatch
    ));
    assert_eq!(db.stats().mismatches, 2);
}

#[test]
fn a_dropped_lease_leaves_the_record_in_flight() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let scope = Scope::new("org", "op");
    drop(acquire(&db, &scope, b"key", b"req"));
    // In flight right after the drop, through the window, to the last millisecond of the
    // record's bucket's life; only then does a retry acquire.
    let last_ms = WINDOW + BUCKET - Duration::from_millis(1);
    let mut at = Duration::ZERO;
    for later in [Duration::ZERO, WINDOW / 2, WINDOW, last_ms] {
        clock.forward(later - at);
        at = later;
        assert!(
            matches!(
                db.reserve(&scope, b"key", b"req").unwrap(),
                Reservation::InFlight { .. }
            ),
            "{later:?} after the drop"
        );
        assert_eq!(db.stats().live_records, 1);
    }
    clock.forward(Duration::from_millis(1));
    assert!(matches!(
        db.reserve(&scope, b"key", b"req").unwrap(),
        Reservation::Acquired(_)
    ));
}

#[test]
fn release_lets_a_retry_run() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let scope = Scope::new("org", "op");
    acquire(&db, &scope, b"key", b"req").release().unwrap();
    assert!(db.get(&scope, b"key").unwrap().is_none());
    assert_eq!(db.stats().live_records, 0);
    acquire(&db, &scope, b"key", b"req")
        .complete(b"done")
        .unwrap();
    assert_eq!(db.stats().released, 1);
}

#[test]
fn scopes_are_independent() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let a = Scope::new("org_a", "create_payment");
    let b = Scope::new("org_b", "create_payment");
    let c = Scope::new("org_a", "refund");
    // Length prefixes keep ("ab", "c") and ("a", "bc") apart.
    let d = Scope::new("org_ab", "c");
    let e = Scope::new("org_a", "bc");
    for scope in [&a, &b, &c, &d, &e] {
        acquire(&db, scope, b"same-key", b"req")
            .complete(scope.tenant())
            .unwrap();
    }
    for scope in [&a, &b, &c, &d, &e] {
        let record = db.get(scope, b"same-key").unwrap().unwrap();
        assert_eq!(record.response(), Some(scope.tenant()));
    }
    // Dedup keys live apart from records.
    assert!(db.insert_if_absent(b"same-key").unwrap());
}

#[test]
fn released_then_reacquired_record_completes_and_replays() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let scope = Scope::new("org", "op");
    acquire(&db, &scope, b"key", b"req").release().unwrap();
    let second = acquire(&db, &scope, b"key", b"req");
    second.complete(b"ok").unwrap();
    // A new reservation after completion replays; no second lease exists.
    assert!(matches!(
        db.reserve(&scope, b"key", b"req").unwrap(),
        Reservation::Completed(_)
    ));
}

#[test]
fn leases_cross_threads() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let scope = Scope::new("org", "op");
    let lease = acquire(&db, &scope, b"key", b"req");
    std::thread::spawn(move || lease.complete(b"from another thread").unwrap())
        .join()
        .unwrap();
    let record = db.get(&scope, b"key").unwrap().unwrap();
    assert_eq!(record.response(), Some(&b"from another thread"[..]));
}

/// `Options::response_retention`: keys outlive responses. Inside the retention the
/// response replays; after it, until the window ends, a retry gets `Expired` (the
/// operation happened, nothing to replay, do not run it again) with the record's status,
/// in memory and after a reopen; after the window the key is new.
#[test]
fn responses_age_out_before_their_keys_with_a_retention() {
    let retention = 10 * BUCKET;
    for durable in [false, true] {
        let clock = manual_clock();
        let dir = tempfile::tempdir().unwrap();
        let options = || {
            let options = if durable {
                crate::support::durable_options(dir.path(), &clock)
            } else {
                oncedb::Options::in_memory()
                    .window(WINDOW)
                    .bucket_width(BUCKET)
                    .clock(clock.clone())
            };
            options.response_retention(retention)
        };
        let mut db = oncedb::Db::open(options()).unwrap();
        let scope = Scope::new("org", "pay");
        acquire(&db, &scope, b"done", b"req")
            .complete(b"paid")
            .unwrap();
        acquire(&db, &scope, b"declined", b"req")
            .fail(b"no")
            .unwrap();
        clock.forward(retention - BUCKET);
        assert!(matches!(
            db.reserve(&scope, b"done", b"req").unwrap(),
            Reservation::Completed(record) if record.response() == Some(&b"paid"[..])
        ));
        clock.forward(2 * BUCKET);
        for reopen in [false, true] {
            if reopen && durable {
                drop(db);
                db = oncedb::Db::open(options()).unwrap();
            }
            let Reservation::Expired(record) = db.reserve(&scope, b"done", b"req").unwrap() else {
                panic!("an aged-out response is Expired (durable {durable}, reopen {reopen})");
            };
            assert_eq!(record.status(), RecordStatus::Completed);
            assert_eq!(record.response(), None);
            assert!(record.finished_at().is_some());
            let Reservation::Expired(record) = db.reserve(&scope, b"declined", b"req").unwrap()
            else {
                panic!("a failure ages out too");
            };
            assert_eq!(record.status(), RecordStatus::Failed);
            let got = db.get(&scope, b"done").unwrap().unwrap();
            assert_eq!(got.response(), None);
            // Still bound to its request: another one is a mismatch, not a new run.
            assert!(matches!(
                db.reserve(&scope, b"done", b"other").unwrap(),
                Reservation::Mismatch
            ));
        }
        clock.forward(WINDOW);
        acquire(&db, &scope, b"done", b"req").release().unwrap();
    }
}

#[test]
fn a_retention_outside_the_window_or_off_the_buckets_is_refused() {
    let clock = manual_clock();
    for retention in [
        Duration::ZERO,
        WINDOW + BUCKET,
        BUCKET + Duration::from_secs(1),
    ] {
        let options = oncedb::Options::in_memory()
            .window(WINDOW)
            .bucket_width(BUCKET)
            .clock(clock.clone())
            .response_retention(retention);
        assert!(
            matches!(
                oncedb::Db::open(options),
                Err(oncedb::Error::InvalidOptions(_))
            ),
            "{retention:?}"
        );
    }
}

/// A record still in flight when its bucket leaves the response retention keeps no
/// response once it finishes: it answers `Expired`, and memory lets its bytes go at once
/// rather than at the end of the window.
#[test]
fn a_response_finished_after_its_retention_leaves_memory_at_once() {
    let retention = 10 * BUCKET;
    let clock = manual_clock();
    let options = oncedb::Options::in_memory()
        .window(WINDOW)
        .bucket_width(BUCKET)
        .clock(clock.clone())
        .shards(1)
        .response_retention(retention);
    let db = oncedb::Db::open(options).unwrap();
    let scope = Scope::new("org", "pay");
    let late = acquire(&db, &scope, b"late", b"req");
    clock.forward(retention + 2 * BUCKET);
    // Writes after the retention passed let the shard age what it queued.
    for n in 0..64u32 {
        acquire(&db, &scope, &n.to_le_bytes(), b"req")
            .release()
            .unwrap();
    }
    let before = db.stats().index_bytes;
    late.complete(&vec![7; 256 * 1024]).unwrap();
    let after = db.stats().index_bytes;
    assert!(
        after < before + 64 * 1024,
        "{before} -> {after}: the response stayed in memory"
    );
    let Reservation::Expired(record) = db.reserve(&scope, b"late", b"req").unwrap() else {
        panic!("a response finished past its retention is Expired");
    };
    assert_eq!(record.status(), RecordStatus::Completed);
}
