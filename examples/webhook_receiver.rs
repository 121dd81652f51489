//! A webhook receiver: `POST /webhooks` behind the idempotency layer keyed by the
//! Standard Webhooks `webhook-id` header, so a sender's redelivery of one message (after
//! a timeout, a 5xx, or its own crash) gets the stored answer and the handler runs once
//! per message id. The fingerprint covers the event's `/type` and `/data` only: a
//! redelivery's other fields (a new `timestamp`) do not make it another request.
//!
//! ```sh
//! cargo run --example webhook_receiver -- --addr 127.0.0.1:8081 --dir /tmp/hooks
//! curl -s -X POST http://127.0.0.1:8081/webhooks -H 'webhook-id: msg_1' \
//!     -H 'content-type: application/json' -d '{"type":"invoice.paid","data":{"id":"in_1"}}'
//! curl -s http://127.0.0.1:8081/handled    # how many messages the handler processed
//! ```
//!
//! Senders of Stripe events put the id in the body instead: `KeySource::Body("/id")`.
//! A real receiver also checks the `webhook-signature` header before anything else (a
//! layer outside this one); this example leaves signatures out.

#![expect(
    clippy::expect_used,
    reason = "example: start-up failures abort with a message"
)]

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use axum::Router;
use axum::body::Bytes;
use axum::extract::{Extension, State};
use axum::http::{HeaderName, StatusCode};
use axum::routing::{get, post};
use oncedb::http::{IdempotencyContext, IdempotencyLayer, KeySource};
use oncedb::{Db, Durability, Options};

/// What the handler did: messages processed.
#[derive(Default)]
struct Receiver {
    handled: AtomicU64,
}

/// Processes one message (here: counts it) and answers what it did.
async fn receive(
    State(receiver): State<Arc<Receiver>>,
    Extension(context): Extension<IdempotencyContext>,
    body: Bytes,
) -> (StatusCode, String) {
    let n = receiver.handled.fetch_add(1, Ordering::SeqCst) + 1;
    (
        StatusCode::OK,
        format!(
            "processed message {} ({} bytes) as number {n}\n",
            context.key,
            body.len()
        ),
    )
}

async fn handled(State(receiver): State<Arc<Receiver>>) -> String {
    format!("{}\n", receiver.handled.load(Ordering::SeqCst))
}

/// The receiver's routes over `db`.
fn app(db: Db, receiver: Arc<Receiver>) -> Router {
    // Every sender is one tenant here; a multi-sender receiver takes the tenant from the
    // verified signature's key.
    let layer = IdempotencyLayer::new(db, |_| Some("webhooks".to_owned()))
        .key_source(KeySource::Header(HeaderName::from_static("webhook-id")))
        .expect("a header key source")
        .key_bytes(1..=255)
        .fingerprint_fields(vec!["/type".to_owned(), "/data".to_owned()])
        .expect("JSON Pointers")
        .wait_for_outcome(std::time::Duration::from_secs(10));
    Router::new()
        .route("/webhooks", post(receive).route_layer(layer))
        .route("/handled", get(handled))
        .with_state(receiver)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut addr, mut dir) = ("127.0.0.1:8081".to_owned(), None);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--addr" => addr = args.next().expect("--addr ADDR"),
            "--dir" => dir = Some(PathBuf::from(args.next().expect("--dir DIR"))),
            other => panic!("unknown flag {other}: use --addr ADDR --dir DIR"),
        }
    }
    let options = match dir {
        Some(dir) => Options::new(dir).durability(Durability::Sync),
        None => Options::in_memory(),
    };
    // A week of message ids: senders retry for up to a few days (Stripe for three,
    // Svix for about five); size the window past the sender's longest retry schedule.
    let db = Db::open(options.window(std::time::Duration::from_secs(7 * 86_400)))
        .expect("open the store");
    let addr: SocketAddr = addr.parse().expect("a socket address");
    let runtime = tokio::runtime::Runtime::new().expect("a runtime");
    runtime.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr).await.expect("bind");
        axum::serve(listener, app(db, Arc::new(Receiver::default())))
            .await
            .expect("serve");
    });
}
