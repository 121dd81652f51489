//! A JetStream stall under a sync replica (the server paused with SIGSTOP, its connections
//! held open): a write JetStream did not acknowledge in time is answered `Unavailable`
//! and admits nothing, so the next call for its key admits it; an answer that found
//! another call's write waits for that write's acknowledgement and never outlives its
//! take-back; asynchronous callers get their answer at the acknowledgement timeout. And
//! a lost acknowledgement (a proxy drops it): the longer re-send is stored.

use std::time::{Duration, Instant};

use crate::replica::open_when_ready;
use crate::support::servers;
use oncedb::{Db, Durability, Error, Options, Replication, Reservation, Scope, Store};
use servers::nats::NatsServer;
use servers::wait_for;

/// A `Sync` store replicated in sync mode to replica `name` on `server`, waiting
/// `ack_timeout` for acknowledgements.
fn stalled_store(
    dir: &std::path::Path,
    server: &NatsServer,
    name: &str,
    ack_timeout: Duration,
) -> Db {
    let replication = Replication::new(server.url(), name)
        .replicas(1)
        .ack_timeout(ack_timeout);
    replicated_store(dir, &replication)
}

/// A `Sync` store in `dir` replicated as `replication` says.
fn replicated_store(dir: &std::path::Path, replication: &Replication) -> Db {
    open_when_ready(|| {
        Options::new(dir)
            .window(Duration::from_secs(3600))
            .bucket_width(Duration::from_secs(60))
            .durability(Durability::Sync)
            .replicate(replication.clone())
    })
}

/// `call`'s answer once JetStream acknowledges it: a call answered `Unavailable` meanwhile
/// (the stall's tail) is made again, as a caller that must not drop its message does.
fn once_acknowledged<T>(mut call: impl FnMut() -> oncedb::Result<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        match call() {
            Ok(answer) => return answer,
            Err(Error::Unavailable { .. }) if Instant::now() < deadline => {}
            Err(err) => panic!("{err}"),
        }
    }
}

fn is_unavailable<T: std::fmt::Debug>(answer: &oncedb::Result<T>) -> bool {
    matches!(answer, Err(Error::Unavailable { .. }))
}

/// The stall of issue's first finding, through the library: a key (and a batch) whose
/// write timed out is admitted by the next call once JetStream is back, not answered
/// "seen" for a write no caller was told succeeded.
#[test]
fn a_key_whose_write_was_not_acknowledged_is_admitted_by_the_next_call() {
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let db = stalled_store(
        work.path(),
        &server,
        "stall-keys",
        Duration::from_millis(300),
    );
    assert!(db.insert_if_absent(b"before").unwrap());
    server.pause();
    let single = db.insert_if_absent(b"stalled");
    assert!(is_unavailable(&single), "{single:?}");
    let batch = db.insert_many(&[b"batch-1".as_slice(), b"batch-2", b"before"]);
    assert!(is_unavailable(&batch), "{batch:?}");
    // Nothing reads them as live meanwhile.
    assert!(!db.contains(b"stalled").unwrap());
    assert!(!db.contains(b"batch-1").unwrap());
    server.resume();
    assert!(once_acknowledged(|| db.insert_if_absent(b"stalled")));
    let batch =
        once_acknowledged(|| db.insert_many(&[b"batch-1".as_slice(), b"batch-2", b"before"]));
    assert_eq!(batch, vec![true, true, false]);
    assert!(!db.insert_if_absent(b"stalled").unwrap());
}

/// A caller that finds a key another call admitted waits for that call's write: while
/// JetStream stalls it is answered `Unavailable` too, never "seen" for a key whose
/// admitting call is then told its write failed.
#[test]
fn a_duplicate_waits_for_the_write_it_found() {
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let db = stalled_store(
        work.path(),
        &server,
        "stall-wait",
        Duration::from_millis(1500),
    );
    assert!(db.insert_if_absent(b"warm").unwrap());
    server.pause();
    let logged = db.stats().log_records;
    std::thread::scope(|scope| {
        let first = scope.spawn(|| db.insert_if_absent(b"contended"));
        // Its write is logged under the lock that admitted it: the key is in memory now.
        wait_for("the first call's write", || db.stats().log_records > logged);
        let second = db.insert_if_absent(b"contended");
        assert!(is_unavailable(&second), "{second:?}");
        let first = first.join().unwrap();
        assert!(is_unavailable(&first), "{first:?}");
    });
    server.resume();
    assert!(once_acknowledged(|| db.insert_if_absent(b"contended")));
}

/// A record reserved through a stall is released with its failed write: the next
/// reserve acquires it, where it found it in flight.
#[test]
fn a_reserve_that_was_not_acknowledged_leaves_no_record_in_flight() {
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let db = stalled_store(
        work.path(),
        &server,
        "stall-records",
        Duration::from_millis(300),
    );
    let scope = Scope::new("tenant", "payments");
    assert!(matches!(
        db.reserve(&scope, b"warm", b"{}").unwrap(),
        Reservation::Acquired(_)
    ));
    server.pause();
    let stalled = db.reserve(&scope, b"order-1", b"{}");
    assert!(is_unavailable(&stalled), "{:?}", stalled.map(|_| ()));
    assert!(db.get(&scope, b"order-1").unwrap().is_none());
    server.resume();
    let again = once_acknowledged(|| db.reserve(&scope, b"order-1", b"{}"));
    assert!(matches!(again, Reservation::Acquired(_)), "{again:?}");
}

/// The asynchronous API (`Store` on a `Db`) answers `Unavailable` at the acknowledgement
/// timeout while JetStream stalls, where its commit waited forever, and takes the key
/// back like the blocking API.
#[test]
fn async_writes_are_answered_at_the_acknowledgement_timeout() {
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let db = stalled_store(
        work.path(),
        &server,
        "stall-async",
        Duration::from_millis(300),
    );
    let runtime = servers::runtime();
    runtime.block_on(async {
        assert!(Store::insert_if_absent(&db, b"before").await.unwrap());
        server.pause();
        let bounded = Duration::from_secs(30);
        let single = tokio::time::timeout(bounded, Store::insert_if_absent(&db, b"stalled")).await;
        let single = single.expect("an async write waited past its acknowledgement timeout");
        assert!(is_unavailable(&single), "{single:?}");
        let keys = vec![b"batch-1".to_vec(), b"before".to_vec()];
        let batch = tokio::time::timeout(bounded, Store::insert_many(&db, keys.clone())).await;
        let batch = batch.expect("an async batch waited past its acknowledgement timeout");
        assert!(is_unavailable(&batch), "{batch:?}");
        server.resume();
        let deadline = Instant::now() + Duration::from_secs(60);
        let admitted = loop {
            match Store::insert_many(&db, keys.clone()).await {
                Ok(admitted) => break admitted,
                Err(Error::Unavailable { .. }) if Instant::now() < deadline => {}
                Err(err) => panic!("{err}"),
            }
        };
        assert_eq!(admitted, vec![true, false]);
    });
    assert!(once_acknowledged(|| db.insert_if_absent(b"stalled")));
}

/// A chunk whose acknowledgement was lost (the proxy drops JetStream's reply and holds the
/// reconnection while another write is fsynced) is sent again from the same offset,
/// longer. JetStream stores it: the longer chunk's message id is its own, where it was
/// the first copy's and JetStream dropped it as a duplicate, so the shipper moved past
/// bytes the stream lacked. A restore holds every acknowledged key.
#[test]
fn a_longer_resend_after_a_lost_acknowledgement_is_stored() {
    let server = NatsServer::start();
    let proxy = servers::proxy::Proxy::start();
    proxy.forward_to(server.port);
    let work = tempfile::tempdir().unwrap();
    let through_proxy = format!("nats://127.0.0.1:{}", proxy.port);
    let replication = Replication::new(through_proxy, "resend")
        .replicas(1)
        .ack_timeout(Duration::from_secs(60));
    let db = replicated_store(&work.path().join("owner"), &replication);
    assert!(db.insert_if_absent(b"first").unwrap());
    let fsyncs = db.stats().fsyncs;
    proxy.lose_next_reply_and_hold();
    std::thread::scope(|scope| {
        let lost = scope.spawn(|| db.insert_if_absent(b"acknowledgement-lost"));
        proxy.wait_lost(1);
        let later = scope.spawn(|| db.insert_if_absent(b"fsynced-meanwhile"));
        wait_for("the later write's fsync", || {
            db.stats().fsyncs >= fsyncs + 2
        });
        proxy.release();
        assert!(lost.join().unwrap().unwrap());
        assert!(later.join().unwrap().unwrap());
    });
    drop(db);
    let direct = Replication::new(server.url(), "resend").replicas(1);
    let restored_dir = work.path().join("restored");
    let options = Options::new(&restored_dir)
        .window(Duration::from_secs(3600))
        .bucket_width(Duration::from_secs(60))
        .durability(Durability::Sync)
        .replicate(direct);
    let (restored, _) = Db::restore(options, &mut |_, _| {}).unwrap();
    for key in [
        b"first".as_slice(),
        b"acknowledgement-lost",
        b"fsynced-meanwhile",
    ] {
        assert!(
            !restored.insert_if_absent(key).unwrap(),
            "{} was acknowledged but the replica lacks it",
            String::from_utf8_lossy(key)
        );
    }
}

/// A failed read of the store's own log while shipping it is an I/O failure of the store:
/// the store is poisoned and a writer waiting for the replica is told so at once, where
/// it waited out the acknowledgement timeout and was answered `Unavailable` as though
/// JetStream were down, write after write.
#[test]
fn a_failed_read_of_the_log_while_shipping_poisons_the_store() {
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let faulty = oncedb::io::FaultyStorage::new(std::sync::Arc::new(oncedb::io::StdStorage));
    let replication = Replication::new(server.url(), "read-fails")
        .replicas(1)
        .ack_timeout(Duration::from_secs(30));
    let db = open_when_ready(|| {
        Options::new(work.path())
            .window(Duration::from_secs(3600))
            .bucket_width(Duration::from_secs(60))
            .durability(Durability::Sync)
            .storage(std::sync::Arc::new(faulty.clone()))
            .replicate(replication.clone())
    });
    assert!(db.insert_if_absent(b"before").unwrap());
    faulty.fail_reads(true);
    let started = Instant::now();
    let failed = db.insert_if_absent(b"unread");
    assert!(matches!(failed, Err(Error::Poisoned)), "{failed:?}");
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "the writer waited out its acknowledgement timeout"
    );
    let after = db.insert_if_absent(b"after");
    assert!(matches!(after, Err(Error::Poisoned)), "{after:?}");
}

const CHILD_DIR: &str = "ONCEDB_STALL_CHILD_DIR";
const CHILD_URL: &str = "ONCEDB_STALL_CHILD_URL";

/// The writer of the backlog test: admits keys one by one (sync mode, a 300 ms
/// acknowledgement timeout) and says `A n` or `U n` after each, until killed.
#[test]
#[ignore = "child process of the backlog test"]
fn backlog_writer_child() {
    let (Ok(dir), Ok(url)) = (std::env::var(CHILD_DIR), std::env::var(CHILD_URL)) else {
        return;
    };
    let replication = Replication::new(url, "backlog")
        .replicas(1)
        .ack_timeout(Duration::from_millis(300));
    let db = replicated_store(std::path::Path::new(&dir), &replication);
    for n in 0.. {
        let told = match db.insert_if_absent(format!("backlog-{n}").as_bytes()) {
            Ok(true) => "A",
            Err(Error::Unavailable { .. }) => "U",
            other => panic!("{other:?}"),
        };
        crate::support::say(&format!("\n{told} {n}\n"));
    }
}

/// A store reopened with log its replica lacks (writes answered `Unavailable` through a
/// stall, then the writer SIGKILLed) ships that log before the open returns: the node
/// lost right after the open, the replica restored elsewhere answers those keys as the
/// reopened store did, where the open returned at once and the log shipped behind it.
#[test]
fn a_reopened_store_ships_the_log_its_replica_lacks_before_it_answers() {
    let mut server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("owner");
    let dir_text = dir.to_string_lossy().into_owned();
    let env = [(CHILD_DIR, dir_text.as_str()), (CHILD_URL, &*server.url())];
    let (mut child, lines) = crate::support::child_test("stall::backlog_writer_child", &env);
    let mut lines = lines.map_while(Result::ok).filter(|line| !line.is_empty());
    let mut told = |wanted: &str| loop {
        let line = lines.next().expect("the writer ended");
        if let Some(n) = line.strip_prefix(wanted) {
            return n.trim().parse::<u64>().unwrap();
        }
    };
    told("A ");
    server.pause();
    let unshipped: Vec<u64> = (0..3).map(|_| told("U ")).collect();
    child.kill().unwrap();
    child.wait().unwrap();
    server.resume();
    let replication = Replication::new(server.url(), "backlog").replicas(1);
    let reopened = replicated_store(&dir, &replication);
    for &n in &unshipped {
        assert!(
            reopened
                .contains(format!("backlog-{n}").as_bytes())
                .unwrap()
        );
    }
    // The node is lost at once, then the replica restored elsewhere.
    server.stop();
    drop(reopened);
    server.start_again();
    let options = Options::new(work.path().join("restored"))
        .window(Duration::from_secs(3600))
        .bucket_width(Duration::from_secs(60))
        .durability(Durability::Sync)
        .replicate(replication);
    let (restored, _) = Db::restore(options, &mut |_, _| {}).unwrap();
    for &n in &unshipped {
        assert!(
            restored
                .contains(format!("backlog-{n}").as_bytes())
                .unwrap(),
            "backlog-{n} was answered present by the reopened store but its replica lacks it"
        );
    }
}

/// One `insert_many` of the concurrent-batches schedule: when it started and ended (on
/// one counter shared by every thread), its keys, and its answer (`None`: `Unavailable`).
struct BatchCall {
    started: u64,
    ended: u64,
    keys: Vec<u64>,
    admitted: Option<Vec<bool>>,
}

/// Concurrent batches of overlapping keys through JetStream stalls, by seeded schedule
/// (the seed printed; `ONCEDB_FAULT_SEED` replays one). Four threads send batches, half
/// fresh keys and half recent ones, while the server is paused and resumed; a batch
/// admits each shard's keys and releases that shard before it logs, marking the keys with
/// its batch slot. The checker holds, for every key answered "seen": some call that
/// started before that answer was told it was admitted, or had an unknown outcome, and
/// the store holds the key at the end (a write taken back never stands behind a "seen");
/// and no key is admitted twice.
#[test]
fn concurrent_batches_through_stalls_answer_seen_only_for_writes_that_stand() {
    use oncedb_testkit::schedule::{Schedule, random_seed};
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    let seed = random_seed();
    eprintln!("concurrent batches through stalls: seed {seed}");
    let mut schedule = Schedule::new(seed);
    let server = NatsServer::start();
    let work = tempfile::tempdir().unwrap();
    let db = stalled_store(
        work.path(),
        &server,
        "stall-batches",
        Duration::from_millis(300),
    );
    let (events, fresh, stop) = (AtomicU64::new(0), AtomicU64::new(0), AtomicBool::new(false));
    let calls = parking_lot::Mutex::new(Vec::<BatchCall>::new());
    let unknown = AtomicU64::new(0);
    std::thread::scope(|scope| {
        for writer in 0..4u64 {
            let seed = seed ^ writer.wrapping_mul(0x9E37_79B9_7F4A_7C15);
            let (db, events, fresh, stop, calls, unknown) =
                (&db, &events, &fresh, &stop, &calls, &unknown);
            scope.spawn(move || {
                let mut draws = Schedule::new(seed);
                while !stop.load(Ordering::Acquire) {
                    let newest = fresh.fetch_add(16, Ordering::AcqRel);
                    let mut keys: Vec<u64> = (newest..newest + 16).collect();
                    keys.extend((0..16).map(|_| newest.saturating_sub(1 + draws.below(200))));
                    let named: Vec<Vec<u8>> =
                        keys.iter().map(|n| format!("b-{n}").into_bytes()).collect();
                    let started = events.fetch_add(1, Ordering::AcqRel);
                    let answer = db.insert_many(&named);
                    let ended = events.fetch_add(1, Ordering::AcqRel);
                    let admitted = match answer {
                        Ok(admitted) => Some(admitted),
                        Err(Error::Unavailable { .. }) => {
                            unknown.fetch_add(1, Ordering::AcqRel);
                            None
                        }
                        Err(err) => panic!("seed {seed}: {err}"),
                    };
                    calls.lock().push(BatchCall {
                        started,
                        ended,
                        keys,
                        admitted,
                    });
                }
            });
        }
        for _stall in 0..6 {
            let answered = calls.lock().len();
            let running = 20 + schedule.below(200) as usize;
            wait_for("batches answered", || {
                calls.lock().len() >= answered + running
            });
            server.pause();
            let failed = unknown.load(Ordering::Acquire);
            wait_for("batches answered Unavailable", || {
                unknown.load(Ordering::Acquire) >= failed + 4
            });
            server.resume();
        }
        stop.store(true, Ordering::Release);
    });
    let calls = calls.into_inner();
    let held = |n: u64| once_acknowledged(|| db.contains(format!("b-{n}").as_bytes()));
    let shortfalls = check_batch_calls(&calls, held);
    let seen = calls
        .iter()
        .filter_map(|call| call.admitted.as_ref())
        .flatten()
        .filter(|&&new| !new)
        .count();
    eprintln!(
        "seed {seed}: {} batches, {} unknown, {seen} keys answered seen",
        calls.len(),
        unknown.into_inner()
    );
    assert!(seen > 0, "seed {seed}: no duplicate was answered");
    assert!(
        shortfalls.is_empty(),
        "seed {seed}:\n{}",
        shortfalls.join("\n")
    );
}

/// The broken promises of a concurrent-batches run (see its test).
fn check_batch_calls(calls: &[BatchCall], held: impl Fn(u64) -> bool) -> Vec<String> {
    use std::collections::HashMap;
    // Per key: the start of every call admitted it or left it unknown, and the admissions.
    let mut backing: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut admissions: HashMap<u64, u32> = HashMap::new();
    for call in calls {
        for (i, &key) in call.keys.iter().enumerate() {
            match call
                .admitted
                .as_ref()
                .map(|admitted| admitted.get(i).copied())
            {
                Some(Some(true)) => {
                    backing.entry(key).or_default().push(call.started);
                    *admissions.entry(key).or_default() += 1;
                }
                None => backing.entry(key).or_default().push(call.started),
                Some(_) => {}
            }
        }
    }
    let mut shortfalls = Vec::new();
    for (&key, &count) in &admissions {
        if count > 1 {
            shortfalls.push(format!("key {key} was admitted {count} times"));
        }
    }
    for call in calls {
        let Some(admitted) = &call.admitted else {
            continue;
        };
        for (&key, _) in call.keys.iter().zip(admitted).filter(|&(_, &new)| !new) {
            let backed = backing
                .get(&key)
                .is_some_and(|starts| starts.iter().any(|&start| start < call.ended));
            if !backed {
                shortfalls.push(format!(
                    "key {key} was answered seen with no call before it told admitted or unknown"
                ));
            } else if !held(key) {
                shortfalls.push(format!(
                    "key {key} was answered seen, but the write it rested on was taken back"
                ));
            }
        }
    }
    shortfalls
}
