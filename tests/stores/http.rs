//! The `Idempotency-Key` layer (feature `http`) on an axum router over a durable embedded
//! store: every answer of the table in `oncedb::http`, the response policy, replay after a
//! restart. `payments` drives the payments example over HTTP.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Extension, State};
use axum::http::{HeaderValue, Request, Response, StatusCode};
use axum::routing::post;
use oncedb::http::{IdempotencyContext, IdempotencyLayer, SideEffect};
use oncedb::{Db, Durability, Options, Store};
use tower::ServiceExt;

const KEY: &str = "key-0123456789abcdef";

/// What the test handler does, by the `x-mode` request header.
#[derive(Default)]
struct Handler {
    calls: AtomicUsize,
    gate: tokio::sync::Notify,
    /// Notified when a `wait` request has been let through the gate.
    finished: tokio::sync::Notify,
}

async fn handle(
    State(handler): State<Arc<Handler>>,
    Extension(context): Extension<IdempotencyContext>,
    request: Request<Body>,
) -> Response<Body> {
    let n = handler.calls.fetch_add(1, Ordering::SeqCst) + 1;
    let mode = request
        .headers()
        .get("x-mode")
        .map(|v| v.to_str().unwrap().to_owned())
        .unwrap_or_default();
    let body = axum::body::to_bytes(request.into_body(), 1 << 20)
        .await
        .unwrap();
    let mut response = Response::new(Body::from(format!(
        "call {n} for {} with {}",
        context.operation_id(),
        String::from_utf8_lossy(&body)
    )));
    *response.status_mut() = StatusCode::CREATED;
    let headers = response.headers_mut();
    headers.insert("content-type", HeaderValue::from_static("text/plain"));
    headers.insert("location", HeaderValue::from_static("/things/1"));
    headers.insert("x-not-replayed", HeaderValue::from_static("1"));
    match mode.as_str() {
        "wait" => {
            handler.gate.notified().await;
            handler.finished.notify_one();
        }
        "declined" => *response.status_mut() = StatusCode::UNPROCESSABLE_ENTITY,
        "unknown" => {
            *response.status_mut() = StatusCode::BAD_GATEWAY;
            response.extensions_mut().insert(SideEffect::Unknown);
        }
        "server_error" => *response.status_mut() = StatusCode::INTERNAL_SERVER_ERROR,
        "rate_limited" if n == 1 => *response.status_mut() = StatusCode::TOO_MANY_REQUESTS,
        "rate_limited" => {}
        "nothing_happened" => {
            *response.status_mut() = StatusCode::SERVICE_UNAVAILABLE;
            response.extensions_mut().insert(SideEffect::NotPerformed);
        }
        "panic" => panic!("handler failure"),
        "large" => *response.body_mut() = Body::from(vec![b'x'; 4096]),
        "stream" => {
            let chunks =
                futures_util::stream::iter([Ok::<_, std::io::Error>(Bytes::from("chunk"))]);
            *response.body_mut() = Body::from_stream(chunks);
        }
        _ => {}
    }
    response
}

fn app<S: Store + Clone>(store: S, handler: Arc<Handler>) -> Router {
    app_with(store, handler, 1024)
}

fn app_with<S: Store + Clone>(store: S, handler: Arc<Handler>, max_body: usize) -> Router {
    let layer = IdempotencyLayer::new(store, |parts| {
        let auth = parts.headers.get("authorization")?.to_str().ok()?;
        auth.strip_prefix("Bearer ").map(str::to_owned)
    })
    .max_body_bytes(max_body);
    Router::new()
        .route("/things", post(handle).route_layer(layer))
        .with_state(handler)
}

fn request(key: Option<&str>, mode: &str, body: &'static str) -> Request<Body> {
    let mut builder = Request::post("/things")
        .header("authorization", "Bearer tenant_a")
        .header("content-type", "application/json")
        .header("x-mode", mode);
    if let Some(key) = key {
        builder = builder.header("idempotency-key", key);
    }
    builder.body(Body::from(body)).unwrap()
}

async fn send(app: &Router, request: Request<Body>) -> (StatusCode, Vec<(String, String)>, Bytes) {
    let response = app.clone().oneshot(request).await.unwrap();
    let status = response.status();
    let headers = response
        .headers()
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_str().unwrap().to_owned()))
        .collect();
    let body = axum::body::to_bytes(response.into_body(), 1 << 20)
        .await
        .unwrap();
    (status, headers, body)
}

fn header<'a>(headers: &'a [(String, String)], name: &str) -> Option<&'a str> {
    headers
        .iter()
        .find(|(k, _)| k == name)
        .map(|(_, v)| v.as_str())
}

fn durable(dir: &std::path::Path) -> Db {
    Db::open(Options::new(dir).durability(Durability::Sync)).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_before_the_handler() {
    let dir = tempfile::tempdir().unwrap();
    let handler = Arc::new(Handler::default());
    let app = app(durable(dir.path()), Arc::clone(&handler));
    let body = r#"{"a":1}"#;
    assert_eq!(
        send(&app, request(None, "", body)).await.0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        send(&app, request(Some("short"), "", body)).await.0,
        StatusCode::BAD_REQUEST
    );
    let long = "k".repeat(256);
    let long = Box::leak(long.into_boxed_str());
    assert_eq!(
        send(&app, request(Some(long), "", body)).await.0,
        StatusCode::BAD_REQUEST
    );
    assert_eq!(
        send(&app, request(Some("key with spaces 0123"), "", body))
            .await
            .0,
        StatusCode::BAD_REQUEST
    );
    // Over the body limit: refused from Content-Length, before buffering.
    let big: &'static str = Box::leak("x".repeat(2000).into_boxed_str());
    let mut too_big = request(Some(KEY), "", big);
    too_big
        .headers_mut()
        .insert("content-length", HeaderValue::from_static("2000"));
    assert_eq!(send(&app, too_big).await.0, StatusCode::PAYLOAD_TOO_LARGE);
    // No tenant.
    let mut anonymous = request(Some(KEY), "", body);
    anonymous.headers_mut().remove("authorization");
    assert_eq!(send(&app, anonymous).await.0, StatusCode::UNAUTHORIZED);
    assert_eq!(handler.calls.load(Ordering::SeqCst), 0);
    // A GET is not guarded.
    let get = Request::get("/things").body(Body::empty()).unwrap();
    assert_eq!(send(&app, get).await.0, StatusCode::METHOD_NOT_ALLOWED);
    // None of them used the key: it still runs once.
    assert_eq!(
        send(&app, request(Some(KEY), "", body)).await.0,
        StatusCode::CREATED
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completed_request_is_replayed_byte_for_byte_even_after_a_restart() {
    let dir = tempfile::tempdir().unwrap();
    let handler = Arc::new(Handler::default());
    let first = {
        let app = app(durable(dir.path()), Arc::clone(&handler));
        let first = send(&app, request(Some(KEY), "", r#"{"b":2,"a":1}"#)).await;
        assert_eq!(first.0, StatusCode::CREATED);
        // The key's structured-field form (quoted) is the same key.
        let quoted: &'static str = Box::leak(format!("\"{KEY}\"").into_boxed_str());
        let again = send(&app, request(Some(quoted), "", r#"{"a":1, "b":2}"#)).await;
        assert_eq!(again.2, first.2);
        assert_eq!(header(&again.1, "idempotent-replayed"), Some("true"));
        first
    };
    // The store is closed and opened again: the record came back from its files.
    let app = app(durable(dir.path()), Arc::clone(&handler));
    let replay = send(&app, request(Some(KEY), "", r#"{"a":1,"b":2}"#)).await;
    assert_eq!(replay.0, StatusCode::CREATED);
    assert_eq!(replay.2, first.2, "the body, byte for byte");
    assert_eq!(header(&replay.1, "content-type"), Some("text/plain"));
    assert_eq!(header(&replay.1, "location"), Some("/things/1"));
    assert_eq!(header(&replay.1, "idempotent-replayed"), Some("true"));
    assert_eq!(
        header(&replay.1, "x-not-replayed"),
        None,
        "not in the allow-list"
    );
    assert_eq!(handler.calls.load(Ordering::SeqCst), 1);
    // The handler saw the operation id: tenant, operation and key, length-prefixed.
    assert!(
        String::from_utf8_lossy(&first.2).contains("8:tenant_a")
            && String::from_utf8_lossy(&first.2).contains("20:key-0123456789abcdef"),
        "{}",
        String::from_utf8_lossy(&first.2)
    );
    // Another body under the same key is refused.
    let other = send(&app, request(Some(KEY), "", r#"{"a":2,"b":2}"#)).await;
    assert_eq!(other.0, StatusCode::UNPROCESSABLE_ENTITY);
    // Another tenant has keys of its own.
    let mut tenant_b = request(Some(KEY), "", r#"{"a":1,"b":2}"#);
    tenant_b
        .headers_mut()
        .insert("authorization", HeaderValue::from_static("Bearer tenant_b"));
    assert_eq!(send(&app, tenant_b).await.0, StatusCode::CREATED);
    assert_eq!(handler.calls.load(Ordering::SeqCst), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_during_the_first_attempt_gets_409() {
    let dir = tempfile::tempdir().unwrap();
    let handler = Arc::new(Handler::default());
    let app = app(durable(dir.path()), Arc::clone(&handler));
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, request(Some(KEY), "wait", "{}")).await }
    });
    // Wait until the first attempt is inside the handler.
    while handler.calls.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    let retry = send(&app, request(Some(KEY), "wait", "{}")).await;
    assert_eq!(retry.0, StatusCode::CONFLICT);
    assert_eq!(header(&retry.1, "retry-after"), Some("1"));
    // Still running: not an unknown outcome.
    assert!(String::from_utf8_lossy(&retry.2).contains("urn:oncedb:problem:request_in_progress"));
    handler.gate.notify_one();
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
    assert_eq!(handler.calls.load(Ordering::SeqCst), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_response_policy_decides_what_a_retry_gets() {
    let dir = tempfile::tempdir().unwrap();
    let handler = Arc::new(Handler::default());
    let db = durable(dir.path());
    let app = app(db.clone(), Arc::clone(&handler));
    let calls = || handler.calls.load(Ordering::SeqCst);

    // 4xx: stored as a failure and replayed.
    let declined = send(&app, request(Some("declined-0000000001"), "declined", "{}")).await;
    assert_eq!(declined.0, StatusCode::UNPROCESSABLE_ENTITY);
    let again = send(&app, request(Some("declined-0000000001"), "declined", "{}")).await;
    assert_eq!((again.0, again.2), (declined.0, declined.2));
    assert_eq!(calls(), 1);

    // 5xx, outcome marked unknown: the record stays in flight with a note.
    let unknown = send(&app, request(Some("unknown-00000000001"), "unknown", "{}")).await;
    assert_eq!(unknown.0, StatusCode::BAD_GATEWAY);
    let again = send(&app, request(Some("unknown-00000000001"), "unknown", "{}")).await;
    assert_eq!(again.0, StatusCode::CONFLICT);
    assert!(
        String::from_utf8_lossy(&again.2).contains("urn:oncedb:problem:request_outcome_unknown"),
        "the retry learns the first attempt's outcome is unknown, not that it runs"
    );
    let stuck = db.in_flight(Duration::ZERO);
    assert_eq!(stuck.len(), 1);
    assert_eq!(
        stuck[0].note.as_deref(),
        Some(&b"HTTP 502 Bad Gateway: outcome unknown"[..])
    );
    assert_eq!(calls(), 2);

    // 5xx, unmarked: stored and replayed (a database blip becomes its 500, not a 409 for
    // the whole window).
    let key = Some("server-error-000001");
    let failed = send(&app, request(key, "server_error", "{}")).await;
    assert_eq!(failed.0, StatusCode::INTERNAL_SERVER_ERROR);
    let again = send(&app, request(key, "", "{}")).await;
    assert_eq!((again.0, &again.2), (failed.0, &failed.2));
    assert_eq!(header(&again.1, "idempotent-replayed"), Some("true"));
    assert_eq!(calls(), 3);

    // 429 from the handler (an inner rate limiter): released, so the next attempt runs.
    let key = Some("rate-limited-000001");
    handler.calls.store(0, Ordering::SeqCst);
    assert_eq!(
        send(&app, request(key, "rate_limited", "{}")).await.0,
        StatusCode::TOO_MANY_REQUESTS
    );
    assert_eq!(
        send(&app, request(key, "rate_limited", "{}")).await.0,
        StatusCode::CREATED
    );
    assert_eq!(calls(), 2);

    // 5xx after which the handler vouches nothing happened: a retry runs again.
    let key = Some("nothing-00000000001");
    assert_eq!(
        send(&app, request(key, "nothing_happened", "{}")).await.0,
        StatusCode::SERVICE_UNAVAILABLE
    );
    assert_eq!(
        send(&app, request(key, "", "{}")).await.0,
        StatusCode::CREATED
    );
    assert_eq!(calls(), 4);

    // A handler that panics leaves the record in flight, never completed; the client
    // gets a 500.
    let panicked = send(&app, request(Some("panicked-0000000001"), "panic", "{}")).await;
    assert_eq!(panicked.0, StatusCode::INTERNAL_SERVER_ERROR);
    let again = send(&app, request(Some("panicked-0000000001"), "", "{}")).await;
    assert_eq!(again.0, StatusCode::CONFLICT);

    // A client that goes away mid-request (its future dropped): the handler runs to the
    // end anyway and its answer is stored, so the retry replays it.
    let abandoned = tokio::spawn({
        let app = app.clone();
        async move { send(&app, request(Some("abandoned-000000001"), "wait", "{}")).await }
    });
    while calls() < 6 {
        tokio::task::yield_now().await;
    }
    abandoned.abort();
    assert!(abandoned.await.unwrap_err().is_cancelled());
    handler.gate.notify_one();
    tokio::time::timeout(Duration::from_secs(10), handler.finished.notified())
        .await
        .expect("the abandoned request's handler runs to its end");
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let replay = loop {
        let answer = send(&app, request(Some("abandoned-000000001"), "", "{}")).await;
        if answer.0 != StatusCode::CONFLICT {
            break answer;
        }
        // The detached request stores its answer right after the handler returns.
        assert!(std::time::Instant::now() < deadline, "never stored");
        tokio::task::yield_now().await;
    };
    assert_eq!(replay.0, StatusCode::CREATED);
    assert_eq!(header(&replay.1, "idempotent-replayed"), Some("true"));
    assert_eq!(
        calls(),
        6,
        "the retry replayed: the handler ran once for the key"
    );
    // Left in flight: the unknown outcome and the panic.
    assert_eq!(db.in_flight(Duration::ZERO).len(), 2);
}

/// The answers of a bad day: a body that never arrives, two keys, a store that cannot be
/// reached or is full, a response too large for the store, a streaming response.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_days_get_the_documented_answers() {
    let deadline = Duration::from_secs(10);
    let dir = tempfile::tempdir().unwrap();
    let handler = Arc::new(Handler::default());
    let app = app(durable(dir.path()), Arc::clone(&handler));
    // A declared body over the limit whose bytes never come: refused from the header,
    // without waiting for (or buffering) the body.
    let never = futures_util::stream::pending::<Result<Bytes, std::io::Error>>();
    let mut stalled = request(Some(KEY), "", "");
    *stalled.body_mut() = Body::from_stream(never);
    stalled
        .headers_mut()
        .insert("content-length", HeaderValue::from_static("2000"));
    let answer = tokio::time::timeout(deadline, send(&app, stalled))
        .await
        .expect("413 without waiting for the body");
    assert_eq!(answer.0, StatusCode::PAYLOAD_TOO_LARGE);
    // Two Idempotency-Key header lines.
    let mut twice = request(Some(KEY), "", "{}");
    twice.headers_mut().append(
        "idempotency-key",
        HeaderValue::from_static("key-other-0123456789"),
    );
    let answer = send(&app, twice).await;
    assert_eq!(answer.0, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&answer.2).contains("duplicate_idempotency_key"));
    assert_eq!(handler.calls.load(Ordering::SeqCst), 0);

    // A store that cannot be reached: 503 with Retry-After, the handler never runs.
    let nowhere = oncedb::PostgresStore::connect_with(
        "postgres://nobody@127.0.0.1:1/none",
        oncedb::StoreOptions::new(Duration::from_secs(60))
            .connect_timeout(Duration::from_secs(2))
            .response_timeout(Duration::from_secs(2)),
    )
    .unwrap();
    let unreachable = app_with(nowhere, Arc::clone(&handler), 1024);
    let answer = send(&unreachable, request(Some(KEY), "", "{}")).await;
    assert_eq!(answer.0, StatusCode::SERVICE_UNAVAILABLE);
    assert!(header(&answer.1, "retry-after").is_some());

    // A full store: 503 with Retry-After.
    let full = Db::open(Options::in_memory().shards(1).max_keys(1)).unwrap();
    let full = app_with(full, Arc::clone(&handler), 1024);
    assert_eq!(
        send(&full, request(Some(KEY), "", "{}")).await.0,
        StatusCode::CREATED
    );
    let answer = send(&full, request(Some("key-second-0123456789"), "", "{}")).await;
    assert_eq!(answer.0, StatusCode::SERVICE_UNAVAILABLE);
    assert!(header(&answer.1, "retry-after").is_some());
    assert_eq!(handler.calls.load(Ordering::SeqCst), 1);

    // A response larger than the store accepts: answered whole, and the retry learns the
    // outcome (status, headers, no body) without running the handler again.
    let small = Db::open(Options::in_memory().max_response_bytes(512)).unwrap();
    let small = app_with(small, Arc::clone(&handler), 1024);
    let first = send(&small, request(Some(KEY), "large", "{}")).await;
    assert_eq!((first.0, first.2.len()), (StatusCode::CREATED, 4096));
    let retry = send(&small, request(Some(KEY), "large", "{}")).await;
    assert_eq!(retry.0, StatusCode::CREATED);
    assert!(retry.2.is_empty());
    assert_eq!(header(&retry.1, "idempotent-body-omitted"), Some("true"));
    assert_eq!(header(&retry.1, "location"), Some("/things/1"));
    assert_eq!(handler.calls.load(Ordering::SeqCst), 2);

    // A streaming response is not stored: the key is released and a retry runs again.
    let streaming = app_with(
        Db::open(Options::in_memory()).unwrap(),
        Arc::clone(&handler),
        1024,
    );
    let first = send(&streaming, request(Some(KEY), "stream", "{}")).await;
    assert_eq!(&first.2[..], b"chunk");
    let retry = send(&streaming, request(Some(KEY), "stream", "{}")).await;
    assert_eq!(header(&retry.1, "idempotent-replayed"), None);
    assert_eq!(handler.calls.load(Ordering::SeqCst), 4);
}

/// The layer's own answers are problem details, with `WWW-Authenticate` on a `401`; a
/// hook re-renders them; a tenant too long for a scope is its own answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layers_answers_are_problem_details() {
    let handler = Arc::new(Handler::default());
    let app = app(
        Db::open(Options::in_memory()).unwrap(),
        Arc::clone(&handler),
    );
    let mut anonymous = request(Some(KEY), "", "{}");
    anonymous.headers_mut().remove("authorization");
    let answer = send(&app, anonymous).await;
    assert_eq!(answer.0, StatusCode::UNAUTHORIZED);
    assert_eq!(header(&answer.1, "www-authenticate"), Some("Bearer"));
    assert_eq!(
        header(&answer.1, "content-type"),
        Some("application/problem+json")
    );
    let body: serde_json::Value = serde_json::from_slice(&answer.2).unwrap();
    assert_eq!(body["status"], 401);
    assert_eq!(body["type"], "urn:oncedb:problem:unauthorized");
    assert!(body["title"].is_string());
    // A tenant longer than a scope part: refused as such, not as a bad key.
    let long_tenant = format!("Bearer {}", "t".repeat(2000));
    let mut long = request(Some(KEY), "", "{}");
    long.headers_mut().insert(
        "authorization",
        HeaderValue::from_str(&long_tenant).unwrap(),
    );
    let answer = send(&app, long).await;
    assert_eq!(answer.0, StatusCode::BAD_REQUEST);
    assert!(String::from_utf8_lossy(&answer.2).contains("invalid_tenant"));
    // The application's own rendering.
    let layer = IdempotencyLayer::new(Db::open(Options::in_memory()).unwrap(), |_| None).problem(
        |problem| {
            let mut response = Response::new(Body::from(format!("custom {}", problem.code)));
            *response.status_mut() = problem.status;
            response
        },
    );
    let custom = Router::new()
        .route("/things", post(handle).route_layer(layer))
        .with_state(Arc::clone(&handler));
    let answer = send(&custom, request(Some(KEY), "", "{}")).await;
    assert_eq!(
        (answer.0, &answer.2[..]),
        (StatusCode::UNAUTHORIZED, &b"custom unauthorized"[..])
    );
    assert_eq!(header(&answer.1, "www-authenticate"), Some("Bearer"));
    assert_eq!(handler.calls.load(Ordering::SeqCst), 0);
}

/// Operation ids are built from length-prefixed parts that include the operation, so
/// parts holding the separator, or one key on two routes, never share an id.
#[test]
fn operation_ids_never_collide() {
    let id = |tenant: &str, operation: &str, key: &str| {
        IdempotencyContext {
            tenant: tenant.into(),
            operation: operation.into(),
            key: key.into(),
        }
        .operation_id()
    };
    assert_ne!(id("a", "POST /p", "b:k"), id("a:b", "POST /p", "k"));
    assert_ne!(
        id("a", "POST /payments", "k"),
        id("a", "POST /refunds", "k")
    );
    assert_ne!(id("a1", "1:b", "k"), id("a", "11:b", "k"));
    assert_eq!(id("t", "POST /p", "k"), id("t", "POST /p", "k"));
}

/// The layer composes inside a body-changing layer: tower-http's request body limit hands
/// it a `Limited` body. A body within the limit is guarded and replayed; one over it is
/// refused (from `Content-Length` by the outer layer, or when the stream passes the limit)
/// before any record exists, so the same key with an acceptable body then runs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_composes_inside_a_request_body_limit() {
    let store = Db::open(Options::in_memory()).unwrap();
    let handler = Arc::new(Handler::default());
    let guarded = tower::ServiceBuilder::new()
        .layer(tower_http::limit::RequestBodyLimitLayer::new(16))
        .layer(IdempotencyLayer::new(store, |_| {
            Some("tenant_a".to_owned())
        }));
    let app = Router::new()
        .route("/things", post(handle).route_layer(guarded))
        .with_state(Arc::clone(&handler));

    let (status, _, first) = send(&app, request(Some(KEY), "", r#"{"a":1}"#)).await;
    assert_eq!(status, StatusCode::CREATED);
    let (status, headers, again) = send(&app, request(Some(KEY), "", r#"{"a":1}"#)).await;
    assert_eq!((status, again), (StatusCode::CREATED, first));
    assert_eq!(header(&headers, "idempotent-replayed"), Some("true"));

    let other = "key-over-the-limit-0001";
    let streamed = request(Some(other), "", r#"{"a":"far more than sixteen bytes"}"#);
    let mut declared = request(Some(other), "", r#"{"a":"far more than sixteen bytes"}"#);
    declared
        .headers_mut()
        .insert("content-length", HeaderValue::from_static("35"));
    for refused in [streamed, declared] {
        let (status, _, _) = send(&app, refused).await;
        assert_eq!(status, StatusCode::PAYLOAD_TOO_LARGE);
    }
    assert_eq!(handler.calls.load(Ordering::SeqCst), 1);
    let (status, headers, _) = send(&app, request(Some(other), "", r#"{"a":2}"#)).await;
    assert_eq!(status, StatusCode::CREATED);
    assert_eq!(header(&headers, "idempotent-replayed"), None);
    assert_eq!(handler.calls.load(Ordering::SeqCst), 2);
}

/// An inner service that fails (a tower service, not an axum route, whose routes cannot):
/// the error goes to the caller, and the record stays in flight with the error as its
/// note, so a retry gets `409 request_outcome_unknown` and never runs the service again
/// while the outcome is unknown. Checked with and without detached execution.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inner_service_error_leaves_the_outcome_unknown() {
    use tower::{Layer, ServiceExt};
    for detached in [true, false] {
        let store = Db::open(Options::in_memory()).unwrap();
        let calls = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&calls);
        let failing = tower::service_fn(move |_: Request<Body>| {
            counted.fetch_add(1, Ordering::SeqCst);
            async { Err::<Response<Body>, _>(std::io::Error::other("database gone")) }
        });
        let service = IdempotencyLayer::new(store.clone(), |_| Some("t".to_owned()))
            .detached(detached)
            .layer(failing);
        let err = service.clone().oneshot(request(Some(KEY), "", "{}")).await;
        assert_eq!(err.unwrap_err().to_string(), "database gone");
        let stuck = store.in_flight(Duration::ZERO);
        assert_eq!(stuck.len(), 1);
        assert_eq!(
            stuck[0].note.as_deref(),
            Some(&b"service error: database gone"[..])
        );
        let retry = service.oneshot(request(Some(KEY), "", "{}")).await.unwrap();
        assert_eq!(retry.status(), StatusCode::CONFLICT);
        let body = axum::body::to_bytes(retry.into_body(), 4096).await.unwrap();
        assert!(String::from_utf8_lossy(&body).contains("request_outcome_unknown"));
        assert_eq!(calls.load(Ordering::SeqCst), 1, "detached: {detached}");
    }
}

/// A retry after the stored response aged out (`Options::response_retention`), while
/// the key is still in its window: `410 idempotency_response_expired`, and the handler
/// does not run again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_after_the_response_aged_out_gets_410_and_does_not_run() {
    let clock = oncedb_testkit::fixtures::manual_clock();
    let bucket = oncedb_testkit::fixtures::BUCKET;
    let db = Db::open(
        Options::in_memory()
            .window(oncedb_testkit::fixtures::WINDOW)
            .bucket_width(bucket)
            .clock(clock.clone())
            .response_retention(2 * bucket),
    )
    .unwrap();
    let handler = Arc::new(Handler::default());
    let app = app(db, Arc::clone(&handler));
    let first = send(&app, request(Some(KEY), "", "{}")).await;
    assert_eq!(first.0, StatusCode::CREATED);
    clock.forward(bucket);
    let replay = send(&app, request(Some(KEY), "", "{}")).await;
    assert_eq!(
        replay.2, first.2,
        "inside the retention the response replays"
    );
    clock.forward(2 * bucket);
    let late = send(&app, request(Some(KEY), "", "{}")).await;
    assert_eq!(late.0, StatusCode::GONE);
    assert!(String::from_utf8_lossy(&late.2).contains("idempotency_response_expired"));
    assert_eq!(handler.calls.load(Ordering::SeqCst), 1, "not run again");
}

/// `wait_for_outcome`: a retry during a slow first attempt waits for it and gets its
/// `201` replayed instead of `409`; the handler ran once. The retry was waiting (the
/// store counts it) before the first attempt was let finish.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_during_a_slow_first_attempt_waits_and_gets_the_replay() {
    let dir = tempfile::tempdir().unwrap();
    let handler = Arc::new(Handler::default());
    let db = durable(dir.path());
    let layer = IdempotencyLayer::new(db.clone(), |_| Some("tenant_a".to_owned()))
        .wait_for_outcome(Duration::from_secs(30));
    let app = Router::new()
        .route("/things", post(handle).route_layer(layer))
        .with_state(Arc::clone(&handler));
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, request(Some(KEY), "wait", "{}")).await }
    });
    while handler.calls.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    let retry = tokio::spawn({
        let app = app.clone();
        async move { send(&app, request(Some(KEY), "wait", "{}")).await }
    });
    while db.stats().outcome_waiters == 0 {
        tokio::task::yield_now().await;
    }
    handler.gate.notify_one();
    let (first, retry) = (first.await.unwrap(), retry.await.unwrap());
    assert_eq!(first.0, StatusCode::CREATED);
    assert_eq!(retry.0, StatusCode::CREATED);
    assert_eq!(header(&retry.1, "idempotent-replayed"), Some("true"));
    assert_eq!(retry.2, first.2);
    assert_eq!(handler.calls.load(Ordering::SeqCst), 1);
}

/// A webhook-style layer: the key from the `webhook-id` header, or from the body's
/// `/id`; the fingerprint over `/amount` only.
fn keyed_app(handler: Arc<Handler>, source: oncedb::http::KeySource) -> Router {
    let layer = IdempotencyLayer::new(Db::open(Options::in_memory()).unwrap(), |_| {
        Some("hooks".to_owned())
    })
    .key_source(source)
    .unwrap()
    .fingerprint_fields(vec!["/amount".to_owned()])
    .unwrap()
    .key_bytes(1..=255);
    Router::new()
        .route("/things", post(handle).route_layer(layer))
        .with_state(handler)
}

fn delivery(header: Option<(&str, &str)>, body: &'static str) -> Request<Body> {
    let mut builder = Request::post("/things").header("content-type", "application/json");
    if let Some((name, value)) = header {
        builder = builder.header(name, value);
    }
    builder.body(Body::from(body)).unwrap()
}

/// Keys from a header of the user's choice and from a body pointer: a duplicate
/// delivery replays; a change outside the fingerprint fields replays, one inside gets
/// `422`; a missing or malformed key is `400`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_come_from_any_header_or_a_body_pointer() {
    use oncedb::http::KeySource;
    let handler = Arc::new(Handler::default());
    let by_header = keyed_app(
        Arc::clone(&handler),
        KeySource::Header(axum::http::HeaderName::from_static("webhook-id")),
    );
    let hook = |body| {
        delivery(
            Some(("webhook-id", "msg_2KWPBgLlAfxdpx2AI54pPJ85f4W")),
            body,
        )
    };
    let first = send(&by_header, hook(r#"{"amount":5,"sent_at":1}"#)).await;
    assert_eq!(first.0, StatusCode::CREATED);
    let again = send(&by_header, hook(r#"{"sent_at":2,"amount":5}"#)).await;
    assert_eq!(again.0, StatusCode::CREATED);
    assert_eq!(header(&again.1, "idempotent-replayed"), Some("true"));
    assert_eq!(again.2, first.2);
    let changed = send(&by_header, hook(r#"{"amount":6,"sent_at":1}"#)).await;
    assert_eq!(changed.0, StatusCode::UNPROCESSABLE_ENTITY);
    let missing = send(&by_header, delivery(None, r#"{"amount":5}"#)).await;
    assert_eq!(missing.0, StatusCode::BAD_REQUEST);
    assert_eq!(handler.calls.load(Ordering::SeqCst), 1);

    let by_body = keyed_app(Arc::clone(&handler), KeySource::Body("/id".to_owned()));
    let event = r#"{"id":"evt_1NG8Du2eZvKYlo2C","amount":5,"created":1}"#;
    let first = send(&by_body, delivery(None, event)).await;
    assert_eq!(first.0, StatusCode::CREATED);
    let redelivered = r#"{"created":2,"amount":5,"id":"evt_1NG8Du2eZvKYlo2C"}"#;
    let again = send(&by_body, delivery(None, redelivered)).await;
    assert_eq!(header(&again.1, "idempotent-replayed"), Some("true"));
    assert_eq!(again.2, first.2);
    let changed = r#"{"id":"evt_1NG8Du2eZvKYlo2C","amount":7}"#;
    assert_eq!(
        send(&by_body, delivery(None, changed)).await.0,
        StatusCode::UNPROCESSABLE_ENTITY
    );
    // A body without its key is told a key is required, not a header.
    let keyless = send(&by_body, delivery(None, r#"{"amount":5}"#)).await;
    let problem: serde_json::Value = serde_json::from_slice(&keyless.2).unwrap();
    assert_eq!(
        problem["type"],
        "urn:oncedb:problem:idempotency_key_required"
    );
    assert_eq!(problem["title"], "An idempotency key is required");
    for bad in [
        r#"{"amount":5}"#,
        r#"{"id":{"x":1}}"#,
        "not json",
        r#"{"id":"has space"}"#,
    ] {
        let refused = send(&by_body, delivery(None, bad)).await;
        assert_eq!(refused.0, StatusCode::BAD_REQUEST, "{bad}");
    }
    assert_eq!(handler.calls.load(Ordering::SeqCst), 2);
    assert!(
        IdempotencyLayer::new(Db::open(Options::in_memory()).unwrap(), |_| None)
            .key_source(KeySource::Body("id".to_owned()))
            .is_err()
    );
}

/// With a lease timeout, the layer renews the lease while the handler runs: a retry that
/// waits for the outcome through five lease timeouts never takes over the handler still
/// running, and gets `409` at its deadline; the handler ran once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_running_handler_keeps_its_lease() {
    let handler = Arc::new(Handler::default());
    let db = Db::open(
        oncedb::StoreOptions::new(Duration::from_secs(60))
            .lease_timeout(Duration::from_millis(300))
            .embedded(Options::in_memory())
            .bucket_width(Duration::from_secs(6)),
    )
    .unwrap();
    let layer = IdempotencyLayer::new(db, |_| Some("tenant_a".to_owned()))
        .wait_for_outcome(Duration::from_millis(1500));
    let app = Router::new()
        .route("/things", post(handle).route_layer(layer))
        .with_state(Arc::clone(&handler));
    let first = tokio::spawn({
        let app = app.clone();
        async move { send(&app, request(Some(KEY), "wait", "{}")).await }
    });
    while handler.calls.load(Ordering::SeqCst) == 0 {
        tokio::task::yield_now().await;
    }
    let mut retry = tokio::spawn({
        let app = app.clone();
        async move { send(&app, request(Some(KEY), "wait", "{}")).await }
    });
    let answered = tokio::time::timeout(Duration::from_secs(20), &mut retry).await;
    assert_eq!(
        handler.calls.load(Ordering::SeqCst),
        1,
        "a retry took over a running handler"
    );
    let retry = answered
        .expect("the retry answers at its deadline")
        .unwrap();
    assert_eq!(retry.0, StatusCode::CONFLICT);
    handler.gate.notify_one();
    assert_eq!(first.await.unwrap().0, StatusCode::CREATED);
}
