//! Redis beyond the conformance suite (feature `redis`), on real servers the tests start:
//! Redis's own limits, keys spread over a cluster's primaries, records in flight on every
//! primary, server-side TTLs, a kill under load with `appendfsync always`, a restart
//! under a live store, epochs across expiry, forged records, oversized responses, and
//! the outage policy when the server is gone.

use crate::support::servers;

use std::time::{Duration, Instant};

use oncedb::{
    Advance, Error, Guarded, GuardedLease, MAX_REDIS_VERSION, OutagePolicy, RecordStatus,
    RedisStore, Reservation, Scope, Store, StoreLease, StoreOptions,
};
use servers::proxy::Proxy;
use servers::redis::{Persistence, RedisServer, start_cluster};
use servers::runtime;

/// The names of the keys of kind `kind` (`r` record, `k` dedup key, `m` ordering mark,
/// `x` release marker) under `prefix` that `node` holds.
fn names(node: &RedisServer, prefix: &str, kind: &str) -> Vec<String> {
    let pattern = format!("{prefix}:*:{kind}");
    node.cli(&["--scan", "--pattern", &pattern])
        .lines()
        .map(str::to_owned)
        .filter(|line| !line.is_empty())
        .collect()
}

fn acquired<L>(answer: Reservation<L>) -> L {
    match answer {
        Reservation::Acquired(lease) => lease,
        _ => panic!("expected Acquired"),
    }
}

#[test]
fn versions_beyond_lua_numbers_are_refused_and_leases_resume() {
    let server = RedisServer::start(false);
    runtime().block_on(async {
        let store = RedisStore::connect(&server.url(), "oncedb", Duration::from_secs(60))
            .await
            .unwrap();
        // The ordering guard keeps versions Lua can count exactly.
        let scope = Scope::new("t", "op");
        assert!(matches!(
            store.advance(&scope, b"agg", u64::MAX).await,
            Err(Error::InvalidOptions(_))
        ));
        // Resume by epoch, and fencing of an older one.
        let Reservation::Acquired(first) = store.reserve(&scope, b"w", b"req").await.unwrap()
        else {
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
fn a_cluster_spreads_keys_over_every_primary() {
    let nodes = start_cluster();
    let urls: Vec<String> = nodes.iter().map(RedisServer::url).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    runtime().block_on(async {
        let store = RedisStore::connect_cluster(&urls, "oncedb", Duration::from_secs(60))
            .await
            .unwrap();
        let keys: Vec<Vec<u8>> = (0..300u32).map(|i| i.to_le_bytes().to_vec()).collect();
        let first = store.insert_many(keys.clone()).await.unwrap();
        assert!(first.iter().all(|&new| new));
        let again = store.insert_many(keys).await.unwrap();
        assert!(again.iter().all(|&new| !new));
    });
    for node in &nodes {
        let keys: u64 = node.cli(&["DBSIZE"]).trim().parse().unwrap();
        assert!(keys > 10, "a primary holds only {keys} keys");
    }
}

/// What a writer task was told by the store.
#[derive(Debug)]
enum Ack {
    Key(String),
    Reserved(String),
    Completed(String),
}

/// A writer: dedup key, reservation, and every other time a completion, until a call
/// fails; returns that error.
async fn write_until_refused(
    store: RedisStore,
    writer: u32,
    acks: tokio::sync::mpsc::UnboundedSender<Ack>,
) -> Error {
    let scope = Scope::new("t", "op");
    for i in 0u32.. {
        let key = format!("{writer}/{i}");
        match store.insert_if_absent(key.as_bytes()).await {
            Ok(new) => assert!(new, "{key} admitted twice"),
            Err(err) => return err,
        }
        acks.send(Ack::Key(key.clone())).unwrap();
        let lease = match store.reserve(&scope, key.as_bytes(), b"req").await {
            Ok(answer) => acquired(answer),
            Err(err) => return err,
        };
        acks.send(Ack::Reserved(key.clone())).unwrap();
        if i % 2 == 0 {
            if let Err(err) = lease.complete(key.as_bytes()).await {
                return err;
            }
            acks.send(Ack::Completed(key)).unwrap();
        }
    }
    unreachable!("a writer ends with the server's death")
}

/// SIGKILL while four writers are mid-flight: every write the store acknowledged is there
/// after the restart.
///
/// What it proves: Redis answers a write only after handing it to the AOF with write(),
/// and the store reports success only on that answer. A SIGKILL leaves the kernel's page
/// cache intact, so this does not exercise the fsync of `appendfsync always`; a power
/// loss is not simulated (and a kill cannot tell `always` from `everysec`).
#[test]
fn aof_always_keeps_every_acknowledged_reservation_across_a_kill() {
    let mut server = RedisServer::start_with(false, Persistence::AofAlways);
    let scope = Scope::new("t", "op");
    let rt = runtime();
    let acks = rt.block_on(async {
        let options = StoreOptions::new(Duration::from_secs(600))
            .response_timeout(Duration::from_secs(2))
            .connect_timeout(Duration::from_secs(2));
        let store = RedisStore::connect_with(&server.url(), "oncedb", options)
            .await
            .unwrap();
        let (sender, mut received) = tokio::sync::mpsc::unbounded_channel();
        let writers: Vec<_> = (0..4)
            .map(|writer| tokio::spawn(write_until_refused(store.clone(), writer, sender.clone())))
            .collect();
        drop(sender);
        let mut acks = Vec::new();
        // The writers loop until a call fails, so they are all running when this kill
        // lands: after 400 acknowledgements, not after the last.
        while acks.len() < 400 {
            acks.push(received.recv().await.unwrap());
        }
        server.kill();
        for writer in writers {
            let err = writer.await.unwrap();
            assert!(matches!(err, Error::Unavailable { .. }), "{err}");
        }
        while let Some(ack) = received.recv().await {
            acks.push(ack);
        }
        acks
    });
    server.restart();
    rt.block_on(async {
        let store = RedisStore::connect(&server.url(), "oncedb", Duration::from_secs(600))
            .await
            .unwrap();
        for ack in &acks {
            match ack {
                Ack::Key(key) => assert!(
                    !store.insert_if_absent(key.as_bytes()).await.unwrap(),
                    "dedup key {key} lost"
                ),
                Ack::Reserved(key) => {
                    let record = store.get(&scope, key.as_bytes()).await.unwrap();
                    let record = record.unwrap_or_else(|| panic!("reservation {key} lost"));
                    // Its completion may have run without being acknowledged.
                    assert_ne!(record.status(), RecordStatus::Failed);
                }
                Ack::Completed(key) => {
                    let record = store.get(&scope, key.as_bytes()).await.unwrap().unwrap();
                    assert_eq!(record.status(), RecordStatus::Completed, "{key}");
                    assert_eq!(record.response(), Some(key.as_bytes()));
                }
            }
        }
    });
    assert!(acks.len() >= 400);
}

#[test]
fn an_unreachable_server_follows_the_outage_policy() {
    let mut server = RedisServer::start(false);
    runtime().block_on(async {
        let store = RedisStore::connect(&server.url(), "oncedb", Duration::from_secs(60))
            .await
            .unwrap();
        let open = Guarded::new(store.clone(), OutagePolicy::FailOpen);
        let closed = Guarded::new(store, OutagePolicy::FailClosed);
        let scope = Scope::new("t", "op");
        assert!(open.insert_if_absent(b"k").await.unwrap());
        assert!(!closed.insert_if_absent(b"k").await.unwrap());
        // Leases taken while the server is up, finished after it is gone.
        let open_lease = acquired(open.reserve(&scope, b"open", b"req").await.unwrap());
        let closed_lease = acquired(closed.reserve(&scope, b"closed", b"req").await.unwrap());
        assert!(matches!(open_lease, GuardedLease::Held(_)));
        assert_eq!(open.outages() + closed.outages(), 0);
        server.kill();

        // Fail open: admitted, unprotected, counted; a key repeated in one batch is
        // still a duplicate the second time.
        assert!(open.insert_if_absent(b"k").await.unwrap());
        assert_eq!(
            open.insert_many(vec![b"a".to_vec(), b"a".to_vec()])
                .await
                .unwrap(),
            [true, false]
        );
        assert_eq!(
            open.advance(&scope, b"agg", 7).await.unwrap(),
            Advance::Applied
        );
        let unprotected = acquired(open.reserve(&scope, b"r", b"req").await.unwrap());
        assert!(matches!(unprotected, GuardedLease::Unprotected));
        unprotected.complete(b"nothing stored").await.unwrap();
        assert_eq!(open.lease_outages(), 0);
        open_lease.complete(b"outcome unknown").await.unwrap();
        assert_eq!(open.lease_outages(), 1);
        assert_eq!(open.outages(), 5);

        // Fail closed: refused, counted.
        crate::support::fails_closed(&closed, closed_lease, &scope).await;
    });
}

#[test]
fn versions_up_to_two_to_the_53_answer_exactly() {
    let server = RedisServer::start(false);
    runtime().block_on(async {
        let store = RedisStore::connect(&server.url(), "oncedb", Duration::from_secs(60))
            .await
            .unwrap();
        let scope = Scope::new("t", "versions");
        assert_eq!(MAX_REDIS_VERSION, (1 << 53) - 1);
        assert_eq!(
            store
                .advance(&scope, b"max", MAX_REDIS_VERSION)
                .await
                .unwrap(),
            Advance::Applied
        );
        assert_eq!(
            store
                .advance(&scope, b"max", MAX_REDIS_VERSION)
                .await
                .unwrap(),
            Advance::Duplicate
        );
        assert!(matches!(
            store.advance(&scope, b"max", 1 << 53).await,
            Err(Error::InvalidOptions(_))
        ));
        assert!(matches!(
            store.advance(&scope, b"fresh", 1 << 53).await,
            Err(Error::InvalidOptions(_))
        ));
        // Beyond 14 significant digits, where Lua's `tostring` would round.
        let big = 100_000_000_000_000u64;
        let answers = [
            (big, Advance::Applied),
            (big, Advance::Duplicate),
            (big + 2, Advance::Gap { expected: big + 1 }),
            (big - 1, Advance::Stale { current: big }),
            (big + 1, Advance::Applied),
            (big, Advance::Stale { current: big + 1 }),
            (big + 3, Advance::Gap { expected: big + 2 }),
        ];
        for (version, expected) in answers {
            assert_eq!(
                store.advance(&scope, b"big", version).await.unwrap(),
                expected,
                "version {version}"
            );
        }
        let top = MAX_REDIS_VERSION;
        let answers = [
            (top - 2, Advance::Applied),
            (top, Advance::Gap { expected: top - 1 }),
            (top - 1, Advance::Applied),
            (top - 3, Advance::Stale { current: top - 1 }),
            (top, Advance::Applied),
            (top - 1, Advance::Stale { current: top }),
        ];
        for (version, expected) in answers {
            assert_eq!(
                store.advance(&scope, b"top", version).await.unwrap(),
                expected,
                "version {version}"
            );
        }
    });
}

#[test]
fn every_key_carries_the_window_as_its_server_ttl() {
    let server = RedisServer::start(false);
    let window = Duration::from_secs(60);
    runtime().block_on(async {
        let store = RedisStore::connect(&server.url(), "ttl", window)
            .await
            .unwrap();
        let scope = Scope::new("t", "ttl");
        assert!(store.insert_if_absent(b"key").await.unwrap());
        acquired(store.reserve(&scope, b"done", b"req").await.unwrap())
            .complete(b"ok")
            .await
            .unwrap();
        let stuck = acquired(store.reserve(&scope, b"stuck", b"req").await.unwrap());
        stuck.note(b"unknown").await.unwrap();
        store.take_over(&scope, b"stuck").await.unwrap().unwrap();
        acquired(store.reserve(&scope, b"gone", b"req").await.unwrap())
            .release()
            .await
            .unwrap();
        assert_eq!(
            store.advance(&scope, b"agg", 1).await.unwrap(),
            Advance::Applied
        );
        assert_eq!(
            store.advance(&scope, b"agg", 2).await.unwrap(),
            Advance::Applied
        );
    });
    let expected = [("k", 1), ("r", 2), ("x", 1), ("m", 1)];
    for (kind, count) in expected {
        let names = names(&server, "ttl", kind);
        assert_eq!(names.len(), count, "keys of kind {kind}: {names:?}");
        for name in names {
            let ttl: i64 = server.cli(&["PTTL", &name]).trim().parse().unwrap();
            assert!(
                ttl > 0 && ttl <= 60_000,
                "{name} expires in {ttl} ms, not within the window"
            );
        }
    }
}

/// Reserves records `<key_prefix>0`, `<key_prefix>1`, ... until each primary of `nodes`
/// holds at least one under `prefix`; their leases, in key order.
async fn reserve_on_every_primary(
    store: &RedisStore,
    nodes: &[RedisServer],
    prefix: &str,
    scope: &Scope,
    key_prefix: &str,
) -> Vec<oncedb::RedisLease> {
    let mut leases = Vec::new();
    while nodes.iter().any(|node| names(node, prefix, "r").is_empty()) {
        assert!(
            leases.len() < 200,
            "the records never reached every primary"
        );
        let key = format!("{key_prefix}{}", leases.len());
        leases.push(acquired(
            store.reserve(scope, key.as_bytes(), b"req").await.unwrap(),
        ));
    }
    leases
}

#[test]
fn in_flight_lists_the_records_of_every_primary() {
    let nodes = start_cluster();
    let urls: Vec<String> = nodes.iter().map(RedisServer::url).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    let scope = Scope::new("t", "in_flight");
    runtime().block_on(async {
        let store = RedisStore::connect_cluster(&urls, "stuck", Duration::from_secs(60))
            .await
            .unwrap();
        let leases = reserve_on_every_primary(&store, &nodes, "stuck", &scope, "stuck/").await;
        let held: usize = nodes
            .iter()
            .map(|node| names(node, "stuck", "r").len())
            .sum();
        assert_eq!(held, leases.len());
        let mut listed: Vec<(Vec<u8>, u64)> = store
            .in_flight(Duration::ZERO)
            .await
            .unwrap()
            .into_iter()
            .filter(|record| record.scope == scope)
            .map(|record| (record.key, record.epoch))
            .collect();
        listed.sort();
        let mut expected: Vec<(Vec<u8>, u64)> = leases
            .iter()
            .enumerate()
            .map(|(i, lease)| (format!("stuck/{i}").into_bytes(), lease.epoch()))
            .collect();
        expected.sort();
        assert_eq!(listed, expected, "every primary's records, each once");
    });
}

#[test]
fn a_restarted_server_serves_the_same_store_again() {
    let mut server = RedisServer::start(false);
    runtime().block_on(async {
        let options = StoreOptions::new(Duration::from_secs(60))
            .response_timeout(Duration::from_secs(1))
            .connect_timeout(Duration::from_secs(1));
        let store = RedisStore::connect_with(&server.url(), "restart", options)
            .await
            .unwrap();
        let scope = Scope::new("t", "restart");
        assert!(store.insert_if_absent(b"before").await.unwrap());
        server.kill();
        // Each call answers, and promptly: a few response timeouts at most.
        let prompt = Duration::from_secs(5);
        for _ in 0..3 {
            let answer = tokio::time::timeout(prompt, store.insert_if_absent(b"during")).await;
            assert!(matches!(answer, Ok(Err(Error::Unavailable { .. }))));
        }
        let answer = tokio::time::timeout(prompt, store.reserve(&scope, b"during", b"req")).await;
        assert!(matches!(answer, Ok(Err(Error::Unavailable { .. }))));
        let answer = tokio::time::timeout(prompt, store.get(&scope, b"during")).await;
        assert!(matches!(answer, Ok(Err(Error::Unavailable { .. }))));
        server.restart();
        // The store reconnects by itself; poll the server through it, with a deadline.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match store.insert_if_absent(b"after").await {
                Ok(new) => {
                    assert!(new);
                    break;
                }
                Err(Error::Unavailable { .. }) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(err) => panic!("the store did not reconnect within 10 s: {err}"),
            }
        }
        assert!(!store.insert_if_absent(b"after").await.unwrap());
        let lease = acquired(store.reserve(&scope, b"after", b"req").await.unwrap());
        lease.complete(b"ok").await.unwrap();
        assert_eq!(
            store
                .get(&scope, b"after")
                .await
                .unwrap()
                .unwrap()
                .response(),
            Some(&b"ok"[..])
        );
    });
}

/// Polls `store` until it answers again after a restart, at most 10 s.
async fn wait_until_served(store: &RedisStore) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while let Err(err) = store.get(&Scope::new("t", "probe"), b"probe").await {
        assert!(Instant::now() < deadline, "not served again in 10 s: {err}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// With a naming secret from configuration, stores connected before and after a restart
/// of a Redis without persistence (which loses every key) still name keys alike: what
/// one admits the other refuses.
#[test]
fn a_configured_naming_secret_survives_a_restart_without_persistence() {
    let mut server = RedisServer::start(false);
    runtime().block_on(async {
        let options = StoreOptions::new(Duration::from_secs(60))
            .connect_timeout(Duration::from_secs(1))
            .response_timeout(Duration::from_secs(1))
            .naming_secret(0x05ee_d0f0_cedb);
        let before = RedisStore::connect_with(&server.url(), "named", options.clone())
            .await
            .unwrap();
        server.kill();
        server.restart();
        wait_until_served(&before).await;
        let after = RedisStore::connect_with(&server.url(), "named", options)
            .await
            .unwrap();
        assert!(after.insert_if_absent(b"k").await.unwrap());
        assert!(!before.insert_if_absent(b"k").await.unwrap());
        assert!(before.insert_if_absent(b"j").await.unwrap());
        assert!(!after.insert_if_absent(b"j").await.unwrap());
        let scope = Scope::new("t", "named");
        let lease = acquired(after.reserve(&scope, b"r", b"req").await.unwrap());
        assert!(matches!(
            before.reserve(&scope, b"r", b"req").await.unwrap(),
            Reservation::InFlight { .. }
        ));
        lease.complete(b"ok").await.unwrap();
    });
}

#[test]
fn a_record_recreated_after_expiry_gets_a_higher_epoch() {
    let server = RedisServer::start(false);
    runtime().block_on(async {
        let store = RedisStore::connect(&server.url(), "expiry", Duration::from_millis(300))
            .await
            .unwrap();
        let scope = Scope::new("t", "expiry");
        let old = acquired(store.reserve(&scope, b"k", b"req").await.unwrap());
        // Poll the server until it has expired the record.
        let deadline = Instant::now() + Duration::from_secs(10);
        while store.get(&scope, b"k").await.unwrap().is_some() {
            assert!(Instant::now() < deadline, "the record never expired");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let new = acquired(store.reserve(&scope, b"k", b"req").await.unwrap());
        assert!(
            new.epoch() > old.epoch(),
            "epoch {} repeats or precedes {}",
            new.epoch(),
            old.epoch()
        );
        assert!(matches!(old.note(b"late").await, Err(Error::LeaseLost)));
        assert!(matches!(
            store.resume(&scope, b"k", old.epoch()).await,
            Err(Error::LeaseLost)
        ));
        assert!(matches!(
            old.complete(b"stale").await,
            Err(Error::LeaseLost)
        ));
        assert_eq!(
            store.get(&scope, b"k").await.unwrap().unwrap().status(),
            RecordStatus::InFlight
        );
        new.complete(b"fresh").await.unwrap();
    });
}

#[test]
fn a_record_of_another_scoped_key_is_a_collision() {
    let server = RedisServer::start(false);
    runtime().block_on(async {
        let store = RedisStore::connect(&server.url(), "forged", Duration::from_secs(60))
            .await
            .unwrap();
        let scope = Scope::new("t", "forged");
        let _lease = acquired(store.reserve(&scope, b"k", b"req").await.unwrap());
        let records = names(&server, "forged", "r");
        assert_eq!(records.len(), 1);
        let record = records.first().unwrap();
        assert_eq!(
            server.cli(&["HSET", record, "sk", "another key"]).trim(),
            "0"
        );
        assert!(matches!(
            store.reserve(&scope, b"k", b"req").await,
            Err(Error::FingerprintCollision)
        ));
        assert!(matches!(
            store.get(&scope, b"k").await,
            Err(Error::FingerprintCollision)
        ));
    });
}

/// A cluster client re-sends a command whose reply it lost to a connection reset, though
/// the server ran it. Every write carries a token of its call, so the re-sent command
/// finds its own first run and answers as that run did: admitted (not "duplicate"),
/// acquired (not `InFlight`), finished (not `LeaseLost`). A proxy in front of a cluster
/// of one node (which announces the proxy's port) loses one reply before each call.
#[test]
fn a_command_re_sent_after_a_lost_reply_answers_as_its_first_run() {
    let proxy = Proxy::start();
    let node = RedisServer::start_cluster_of_one(proxy.port);
    proxy.forward_to(node.port);
    runtime().block_on(async {
        let url = format!("redis://127.0.0.1:{}/", proxy.port);
        let store = RedisStore::connect_cluster(&[url.as_str()], "resend", Duration::from_secs(60))
            .await
            .unwrap();
        let scope = Scope::new("t", "resend");
        proxy.lose_next_reply();
        assert!(store.insert_if_absent(b"k").await.unwrap());
        assert_eq!(
            proxy.lost(),
            1,
            "the reply was lost and the command re-sent"
        );
        assert!(!store.insert_if_absent(b"k").await.unwrap());
        proxy.lose_next_reply();
        let batch = store.insert_many(vec![b"a".to_vec(), b"k".to_vec()]).await;
        assert_eq!(batch.unwrap(), vec![true, false]);
        proxy.lose_next_reply();
        let lease = acquired(store.reserve(&scope, b"r", b"req").await.unwrap());
        proxy.lose_next_reply();
        lease.note(b"calling the provider").await.unwrap();
        proxy.lose_next_reply();
        let lease = store.take_over(&scope, b"r").await.unwrap().unwrap();
        proxy.lose_next_reply();
        lease.complete(b"done").await.unwrap();
        let Reservation::Completed(record) = store.reserve(&scope, b"r", b"req").await.unwrap()
        else {
            panic!("the completion stands");
        };
        assert_eq!(record.response(), Some(&b"done"[..]));
        let lease = acquired(store.reserve(&scope, b"f", b"req").await.unwrap());
        proxy.lose_next_reply();
        lease.fail(b"declined").await.unwrap();
        let lease = acquired(store.reserve(&scope, b"x", b"req").await.unwrap());
        proxy.lose_next_reply();
        lease.release().await.unwrap();
        acquired(store.reserve(&scope, b"x", b"req").await.unwrap());
        proxy.lose_next_reply();
        assert_eq!(
            store.advance(&scope, b"agg", 1).await.unwrap(),
            Advance::Applied
        );
        assert_eq!(proxy.lost(), 9, "every armed reply was lost");
    });
}

/// A single-server store does not re-send: a lost reply is `Unavailable` (the write's
/// outcome unknown, as over any network), never a wrong answer, and the next call is
/// served on a new connection.
#[test]
fn a_lost_reply_on_a_single_server_is_unavailable() {
    let proxy = Proxy::start();
    let server = RedisServer::start(false);
    proxy.forward_to(server.port);
    runtime().block_on(async {
        let url = format!("redis://127.0.0.1:{}/", proxy.port);
        let store = RedisStore::connect(&url, "lost", Duration::from_secs(60))
            .await
            .unwrap();
        proxy.lose_next_reply();
        assert!(matches!(
            store.insert_if_absent(b"k").await,
            Err(Error::Unavailable { .. })
        ));
        assert_eq!(proxy.lost(), 1);
        // The server ran it: the key is taken.
        let deadline = Instant::now() + Duration::from_secs(10);
        let answer = loop {
            match store.insert_if_absent(b"k").await {
                Err(Error::Unavailable { .. }) if Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                answer => break answer,
            }
        };
        assert!(!answer.unwrap());
    });
}

/// A server whose `maxmemory-policy` evicts keys (every key of a store has a TTL, so
/// `volatile-*` evicts dedup keys and records too) is refused at connect unless the
/// caller accepts eviction; a server out of memory under `noeviction` answers `Full`,
/// as the embedded store does, and `FailOpen` does not turn that into an admission.
#[test]
fn an_evicting_server_is_refused_and_a_full_one_answers_full() {
    let server = RedisServer::start(false);
    let url = server.url();
    let options = || StoreOptions::new(Duration::from_secs(60));
    runtime().block_on(async {
        for policy in ["volatile-lru", "allkeys-lfu"] {
            server.cli(&["CONFIG", "SET", "maxmemory-policy", policy]);
            assert!(matches!(
                RedisStore::connect_with(&url, "evict", options()).await,
                Err(Error::InvalidOptions(_))
            ));
            let accepted = RedisStore::connect_with(&url, "evict", options().accept_eviction(true))
                .await
                .unwrap();
            assert!(accepted.insert_if_absent(policy.as_bytes()).await.unwrap());
        }
        server.cli(&["CONFIG", "SET", "maxmemory-policy", "noeviction"]);
        let store = RedisStore::connect_with(&url, "evict", options())
            .await
            .unwrap();
        let scope = Scope::new("t", "full");
        server.cli(&["CONFIG", "SET", "maxmemory", "1"]);
        assert!(matches!(
            store.insert_if_absent(b"new").await,
            Err(Error::Full)
        ));
        assert!(matches!(
            store.insert_many(vec![b"a".to_vec()]).await,
            Err(Error::Full)
        ));
        assert!(matches!(
            store.reserve(&scope, b"r", b"req").await,
            Err(Error::Full)
        ));
        let open = Guarded::new(store.clone(), OutagePolicy::FailOpen);
        assert!(matches!(
            open.reserve(&scope, b"r", b"req").await,
            Err(Error::Full)
        ));
        assert_eq!(open.outages(), 0);
        server.cli(&["CONFIG", "SET", "maxmemory", "0"]);
        // The refused calls changed nothing.
        assert!(store.insert_if_absent(b"new").await.unwrap());
        acquired(store.reserve(&scope, b"r", b"req").await.unwrap());
    });
}

const CLOCK_CHILD_URL: &str = "ONCEDB_CLOCK_CHILD_URL";

/// The reserving client of the lease clock test, run with its clock two hours ahead:
/// prints how its reservation was answered.
#[test]
#[ignore = "child process of the lease clock test"]
fn clock_child() {
    let Ok(url) = std::env::var(CLOCK_CHILD_URL) else {
        return;
    };
    runtime().block_on(async {
        let options = StoreOptions::new(Duration::from_secs(60))
            .lease_timeout(Duration::from_secs(60))
            .naming_secret(11);
        let store = RedisStore::connect_with(&url, "clock", options)
            .await
            .unwrap();
        let answer = store
            .reserve(&Scope::new("t", "clock"), b"k", b"req")
            .await
            .unwrap();
        let answer = match answer {
            Reservation::Acquired(_) => "acquired",
            Reservation::InFlight { .. } => "in_flight",
            _ => "other",
        };
        println!("answer {answer}");
    });
}

/// The lease timeout runs on the server's clock: a client whose clock runs two hours
/// ahead (under `faketime`) finds a lease granted a moment ago still live, where its
/// own clock would call it timed out and take it over.
#[test]
fn a_client_clock_running_ahead_never_times_a_live_lease_out() {
    let server = RedisServer::start(false);
    let url = server.url();
    runtime().block_on(async {
        let options = StoreOptions::new(Duration::from_secs(60))
            .lease_timeout(Duration::from_secs(60))
            .naming_secret(11);
        let store = RedisStore::connect_with(&url, "clock", options)
            .await
            .unwrap();
        let scope = Scope::new("t", "clock");
        let lease = acquired(store.reserve(&scope, b"k", b"req").await.unwrap());
        let output = std::process::Command::new("faketime")
            .args(["-f", "+2h"])
            .arg(std::env::current_exe().unwrap())
            .args([
                "--ignored",
                "--exact",
                "redis::clock_child",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CLOCK_CHILD_URL, &url)
            .env("FAKETIME_DONT_FAKE_MONOTONIC", "1")
            .output()
            .expect("faketime must be installed (.ci/run installs it)");
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(output.status.success(), "{stdout}");
        assert!(stdout.contains("answer in_flight"), "{stdout}");
        lease.complete(b"done").await.unwrap();
    });
}

/// Sets every slot `source` serves migrating to `target` (and importing there), as a
/// resharding does before it moves keys: keys absent from the source answer `ASK`.
fn migrate_every_slot(source: &RedisServer, target: &RedisServer) {
    let source_id = source.cli(&["CLUSTER", "MYID"]).trim().to_owned();
    let target_id = target.cli(&["CLUSTER", "MYID"]).trim().to_owned();
    let nodes = source.cli(&["CLUSTER", "NODES"]);
    let mine = nodes
        .lines()
        .find(|line| line.contains("myself"))
        .unwrap()
        .to_owned();
    let mut importing = String::new();
    let mut migrating = String::new();
    for range in mine.split_whitespace().skip(8) {
        let (first, last) = range.split_once('-').unwrap_or((range, range));
        for slot in first.parse::<u16>().unwrap()..=last.parse::<u16>().unwrap() {
            importing.push_str(&format!("CLUSTER SETSLOT {slot} IMPORTING {source_id}\n"));
            migrating.push_str(&format!("CLUSTER SETSLOT {slot} MIGRATING {target_id}\n"));
        }
    }
    for (node, commands) in [(target, importing), (source, migrating)] {
        let mut cli = std::process::Command::new("redis-cli")
            .args(["-p", &node.port.to_string()])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::null())
            .spawn()
            .unwrap();
        use std::io::Write;
        cli.stdin
            .take()
            .unwrap()
            .write_all(commands.as_bytes())
            .unwrap();
        assert!(cli.wait().unwrap().success());
    }
}

/// A batch meeting slots in migration lands each key where the cluster redirects it
/// (`ASK`, with `ASKING` for that command), and answers as it would outside a migration.
#[test]
fn a_batch_survives_slots_in_migration() {
    let nodes = start_cluster();
    let urls: Vec<String> = nodes.iter().map(RedisServer::url).collect();
    let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
    runtime().block_on(async {
        let options = StoreOptions::new(Duration::from_secs(60)).naming_secret(5);
        let store = RedisStore::connect_cluster_with(&urls, "moving", options)
            .await
            .unwrap();
        migrate_every_slot(&nodes[0], &nodes[1]);
        let keys: Vec<Vec<u8>> = (0..60).map(|i| format!("key-{i}").into_bytes()).collect();
        let first = store.insert_many(keys.clone()).await.unwrap();
        assert!(first.iter().all(|admitted| *admitted), "{first:?}");
        let again = store.insert_many(keys.clone()).await.unwrap();
        assert!(again.iter().all(|admitted| !*admitted), "{again:?}");
        assert!(!store.insert_if_absent(&keys[0]).await.unwrap());
        // Nothing was planted on the source, which still owns the slots.
        assert!(names(&nodes[0], "moving", "k").is_empty());
        assert_eq!(
            names(&nodes[1], "moving", "k").len() + names(&nodes[2], "moving", "k").len(),
            keys.len()
        );
    });
}

/// A write re-sent after its reply was lost never answers for a grant someone else got
/// in between: a reserve re-sent after a take-over does not get the taker's epoch, a
/// take-over re-sent after a lease timeout's take-over does not get that epoch, and an
/// `advance` re-sent after another client applied the next version still answers
/// `Applied` for its own.
#[test]
fn a_re_sent_write_never_answers_for_another_grant() {
    let proxy = Proxy::start();
    let node = RedisServer::start_cluster_of_one(proxy.port);
    proxy.forward_to(node.port);
    runtime().block_on(async {
        let options = || StoreOptions::new(Duration::from_secs(60)).naming_secret(3);
        let url = format!("redis://127.0.0.1:{}/", proxy.port);
        let resending = RedisStore::connect_cluster_with(&[url.as_str()], "regrant", options())
            .await
            .unwrap();
        // Another client, straight to the node, past the proxy.
        let other = RedisStore::connect_with(&node.url(), "regrant", options())
            .await
            .unwrap();
        let scope = Scope::new("t", "regrant");
        // The node caches each script once run, so that the lost replies below are the
        // scripts' answers, not a request to load them.
        acquired(other.reserve(&scope, b"warm", b"req").await.unwrap());
        other.take_over(&scope, b"warm").await.unwrap().unwrap();
        assert_eq!(
            other.advance(&scope, b"warm", 1).await.unwrap(),
            Advance::Applied
        );

        proxy.lose_next_reply_and_hold();
        let (store, sc) = (resending.clone(), scope.clone());
        let reserving = tokio::spawn(async move { store.reserve(&sc, b"r", b"req").await });
        proxy.wait_lost(1);
        let taker = other.take_over(&scope, b"r").await.unwrap().unwrap();
        proxy.release();
        let answer = reserving.await.unwrap().unwrap();
        assert!(
            matches!(answer, Reservation::InFlight { .. }),
            "the re-sent reserve answered for the taker's epoch {}",
            taker.epoch()
        );

        let holder = acquired(other.reserve(&scope, b"t", b"req").await.unwrap());
        proxy.lose_next_reply_and_hold();
        let (store, sc) = (resending.clone(), scope.clone());
        let taking = tokio::spawn(async move { store.take_over(&sc, b"t").await });
        proxy.wait_lost(2);
        let timing_out = RedisStore::connect_with(
            &node.url(),
            "regrant",
            options().lease_timeout(Duration::from_millis(1)),
        )
        .await
        .unwrap();
        // The lease times out 1 ms after the take-over, on the server's clock.
        let regranted = loop {
            match timing_out.reserve(&scope, b"t", b"req").await.unwrap() {
                Reservation::Acquired(lease) => break lease,
                Reservation::InFlight { .. } => tokio::task::yield_now().await,
                _ => panic!("expected Acquired or InFlight"),
            }
        };
        proxy.release();
        let taken = taking.await.unwrap().unwrap().unwrap();
        assert!(
            taken.epoch() > regranted.epoch(),
            "two holders of one epoch"
        );
        assert!(matches!(holder.complete(b"x").await, Err(Error::Fenced)));
        assert!(matches!(regranted.complete(b"x").await, Err(Error::Fenced)));
        taken.complete(b"done").await.unwrap();

        proxy.lose_next_reply_and_hold();
        let (store, sc) = (resending.clone(), scope.clone());
        let advancing = tokio::spawn(async move { store.advance(&sc, b"agg", 1).await });
        proxy.wait_lost(3);
        assert_eq!(
            other.advance(&scope, b"agg", 2).await.unwrap(),
            Advance::Applied
        );
        proxy.release();
        assert_eq!(advancing.await.unwrap().unwrap(), Advance::Applied);
    });
}

/// `in_flight` asks the cluster for its primaries: a store connected through one seed
/// lists the records of every primary, and a seed that is gone does not fail it. An
/// evicting primary is refused at connect.
#[test]
fn in_flight_follows_the_clusters_primaries() {
    let nodes = start_cluster();
    let scope = Scope::new("t", "topology");
    runtime().block_on(async {
        let seed = nodes[0].url();
        let dead = format!("redis://127.0.0.1:{}/", servers::free_port());
        let store = RedisStore::connect_cluster(
            &[seed.as_str(), dead.as_str()],
            "topology",
            Duration::from_secs(60),
        )
        .await
        .unwrap();
        let leases = reserve_on_every_primary(&store, &nodes, "topology", &scope, "k").await;
        let listed = store.in_flight(Duration::ZERO).await.unwrap();
        assert_eq!(listed.len(), leases.len(), "every primary's records");

        nodes[2].cli(&["CONFIG", "SET", "maxmemory-policy", "volatile-ttl"]);
        assert!(matches!(
            RedisStore::connect_cluster(&[seed.as_str()], "topology", Duration::from_secs(60))
                .await,
            Err(Error::InvalidOptions(_))
        ));
    });
}

/// The naming secret never appears in a store's or a lease's `Debug`.
#[test]
fn the_naming_secret_is_never_printed() {
    let server = RedisServer::start(false);
    let secret: u64 = 0x5ec2_e7ab_cdef_1234;
    runtime().block_on(async {
        let options = StoreOptions::new(Duration::from_secs(60)).naming_secret(secret);
        let printed_options = format!("{options:?}");
        let store = RedisStore::connect_with(&server.url(), "debug", options)
            .await
            .unwrap();
        let lease = acquired(
            store
                .reserve(&Scope::new("t", "op"), b"k", b"req")
                .await
                .unwrap(),
        );
        for printed in [printed_options, format!("{store:?}"), format!("{lease:?}")] {
            assert!(!printed.contains(&secret.to_string()), "{printed}");
            assert!(!printed.contains(&format!("{secret:x}")), "{printed}");
            assert!(printed.contains("naming_secret_set: true"), "{printed}");
        }
    });
}
