//! What the modules of this binary share: real PostgreSQL, Redis and NATS servers, and
//! the examples' paths, from `oncedb_testkit::servers`.

pub use oncedb_testkit::servers;

/// Waits until PostgreSQL has ended every other session's open transaction: a killed
/// process's backend holds its row locks until the server notices the closed connection,
/// and a relay started before that would skip the locked rows. Polls the server's own
/// view (nothing in this process can signal it), for at most 30 s.
#[cfg(feature = "postgres")]
pub async fn await_dead_transactions(store: &oncedb::PostgresStore) {
    let client = store.pool().get().await.unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let open: i64 = client
            .query_one(
                "SELECT count(*) FROM pg_stat_activity \
                 WHERE state LIKE 'idle in transaction%' AND pid <> pg_backend_pid()",
                &[],
            )
            .await
            .unwrap()
            .get(0);
        if open == 0 {
            return;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the killed process's transaction never ended"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

/// With its server gone, a `FailClosed` store refuses every write (a key, a reserve, an
/// ordering check, and `lease`'s completion) with `Unavailable` and counts each, the
/// lease call among the lease outages.
#[cfg(feature = "async")]
pub async fn fails_closed<S: oncedb::Store>(
    closed: &oncedb::Guarded<S>,
    lease: oncedb::GuardedLease<S::Lease>,
    scope: &oncedb::Scope,
) {
    use oncedb::{Error, Store, StoreLease};
    assert!(matches!(
        closed.insert_if_absent(b"k").await,
        Err(Error::Unavailable { .. })
    ));
    assert!(matches!(
        closed.reserve(scope, b"r", b"req").await,
        Err(Error::Unavailable { .. })
    ));
    assert!(matches!(
        closed.advance(scope, b"agg", 7).await,
        Err(Error::Unavailable { .. })
    ));
    assert!(matches!(
        lease.complete(b"outcome unknown").await,
        Err(Error::Unavailable { .. })
    ));
    assert_eq!((closed.outages(), closed.lease_outages()), (4, 1));
}

/// Prints `line` to stdout at once, past the test harness's capture: a child process's
/// acknowledgements.
pub fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    out.write_all(line.as_bytes()).unwrap();
    out.flush().unwrap();
}

/// An example served by a child process on a free loopback port (`--addr`), SIGKILLed on
/// drop, so that a failed test stops it too.
#[cfg(feature = "http")]
pub struct ExampleServer {
    child: std::process::Child,
    /// `http://127.0.0.1:<port>`.
    pub base: String,
    pub http: reqwest::Client,
}

#[cfg(feature = "http")]
impl ExampleServer {
    /// Starts example `name` with `--addr`, `--dir dir` and `flags`, and waits until it
    /// accepts connections.
    pub fn start(name: &str, dir: &std::path::Path, flags: &[&str]) -> ExampleServer {
        let port = servers::free_port();
        let child = std::process::Command::new(servers::example(name))
            .args(["--addr", &format!("127.0.0.1:{port}"), "--dir"])
            .arg(dir)
            .args(flags)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        servers::wait_for("the example's start", || {
            std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        ExampleServer {
            child,
            base: format!("http://127.0.0.1:{port}"),
            http: reqwest::Client::new(),
        }
    }
}

#[cfg(feature = "http")]
impl Drop for ExampleServer {
    fn drop(&mut self) {
        // `Child::kill` is SIGKILL on Unix.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs ignored test `test` of this binary as a child process with `env`; the child
/// and its stdout's lines (where it `say`s how far it got).
pub fn child_test(
    test: &str,
    env: &[(&str, &str)],
) -> (
    std::process::Child,
    std::io::Lines<std::io::BufReader<std::process::ChildStdout>>,
) {
    use std::io::BufRead;
    let mut child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            test,
            "--nocapture",
            "--test-threads=1",
        ])
        .envs(env.iter().copied())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    (child, lines)
}
