//! `Store` on real Redis servers (feature `redis`): one server, and a three-node Redis
//! Cluster. Each test starts its own `redis-server` processes on free loopback ports and
//! stops them when it ends, passed or failed. `.ci/run` installs Redis when it is missing.

#![cfg(feature = "redis")]
#![expect(clippy::unwrap_used, reason = "test code: a panic is the test failing")]
#![expect(clippy::expect_used, reason = "test code: a panic is the test failing")]

#[path = "shared/store_lifecycle.rs"]
mod store_lifecycle;

use std::net::{TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use oncedb::{Advance, Error, RedisStore, Reserved, Scope, Store, StoreLease};
use store_lifecycle::lifecycle;

/// A `redis-server` child, killed on drop.
struct RedisServer {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free loopback port whose cluster bus port (+10000) is free too.
fn free_port() -> u16 {
    loop {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        if port < 55_000 && TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// Polls `ready` until it holds, for at most ten seconds: an external server's start-up.
fn wait_for(what: &str, mut ready: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while !ready() {
        assert!(
            Instant::now() < deadline,
            "{what} did not happen within 10 s"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

impl RedisServer {
    fn start(cluster: bool) -> RedisServer {
        let port = free_port();
        let dir = tempfile::tempdir().unwrap();
        let mut command = Command::new("redis-server");
        command
            .args(["--port", &port.to_string(), "--bind", "127.0.0.1"])
            .args(["--save", "", "--appendonly", "no", "--protected-mode", "no"])
            .arg("--dir")
            .arg(dir.path())
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        if cluster {
            command.args([
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
            ]);
        }
        let child = command
            .spawn()
            .expect("redis-server must be installed (.ci/run installs it)");
        let server = RedisServer {
            child,
            port,
            _dir: dir,
        };
        wait_for("redis-server start", || {
            TcpStream::connect(("127.0.0.1", port)).is_ok()
        });
        server
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}/", self.port)
    }

    fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli must be installed (.ci/run installs it)");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

/// Three primaries sharing the 16384 slots.
fn start_cluster() -> Vec<RedisServer> {
    let nodes: Vec<RedisServer> = (0..3).map(|_| RedisServer::start(true)).collect();
    let addresses: Vec<String> = nodes
        .iter()
        .map(|node| format!("127.0.0.1:{}", node.port))
        .collect();
    let status = Command::new("redis-cli")
        .args(["--cluster", "create"])
        .args(&addresses)
        .args(["--cluster-replicas", "0", "--cluster-yes"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("redis-cli must be installed");
    assert!(status.success(), "redis-cli --cluster create failed");
    for node in &nodes {
        wait_for("cluster_state:ok", || {
            node.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok")
        });
    }
    nodes
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn one_server_serves_the_store_interface() {
    let server = RedisServer::start(false);
    runtime().block_on(async {
        let store = RedisStore::connect(&server.url(), "oncedb", Duration::from_secs(60))
            .await
            .unwrap();
        lifecycle(&store).await;
        // The ordering guard keeps versions Lua can count exactly.
        let scope = Scope::new("t", "op");
        assert!(matches!(
            store.advance(&scope, b"agg", u64::MAX).await,
            Err(Error::InvalidOptions(_))
        ));
        // Resume by epoch, and fencing of an older one.
        let Reserved::Acquired(first) = store.reserve(&scope, b"w", b"req").await.unwrap() else {
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
    });
}

#[test]
fn concurrent_reservations_have_one_winner() {
    let server = RedisServer::start(false);
    runtime().block_on(async {
        let store = RedisStore::connect(&server.url(), "oncedb", Duration::from_secs(60))
            .await
            .unwrap();
        let tasks: Vec<_> = (0..32)
            .map(|_| {
                let store = store.clone();
                tokio::spawn(async move {
                    let scope = Scope::new("t", "op");
                    matches!(
                        store.reserve(&scope, b"race", b"req").await.unwrap(),
                        Reserved::Acquired(_)
                    )
                })
            })
            .collect();
        let mut winners = 0;
        for task in tasks {
            winners += usize::from(task.await.unwrap());
        }
        assert_eq!(winners, 1);
        let answers = store
            .insert_many(
                (0..50u32)
                    .map(|i| (i % 40).to_le_bytes().to_vec())
                    .collect(),
            )
            .await
            .unwrap();
        assert_eq!(answers.iter().filter(|&&new| new).count(), 40);
    });
}

#[test]
fn a_cluster_serves_the_store_interface_across_slots() {
    let nodes = start_cluster();
    let urls: Vec<String> = nodes.iter().map(RedisServer::url).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    runtime().block_on(async {
        let store = RedisStore::connect_cluster(&urls, "oncedb", Duration::from_secs(60))
            .await
            .unwrap();
        lifecycle(&store).await;
        let keys: Vec<Vec<u8>> = (0..300u32).map(|i| i.to_le_bytes().to_vec()).collect();
        assert!(
            store
                .insert_many(keys.clone())
                .await
                .unwrap()
                .iter()
                .all(|&new| new)
        );
        assert!(
            store
                .insert_many(keys)
                .await
                .unwrap()
                .iter()
                .all(|&new| !new)
        );
        let scope = Scope::new("t", "op");
        assert_eq!(
            store.advance(&scope, b"agg", 1).await.unwrap(),
            Advance::Applied
        );
    });
    // The keys were spread over every primary.
    for node in &nodes {
        let keys: u64 = node.cli(&["DBSIZE"]).trim().parse().unwrap();
        assert!(keys > 10, "a primary holds only {keys} keys");
    }
}
