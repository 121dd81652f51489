//! Durable stores: reopen, locking, manifest checks, segment expiry, group commit.

#![expect(clippy::unwrap_used, reason = "test code: a panic is the test failing")]

mod common;

use std::time::Duration;

use common::{BUCKET, WINDOW, durable_options, manual_clock};
use oncedb::{Db, Durability, Error, Options, RecordStatus, Reservation, Scope};

fn segment_files(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("seg-"))
        .collect();
    names.sort();
    names
}

#[test]
fn keys_and_records_survive_reopen_in_every_mode() {
    for durability in [
        Durability::Sync,
        Durability::Buffered,
        Durability::Interval(Duration::from_millis(5)),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let clock = manual_clock();
        let scope = Scope::new("org", "pay");
        {
            let db = Db::open(durable_options(dir.path(), &clock).durability(durability)).unwrap();
            assert!(db.insert_if_absent(b"single").unwrap());
            db.insert_many(&[b"a", b"b", b"c"]).unwrap();
            let Reservation::Acquired(done) = db.reserve(&scope, b"done", b"req").unwrap() else {
                panic!()
            };
            done.complete(b"response").unwrap();
            let Reservation::Acquired(failed) = db.reserve(&scope, b"failed", b"req").unwrap()
            else {
                panic!()
            };
            failed.fail(b"declined").unwrap();
            let Reservation::Acquired(released) = db.reserve(&scope, b"released", b"req").unwrap()
            else {
                panic!()
            };
            released.release().unwrap();
            let Reservation::Acquired(pending) = db.reserve(&scope, b"pending", b"req").unwrap()
            else {
                panic!()
            };
            drop(pending);
            db.flush().unwrap();
        }
        let db = Db::open(durable_options(dir.path(), &clock).durability(durability)).unwrap();
        for key in [&b"single"[..], b"a", b"b", b"c"] {
            assert!(
                !db.insert_if_absent(key).unwrap(),
                "{durability:?}: {key:?} lost"
            );
        }
        let record = db.get(&scope, b"done").unwrap().unwrap();
        assert_eq!(
            (record.status(), record.response()),
            (RecordStatus::Completed, Some(&b"response"[..]))
        );
        let record = db.get(&scope, b"failed").unwrap().unwrap();
        assert_eq!(
            (record.status(), record.response()),
            (RecordStatus::Failed, Some(&b"declined"[..]))
        );
        assert!(db.get(&scope, b"released").unwrap().is_none());
        assert!(matches!(
            db.reserve(&scope, b"pending", b"req").unwrap(),
            Reservation::InFlight { .. }
        ));
        assert!(matches!(
            db.reserve(&scope, b"done", b"other").unwrap(),
            Reservation::Mismatch
        ));
        assert!(db.stats().recovered_records >= 8);
    }
}

#[test]
fn leases_after_reopen_do_not_reuse_ids() {
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let scope = Scope::new("org", "pay");
    {
        let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
        let Reservation::Acquired(lease) = db.reserve(&scope, b"old", b"req").unwrap() else {
            panic!()
        };
        drop(lease);
    }
    let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
    let Reservation::Acquired(lease) = db.reserve(&scope, b"new", b"req").unwrap() else {
        panic!()
    };
    lease.complete(b"ok").unwrap();
    drop(db);
    // Replay must apply the completion to "new" only; "old" stays in flight.
    let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
    assert_eq!(
        db.get(&scope, b"old").unwrap().unwrap().status(),
        RecordStatus::InFlight
    );
    assert_eq!(
        db.get(&scope, b"new").unwrap().unwrap().status(),
        RecordStatus::Completed
    );
}

#[test]
fn a_second_open_of_one_directory_is_locked_out() {
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
    match Db::open(durable_options(dir.path(), &clock)) {
        Err(Error::Locked(path)) => assert_eq!(path, dir.path()),
        Err(other) => panic!("expected Locked, got {other}"),
        Ok(_) => panic!("expected Locked, got a database"),
    }
    drop(db);
    Db::open(durable_options(dir.path(), &clock)).unwrap();
}

#[test]
fn reopening_with_another_window_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    drop(Db::open(durable_options(dir.path(), &clock)).unwrap());
    let other = durable_options(dir.path(), &clock).window(WINDOW * 2);
    assert!(matches!(
        Db::open(other),
        Err(Error::IncompatibleOptions(_))
    ));
}

#[test]
fn keys_remember_their_bucket_across_reopen() {
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    {
        let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
        db.insert_if_absent(b"early").unwrap();
        clock.advance(WINDOW / 2);
        db.insert_if_absent(b"late").unwrap();
    }
    clock.advance(WINDOW / 2 + BUCKET);
    let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
    assert!(
        !db.contains(b"early").unwrap(),
        "replay must not extend a key's window"
    );
    assert!(db.contains(b"late").unwrap());
}

#[test]
fn expired_segments_are_deleted_whole() {
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
    for i in 0..5u32 {
        db.insert_if_absent(&i.to_le_bytes()).unwrap();
        clock.advance(BUCKET);
    }
    assert_eq!(segment_files(dir.path()).len(), 5);
    clock.advance(WINDOW);
    db.insert_if_absent(b"now").unwrap();
    assert_eq!(
        segment_files(dir.path()).len(),
        1,
        "{:?}",
        segment_files(dir.path())
    );
    assert_eq!(db.stats().segments_deleted, 5);
    drop(db);
    let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
    assert!(db.contains(b"now").unwrap());
    assert!(!db.contains(&0u32.to_le_bytes()).unwrap());
}

#[test]
fn expired_segments_are_deleted_at_open() {
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    drop({
        let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
        db.insert_if_absent(b"old").unwrap();
        db
    });
    clock.advance(WINDOW + BUCKET);
    let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
    assert!(segment_files(dir.path()).is_empty());
    // The sealed segment holding "old" and the empty one its clean close started.
    assert_eq!(db.stats().segments_deleted, 2);
    assert!(db.insert_if_absent(b"old").unwrap());
}

#[test]
fn segments_roll_over_at_the_size_limit() {
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let options = durable_options(dir.path(), &clock).segment_max_bytes(4096);
    {
        let db = Db::open(options.clone()).unwrap();
        for i in 0..1_000u32 {
            db.insert_if_absent(&i.to_le_bytes()).unwrap();
        }
    }
    assert!(
        segment_files(dir.path()).len() >= 8,
        "{:?}",
        segment_files(dir.path())
    );
    let db = Db::open(options).unwrap();
    for i in 0..1_000u32 {
        assert!(db.contains(&i.to_le_bytes()).unwrap());
    }
}

#[test]
fn a_batch_costs_one_fsync_and_writers_share_fsyncs() {
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let db = Db::open(durable_options(dir.path(), &clock).durability(Durability::Sync)).unwrap();
    db.insert_if_absent(b"warm-up").unwrap();
    let before = db.stats().fsyncs;
    let keys: Vec<[u8; 4]> = (0..1_000u32).map(u32::to_le_bytes).collect();
    db.insert_many(&keys).unwrap();
    assert_eq!(db.stats().fsyncs - before, 1);

    let threads = 16;
    let per_thread = 200u32;
    let before = db.stats().fsyncs;
    std::thread::scope(|s| {
        for t in 0..threads {
            let db = &db;
            s.spawn(move || {
                for i in 0..per_thread {
                    db.insert_if_absent(format!("{t}-{i}").as_bytes()).unwrap();
                }
            });
        }
    });
    let fsyncs = db.stats().fsyncs - before;
    let writes = u64::from(per_thread) * threads;
    eprintln!("{fsyncs} fsyncs for {writes} writes");
    // Writers arriving while a leader syncs share the next fsync: with 16 writers a
    // group holds several writes. One fsync per write would mean no group commit.
    assert!(fsyncs * 3 <= writes, "{fsyncs} fsyncs for {writes} writes");
}

#[test]
fn in_memory_flush_is_a_no_op_and_open_needs_no_directory() {
    let db = Db::open(Options::in_memory()).unwrap();
    db.flush().unwrap();
    assert_eq!(db.stats().fsyncs, 0);
}

#[test]
fn segments_stay_within_their_limit_and_roll_over_once_per_boundary() {
    const MAX: u64 = 4096;
    // The largest append: a finish frame with a 900-byte response and its group's mark.
    const LARGEST_APPEND: u64 = 20 + 36 + 900 + 28;
    const SEAL: u64 = 28;
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let options = durable_options(dir.path(), &clock)
        .durability(Durability::Sync)
        .segment_max_bytes(MAX);
    {
        let db = Db::open(options.clone()).unwrap();
        let scope = Scope::new("org", "big");
        std::thread::scope(|s| {
            for t in 0..8u32 {
                let (db, scope) = (&db, &scope);
                s.spawn(move || {
                    for i in 0..60u32 {
                        let key = format!("{t}-{i}");
                        let Reservation::Acquired(lease) =
                            db.reserve(scope, key.as_bytes(), b"r").unwrap()
                        else {
                            panic!("fresh key");
                        };
                        let len = 100 + (t * 131 + i * 37) % 801;
                        lease.complete(&vec![7; len as usize]).unwrap();
                    }
                });
            }
        });
    }
    let sizes: Vec<u64> = segment_files(dir.path())
        .iter()
        .map(|name| std::fs::metadata(dir.path().join(name)).unwrap().len())
        .collect();
    assert!(sizes.len() > 20, "{sizes:?}");
    for &size in &sizes {
        assert!(
            size <= MAX + SEAL,
            "a segment of {size} bytes passed the limit: {sizes:?}"
        );
    }
    // Each segment rolled over only when the next append did not fit: none but the last
    // data segment and the empty one a clean close starts is far from full.
    for &size in &sizes[..sizes.len() - 2] {
        assert!(
            size + LARGEST_APPEND + SEAL >= MAX,
            "a segment of {size} bytes was rolled over early: {sizes:?}"
        );
    }
    let db = Db::open(options).unwrap();
    assert_eq!(db.stats().live_records, 8 * 60);
}

#[test]
fn stats_report_bytes_on_disk_and_fsync_latency() {
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let db = Db::open(
        durable_options(dir.path(), &clock)
            .durability(Durability::Sync)
            .segment_max_bytes(4096),
    )
    .unwrap();
    for i in 0..300u32 {
        db.insert_if_absent(&i.to_le_bytes()).unwrap();
    }
    clock.advance(BUCKET);
    db.insert_if_absent(b"next bucket").unwrap();
    let stats = db.stats();
    let files = segment_files(dir.path());
    let on_disk: u64 = files
        .iter()
        .map(|name| std::fs::metadata(dir.path().join(name)).unwrap().len())
        .sum::<u64>()
        + std::fs::metadata(dir.path().join("MANIFEST"))
            .unwrap()
            .len();
    assert_eq!(stats.segments, files.len() as u64);
    assert_eq!(stats.bytes_on_disk, on_disk);
    assert!(stats.fsyncs >= 301, "{stats:?}");
    assert!(stats.fsync_p50_us > 0 && stats.fsync_p50_us <= stats.fsync_p99_us);
    assert!(stats.fsync_p99_us <= stats.fsync_max_us);
}
