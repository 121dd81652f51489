//! The cost of the asynchronous `Store` interface over the embedded `Db`: a reserve and a
//! complete per iteration, through the synchronous API on the calling thread and through
//! `Store` on a tokio runtime, for an in-memory store and a durable `Sync` and `Interval`
//! store (each write on the calling task, awaiting its group commit); and an ordering-guard
//! advance per iteration, the same ways; and `run_once` (reserve, the operation, complete)
//! against the same reserve and complete written by hand, also on a store with a lease
//! timeout (where `run_once` renews its lease beside the operation).
//!
//! `cargo bench --bench store --features async`.

#![expect(clippy::unwrap_used, reason = "benchmark: a failure aborts the run")]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use criterion::{Criterion, criterion_group, criterion_main};
use oncedb::{
    Advance, Db, Durability, Once, Options, Reservation, RunOnce, Scope, Store, StoreLease,
};

fn stores() -> Vec<(&'static str, Db, tempfile::TempDir)> {
    let mut out = Vec::new();
    for (name, durability) in [
        ("memory", None),
        (
            "interval",
            Some(Durability::Interval(Duration::from_millis(10))),
        ),
        ("sync", Some(Durability::Sync)),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let options = match durability {
            None => Options::in_memory(),
            Some(durability) => Options::new(dir.path()).durability(durability),
        };
        out.push((name, Db::open(options).unwrap(), dir));
    }
    // With a lease timeout: `run_once` renews the lease beside the operation (a thread on
    // the synchronous API, a task on `Store`), the hand-written loop does not.
    let dir = tempfile::tempdir().unwrap();
    let leased = Options::in_memory().lease_timeout(Duration::from_secs(30));
    out.push(("memory_leased", Db::open(leased).unwrap(), dir));
    out
}

/// The runtime the `Store` calls run on: two worker threads, one a core.
fn two_workers() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        // Timers: `run_once` under a lease timeout renews on them.
        .enable_time()
        .build()
        .unwrap()
}

/// The call one iteration makes, on a fresh key each time.
#[derive(Clone, Copy)]
enum Call {
    /// A reserve and a complete.
    ReserveComplete,
    /// An ordering-guard advance of a fresh aggregate: applied and logged.
    Advance,
    /// `run_once` of an operation answering `response`: a reserve and a complete.
    RunOnce,
}

impl Call {
    fn sync_api(self, db: &Db, scope: &Scope, key: &[u8]) {
        match self {
            Call::ReserveComplete => {
                let Reservation::Acquired(lease) = db.reserve(scope, key, b"req").unwrap() else {
                    panic!("fresh key");
                };
                lease.complete(b"response").unwrap();
            }
            Call::Advance => assert_eq!(db.advance(scope, key, 1).unwrap(), Advance::Applied),
            Call::RunOnce => {
                let ran = db.run_once(scope, (key, b"req"), RunOnce::new(), |_, _| {
                    Ok::<_, String>(b"response".to_vec())
                });
                assert!(matches!(ran.unwrap(), Once::Ran(_)));
            }
        }
    }

    async fn store_trait(self, db: &Db, scope: &Scope, key: &[u8]) {
        match self {
            Call::ReserveComplete => {
                let Reservation::Acquired(lease) =
                    Store::reserve(db, scope, key, b"req").await.unwrap()
                else {
                    panic!("fresh key");
                };
                StoreLease::complete(lease, b"response").await.unwrap();
            }
            Call::Advance => {
                let advanced = Store::advance(db, scope, key, 1).await.unwrap();
                assert_eq!(advanced, Advance::Applied);
            }
            Call::RunOnce => {
                let ran = Store::run_once(db, scope, (key, b"req"), RunOnce::new(), |_| async {
                    Ok::<_, String>(b"response".to_vec())
                });
                assert!(matches!(ran.await.unwrap(), Once::Ran(_)));
            }
        }
    }
}

/// `call` per iteration on every store, through the synchronous API on the calling
/// thread and through `Store` on the runtime.
fn each_store(c: &mut Criterion, group_name: &str, call: Call) {
    let mut group = c.benchmark_group(group_name);
    group.sample_size(20);
    let (runtime, scope, next) = (two_workers(), Scope::new("org", "op"), AtomicU64::new(0));
    let fresh = || next.fetch_add(1, Ordering::Relaxed).to_le_bytes();
    for (name, db, _dir) in stores() {
        group.bench_function(format!("{name}/sync_api"), |b| {
            b.iter(|| call.sync_api(&db, &scope, &fresh()));
        });
        group.bench_function(format!("{name}/store_trait"), |b| {
            b.to_async(&runtime).iter(|| {
                let (key, db, scope) = (fresh(), &db, &scope);
                async move { call.store_trait(db, scope, &key).await }
            });
        });
    }
    group.finish();
}

fn reserve_complete(c: &mut Criterion) {
    each_store(c, "store_reserve_complete", Call::ReserveComplete);
}

fn advance(c: &mut Criterion) {
    each_store(c, "store_advance", Call::Advance);
}

/// `run_once` against `store_reserve_complete`, its hand-written equivalent.
fn run_once(c: &mut Criterion) {
    each_store(c, "store_run_once", Call::RunOnce);
}

/// 64 tasks, each admitting fresh keys one at a time through `Store` on a `Sync` store:
/// the time per admission, and (on stderr) the admissions each fsync covered. Against it:
/// `oncedb bench --threads 64 --batch 1 --durability sync` (64 threads on the
/// synchronous API) and one writer.
fn sync_writers(c: &mut Criterion) {
    const TASKS: u64 = 64;
    let mut group = c.benchmark_group("store_sync_writers");
    group.sample_size(10);
    group.throughput(criterion::Throughput::Elements(1));
    let runtime = two_workers();
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(Options::new(dir.path()).durability(Durability::Sync)).unwrap();
    let next = std::sync::Arc::new(AtomicU64::new(0));
    let before = db.stats();
    group.bench_function("store_trait_64_tasks", |b| {
        b.to_async(&runtime).iter_custom(|iters| {
            let (db, next) = (db.clone(), std::sync::Arc::clone(&next));
            async move {
                let started = std::time::Instant::now();
                let tasks: Vec<_> = (0..TASKS)
                    .map(|_| {
                        let (db, next) = (db.clone(), std::sync::Arc::clone(&next));
                        tokio::spawn(async move {
                            for _ in 0..iters.div_ceil(TASKS) {
                                let key = next.fetch_add(1, Ordering::Relaxed).to_le_bytes();
                                assert!(Store::insert_if_absent(&db, &key).await.unwrap());
                            }
                        })
                    })
                    .collect();
                for task in tasks {
                    task.await.unwrap();
                }
                started.elapsed()
            }
        });
    });
    let after = db.stats();
    let (ops, fsyncs) = (
        after.admitted - before.admitted,
        after.fsyncs - before.fsyncs,
    );
    eprintln!(
        "store_trait_64_tasks: {ops} admissions, {fsyncs} fsyncs, {:.1} admissions an fsync",
        ops as f64 / fsyncs.max(1) as f64
    );
    group.finish();
}

criterion_group!(benches, reserve_complete, run_once, advance, sync_writers);
criterion_main!(benches);
