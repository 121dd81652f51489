//! The public API contract that later layers rely on: handles and leases cross threads,
//! clocks are pluggable, errors compose with `?`.

use std::time::{Duration, SystemTime};

use oncedb::{Clock, Db, Error, ManualClock, Options, Reservation, Scope};

#[test]
fn a_lease_crosses_threads_and_clones_share_one_store() {
    let db = Db::open(Options::in_memory().clock(ManualClock::new(SystemTime::now()))).unwrap();
    let scope = Scope::new("org", "op");
    let Reservation::Acquired(lease) = db.reserve(&scope, b"key", b"req").unwrap() else {
        panic!("acquire");
    };
    let other = db.clone();
    let worker = std::thread::spawn(move || {
        // The lease and a clone of the handle work on another thread.
        assert!(other.insert_if_absent(b"from-worker").unwrap());
        lease.complete(b"done")
    });
    worker.join().unwrap().unwrap();
    assert!(!db.insert_if_absent(b"from-worker").unwrap());
    let Reservation::Completed(record) = db.reserve(&scope, b"key", b"req").unwrap() else {
        panic!("the worker's completion is replayed");
    };
    assert_eq!(record.response(), Some(&b"done"[..]));
}

#[test]
fn errors_convert_into_boxed_errors_and_keep_their_source() {
    fn open_bad() -> Result<Db, Box<dyn std::error::Error + Send + Sync>> {
        Ok(Db::open(Options::in_memory().shards(3))?)
    }
    let err = open_bad().err().unwrap();
    assert!(err.to_string().contains("shards"), "{err}");
    let io = Error::from(std::io::Error::other("disk on fire"));
    assert!(std::error::Error::source(&io).is_some());
}

/// An event-time clock, as a stream processor would drive it.
struct EventTime(std::sync::atomic::AtomicU64);

impl Clock for EventTime {
    fn now_ms(&self) -> u64 {
        self.0.load(std::sync::atomic::Ordering::SeqCst)
    }
}

#[test]
fn a_custom_clock_drives_the_window() {
    let clock = std::sync::Arc::new(EventTime(std::sync::atomic::AtomicU64::new(1_000_000)));
    struct Shared(std::sync::Arc<EventTime>);
    impl Clock for Shared {
        fn now_ms(&self) -> u64 {
            self.0.now_ms()
        }
    }
    let db = Db::open(
        Options::in_memory()
            .window(Duration::from_secs(10))
            .bucket_width(Duration::from_secs(1))
            .clock(Shared(clock.clone())),
    )
    .unwrap();
    assert!(db.insert_if_absent(b"event").unwrap());
    clock
        .0
        .store(1_000_000 + 9_999, std::sync::atomic::Ordering::SeqCst);
    assert!(!db.insert_if_absent(b"event").unwrap());
    clock
        .0
        .store(1_000_000 + 11_000, std::sync::atomic::Ordering::SeqCst);
    assert!(db.insert_if_absent(b"event").unwrap());
}

#[test]
fn a_lease_outlives_every_db_handle() {
    let db = Db::open(Options::in_memory().clock(ManualClock::new(SystemTime::now()))).unwrap();
    let scope = Scope::new("org", "op");
    let reader = db.clone();
    let Reservation::Acquired(lease) = db.reserve(&scope, b"key", b"req").unwrap() else {
        panic!("acquire");
    };
    drop(db);
    lease.complete(b"done").unwrap();
    assert_eq!(
        reader.get(&scope, b"key").unwrap().unwrap().response(),
        Some(&b"done"[..])
    );
}
