//! The payments example (`examples/payments.rs`) as a real server in a child process,
//! driven over HTTP with reqwest: one provider call per key across retries, tenants,
//! 16 concurrent duplicates and a SIGKILL of the server; the refusals (`400`, `401`,
//! `413`, `422`); a timeout settled by reconciliation.

use crate::support::ExampleServer;

use std::path::Path;
use std::time::{Duration, Instant};

use oncedb::http::IdempotencyContext;
use reqwest::StatusCode;

/// The payments example as a child process, SIGKILLed on drop.
struct Payments(ExampleServer);

impl std::ops::Deref for Payments {
    type Target = ExampleServer;

    fn deref(&self) -> &ExampleServer {
        &self.0
    }
}

/// One answer: status, headers, body.
struct Answer {
    status: StatusCode,
    headers: reqwest::header::HeaderMap,
    body: String,
}

impl Answer {
    fn replayed(&self) -> bool {
        self.headers
            .get("idempotent-replayed")
            .is_some_and(|v| v == "true")
    }
}

impl Payments {
    /// Starts the example on a free loopback port with its store in `dir`.
    fn start(dir: &Path, flags: &[&str]) -> Payments {
        Payments(ExampleServer::start("payments", dir, flags))
    }

    async fn post(&self, headers: &[(&str, &str)], body: String) -> Answer {
        let mut request = self
            .http
            .post(format!("{}/v1/payments", self.base))
            .header("content-type", "application/json")
            .body(body);
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let response = request.send().await.unwrap();
        Answer {
            status: response.status(),
            headers: response.headers().clone(),
            body: response.text().await.unwrap(),
        }
    }

    async fn pay(&self, token: &str, key: &str, method: &str) -> Answer {
        let auth = format!("Bearer {token}");
        self.post(
            &[("authorization", &auth), ("idempotency-key", key)],
            body(method),
        )
        .await
    }

    /// Calls the provider saw for the payment of `key` by `tenant`.
    async fn provider_calls(&self, tenant: &str, key: &str) -> u64 {
        let operation_id = IdempotencyContext {
            tenant: tenant.to_owned(),
            operation: "POST /v1/payments".to_owned(),
            key: key.to_owned(),
        }
        .operation_id();
        // The id holds a space and slashes: percent-encode it for the path.
        let encoded: String = operation_id
            .bytes()
            .map(|b| {
                if b.is_ascii_alphanumeric() || b"-_.".contains(&b) {
                    char::from(b).to_string()
                } else {
                    format!("%{b:02X}")
                }
            })
            .collect();
        let value: serde_json::Value = self
            .http
            .get(format!("{}/v1/provider/calls/{encoded}", self.base))
            .send()
            .await
            .unwrap()
            .json_value()
            .await;
        value
            .get("calls")
            .and_then(serde_json::Value::as_u64)
            .unwrap()
    }
}

/// reqwest's `json` feature is off; the body is parsed here.
trait JsonValue {
    async fn json_value(self) -> serde_json::Value;
}

impl JsonValue for reqwest::Response {
    async fn json_value(self) -> serde_json::Value {
        serde_json::from_str(&self.text().await.unwrap()).unwrap()
    }
}

fn body(method: &str) -> String {
    format!(r#"{{"amount_cents": 5000, "currency": "USD", "payment_method_id": "{method}"}}"#)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_payments_example_charges_once_per_key() {
    let dir = tempfile::tempdir().unwrap();
    let app = Payments::start(dir.path(), &[]);
    let key = "7d1f6c1e-5a8b-4c6f-9a1e-2b3c4d5e6f70";
    let first = app.pay("tok_org_123", key, "pm_card_visa").await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    let payment: serde_json::Value = serde_json::from_str(&first.body).unwrap();
    assert_eq!(payment["status"], "authorized");
    assert_eq!(payment["amount_cents"], 5000);
    assert!(!first.replayed());
    let retry = app.pay("tok_org_123", key, "pm_card_visa").await;
    assert_eq!(
        (retry.status, &retry.body),
        (StatusCode::CREATED, &first.body)
    );
    assert!(retry.replayed());
    assert_eq!(app.provider_calls("org_123", key).await, 1);
    // The same key from another tenant is another payment.
    assert_eq!(
        app.pay("tok_org_456", key, "pm_card_visa").await.status,
        StatusCode::CREATED
    );
    assert_eq!(app.provider_calls("org_456", key).await, 1);
    // Unknown token, changed body.
    assert_eq!(
        app.pay("tok_nobody", key, "pm_card_visa").await.status,
        StatusCode::UNAUTHORIZED
    );
    let changed = app.pay("tok_org_123", key, "pm_other").await;
    assert_eq!(changed.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(app.provider_calls("org_123", key).await, 1);
    // A decline is stored and replayed.
    let declined = app
        .pay("tok_org_123", "declined-key-000000001", "pm_card_declined")
        .await;
    assert_eq!(declined.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(declined.body.contains("payment_declined"));
    let again = app
        .pay("tok_org_123", "declined-key-000000001", "pm_card_declined")
        .await;
    assert_eq!(
        (again.status, &again.body),
        (declined.status, &declined.body)
    );
    assert!(again.replayed());
    assert_eq!(
        app.provider_calls("org_123", "declined-key-000000001")
            .await,
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_keys_and_bodies_are_refused_by_the_example() {
    let dir = tempfile::tempdir().unwrap();
    let app = Payments::start(dir.path(), &[]);
    let auth = [("authorization", "Bearer tok_org_123")];
    let missing = app.post(&auth, body("pm_card_visa")).await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST, "{}", missing.body);
    let long = "k".repeat(256);
    for key in ["short", long.as_str(), "bad key with spaces"] {
        let answer = app.pay("tok_org_123", key, "pm_card_visa").await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "key {key:?}");
    }
    // Above the example's 64 KiB limit: refused before it is buffered.
    let huge = format!(
        r#"{{"amount_cents": 5000, "currency": "USD", "payment_method_id": "{}"}}"#,
        "p".repeat(100 * 1024)
    );
    let key = [
        ("authorization", "Bearer tok_org_123"),
        ("idempotency-key", "huge-body-key-00000001"),
    ];
    assert_eq!(
        app.post(&key, huge).await.status,
        StatusCode::PAYLOAD_TOO_LARGE
    );
    // None of them reached the provider or used the key.
    assert_eq!(
        app.provider_calls("org_123", "huge-body-key-00000001")
            .await,
        0
    );
    let fine = app
        .pay("tok_org_123", "huge-body-key-00000001", "pm_card_visa")
        .await;
    assert_eq!(fine.status, StatusCode::CREATED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_concurrent_duplicates_charge_once() {
    let dir = tempfile::tempdir().unwrap();
    let app = std::sync::Arc::new(Payments::start(dir.path(), &[]));
    let key = "slow-key-0000000000001";
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let app = std::sync::Arc::clone(&app);
        tasks.spawn(async move { app.pay("tok_org_123", key, "pm_slow").await });
    }
    let (mut created, mut conflicts) = (Vec::new(), 0);
    while let Some(answer) = tasks.join_next().await {
        let answer = answer.unwrap();
        match answer.status {
            StatusCode::CREATED => created.push(answer),
            StatusCode::CONFLICT => {
                assert!(answer.headers.contains_key("retry-after"));
                conflicts += 1;
            }
            other => panic!("unexpected {other}: {}", answer.body),
        }
    }
    // One request ran; the provider takes a second, so the others met it in flight
    // (or, arriving after it finished, got its replay).
    assert_eq!(app.provider_calls("org_123", key).await, 1);
    assert_eq!(created.iter().filter(|a| !a.replayed()).count(), 1);
    assert!(created.iter().all(|a| a.body == created[0].body));
    assert!(
        conflicts >= 1,
        "no duplicate met the first request in flight"
    );
    assert_eq!(created.len() + conflicts, 16);
    let after = app.pay("tok_org_123", key, "pm_slow").await;
    assert_eq!(
        (after.status, &after.body),
        (StatusCode::CREATED, &created[0].body)
    );
    assert!(after.replayed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_survives_a_sigkill_of_the_server() {
    let dir = tempfile::tempdir().unwrap();
    let key = "kill-key-0000000000001";
    let first = {
        let app = Payments::start(dir.path(), &[]);
        app.pay("tok_org_123", key, "pm_card_visa").await
        // Dropped: SIGKILL, no clean close.
    };
    assert_eq!(first.status, StatusCode::CREATED);
    let app = Payments::start(dir.path(), &[]);
    let retry = app.pay("tok_org_123", key, "pm_card_visa").await;
    assert_eq!(
        (retry.status, &retry.body),
        (StatusCode::CREATED, &first.body)
    );
    assert!(retry.replayed());
    // The restarted process never called its provider: the answer came from the store.
    assert_eq!(app.provider_calls("org_123", key).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timeout_is_settled_by_reconciliation() {
    let dir = tempfile::tempdir().unwrap();
    let app = Payments::start(dir.path(), &[]);
    let key = "timeout-key-0000000001";
    // A timeout leaves the outcome unknown; reconciliation finds the charge and
    // completes the record, and the retry gets the payment without a second charge.
    let timeout = app.pay("tok_org_123", key, "pm_timeout").await;
    assert_eq!(timeout.status, StatusCode::SERVICE_UNAVAILABLE);
    assert!(timeout.headers.contains_key("retry-after"));
    let deadline = Instant::now() + Duration::from_secs(30);
    let settled = loop {
        let answer = app.pay("tok_org_123", key, "pm_timeout").await;
        if answer.status != StatusCode::CONFLICT {
            break answer;
        }
        assert!(
            Instant::now() < deadline,
            "reconciliation never settled the payment"
        );
        // Polling a server that settles on its own schedule; nothing to wait on.
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert_eq!(settled.status, StatusCode::CREATED, "{}", settled.body);
    assert!(settled.replayed());
    assert_eq!(app.provider_calls("org_123", key).await, 1);
}

/// Requests per second through the example with and without the layer (docs/http.md):
/// `cargo build --release --all-features --example payments && cargo test --release
/// --all-features --test stores -- --ignored --nocapture requests_per_second`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "measurement, run by hand"]
async fn requests_per_second_with_and_without_the_layer() {
    const REQUESTS: usize = 20_000;
    const CLIENTS: usize = 32;
    let interval: &[&str] = &["--durability", "interval:10"];
    let runs: [(&str, &[&str], bool); 5] = [
        ("layer, Sync, new keys", &[], false),
        ("layer, Sync, replays", &[], true),
        ("layer, Interval(10 ms), new keys", interval, false),
        ("layer, Interval(10 ms), replays", interval, true),
        ("no layer", &["--without-layer"], false),
    ];
    for round in 0..3 {
        for (name, flags, replays) in runs {
            let dir = tempfile::tempdir().unwrap();
            let app = std::sync::Arc::new(Payments::start(dir.path(), flags));
            if replays {
                // Every client replays one key it charged once beforehand.
                for c in 0..CLIENTS {
                    app.pay(
                        "tok_org_123",
                        &format!("replayed-key-{c:08}"),
                        "pm_card_visa",
                    )
                    .await;
                }
            }
            let started = Instant::now();
            let mut tasks = tokio::task::JoinSet::new();
            for c in 0..CLIENTS {
                let app = std::sync::Arc::clone(&app);
                tasks.spawn(async move {
                    for i in (c..REQUESTS).step_by(CLIENTS) {
                        let key = if replays {
                            format!("replayed-key-{c:08}")
                        } else {
                            format!("load-key-{i:012}")
                        };
                        let answer = app.pay("tok_org_123", &key, "pm_card_visa").await;
                        assert_eq!(answer.status, StatusCode::CREATED);
                    }
                });
            }
            while let Some(task) = tasks.join_next().await {
                task.unwrap();
            }
            let seconds = started.elapsed().as_secs_f64();
            println!(
                "round {round}: {name}: {REQUESTS} requests in {seconds:.2} s ({:.0} requests/s)",
                REQUESTS as f64 / seconds
            );
        }
    }
}

/// A client that gives up before the provider answers (`pm_slow` takes about a second,
/// the client waits 500 ms): the request runs to the end without it, so the retry gets
/// the payment, replayed, and the provider was charged once; not a `409` for a record
/// left in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_gives_up_gets_the_payment_on_its_retry() {
    let dir = tempfile::tempdir().unwrap();
    let app = Payments::start(dir.path(), &[]);
    let key = "impatient-key-000000001";
    let impatient = app
        .http
        .post(format!("{}/v1/payments", app.base))
        .header("authorization", "Bearer tok_org_123")
        .header("idempotency-key", key)
        .header("content-type", "application/json")
        .body(body("pm_slow"))
        .timeout(Duration::from_millis(500))
        .send()
        .await;
    assert!(impatient.is_err(), "the client gave up first");
    // The abandoned request reaches the provider all the same.
    let deadline = Instant::now() + Duration::from_secs(30);
    while app.provider_calls("org_123", key).await == 0 {
        assert!(Instant::now() < deadline, "the abandoned request never ran");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let retry = loop {
        let answer = app.pay("tok_org_123", key, "pm_slow").await;
        if answer.status != StatusCode::CONFLICT {
            break answer;
        }
        assert!(
            Instant::now() < deadline,
            "the abandoned request never finished"
        );
        // The provider answers on its own schedule (about a second).
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(retry.status, StatusCode::CREATED, "{}", retry.body);
    assert!(
        retry.replayed(),
        "{} (provider calls {})",
        retry.body,
        app.provider_calls("org_123", key).await
    );
    assert_eq!(app.provider_calls("org_123", key).await, 1);
}
