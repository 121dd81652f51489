//! PostgreSQL beyond the conformance suite (feature `postgres`), on a real server the
//! tests start: migrations, the transactional inbox and outbox, the relay with several
//! workers, batched expiry, and crashes — of the server between a business update and
//! its commit, and of a relay between publishing and marking published.

use crate::support::servers;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use oncedb::postgres::inbox::{self, Received};
use oncedb::postgres::outbox::{self, NewMessage, OutboxMessage, Publisher, Relay};
use oncedb::{
    Error, Guarded, GuardedLease, MAX_POSTGRES_VERSION, OutagePolicy, PostgresStore, RecordStatus,
    Reservation, Scope, Store, StoreLease, StoreOptions,
};
use servers::postgres::PgServer;

async fn store(server: &PgServer, window: Duration) -> PostgresStore {
    let store = PostgresStore::connect(&server.url(), window).unwrap();
    store.migrate().await.unwrap();
    store
}

/// The business table of the tests: one row per applied payment.
async fn business_schema(store: &PostgresStore) {
    let client = store.pool().get().await.unwrap();
    client
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS payments (
                id text PRIMARY KEY, amount_cents integer NOT NULL CHECK (amount_cents > 0))",
        )
        .await
        .unwrap();
}

fn acquired<L>(answer: Reservation<L>) -> L {
    match answer {
        Reservation::Acquired(lease) => lease,
        _ => panic!("expected Acquired"),
    }
}

async fn count(store: &PostgresStore, sql: &str) -> i64 {
    let client = store.pool().get().await.unwrap();
    client.query_one(sql, &[]).await.unwrap().get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_apply_once_and_are_recorded() {
    let server = PgServer::start();
    let store = PostgresStore::connect(&server.url(), Duration::from_secs(60)).unwrap();
    // Nothing exists before the explicit call.
    assert!(matches!(
        store.insert_if_absent(b"k").await,
        Err(Error::Backend { .. })
    ));
    let first = tokio::join!(store.migrate(), store.migrate());
    // Two instances racing: the advisory lock lets one apply, the other finds it done.
    assert_eq!(
        first.0.unwrap() + first.1.unwrap(),
        oncedb::postgres::MIGRATIONS.len()
    );
    assert_eq!(store.migrate().await.unwrap(), 0);
    assert_eq!(
        count(&store, "SELECT count(*) FROM oncedb_schema_migrations").await,
        i64::try_from(oncedb::postgres::MIGRATIONS.len()).unwrap()
    );
    assert!(store.insert_if_absent(b"k").await.unwrap());
    // The partial indexes for cleanup and stuck records are there.
    assert_eq!(
        count(
            &store,
            "SELECT count(*) FROM pg_indexes WHERE indexname IN
             ('idempotency_records_expiration_idx', 'idempotency_records_processing_idx',
              'outbox_messages_unpublished_idx')"
        )
        .await,
        3
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn versions_and_resume() {
    let server = PgServer::start();
    let store = store(&server, Duration::from_secs(60)).await;
    let scope = Scope::new("t", "op");
    assert!(matches!(
        store
            .advance(&scope, b"agg", MAX_POSTGRES_VERSION + 1)
            .await,
        Err(Error::InvalidOptions(_))
    ));
    assert_eq!(
        store
            .advance(&scope, b"agg", MAX_POSTGRES_VERSION)
            .await
            .unwrap(),
        oncedb::Advance::Applied
    );
    let Reservation::Acquired(first) = store.reserve(&scope, b"w", b"req").await.unwrap() else {
        panic!("acquire");
    };
    let second = store.take_over(&scope, b"w").await.unwrap().unwrap();
    assert!(matches!(
        store.resume(&scope, b"w", first.epoch()).await,
        Err(Error::Fenced)
    ));
    let resumed = store.resume(&scope, b"w", second.epoch()).await.unwrap();
    resumed.complete(b"ok").await.unwrap();
    assert!(matches!(second.note(b"late").await, Err(Error::LeaseLost)));
    assert!(matches!(
        store.resume(&scope, b"absent", 1).await,
        Err(Error::LeaseLost)
    ));
}

/// Logs every `DELETE` statement on the store's tables with the number of rows it
/// deleted, through statement-level triggers.
async fn log_deletes(store: &PostgresStore) {
    let client = store.pool().get().await.unwrap();
    client
        .batch_execute(
            "CREATE TABLE delete_log (id bigserial PRIMARY KEY, tbl text NOT NULL, n bigint NOT NULL);
             CREATE FUNCTION log_delete() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 INSERT INTO delete_log (tbl, n) SELECT TG_TABLE_NAME, count(*) FROM gone;
                 RETURN NULL;
             END $$;",
        )
        .await
        .unwrap();
    for table in [
        "idempotency_records",
        "dedup_keys",
        "ordering_marks",
        "inbox_messages",
        "outbox_messages",
    ] {
        client
            .batch_execute(&format!(
                "CREATE TRIGGER {table}_deletes AFTER DELETE ON {table}
                 REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION log_delete()"
            ))
            .await
            .unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_rows_are_deleted_in_batches() {
    const BATCH: i64 = 7;
    let server = PgServer::start();
    let short = store(&server, Duration::from_millis(300)).await;
    let long = store(&server, Duration::from_secs(3600)).await;
    log_deletes(&short).await;
    let scope = Scope::new("t", "purge");
    // Live: 30 keys, 10 records (a completed one among them), two marks.
    let live_keys: Vec<Vec<u8>> = (100..130u32).map(|i| i.to_le_bytes().to_vec()).collect();
    long.insert_many(live_keys.clone()).await.unwrap();
    for i in 100..110u32 {
        let lease = acquired(long.reserve(&scope, &i.to_le_bytes(), b"r").await.unwrap());
        if i == 100 {
            lease.complete(b"kept").await.unwrap();
        }
    }
    for aggregate in [&b"live1"[..], b"live2"] {
        assert_eq!(
            long.advance(&scope, aggregate, 1).await.unwrap(),
            oncedb::Advance::Applied
        );
    }
    // Inbox and outbox: 12 inbox rows and 9 published outbox rows past the retention,
    // 5 recent inbox rows, 4 recently published and 3 unpublished outbox rows.
    {
        let client = short.pool().get().await.unwrap();
        client
            .batch_execute(
                "INSERT INTO inbox_messages (consumer_name, message_id, processed_at)
                 SELECT 'c', 'old' || i, now() - interval '2 hours' FROM generate_series(1, 12) i;
                 INSERT INTO inbox_messages (consumer_name, message_id)
                 SELECT 'c', 'new' || i FROM generate_series(1, 5) i;",
            )
            .await
            .unwrap();
    }
    {
        let mut client = short.pool().get().await.unwrap();
        let tx = client.transaction().await.unwrap();
        for (prefix, n) in [("old", 9), ("new", 4), ("unpublished", 3)] {
            for i in 0..n {
                let id = format!("{prefix}{i}");
                outbox::enqueue(
                    &tx,
                    &NewMessage {
                        id: Some(&id),
                        aggregate_type: "a",
                        aggregate_id: &id,
                        message_type: "m",
                        payload: b"",
                    },
                )
                .await
                .unwrap();
            }
        }
        tx.batch_execute(
            "UPDATE outbox_messages SET published_at = now() - interval '2 hours'
             WHERE id LIKE 'old%';
             UPDATE outbox_messages SET published_at = now() WHERE id LIKE 'new%';",
        )
        .await
        .unwrap();
        tx.commit().await.unwrap();
    }
    let retention = Duration::from_secs(3600);
    // Nothing has expired yet but the old inbox and outbox rows. (The rows of the short
    // window are written after this purge: its 300 ms could pass while the rows above are
    // written on a loaded machine.)
    assert_eq!(
        short
            .purge_expired(BATCH as usize, retention)
            .await
            .unwrap(),
        12 + 9
    );
    // Expiring: 50 keys, 20 records (half completed, half in flight), one mark.
    let keys: Vec<Vec<u8>> = (0..50u32).map(|i| i.to_le_bytes().to_vec()).collect();
    short.insert_many(keys).await.unwrap();
    for i in 0..20u32 {
        let lease = acquired(short.reserve(&scope, &i.to_le_bytes(), b"r").await.unwrap());
        if i % 2 == 0 {
            lease.complete(b"done").await.unwrap();
        }
    }
    assert_eq!(
        short.advance(&scope, b"agg", 1).await.unwrap(),
        oncedb::Advance::Applied
    );
    // Poll the server's clock until the short window's rows have expired.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while count(
        &short,
        "SELECT (SELECT count(*) FROM idempotency_records WHERE expires_at <= now())
              + (SELECT count(*) FROM dedup_keys WHERE expires_at <= now())
              + (SELECT count(*) FROM ordering_marks WHERE expires_at <= now())",
    )
    .await
        < 50 + 20 + 1
    {
        assert!(std::time::Instant::now() < deadline, "nothing expired");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let deleted = short
        .purge_expired(BATCH as usize, retention)
        .await
        .unwrap();
    assert_eq!(deleted, 50 + 20 + 1);

    // Each statement deleted at most a batch, and took as many statements as that needs.
    let client = short.pool().get().await.unwrap();
    let log: Vec<(String, i64)> = client
        .query("SELECT tbl, n FROM delete_log ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    assert!(
        log.iter().all(|(_, n)| *n <= BATCH),
        "a statement deleted more than {BATCH} rows: {log:?}"
    );
    let per_table = |table: &str| -> (i64, usize) {
        let mine: Vec<i64> = log
            .iter()
            .filter(|(t, _)| t == table)
            .map(|(_, n)| *n)
            .collect();
        (mine.iter().sum(), mine.iter().filter(|&&n| n > 0).count())
    };
    // Rows, and statements that deleted any: ceil(rows / 7) per purge statement.
    assert_eq!(per_table("dedup_keys"), (50, 8));
    assert_eq!(per_table("idempotency_records"), (20, 4));
    assert_eq!(per_table("ordering_marks"), (1, 1));
    assert_eq!(per_table("inbox_messages"), (12, 2));
    assert_eq!(per_table("outbox_messages"), (9, 2));

    // Nothing live was deleted, and the store still answers for it.
    assert_eq!(count(&short, "SELECT count(*) FROM dedup_keys").await, 30);
    assert_eq!(
        count(&short, "SELECT count(*) FROM idempotency_records").await,
        10
    );
    assert_eq!(
        count(&short, "SELECT count(*) FROM ordering_marks").await,
        2
    );
    assert_eq!(
        count(
            &short,
            "SELECT count(*) FROM inbox_messages WHERE message_id LIKE 'new%'"
        )
        .await,
        5
    );
    assert_eq!(
        count(&short, "SELECT count(*) FROM inbox_messages").await,
        5
    );
    assert_eq!(
        count(&short, "SELECT count(*) FROM outbox_messages").await,
        4 + 3
    );
    assert_eq!(
        count(
            &short,
            "SELECT count(*) FROM outbox_messages WHERE id LIKE 'old%'"
        )
        .await,
        0
    );
    assert!(
        long.insert_many(live_keys)
            .await
            .unwrap()
            .iter()
            .all(|&new| !new)
    );
    let kept = long
        .get(&scope, &100u32.to_le_bytes())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(kept.response(), Some(&b"kept"[..]));
    assert!(matches!(
        long.reserve(&scope, &101u32.to_le_bytes(), b"r")
            .await
            .unwrap(),
        Reservation::InFlight { .. }
    ));
    assert_eq!(
        long.advance(&scope, b"live1", 1).await.unwrap(),
        oncedb::Advance::Duplicate
    );
    // Another pass finds nothing more.
    assert_eq!(
        short
            .purge_expired(BATCH as usize, retention)
            .await
            .unwrap(),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_inbox_commits_and_rolls_back_with_the_business_update() {
    let server = PgServer::start();
    let store = store(&server, Duration::from_secs(60)).await;
    business_schema(&store).await;
    let mut client = store.pool().get().await.unwrap();

    // Rolled back: the message is not marked received.
    let tx = client.transaction().await.unwrap();
    assert_eq!(
        inbox::receive(&tx, "payments", "m1", Some("p1"))
            .await
            .unwrap(),
        Received::New
    );
    tx.execute("INSERT INTO payments VALUES ('p1', 500)", &[])
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    // Applied and committed once; the redelivery is a duplicate.
    for expected in [Received::New, Received::Duplicate] {
        let tx = client.transaction().await.unwrap();
        let received = inbox::receive(&tx, "payments", "m1", Some("p1"))
            .await
            .unwrap();
        assert_eq!(received, expected);
        if received == Received::New {
            tx.execute("INSERT INTO payments VALUES ('p1', 500)", &[])
                .await
                .unwrap();
        }
        tx.commit().await.unwrap();
    }
    // Another consumer has an inbox of its own.
    let tx = client.transaction().await.unwrap();
    assert_eq!(
        inbox::receive(&tx, "audit", "m1", None).await.unwrap(),
        Received::New
    );
    tx.commit().await.unwrap();
    assert_eq!(count(&store, "SELECT count(*) FROM payments").await, 1);

    // A concurrent delivery waits for the first transaction and then sees its outcome:
    // a duplicate after its commit, new after its rollback.
    for (message, commit, expected) in [
        ("m2", true, Received::Duplicate),
        ("m3", false, Received::New),
    ] {
        let tx = client.transaction().await.unwrap();
        assert_eq!(
            inbox::receive(&tx, "payments", message, None)
                .await
                .unwrap(),
            Received::New
        );
        let racer = deliver(&store, message);
        // The racer is provably concurrent: blocked on the first transaction's row.
        wait_for_lock_waiters(&store, 1).await;
        assert!(!racer.is_finished(), "the racer did not wait");
        if commit {
            tx.commit().await.unwrap();
        } else {
            tx.rollback().await.unwrap();
        }
        assert_eq!(racer.await.unwrap(), expected, "{message}");
        assert_eq!(
            count(
                &store,
                &format!("SELECT count(*) FROM inbox_messages WHERE message_id = '{message}'")
            )
            .await,
            1
        );
    }
}

/// A second delivery of `message` to the `payments` inbox in a transaction of its own,
/// committed.
fn deliver(store: &PostgresStore, message: &'static str) -> tokio::task::JoinHandle<Received> {
    let store = store.clone();
    tokio::spawn(async move {
        let mut client = store.pool().get().await.unwrap();
        let tx = client.transaction().await.unwrap();
        let received = inbox::receive(&tx, "payments", message, None)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        received
    })
}

/// Polls `pg_locks` until `waiters` lock requests wait, for at most 30 s: only the server
/// knows when a backend blocks.
async fn wait_for_lock_waiters(store: &PostgresStore, waiters: i64) {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while count(store, "SELECT count(*) FROM pg_locks WHERE NOT granted").await < waiters {
        assert!(
            std::time::Instant::now() < deadline,
            "no transaction waited within 30 s"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_crash_before_commit_leaves_neither_inbox_row_nor_business_row() {
    let server = PgServer::start();
    let store = store(&server, Duration::from_secs(60)).await;
    business_schema(&store).await;
    let mut client = store.pool().get().await.unwrap();
    // One message committed before the crash: it must survive it.
    let tx = client.transaction().await.unwrap();
    assert_eq!(
        inbox::receive(&tx, "payments", "kept", None).await.unwrap(),
        Received::New
    );
    tx.execute("INSERT INTO payments VALUES ('kept', 100)", &[])
        .await
        .unwrap();
    outbox::enqueue(
        &tx,
        &NewMessage {
            id: Some("evt-kept"),
            aggregate_type: "payment",
            aggregate_id: "kept",
            message_type: "payment.authorized",
            payload: b"{}",
        },
    )
    .await
    .unwrap();
    tx.commit().await.unwrap();

    // The second is between its business update and its commit when the server dies.
    let tx = client.transaction().await.unwrap();
    assert_eq!(
        inbox::receive(&tx, "payments", "lost", None).await.unwrap(),
        Received::New
    );
    tx.execute("INSERT INTO payments VALUES ('lost', 200)", &[])
        .await
        .unwrap();
    outbox::enqueue(
        &tx,
        &NewMessage {
            id: Some("evt-lost"),
            aggregate_type: "payment",
            aggregate_id: "lost",
            message_type: "payment.authorized",
            payload: b"{}",
        },
    )
    .await
    .unwrap();
    server.crash();
    assert!(
        tx.commit().await.is_err(),
        "a commit to a dead server cannot succeed"
    );
    drop(client);
    server.restart();

    let store = PostgresStore::connect(&server.url(), Duration::from_secs(60)).unwrap();
    let rows = |table: &'static str, column: &'static str| {
        let store = store.clone();
        async move {
            let client = store.pool().get().await.unwrap();
            let sql = format!("SELECT {column} FROM {table} ORDER BY 1");
            let rows = client.query(&sql, &[]).await.unwrap();
            rows.iter()
                .map(|row| row.get::<_, String>(0))
                .collect::<Vec<_>>()
        }
    };
    assert_eq!(rows("payments", "id").await, ["kept"]);
    assert_eq!(rows("inbox_messages", "message_id").await, ["kept"]);
    assert_eq!(rows("outbox_messages", "id").await, ["evt-kept"]);
    // The redelivered message is new again, and applies.
    let mut client = store.pool().get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    assert_eq!(
        inbox::receive(&tx, "payments", "lost", None).await.unwrap(),
        Received::New
    );
    tx.commit().await.unwrap();
}

/// A test sink: every published message in arrival order, with who published it.
#[derive(Clone, Default)]
struct Sink {
    got: Arc<Mutex<Vec<(usize, OutboxMessage)>>>,
    relay: usize,
}

impl Publisher for Sink {
    async fn publish(&self, message: &OutboxMessage) -> oncedb::Result<()> {
        self.got.lock().unwrap().push((self.relay, message.clone()));
        // Let other relays interleave.
        tokio::task::yield_now().await;
        Ok(())
    }
}

async fn write_messages(store: &PostgresStore, aggregates: usize, per_aggregate: usize) {
    let mut client = store.pool().get().await.unwrap();
    for round in 0..per_aggregate {
        let tx = client.transaction().await.unwrap();
        for aggregate in 0..aggregates {
            let payload = format!("{aggregate}:{round}");
            outbox::enqueue(
                &tx,
                &NewMessage {
                    id: Some(&format!("evt-{aggregate}-{round}")),
                    aggregate_type: "payment",
                    aggregate_id: &aggregate.to_string(),
                    message_type: "payment.updated",
                    payload: payload.as_bytes(),
                },
            )
            .await
            .unwrap();
        }
        tx.commit().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn relays_publish_each_message_once_in_aggregate_order() {
    let server = PgServer::start();
    let store = store(&server, Duration::from_secs(60)).await;
    let (aggregates, per_aggregate) = (40, 12);
    write_messages(&store, aggregates, per_aggregate).await;
    let total = aggregates * per_aggregate;
    let got = Arc::new(Mutex::new(Vec::new()));
    let done = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut workers = Vec::new();
    for relay in 0..3 {
        let sink = Sink {
            got: Arc::clone(&got),
            relay,
        };
        // Batches smaller than the number of aggregates, so relays claim different ones.
        let relay = Relay::new(&store, sink).batch(8).unwrap();
        let done = Arc::clone(&done);
        workers.push(tokio::spawn(async move {
            let mut published = 0;
            while done.load(std::sync::atomic::Ordering::SeqCst) < total {
                let n = relay.run_once().await.unwrap();
                done.fetch_add(n, std::sync::atomic::Ordering::SeqCst);
                published += n;
                if n == 0 {
                    tokio::task::yield_now().await;
                }
            }
            published
        }));
    }
    let mut published = Vec::new();
    for worker in workers {
        published.push(worker.await.unwrap());
    }
    let got = got.lock().unwrap().clone();
    assert_eq!(
        got.len(),
        aggregates * per_aggregate,
        "each message exactly once"
    );
    assert!(
        published.iter().filter(|&&n| n > 0).count() >= 2,
        "the relays shared the work: {published:?}"
    );
    let mut last_round: BTreeMap<String, i64> = BTreeMap::new();
    for (_, message) in got.iter() {
        let text = String::from_utf8(message.payload.clone()).unwrap();
        let (aggregate, round) = text.split_once(':').unwrap();
        let round: i64 = round.parse().unwrap();
        let previous = last_round.insert(aggregate.to_owned(), round).unwrap_or(-1);
        assert_eq!(round, previous + 1, "aggregate {aggregate} out of order");
        assert_eq!(message.id, format!("evt-{aggregate}-{round}"));
    }
    assert_eq!(
        count(
            &store,
            "SELECT count(*) FROM outbox_messages WHERE published_at IS NULL"
        )
        .await,
        0
    );
}

const RELAY_CHILD_URL: &str = "ONCEDB_RELAY_CHILD_URL";

/// A publisher that announces each message on stdout and then hangs before the relay can
/// mark anything published: the parent kills the process there.
struct Hang;

impl Publisher for Hang {
    async fn publish(&self, message: &OutboxMessage) -> oncedb::Result<()> {
        // Straight to the pipe, past the test harness's output capture.
        {
            let mut out = std::io::stdout().lock();
            writeln!(out, "published {}", message.id).unwrap();
            out.flush().unwrap();
        }
        std::future::pending::<()>().await;
        Ok(())
    }
}

/// The relay child of the relay crash test.
#[test]
#[ignore = "child process of the relay crash test"]
fn relay_child() {
    let Ok(url) = std::env::var(RELAY_CHILD_URL) else {
        return;
    };
    servers::runtime().block_on(async {
        let store = PostgresStore::connect(&url, Duration::from_secs(60)).unwrap();
        let relay = Relay::new(&store, Hang);
        relay.run_once().await.unwrap();
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_relay_killed_between_publish_and_mark_duplicates_only_same_ids() {
    let server = PgServer::start();
    let store = store(&server, Duration::from_secs(60)).await;
    write_messages(&store, 3, 5).await;
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "postgres::relay_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(RELAY_CHILD_URL, server.url())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let published_by_child = loop {
        let line = lines.next().expect("the child published nothing").unwrap();
        // The harness's "test postgres::relay_child ... " may share the line.
        if let Some((_, id)) = line.split_once("published ") {
            break id.to_owned();
        }
    };
    child.kill().unwrap();
    child.wait().unwrap();
    crate::support::await_dead_transactions(&store).await;

    let sink = Sink::default();
    let relay = Relay::new(&store, sink.clone());
    while relay.run_once().await.unwrap() > 0 {}
    let got = sink.got.lock().unwrap();
    let mut ids: Vec<&str> = got.iter().map(|(_, m)| m.id.as_str()).collect();
    // Nothing lost: every message, the one the killed relay published included, came out
    // again with its own id.
    assert!(ids.contains(&published_by_child.as_str()));
    ids.sort_unstable();
    ids.dedup();
    assert_eq!(ids.len(), 15);
    assert_eq!(got.len(), 15, "published again once, not twice");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_server_follows_the_outage_policy() {
    let server = PgServer::start();
    let store = store(&server, Duration::from_secs(60)).await;
    let open = Guarded::new(store.clone(), OutagePolicy::FailOpen);
    let closed = Guarded::new(store.clone(), OutagePolicy::FailClosed);
    assert!(open.insert_if_absent(b"before").await.unwrap());
    assert!(!closed.insert_if_absent(b"before").await.unwrap());
    let scope = Scope::new("t", "op");
    // Leases taken while the server is up, finished after it is gone.
    let open_lease = acquired(open.reserve(&scope, b"open", b"r").await.unwrap());
    let closed_lease = acquired(closed.reserve(&scope, b"closed", b"r").await.unwrap());
    assert!(matches!(open_lease, GuardedLease::Held(_)));
    assert_eq!(open.outages() + closed.outages(), 0);
    drop(server);

    // Fail open: admitted, unprotected, counted.
    assert!(open.insert_if_absent(b"before").await.unwrap());
    // A key repeated in the batch is still a duplicate the second time.
    assert_eq!(
        open.insert_many(vec![b"x".to_vec(), b"y".to_vec(), b"x".to_vec()])
            .await
            .unwrap(),
        [true, true, false]
    );
    let Reservation::Acquired(lease) = open.reserve(&scope, b"k", b"r").await.unwrap() else {
        panic!("fail-open reservations proceed");
    };
    assert!(matches!(lease, GuardedLease::Unprotected));
    lease.complete(b"nothing stored").await.unwrap();
    assert!(matches!(
        open.get(&scope, b"k").await,
        Err(Error::Unavailable { .. })
    ));
    assert_eq!(
        open.advance(&scope, b"agg", 3).await.unwrap(),
        oncedb::Advance::Applied
    );
    assert_eq!(open.lease_outages(), 0);
    open_lease.complete(b"outcome unknown").await.unwrap();
    assert_eq!(open.lease_outages(), 1);
    assert_eq!(open.outages(), 6);

    // Fail closed: refused, counted.
    crate::support::fails_closed(&closed, closed_lease, &scope).await;
    // Input errors are not outages.
    assert!(matches!(
        closed.insert_if_absent(b"").await,
        Err(Error::EmptyKey)
    ));
    assert_eq!(closed.outages(), 4);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_failing_part_way_admits_nothing() {
    let server = PgServer::start();
    let store = store(&server, Duration::from_secs(60)).await;
    // The server refuses the batch's last key (sorted last, so in its second statement of
    // 4096 keys) after the first statement has written its rows.
    let client = store.pool().get().await.unwrap();
    client
        .batch_execute(
            "CREATE FUNCTION refuse_key() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN RAISE EXCEPTION 'refused key'; END $$;
             CREATE TRIGGER refuse_poison BEFORE INSERT ON dedup_keys FOR EACH ROW
             WHEN (NEW.key = '\\xffffffff'::bytea) EXECUTE FUNCTION refuse_key();",
        )
        .await
        .unwrap();
    let mut keys: Vec<Vec<u8>> = (0..5000u32).map(|i| i.to_be_bytes().to_vec()).collect();
    keys.push(vec![0xff; 4]);
    assert!(matches!(
        store.insert_many(keys.clone()).await,
        Err(Error::Backend { .. })
    ));
    assert_eq!(count(&store, "SELECT count(*) FROM dedup_keys").await, 0);
    client
        .batch_execute("DROP TRIGGER refuse_poison ON dedup_keys")
        .await
        .unwrap();
    let answers = store.insert_many(keys).await.unwrap();
    assert_eq!(answers.len(), 5001);
    assert!(
        answers.iter().all(|&new| new),
        "a key of the failed batch stayed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_row_expires_within_the_window_on_the_server_clock() {
    let server = PgServer::start();
    let store = store(&server, Duration::from_secs(60)).await;
    let scope = Scope::new("t", "ttl");
    assert!(store.insert_if_absent(b"key").await.unwrap());
    store.insert_many(vec![b"batch".to_vec()]).await.unwrap();
    acquired(store.reserve(&scope, b"done", b"req").await.unwrap())
        .complete(b"ok")
        .await
        .unwrap();
    acquired(store.reserve(&scope, b"stuck", b"req").await.unwrap());
    store.take_over(&scope, b"stuck").await.unwrap().unwrap();
    assert_eq!(
        store.advance(&scope, b"agg", 1).await.unwrap(),
        oncedb::Advance::Applied
    );
    assert_eq!(
        store.advance(&scope, b"agg", 2).await.unwrap(),
        oncedb::Advance::Applied
    );
    for (table, rows) in [
        ("dedup_keys", 2),
        ("idempotency_records", 2),
        ("ordering_marks", 1),
    ] {
        let sql = format!(
            "SELECT count(*) FROM {table}
             WHERE expires_at > now() AND expires_at <= now() + interval '60 seconds'"
        );
        assert_eq!(count(&store, &sql).await, rows, "{table}");
        let all = format!("SELECT count(*) FROM {table}");
        assert_eq!(count(&store, &all).await, rows, "{table}");
    }
}

/// A server killed and started again: while it is down every call answers promptly with
/// `Unavailable`; after it is back the same store (its pool's dead connections replaced)
/// serves again, and everything acknowledged before the crash is still there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_server_serves_the_same_store_again() {
    let server = PgServer::start();
    let options = oncedb::StoreOptions::new(Duration::from_secs(60))
        .response_timeout(Duration::from_secs(1))
        .connect_timeout(Duration::from_secs(1));
    let store = PostgresStore::connect_with(&server.url(), options).unwrap();
    store.migrate().await.unwrap();
    let scope = Scope::new("t", "restart");
    assert!(store.insert_if_absent(b"before").await.unwrap());
    let lease = acquired(store.reserve(&scope, b"done", b"req").await.unwrap());
    lease.complete(b"the answer").await.unwrap();
    server.crash();
    let prompt = Duration::from_secs(5);
    for _ in 0..3 {
        let answer = tokio::time::timeout(prompt, store.insert_if_absent(b"during")).await;
        assert!(
            matches!(answer, Ok(Err(Error::Unavailable { .. }))),
            "{answer:?}"
        );
    }
    let answer = tokio::time::timeout(prompt, store.get(&scope, b"done")).await;
    assert!(
        matches!(answer, Ok(Err(Error::Unavailable { .. }))),
        "{answer:?}"
    );
    server.restart();
    // The pool reconnects by itself; poll the server through the store, with a deadline.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match store.insert_if_absent(b"after").await {
            Ok(new) => {
                assert!(new, "nothing was written while the server was down");
                break;
            }
            Err(Error::Unavailable { .. }) if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(err) => panic!("the store did not reconnect within 10 s: {err}"),
        }
    }
    assert!(!store.insert_if_absent(b"before").await.unwrap());
    assert!(
        store.insert_if_absent(b"during").await.unwrap(),
        "a call refused during the outage wrote nothing"
    );
    let record = store.get(&scope, b"done").await.unwrap().unwrap();
    assert_eq!(record.status(), RecordStatus::Completed);
    assert_eq!(record.response(), Some(&b"the answer"[..]));
}

/// Whether a backend other than this test's connections waits on a lock now.
async fn someone_waits_on_a_lock(store: &PostgresStore) -> bool {
    count(
        store,
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'",
    )
    .await
        > 0
}

/// A purge whose snapshot saw an expired row that a reservation in an open transaction
/// is replacing must not delete the replacement when that transaction commits: the
/// re-admitted record (and the re-admitted dedup key) stay, and the lease finishes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_never_deletes_a_row_re_admitted_while_it_runs() {
    let server = PgServer::start();
    let store = store(&server, Duration::from_millis(300)).await;
    let scope = Scope::new("t", "purge-race");
    acquired(store.reserve(&scope, b"r", b"req").await.unwrap())
        .complete(b"old")
        .await
        .unwrap();
    assert!(store.insert_if_absent(b"k").await.unwrap());
    // Real time passing on the server's clock is what expires the rows.
    tokio::time::sleep(Duration::from_millis(500)).await;

    // The expired rows are replaced in a transaction left open.
    let mut client = store.pool().get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let lease = acquired(store.reserve_in(&tx, &scope, b"r", b"req").await.unwrap());
    tx.execute(
        "UPDATE dedup_keys SET expires_at = now() + interval '1 hour' WHERE key = 'k'",
        &[],
    )
    .await
    .unwrap();

    let purging = store.clone();
    let purge =
        tokio::spawn(async move { purging.purge_expired(100, Duration::from_secs(60)).await });
    // The purge either waits on the replaced rows' locks or skips them; either way the
    // transaction then commits.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while !purge.is_finished() && !someone_waits_on_a_lock(&store).await {
        assert!(std::time::Instant::now() < deadline, "the purge never ran");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    lease.complete_in(&tx, b"new").await.unwrap();
    tx.commit().await.unwrap();
    purge.await.unwrap().unwrap();

    let Reservation::Completed(record) = store.reserve(&scope, b"r", b"req").await.unwrap() else {
        panic!("the re-admitted record was purged");
    };
    assert_eq!(record.response(), Some(&b"new"[..]));
    assert!(
        !store.insert_if_absent(b"k").await.unwrap(),
        "the re-admitted key was purged"
    );
}

/// A batch holding a lock on an expired row (re-admitting it) does not stall a purge,
/// which could otherwise deadlock with it: the purge leaves the locked row and deletes
/// the others while the batch's transaction is still open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_purge_never_waits_on_a_row_a_writer_holds() {
    let server = PgServer::start();
    let options =
        StoreOptions::new(Duration::from_millis(300)).response_timeout(Duration::from_secs(2));
    let store = PostgresStore::connect_with(&server.url(), options).unwrap();
    store.migrate().await.unwrap();
    let keys: Vec<Vec<u8>> = (0..10).map(|i| format!("k{i}").into_bytes()).collect();
    assert!(store.insert_many(keys).await.unwrap().iter().all(|a| *a));
    // Real time passing on the server's clock is what expires the rows.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let mut client = store.pool().get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    tx.execute(
        "UPDATE dedup_keys SET expires_at = now() + interval '1 hour' WHERE key = 'k5'",
        &[],
    )
    .await
    .unwrap();
    let deleted = store
        .purge_expired(3, Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(deleted, 9, "every expired row but the held one");
    tx.commit().await.unwrap();
    assert_eq!(count(&store, "SELECT count(*) FROM dedup_keys").await, 1);
}

/// A reservation that waits behind another transaction's reservation of the same key
/// for longer than the response timeout is `TimedOut`, which `FailOpen` passes on: it
/// never runs the caller unprotected while the first attempt is under way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reserve_waiting_on_a_lock_is_timed_out_not_an_outage() {
    let server = PgServer::start();
    let options =
        StoreOptions::new(Duration::from_secs(60)).response_timeout(Duration::from_millis(300));
    let store = PostgresStore::connect_with(&server.url(), options).unwrap();
    store.migrate().await.unwrap();
    let scope = Scope::new("t", "locked");
    let mut client = store.pool().get().await.unwrap();
    let tx = client.transaction().await.unwrap();
    let first = acquired(store.reserve_in(&tx, &scope, b"k", b"req").await.unwrap());

    let open = Guarded::new(store.clone(), OutagePolicy::FailOpen);
    let answer = open.reserve(&scope, b"k", b"req").await;
    assert!(
        matches!(answer, Err(Error::TimedOut { .. })),
        "{:?}",
        answer.map(|r| matches!(r, Reservation::Acquired(GuardedLease::Unprotected)))
    );
    assert_eq!(open.outages(), 0);
    first.complete_in(&tx, b"done").await.unwrap();
    tx.commit().await.unwrap();
    assert!(matches!(
        open.reserve(&scope, b"k", b"req").await.unwrap(),
        Reservation::Completed(_)
    ));
}

/// `migrate` is not bound by the response timeout: a migration that rewrites a table
/// longer than the timeout completes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_run_without_the_response_timeout() {
    let server = PgServer::start();
    let options =
        StoreOptions::new(Duration::from_secs(60)).response_timeout(Duration::from_millis(20));
    let store = PostgresStore::connect_with(&server.url(), options).unwrap();
    // The schema before migration 4, with enough rows that rewriting them takes longer
    // than the timeout.
    let client = store.pool().get().await.unwrap();
    client
        .batch_execute("SET statement_timeout = 0")
        .await
        .unwrap();
    for (version, name, sql) in oncedb::postgres::MIGRATIONS.iter().take(3) {
        client.batch_execute(sql).await.unwrap();
        client
            .execute(
                "CREATE TABLE IF NOT EXISTS oncedb_schema_migrations (
                    version integer PRIMARY KEY, name text NOT NULL,
                    applied_at timestamptz NOT NULL DEFAULT now())",
                &[],
            )
            .await
            .unwrap();
        client
            .execute(
                "INSERT INTO oncedb_schema_migrations (version, name) VALUES ($1, $2)",
                &[version, name],
            )
            .await
            .unwrap();
    }
    client
        .batch_execute(
            "INSERT INTO dedup_keys (key, expires_at)
             SELECT int8send(i), now() + interval '1 hour' FROM generate_series(1, 300000) i",
        )
        .await
        .unwrap();
    // Back to the store's timeout before the connection returns to the pool.
    client
        .batch_execute("RESET statement_timeout")
        .await
        .unwrap();
    drop(client);
    assert_eq!(
        store.migrate().await.unwrap(),
        oncedb::postgres::MIGRATIONS.len() - 3
    );
    assert!(!store.insert_if_absent(&7i64.to_be_bytes()).await.unwrap());
}

/// A waiter on a store with a listener and no lease timeout looks again at least every
/// second: an ending whose `NOTIFY` it never gets (a pooler in transaction mode, a wait
/// registered while the listener closes; here, an ending written without one) still
/// answers it long before its deadline, where it slept until the deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wait_whose_notify_is_lost_looks_again_before_its_deadline() {
    let server = PgServer::start();
    let store = store(&server, Duration::from_secs(3600)).await;
    let scope = Scope::new("t", "silent");
    let _held = acquired(store.reserve(&scope, b"k", b"req").await.unwrap());
    let client = store.pool().get().await.unwrap();
    let before: std::time::SystemTime = client.query_one("SELECT now()", &[]).await.unwrap().get(0);
    let waiter = {
        let (store, scope) = (store.clone(), scope.clone());
        tokio::spawn(async move {
            store
                .wait_finished(&scope, b"k", Duration::from_secs(60))
                .await
        })
    };
    // The waiter's first look has read the record in flight (only the server shows it).
    let looked = "SELECT count(*) FROM pg_stat_activity WHERE state = 'idle' \
                  AND query LIKE 'SELECT request_hash, status, response_body%' AND query_start > $1";
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while client
        .query_one(looked, &[&before])
        .await
        .unwrap()
        .get::<_, i64>(0)
        == 0
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the waiter never looked"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // The ending, written with no NOTIFY.
    let silent = "UPDATE idempotency_records SET status = 'completed', response_body = $1, \
                  finished_at = now(), updated_at = now() WHERE status = 'processing'";
    assert_eq!(
        client
            .execute(silent, &[&b"done".as_slice()])
            .await
            .unwrap(),
        1
    );
    let answer = tokio::time::timeout(Duration::from_secs(15), waiter)
        .await
        .expect("the waiter slept toward its deadline past a lost NOTIFY")
        .unwrap()
        .unwrap()
        .expect("the record");
    assert_eq!(answer.status(), RecordStatus::Completed);
}
