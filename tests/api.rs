//! The public API contract: the types later layers rely on, and their auto traits.

use std::time::{Duration, SystemTime};

use oncedb::{
    Clock, Db, Durability, Error, Lease, ManualClock, Options, Record, Reservation, Scope, Stats,
};

fn send_sync_static<T: Send + Sync + 'static>() {}
fn send_static<T: Send + 'static>() {}
fn clone<T: Clone>() {}
fn std_error<T: std::error::Error + Send + Sync + 'static>() {}

#[test]
fn handles_cross_threads_and_await_points() {
    send_sync_static::<Db>();
    send_static::<Reservation>();
    send_static::<Lease>();
    send_sync_static::<Record>();
    send_sync_static::<Stats>();
    send_sync_static::<Options>();
    clone::<Db>();
    clone::<Scope>();
    clone::<ManualClock>();
    clone::<Options>();
    std_error::<Error>();
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

#[test]
fn durability_modes_are_plain_values() {
    let modes = [
        Durability::Buffered,
        Durability::Interval(Duration::from_millis(10)),
        Durability::Sync,
    ];
    assert_eq!(modes[1], Durability::Interval(Duration::from_millis(10)));
}
