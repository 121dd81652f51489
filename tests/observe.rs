//! The `metrics` facade and `tracing` events, each checked with a real recorder or
//! subscriber. Runs with `--features metrics,tracing` (CI runs every feature).
//!
//! A test binary of its own: the tracing test installs its subscriber process-wide
//! (`set_global_default`), so it would capture the events of any other test running in the
//! same process, and a replay or mismatch of another tenant, operation or key could be
//! the line its assertions find first. (The metrics test's recorder is thread-local.)

#![cfg(any(feature = "metrics", feature = "tracing"))]
#![expect(clippy::unwrap_used, reason = "test code: a panic is the test failing")]
#![cfg_attr(
    feature = "metrics",
    expect(
        clippy::cast_possible_truncation,
        reason = "test code: gauges here hold small whole numbers"
    )
)]

use std::time::SystemTime;

use oncedb::{Advance, Db, ManualClock, Options, Reservation, Scope};

/// One of every outcome the facade and the events report.
fn workload(db: &Db) {
    let scope = Scope::new("org_123", "create_payment");
    assert!(db.insert_if_absent(b"m1").unwrap());
    assert!(!db.insert_if_absent(b"m1").unwrap());
    let Reservation::Acquired(lease) = db.reserve(&scope, b"k1", b"req").unwrap() else {
        panic!("acquire");
    };
    assert!(matches!(
        db.reserve(&scope, b"k1", b"req").unwrap(),
        Reservation::InFlight { .. }
    ));
    let new = db.take_over(&scope, b"k1").unwrap().unwrap();
    assert!(lease.complete(b"old").is_err());
    new.complete(b"{\"id\":\"pay_1\"}").unwrap();
    assert!(matches!(
        db.reserve(&scope, b"k1", b"req").unwrap(),
        Reservation::Completed(_)
    ));
    assert!(matches!(
        db.reserve(&scope, b"k1", b"other").unwrap(),
        Reservation::Mismatch
    ));
    assert_eq!(db.advance(&scope, b"agg", 1).unwrap(), Advance::Applied);
    assert_eq!(
        db.advance(&scope, b"agg", 3).unwrap(),
        Advance::Gap { expected: 2 }
    );
    let _ = db.stats();
}

fn db() -> (tempfile::TempDir, Db) {
    let dir = tempfile::tempdir().unwrap();
    let db = Db::open(Options::new(dir.path()).clock(ManualClock::new(SystemTime::now()))).unwrap();
    (dir, db)
}

#[cfg(feature = "metrics")]
#[test]
fn the_metrics_facade_counts_every_outcome() {
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};

    let recorder = DebuggingRecorder::new();
    let snapshotter = recorder.snapshotter();
    let (_dir, db) = db();
    metrics::with_local_recorder(&recorder, || workload(&db));
    let mut seen = std::collections::BTreeMap::new();
    for (key, _, _, value) in snapshotter.snapshot().into_vec() {
        let key = key.key();
        let mut labels: Vec<String> = key
            .labels()
            .map(|l| format!("{}={}", l.key(), l.value()))
            .collect();
        labels.sort();
        let name = format!("{}{{{}}}", key.name(), labels.join(","));
        let value = match value {
            DebugValue::Counter(n) => n,
            DebugValue::Gauge(g) => g.into_inner() as u64,
            DebugValue::Histogram(samples) => samples.len() as u64,
        };
        seen.insert(name, value);
    }
    let expect = |name: &str, value: u64| {
        assert_eq!(seen.get(name), Some(&value), "{name} in {seen:#?}");
    };
    expect("oncedb_keys_total{result=admitted}", 1);
    expect("oncedb_keys_total{result=duplicate}", 1);
    let op = "operation=create_payment";
    expect(
        &format!("oncedb_reservations_total{{{op},outcome=acquired}}"),
        1,
    );
    expect(
        &format!("oncedb_reservations_total{{{op},outcome=in_flight}}"),
        1,
    );
    expect(
        &format!("oncedb_reservations_total{{{op},outcome=replayed}}"),
        1,
    );
    expect(
        &format!("oncedb_reservations_total{{{op},outcome=mismatch}}"),
        1,
    );
    expect(&format!("oncedb_take_overs_total{{{op}}}"), 1);
    expect(
        &format!("oncedb_lease_endings_total{{ending=fenced,{op}}}"),
        1,
    );
    expect(
        &format!("oncedb_lease_endings_total{{ending=completed,{op}}}"),
        1,
    );
    expect(&format!("oncedb_versions_total{{answer=applied,{op}}}"), 1);
    expect(&format!("oncedb_versions_total{{answer=gap,{op}}}"), 1);
    expect("oncedb_live_keys{}", 1);
    expect("oncedb_live_records{}", 1);
    assert!(
        seen.get("oncedb_fsync_seconds{}").is_some_and(|&n| n >= 5),
        "{seen:#?}"
    );
    assert!(
        seen.keys().all(|name| !name.contains("org_123")),
        "no tenant label"
    );
}

#[cfg(feature = "tracing")]
#[test]
fn events_carry_tenant_operation_key_hash_and_status() {
    use std::sync::{Arc, Mutex};

    #[derive(Clone, Default)]
    struct Captured(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Captured {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }

    let captured = Captured::default();
    let writer = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    // Global, not thread-local: a callsite first reached on another test's thread
    // without a subscriber would otherwise keep its cached "never" interest.
    tracing::subscriber::set_global_default(subscriber).unwrap();
    let (_dir, db) = db();
    workload(&db);
    let output = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let key_hash = format!("{:016x}", xxhash_rust::xxh3::xxh3_64(b"k1"));
    for event in [
        "idempotency_replay",
        "idempotency_mismatch",
        "idempotency_in_flight",
        "idempotency_take_over",
        "idempotency_fenced",
    ] {
        let line = output
            .lines()
            .find(|line| line.contains(&format!("event=\"{event}\"")))
            .unwrap_or_else(|| panic!("no {event} in\n{output}"));
        assert!(line.contains("tenant=org_123"), "{line}");
        assert!(line.contains("operation=create_payment"), "{line}");
        assert!(line.contains(&key_hash), "{line}");
        assert!(
            !line.contains("k1"),
            "the key itself is never logged: {line}"
        );
    }
    let replay = output
        .lines()
        .find(|l| l.contains("idempotency_replay"))
        .unwrap();
    assert!(replay.contains("status=\"completed\""), "{replay}");
}
