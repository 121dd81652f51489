//! `oncedb bench --backend` against every backend, on real servers the test starts: the
//! run succeeds only when each workload admitted exactly the distinct keys of its stream,
//! and the table says so. It runs alone, as every test of this binary does: the servers
//! and `oncedb` it spawns are children (`support::serial`).

use crate::support::{oncedb, serial, servers};

use servers::postgres::PgServer;
use servers::redis::{RedisServer, start_cluster};

/// Runs the backend suite and returns the (admitted, distinct) pair of each row.
fn bench(backend: &str) -> Vec<(u64, u64)> {
    let out = oncedb(
        &[
            "bench",
            "--backend",
            backend,
            "--keys",
            "3000",
            "--tasks",
            "4",
        ],
        b"",
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{backend}: {stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rows: Vec<(u64, u64)> = stdout
        .lines()
        .filter(|line| line.starts_with("ids") || line.starts_with("records"))
        .map(|line| {
            let mut numbers = line.split_whitespace().rev();
            let distinct = numbers.next().unwrap().parse().unwrap();
            let admitted = numbers.next().unwrap().parse().unwrap();
            (admitted, distinct)
        })
        .collect();
    assert_eq!(rows.len(), 3, "{stdout}");
    rows
}

#[test]
fn every_backend_admits_exactly_the_distinct_keys() {
    let _serial = serial();
    let postgres = PgServer::start();
    let redis = RedisServer::start(false);
    let cluster = start_cluster();
    let nodes: Vec<String> = cluster
        .iter()
        .map(|node| format!("127.0.0.1:{}", node.port))
        .collect();
    let postgres_url = format!("postgres://oncedb@127.0.0.1:{}/postgres", postgres.port);
    for backend in [
        "embedded".to_owned(),
        postgres_url,
        redis.url(),
        format!("redis+cluster://{}", nodes.join(",")),
    ] {
        for (admitted, distinct) in bench(&backend) {
            // 3000 operations with 20% repeats.
            assert!(distinct > 2000 && distinct < 3000, "{backend}: {distinct}");
            assert_eq!(admitted, distinct, "{backend}");
        }
    }
}

/// A password in `--backend` is used to connect and never printed: not in the table,
/// not in an error line.
#[test]
fn a_password_in_the_backend_url_is_never_printed() {
    let _serial = serial();
    let postgres = PgServer::start();
    // The test server trusts loopback, so any password connects.
    let url = format!(
        "postgres://oncedb:hunter2@127.0.0.1:{}/postgres",
        postgres.port
    );
    let unreachable = "redis://default:hunter2@127.0.0.1:1/".to_owned();
    for (backend, succeeds) in [(url, true), (unreachable, false)] {
        let out = oncedb(&["bench", "--backend", &backend, "--keys", "300"], b"");
        let printed = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert_eq!(out.status.success(), succeeds, "{printed}");
        assert!(!printed.contains("hunter2"), "{printed}");
        assert!(printed.contains(":***@"), "{printed}");
    }
}
