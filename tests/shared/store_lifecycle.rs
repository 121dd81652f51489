//! One service's life through the `Store` trait, run against every implementation: the
//! embedded `Db` (`tests/store.rs`) and Redis (`tests/redis.rs`).

use std::time::Duration;

use oncedb::{Advance, Error, Reserved, Scope, Store, StoreLease};

/// Everything a service does through the trait, generic over the store.
pub async fn lifecycle<S: Store>(store: &S) {
    let scope = Scope::new("org_123", "create_payment");
    assert!(store.insert_if_absent(b"m1").await.unwrap());
    assert_eq!(
        store
            .insert_many(vec![b"m1".to_vec(), b"m2".to_vec()])
            .await
            .unwrap(),
        vec![false, true]
    );
    let Reserved::Acquired(lease) = store.reserve(&scope, b"k", b"req").await.unwrap() else {
        panic!("acquire");
    };
    lease.note(b"provider_outcome_unknown").await.unwrap();
    assert!(matches!(
        store.reserve(&scope, b"k", b"req").await.unwrap(),
        Reserved::InFlight { .. }
    ));
    let stuck = store.in_flight(Duration::ZERO).await.unwrap();
    let note = stuck.first().and_then(|record| record.note.as_deref());
    assert_eq!(note, Some(&b"provider_outcome_unknown"[..]));
    let new = store.take_over(&scope, b"k").await.unwrap().unwrap();
    assert!(new.epoch() > lease.epoch());
    assert!(matches!(lease.complete(b"old").await, Err(Error::Fenced)));
    new.complete(b"done").await.unwrap();
    let Reserved::Completed(record) = store.reserve(&scope, b"k", b"req").await.unwrap() else {
        panic!("replay");
    };
    assert_eq!(record.response(), Some(&b"done"[..]));
    assert!(matches!(
        store.reserve(&scope, b"k", b"other").await.unwrap(),
        Reserved::Mismatch
    ));
    let Reserved::Acquired(failing) = store.reserve(&scope, b"f", b"req").await.unwrap() else {
        panic!("acquire");
    };
    failing.fail(b"declined").await.unwrap();
    let Reserved::Acquired(released) = store.reserve(&scope, b"r", b"req").await.unwrap() else {
        panic!("acquire");
    };
    released.release().await.unwrap();
    assert!(store.get(&scope, b"r").await.unwrap().is_none());
    assert_eq!(
        store.advance(&scope, b"agg", 1).await.unwrap(),
        Advance::Applied
    );
    assert_eq!(
        store.advance(&scope, b"agg", 3).await.unwrap(),
        Advance::Gap { expected: 2 }
    );
}
