//! The asynchronous `Store` interface over the embedded `Db` (feature `async`): the same
//! semantics as the synchronous API (the whole conformance suite), and no fsync on a
//! runtime thread.

use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::{Duration, SystemTime};

use crate::conformance::suite;
use oncedb::io::MemStorage;
use oncedb::{Db, Durability, ManualClock, Options, StoreOptions};
use oncedb_testkit::gate::SyncGate;
use oncedb_testkit::watched::WatchedStorage;

/// The thread of every file and directory sync.
type SyncThreads = Arc<Mutex<Vec<ThreadId>>>;

/// Durable stores on the recording storage, opened on the blocking pool, on a manual
/// clock. It keeps a handle to each: dropping the last handle of a durable `Db` closes
/// its journal, which syncs on the dropping thread, and that is not what is under test.
struct Recorded {
    storage: WatchedStorage,
    threads: SyncThreads,
    clock: ManualClock,
    stores: Mutex<Vec<Db>>,
}

impl suite::Harness for Recorded {
    type S = Db;

    async fn store_with(&self, shared: StoreOptions) -> Db {
        let n = self.stores.lock().unwrap().len();
        let window = shared.window();
        let options = shared
            .embedded(Options::new(format!("/db/{n}")))
            .storage(Arc::new(self.storage.clone()))
            .durability(Durability::Sync)
            .bucket_width(window / 10)
            .clock(self.clock.clone());
        // Opening syncs files too: not on the runtime thread either.
        let db = tokio::task::spawn_blocking(move || Db::open(options))
            .await
            .unwrap()
            .unwrap();
        self.stores.lock().unwrap().push(db.clone());
        db
    }

    async fn pass(&self, _store: &Db, window: Duration) {
        self.clock.forward(window + window / 5);
    }

    async fn approach(&self, _store: &Db, window: Duration) {
        self.clock.forward(window - Duration::from_millis(1));
    }
}

/// The whole conformance suite (insert_many, take_over, advance, release and the races
/// included) on a current-thread runtime: every fsync ran on another thread.
#[test]
fn a_durable_db_never_fsyncs_on_the_runtime_thread() {
    let threads = SyncThreads::default();
    let recorded = Arc::clone(&threads);
    let storage = WatchedStorage::new(MemStorage::new(), move || {
        recorded.lock().unwrap().push(std::thread::current().id());
    });
    let harness = Recorded {
        storage,
        threads,
        clock: ManualClock::new(SystemTime::now()),
        stores: Mutex::new(Vec::new()),
    };
    // Timers on: waits for an outcome (`wait_finished`, `run_once`) sleep on them.
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .unwrap();
    runtime.block_on(suite::run(&harness));
    let runtime_thread = std::thread::current().id();
    // Before the harness drops the stores.
    let threads = harness.threads.lock().unwrap().clone();
    assert_eq!(harness.stores.lock().unwrap().len(), 8);
    assert!(
        threads.len() > 40,
        "the writes were fsynced: {}",
        threads.len()
    );
    assert!(
        threads.iter().all(|&thread| thread != runtime_thread),
        "an fsync ran on the runtime thread"
    );
}

/// A `Sync` store whose writers' fsyncs pass through `gate`.
fn sync_db_behind(gate: &Arc<SyncGate>) -> Db {
    let options = Options::new("/db")
        .storage(Arc::new(gate.storage(MemStorage::new())))
        .durability(Durability::Sync)
        .window(Duration::from_secs(60))
        .bucket_width(Duration::from_secs(6))
        .clock(ManualClock::new(SystemTime::now()));
    Db::open(options).unwrap()
}

/// A current-thread runtime whose blocking pool has one thread.
fn one_blocking_thread() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .max_blocking_threads(1)
        .build()
        .unwrap()
}

/// A `Sync` write through `Store` waits for its group commit without holding a thread:
/// with a blocking pool of one thread, and that one (or the commit's) stuck in an fsync,
/// every other write still reaches memory and the log and joins the next group. A
/// design that parks a blocking-pool thread per waiting call admits one key while the
/// fsync is held and pays an fsync per write.
#[test]
fn a_waiting_write_holds_no_thread() {
    use oncedb::Store;
    let gate = SyncGate::writers();
    let db = sync_db_behind(&gate);
    db.insert_if_absent(b"warm-up").unwrap();
    db.flush().unwrap();
    let before = db.stats();
    gate.hold(1);
    let writers = 16u64;
    let runtime = one_blocking_thread();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut admitted_while_held = 0;
    std::thread::scope(|s| {
        let writes = s.spawn(|| {
            runtime.block_on(async {
                let tasks: Vec<_> = (0..writers)
                    .map(|w| {
                        let db = db.clone();
                        tokio::spawn(
                            async move { Store::insert_if_absent(&db, &w.to_le_bytes()).await },
                        )
                    })
                    .collect();
                for task in tasks {
                    assert!(task.await.unwrap().unwrap());
                }
            });
        });
        gate.await_held(1);
        while db.stats().live_keys - before.live_keys < writers
            && std::time::Instant::now() < deadline
        {
            std::thread::yield_now();
        }
        admitted_while_held = db.stats().live_keys - before.live_keys;
        gate.release_one();
        writes.join().unwrap();
    });
    assert_eq!(
        admitted_while_held, writers,
        "every write reached memory while one fsync was held"
    );
    let fsyncs = db.stats().fsyncs - before.fsyncs;
    assert!(fsyncs <= 2, "the held group and the next: {fsyncs} fsyncs");
    assert!((0..writers).all(|w| db.contains(&w.to_le_bytes()).unwrap()));
}

/// Take-overs, ordering-guard advances and notes through `Store` wait for their group
/// commit as the other writes do, holding no thread: with a blocking pool of one thread
/// and one fsync held, sixteen of each reach memory and the log, and join the next group.
/// Sent through the blocking pool, they would move one at a time while the fsync is held.
#[test]
fn take_overs_advances_and_notes_hold_no_thread_while_they_wait() {
    use oncedb::{Advance, Reservation, Scope, Store, StoreLease};
    let gate = SyncGate::writers();
    let db = sync_db_behind(&gate);
    let scope = Scope::new("org", "op");
    let writers = 16u64;
    let acquire = |n: u64| match db.reserve(&scope, &n.to_le_bytes(), b"r").unwrap() {
        Reservation::Acquired(lease) => lease,
        other => panic!("a fresh key is acquired: {other:?}"),
    };
    // One record in flight per writer to take over, and one lease per writer to note on.
    let taken: Vec<_> = (0..writers).map(acquire).collect();
    let noted: Vec<_> = (0..writers).map(|w| acquire(1_000 + w)).collect();
    db.flush().unwrap();
    let before = db.stats();
    let noted_now = || {
        db.in_flight(Duration::ZERO)
            .iter()
            .filter(|record| record.note.as_deref() == Some(&b"step"[..]))
            .count() as u64
    };
    let progress = || {
        let stats = db.stats();
        (stats.take_overs - before.take_overs)
            + (stats.versions_applied - before.versions_applied)
            + noted_now()
    };
    gate.hold(1);
    let runtime = one_blocking_thread();
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut done_while_held = 0;
    std::thread::scope(|s| {
        let writes = s.spawn(|| {
            runtime.block_on(async {
                let mut tasks = Vec::new();
                for (w, lease) in (0..writers).zip(noted) {
                    let (db, scope) = (db.clone(), scope.clone());
                    let (db2, scope2) = (db.clone(), scope.clone());
                    tasks.push(tokio::spawn(async move {
                        let lease = Store::take_over(&db, &scope, &w.to_le_bytes()).await;
                        assert!(lease.unwrap().is_some(), "record {w} is taken over");
                    }));
                    tasks.push(tokio::spawn(async move {
                        let advanced = Store::advance(&db2, &scope2, &w.to_le_bytes(), 1).await;
                        assert_eq!(advanced.unwrap(), Advance::Applied);
                    }));
                    tasks.push(tokio::spawn(async move {
                        StoreLease::note(&lease, b"step").await.unwrap();
                    }));
                }
                for task in tasks {
                    task.await.unwrap();
                }
            });
        });
        gate.await_held(1);
        while progress() < 3 * writers && std::time::Instant::now() < deadline {
            std::thread::yield_now();
        }
        done_while_held = progress();
        gate.release_one();
        writes.join().unwrap();
    });
    drop(taken);
    assert_eq!(
        done_while_held,
        3 * writers,
        "writes that reached memory while one fsync was held"
    );
    let fsyncs = db.stats().fsyncs - before.fsyncs;
    assert!(fsyncs <= 2, "the held group and the next: {fsyncs} fsyncs");
}

/// A waker that records that it was woken.
#[derive(Default)]
struct Woken {
    woken: parking_lot::Mutex<bool>,
    changed: parking_lot::Condvar,
}

impl std::task::Wake for Woken {
    fn wake(self: Arc<Self>) {
        *self.woken.lock() = true;
        self.changed.notify_all();
    }
}

/// A group commit that fails wakes every write waiting on it, each with
/// `Error::Poisoned` (the committer thread met the I/O error), and the store stays
/// poisoned: no write after it is acknowledged.
#[test]
fn a_failed_commit_wakes_every_waiting_write() {
    use oncedb::Store;
    use oncedb::io::FaultyStorage;
    use std::future::Future;
    use std::task::{Context, Poll};
    let faulty = FaultyStorage::new(Arc::new(MemStorage::new()));
    let options = Options::new("/db")
        .storage(Arc::new(faulty.clone()))
        .durability(Durability::Sync)
        .window(Duration::from_secs(60))
        .bucket_width(Duration::from_secs(6))
        .clock(ManualClock::new(SystemTime::now()));
    let db = Db::open(options).unwrap();
    db.insert_if_absent(b"warm-up").unwrap();
    db.flush().unwrap();
    faulty.reset();
    faulty.fail_at(1, true);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let _context = runtime.enter();
    let keys: Vec<[u8; 8]> = (0..8u64).map(u64::to_le_bytes).collect();
    let mut writes: Vec<_> = keys
        .iter()
        .map(|key| Box::pin(Store::insert_if_absent(&db, key)))
        .collect();
    let mut pending = Vec::new();
    for (n, write) in writes.iter_mut().enumerate() {
        let woken = Arc::new(Woken::default());
        let waker = std::task::Waker::from(Arc::clone(&woken));
        match write.as_mut().poll(&mut Context::from_waker(&waker)) {
            Poll::Pending => pending.push((n, woken, waker)),
            Poll::Ready(answer) => assert!(matches!(answer, Err(oncedb::Error::Poisoned))),
        }
    }
    assert!(!pending.is_empty(), "the first write waits for its commit");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    for (n, woken, waker) in pending {
        let mut flag = woken.woken.lock();
        while !*flag && std::time::Instant::now() < deadline {
            woken.changed.wait_until(&mut flag, deadline);
        }
        assert!(*flag, "write {n} was never woken");
        drop(flag);
        let answer = writes[n].as_mut().poll(&mut Context::from_waker(&waker));
        assert!(
            matches!(answer, Poll::Ready(Err(oncedb::Error::Poisoned))),
            "{answer:?}"
        );
    }
    faulty.reset();
    let after = runtime.block_on(Store::insert_if_absent(&db, b"after"));
    assert!(matches!(after, Err(oncedb::Error::Poisoned)), "{after:?}");
}

/// A waiter never answers an ending before it is durable: with the completion's fsync
/// held, neither a wait nor a reserve answers the record completed (they wait for the
/// write they would rest on); once the fsync is let through, both do.
#[test]
fn a_waiter_never_answers_an_ending_before_it_is_durable() {
    let gate = SyncGate::writers();
    let db = sync_db_behind(&gate);
    let scope = oncedb::Scope::new("t", "durable-ending");
    let oncedb::Reservation::Acquired(lease) = db.reserve(&scope, b"k", b"req").unwrap() else {
        panic!("acquired");
    };
    db.flush().unwrap();
    gate.hold(1);
    std::thread::scope(|s| {
        // A failed assertion below lets the held fsync go, so the scope's threads end.
        let _release = gate.release_on_drop();
        let completing = s.spawn(|| lease.complete(b"done").unwrap());
        gate.await_held(1);
        let (told, answers) = std::sync::mpsc::channel();
        let waiting = {
            let (db, scope, told) = (db.clone(), scope.clone(), told.clone());
            s.spawn(move || {
                let record = db.wait_finished(&scope, b"k", Duration::from_secs(60));
                told.send(("wait", record.unwrap().unwrap().status()))
                    .unwrap();
            })
        };
        let reserving = {
            let (db, scope) = (db.clone(), scope.clone());
            s.spawn(move || {
                let status = match db.reserve(&scope, b"k", b"req").unwrap() {
                    oncedb::Reservation::Completed(record) => record.status(),
                    _ => oncedb::RecordStatus::InFlight,
                };
                told.send(("reserve", status)).unwrap();
            })
        };
        // While the fsync is held, nothing may answer "completed".
        if let Ok((who, status)) = answers.recv_timeout(Duration::from_millis(300)) {
            assert_ne!(
                status,
                oncedb::RecordStatus::Completed,
                "{who} answered an ending whose fsync is held"
            );
        }
        gate.release_all();
        completing.join().unwrap();
        waiting.join().unwrap();
        reserving.join().unwrap();
    });
    assert_eq!(
        db.get(&scope, b"k").unwrap().unwrap().status(),
        oncedb::RecordStatus::Completed
    );
}

/// `Store::run_once` renews its lease from a task of its own: an operation that blocks
/// its thread (synchronous I/O, heavy work) for four lease timeouts keeps its lease on a
/// multi-threaded runtime, and a caller reserving meanwhile is told it is in flight.
#[test]
fn an_operation_that_blocks_its_thread_keeps_its_lease() {
    use oncedb::Store;
    let timeout = Duration::from_millis(300);
    let db = Db::open(
        StoreOptions::new(Duration::from_secs(60))
            .lease_timeout(timeout)
            .embedded(Options::in_memory())
            .bucket_width(Duration::from_secs(6)),
    )
    .unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap();
    let scope = oncedb::Scope::new("t", "blocking");
    let (blocked, blocking) = std::sync::mpsc::channel();
    let (released, release) = std::sync::mpsc::channel::<()>();
    let running = {
        let (db, scope) = (db.clone(), scope.clone());
        runtime.spawn(async move {
            let how = oncedb::RunOnce::new();
            Store::run_once(&db, &scope, (b"k", b"req"), how, |_| async move {
                blocked.send(()).unwrap();
                // Blocks this worker thread (the workload under test), up to 10 s.
                let _ = release.recv_timeout(Duration::from_secs(10));
                Ok::<_, String>(b"done".to_vec())
            })
            .await
        })
    };
    blocking.recv().unwrap();
    // Four lease timeouts, looking every ~timeout/2: never taken over.
    let started = std::time::Instant::now();
    while started.elapsed() < timeout * 4 {
        let answer = runtime
            .block_on(Store::reserve(&db, &scope, b"k", b"req"))
            .unwrap();
        assert!(
            matches!(answer, oncedb::Reservation::InFlight { .. }),
            "a blocked operation's lease lapsed"
        );
        std::thread::sleep(timeout / 2);
    }
    released.send(()).unwrap();
    let ran = runtime.block_on(running).unwrap().unwrap();
    assert!(matches!(ran, oncedb::Once::Ran(_)));
}
