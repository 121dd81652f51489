//! `run_once` across processes on the shared stores: a worker process runs an operation
//! that never ends, renewing its lease; another caller waiting longer than the lease
//! timeout is told the attempt is still in flight (never taken over); once the worker is
//! SIGKILLed mid-operation, the waiting caller takes the record over after the timeout
//! and runs the operation itself. PostgreSQL and Redis, real servers.

use std::io::BufReader;
use std::time::Duration;

use crate::support::servers;
use oncedb::{Error, Once, PostgresStore, RedisStore, RunOnce, Scope, Store, StoreOptions};

const LEASE_TIMEOUT: Duration = Duration::from_millis(600);
const CHILD_BACKEND: &str = "ONCEDB_WORKER_BACKEND";
const CHILD_URL: &str = "ONCEDB_WORKER_URL";

fn options() -> StoreOptions {
    StoreOptions::new(Duration::from_secs(600)).lease_timeout(LEASE_TIMEOUT)
}

async fn postgres(url: &str) -> PostgresStore {
    let store = PostgresStore::connect_with(url, options()).unwrap();
    store.migrate().await.unwrap();
    store
}

async fn redis(url: &str) -> RedisStore {
    RedisStore::connect_with(url, "workers", options())
        .await
        .unwrap()
}

/// The worker: runs the operation of key `job` and never finishes it, saying so
/// once inside (its lease renewed by `run_once` meanwhile).
#[test]
#[ignore = "child process of the run_once worker test"]
fn run_once_worker_child() {
    let (Ok(backend), Ok(url)) = (std::env::var(CHILD_BACKEND), std::env::var(CHILD_URL)) else {
        return;
    };
    let runtime = tokio::runtime::Runtime::new().unwrap();
    runtime.block_on(async {
        let never = |_epoch| async {
            crate::support::say("worker inside its operation\n");
            std::future::pending::<Result<Vec<u8>, String>>().await
        };
        let scope = Scope::new("t", "workers");
        let _ = match backend.as_str() {
            "postgres" => {
                postgres(&url)
                    .await
                    .run_once(&scope, (b"job", b"req"), RunOnce::new(), never)
                    .await
            }
            _ => {
                redis(&url)
                    .await
                    .run_once(&scope, (b"job", b"req"), RunOnce::new(), never)
                    .await
            }
        };
    });
}

/// A worker process, SIGKILLed on drop (a failed test stops it too), and its stdout,
/// kept open while it runs.
struct Worker(
    std::process::Child,
    std::io::Lines<BufReader<std::process::ChildStdout>>,
);

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the worker on `backend` at `url` and waits until it runs the operation.
fn start_worker(backend: &str, url: &str) -> Worker {
    let env = [(CHILD_BACKEND, backend), (CHILD_URL, url)];
    let (child, lines) = crate::support::child_test("workers::run_once_worker_child", &env);
    let mut worker = Worker(child, lines);
    assert!(
        worker
            .1
            .any(|line| line.is_ok_and(|line| line.contains("worker inside its operation"))),
        "the worker never started its operation"
    );
    worker
}

/// What the waiting caller sees while the worker renews, then after it is killed.
async fn renewing_then_killed<S: Store>(store: &S, mut worker: Worker) {
    let scope = Scope::new("t", "workers");
    let wait = RunOnce::new().wait(LEASE_TIMEOUT * 3);
    let busy = store
        .run_once(&scope, (b"job", b"req"), wait, |_| async {
            Ok::<_, String>(b"second".to_vec())
        })
        .await;
    assert!(matches!(busy, Err(Error::StillInFlight { .. })), "{busy:?}");
    // SIGKILL mid-operation: nothing renews the lease from now on.
    worker.0.kill().unwrap();
    worker.0.wait().unwrap();
    let taken = store
        .run_once(
            &scope,
            (b"job", b"req"),
            RunOnce::new().wait(LEASE_TIMEOUT * 20),
            |_| async { Ok::<_, String>(b"taken over".to_vec()) },
        )
        .await
        .unwrap();
    assert!(
        matches!(taken, Once::Ran(ref out) if out == b"taken over"),
        "{taken:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewing_worker_keeps_its_record_and_a_killed_one_is_taken_over_on_postgres() {
    let server = servers::postgres::PgServer::start();
    let store = postgres(&server.url()).await;
    let worker = start_worker("postgres", &server.url());
    renewing_then_killed(&store, worker).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewing_worker_keeps_its_record_and_a_killed_one_is_taken_over_on_redis() {
    let server = servers::redis::RedisServer::start(false);
    let store = redis(&server.url()).await;
    let worker = start_worker("redis", &server.url());
    renewing_then_killed(&store, worker).await;
}
