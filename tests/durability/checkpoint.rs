//! `Db::checkpoint`: a consistent, openable copy of a store taken while writers go on.
//! The copy holds every write acknowledged before the call and none begun after it
//! returned; immutable files are linked where the file system allows and copied
//! otherwise; expired buckets and sealed runs answer in the copy as in the store; a
//! failed call at any I/O step leaves the store serving and never a copy that opens
//! smaller than it claims.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::support::{BUCKET, WINDOW, manual_clock, real_files};
use oncedb::io::{FaultyStorage, MemStorage, Storage};
use oncedb::{Db, Durability, Error, ManualClock, Options, Reservation, Scope};

fn key(writer: u64, n: u64) -> Vec<u8> {
    format!("writer-{writer}-key-{n}").into_bytes()
}

/// Two writers admit keys (and every tenth a record, completed) while a checkpoint is
/// taken: the copy holds every key and record acknowledged before the call, none that
/// began after it returned, and its immutable files are links.
#[test]
fn a_checkpoint_taken_while_writers_go_on_holds_every_acknowledged_write() {
    let _files = real_files();
    let dir = tempfile::tempdir().unwrap();
    let options = |path: &Path| {
        Options::new(path)
            .window(Duration::from_secs(600))
            .bucket_width(Duration::from_secs(60))
            .durability(Durability::Sync)
            .segment_max_bytes(64 << 10)
    };
    let db = Db::open(options(&dir.path().join("db"))).unwrap();
    let scope = Scope::new("t", "checkpoint");
    let stop = Arc::new(AtomicBool::new(false));
    let acked: Arc<[AtomicU64; 2]> = Arc::new([AtomicU64::new(0), AtomicU64::new(0)]);
    let writers: Vec<_> = (0..2u64)
        .map(|writer| {
            let (db, scope, stop, acked) = (
                db.clone(),
                scope.clone(),
                Arc::clone(&stop),
                Arc::clone(&acked),
            );
            std::thread::spawn(move || {
                let mut n = 0;
                while !stop.load(Ordering::Acquire) {
                    assert!(db.insert_if_absent(&key(writer, n)).unwrap());
                    if n % 10 == 0 {
                        let Reservation::Acquired(lease) =
                            db.reserve(&scope, &key(writer, n), b"req").unwrap()
                        else {
                            panic!("a new record");
                        };
                        lease.complete(&key(writer, n)).unwrap();
                    }
                    n += 1;
                    acked[writer as usize].store(n, Ordering::Release);
                }
            })
        })
        .collect();
    // Enough writes that segments rolled over (64 KiB each) before the checkpoint.
    while acked
        .iter()
        .any(|count| count.load(Ordering::Acquire) < 3000)
    {
        std::thread::yield_now();
    }
    let before: Vec<u64> = acked.iter().map(|c| c.load(Ordering::Acquire)).collect();
    let checkpoint = db.checkpoint(dir.path().join("copy")).unwrap();
    let after: Vec<u64> = acked.iter().map(|c| c.load(Ordering::Acquire)).collect();
    // Writers go on after the call, by more than the one call each had under way.
    while acked
        .iter()
        .zip(&after)
        .any(|(count, after)| count.load(Ordering::Acquire) < after + 100)
    {
        std::thread::yield_now();
    }
    stop.store(true, Ordering::Release);
    for writer in writers {
        writer.join().unwrap();
    }
    assert!(checkpoint.files_linked > 0, "{checkpoint:?}");
    assert!(checkpoint.files_copied >= 1, "the active segment is copied");

    let copy = Db::open(options(&dir.path().join("copy"))).unwrap();
    for writer in 0..2u64 {
        for n in 0..before[writer as usize] {
            assert!(
                copy.contains(&key(writer, n)).unwrap(),
                "key {writer}/{n} lost"
            );
            if n % 10 == 0 {
                let Reservation::Completed(record) =
                    copy.reserve(&scope, &key(writer, n), b"req").unwrap()
                else {
                    panic!("record {writer}/{n} lost");
                };
                assert_eq!(record.response(), Some(&key(writer, n)[..]));
            }
        }
        // A write begun after the call returned is past the copy's log.
        for n in after[writer as usize] + 1..after[writer as usize] + 100 {
            assert!(!copy.contains(&key(writer, n)).unwrap(), "key {writer}/{n}");
        }
    }
    // The source serves on, unchanged by the copy.
    assert!(!db.insert_if_absent(&key(0, 0)).unwrap());
    assert!(db.insert_if_absent(b"after the checkpoint").unwrap());
}

fn budgeted(dir: &str, disk: &Arc<MemStorage>, clock: &ManualClock) -> Options {
    Options::new(dir)
        .window(WINDOW)
        .bucket_width(BUCKET)
        .clock(clock.clone())
        .durability(Durability::Buffered)
        .memory_budget(1 << 16)
        .shards(4)
        .storage(Arc::clone(disk) as Arc<dyn Storage>)
}

/// A store whose keys and records were sealed into runs (and runs merged), some of whose
/// buckets expired: its checkpoint, on a storage that cannot link, answers every key and
/// every record as the store does.
#[test]
fn a_checkpoint_of_sealed_runs_and_expired_buckets_answers_as_the_store() {
    const RECORDS_A_MINUTE: u32 = 100;
    let disk = Arc::new(MemStorage::new());
    let clock = manual_clock();
    let db = Db::open(budgeted("/db", &disk, &clock)).unwrap();
    let keys = |range: std::ops::Range<u32>| -> Vec<Vec<u8>> {
        range.map(|n| format!("k{n}").into_bytes()).collect()
    };
    let scope = oncedb::Scope::new("org", "pay");
    for minute in 0..90u32 {
        let batch = keys(minute * 400..minute * 400 + 400);
        db.insert_many(&batch).unwrap();
        for record in keys(minute * RECORDS_A_MINUTE..(minute + 1) * RECORDS_A_MINUTE) {
            let oncedb::Reservation::Acquired(lease) = db.reserve(&scope, &record, b"r").unwrap()
            else {
                panic!("a new record");
            };
            lease.complete(&record).unwrap();
        }
        clock.forward(BUCKET);
    }
    db.flush().unwrap();
    assert!(db.stats().sealed_runs > 0, "key runs were sealed");
    assert!(db.stats().sealed_record_runs > 0, "record runs were sealed");
    let checkpoint = db.checkpoint("/copy").unwrap();
    assert_eq!(checkpoint.files_linked, 0, "MemStorage cannot link");
    assert!(checkpoint.files_copied > 1);
    let copy = Db::open(budgeted("/copy", &disk, &clock)).unwrap();
    // The copy holds the runs (those whose window has not passed: the source retires
    // the others at its next look), so it does not rebuild their records from the log.
    let copied = copy.stats();
    assert!(copied.sealed_record_runs > 0, "{copied:?}");
    assert!(copied.live_records < copied.sealed_records, "{copied:?}");
    let mut live = 0;
    for probe in keys(0..90 * 400) {
        let expected = db.contains(&probe).unwrap();
        live += usize::from(expected);
        assert_eq!(copy.contains(&probe).unwrap(), expected, "{probe:?}");
    }
    assert!(
        live > 0 && live < 90 * 400,
        "some buckets expired, some live"
    );
    let response = |db: &Db, record: &[u8]| {
        db.get(&scope, record)
            .unwrap()
            .map(|got| got.response().map(<[u8]>::to_vec))
    };
    for record in keys(0..90 * RECORDS_A_MINUTE) {
        assert_eq!(
            response(&copy, &record),
            response(&db, &record),
            "{record:?}"
        );
    }
}

#[test]
fn a_checkpoint_is_refused_for_a_store_in_memory_or_a_directory_in_use() {
    let clock = manual_clock();
    let memory = Db::open(Options::in_memory().clock(clock.clone())).unwrap();
    assert!(matches!(
        memory.checkpoint("/anywhere"),
        Err(Error::InvalidOptions(_))
    ));
    let disk = Arc::new(MemStorage::new());
    let db = Db::open(budgeted("/db", &disk, &clock)).unwrap();
    assert!(db.insert_if_absent(b"k").unwrap());
    // The store's own directory holds files: refused, and nothing written there. (The
    // segment worker prepares the next segment, a `prep-` file, whenever it gets to it.)
    let files = || {
        let listed = disk.list(Path::new("/db")).unwrap();
        let prepared = |path: &std::path::PathBuf| {
            let name = path
                .file_name()
                .map(|name| name.to_string_lossy().into_owned());
            name.is_some_and(|name| name.starts_with("prep-"))
        };
        listed
            .into_iter()
            .filter(|path| !prepared(path))
            .collect::<Vec<_>>()
    };
    let before = files();
    assert!(matches!(
        db.checkpoint("/db"),
        Err(Error::InvalidOptions(_))
    ));
    assert_eq!(files(), before);
}

/// A failure at any I/O call of a checkpoint is returned; the store serves on (only a
/// failure of its own group commit poisons it, as for any write); and the copy either
/// opens with every key or is refused as `Corrupted` (segments without a manifest), or
/// holds nothing at all: never a smaller window.
#[test]
fn a_checkpoint_failing_at_any_call_never_leaves_a_smaller_copy() {
    let mut call = 1;
    loop {
        let disk = Arc::new(MemStorage::new());
        let faulty = Arc::new(FaultyStorage::new(Arc::clone(&disk) as Arc<dyn Storage>));
        let clock = manual_clock();
        let options = |dir: &str, storage: Arc<dyn Storage>| {
            Options::new(dir)
                .window(WINDOW)
                .bucket_width(BUCKET)
                .clock(clock.clone())
                .durability(Durability::Sync)
                .segment_max_bytes(4096)
                .storage(storage)
        };
        let db = Db::open(options("/db", Arc::clone(&faulty) as Arc<dyn Storage>)).unwrap();
        let keys: Vec<Vec<u8>> = (0..400u32).map(|n| n.to_le_bytes().to_vec()).collect();
        for batch in keys.chunks(50) {
            db.insert_many(batch).unwrap();
            clock.forward(BUCKET);
        }
        // The segment worker's background work done: every call counted from here is
        // the checkpoint's.
        db.flush().unwrap();
        faulty.reset();
        faulty.fail_at(call, false);
        let answer = db.checkpoint("/copy");
        let failed = faulty.failures() > 0;
        faulty.reset();
        match &answer {
            Ok(_) => assert!(!failed, "call {call}: a failure went unreported"),
            Err(Error::Poisoned) | Err(Error::Io(_)) => {}
            Err(other) => panic!("call {call}: {other}"),
        }
        // The store serves on unless its own commit failed.
        match db.insert_if_absent(b"after") {
            Ok(admitted) => assert!(admitted),
            Err(Error::Poisoned) => {}
            Err(other) => panic!("call {call}: {other}"),
        }
        drop(db);
        let copy = Db::open(options("/copy", Arc::clone(&disk) as Arc<dyn Storage>));
        match (answer.is_ok(), copy) {
            (true, Ok(copy)) => {
                for probe in &keys {
                    assert!(copy.contains(probe).unwrap(), "call {call}");
                }
            }
            (false, Err(Error::Corrupted { .. })) => {}
            // Failed before anything was copied, or after the manifest was in place
            // (its directory fsync): nothing, or everything.
            (false, Ok(copy)) => {
                let held = keys.iter().filter(|k| copy.contains(k).unwrap()).count();
                assert!(held == 0 || held == keys.len(), "call {call}: {held} keys");
            }
            (ok, Err(err)) => panic!("call {call}: checkpoint ok {ok}, open {err}"),
        }
        if !failed {
            break;
        }
        call += 1;
    }
    assert!(
        call > 10,
        "every call of the checkpoint was failed once ({call})"
    );
}

/// Under `Buffered` and `Interval` durability, writes acknowledged but not yet fsynced
/// are in the copy too: the checkpoint commits what was appended before it copies.
#[test]
fn a_checkpoint_holds_the_writes_not_yet_fsynced() {
    for durability in [
        Durability::Buffered,
        Durability::Interval(Duration::from_secs(3600)),
    ] {
        let disk = Arc::new(MemStorage::new());
        let clock = manual_clock();
        let options = |dir: &str| {
            Options::new(dir)
                .window(WINDOW)
                .bucket_width(BUCKET)
                .clock(clock.clone())
                .durability(durability)
                .storage(Arc::clone(&disk) as Arc<dyn Storage>)
        };
        let db = Db::open(options("/db")).unwrap();
        let keys: Vec<Vec<u8>> = (0..100u32).map(|n| n.to_le_bytes().to_vec()).collect();
        db.insert_many(&keys).unwrap();
        db.checkpoint("/copy").unwrap();
        drop(db);
        // What a power loss keeps of the copy: its fsynced bytes.
        disk.power_loss();
        let copy = Db::open(options("/copy")).unwrap();
        for probe in &keys {
            assert!(copy.contains(probe).unwrap(), "{durability:?}");
        }
    }
}
