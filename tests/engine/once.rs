//! `Db::run_once`, `Db::wait_finished` and `Lease::keep_alive` on the embedded store:
//! a waiter is woken by the ending itself; a renewing holder is never taken over and a
//! silent one is, after the lease timeout; a renewal survives a reopen.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::support::manual_clock;
use oncedb::{
    Db, Durability, Error, Lease, Once, Options, RecordStatus, Reservation, RunOnce, Scope,
};

fn acquire(db: &Db, scope: &Scope, key: &[u8]) -> Lease {
    match db.reserve(scope, key, b"req").unwrap() {
        Reservation::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {other:?}"),
    }
}

/// Waits until `db` has `n` callers waiting for an outcome.
fn until_waiting(db: &Db, n: u64) {
    let deadline = Instant::now() + Duration::from_secs(30);
    while db.stats().outcome_waiters < n {
        assert!(Instant::now() < deadline, "no caller started waiting");
        std::thread::yield_now();
    }
}

/// The waiter sleeps on the ending: registered before the completion (the store counts
/// it), it returns with the outcome within milliseconds of it, long before its 60 s
/// deadline; with nothing ending, it returns at its deadline with the record in flight.
#[test]
fn a_waiter_is_woken_by_the_ending_not_by_a_timer() {
    let db = Db::open(Options::in_memory()).unwrap();
    let scope = Scope::new("t", "wait");
    let lease = acquire(&db, &scope, b"k");
    std::thread::scope(|threads| {
        let waiter = threads.spawn(|| {
            let record = db.wait_finished(&scope, b"k", Duration::from_secs(60));
            (record, Instant::now())
        });
        until_waiting(&db, 1);
        let completed_at = Instant::now();
        lease.complete(b"answer").unwrap();
        let (record, woken_at) = waiter.join().unwrap();
        let record = record.unwrap().unwrap();
        assert_eq!(record.response(), Some(&b"answer"[..]));
        let late = woken_at.saturating_duration_since(completed_at);
        assert!(
            late < Duration::from_secs(2),
            "woken {late:?} after the completion"
        );
    });
    assert_eq!(db.stats().outcome_waiters, 0);
    let held = acquire(&db, &scope, b"held");
    let started = Instant::now();
    let record = db
        .wait_finished(&scope, b"held", Duration::from_millis(200))
        .unwrap()
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert_eq!(record.status(), RecordStatus::InFlight);
    assert_eq!(
        db.stats().outcome_waiters,
        0,
        "a waiter that gave up is forgotten"
    );
    held.release().unwrap();
}

/// Sixteen threads run one operation once: one runs it, fifteen wait and replay it.
#[test]
fn sixteen_callers_run_the_operation_once_and_all_get_its_output() {
    let db = Db::open(Options::in_memory()).unwrap();
    let scope = Scope::new("t", "once");
    let runs = AtomicUsize::new(0);
    let (open_gate, gate) = std::sync::mpsc::channel::<()>();
    let gate = std::sync::Mutex::new(gate);
    let outcomes: Vec<Once<String>> = std::thread::scope(|threads| {
        let callers: Vec<_> = (0..16)
            .map(|_| {
                threads.spawn(|| {
                    let how = RunOnce::new().wait(Duration::from_secs(60));
                    db.run_once(&scope, (b"k", b"req"), how, |_lease, _watch| {
                        runs.fetch_add(1, Ordering::SeqCst);
                        gate.lock().unwrap().recv().unwrap();
                        Ok::<_, String>(b"output".to_vec())
                    })
                    .unwrap()
                })
            })
            .collect();
        until_waiting(&db, 15);
        open_gate.send(()).unwrap();
        callers.into_iter().map(|c| c.join().unwrap()).collect()
    });
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let ran = outcomes
        .iter()
        .filter(|o| matches!(o, Once::Ran(out) if out == b"output"))
        .count();
    let replayed = outcomes
        .iter()
        .filter(|o| matches!(o, Once::Replayed(r) if r.response() == Some(&b"output"[..])))
        .count();
    assert_eq!((ran, replayed), (1, 15));
}

/// With a lease timeout, `run_once` renews its lease while the operation runs: a caller
/// that waits longer than the timeout is still told `StillInFlight`. A holder that
/// stops renewing (its lease dropped) is taken over after the timeout by a waiting
/// caller, which runs the operation.
#[test]
fn a_renewing_holder_is_never_taken_over_and_a_silent_one_is() {
    let timeout = Duration::from_millis(300);
    let db = Arc::new(Db::open(Options::in_memory().lease_timeout(timeout)).unwrap());
    let scope = Scope::new("t", "renew");
    let (release, released) = std::sync::mpsc::channel::<()>();
    let (entered, running) = std::sync::mpsc::channel::<()>();
    let holder = {
        let (db, scope) = (Arc::clone(&db), scope.clone());
        std::thread::spawn(move || {
            db.run_once(&scope, (b"k", b"req"), RunOnce::new(), |_lease, _watch| {
                entered.send(()).unwrap();
                released.recv().unwrap();
                Ok::<_, String>(b"first".to_vec())
            })
            .unwrap()
        })
    };
    running.recv().unwrap();
    let busy = db.run_once(
        &scope,
        (b"k", b"req"),
        RunOnce::new().wait(timeout * 4),
        |_, _| Ok::<_, String>(b"second".to_vec()),
    );
    assert!(matches!(busy, Err(Error::StillInFlight { .. })), "{busy:?}");
    release.send(()).unwrap();
    assert!(matches!(holder.join().unwrap(), Once::Ran(ref out) if out == b"first"));

    // A holder that stopped renewing: its lease dropped, the record left in flight.
    drop(acquire(&db, &scope, b"silent"));
    let taken = db
        .run_once(
            &scope,
            (b"silent", b"req"),
            RunOnce::new().wait(timeout * 10),
            |_, _| Ok::<_, String>(b"taken over".to_vec()),
        )
        .unwrap();
    assert!(matches!(taken, Once::Ran(ref out) if out == b"taken over"));
}

/// A renewal is logged: reopened past the timeout from the grant but within it from
/// the renewal, the record is still in flight under the lease, not taken over.
#[test]
fn a_renewal_survives_a_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let options = || {
        Options::new(dir.path())
            .durability(Durability::Sync)
            .clock(clock.clone())
            .lease_timeout(Duration::from_millis(600))
    };
    let db = Db::open(options()).unwrap();
    let scope = Scope::new("t", "renewal");
    let lease = acquire(&db, &scope, b"k");
    let epoch = lease.epoch();
    clock.forward(Duration::from_millis(500));
    lease.keep_alive().unwrap();
    drop(lease);
    drop(db);
    clock.forward(Duration::from_millis(500));
    let db = Db::open(options()).unwrap();
    assert!(matches!(
        db.reserve(&scope, b"k", b"req").unwrap(),
        Reservation::InFlight { .. }
    ));
    let lease = db.resume(&scope, b"k", epoch).unwrap();
    clock.forward(Duration::from_millis(700));
    let Reservation::Acquired(taker) = db.reserve(&scope, b"k", b"req").unwrap() else {
        panic!("a silent lease is taken over after the timeout");
    };
    assert!(taker.epoch() > epoch);
    assert!(matches!(lease.keep_alive(), Err(Error::Fenced)));
}

/// Every ending of `Db::run_once` is an ending: an output over the limit fails the record
/// with a short text (replayed, not run again); a failure text over it is cut to it; an
/// operation that panics leaves the record in flight with a note, which a reserve past
/// the lease timeout does not take over.
#[test]
fn run_once_ends_its_record_on_every_path() {
    let clock = manual_clock();
    let db = Db::open(
        Options::in_memory()
            .clock(clock.clone())
            .max_response_bytes(64)
            .lease_timeout(Duration::from_secs(1)),
    )
    .unwrap();
    let scope = Scope::new("t", "endings");
    let runs = AtomicUsize::new(0);
    let large = || {
        db.run_once(&scope, (b"large", b"req"), RunOnce::new(), |_, _| {
            runs.fetch_add(1, Ordering::SeqCst);
            Ok::<_, String>(vec![1; 65])
        })
    };
    assert!(matches!(
        large(),
        Err(Error::ResponseTooLarge { len: 65, max: 64 })
    ));
    let Ok(Once::Replayed(record)) = large() else {
        panic!("an output over the limit is run again");
    };
    assert_eq!(record.status(), RecordStatus::Failed);
    assert_eq!(runs.load(Ordering::SeqCst), 1);
    let failed = db.run_once(
        &scope,
        (b"long", b"req"),
        RunOnce::new().on_error(oncedb::OnError::Fail),
        |_, _| Err::<Vec<u8>, _>("é".repeat(40)),
    );
    assert!(matches!(failed, Ok(Once::Errored(_))));
    let record = db.get(&scope, b"long").unwrap().unwrap();
    assert_eq!(record.response(), Some("é".repeat(32).as_bytes()));
    let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        db.run_once(&scope, (b"panics", b"req"), RunOnce::new(), |_, _| {
            panic!("the operation panics")
        })
        .map(|_: Once<String>| ())
    }));
    assert!(panicked.is_err());
    clock.forward(Duration::from_secs(2));
    let Reservation::InFlight {
        note: Some(note), ..
    } = db.reserve(&scope, b"panics", b"req").unwrap()
    else {
        panic!("a panicked operation's record was taken over or left unnoted");
    };
    assert!(note.ends_with(b"outcome unknown"));
}

/// A waiter wakes when a silent holder's lease runs out, and `run_once` takes the record
/// over then, not at the end of its own 20 s wait.
#[test]
fn a_waiter_takes_over_when_a_silent_holders_lease_runs_out() {
    let db = Db::open(Options::in_memory().lease_timeout(Duration::from_millis(300))).unwrap();
    let scope = Scope::new("t", "silent");
    // The holder dies: its lease is dropped, neither ended nor noted.
    drop(acquire(&db, &scope, b"k"));
    let started = Instant::now();
    let how = RunOnce::new().wait(Duration::from_secs(20));
    let ran = db.run_once(&scope, (b"k", b"req"), how, |_, _| {
        Ok::<_, String>(b"taken over".to_vec())
    });
    assert!(matches!(ran, Ok(Once::Ran(_))));
    let waited = started.elapsed();
    assert!(
        waited < Duration::from_secs(10),
        "waited {waited:?} for a lease of 300 ms"
    );
}

/// A wait dropped before its ending (a timeout around it, a `select!`) takes its
/// registration back: a million of them leave no waiter behind.
#[cfg(feature = "async")]
#[test]
fn a_cancelled_wait_leaves_no_waiter_behind() {
    let db = Db::open(Options::in_memory()).unwrap();
    let scope = Scope::new("t", "cancelled-waits");
    let lease = acquire(&db, &scope, b"k");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    runtime.block_on(async {
        for _ in 0..1000 {
            let wait = oncedb::Store::wait_finished(&db, &scope, b"k", Duration::from_secs(60));
            let mut wait = std::pin::pin!(wait);
            // Polled once (registered), then dropped.
            assert!(futures_util::poll!(wait.as_mut()).is_pending());
        }
    });
    assert_eq!(db.stats().outcome_waiters, 0);
    lease.complete(b"done").unwrap();
}

/// A lease timeout under a millisecond is a millisecond, as on every store: a record just
/// reserved is not taken over at once.
#[test]
fn a_lease_timeout_under_a_millisecond_is_one() {
    let clock = manual_clock();
    let db = Db::open(
        Options::in_memory()
            .clock(clock.clone())
            .lease_timeout(Duration::from_micros(500)),
    )
    .unwrap();
    let scope = Scope::new("t", "short");
    let lease = acquire(&db, &scope, b"k");
    assert!(matches!(
        db.reserve(&scope, b"k", b"req").unwrap(),
        Reservation::InFlight { .. }
    ));
    clock.forward(Duration::from_millis(1));
    assert!(matches!(
        db.reserve(&scope, b"k", b"req").unwrap(),
        Reservation::Acquired(_)
    ));
    assert!(matches!(lease.complete(b"late"), Err(e) if matches!(e.error(), Error::Fenced)));
}
