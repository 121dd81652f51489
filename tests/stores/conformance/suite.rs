//! The one conformance suite of the `Store` trait, run against every implementation by
//! `conformance`: the embedded `Db`, PostgreSQL, one Redis server and a three-primary
//! Redis Cluster, and `store` on a durable `Db` on a current-thread runtime. Each check uses keys of its own,
//! so checks share a store.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use oncedb::io::SplitMix64;
use oncedb::{
    Advance, Error, MAX_KEY_BYTES_LIMIT, MAX_NOTE_BYTES, MAX_SCOPE_PART_BYTES, OnError, Once,
    RecordStatus, Reservation, RunOnce, Scope, Store, StoreLease, StoreOptions,
};

/// How a suite run gets stores and lets time pass.
pub trait Harness {
    /// The store under test.
    type S: Store + Clone;

    /// A store built with `options` (window, limits, lease timeout).
    fn store_with(&self, options: StoreOptions) -> impl Future<Output = Self::S>;

    /// A store remembering for `window`, every other option at its default.
    fn store(&self, window: Duration) -> impl Future<Output = Self::S> {
        self.store_with(StoreOptions::new(window))
    }

    /// Lets at least `window` pass for `store` (a real wait, or a manual clock).
    fn pass(&self, store: &Self::S, window: Duration) -> impl Future<Output = ()>;

    /// Lets most of `window` pass for `store`, so that what was written just before is
    /// close to its end but not past it: a manual clock goes to 1 ms before the end; a
    /// real wait lasts three quarters of the window, and the checks that follow count
    /// only if they finish before the window ends.
    fn approach(&self, store: &Self::S, window: Duration) -> impl Future<Output = ()>;
}

/// Every check, in order.
pub async fn run<H: Harness>(harness: &H) {
    let store = harness.store(Duration::from_secs(600)).await;
    keys(&store).await;
    lifecycle(&store).await;
    scopes(&store).await;
    mismatch(&store).await;
    replay_is_byte_exact(&store).await;
    in_flight(&store).await;
    fencing(&store).await;
    fencing_is_exact(&store).await;
    release(&store).await;
    limits(&store).await;
    ordering_guard(&store).await;
    races(&store).await;
    window(harness).await;
    lease_timeout(harness).await;
    run_once_endings(harness).await;
    silent_holder(harness).await;
    keep_alive(harness).await;
    waiting(&store).await;
    run_once(&store).await;
    run_once_errors(&store).await;
    longest_keys(harness).await;
    let options =
        StoreOptions::new(Duration::from_secs(60)).lease_timeout(Duration::from_millis(200));
    check_once(harness.store_with(options).await, "suite", 6).await;
}

/// The property test of "once" (`once.rs`) on `store`, whose lease timeout is set, for
/// `batches` batches; the seed is printed, and `ONCEDB_FAULT_SEED` replays it.
pub async fn check_once<S: Store + Clone>(store: S, name: &str, batches: u64) {
    let seed = oncedb_testkit::schedule::random_seed();
    eprintln!(
        "once property ({name}): seed {seed} (replay with {}={seed})",
        oncedb_testkit::schedule::SEED_VARIABLE
    );
    let scope = Scope::new("t", format!("once-{name}-{seed}"));
    let report = super::once::property(store, &scope, seed, batches).await;
    eprintln!(
        "once property ({name}) {seed}: {} callers answered, {} keys acted on; faults: {}",
        report.seen,
        report.keys,
        report.fault_list.join(", ")
    );
    assert!(report.keys > 0, "seed {seed}: no operation acted");
    assert!(
        report.shortfalls.is_empty(),
        "seed {seed}:\n{}",
        report.shortfalls.join("\n")
    );
}

fn acquired<L>(answer: Reservation<L>) -> L {
    match answer {
        Reservation::Acquired(lease) => lease,
        other => panic!("expected Acquired, got {}", describe(&other)),
    }
}

fn describe<L>(answer: &Reservation<L>) -> &'static str {
    match answer {
        Reservation::Acquired(_) => "Acquired",
        Reservation::InFlight { .. } => "InFlight",
        Reservation::Completed(_) => "Completed",
        Reservation::Failed(_) => "Failed",
        Reservation::Expired(_) => "Expired",
        Reservation::Mismatch => "Mismatch",
    }
}

/// Create-if-absent, single and batched, with duplicates inside a batch.
async fn keys<S: Store>(store: &S) {
    assert!(store.insert_if_absent(b"keys/1").await.unwrap());
    assert!(!store.insert_if_absent(b"keys/1").await.unwrap());
    let batch = vec![
        b"keys/1".to_vec(),
        b"keys/2".to_vec(),
        b"keys/3".to_vec(),
        b"keys/2".to_vec(),
    ];
    assert_eq!(
        store.insert_many(batch.clone()).await.unwrap(),
        vec![false, true, true, false]
    );
    assert_eq!(
        store.insert_many(batch).await.unwrap(),
        vec![false, false, false, false]
    );
    assert!(matches!(
        store.insert_if_absent(b"").await,
        Err(Error::EmptyKey)
    ));
    // A refused batch admits nothing.
    assert!(
        store
            .insert_many(vec![b"keys/4".to_vec(), Vec::new()])
            .await
            .is_err()
    );
    assert!(store.insert_if_absent(b"keys/4").await.unwrap());
}

/// One service's life: reserve, note, retry in flight, take over, complete, replay.
pub async fn lifecycle<S: Store>(store: &S) {
    let scope = Scope::new("org_123", "create_payment");
    let lease = acquired(store.reserve(&scope, b"life", b"req").await.unwrap());
    lease.note(b"provider_outcome_unknown").await.unwrap();
    assert!(matches!(
        store.reserve(&scope, b"life", b"req").await.unwrap(),
        Reservation::InFlight { .. }
    ));
    let record = store.get(&scope, b"life").await.unwrap().unwrap();
    assert_eq!(record.status(), RecordStatus::InFlight);
    assert_eq!(record.response(), None);
    lease.complete(b"done").await.unwrap();
    let Reservation::Completed(record) = store.reserve(&scope, b"life", b"req").await.unwrap()
    else {
        panic!("a retry after completion replays");
    };
    assert_eq!(record.response(), Some(&b"done"[..]));
    let failing = acquired(store.reserve(&scope, b"life/f", b"req").await.unwrap());
    failing.fail(b"declined").await.unwrap();
    let Reservation::Failed(record) = store.reserve(&scope, b"life/f", b"req").await.unwrap()
    else {
        panic!("a retry after a failure replays it");
    };
    assert_eq!(record.response(), Some(&b"declined"[..]));
    assert_eq!(record.status(), RecordStatus::Failed);
}

/// The same key in another tenant or operation is another record.
async fn scopes<S: Store>(store: &S) {
    let a = Scope::new("tenant_a", "op");
    let b = Scope::new("tenant_b", "op");
    let c = Scope::new("tenant_a", "other_op");
    let lease = acquired(store.reserve(&a, b"scoped", b"req").await.unwrap());
    let other_tenant = acquired(store.reserve(&b, b"scoped", b"req").await.unwrap());
    let other_operation = acquired(store.reserve(&c, b"scoped", b"req").await.unwrap());
    lease.complete(b"a").await.unwrap();
    other_tenant.complete(b"b").await.unwrap();
    other_operation.release().await.unwrap();
    assert_eq!(
        store.get(&a, b"scoped").await.unwrap().unwrap().response(),
        Some(&b"a"[..])
    );
    assert_eq!(
        store.get(&b, b"scoped").await.unwrap().unwrap().response(),
        Some(&b"b"[..])
    );
    assert!(store.get(&c, b"scoped").await.unwrap().is_none());
}

/// A key reused with another request is refused, in flight and after completion.
async fn mismatch<S: Store>(store: &S) {
    let scope = Scope::new("t", "mismatch");
    let lease = acquired(store.reserve(&scope, b"k", b"amount=5").await.unwrap());
    assert!(matches!(
        store.reserve(&scope, b"k", b"amount=6").await.unwrap(),
        Reservation::Mismatch
    ));
    lease.complete(b"ok").await.unwrap();
    assert!(matches!(
        store.reserve(&scope, b"k", b"amount=6").await.unwrap(),
        Reservation::Mismatch
    ));
    // The mismatch changed nothing.
    assert!(matches!(
        store.reserve(&scope, b"k", b"amount=5").await.unwrap(),
        Reservation::Completed(_)
    ));
}

/// Stored responses come back byte for byte: every byte value, an empty body and a large
/// one.
async fn replay_is_byte_exact<S: Store>(store: &S) {
    let scope = Scope::new("t", "replay");
    let every_byte: Vec<u8> = (0..=255u8).cycle().take(70_000).collect();
    for (key, response) in [
        (&b"bytes"[..], every_byte.as_slice()),
        (b"empty", b""),
        (b"nul", b"\0\0\xff\0"),
    ] {
        let lease = acquired(store.reserve(&scope, key, b"req").await.unwrap());
        lease.complete(response).await.unwrap();
        let Reservation::Completed(record) = store.reserve(&scope, key, b"req").await.unwrap()
        else {
            panic!("replay");
        };
        assert_eq!(record.response(), Some(response));
        let got = store.get(&scope, key).await.unwrap().unwrap();
        assert_eq!(got.response(), Some(response));
        assert!(got.finished_at().is_some());
    }
}

/// Records in flight are listed with their note; finished ones are not.
async fn in_flight<S: Store>(store: &S) {
    let scope = Scope::new("t", "in_flight");
    let lease = acquired(store.reserve(&scope, b"stuck", b"req").await.unwrap());
    // A retry sees the attempt in flight, and its note once it has one.
    let Reservation::InFlight { note, .. } = store.reserve(&scope, b"stuck", b"req").await.unwrap()
    else {
        panic!("a retry of a record in flight gets InFlight");
    };
    assert_eq!(note, None);
    lease.note(b"charged? unknown").await.unwrap();
    let Reservation::InFlight { note, .. } = store.reserve(&scope, b"stuck", b"req").await.unwrap()
    else {
        panic!("a retry of a record in flight gets InFlight");
    };
    assert_eq!(note.as_deref(), Some(&b"charged? unknown"[..]));
    let done = acquired(store.reserve(&scope, b"done", b"req").await.unwrap());
    done.complete(b"ok").await.unwrap();
    let listed = store.in_flight(Duration::ZERO).await.unwrap();
    let mine: Vec<_> = listed.iter().filter(|r| r.scope == scope).collect();
    assert_eq!(mine.len(), 1, "only the record in flight is listed");
    let stuck = mine.first().unwrap();
    assert_eq!(stuck.key, b"stuck");
    assert_eq!(stuck.epoch, lease.epoch());
    assert_eq!(stuck.note.as_deref(), Some(&b"charged? unknown"[..]));
    // Nothing has been in flight for an hour.
    assert!(
        store
            .in_flight(Duration::from_secs(3600))
            .await
            .unwrap()
            .iter()
            .all(|r| r.scope != scope)
    );
    lease.release().await.unwrap();
}

/// A take-over fences the old lease: its calls fail with `Fenced` and change nothing.
async fn fencing<S: Store>(store: &S) {
    let scope = Scope::new("t", "fencing");
    let old = acquired(store.reserve(&scope, b"k", b"req").await.unwrap());
    let new = store.take_over(&scope, b"k").await.unwrap().unwrap();
    assert!(new.epoch() > old.epoch());
    assert!(matches!(old.note(b"late").await, Err(Error::Fenced)));
    let newest = store.take_over(&scope, b"k").await.unwrap().unwrap();
    assert!(newest.epoch() > new.epoch());
    assert!(matches!(new.complete(b"stale").await, Err(Error::Fenced)));
    assert!(matches!(old.release().await, Err(Error::Fenced)));
    assert_eq!(
        store.get(&scope, b"k").await.unwrap().unwrap().status(),
        RecordStatus::InFlight
    );
    newest.complete(b"fresh").await.unwrap();
    assert_eq!(
        store.get(&scope, b"k").await.unwrap().unwrap().response(),
        Some(&b"fresh"[..])
    );
    // Only records in flight can be taken over.
    assert!(store.take_over(&scope, b"k").await.unwrap().is_none());
    assert!(store.take_over(&scope, b"absent").await.unwrap().is_none());
}

/// Only the epochs a take-over replaced are `Fenced`: another key's epoch, or one never
/// granted, is `LeaseLost`, and the current epoch resumes.
async fn fencing_is_exact<S: Store>(store: &S) {
    let scope = Scope::new("t", "exact-fencing");
    let first = acquired(store.reserve(&scope, b"k2", b"req").await.unwrap()).epoch();
    let other = acquired(store.reserve(&scope, b"k1", b"req").await.unwrap()).epoch();
    let taken = store.take_over(&scope, b"k2").await.unwrap().unwrap();
    let taken = taken.epoch();
    assert!(first < taken && other < taken, "{first}, {other} < {taken}");
    assert!(matches!(
        store.resume(&scope, b"k2", other).await,
        Err(Error::LeaseLost)
    ));
    assert!(matches!(
        store.resume(&scope, b"k2", first).await,
        Err(Error::Fenced)
    ));
    assert!(matches!(
        store.resume(&scope, b"k2", taken + 1).await,
        Err(Error::LeaseLost)
    ));
    assert!(matches!(
        store.resume(&scope, b"absent", first).await,
        Err(Error::LeaseLost)
    ));
    let resumed = store.resume(&scope, b"k2", taken).await.unwrap();
    assert_eq!(resumed.epoch(), taken);
    resumed.complete(b"ok").await.unwrap();
    // Finished: no epoch resumes it any more.
    assert!(matches!(
        store.resume(&scope, b"k2", taken).await,
        Err(Error::LeaseLost)
    ));
    let k1 = store.resume(&scope, b"k1", other).await.unwrap();
    k1.complete(b"ok").await.unwrap();
}

/// Every store refuses what the embedded store refuses, with the same error and before
/// writing anything: an empty or over-long key, a response or note over its limit. A
/// refused lease call leaves the lease usable.
async fn limits<S: Store>(store: &S) {
    let scope = Scope::new("t", "limits");
    let long = vec![b'k'; 1025];
    assert!(matches!(
        store.insert_if_absent(&long).await,
        Err(Error::KeyTooLong { len: 1025, .. })
    ));
    assert!(matches!(
        store.insert_if_absent(b"").await,
        Err(Error::EmptyKey)
    ));
    assert!(matches!(
        store
            .insert_many(vec![b"fine".to_vec(), long.clone()])
            .await,
        Err(Error::KeyTooLong { .. })
    ));
    // The refused batch admitted nothing, not even its valid key.
    assert!(store.insert_if_absent(b"fine").await.unwrap());
    assert!(matches!(
        store.reserve(&scope, &long, b"req").await,
        Err(Error::KeyTooLong { .. })
    ));
    let max = store.max_response_bytes();
    assert_eq!(max, 1024 * 1024, "the embedded default on every store");
    let lease = acquired(store.reserve(&scope, b"k", b"req").await.unwrap());
    let epoch = lease.epoch();
    let large = vec![7u8; max + 1];
    assert!(matches!(
        lease.complete(&large).await,
        Err(Error::ResponseTooLarge { len, max: limit }) if len == max + 1 && limit == max
    ));
    let lease = store.resume(&scope, b"k", epoch).await.unwrap();
    assert!(matches!(
        lease.fail(&large).await,
        Err(Error::ResponseTooLarge { .. })
    ));
    let lease = store.resume(&scope, b"k", epoch).await.unwrap();
    assert!(matches!(
        lease.note(&vec![b'n'; MAX_NOTE_BYTES + 1]).await,
        Err(Error::NoteTooLong { len }) if len == MAX_NOTE_BYTES + 1
    ));
    let record = store.get(&scope, b"k").await.unwrap().unwrap();
    assert_eq!(record.status(), RecordStatus::InFlight);
    assert_eq!(record.response(), None);
    // Exactly the limit is accepted and replayed whole.
    let exact = vec![8u8; max];
    lease.complete(&exact).await.unwrap();
    let Reservation::Completed(record) = store.reserve(&scope, b"k", b"req").await.unwrap() else {
        panic!("the completion replays");
    };
    assert_eq!(record.response(), Some(&exact[..]));
}

/// A released key can be reserved again; the released lease is spent.
async fn release<S: Store>(store: &S) {
    let scope = Scope::new("t", "release");
    let first = acquired(store.reserve(&scope, b"k", b"req").await.unwrap());
    let first_epoch = first.epoch();
    first.release().await.unwrap();
    assert!(store.get(&scope, b"k").await.unwrap().is_none());
    let second = acquired(store.reserve(&scope, b"k", b"other request").await.unwrap());
    assert!(second.epoch() > first_epoch);
    second.complete(b"second").await.unwrap();
}

/// The ordering guard: next applies, equal is a duplicate, older is stale, a skip is a gap.
async fn ordering_guard<S: Store>(store: &S) {
    let scope = Scope::new("t", "orders");
    assert_eq!(
        store.advance(&scope, b"a", 1).await.unwrap(),
        Advance::Applied
    );
    assert_eq!(
        store.advance(&scope, b"a", 1).await.unwrap(),
        Advance::Duplicate
    );
    assert_eq!(
        store.advance(&scope, b"a", 3).await.unwrap(),
        Advance::Gap { expected: 2 }
    );
    assert_eq!(
        store.advance(&scope, b"a", 2).await.unwrap(),
        Advance::Applied
    );
    assert_eq!(
        store.advance(&scope, b"a", 1).await.unwrap(),
        Advance::Stale { current: 2 }
    );
    assert_eq!(
        store.advance(&scope, b"a", 3).await.unwrap(),
        Advance::Applied
    );
    // Aggregates and scopes are independent.
    assert_eq!(
        store.advance(&scope, b"b", 7).await.unwrap(),
        Advance::Applied
    );
    let other = Scope::new("t2", "orders");
    assert_eq!(
        store.advance(&other, b"a", 1).await.unwrap(),
        Advance::Applied
    );
}

/// Sixteen tasks per key race to reserve and to insert: exactly one wins each key.
async fn races<S: Store + Clone>(store: &S) {
    const TASKS: usize = 16;
    let scope = Arc::new(Scope::new("t", "races"));
    for round in 0..8u32 {
        let key = format!("race/{round}").into_bytes();
        let mut tasks = Vec::new();
        for _ in 0..TASKS {
            let (store, scope, key) = (store.clone(), Arc::clone(&scope), key.clone());
            tasks.push(tokio::spawn(async move {
                let reserved = store.reserve(&scope, &key, b"req").await.unwrap();
                let inserted = store.insert_if_absent(&key).await.unwrap();
                (reserved, inserted)
            }));
        }
        let (mut leases, mut inserted, mut in_flight) = (Vec::new(), 0, 0);
        for task in tasks {
            let (reserved, new) = task.await.unwrap();
            inserted += usize::from(new);
            match reserved {
                Reservation::Acquired(lease) => leases.push(lease),
                Reservation::InFlight { .. } => in_flight += 1,
                other => panic!("a racing reservation got {}", describe(&other)),
            }
        }
        assert_eq!(leases.len(), 1, "round {round}: one reservation wins");
        assert_eq!(in_flight, TASKS - 1);
        assert_eq!(inserted, 1, "round {round}: one insert wins");
        leases.pop().unwrap().complete(b"winner").await.unwrap();
    }
}

/// Keys, records and ordering marks are forgotten once the window has passed, and not
/// before.
async fn window<H: Harness>(harness: &H) {
    let window = Duration::from_millis(1500);
    let store = harness.store(window).await;
    let scope = Scope::new("t", "window");
    let start = Instant::now();
    assert!(store.insert_if_absent(b"w/key").await.unwrap());
    let lease = acquired(store.reserve(&scope, b"w/rec", b"req").await.unwrap());
    lease.complete(b"first").await.unwrap();
    assert_eq!(
        store.advance(&scope, b"w/agg", 5).await.unwrap(),
        Advance::Applied
    );
    let stuck = acquired(store.reserve(&scope, b"w/stuck", b"req").await.unwrap());
    let refused = !store.insert_if_absent(b"w/key").await.unwrap();
    assert!(
        refused || start.elapsed() >= window,
        "a key is remembered inside its window"
    );
    // Just before the end of the window, everything is still there.
    harness.approach(&store, window).await;
    // Each answer counts if it came before the end of the window (a real clock may get
    // there first on a slow machine).
    let in_time = || start.elapsed() < window;
    let key_refused = !store.insert_if_absent(b"w/key").await.unwrap();
    assert!(
        key_refused || !in_time(),
        "a key is remembered to the end of its window"
    );
    let record = store.get(&scope, b"w/rec").await.unwrap();
    if in_time() {
        let record = record.expect("a record is kept until the end of its window");
        assert_eq!(record.status(), RecordStatus::Completed);
        assert_eq!(record.response(), Some(&b"first"[..]));
    }
    let stuck_record = store.get(&scope, b"w/stuck").await.unwrap();
    if in_time() {
        let stuck_record = stuck_record.expect("a record in flight is kept to the end");
        assert_eq!(stuck_record.status(), RecordStatus::InFlight);
    }
    let duplicate = store.advance(&scope, b"w/agg", 5).await.unwrap();
    assert!(
        duplicate == Advance::Duplicate || !in_time(),
        "an ordering mark is kept to the end of its window"
    );
    let stale = store.advance(&scope, b"w/agg", 4).await.unwrap();
    assert!(stale == Advance::Stale { current: 5 } || !in_time());
    let gap = store.advance(&scope, b"w/agg", 7).await.unwrap();
    assert!(gap == Advance::Gap { expected: 6 } || !in_time());
    let replay = store.reserve(&scope, b"w/rec", b"req").await.unwrap();
    if in_time() {
        let Reservation::Completed(replayed) = replay else {
            panic!("a completed record replays until the end of its window");
        };
        assert_eq!(replayed.response(), Some(&b"first"[..]));
    }
    let retry = store.reserve(&scope, b"w/stuck", b"req").await.unwrap();
    assert!(matches!(retry, Reservation::InFlight { .. }) || !in_time());
    harness.pass(&store, window).await;
    assert!(store.insert_if_absent(b"w/key").await.unwrap());
    assert!(store.get(&scope, b"w/rec").await.unwrap().is_none());
    assert!(store.get(&scope, b"w/stuck").await.unwrap().is_none());
    // The expired lease is lost, and a new reservation acquires the key.
    assert!(matches!(stuck.note(b"late").await, Err(Error::LeaseLost)));
    let fresh = acquired(store.reserve(&scope, b"w/stuck", b"req").await.unwrap());
    assert!(fresh.epoch() > stuck.epoch());
    fresh.release().await.unwrap();
    let again = acquired(
        store
            .reserve(&scope, b"w/rec", b"another request")
            .await
            .unwrap(),
    );
    again.complete(b"second").await.unwrap();
    // The aggregate's old version is forgotten: any version applies.
    assert_eq!(
        store.advance(&scope, b"w/agg", 2).await.unwrap(),
        Advance::Applied
    );
}

/// `StoreOptions::lease_timeout`: a reserve that finds a record in flight under a lease
/// granted at least the timeout ago takes it over (a higher epoch, the old lease fenced);
/// before that it answers `InFlight`. A note does not reset the timeout.
async fn lease_timeout<H: Harness>(harness: &H) {
    let timeout = Duration::from_millis(600);
    let options = StoreOptions::new(Duration::from_secs(60)).lease_timeout(timeout);
    let store = harness.store_with(options).await;
    let scope = Scope::new("t", "lease-timeout");
    let first = acquired(store.reserve(&scope, b"k", b"req").await.unwrap());
    assert!(matches!(
        store.reserve(&scope, b"k", b"req").await.unwrap(),
        Reservation::InFlight { .. }
    ));
    harness.pass(&store, timeout).await;
    let second = acquired(store.reserve(&scope, b"k", b"req").await.unwrap());
    assert!(second.epoch() > first.epoch());
    assert!(matches!(first.complete(b"late").await, Err(Error::Fenced)));
    second.complete(b"done").await.unwrap();
    assert!(matches!(
        store.reserve(&scope, b"k", b"req").await.unwrap(),
        Reservation::Completed(_)
    ));
    // A noted record (an outcome unknown) is never taken over automatically: past the
    // timeout a reserve still answers in flight, with the note. A reconciler's
    // explicit take-over gets it.
    let noted = acquired(store.reserve(&scope, b"noted", b"req").await.unwrap());
    noted.note(b"provider timed out").await.unwrap();
    harness.pass(&store, timeout).await;
    match store.reserve(&scope, b"noted", b"req").await.unwrap() {
        Reservation::InFlight { note, .. } => {
            assert_eq!(note.as_deref(), Some(&b"provider timed out"[..]));
        }
        other => panic!("a noted record answered {}", describe(&other)),
    }
    let taker = store.take_over(&scope, b"noted").await.unwrap();
    let taker = taker.expect("a reconciler takes a noted record over");
    assert!(taker.epoch() > noted.epoch());
    assert!(matches!(noted.complete(b"late").await, Err(Error::Fenced)));
    taker.complete(b"done").await.unwrap();
}

/// Every ending of `run_once` is an ending: an output over the store's limit fails the
/// record with a text saying so (a retry replays it, the operation does not run
/// again); a call dropped while its operation runs, or whose operation panics, leaves
/// the record in flight with a note ("outcome unknown"), which no reserve takes over
/// after the lease timeout.
async fn run_once_endings<H: Harness>(harness: &H) {
    let timeout = Duration::from_millis(600);
    let options = StoreOptions::new(Duration::from_secs(60))
        .lease_timeout(timeout)
        .max_response_bytes(64);
    let store = harness.store_with(options).await;
    let scope = Scope::new("t", "run-once-endings");
    let runs = std::sync::atomic::AtomicUsize::new(0);
    let large = || {
        store.run_once(&scope, (b"large", b"req"), RunOnce::new(), |_| async {
            runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok::<_, String>(vec![7; 65])
        })
    };
    assert!(matches!(
        large().await,
        Err(Error::ResponseTooLarge { len: 65, max: 64 })
    ));
    let Once::Replayed(record) = large().await.unwrap() else {
        panic!("an output over the limit is run again");
    };
    assert_eq!(record.status(), RecordStatus::Failed);
    assert!(
        record
            .response()
            .unwrap()
            .starts_with(b"the output of 65 bytes")
    );
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    // A failure text over the limit is cut to it.
    let long_failure = store.run_once(
        &scope,
        (b"long-failure", b"req"),
        RunOnce::new().on_error(OnError::Fail),
        |_| async { Err::<Vec<u8>, _>("x".repeat(100)) },
    );
    assert!(matches!(long_failure.await.unwrap(), Once::Errored(_)));
    let record = store.get(&scope, b"long-failure").await.unwrap().unwrap();
    assert_eq!(record.response(), Some(&[b'x'; 64][..]));
    // Cancelled while the operation runs.
    let cancelled = tokio::time::timeout(
        Duration::from_millis(50),
        store.run_once(&scope, (b"cancelled", b"req"), RunOnce::new(), |_| {
            std::future::pending::<std::result::Result<Vec<u8>, String>>()
        }),
    );
    assert!(cancelled.await.is_err());
    unfinished_stays(harness, &store, &scope, b"cancelled", b"cancelled").await;
    // Panicked while the operation runs.
    let panicked = {
        let (store, scope) = (store.clone(), scope.clone());
        tokio::spawn(async move {
            store
                .run_once(&scope, (b"panicked", b"req"), RunOnce::new(), |_| async {
                    panic!("the operation panics");
                    #[expect(unreachable_code, reason = "the closure's output type")]
                    Ok::<Vec<u8>, String>(Vec::new())
                })
                .await
        })
    };
    assert!(panicked.await.unwrap_err().is_panic());
    unfinished_stays(harness, &store, &scope, b"panicked", b"panicked").await;
}

/// A caller of `run_once` waiting on a record whose holder went silent (its lease
/// dropped, neither ended nor noted) takes it over once the lease runs out, long before
/// its own 60 s wait ends: the wait looks again when the holder's lease runs out.
async fn silent_holder<H: Harness>(harness: &H) {
    let timeout = Duration::from_millis(600);
    let options = StoreOptions::new(Duration::from_secs(60)).lease_timeout(timeout);
    let store = harness.store_with(options).await;
    let scope = Scope::new("t", "silent-holder");
    drop(acquired(store.reserve(&scope, b"k", b"req").await.unwrap()));
    let waiter = {
        let (store, scope) = (store.clone(), scope.clone());
        tokio::spawn(async move {
            let how = RunOnce::new().wait(Duration::from_secs(60));
            store
                .run_once(&scope, (b"k", b"req"), how, |_| async {
                    Ok::<_, String>(b"taken over".to_vec())
                })
                .await
        })
    };
    harness.pass(&store, timeout).await;
    let ran = tokio::time::timeout(Duration::from_secs(30), waiter).await;
    let ran = ran.expect("the waiter took the record over when the lease ran out");
    assert!(matches!(ran.unwrap(), Ok(Once::Ran(_))));
}

/// Waits until the record of `key` carries the note of an unfinished operation (noted by
/// a task of its own), then checks that it is not taken over past the lease timeout.
async fn unfinished_stays<H: Harness>(
    harness: &H,
    store: &H::S,
    scope: &Scope,
    key: &[u8],
    word: &[u8],
) {
    let deadline = Instant::now() + Duration::from_secs(30);
    let note = loop {
        let listed = store.in_flight(Duration::ZERO).await.unwrap();
        let note = listed
            .into_iter()
            .find(|record| record.scope == *scope && record.key == key)
            .and_then(|record| record.note);
        if let Some(note) = note {
            break note;
        }
        assert!(
            Instant::now() < deadline,
            "no note on an unfinished operation"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert!(
        note.windows(word.len()).any(|part| part == word) && note.ends_with(b"outcome unknown"),
        "{}",
        String::from_utf8_lossy(&note)
    );
    harness.pass(store, Duration::from_millis(600)).await;
    let answer = store.reserve(scope, key, b"req").await.unwrap();
    assert!(
        matches!(answer, Reservation::InFlight { .. }),
        "an unfinished operation's record answered {}",
        describe(&answer)
    );
}

/// `StoreLease::keep_alive`: a lease renewed before its timeout is not taken over
/// although more than the timeout passed since its grant; once its holder stops
/// renewing, it is taken over after the timeout, and the old holder's next renewal is
/// fenced.
async fn keep_alive<H: Harness>(harness: &H) {
    let timeout = Duration::from_millis(600);
    let options = StoreOptions::new(Duration::from_secs(60)).lease_timeout(timeout);
    let store = harness.store_with(options).await;
    assert_eq!(store.lease_timeout(), Some(timeout));
    let scope = Scope::new("t", "keep-alive");
    let held = acquired(store.reserve(&scope, b"k", b"req").await.unwrap());
    harness.approach(&store, timeout).await;
    held.keep_alive().await.unwrap();
    harness.approach(&store, timeout).await;
    // Past the timeout since the grant, within it since the renewal.
    let Reservation::InFlight { .. } = store.reserve(&scope, b"k", b"req").await.unwrap() else {
        panic!("a renewed lease was taken over");
    };
    held.keep_alive().await.unwrap();
    harness.pass(&store, timeout).await;
    let taker = acquired(store.reserve(&scope, b"k", b"req").await.unwrap());
    assert!(taker.epoch() > held.epoch());
    assert!(matches!(held.keep_alive().await, Err(Error::Fenced)));
    taker.complete(b"done").await.unwrap();
    assert!(matches!(
        renewing_an_ended_lease(&store, &scope).await,
        Err(Error::LeaseLost)
    ));
}

/// A renewal of a lease whose record was completed: `LeaseLost`.
async fn renewing_an_ended_lease<S: Store>(store: &S, scope: &Scope) -> oncedb::Result<()> {
    let lease = acquired(store.reserve(scope, b"k-ended", b"req").await.unwrap());
    let again = store
        .resume(scope, b"k-ended", lease.epoch())
        .await
        .unwrap();
    lease.complete(b"done").await.unwrap();
    again.keep_alive().await
}

/// `Store::wait_finished`: a waiter returns with the outcome once the attempt in flight
/// completes (long before its deadline), with `None` once it is released, and with the
/// record still in flight when its deadline passes first.
async fn waiting<S: Store + Clone>(store: &S) {
    let scope = Arc::new(Scope::new("t", "waiting"));
    for (n, release) in [(0, false), (1, true)] {
        let key = format!("wait/{n}").into_bytes();
        let lease = acquired(store.reserve(&scope, &key, b"req").await.unwrap());
        let (waiting, started) = tokio::sync::oneshot::channel();
        let waiter = {
            let (store, scope, key) = (store.clone(), Arc::clone(&scope), key.clone());
            tokio::spawn(async move {
                // A first, short wait ends at its deadline: the waiter is set up (a
                // listening connection open, where the store has one) before the
                // ending, and the record was in flight.
                let first = store.wait_finished(&scope, &key, Duration::from_millis(100));
                let first = first.await.unwrap().unwrap();
                assert_eq!(first.status(), RecordStatus::InFlight);
                let _ = waiting.send(());
                let record = store
                    .wait_finished(&scope, &key, Duration::from_secs(30))
                    .await;
                (record, Instant::now())
            })
        };
        started.await.unwrap();
        tokio::task::yield_now().await;
        let ended_at = Instant::now();
        if release {
            lease.release().await.unwrap();
        } else {
            lease.complete(b"the outcome").await.unwrap();
        }
        let (record, woken_at) = waiter.await.unwrap();
        let record = record.unwrap();
        if release {
            assert!(record.is_none(), "a released record is gone");
        } else {
            let record = record.expect("the completed record");
            assert_eq!(record.status(), RecordStatus::Completed);
            assert_eq!(record.response(), Some(&b"the outcome"[..]));
        }
        // Woken by the ending, not by the 30 s deadline.
        let waited = woken_at.saturating_duration_since(ended_at);
        assert!(
            waited < Duration::from_secs(5),
            "woken {waited:?} after the ending"
        );
    }
    // Nothing ends: the deadline answers, with the record still in flight.
    let lease = acquired(store.reserve(&scope, b"wait/held", b"req").await.unwrap());
    let started = Instant::now();
    let record = store
        .wait_finished(&scope, b"wait/held", Duration::from_millis(300))
        .await
        .unwrap()
        .unwrap();
    assert!(started.elapsed() >= Duration::from_millis(300));
    assert_eq!(record.status(), RecordStatus::InFlight);
    lease.complete(b"late").await.unwrap();
    // A record that is not in flight answers at once, and so does a missing one.
    let record = store.wait_finished(&scope, b"wait/held", Duration::from_secs(30));
    let record = record.await.unwrap().unwrap();
    assert_eq!(record.response(), Some(&b"late"[..]));
    let missing = store.wait_finished(&scope, b"wait/none", Duration::from_secs(30));
    assert!(missing.await.unwrap().is_none());
}

/// `Store::run_once`: sixteen concurrent callers of one key run the operation once; the
/// one that ran it gets `Ran`, the fifteen that waited for it get its output replayed.
async fn run_once<S: Store + Clone>(store: &S) {
    const CALLERS: usize = 16;
    let scope = Arc::new(Scope::new("t", "run-once"));
    let runs = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let gate = Arc::new(tokio::sync::Semaphore::new(0));
    let (entered, mut running) = tokio::sync::mpsc::unbounded_channel::<()>();
    let mut callers = Vec::new();
    for _ in 0..CALLERS {
        let (store, scope, runs, gate, entered) = (
            store.clone(),
            Arc::clone(&scope),
            Arc::clone(&runs),
            Arc::clone(&gate),
            entered.clone(),
        );
        callers.push(tokio::spawn(async move {
            let how = RunOnce::new().wait(Duration::from_secs(60));
            store
                .run_once(&scope, (b"once", b"req"), how, |_epoch| async move {
                    runs.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                    let _ = entered.send(());
                    // Held until every caller has started: the others wait meanwhile.
                    let _permit = gate.acquire().await.unwrap();
                    Ok::<_, String>(b"output".to_vec())
                })
                .await
                .unwrap()
        }));
    }
    running.recv().await.unwrap();
    let opened_at = Instant::now();
    gate.add_permits(CALLERS);
    let (mut ran, mut replayed) = (0, 0);
    for caller in callers {
        match caller.await.unwrap() {
            Once::Ran(output) => {
                assert_eq!(output, b"output");
                ran += 1;
            }
            Once::Replayed(record) => {
                assert_eq!(record.status(), RecordStatus::Completed);
                assert_eq!(record.response(), Some(&b"output"[..]));
                replayed += 1;
            }
            other => panic!("a caller got {other:?}"),
        }
    }
    assert_eq!((ran, replayed), (1, CALLERS - 1));
    assert_eq!(runs.load(std::sync::atomic::Ordering::SeqCst), 1);
    // The waiters were woken by the completion, not by their 60 s deadline.
    let took = opened_at.elapsed();
    assert!(took < Duration::from_secs(20), "the waiters took {took:?}");
}

/// `run_once` with an erring operation releases the record (a retry runs it again) or
/// stores the failure (a retry replays it), as asked; another request for the key is a
/// mismatch; an attempt in flight past the wait is `StillInFlight`.
async fn run_once_errors<S: Store>(store: &S) {
    let scope = Scope::new("t", "run-once-errors");
    let fails = |how: RunOnce| {
        store.run_once(&scope, (b"err", b"req"), how, |_| async {
            Err::<Vec<u8>, _>("card declined".to_owned())
        })
    };
    let released = fails(RunOnce::new().on_error(OnError::Release))
        .await
        .unwrap();
    assert!(matches!(released, Once::Errored(ref why) if why == "card declined"));
    assert!(store.get(&scope, b"err").await.unwrap().is_none());
    let stored = fails(RunOnce::new().on_error(OnError::Fail)).await.unwrap();
    assert!(matches!(stored, Once::Errored(_)));
    let Once::Replayed(record) = fails(RunOnce::new()).await.unwrap() else {
        panic!("a stored failure is replayed");
    };
    assert_eq!(record.status(), RecordStatus::Failed);
    assert_eq!(record.response(), Some(&b"card declined"[..]));
    let other = store
        .run_once(&scope, (b"err", b"another"), RunOnce::new(), |_| async {
            Ok::<_, String>(b"never".to_vec())
        })
        .await;
    assert!(matches!(other, Err(Error::RequestMismatch)));
    let held = acquired(store.reserve(&scope, b"held", b"req").await.unwrap());
    let busy = store
        .run_once(
            &scope,
            (b"held", b"req"),
            RunOnce::new().wait(Duration::from_millis(200)),
            |_| async { Ok::<_, String>(b"never".to_vec()) },
        )
        .await;
    assert!(matches!(busy, Err(Error::StillInFlight { .. })));
    held.complete(b"done").await.unwrap();
}

/// Bytes that no compression shrinks, from a seeded generator.
fn incompressible(len: usize, seed: u64) -> Vec<u8> {
    let mut rng = SplitMix64::new(seed);
    (0..len).map(|_| rng.next_u64().to_le_bytes()[0]).collect()
}

/// The longest keys the embedded store can be configured to accept work on every store:
/// tenant and operation of `MAX_SCOPE_PART_BYTES` and keys of `MAX_KEY_BYTES_LIMIT`,
/// incompressible, for keys, batches, records and ordering marks.
async fn longest_keys<H: Harness>(harness: &H) {
    let options = StoreOptions::new(Duration::from_secs(600)).max_key_bytes(MAX_KEY_BYTES_LIMIT);
    let store = harness.store_with(options).await;
    let scope = Scope::new(
        incompressible(MAX_SCOPE_PART_BYTES, 1),
        incompressible(MAX_SCOPE_PART_BYTES, 2),
    );
    let key = incompressible(MAX_KEY_BYTES_LIMIT, 3);
    let other = incompressible(MAX_KEY_BYTES_LIMIT, 4);
    assert!(store.insert_if_absent(&key).await.unwrap());
    assert!(!store.insert_if_absent(&key).await.unwrap());
    assert_eq!(
        store
            .insert_many(vec![key.clone(), other.clone()])
            .await
            .unwrap(),
        vec![false, true]
    );
    let lease = acquired(store.reserve(&scope, &key, b"req").await.unwrap());
    lease.note(b"running").await.unwrap();
    let stuck = store.in_flight(Duration::ZERO).await.unwrap();
    assert!(stuck.iter().any(|r| r.scope == scope && r.key == key));
    let lease = store.take_over(&scope, &key).await.unwrap().unwrap();
    lease.complete(b"done").await.unwrap();
    let Reservation::Completed(record) = store.reserve(&scope, &key, b"req").await.unwrap() else {
        panic!("a long key's record replays");
    };
    assert_eq!(record.response(), Some(&b"done"[..]));
    assert!(store.get(&scope, &other).await.unwrap().is_none());
    assert_eq!(
        store.advance(&scope, &key, 1).await.unwrap(),
        Advance::Applied
    );
    assert_eq!(
        store.advance(&scope, &key, 1).await.unwrap(),
        Advance::Duplicate
    );
    assert_eq!(
        store.advance(&scope, &other, 9).await.unwrap(),
        Advance::Applied
    );
}
