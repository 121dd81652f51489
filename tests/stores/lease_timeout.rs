//! `StoreOptions::lease_timeout` on the shared stores, on real servers: a reserve that
//! finds a record in flight under a lease granted at least that long ago takes it over
//! (a higher epoch, the old lease fenced); before that it answers `InFlight`.

use std::time::{Duration, Instant};

use oncedb::{
    Error, PostgresStore, RedisStore, Reservation, Scope, Store, StoreLease, StoreOptions,
};

use crate::support::servers::postgres::PgServer;
use crate::support::servers::redis::RedisServer;

const TIMEOUT: Duration = Duration::from_millis(300);

async fn stuck_records_are_taken_over<S: Store>(store: S) {
    let scope = Scope::new("org", "timeout");
    let Reservation::Acquired(first) = store.reserve(&scope, b"k", b"req").await.unwrap() else {
        panic!("a fresh key is acquired");
    };
    let since = Instant::now();
    // At once: still the first attempt's.
    assert!(matches!(
        store.reserve(&scope, b"k", b"req").await.unwrap(),
        Reservation::InFlight { .. }
    ));
    // The timeout is a span of the servers' or clients' clocks: poll until it has passed.
    let second = loop {
        match store.reserve(&scope, b"k", b"req").await.unwrap() {
            Reservation::Acquired(lease) => break lease,
            Reservation::InFlight { .. } => {}
            _ => panic!("a stuck record is taken over, not replayed"),
        }
        assert!(
            since.elapsed() < Duration::from_secs(30),
            "never taken over"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(since.elapsed() >= TIMEOUT, "taken over before the timeout");
    assert!(second.epoch() > first.epoch());
    assert!(matches!(first.complete(b"late").await, Err(Error::Fenced)));
    second.complete(b"done").await.unwrap();
    assert!(matches!(
        store.reserve(&scope, b"k", b"req").await.unwrap(),
        Reservation::Completed(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_takes_over_a_stuck_record() {
    let server = PgServer::start();
    let store = PostgresStore::connect_with(
        &server.url(),
        StoreOptions::new(Duration::from_secs(60)).lease_timeout(TIMEOUT),
    )
    .unwrap();
    store.migrate().await.unwrap();
    stuck_records_are_taken_over(store).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_takes_over_a_stuck_record() {
    let server = RedisServer::start(false);
    let store = RedisStore::connect_with(
        &server.url(),
        "timeout",
        StoreOptions::new(Duration::from_secs(60)).lease_timeout(TIMEOUT),
    )
    .await
    .unwrap();
    stuck_records_are_taken_over(store).await;
}
