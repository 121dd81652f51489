//! Reservations in the caller's transaction, on a real PostgreSQL: the record and the
//! business row commit together, roll back together, and a server crash before the
//! commit leaves neither.

use std::time::Duration;

use oncedb::{PostgresStore, Reservation, Scope, Store};

use crate::support::servers::postgres::PgServer;

async fn store(server: &PgServer) -> PostgresStore {
    let store = PostgresStore::connect(&server.url(), Duration::from_secs(60)).unwrap();
    store.migrate().await.unwrap();
    let client = store.pool().get().await.unwrap();
    client
        .batch_execute("CREATE TABLE IF NOT EXISTS charges (id text PRIMARY KEY)")
        .await
        .unwrap();
    store
}

async fn charges(store: &PostgresStore) -> i64 {
    let client = store.pool().get().await.unwrap();
    client
        .query_one("SELECT count(*) FROM charges", &[])
        .await
        .unwrap()
        .get(0)
}

fn scope() -> Scope {
    Scope::new("org", "charge")
}

/// Reserves `key` in a new transaction of `client`, writes the business row and
/// completes the lease in it; returns the open transaction.
async fn charge<'a>(
    store: &PostgresStore,
    client: &'a mut deadpool_postgres::Object,
    key: &str,
) -> deadpool_postgres::Transaction<'a> {
    let tx = client.transaction().await.unwrap();
    let Reservation::Acquired(lease) = store
        .reserve_in(&tx, &scope(), key.as_bytes(), b"req")
        .await
        .unwrap()
    else {
        panic!("a fresh key is acquired");
    };
    tx.execute("INSERT INTO charges VALUES ($1)", &[&key])
        .await
        .unwrap();
    lease.complete_in(&tx, b"charged").await.unwrap();
    tx
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_record_commits_and_rolls_back_with_the_business_row() {
    let server = PgServer::start();
    let store = store(&server).await;
    let mut client = store.pool().get().await.unwrap();
    charge(&store, &mut client, "kept")
        .await
        .commit()
        .await
        .unwrap();
    assert_eq!(charges(&store).await, 1);
    let Reservation::Completed(record) = store.reserve(&scope(), b"kept", b"req").await.unwrap()
    else {
        panic!("the committed record replays");
    };
    assert_eq!(record.response(), Some(&b"charged"[..]));
    charge(&store, &mut client, "undone")
        .await
        .rollback()
        .await
        .unwrap();
    assert_eq!(charges(&store).await, 1);
    assert!(matches!(
        store.reserve(&scope(), b"undone", b"req").await.unwrap(),
        Reservation::Acquired(_)
    ));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_crash_before_commit_leaves_neither_record_nor_business_row() {
    let server = PgServer::start();
    let store = store(&server).await;
    let mut client = store.pool().get().await.unwrap();
    let tx = charge(&store, &mut client, "lost").await;
    server.crash();
    assert!(
        tx.commit().await.is_err(),
        "a commit to a dead server cannot succeed"
    );
    drop(client);
    server.restart();
    let store = PostgresStore::connect(&server.url(), Duration::from_secs(60)).unwrap();
    assert_eq!(
        charges(&store).await,
        0,
        "the business row died with the commit"
    );
    assert!(
        store.get(&scope(), b"lost").await.unwrap().is_none(),
        "and so did the record"
    );
}
