//! The cost of the `Idempotency-Key` layer: one POST through an axum router per
//! iteration, without the layer, with it on a first request (reserve, handler, store the
//! response) and on a replay, over an in-memory, an `Interval(10 ms)` and a `Sync` store.
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

criterion_group!(benches, layer);
criterion_main!(benches);
