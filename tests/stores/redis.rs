//! Redis beyond the conformance suite (feature `redis`), on real servers the tests start:
//! Redis's own limits, keys spread over a cluster's primaries, a restart with
//! `appendfsync always`, and the outage policy when the server is gone.

use crate::support::servers;

use std::time::Duration;

use oncedb::{
    Error, Guarded, OutagePolicy, RecordStatus, RedisStore, Reservation, Scope, Store, StoreLease,
};
use servers::redis::{Persistence, RedisServer, start_cluster};
use servers::runtime;

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

#[test]
fn aof_always_keeps_every_acknowledged_reservation_across_a_kill() {
    let mut server = RedisServer::start_with(false, Persistence::AofAlways);
    let scope = Scope::new("t", "op");
    let rt = runtime();
    rt.block_on(async {
        let store = RedisStore::connect(&server.url(), "oncedb", Duration::from_secs(600))
            .await
            .unwrap();
        for i in 0..200u32 {
            assert!(store.insert_if_absent(&i.to_le_bytes()).await.unwrap());
            let Reservation::Acquired(lease) = store
                .reserve(&scope, &i.to_le_bytes(), b"req")
                .await
                .unwrap()
            else {
                panic!("acquire");
            };
            if i % 2 == 0 {
                lease.complete(&i.to_le_bytes()).await.unwrap();
            }
        }
    });
    server.kill();
    server.restart();
    rt.block_on(async {
        let store = RedisStore::connect(&server.url(), "oncedb", Duration::from_secs(600))
            .await
            .unwrap();
        for i in 0..200u32 {
            assert!(
                !store.insert_if_absent(&i.to_le_bytes()).await.unwrap(),
                "key {i} lost"
            );
            let record = store.get(&scope, &i.to_le_bytes()).await.unwrap().unwrap();
            if i % 2 == 0 {
                assert_eq!(record.status(), RecordStatus::Completed);
                assert_eq!(record.response(), Some(&i.to_le_bytes()[..]));
            } else {
                assert_eq!(record.status(), RecordStatus::InFlight);
            }
        }
    });
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
        assert!(open.insert_if_absent(b"k").await.unwrap());
        assert!(!closed.insert_if_absent(b"k").await.unwrap());
        server.kill();
        assert!(open.insert_if_absent(b"k").await.unwrap());
        assert!(matches!(
            closed.insert_if_absent(b"k").await,
            Err(Error::Unavailable { .. })
        ));
        let scope = Scope::new("t", "op");
        assert!(matches!(
            closed.reserve(&scope, b"r", b"req").await,
            Err(Error::Unavailable { .. })
        ));
        assert_eq!((open.outages(), closed.outages()), (1, 2));
    });
}
