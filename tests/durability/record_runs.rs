//! `Options::memory_budget` and idempotency records: settled records beyond a quarter of
//! the budget are sealed into record runs on disk; every answer stays exact (a replay
//! byte for byte, a mismatch, an unknown key, a lease that ended), in memory and after a
//! reopen; a damaged run is `Corrupted`, never another record; runs leave whole with
//! their window.

use std::path::Path;
use std::sync::Arc;

use crate::support::{BUCKET, WINDOW, manual_clock};
use oncedb::io::{MemStorage, Storage};
use oncedb::{Db, Durability, Error, ManualClock, Options, Reservation, Scope};
use oncedb_testkit::gate::SyncGate;

/// Records seal once they hold 16 KiB of memory: every few hundred records.
const BUDGET: u64 = 1 << 16;
const RECORDS: u32 = 6_000;

fn options(storage: Arc<dyn Storage>, clock: &ManualClock) -> Options {
    options_in(storage, clock, Durability::Buffered)
}

fn options_in(storage: Arc<dyn Storage>, clock: &ManualClock, durability: Durability) -> Options {
    Options::new("/db")
        .window(WINDOW)
        .bucket_width(BUCKET)
        .clock(clock.clone())
        .durability(durability)
        .memory_budget(BUDGET)
        .shards(4)
        .storage(storage)
}

fn key(n: u32) -> [u8; 8] {
    u64::from(n).to_le_bytes()
}

fn response_of(n: u32) -> Vec<u8> {
    let mut response = vec![(n % 251) as u8; 40 + (n % 60) as usize];
    response[..4].copy_from_slice(&n.to_le_bytes());
    response
}

/// Reserves and ends records `range` (every seventh one failed), each with its request.
fn finish_all(db: &Db, scope: &Scope, range: std::ops::Range<u32>) {
    for n in range {
        end(n, reserve_new(db, scope, n));
    }
}

/// Reserves record `n`, which is new: its lease.
fn reserve_new(db: &Db, scope: &Scope, n: u32) -> oncedb::Lease {
    match db.reserve(scope, &key(n), b"req").unwrap() {
        Reservation::Acquired(lease) => lease,
        other => panic!("record {n} is new: {other:?}"),
    }
}

/// Ends record `n` with its response: failed if it is a seventh one, else completed.
fn end(n: u32, lease: oncedb::Lease) {
    if n.is_multiple_of(7) {
        lease.fail(&response_of(n)).unwrap();
    } else {
        lease.complete(&response_of(n)).unwrap();
    }
}

/// Reserves records `range`, each new, and keeps them in flight: their leases.
fn reserve_all(db: &Db, scope: &Scope, range: std::ops::Range<u32>) -> Vec<oncedb::Lease> {
    range.map(|n| reserve_new(db, scope, n)).collect()
}

/// Every record `range` answers as finished, with its response byte for byte, to a
/// retry and to `get`; another request is a mismatch.
fn answers_all(db: &Db, scope: &Scope, range: std::ops::Range<u32>) {
    for n in range {
        let record = match db.reserve(scope, &key(n), b"req").unwrap() {
            Reservation::Failed(record) if n % 7 == 0 => record,
            Reservation::Completed(record) if n % 7 != 0 => record,
            other => panic!("record {n}: {other:?}"),
        };
        assert_eq!(record.response(), Some(&response_of(n)[..]), "record {n}");
        let got = db.get(scope, &key(n)).unwrap().unwrap();
        assert_eq!(got.response(), Some(&response_of(n)[..]), "record {n}");
        assert_eq!(got.status(), record.status());
        assert!(matches!(
            db.reserve(scope, &key(n), b"other").unwrap(),
            Reservation::Mismatch
        ));
    }
}

/// A store under the budget with records `0..count` finished (and flushed: the seal
/// under way is settled).
fn store_with_records(count: u32) -> (MemStorage, ManualClock, Db) {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
    finish_all(&db, &Scope::new("org", "pay"), 0..count);
    db.flush().unwrap();
    (disk, clock, db)
}

fn record_runs_on(disk: &MemStorage) -> Vec<std::path::PathBuf> {
    disk.list(Path::new("/db"))
        .unwrap()
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "records"))
        .collect()
}

/// In `Buffered`, and in `Interval` with a long interval, where most finished records
/// still hold their responses (the log is written a megabyte at a time) when a seal takes
/// the settled ones: the run's cover stops before the first of those, whose endings the
/// reopen replays.
#[test]
fn settled_records_beyond_the_budget_are_sealed_and_every_answer_stays_exact() {
    for durability in [
        Durability::Buffered,
        Durability::Interval(std::time::Duration::from_secs(3600)),
    ] {
        sealed_records_answer_exactly(durability);
    }
}

fn sealed_records_answer_exactly(durability: Durability) {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let scope = Scope::new("org", "pay");
    let options = || options_in(Arc::new(disk.clone()), &clock, durability);
    let db = Db::open(options()).unwrap();
    finish_all(&db, &scope, 0..RECORDS);
    // A record still in flight is never sealed.
    let Reservation::Acquired(open_lease) = db.reserve(&scope, b"open", b"req").unwrap() else {
        panic!("a new key");
    };
    finish_all(&db, &scope, RECORDS..2 * RECORDS);
    db.flush().unwrap();
    let stats = db.stats();
    assert!(stats.sealed_record_runs >= 1, "{stats:?}");
    assert!(stats.sealed_records >= u64::from(RECORDS / 2), "{stats:?}");
    assert_eq!(
        stats.sealed_records + stats.live_records,
        u64::from(2 * RECORDS) + 1,
        "{stats:?}"
    );
    assert_eq!(record_runs_on(&disk).len() as u64, stats.sealed_record_runs);
    answers_all(&db, &scope, 0..2 * RECORDS);
    assert!(db.get(&scope, b"never").unwrap().is_none());
    assert!(matches!(
        db.reserve(&scope, b"open", b"req").unwrap(),
        Reservation::InFlight { .. }
    ));
    drop(db);
    disk.process_crash();

    // A reopen replays the log past the runs' cover: sealed records stay on disk.
    let db = Db::open(options()).unwrap();
    let reopened = db.stats();
    assert_eq!(reopened.sealed_records, stats.sealed_records);
    // A record that ended while a seal ran may be both in its run and replayed (so in
    // memory again until the next seal), some among the sealed ones: a record seal
    // fsyncs the log before it publishes its run, so more records end while it runs.
    assert!(
        reopened.live_records < stats.live_records + stats.sealed_records / 2,
        "memory rebuilt the sealed records: {} before, {reopened:?}",
        stats.live_records
    );
    answers_all(&db, &scope, 0..2 * RECORDS);
    assert!(matches!(
        db.reserve(&scope, b"open", b"req").unwrap(),
        Reservation::InFlight { .. }
    ));
    let epoch = open_lease.epoch();
    drop(open_lease);
    db.resume(&scope, b"open", epoch)
        .unwrap()
        .complete(b"late")
        .unwrap();
    assert_eq!(
        db.get(&scope, b"open").unwrap().unwrap().response(),
        Some(&b"late"[..])
    );
    assert!(db.get(&scope, b"never").unwrap().is_none());
}

/// Record runs merge four of a level into one of the next, as key runs do: answers stay
/// exact before and after a reopen, and only the merged run is left.
#[test]
fn record_runs_merge_and_every_answer_stays_exact() {
    let (disk, clock, db) = store_with_records(4 * RECORDS);
    let scope = Scope::new("org", "pay");
    let stats = db.stats();
    assert!(stats.runs_merged >= 1, "{stats:?}");
    assert!(stats.sealed_record_runs < stats.runs_sealed, "{stats:?}");
    assert_eq!(record_runs_on(&disk).len() as u64, stats.sealed_record_runs);
    answers_all(&db, &scope, 0..4 * RECORDS);
    drop(db);
    disk.process_crash();
    let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
    answers_all(&db, &scope, 0..4 * RECORDS);
    assert!(db.get(&scope, b"never").unwrap().is_none());
}

#[test]
fn record_runs_leave_whole_with_their_window() {
    let (disk, clock, db) = store_with_records(RECORDS);
    let scope = Scope::new("org", "pay");
    assert!(!record_runs_on(&disk).is_empty());
    clock.forward(WINDOW + 2 * BUCKET);
    // The old records are gone: each key is new again, and the runs are removed.
    finish_all(&db, &scope, 0..RECORDS);
    db.flush().unwrap();
    let stats = db.stats();
    assert!(stats.runs_expired >= 1, "{stats:?}");
    assert!(
        stats.sealed_records <= u64::from(RECORDS),
        "expired records stay sealed: {stats:?}"
    );
    answers_all(&db, &scope, 0..RECORDS);
}

#[test]
fn a_damaged_record_run_is_corruption_never_another_answer() {
    let (disk, clock, db) = store_with_records(RECORDS);
    let scope = Scope::new("org", "pay");
    drop(db);
    let run = record_runs_on(&disk).into_iter().next().unwrap();
    let mut bytes = disk.contents(&run).unwrap();
    // A byte of the first data page: a record's response span.
    bytes[90] ^= 0x40;
    disk.set_contents(&run, bytes);
    let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
    let mut corrupted = 0;
    for n in 0..RECORDS {
        match db.reserve(&scope, &key(n), b"req") {
            Err(Error::Corrupted { path, .. }) => {
                assert_eq!(path, run);
                corrupted += 1;
            }
            Ok(Reservation::Completed(record) | Reservation::Failed(record)) => {
                assert_eq!(record.response(), Some(&response_of(n)[..]), "record {n}");
            }
            other => panic!("record {n}: {other:?}"),
        }
    }
    assert!(corrupted > 0, "no lookup read the damaged page");
    let report = oncedb::verify_with(&disk, "/db").unwrap();
    assert!(!report.is_clean(), "{report:?}");
}

/// The sweep's store: the log is written at each flush (a long interval), so that the
/// workload makes few I/O calls.
fn sweep_options(storage: Arc<dyn Storage>, clock: &ManualClock) -> Options {
    options_in(
        storage,
        clock,
        Durability::Interval(std::time::Duration::from_secs(3600)),
    )
}

/// Records the fault sweep finishes: a record seal.
const SWEEP_RECORDS: u32 = 5_000;

/// Finishes the sweep's records, flushing every 500, and returns how many a flush
/// acknowledged before the first error.
fn flushed_records(db: &Db, scope: &Scope) -> u32 {
    let mut acked = 0;
    for n in 0..SWEEP_RECORDS {
        let finished = match db.reserve(scope, &key(n), b"req") {
            Ok(Reservation::Acquired(lease)) => lease.complete(&response_of(n)).is_ok(),
            _ => false,
        };
        if !finished {
            return acked;
        }
        if n % 500 == 499 {
            if db.flush().is_err() {
                return acked;
            }
            acked = n + 1;
        }
    }
    acked
}

/// A fault at any I/O call while records are finished and sealed (each record run's
/// create, appends, fsync, rename and directory fsync among them), then a crash or a
/// power loss: the fault is reported, and every record acknowledged before it replays
/// byte for byte after a reopen.
#[test]
fn a_fault_at_any_step_of_a_record_seal_loses_no_acknowledged_record() {
    let scope = Scope::new("org", "pay");
    let calls = {
        let faulty = oncedb::io::FaultyStorage::new(Arc::new(MemStorage::new()));
        let clock = manual_clock();
        let db = Db::open(sweep_options(Arc::new(faulty.clone()), &clock)).unwrap();
        assert_eq!(flushed_records(&db, &scope), SWEEP_RECORDS);
        assert!(db.stats().runs_sealed >= 1, "{:?}", db.stats());
        drop(db);
        faulty.calls()
    };
    assert!(calls < 200, "the sweep makes {calls} calls");
    let clock = manual_clock();
    crate::support::sweep_faults(
        calls,
        |storage| Db::open(sweep_options(storage, &clock)),
        (|db: &Db| flushed_records(db, &scope), SWEEP_RECORDS),
        |db, acked, round| {
            for n in 0..acked {
                match db.reserve(&scope, &key(n), b"req").unwrap() {
                    Reservation::Completed(record) => {
                        assert_eq!(record.response(), Some(&response_of(n)[..]), "{round}");
                    }
                    other => panic!("{round}: acknowledged record {n}: {other:?}"),
                }
            }
        },
    );
}

/// While a record seal is held inside its run's fsync, a writer goes on finishing records
/// until the records memory holds reach half the budget (twice a record seal's
/// threshold), then waits there; once the seal ends it goes on, and every record answers
/// exactly.
#[test]
fn writers_wait_for_a_record_seal_at_half_the_budget() {
    const BUDGET_BYTES: u64 = 4 << 20;
    // A look at the budget comes every 4,096 calls: memory may pass the bound by as many
    // records (under 200 bytes each here) before a writer sees it.
    const SLACK_BYTES: u64 = 4_096 * 200;
    let disk = MemStorage::new();
    let gate = SyncGate::thread("oncedb-sealer");
    let clock = manual_clock();
    let scope = Scope::new("org", "pay");
    let options = Options::new("/db")
        .window(WINDOW)
        .bucket_width(BUCKET)
        .clock(clock.clone())
        .durability(Durability::Buffered)
        .memory_budget(BUDGET_BYTES)
        .shards(4)
        .storage(Arc::new(gate.storage(disk.clone())));
    let db = Db::open(options).unwrap();
    let release = gate.release_on_drop();
    // The seal fsyncs the log its records name first, then its run: the run's is held.
    gate.hold(2);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let limit = std::time::Duration::from_secs(30);
    let finished = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && n < 1_000_000 {
                finish_all(&db, &scope, n..n + 64);
                n += 64;
            }
            n
        });
        assert!(
            gate.await_held_within(1, limit),
            "no record seal fsynced the log"
        );
        gate.release_one();
        assert!(
            gate.await_held_within(2, limit),
            "no record seal reached its run's fsync"
        );
        let stats = crate::support::until_the_writer_waits(
            &db,
            &writer,
            limit,
            ("the seal", |stats| stats.budget_waiters > 0),
        );
        assert_eq!(stats.budget_waiters, 1, "{stats:?}");
        assert_eq!(
            stats.sealed_record_runs, 0,
            "the seal ended while held: {stats:?}"
        );
        let held = stats.index_bytes - stats.sealed_filter_bytes;
        assert!(
            held < BUDGET_BYTES / 2 + SLACK_BYTES,
            "{held} bytes of records in memory: {stats:?}"
        );
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        drop(release);
        writer.join().unwrap()
    });
    db.flush().unwrap();
    let stats = db.stats();
    assert!(stats.sealed_record_runs >= 1, "{stats:?}");
    assert_eq!(stats.budget_waiters, 0, "{stats:?}");
    answers_all(&db, &scope, 0..finished);
}

/// With a response retention shorter than the window, a sealed record past the retention
/// answers `Expired` (the operation happened, its response aged out) and keeps doing so
/// until the window ends, as a record in memory does.
#[test]
fn a_sealed_record_past_the_response_retention_is_expired() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let scope = Scope::new("org", "pay");
    let options = || options(Arc::new(disk.clone()), &clock).response_retention(WINDOW / 4);
    let db = Db::open(options()).unwrap();
    finish_all(&db, &scope, 0..RECORDS);
    db.flush().unwrap();
    assert!(db.stats().sealed_records > 0, "{:?}", db.stats());
    clock.forward(WINDOW / 2);
    let expired_all = |db: &Db| {
        for n in (0..RECORDS).step_by(7) {
            match db.reserve(&scope, &key(n), b"req").unwrap() {
                Reservation::Expired(record) => assert_eq!(record.response(), None),
                other => panic!("record {n}: {other:?}"),
            }
            let got = db.get(&scope, &key(n)).unwrap().unwrap();
            assert_eq!(got.response(), None, "record {n}");
        }
    };
    expired_all(&db);
    drop(db);
    disk.process_crash();
    expired_all(&Db::open(options()).unwrap());
}

/// Under `Buffered` a response's frame is written, not fsynced, when a seal takes its
/// record, and the seal's run names that frame. The run is fsynced only after the log up
/// to its cover and its frames: a power loss after the seal leaves the store opening and
/// every record answering as a `Buffered` store's may (finished with its response, in
/// flight or new again if its frames were lost), where every reserve failed with an I/O
/// error from
/// a run naming frames past the log's end.
#[test]
fn a_power_loss_after_a_record_seal_leaves_every_record_answerable() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let scope = Scope::new("org", "pay");
    let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
    finish_all(&db, &scope, 0..RECORDS);
    // No flush: it would fsync the log. The seal task publishes its run by itself.
    oncedb_testkit::servers::wait_for("a record run", || db.stats().sealed_record_runs >= 1);
    // The process dies with the power, its buffers never written.
    std::mem::forget(db);
    disk.power_loss();
    let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
    let mut finished = 0;
    for n in 0..RECORDS {
        match db.reserve(&scope, &key(n), b"req") {
            Ok(Reservation::Completed(record) | Reservation::Failed(record)) => {
                assert_eq!(record.response(), Some(&response_of(n)[..]), "record {n}");
                finished += 1;
            }
            // Its ending (or its reserve) lost with the power.
            Ok(Reservation::InFlight { .. } | Reservation::Acquired(_)) => {}
            other => panic!("record {n}: {other:?}"),
        }
    }
    assert!(finished > 0, "no record survived the seal's fsync");
}

/// Records in flight cannot be sealed. Past the record threshold they start no record
/// seal, which would take nothing (a run file written and removed, a run id used, at
/// every check) and, chosen over the dedup tables for being further past its threshold,
/// kept the keys from ever sealing: the keys seal, and no record run is written.
#[test]
fn records_in_flight_start_no_record_seal_and_leave_the_keys_to_seal() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
    let scope = Scope::new("org", "pay");
    let held = reserve_all(&db, &scope, 0..20_000);
    for n in 0..50_000_u64 {
        assert!(db.insert_if_absent(&n.to_le_bytes()).unwrap());
    }
    db.flush().unwrap();
    let stats = db.stats();
    assert!(
        stats.sealed_runs >= 1,
        "the dedup keys never sealed: {stats:?}"
    );
    assert_eq!(stats.sealed_record_runs, 0, "{stats:?}");
    assert!(record_runs_on(&disk).is_empty());
    for lease in held {
        lease.complete(b"done").unwrap();
    }
}

/// The memory records leave (settled into the dense tier, sealed into runs) is given
/// back: a map and a table grown for 20,000 records in flight do not keep their peak
/// capacity once those records are sealed, so that the budget, which weighs the memory
/// held, does not stay near its bound with the records gone.
#[test]
fn memory_the_records_left_is_given_back() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
    let scope = Scope::new("org", "pay");
    let held_bytes = |db: &Db| {
        let stats = db.stats();
        stats.index_bytes - stats.sealed_filter_bytes
    };
    let empty = held_bytes(&db);
    let leases = reserve_all(&db, &scope, 0..20_000);
    let peak = held_bytes(&db);
    for (n, lease) in (0..).zip(leases) {
        end(n, lease);
    }
    db.flush().unwrap();
    // The next writes look at the budget (every 4,096 calls) and seal what settled.
    finish_all(&db, &scope, 20_000..30_000);
    db.flush().unwrap();
    let stats = db.stats();
    assert!(stats.sealed_record_runs >= 1, "{stats:?}");
    let after = held_bytes(&db);
    assert!(
        after - empty < (peak - empty) / 8,
        "{after} bytes held after the seals, {peak} at the peak, {empty} empty: {stats:?}"
    );
    answers_all(&db, &scope, 0..30_000);
}
