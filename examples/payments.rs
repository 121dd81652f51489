//! A payment service: `POST /v1/payments` behind the `Idempotency-Key` layer,
//! a fake payment provider that deduplicates by operation id, and a reconciliation task
//! that settles requests whose outcome was unknown.
//!
//! ```sh
//! cargo run --example payments -- --addr 127.0.0.1:8080 --dir /tmp/payments
//! # with a shared store instead of the embedded one:
//! cargo run --example payments -- --addr 127.0.0.1:8080 --dir /tmp/p \
//!     --backend postgres://user@127.0.0.1:5432/db
//! ```
//!
//! `--without-layer` serves the same routes with no idempotency at all (every request
//! charges): the baseline for the layer's cost in `docs/http.md`. `--durability
//! interval:MS` commits the embedded store every MS milliseconds instead of at each
//! write (`sync`, the default).
//!
//! `payment_method_id` picks the provider's behaviour: `pm_card_declined` declines
//! (`422`, stored and replayed), `pm_slow` takes about a second, `pm_timeout` charges but
//! the answer never arrives (`503`, the record stays in flight until reconciliation
//! finds the charge), anything else authorizes.

#![expect(
    clippy::unwrap_used,
    reason = "example: a poisoned lock or bad literal aborts"
)]
#![expect(
    clippy::expect_used,
    reason = "example: start-up failures abort with a message"
)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Extension, Path, State};
use axum::http::header::{AUTHORIZATION, CONTENT_TYPE, LOCATION, RETRY_AFTER};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderName, HeaderValue, Response, StatusCode};
use axum::routing::{get, post};
use oncedb::http::{IdempotencyContext, IdempotencyLayer, SideEffect, StoredResponse};
use oncedb::{Db, Durability, Options, Store, StoreLease};

/// How long a request may stay in flight before reconciliation looks at it.
const RECONCILE_AFTER: Duration = Duration::from_secs(3);

/// The largest request body the layer buffers; a larger one gets `413`.
const MAX_BODY_BYTES: usize = 64 * 1024;

/// What the provider decided for one operation id.
#[derive(Debug, Clone)]
enum Outcome {
    Authorized {
        provider_payment_id: String,
        amount_cents: i64,
        currency: String,
    },
    Declined,
}

/// A payment provider that deduplicates by operation id, as a real one does with its own
/// idempotency keys, and counts the calls it receives.
#[derive(Default)]
struct Provider {
    calls: Mutex<HashMap<String, u64>>,
    outcomes: Mutex<HashMap<String, Outcome>>,
}

/// The provider's answer did not arrive in time (the charge may have happened).
struct Timeout;

impl Provider {
    async fn authorize(
        &self,
        operation_id: &str,
        amount_cents: i64,
        currency: &str,
        method: &str,
    ) -> Result<Outcome, Timeout> {
        *self
            .calls
            .lock()
            .unwrap()
            .entry(operation_id.to_owned())
            .or_default() += 1;
        if method == "pm_slow" {
            tokio::time::sleep(Duration::from_secs(1)).await;
        }
        let outcome = self
            .outcomes
            .lock()
            .unwrap()
            .entry(operation_id.to_owned())
            .or_insert_with(|| match method {
                "pm_card_declined" => Outcome::Declined,
                _ => Outcome::Authorized {
                    provider_payment_id: format!(
                        "prov_{:016x}",
                        xxhash_rust::xxh3::xxh3_64(operation_id.as_bytes())
                    ),
                    amount_cents,
                    currency: currency.to_owned(),
                },
            })
            .clone();
        if method == "pm_timeout" {
            // The charge went through; the answer is lost on the way back.
            tokio::time::sleep(Duration::from_millis(200)).await;
            return Err(Timeout);
        }
        Ok(outcome)
    }

    /// A status lookup by operation id (not a charge, so not counted).
    fn lookup(&self, operation_id: &str) -> Option<Outcome> {
        self.outcomes.lock().unwrap().get(operation_id).cloned()
    }

    fn calls(&self, operation_id: &str) -> u64 {
        self.calls
            .lock()
            .unwrap()
            .get(operation_id)
            .copied()
            .unwrap_or(0)
    }
}

/// The answer the service gives for a provider outcome (also stored by reconciliation).
fn payment_answer(operation_id: &str, outcome: &Outcome) -> StoredResponse {
    let json = HeaderValue::from_static("application/json");
    match outcome {
        Outcome::Authorized {
            provider_payment_id,
            amount_cents,
            currency,
        } => {
            let id = format!(
                "pay_{:016x}",
                xxhash_rust::xxh3::xxh3_64(operation_id.as_bytes())
            );
            let body = serde_json::json!({
                "id": id,
                "status": "authorized",
                "amount_cents": amount_cents,
                "currency": currency,
                "provider_payment_id": provider_payment_id,
            });
            StoredResponse {
                status: StatusCode::CREATED,
                headers: vec![
                    (CONTENT_TYPE, json),
                    (
                        LOCATION,
                        HeaderValue::from_str(&format!("/v1/payments/{id}")).unwrap(),
                    ),
                ],
                body: body.to_string().into_bytes(),
            }
        }
        Outcome::Declined => StoredResponse {
            status: StatusCode::UNPROCESSABLE_ENTITY,
            headers: vec![(CONTENT_TYPE, json)],
            body: br#"{"error":"payment_declined"}"#.to_vec(),
        },
    }
}

fn error(status: StatusCode, error: &str) -> Response<Body> {
    StoredResponse {
        status,
        headers: vec![(CONTENT_TYPE, HeaderValue::from_static("application/json"))],
        body: format!("{{\"error\":\"{error}\"}}").into_bytes(),
    }
    .into_response()
}

/// `POST /v1/payments`: validate, call the provider with the stable operation id, answer.
async fn create_payment(
    State(provider): State<Arc<Provider>>,
    context: Option<Extension<IdempotencyContext>>,
    headers: HeaderMap,
    body: Bytes,
) -> Response<Body> {
    let Ok(request) = serde_json::from_slice::<serde_json::Value>(&body) else {
        return error(StatusCode::BAD_REQUEST, "invalid_json");
    };
    let field = |name: &str| request.get(name);
    let amount = field("amount_cents")
        .and_then(serde_json::Value::as_i64)
        .filter(|&a| a > 0);
    let currency = field("currency")
        .and_then(serde_json::Value::as_str)
        .filter(|c| c.len() == 3 && c.chars().all(|c| c.is_ascii_alphabetic()));
    let method = field("payment_method_id").and_then(serde_json::Value::as_str);
    let (Some(amount), Some(currency), Some(method)) = (amount, currency, method) else {
        return error(StatusCode::UNPROCESSABLE_ENTITY, "invalid_request");
    };
    // Without the layer (`--without-layer`) nothing binds the key to a tenant or
    // remembers it: the raw header stands in for the operation id.
    let operation_id = match context {
        Some(Extension(context)) => context.operation_id(),
        None => format!(
            "unprotected:{}",
            String::from_utf8_lossy(
                headers
                    .get("idempotency-key")
                    .map_or(&b""[..], HeaderValue::as_bytes)
            )
        ),
    };
    match provider
        .authorize(
            &operation_id,
            amount,
            &currency.to_ascii_uppercase(),
            method,
        )
        .await
    {
        Ok(outcome) => payment_answer(&operation_id, &outcome).into_response(),
        Err(Timeout) => {
            // Outcome unknown: the layer keeps the record in flight with a note.
            let mut response = error(StatusCode::SERVICE_UNAVAILABLE, "provider_timeout");
            response.extensions_mut().insert(SideEffect::Unknown);
            response
                .headers_mut()
                .insert(RETRY_AFTER, HeaderValue::from_static("2"));
            response
        }
    }
}

/// `GET /v1/provider/calls/{operation_id}`: the fake provider's call count.
async fn provider_calls(
    State(provider): State<Arc<Provider>>,
    Path(operation_id): Path<String>,
) -> Response<Body> {
    let body = serde_json::json!({
        "operation_id": operation_id,
        "calls": provider.calls(&operation_id),
    });
    let mut response = Response::new(Body::from(body.to_string()));
    response
        .headers_mut()
        .insert(CONTENT_TYPE, HeaderValue::from_static("application/json"));
    response
}

/// The tenant of a bearer token (a fixed map here; a real service asks its auth).
fn tenant(parts: &Parts) -> Option<String> {
    let token = parts
        .headers
        .get(AUTHORIZATION)?
        .to_str()
        .ok()?
        .strip_prefix("Bearer ")?;
    match token {
        "tok_org_123" => Some("org_123".into()),
        "tok_org_456" => Some("org_456".into()),
        _ => None,
    }
}

/// Settles records in flight for longer than [`RECONCILE_AFTER`]: asks the provider by
/// operation id, stores what it says through a take-over, or releases the key when the
/// provider never saw the operation, so a retry runs it.
async fn reconcile<S: Store + Clone>(store: S, provider: Arc<Provider>) {
    loop {
        tokio::time::sleep(Duration::from_millis(500)).await;
        let Ok(stuck) = store.in_flight(RECONCILE_AFTER).await else {
            continue;
        };
        // Only records the layer marked "outcome unknown" (its note): a record without one
        // belongs to a handler still running, which must not be fenced.
        for record in stuck.into_iter().filter(|record| record.note.is_some()) {
            // The id the handler sent the provider: the same three parts.
            let operation_id = IdempotencyContext {
                tenant: String::from_utf8_lossy(record.scope.tenant()).into_owned(),
                operation: String::from_utf8_lossy(record.scope.operation()).into_owned(),
                key: String::from_utf8_lossy(&record.key).into_owned(),
            }
            .operation_id();
            let Ok(Some(lease)) = store.take_over(&record.scope, &record.key).await else {
                continue;
            };
            let settled = match provider.lookup(&operation_id) {
                Some(outcome) => {
                    let answer = payment_answer(&operation_id, &outcome);
                    if answer.status.is_success() {
                        lease.complete(&answer.encode()).await
                    } else {
                        lease.fail(&answer.encode()).await
                    }
                }
                None => lease.release().await,
            };
            match settled {
                Ok(()) => eprintln!("reconciled {operation_id}"),
                Err(err) => eprintln!("reconciling {operation_id}: {err}"),
            }
        }
    }
}

async fn serve<S: Store + Clone>(store: S, addr: SocketAddr, with_layer: bool) {
    let provider = Arc::new(Provider::default());
    let layer = IdempotencyLayer::new(store.clone(), tenant)
        .max_body_bytes(MAX_BODY_BYTES)
        .replay_headers(vec![
            CONTENT_TYPE,
            LOCATION,
            HeaderName::from_static("x-request-id"),
        ])
        .expect("the replayed headers carry no credentials");
    let payments = if with_layer {
        post(create_payment).route_layer(layer)
    } else {
        post(create_payment)
    };
    let app = Router::new()
        .route("/v1/payments", payments)
        .route("/v1/provider/calls/{operation_id}", get(provider_calls))
        .with_state(Arc::clone(&provider));
    tokio::spawn(reconcile(store, provider));
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .expect("cannot listen on --addr");
    let addr = listener.local_addr().expect("bound address");
    println!("payments: listening on http://{addr}");
    println!(
        "try: curl -i -X POST http://{addr}/v1/payments -H 'Authorization: Bearer tok_org_123' \
         -H 'Idempotency-Key: 7d1f6c1e-5a8b-4c6f-9a1e-2b3c4d5e6f70' -H 'Content-Type: application/json' \
         -d '{{\"amount_cents\": 5000, \"currency\": \"USD\", \"payment_method_id\": \"pm_card_visa\"}}'"
    );
    println!(
        "then: curl http://{addr}/v1/provider/calls/org_123:7d1f6c1e-5a8b-4c6f-9a1e-2b3c4d5e6f70"
    );
    axum::serve(listener, app).await.expect("server failed");
}

struct Args {
    addr: SocketAddr,
    dir: PathBuf,
    backend: Option<String>,
    durability: Durability,
    with_layer: bool,
}

/// `sync`, or `interval:MS`.
fn durability(value: &str) -> Result<Durability, String> {
    match value.split_once(':') {
        None if value == "sync" => Ok(Durability::Sync),
        Some(("interval", ms)) => ms
            .parse()
            .map(|ms| Durability::Interval(Duration::from_millis(ms)))
            .map_err(|e| format!("--durability interval:MS: {e}")),
        _ => Err(format!("--durability {value}: sync or interval:MS")),
    }
}

fn args() -> Result<Args, String> {
    let mut addr = None;
    let mut dir = None;
    let mut backend = None;
    let mut durability_mode = Durability::Sync;
    let mut with_layer = true;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        if flag == "--without-layer" {
            with_layer = false;
            continue;
        }
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--addr" => addr = Some(value.parse().map_err(|e| format!("--addr: {e}"))?),
            "--dir" => dir = Some(PathBuf::from(value)),
            "--backend" => backend = Some(value),
            "--durability" => durability_mode = durability(&value)?,
            other => return Err(format!("unknown flag {other}")),
        }
    }
    Ok(Args {
        addr: addr.ok_or("--addr HOST:PORT is required")?,
        dir: dir.ok_or("--dir DIR is required")?,
        backend,
        durability: durability_mode,
        with_layer,
    })
}

#[tokio::main]
async fn main() {
    let args = match args() {
        Ok(args) => args,
        Err(err) => {
            eprintln!(
                "payments: {err}\nusage: payments --addr HOST:PORT --dir DIR [--backend URL] [--durability sync|interval:MS] [--without-layer]"
            );
            std::process::exit(2);
        }
    };
    let window = Duration::from_secs(24 * 3600);
    match args.backend.as_deref() {
        None => {
            let db = Db::open(
                Options::new(&args.dir)
                    .durability(args.durability)
                    .window(window),
            )
            .expect("cannot open the store in --dir");
            serve(db, args.addr, args.with_layer).await;
        }
        #[cfg(feature = "postgres")]
        Some(url) if url.starts_with("postgres") => {
            let store = oncedb::PostgresStore::connect(url, window).expect("bad --backend");
            store.migrate().await.expect("cannot migrate the database");
            serve(store, args.addr, args.with_layer).await;
        }
        #[cfg(feature = "redis")]
        Some(url) if url.starts_with("redis://") => {
            let store = oncedb::RedisStore::connect(url, "payments", window)
                .await
                .expect("cannot reach Redis");
            serve(store, args.addr, args.with_layer).await;
        }
        Some(other) => {
            eprintln!(
                "payments: unsupported --backend {other} (postgres:// and redis:// are supported)"
            );
            std::process::exit(2);
        }
    }
}
