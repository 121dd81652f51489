//! Operating a store: stuck records with notes, take-over with fencing (also across a
//! reopen and a crash), the ordering guard, and the counters behind them.

use std::sync::{Arc, Barrier};
use std::time::Duration;

use crate::support::{BUCKET, WINDOW, durable_options, manual_clock, memory_db};
use oncedb::io::MemStorage;
use oncedb::{Advance, Db, Error, Lease, Options, RecordStatus, Reservation, Scope};

fn scope() -> Scope {
    Scope::new("org_123", "create_payment")
}

fn acquire(db: &Db, key: &[u8]) -> Lease {
    match db.reserve(&scope(), key, b"req").unwrap() {
        Reservation::Acquired(lease) => lease,
        other => panic!("expected to acquire, got {other:?}"),
    }
}

#[test]
fn a_taken_over_lease_is_fenced_and_changes_nothing() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let old = acquire(&db, b"pay-1");
    let new = db.take_over(&scope(), b"pay-1").unwrap().unwrap();
    assert!(new.epoch() > old.epoch());
    assert!(matches!(old.note(b"late"), Err(Error::Fenced)));
    let old = old.complete(b"old").unwrap_err();
    assert!(matches!(old.error(), Error::Fenced));
    let old = old.into_lease().fail(b"old").unwrap_err();
    assert!(matches!(old.error(), Error::Fenced));
    let old = old.into_lease().release().unwrap_err();
    assert!(matches!(old.error(), Error::Fenced));
    // Nothing the old lease tried took effect: the record is still in flight.
    assert_eq!(
        db.get(&scope(), b"pay-1").unwrap().unwrap().status(),
        RecordStatus::InFlight
    );
    new.complete(b"new").unwrap();
    let Reservation::Completed(record) = db.reserve(&scope(), b"pay-1", b"req").unwrap() else {
        panic!("the new lease completed the record");
    };
    assert_eq!(record.response(), Some(&b"new"[..]));
    // Even after the record finished, the old lease stays fenced, never "lost".
    assert!(matches!(
        old.into_lease().complete(b"x").unwrap_err().error(),
        Error::Fenced
    ));
    // Only records in flight can be taken over.
    assert!(db.take_over(&scope(), b"pay-1").unwrap().is_none());
    assert!(db.take_over(&scope(), b"absent").unwrap().is_none());
    let stats = db.stats();
    assert_eq!((stats.take_overs, stats.fenced), (1, 5));
}

#[test]
fn fencing_holds_across_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let (old_epoch, new_epoch) = {
        let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
        let old = acquire(&db, b"pay-2");
        let new = db.take_over(&scope(), b"pay-2").unwrap().unwrap();
        (old.epoch(), new.epoch())
        // Both workers die without finishing.
    };
    let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
    assert!(matches!(
        db.resume(&scope(), b"pay-2", old_epoch),
        Err(Error::Fenced)
    ));
    let stuck = db.in_flight(Duration::ZERO);
    assert_eq!(stuck.len(), 1);
    assert_eq!(stuck[0].epoch, new_epoch);
    let lease = db.resume(&scope(), b"pay-2", new_epoch).unwrap();
    lease.complete(b"reconciled").unwrap();
    assert!(matches!(
        db.resume(&scope(), b"pay-2", new_epoch),
        Err(Error::LeaseLost)
    ));
    drop(db);
    let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
    let record = db.get(&scope(), b"pay-2").unwrap().unwrap();
    assert_eq!(record.response(), Some(&b"reconciled"[..]));
    // Epochs keep rising after a reopen.
    let next = acquire(&db, b"pay-3");
    assert!(next.epoch() > new_epoch);
}

#[test]
fn fencing_holds_across_a_crash_between_take_over_and_completion() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let options = || {
        Options::new("/db")
            .window(WINDOW)
            .bucket_width(BUCKET)
            .clock(clock.clone())
            .storage(Arc::new(disk.clone()))
    };
    let db = Db::open(options()).unwrap();
    let old = acquire(&db, b"pay-4");
    old.note(b"provider_outcome_unknown").unwrap();
    let new = db.take_over(&scope(), b"pay-4").unwrap().unwrap();
    let (old_epoch, new_epoch) = (old.epoch(), new.epoch());
    std::mem::forget((old, new, db));
    disk.power_loss();
    let db = Db::open(options()).unwrap();
    assert!(matches!(
        db.resume(&scope(), b"pay-4", old_epoch),
        Err(Error::Fenced)
    ));
    let stuck = db.in_flight(Duration::ZERO);
    assert_eq!(stuck.len(), 1);
    assert_eq!(
        (stuck[0].epoch, stuck[0].note.as_deref()),
        (new_epoch, Some(&b"provider_outcome_unknown"[..]))
    );
    db.resume(&scope(), b"pay-4", new_epoch)
        .unwrap()
        .complete(b"ok")
        .unwrap();
}

#[test]
fn of_concurrent_take_overs_exactly_one_finishes() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let _abandoned = acquire(&db, b"pay-5");
    let threads = 8;
    let barrier = Barrier::new(threads);
    let leases: Vec<Lease> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (db, barrier) = (&db, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    db.take_over(&scope(), b"pay-5").unwrap().unwrap()
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut epochs: Vec<u64> = leases.iter().map(Lease::epoch).collect();
    epochs.sort_unstable();
    epochs.dedup();
    assert_eq!(epochs.len(), threads, "every take-over gets its own epoch");
    // Exactly one finishes, and it is the last take-over: the one with the highest
    // epoch ("first completer wins" would also give one). Try them lowest epoch first,
    // so a store that let an older lease finish would be caught at once.
    let highest = *epochs.last().unwrap();
    let mut leases = leases;
    leases.sort_by_key(Lease::epoch);
    let results: Vec<(u64, bool)> = leases
        .into_iter()
        .map(|l| (l.epoch(), l.complete(b"x").is_ok()))
        .collect();
    let winners: Vec<u64> = results.iter().filter(|r| r.1).map(|r| r.0).collect();
    assert_eq!(winners, [highest], "{results:?}");
}

#[test]
fn in_flight_lists_stuck_records_with_their_notes() {
    let clock = manual_clock();
    let db = Db::open(
        Options::in_memory()
            .window(WINDOW)
            .bucket_width(BUCKET)
            .clock(clock.clone())
            .stuck_after(Duration::from_secs(300)),
    )
    .unwrap();
    let early = acquire(&db, b"early");
    early.note(b"provider_outcome_unknown").unwrap();
    early.note(b"provider timeout after 30s").unwrap();
    let done = acquire(&db, b"done");
    done.complete(b"ok").unwrap();
    clock.forward(Duration::from_secs(400));
    let _late = acquire(&db, b"late");
    assert!(matches!(
        _late.note(&[0; oncedb::MAX_NOTE_BYTES + 1]),
        Err(Error::NoteTooLong { .. })
    ));
    let stuck = db.in_flight(Duration::from_secs(300));
    assert_eq!(stuck.len(), 1);
    assert_eq!(stuck[0].scope, scope());
    assert_eq!(stuck[0].key, b"early");
    assert_eq!(stuck[0].epoch, early.epoch());
    assert_eq!(
        stuck[0].note.as_deref(),
        Some(&b"provider timeout after 30s"[..])
    );
    assert_eq!(db.in_flight(Duration::ZERO).len(), 2);
    assert_eq!(db.stats().stuck_records, 1);
}

#[test]
fn the_ordering_guard_gives_every_answer() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let agg = b"order-7";
    assert_eq!(db.advance(&scope(), agg, 1).unwrap(), Advance::Applied);
    assert_eq!(db.advance(&scope(), agg, 2).unwrap(), Advance::Applied);
    assert_eq!(db.advance(&scope(), agg, 2).unwrap(), Advance::Duplicate);
    assert_eq!(
        db.advance(&scope(), agg, 1).unwrap(),
        Advance::Stale { current: 2 }
    );
    assert_eq!(
        db.advance(&scope(), agg, 4).unwrap(),
        Advance::Gap { expected: 3 }
    );
    // A gap changes nothing: 3 is still next.
    assert_eq!(db.advance(&scope(), agg, 3).unwrap(), Advance::Applied);
    assert_eq!(db.advance(&scope(), agg, 4).unwrap(), Advance::Applied);
    // Aggregates, scopes and record keys are independent.
    assert_eq!(
        db.advance(&scope(), b"order-8", 9).unwrap(),
        Advance::Applied
    );
    let other = Scope::new("org_456", "create_payment");
    assert_eq!(db.advance(&other, agg, 1).unwrap(), Advance::Applied);
    let stats = db.stats();
    assert_eq!(
        (
            stats.versions_applied,
            stats.versions_duplicate,
            stats.versions_stale,
            stats.versions_gap,
            stats.live_aggregates
        ),
        (6, 1, 1, 1, 3)
    );
    // The mark lives through the window after its last change, then any version starts.
    clock.forward(WINDOW);
    assert_eq!(db.advance(&scope(), agg, 4).unwrap(), Advance::Duplicate);
    clock.forward(BUCKET);
    assert_eq!(db.advance(&scope(), agg, 1).unwrap(), Advance::Applied);
}

#[test]
fn the_ordering_guard_is_atomic_under_races() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let threads = 6;
    let versions = 300u64;
    let barrier = Barrier::new(threads);
    let applied: Vec<Vec<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let (db, barrier) = (&db, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    let mut mine = Vec::new();
                    let mut version = 1;
                    while version <= versions {
                        match db.advance(&scope(), b"agg", version).unwrap() {
                            Advance::Applied => {
                                mine.push(version);
                                version += 1;
                            }
                            Advance::Duplicate | Advance::Stale { .. } => version += 1,
                            Advance::Gap { expected } => version = expected,
                        }
                    }
                    mine
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut all: Vec<u64> = applied.into_iter().flatten().collect();
    all.sort_unstable();
    assert_eq!(
        all,
        (1..=versions).collect::<Vec<_>>(),
        "each version applied once"
    );
}

#[test]
fn the_ordering_guard_is_durable() {
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    {
        let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
        for version in 1..=5 {
            assert_eq!(
                db.advance(&scope(), b"agg", version).unwrap(),
                Advance::Applied
            );
        }
    }
    let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
    assert_eq!(
        db.advance(&scope(), b"agg", 3).unwrap(),
        Advance::Stale { current: 5 }
    );
    assert_eq!(db.advance(&scope(), b"agg", 6).unwrap(), Advance::Applied);
    assert_eq!(db.stats().live_aggregates, 1);
}

#[test]
fn a_lease_whose_record_expired_is_lost_not_fenced() {
    let clock = manual_clock();
    let db = memory_db(&clock);
    let first = acquire(&db, b"pay-6");
    clock.forward(WINDOW + BUCKET);
    let second = acquire(&db, b"pay-6");
    assert!(second.epoch() > first.epoch());
    assert!(matches!(
        first.complete(b"late").unwrap_err().error(),
        Error::LeaseLost
    ));
    second.complete(b"won").unwrap();
}
