//! Replication to NATS JetStream (feature `replicate`), against real `nats-server -js`
//! processes the tests start: a writer killed with SIGKILL whose directory is then lost is
//! restored with every acknowledged key, also while a node of a three-node cluster (R3)
//! is killed and restarted; a restored replica fences its old owner, whose writes and
//! reopen are refused; async mode refuses writes past its lag while JetStream is down;
//! a damaged chunk is `Corrupted` at restore; expired buckets leave the replica.

use std::io::BufReader;
use std::path::Path;
use std::time::{Duration, Instant};

use crate::support::servers;
use oncedb::{Db, Durability, Error, Options, ReplicaMode, Replication};
use servers::nats::{NatsCluster, NatsServer, Release};

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

/// A manual clock at a bucket boundary.
fn manual_clock() -> oncedb::ManualClock {
    oncedb::ManualClock::new(std::time::UNIX_EPOCH + Duration::from_secs(1_700_000_040))
}

/// A store in `dir` with a ten-minute window of one-minute buckets on `clock`,
/// replicated in sync mode to replica `name` on `server`.
fn clocked(dir: &Path, clock: &oncedb::ManualClock, server: &NatsServer, name: &str) -> Options {
    Options::new(dir)
        .window(Duration::from_secs(600))
        .bucket_width(Duration::from_secs(60))
        .durability(Durability::Sync)
        .clock(clock.clone())
        .replicate(Replication::new(server.url(), name).replicas(1))
}

/// Opens `options`, trying again while JetStream is not ready yet (a cluster electing its
/// leaders answers "temporarily unavailable" for a few seconds after it starts).
pub(crate) fn open_when_ready(options: impl Fn() -> Options) -> Db {
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

/// A child process's store directory and server URL.
const CHILD_DIR: &str = "ONCEDB_REPLICA_CHILD_DIR";
const CHILD_URL: &str = "ONCEDB_REPLICA_CHILD_URL";

/// Runs test `test` of this binary as a child process (a writer or a restore), with its
/// directory and server URL in the environment; the child and its stdout's lines.
fn child(
    test: &str,
    dir: &Path,
    url: &str,
) -> (
    std::process::Child,
    std::io::Lines<BufReader<std::process::ChildStdout>>,
) {
    let dir = dir.to_string_lossy();
    crate::support::child_test(test, &[(CHILD_DIR, &dir), (CHILD_URL, url)])
}

/// The writer of the crash test: admits keys one by one on a replicating store (sync
/// mode, three stream replicas) and says `acked N` after each acknowledgement.
#[test]
#[ignore = "child process of the replication crash test"]
fn replica_writer_child() {
    let (Ok(dir), Ok(url)) = (std::env::var(CHILD_DIR), std::env::var(CHILD_URL)) else {
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
    let (mut child, mut lines) =
        child("replica::replica_writer_child", &writer_dir, &cluster.url());
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
    let mut calls;
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
    let replication = || Replication::new(server.url(), "fence").replicas(1);
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

/// A fenced owner learns that it is fenced even when the stream's last message is gone
/// (the new owner removed it: an expired segment, a run merged away). It asks the owner
/// subject who owns the replica, not the stream's last message, so its next write is
/// `NotOwner`; it used to look up the missing message, take that for JetStream being
/// down, and answer `Unavailable` for ever.
#[test]
fn a_fenced_owner_learns_it_when_the_streams_last_message_was_removed() {
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let replication = || Replication::new(server.url(), "gone").replicas(1);
    let old = open_when_ready(|| options(&work.path().join("old"), replication()));
    for n in 0..10 {
        assert!(old.insert_if_absent(&key(n)).unwrap());
    }
    let (new, _) = Db::restore(
        options(&work.path().join("new"), replication()),
        &mut |_, _| {},
    )
    .unwrap();
    drop(new);
    // A message after the claim, then removed: the stream's last sequence names nothing.
    servers::runtime().block_on(async {
        let client = async_nats::connect(server.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        js.publish("oncedb.gone.probe", "probe".into())
            .await
            .unwrap()
            .await
            .unwrap();
        let stream = js.get_stream("ONCEDB_gone").await.unwrap();
        stream.purge().filter("oncedb.gone.probe").await.unwrap();
    });
    match old.insert_if_absent(b"written after the claim") {
        Err(Error::NotOwner { .. }) => {}
        other => panic!("the fenced owner answered {other:?}"),
    }
}

/// A restore run while the old owner writes steadily (a rebalance with a zombie owner):
/// the restore claims the replica first, then copies to the stream's end as of the
/// claim, so it succeeds where it refused the replica as holding log its copy lacked. The
/// restored store holds every key the old owner was told was admitted, and the old owner's
/// writes after the claim are refused with `NotOwner`, none acknowledged: the key it was
/// refused is new to the restored store.
#[test]
fn a_restore_under_a_busy_owner_holds_every_acknowledged_write() {
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let replication = || Replication::new(server.url(), "busy").replicas(1);
    let db = open_when_ready(|| options(&work.path().join("owner"), replication()));
    let stop = std::sync::atomic::AtomicBool::new(false);
    let (restore, acked, refused) = std::thread::scope(|scope| {
        // Writes until fenced, or until the restore is over (it failed, or never fenced).
        let writer = scope.spawn(|| {
            let mut acked = Vec::new();
            let mut n = 0;
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                match db.insert_if_absent(&key(n)) {
                    Ok(true) => acked.push(n),
                    Err(Error::NotOwner { .. }) => return (acked, Some(n)),
                    // Outcome unknown: neither counted nor checked.
                    Err(Error::Unavailable { .. }) => {}
                    other => panic!("{other:?}"),
                }
                n += 1;
            }
            (acked, None)
        });
        servers::wait_for("the owner's first writes", || db.stats().admitted >= 50);
        let restored_dir = work.path().join("restored");
        let restore = Db::restore(options(&restored_dir, replication()), &mut |_, _| {})
            .map(|(restored, _)| drop(restored));
        // A fenced writer has returned already; any other stops here.
        if restore.is_err() {
            stop.store(true, std::sync::atomic::Ordering::Release);
        }
        let (acked, refused) = writer.join().unwrap();
        (restore, acked, refused)
    });
    restore.expect("a restore under a busy owner");
    let refused = refused.expect("the old owner was never fenced");
    let reopened = Db::open(options(&work.path().join("restored"), replication())).unwrap();
    for &n in &acked {
        assert!(
            reopened.contains(&key(n)).unwrap(),
            "key {n} was acknowledged by the old owner but the restore lacks it"
        );
    }
    assert!(
        !reopened.contains(&key(refused)).unwrap(),
        "the old owner's refused write reached the restored store"
    );
    assert!(acked.len() >= 50);
}

/// Async mode acknowledges after the local commit and ships behind it; while JetStream
/// is down it buffers up to its lag, then refuses writes with `Unavailable`, changing
/// nothing; once JetStream is back the lag drains and writes go on.
#[test]
fn async_mode_refuses_writes_past_its_lag_while_jetstream_is_down() {
    let mut server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let replication = Replication::new(server.url(), "lag")
        .replicas(1)
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

/// The segments of replica `name` on the server at `url`: subject count and bytes of the
/// stream, read with a client of the test's own.
/// The chunks of replica `name`'s segments the stream holds.
fn segment_messages(url: &str, name: &str) -> u64 {
    servers::runtime().block_on(async {
        let client = async_nats::connect(url).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream(format!("ONCEDB_{name}")).await.unwrap();
        let mut subjects = stream
            .info_with_subjects(format!("oncedb.{name}.seg.>"))
            .await
            .unwrap();
        let mut total = 0;
        while let Some(subject) = futures_util::StreamExt::next(&mut subjects).await {
            total += subject.unwrap().1 as u64;
        }
        total
    })
}

/// How many segment files the store in `dir` holds.
fn segment_files(dir: &Path) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|entry| {
            let name = entry.as_ref().unwrap().file_name();
            name.to_string_lossy().starts_with("seg-")
        })
        .count()
}

/// How many segment subjects replica `name`'s stream holds, and its bytes; `url` names
/// one server or several, separated by commas.
fn stream_state(url: &str, name: &str) -> (usize, u64) {
    let servers: Vec<async_nats::ServerAddr> =
        url.split(',').map(|url| url.parse().unwrap()).collect();
    servers::runtime().block_on(async {
        let client = async_nats::connect(servers).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let mut stream = js.get_stream(format!("ONCEDB_{name}")).await.unwrap();
        let bytes = stream.info().await.unwrap().state.bytes;
        let mut subjects = stream
            .info_with_subjects(format!("oncedb.{name}.seg.>"))
            .await
            .unwrap();
        let mut count = 0;
        while let Some(subject) = futures_util::StreamExt::next(&mut subjects).await {
            subject.unwrap();
            count += 1;
        }
        (count, bytes)
    })
}

/// Segments whose bucket left the window leave the replica too (purged by subject), a
/// restore brings back only the live window, and sealed segments are held in whole
/// chunks: the stream holds about what the store's files hold.
#[test]
fn expired_buckets_leave_the_replica_and_sealed_segments_are_compacted() {
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let options = |dir: &Path| clocked(dir, &clock, &server, "expiry").segment_max_bytes(16 << 10);
    let dir = work.path().join("db");
    let db = open_when_ready(|| options(&dir));
    // Ten minutes of keys, one write (and one shipped group) each, then ten more: the
    // first ten minutes' buckets leave the window.
    let mut n = 0;
    for _minute in 0..20 {
        for _ in 0..150 {
            assert!(db.insert_if_absent(&key(n)).unwrap());
            n += 1;
        }
        clock.forward(Duration::from_secs(60));
    }
    assert!(db.insert_if_absent(b"last").unwrap());
    db.flush().unwrap();
    let local_segments = segment_files(&dir);
    let local_bytes: u64 = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().metadata().unwrap().len())
        .sum();
    // The shipper purges and compacts on its next rounds: wait until the stream holds
    // the store's segments and no more.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (subjects, stream_bytes) = loop {
        let (subjects, bytes) = stream_state(&server.url(), "expiry");
        if subjects == local_segments && bytes <= local_bytes * 2 {
            break (subjects, bytes);
        }
        assert!(
            Instant::now() < deadline,
            "{subjects} subjects for {local_segments} segments, {bytes} bytes for {local_bytes}"
        );
        std::thread::yield_now();
    };
    assert!(subjects < 20, "expired segments purged: {subjects}");
    drop(db);
    std::fs::remove_dir_all(&dir).unwrap();
    let (restored, report) =
        Db::restore(options(&work.path().join("restored")), &mut |_, _| {}).unwrap();
    assert_eq!(report.expired_messages, 0, "{report:?}");
    assert!(restored.contains(&key(n - 1)).unwrap());
    assert!(restored.contains(b"last").unwrap());
    assert!(
        !restored.contains(&key(0)).unwrap(),
        "an expired key came back"
    );
    assert!(stream_bytes > 0);
}

/// Segments that left the window leave a replica on a three-node cluster, and the
/// replica outlives a restart of every node: each node replays the removals as they were
/// made. (On nats-server before 2.9.18 a restarted node replays a purge by subject as a
/// purge of the whole stream below it, nats-server#4196: the store deletes message by
/// message there, `removal.rs`.)
#[test]
fn expired_segments_leave_a_cluster_replica_that_outlives_a_restart_of_every_node() {
    expired_segments_leave_a_replica_that_outlives_restarts(Release::Newest);
}

/// The same on a server before 2.9.18, through the store's message-by-message deletes.
#[test]
fn expired_segments_are_deleted_one_by_one_on_a_server_before_the_purge_fix() {
    expired_segments_leave_a_replica_that_outlives_restarts(Release::BeforePurgeFix);
}

fn expired_segments_leave_a_replica_that_outlives_restarts(release: Release) {
    let mut cluster = NatsCluster::start_release(3, release);
    let url = cluster.url();
    let work = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let options = |dir: &Path| {
        Options::new(dir)
            .window(Duration::from_secs(600))
            .bucket_width(Duration::from_secs(60))
            .durability(Durability::Sync)
            .clock(clock.clone())
            .segment_max_bytes(16 << 10)
            .replicate(Replication::new(url.clone(), "restart").replicas(3))
    };
    let dir = work.path().join("db");
    let db = open_when_ready(|| options(&dir));
    let mut n = 0;
    for _minute in 0..14 {
        for _ in 0..40 {
            assert!(db.insert_if_absent(&key(n)).unwrap());
            n += 1;
        }
        clock.forward(Duration::from_secs(60));
    }
    assert!(db.insert_if_absent(b"last").unwrap());
    db.flush().unwrap();
    // The shipper removes the expired segments on its next rounds.
    let deadline = Instant::now() + Duration::from_secs(60);
    while stream_state(&url, "restart").0 != segment_files(&dir) {
        assert!(
            Instant::now() < deadline,
            "expired segments stay on the stream"
        );
        std::thread::yield_now();
    }
    drop(db);
    for node in 0..3 {
        cluster.kill(node);
    }
    for node in 0..3 {
        cluster.restart(node);
    }
    std::fs::remove_dir_all(&dir).unwrap();
    let restored_dir = work.path().join("restored");
    let deadline = Instant::now() + Duration::from_secs(60);
    let (restored, _) = loop {
        match Db::restore(options(&restored_dir), &mut |_, _| {}) {
            Err(Error::Unavailable { .. }) if Instant::now() < deadline => {
                std::thread::yield_now();
            }
            answer => break answer.unwrap(),
        }
    };
    // Every key of the live window, the first minute's gone.
    for live in 40 * 5..n {
        assert!(
            restored.contains(&key(live)).unwrap(),
            "live key {live} lost"
        );
    }
    assert!(restored.contains(b"last").unwrap());
    assert!(
        !restored.contains(&key(0)).unwrap(),
        "an expired key came back"
    );
    assert!(restored.insert_if_absent(b"after the restarts").unwrap());
}

/// A restore checks what it fetches: a chunk that leaves a gap in its segment is
/// `Corrupted`, and a chunk whose bytes were damaged is `Corrupted` at the open that
/// ends the restore (every frame's checksum is checked), never a smaller window.
#[test]
fn a_restore_refuses_a_damaged_replica() {
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let replication = || Replication::new(server.url(), "damage").replicas(1);
    let db = open_when_ready(|| options(&work.path().join("db"), replication()));
    for n in 0..400 {
        assert!(db.insert_if_absent(&key(n)).unwrap());
    }
    db.flush().unwrap();
    drop(db);
    let subject = servers::runtime().block_on(async {
        let client = async_nats::connect(server.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream("ONCEDB_damage").await.unwrap();
        // The oldest segment, sealed and compacted: take its bytes, flip one in the
        // middle, and put the damaged copy in its place.
        let mut subjects = stream
            .info_with_subjects("oncedb.damage.seg.>")
            .await
            .unwrap();
        let mut names = Vec::new();
        while let Some(subject) = futures_util::StreamExt::next(&mut subjects).await {
            names.push(subject.unwrap().0);
        }
        names.sort();
        let subject = names[0].clone();
        let whole = stream
            .get_last_raw_message_by_subject(&subject)
            .await
            .unwrap();
        assert_eq!(
            whole.headers.get("Oncedb-Offset").unwrap().as_str(),
            "0",
            "the sealed segment is one chunk"
        );
        let mut damaged = whole.payload.to_vec();
        let middle = damaged.len() / 2;
        damaged[middle] ^= 0x40;
        stream.purge().filter(&subject).await.unwrap();
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Oncedb-Offset", "0");
        js.publish_with_headers(subject.clone(), headers, damaged.into())
            .await
            .unwrap()
            .await
            .unwrap();
        subject
    });
    assert!(matches!(
        Db::restore(
            options(&work.path().join("r1"), replication()),
            &mut |_, _| {}
        ),
        Err(Error::Corrupted { .. })
    ));
    // A chunk past the end of what the replica holds of its segment: a gap.
    servers::runtime().block_on(async {
        let client = async_nats::connect(server.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let mut headers = async_nats::HeaderMap::new();
        headers.insert("Oncedb-Offset", "1000000");
        js.publish_with_headers(subject, headers, vec![1u8; 10].into())
            .await
            .unwrap()
            .await
            .unwrap();
    });
    let gap = Db::restore(
        options(&work.path().join("r2"), replication()),
        &mut |_, _| {},
    );
    let Err(Error::Corrupted { reason, .. }) = gap else {
        panic!("a gap restored");
    };
    assert!(reason.contains("misses bytes"), "{reason}");
}

/// A standby follows a replicating store as it writes (its lag falls to no pending
/// chunk); promoted, it copies only what it still lacks, holds every acknowledged write
/// and claims the replica: the old owner is refused its next write.
#[test]
fn a_standby_follows_and_its_promotion_copies_only_what_it_lacks() {
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let replication = || Replication::new(server.url(), "standby").replicas(1);
    // Segments large enough that none seals: the stream keeps every chunk (a sealed
    // segment's chunks are compacted into a few), so a standby starting from scratch
    // would read them all.
    let options =
        |dir: &Path, replication: Replication| options(dir, replication).segment_max_bytes(1 << 20);
    let old = open_when_ready(|| options(&work.path().join("old"), replication()));
    for n in 0..300 {
        assert!(old.insert_if_absent(&key(n)).unwrap());
    }
    let standby = Db::standby(options(&work.path().join("standby"), replication())).unwrap();
    let caught_up = |standby: &oncedb::Standby, at_least: u64| {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let lag = standby.lag().unwrap();
            if lag.applied_messages >= at_least && lag.pending_messages == 0 {
                return lag.applied_messages;
            }
            assert!(
                Instant::now() < deadline,
                "the standby never caught up: {lag:?}"
            );
            std::thread::yield_now();
        }
    };
    caught_up(&standby, 1);
    // Stopped and started again on its directory, a standby resumes after the chunks it
    // applied: it reads only the ones written meanwhile (one per acknowledged write in
    // sync mode with one writer), not the stream from its start.
    drop(standby);
    for n in 300..600 {
        assert!(old.insert_if_absent(&key(n)).unwrap());
    }
    let standby = Db::standby(options(&work.path().join("standby"), replication())).unwrap();
    let followed = caught_up(&standby, 1);
    let held = segment_messages(&server.url(), "standby");
    // About the 300 written while it was stopped, of about 600 the stream holds.
    assert!(
        followed <= held / 2 + 10,
        "the restarted standby read {followed} chunks of the {held} the stream holds"
    );
    assert!(old.insert_if_absent(&key(600)).unwrap());
    let (db, report) = standby.promote().unwrap();
    let at_promotion = report.messages - followed;
    assert!(
        at_promotion <= 5,
        "the promotion copied {at_promotion} chunks again"
    );
    for n in 0..=600 {
        assert!(db.contains(&key(n)).unwrap(), "key {n}");
    }
    assert!(matches!(
        old.insert_if_absent(b"after the promotion"),
        Err(Error::NotOwner { .. })
    ));
    assert!(
        db.insert_if_absent(b"written by the promoted store")
            .unwrap()
    );
}

/// The restore of the interrupted-restore test: stops for good after its third message
/// (saying `paused`), where the parent kills it.
#[test]
#[ignore = "child process of the interrupted-restore test"]
fn restore_child() {
    let (Ok(dir), Ok(url)) = (std::env::var(CHILD_DIR), std::env::var(CHILD_URL)) else {
        return;
    };
    let _ = Db::restore(
        options(
            Path::new(&dir),
            Replication::new(url, "interrupted").replicas(1),
        ),
        &mut |read, _| {
            if read == 3 {
                crate::support::say("paused\n");
                loop {
                    std::thread::park();
                }
            }
        },
    );
}

/// A standby that loses its replica (the server killed) says so through `lag()`, where
/// its thread ended silently and `lag()` kept its last values; once the server is back it
/// follows again from where it was, and its promotion holds every key, those written
/// after the outage too.
#[test]
fn a_standby_reports_a_lost_replica_and_follows_again() {
    let mut server = NatsServer::start();
    let url = server.url();
    let work = tempfile::tempdir().unwrap();
    let replication = || Replication::new(url.clone(), "outage").replicas(1);
    let old = open_when_ready(|| options(&work.path().join("old"), replication()));
    for n in 0..50 {
        assert!(old.insert_if_absent(&key(n)).unwrap());
    }
    let standby = Db::standby(options(&work.path().join("standby"), replication())).unwrap();
    let following = |standby: &oncedb::Standby, more_than: u64| {
        servers::wait_for("the standby to follow", || {
            standby
                .lag()
                .is_ok_and(|lag| lag.applied_messages > more_than && lag.pending_messages == 0)
        });
        standby.lag().unwrap().applied_messages
    };
    let before = following(&standby, 0);
    server.stop();
    servers::wait_for("the standby to report the outage", || {
        standby.lag().is_err()
    });
    let outage = standby.lag().unwrap_err();
    assert!(outage.to_string().contains("not following"), "{outage}");
    server.start_again();
    for n in 50..100 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match old.insert_if_absent(&key(n)) {
                Ok(admitted) => break assert!(admitted),
                Err(Error::Unavailable { .. }) if Instant::now() < deadline => {}
                Err(err) => panic!("{err}"),
            }
        }
    }
    following(&standby, before);
    drop(old);
    let (promoted, _) = standby.promote().unwrap();
    for n in 0..100 {
        assert!(promoted.contains(&key(n)).unwrap(), "key {n}");
    }
}

/// A restore SIGKILLed part-way leaves segment files, its claim and no manifest; run
/// again on the same directory, it claims anew, completes them, and the store holds every
/// key.
#[test]
fn a_restore_killed_part_way_is_run_again() {
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let replication = || Replication::new(server.url(), "interrupted").replicas(1);
    let db = open_when_ready(|| options(&work.path().join("db"), replication()));
    for n in 0..400 {
        assert!(db.insert_if_absent(&key(n)).unwrap());
    }
    drop(db);
    let dir = work.path().join("restored");
    let (mut child, mut lines) = child("replica::restore_child", &dir, &server.url());
    while !lines
        .next()
        .expect("the restore ended before it paused")
        .unwrap()
        .contains("paused")
    {}
    child.kill().unwrap();
    child.wait().unwrap();
    let left: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    // Segment files, and the claim made before anything was copied; no manifest.
    assert!(
        left.iter().any(|name| name.starts_with("seg-"))
            && left.iter().any(|name| name == "REPLICA")
            && left
                .iter()
                .all(|name| name.starts_with("seg-") || name == "REPLICA"),
        "{left:?}"
    );
    let (restored, _) = Db::restore(options(&dir, replication()), &mut |_, _| {}).unwrap();
    for n in 0..400 {
        assert!(restored.contains(&key(n)).unwrap(), "key {n}");
    }
}

/// The writer of the async loss test: admits keys one by one in async mode and says
/// `acked N lag L` after each acknowledgement, `L` the replication lag then.
#[test]
#[ignore = "child process of the async loss test"]
fn async_writer_child() {
    let (Ok(dir), Ok(url)) = (std::env::var(CHILD_DIR), std::env::var(CHILD_URL)) else {
        return;
    };
    let replication = Replication::new(url, "async-loss")
        .replicas(1)
        .mode(ReplicaMode::Async);
    let db = open_when_ready(|| options(Path::new(&dir), replication.clone()));
    for n in 0.. {
        assert!(db.insert_if_absent(&key(n)).unwrap());
        let lag = db.stats().replication_lag_bytes;
        crate::support::say(&format!("acked {n} lag {lag}\n"));
    }
}

/// Async mode: a writer killed while JetStream was unreachable for part of its run,
/// whose directory is then lost, is restored with every key it acknowledged but those
/// the lag it reported last covers: no more is lost than that lag (each lost key's
/// entry takes at least 48 bytes of log).
#[test]
fn async_mode_loses_at_most_the_lag_it_reported() {
    let mut server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let writer_dir = work.path().join("writer");
    let (mut child, mut lines) = child("replica::async_writer_child", &writer_dir, &server.url());
    let last = loop {
        let line = lines.next().expect("the writer stopped").unwrap();
        let Some((_, report)) = line.split_once("acked ") else {
            continue;
        };
        let (n, lag) = report.split_once(" lag ").unwrap();
        let (n, lag): (u64, u64) = (n.parse().unwrap(), lag.trim().parse().unwrap());
        if n == 300 {
            // JetStream goes away: the lag grows from here.
            server.stop();
        }
        if n == 600 {
            break (n, lag);
        }
    };
    child.kill().unwrap();
    child.wait().unwrap();
    server.start_again();
    std::fs::remove_dir_all(&writer_dir).unwrap();
    let (lost_before, lag) = last;
    assert!(lag > 0, "the lag was reported");
    let (db, _) = Db::restore(
        options(
            &work.path().join("restored"),
            Replication::new(server.url(), "async-loss").replicas(1),
        ),
        &mut |_, _| {},
    )
    .unwrap();
    let lost = (0..=lost_before)
        .filter(|n| !db.contains(&key(*n)).unwrap())
        .count() as u64;
    assert!(lost > 0, "JetStream was down: some keys were not shipped");
    assert!(
        lost * 48 <= lag,
        "{lost} keys lost, more than the reported lag of {lag} bytes covers"
    );
}

/// The window stays exact across a restore: stepping one clock through the end of a
/// key's window, second by second, the restored store answers as the store it was
/// restored from, and the key leaves both at the same step.
#[test]
fn a_restored_window_expires_exactly_as_the_original() {
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let options = |dir: &Path| clocked(dir, &clock, &server, "boundary");
    let original = open_when_ready(|| options(&work.path().join("db")));
    assert!(original.insert_if_absent(b"early").unwrap());
    clock.forward(Duration::from_secs(90));
    assert!(original.insert_if_absent(b"later").unwrap());
    let (restored, _) =
        Db::restore(options(&work.path().join("restored")), &mut |_, _| {}).unwrap();
    clock.forward(Duration::from_secs(400));
    let mut left_at = None;
    for second in 0..300 {
        for key in [&b"early"[..], &b"later"[..]] {
            assert_eq!(
                restored.contains(key).unwrap(),
                original.contains(key).unwrap(),
                "{} at +{second} s",
                String::from_utf8_lossy(key)
            );
        }
        if left_at.is_none() && !restored.contains(b"early").unwrap() {
            left_at = Some(second);
        }
        clock.forward(Duration::from_secs(1));
    }
    assert!(left_at.is_some(), "the early key never left the window");
    assert!(!restored.contains(b"later").unwrap());
}

/// The run subjects of replica `name` and the chunks each holds.
fn run_subjects(url: &str, name: &str) -> Vec<(String, usize)> {
    servers::runtime().block_on(async {
        let client = async_nats::connect(url).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream(format!("ONCEDB_{name}")).await.unwrap();
        let mut subjects = stream
            .info_with_subjects(format!("oncedb.{name}.run.>"))
            .await
            .unwrap();
        let mut found = Vec::new();
        while let Some(subject) = futures_util::StreamExt::next(&mut subjects).await {
            found.push(subject.unwrap());
        }
        found.sort();
        found
    })
}

/// How many files of `dir` have `extension`.
fn files_with_extension(dir: &Path, extension: &str) -> usize {
    std::fs::read_dir(dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .path()
                .extension()
                .is_some_and(|x| x == extension)
        })
        .count()
}

/// A store under a memory budget whose runs are all on the replica (whole: their last
/// chunk reaches their length), every one of its keys admitted.
fn budgeted_store_shipped(server: &NatsServer, dir: &Path, name: &str, keys: u64) -> Db {
    let db = open_when_ready(|| {
        options(dir, Replication::new(server.url(), name).replicas(1))
            .memory_budget(1 << 16)
            .shards(4)
    });
    let all: Vec<Vec<u8>> = (0..keys).map(key).collect();
    for batch in all.chunks(256) {
        assert!(db.insert_many(batch).unwrap().iter().all(|&new| new));
    }
    db.flush().unwrap();
    let runs = || files_with_extension(dir, "keys");
    assert!(runs() >= 1, "the budget sealed no run");
    // The shipper lists the directory twice a second: wait until the store says the
    // replica holds every live run whole, then check the stream does.
    let deadline = Instant::now() + Duration::from_secs(60);
    while db.stats().replication_runs_unshipped > 0 {
        assert!(Instant::now() < deadline, "the runs were not shipped");
        std::thread::yield_now();
    }
    assert_eq!(run_subjects(&server.url(), name).len(), runs());
    assert!(runs_whole(server, name));
    db
}

/// Whether every run on replica `name` is whole: its last chunk reaches its length.
fn runs_whole(server: &NatsServer, name: &str) -> bool {
    let subjects = run_subjects(&server.url(), name);
    servers::runtime().block_on(async {
        let client = async_nats::connect(server.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream(format!("ONCEDB_{name}")).await.unwrap();
        for (subject, _) in subjects {
            let last = stream
                .get_last_raw_message_by_subject(&subject)
                .await
                .unwrap();
            let header =
                |h: &str| -> u64 { last.headers.get(h).unwrap().as_str().parse().unwrap() };
            if header("Oncedb-Offset") + last.payload.len() as u64 != header("Oncedb-Length") {
                return false;
            }
        }
        true
    })
}

/// Sealed key runs ship beside the log and a restore fetches them (checked whole) so
/// that the restored store reads its keys from runs, not from a replay of every key;
/// every key stays a duplicate. A run the replica holds only in part is left out with
/// every later run (their keys are replayed from the log), and a damaged run is
/// `Corrupted`.
#[test]
fn sealed_runs_are_shipped_and_restored_whole() {
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let db = budgeted_store_shipped(&server, &work.path().join("db"), "runs", 20_000);
    let local_runs = run_subjects(&server.url(), "runs").len() as u64;
    drop(db);
    let restore = |to: &str| {
        Db::restore(
            options(
                &work.path().join(to),
                Replication::new(server.url(), "runs").replicas(1),
            )
            .memory_budget(1 << 16)
            .shards(4),
            &mut |_, _| {},
        )
    };
    let (restored, report) = restore("r1").unwrap();
    assert_eq!(report.runs, local_runs, "{report:?}");
    let stats = restored.stats();
    assert!(stats.sealed_runs >= local_runs, "{stats:?}");
    let all: Vec<Vec<u8>> = (0..20_000).map(key).collect();
    for batch in all.chunks(256) {
        assert!(restored.insert_many(batch).unwrap().iter().all(|&new| !new));
    }
    drop(restored);

    // The newest run held in part: a chunk claiming a longer run than it ends. Restores
    // keep the runs before it, and still every key.
    let subjects = run_subjects(&server.url(), "runs");
    let (newest, _) = subjects.last().unwrap().clone();
    servers::runtime().block_on(async {
        let client = async_nats::connect(server.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream("ONCEDB_runs").await.unwrap();
        let last = stream
            .get_last_raw_message_by_subject(&newest)
            .await
            .unwrap();
        let mut headers = async_nats::HeaderMap::new();
        let offset = last
            .headers
            .get("Oncedb-Offset")
            .unwrap()
            .as_str()
            .to_owned();
        headers.insert("Oncedb-Offset", offset.as_str());
        headers.insert("Oncedb-Length", "100000000");
        js.publish_with_headers(newest.clone(), headers, last.payload.clone())
            .await
            .unwrap()
            .await
            .unwrap();
    });
    let (partial, report) = restore("r2").unwrap();
    assert_eq!(report.runs, local_runs - 1, "{report:?}");
    for batch in all.chunks(256) {
        assert!(partial.insert_many(batch).unwrap().iter().all(|&new| !new));
    }
    drop(partial);
}

/// A run reaches the replica only after the log its cover names (finding: a run shipped
/// first left a replica whose restore refused to open, "covers a log position the store
/// never reached"). Under `Interval` a key run covers log appended but not yet fsynced,
/// so not yet shipped: the shipper holds every such run back, and says so in
/// `replication_runs_awaiting_log`, and a restore at that moment opens. After an fsync
/// ships the log, the runs follow and a restore holds every key.
#[test]
fn a_run_waits_on_the_replica_for_the_log_its_cover_names() {
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    // An interval no test reaches, and a clock that stays in one bucket (a new bucket
    // would roll the log over, and fsync it): the log is fsynced only by `flush`.
    let clock = manual_clock();
    let unsynced = |dir: &str, name: &str| {
        Options::new(work.path().join(dir))
            .window(Duration::from_secs(3600))
            .bucket_width(Duration::from_secs(60))
            .clock(clock.clone())
            .durability(Durability::Interval(Duration::from_secs(3600)))
            .memory_budget(1 << 16)
            .shards(4)
            .replicate(
                Replication::new(server.url(), name)
                    .replicas(1)
                    .mode(ReplicaMode::Async),
            )
    };
    let all: Vec<Vec<u8>> = (0..20_000).map(key).collect();
    let fill = |db: &Db| {
        for batch in all.chunks(256) {
            assert!(db.insert_many(batch).unwrap().iter().all(|&new| new));
        }
    };
    let settled = |db: &Db, done: &dyn Fn(&oncedb::Stats) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let stats = db.stats();
            if done(&stats) {
                return stats;
            }
            assert!(
                Instant::now() < deadline,
                "the shipper never settled: {stats:?}"
            );
            std::thread::yield_now();
        }
    };

    // Sealed runs whose cover lies in log no fsync has reached: every one waits.
    let db = open_when_ready(|| unsynced("held", "held"));
    fill(&db);
    assert!(files_with_extension(&work.path().join("held"), "keys") >= 1);
    let stats = settled(&db, &|s| {
        s.replication_runs_awaiting_log > 0 || s.replication_runs_unshipped == 0
    });
    assert!(
        stats.replication_runs_awaiting_log > 0
            && stats.replication_runs_awaiting_log == stats.replication_runs_unshipped,
        "a run was shipped before the log its cover names: {stats:?}"
    );
    assert!(run_subjects(&server.url(), "held").is_empty());
    // A restore now (the owner alive, and fenced by it) opens.
    let (restored, report) = Db::restore(unsynced("held-copy", "held"), &mut |_, _| {}).unwrap();
    assert_eq!(report.runs, 0, "{report:?}");
    drop(restored);
    drop(db);

    // Once an fsync ships the log, the runs follow, and a restore holds every key.
    let db = open_when_ready(|| unsynced("shipped", "shipped"));
    fill(&db);
    db.flush().unwrap();
    let stats = settled(&db, &|s| s.replication_runs_unshipped == 0);
    assert_eq!(stats.replication_runs_awaiting_log, 0, "{stats:?}");
    drop(db);
    let (restored, report) =
        Db::restore(unsynced("shipped-copy", "shipped"), &mut |_, _| {}).unwrap();
    assert!(report.runs >= 1, "{report:?}");
    for batch in all.chunks(256) {
        assert!(restored.insert_many(batch).unwrap().iter().all(|&new| !new));
    }
}

/// A run damaged on the replica (one byte flipped) is `Corrupted` at restore, never a
/// smaller window.
#[test]
fn a_restore_refuses_a_damaged_run() {
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    drop(budgeted_store_shipped(
        &server,
        &work.path().join("db"),
        "bad-run",
        20_000,
    ));
    let (oldest, _) = run_subjects(&server.url(), "bad-run")[0].clone();
    servers::runtime().block_on(async {
        let client = async_nats::connect(server.url()).await.unwrap();
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream("ONCEDB_bad-run").await.unwrap();
        let last = stream
            .get_last_raw_message_by_subject(&oldest)
            .await
            .unwrap();
        assert_eq!(
            last.headers.get("Oncedb-Offset").unwrap().as_str(),
            "0",
            "one chunk"
        );
        let mut damaged = last.payload.to_vec();
        damaged[100] ^= 0x40;
        stream.purge().filter(&oldest).await.unwrap();
        let mut headers = async_nats::HeaderMap::new();
        let length = last
            .headers
            .get("Oncedb-Length")
            .unwrap()
            .as_str()
            .to_owned();
        headers.insert("Oncedb-Offset", "0");
        headers.insert("Oncedb-Length", length.as_str());
        js.publish_with_headers(oldest.clone(), headers, damaged.into())
            .await
            .unwrap()
            .await
            .unwrap();
    });
    let restored = Db::restore(
        options(
            &work.path().join("r"),
            Replication::new(server.url(), "bad-run").replicas(1),
        )
        .memory_budget(1 << 16)
        .shards(4),
        &mut |_, _| {},
    );
    let Err(Error::Corrupted { path, .. }) = restored else {
        panic!("a damaged run restored");
    };
    assert!(path.to_string_lossy().contains(".run."), "{path:?}");
}

/// Record runs ship like key runs: a store under a memory budget seals its settled
/// records; once the replica holds every run whole, a restore fetches the record runs,
/// names them by their kind, and every record replays byte for byte from them (the
/// restored store holds them sealed, not rebuilt in memory).
#[test]
fn record_runs_are_shipped_and_restored_whole() {
    const RECORDS: u64 = 6_000;
    let response = |n: u64| format!("response-{n}").into_bytes();
    let scope = oncedb::Scope::new("org", "pay");
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let replication = || {
        Replication::new(server.url(), "records")
            .replicas(1)
            .mode(ReplicaMode::Async)
    };
    let budgeted = |dir: &str| {
        options(&work.path().join(dir), replication())
            .durability(Durability::Interval(Duration::from_millis(10)))
            .segment_max_bytes(1 << 20)
            .memory_budget(1 << 16)
            .shards(4)
    };
    let db = open_when_ready(|| budgeted("db"));
    for n in 0..RECORDS {
        let oncedb::Reservation::Acquired(lease) = db.reserve(&scope, &key(n), b"req").unwrap()
        else {
            panic!("record {n} is new");
        };
        lease.complete(&response(n)).unwrap();
    }
    db.flush().unwrap();
    let sealed = db.stats().sealed_records;
    assert!(sealed > 0, "{:?}", db.stats());
    let deadline = Instant::now() + Duration::from_secs(60);
    while db.stats().replication_runs_unshipped > 0 || db.stats().replication_lag_bytes > 0 {
        assert!(Instant::now() < deadline, "the runs were not shipped");
        std::thread::yield_now();
    }
    assert!(runs_whole(&server, "records"));
    drop(db);
    let (restored, report) = Db::restore(budgeted("restored"), &mut |_, _| {}).unwrap();
    assert!(report.runs >= 1, "{report:?}");
    let records_restored = files_with_extension(&work.path().join("restored"), "records");
    assert!(records_restored >= 1, "no record run was restored");
    assert_eq!(restored.stats().sealed_records, sealed);
    for n in 0..RECORDS {
        match restored.reserve(&scope, &key(n), b"req").unwrap() {
            oncedb::Reservation::Completed(record) => {
                assert_eq!(record.response(), Some(&response(n)[..]), "record {n}");
            }
            other => panic!("record {n}: {other:?}"),
        }
    }
}
