//! The transactional outbox on bad days, on a real PostgreSQL: a message that can never
//! be published holds back its own aggregate only, with attempts, last error, back-off
//! and a dead state; and two open transactions writing for one aggregate are relayed in
//! the order they commit.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use oncedb::PostgresStore;
use oncedb::postgres::outbox::{self, NewMessage, OutboxMessage, OutboxStatus, Publisher, Relay};

use crate::support::servers::postgres::PgServer;

/// Collects what it publishes; refuses payloads `poison` until told to accept them.
#[derive(Clone, Default)]
struct Sink {
    got: Arc<Mutex<Vec<String>>>,
    accept_poison: Arc<std::sync::atomic::AtomicBool>,
}

impl Publisher for Sink {
    async fn publish(&self, message: &OutboxMessage) -> oncedb::Result<()> {
        let payload = String::from_utf8(message.payload.clone()).unwrap();
        if payload.ends_with("poison")
            && !self.accept_poison.load(std::sync::atomic::Ordering::SeqCst)
        {
            return Err(oncedb::Error::Backend {
                engine: "test broker",
                message: "message over the broker's max_payload".into(),
            });
        }
        self.got.lock().unwrap().push(payload);
        Ok(())
    }
}

async fn store(server: &PgServer) -> PostgresStore {
    let store = PostgresStore::connect(&server.url(), Duration::from_secs(60)).unwrap();
    store.migrate().await.unwrap();
    store
}

async fn enqueue(tx: &tokio_postgres::Transaction<'_>, aggregate: &str, payload: &str) {
    outbox::enqueue(
        tx,
        &NewMessage {
            id: None,
            aggregate_type: "order",
            aggregate_id: aggregate,
            message_type: "order.changed",
            payload: payload.as_bytes(),
        },
    )
    .await
    .unwrap();
}

async fn drain<P: Publisher>(relay: &Relay<P>) {
    while relay.run_once().await.unwrap() > 0 {}
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_holds_back_only_its_own_aggregate() {
    let server = PgServer::start();
    let store = store(&server).await;
    let mut client = store.pool().get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    for (aggregate, payload) in [("a", "a1 poison"), ("a", "a2"), ("b", "b1"), ("b", "b2")] {
        enqueue(&tx, aggregate, payload).await;
    }
    tx.commit().await.unwrap();
    let sink = Sink::default();
    let relay = Relay::new(&store, sink.clone())
        .max_attempts(3)
        .unwrap()
        .backoff(Duration::ZERO, Duration::ZERO);
    // The first round already publishes b, while a's head fails and waits.
    assert_eq!(relay.run_once().await.unwrap(), 2);
    assert_eq!(*sink.got.lock().unwrap(), ["b1", "b2"]);
    assert_eq!(outbox::status(&store).await.unwrap().retrying, 1);
    for _ in 0..5 {
        relay.run_once().await.unwrap();
    }
    // Aggregate b went out whole; a waits behind its poison message, which died.
    assert_eq!(*sink.got.lock().unwrap(), ["b1", "b2"]);
    assert_eq!(
        outbox::status(&store).await.unwrap(),
        OutboxStatus {
            pending: 1,
            retrying: 0,
            dead: 1
        }
    );
    let row = client
        .query_one(
            "SELECT id, attempts, last_error FROM outbox_messages WHERE dead_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap();
    let (id, attempts, error): (String, i32, String) = (row.get(0), row.get(1), row.get(2));
    assert_eq!(attempts, 3);
    assert!(error.contains("max_payload"), "{error}");
    // Fixed and revived: a goes out, in order.
    sink.accept_poison
        .store(true, std::sync::atomic::Ordering::SeqCst);
    assert!(outbox::revive(&store, &id).await.unwrap());
    drain(&relay).await;
    assert_eq!(*sink.got.lock().unwrap(), ["b1", "b2", "a1 poison", "a2"]);
    assert_eq!(
        outbox::status(&store).await.unwrap(),
        OutboxStatus::default()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_message_backs_off_and_keeps_its_error() {
    let server = PgServer::start();
    let store = store(&server).await;
    let mut client = store.pool().get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    enqueue(&tx, "c", "c1 poison").await;
    tx.commit().await.unwrap();
    let relay = Relay::new(&store, Sink::default())
        .backoff(Duration::from_secs(3600), Duration::from_secs(7200));
    assert_eq!(relay.run_once().await.unwrap(), 0);
    // Waiting an hour: the next rounds do not try it again.
    assert_eq!(relay.run_once().await.unwrap(), 0);
    let row = client
        .query_one(
            "SELECT attempts, next_attempt_at > now() + interval '50 minutes' FROM outbox_messages",
            &[],
        )
        .await
        .unwrap();
    assert_eq!((row.get::<_, i32>(0), row.get::<_, bool>(1)), (1, true));
    assert_eq!(outbox::status(&store).await.unwrap().retrying, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn messages_of_one_aggregate_are_relayed_in_commit_order() {
    let server = PgServer::start();
    let store = store(&server).await;
    let mut first = store.pool().get().await.unwrap();
    let first_tx = first.transaction().await.unwrap();
    enqueue(&first_tx, "x", "first").await;
    // A second transaction writes for the same aggregate and tries to commit before the
    // first does.
    let second_store = store.clone();
    let second = tokio::spawn(async move {
        let mut client = second_store.pool().get().await.unwrap();
        let tx = client.transaction().await.unwrap();
        enqueue(&tx, "x", "second").await;
        tx.commit().await.unwrap();
    });
    // Until it has committed, or waits on the first (it must wait: the aggregate's
    // counter row is the first transaction's).
    let watcher = store.pool().get().await.unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let waiting: i64 = watcher
            .query_one("SELECT count(*) FROM pg_locks WHERE NOT granted", &[])
            .await
            .unwrap()
            .get(0);
        if waiting > 0 || second.is_finished() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the second writer neither waited nor committed"
        );
        // Polling the server's own view; nothing in this process can signal it.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let sink = Sink::default();
    let relay = Relay::new(&store, sink.clone());
    // A relay running now sees at most what has committed.
    drain(&relay).await;
    first_tx.commit().await.unwrap();
    second.await.unwrap();
    drain(&relay).await;
    assert_eq!(*sink.got.lock().unwrap(), ["first", "second"]);
}
