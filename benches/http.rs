//! The cost of the `Idempotency-Key` layer: one POST through an axum router per
//! iteration, without the layer, with it on a first request (reserve, handler, store the
//! response) and on a replay, over an in-memory, an `Interval(10 ms)` and a `Sync` store.
//!
//! And a client that retries 50 ms into a first attempt that takes 120 ms: the time until
//! the retrying client holds the answer, with `wait_for_outcome` (one retry, answered
//! when the first attempt ends) against `409` and a retry every 50 ms until it is
//! replayed.
//!
//! `cargo bench --bench http --features http`.

#![expect(clippy::unwrap_used, reason = "benchmark: a failure aborts the run")]

use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use axum::routing::post;
use criterion::{Criterion, criterion_group, criterion_main};
use oncedb::http::IdempotencyLayer;
use oncedb::{Db, Durability, Options};
use tower::ServiceExt;

async fn created() -> (StatusCode, [(&'static str, &'static str); 1], &'static str) {
    (
        StatusCode::CREATED,
        [("content-type", "application/json")],
        r#"{"id":"pay_1","status":"authorized","amount_cents":5000,"currency":"USD"}"#,
    )
}

fn app(store: Option<Db>) -> Router {
    let route = match store {
        Some(db) => {
            post(created).route_layer(IdempotencyLayer::new(db, |_| Some("org_123".to_owned())))
        }
        None => post(created),
    };
    Router::new().route("/v1/payments", route)
}

fn request(key: u64) -> Request<Body> {
    Request::post("/v1/payments")
        .header("content-type", "application/json")
        .header("idempotency-key", format!("key-{key:016x}"))
        .body(Body::from(
            r#"{"amount_cents": 5000, "currency": "USD", "payment_method_id": "pm_card_visa"}"#,
        ))
        .unwrap()
}

fn layer(c: &mut Criterion) {
    let mut group = c.benchmark_group("http_layer");
    group.sample_size(20);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .build()
        .unwrap();
    let next = AtomicU64::new(0);
    let plain = app(None);
    group.bench_function("no_layer", |b| {
        b.to_async(&runtime).iter(|| {
            let app = plain.clone();
            let key = next.fetch_add(1, Ordering::Relaxed);
            async move { app.oneshot(request(key)).await.unwrap() }
        });
    });
    let (sync_dir, interval_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let interval = Durability::Interval(std::time::Duration::from_millis(10));
    for (name, db) in [
        ("memory", Db::open(Options::in_memory()).unwrap()),
        (
            "interval",
            Db::open(Options::new(interval_dir.path()).durability(interval)).unwrap(),
        ),
        (
            "sync",
            Db::open(Options::new(sync_dir.path()).durability(Durability::Sync)).unwrap(),
        ),
    ] {
        let guarded = app(Some(db));
        group.bench_function(format!("{name}/first"), |b| {
            b.to_async(&runtime).iter(|| {
                let app = guarded.clone();
                let key = next.fetch_add(1, Ordering::Relaxed);
                async move { app.oneshot(request(key)).await.unwrap() }
            });
        });
        runtime
            .block_on(guarded.clone().oneshot(request(u64::MAX)))
            .unwrap();
        group.bench_function(format!("{name}/replay"), |b| {
            b.to_async(&runtime).iter(|| {
                let app = guarded.clone();
                async move { app.oneshot(request(u64::MAX)).await.unwrap() }
            });
        });
    }
    group.finish();
}

/// The first attempt's handler: 120 ms of work.
async fn slow() -> (StatusCode, &'static str) {
    tokio::time::sleep(std::time::Duration::from_millis(120)).await;
    (StatusCode::CREATED, "created")
}

/// Sends a first request, retries it 50 ms later (and every 50 ms while answered `409`),
/// and returns once the retry got the answer.
async fn retried(app: Router, key: u64) {
    let first = tokio::spawn({
        let app = app.clone();
        async move { app.oneshot(request(key)).await.unwrap() }
    });
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let answer = app.clone().oneshot(request(key)).await.unwrap();
        if answer.status() != StatusCode::CONFLICT {
            assert_eq!(answer.status(), StatusCode::CREATED);
            break;
        }
    }
    first.await.unwrap();
}

fn retry_during_first_attempt(c: &mut Criterion) {
    let mut group = c.benchmark_group("http_retry_during_first_attempt");
    group.sample_size(10);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_time()
        .build()
        .unwrap();
    let next = AtomicU64::new(0);
    for (name, wait) in [
        ("409_and_retry_every_50ms", std::time::Duration::ZERO),
        ("wait_for_outcome", std::time::Duration::from_secs(5)),
    ] {
        let db = Db::open(Options::in_memory()).unwrap();
        let layer =
            IdempotencyLayer::new(db, |_| Some("org_123".to_owned())).wait_for_outcome(wait);
        let app = Router::new().route("/v1/payments", post(slow).route_layer(layer));
        group.bench_function(name, |b| {
            b.to_async(&runtime).iter(|| {
                let key = next.fetch_add(1, Ordering::Relaxed);
                retried(app.clone(), key)
            });
        });
    }
    group.finish();
}

criterion_group!(benches, layer, retry_during_first_attempt);
criterion_main!(benches);
