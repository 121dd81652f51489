//! Responses in the log: a durable store keeps a finished record's response on disk
//! (memory holds the span of its finish frame), reads it back with one positioned read
//! on replay, and rebuilds the spans at open without holding response bytes.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use crate::support::{BUCKET, WINDOW, manual_clock};
use oncedb::io::{FaultyStorage, MemStorage, Storage};
use oncedb::{Db, Durability, Error, ManualClock, Options, Reservation, Scope};

const RECORDS: u32 = 200;
const RESPONSE_BYTES: usize = 8192;

fn response_of(i: u32) -> Vec<u8> {
    let mut response = vec![(i % 251) as u8; RESPONSE_BYTES];
    response[..4].copy_from_slice(&i.to_le_bytes());
    response
}

fn options(storage: Arc<dyn Storage>, clock: &ManualClock, durability: Durability) -> Options {
    Options::new("/db")
        .window(WINDOW)
        .bucket_width(BUCKET)
        .clock(clock.clone())
        .durability(durability)
        .storage(storage)
}

fn complete_all(db: &Db, scope: &Scope) {
    for i in 0..RECORDS {
        let Reservation::Acquired(lease) = db.reserve(scope, &i.to_le_bytes(), b"req").unwrap()
        else {
            panic!("a fresh key is acquired");
        };
        lease.complete(&response_of(i)).unwrap();
    }
}

fn replays_all(db: &Db, scope: &Scope) {
    for i in 0..RECORDS {
        let Reservation::Completed(record) = db.reserve(scope, &i.to_le_bytes(), b"req").unwrap()
        else {
            panic!("record {i} is completed");
        };
        assert_eq!(record.response(), Some(&response_of(i)[..]), "record {i}");
        let got = db.get(scope, &i.to_le_bytes()).unwrap().unwrap();
        assert_eq!(got.response(), Some(&response_of(i)[..]));
    }
}

/// Memory holds no response bytes once they are in the log, in every durable mode
/// (in `Interval`, once the log is written: here at `flush`), and none after a reopen;
/// every replay still returns the bytes.
#[test]
fn responses_live_in_the_log_and_replay_byte_for_byte() {
    let all_bytes = u64::from(RECORDS) * RESPONSE_BYTES as u64;
    for durability in [
        Durability::Sync,
        Durability::Buffered,
        Durability::Interval(Duration::from_secs(3600)),
    ] {
        let disk = MemStorage::new();
        let clock = manual_clock();
        let scope = Scope::new("org", "pay");
        let db = Db::open(options(Arc::new(disk.clone()), &clock, durability)).unwrap();
        let empty = db.stats().index_bytes;
        complete_all(&db, &scope);
        if matches!(durability, Durability::Interval(_)) {
            // The last appends are not yet written (an interval writer writes once a
            // megabyte is buffered): memory holds their bytes, and replays them.
            assert!(db.stats().index_bytes >= empty + 16 * RESPONSE_BYTES as u64);
            replays_all(&db, &scope);
            db.flush().unwrap();
        }
        let held = db.stats().index_bytes - empty;
        assert!(
            held < all_bytes / 20,
            "{durability:?}: {held} bytes held for {all_bytes} bytes of responses"
        );
        replays_all(&db, &scope);
        drop(db);
        disk.process_crash();
        let db = Db::open(options(Arc::new(disk.clone()), &clock, durability)).unwrap();
        let held = db.stats().index_bytes - empty;
        assert!(held < all_bytes / 20, "after a reopen: {held} bytes held");
        replays_all(&db, &scope);
    }
}

/// A finished record whose response and key are both in the log keeps a fixed-size
/// form: the memory it holds does not grow with its key (here 4 KiB keys), before or
/// after a reopen, and every replay still compares the key and returns the bytes.
#[test]
fn finished_records_hold_neither_their_response_nor_their_key() {
    const KEY_BYTES: usize = 4096;
    let key = |i: u32| {
        let mut key = vec![(i % 253) as u8; KEY_BYTES];
        key[..4].copy_from_slice(&i.to_le_bytes());
        key
    };
    let disk = MemStorage::new();
    let clock = manual_clock();
    let scope = Scope::new("org", "pay");
    let open = || {
        let options = options(Arc::new(disk.clone()), &clock, Durability::Sync);
        Db::open(options.max_key_bytes(KEY_BYTES)).unwrap()
    };
    let db = open();
    let empty = db.stats().index_bytes;
    for i in 0..RECORDS {
        let Reservation::Acquired(lease) = db.reserve(&scope, &key(i), b"req").unwrap() else {
            panic!("a fresh key is acquired");
        };
        lease.complete(&response_of(i)).unwrap();
    }
    let per_record = |db: &Db| (db.stats().index_bytes - empty) / u64::from(RECORDS);
    assert!(per_record(&db) < 512, "{} bytes a record", per_record(&db));
    drop(db);
    disk.process_crash();
    let db = open();
    assert!(
        per_record(&db) < 512,
        "after a reopen: {} bytes",
        per_record(&db)
    );
    for i in 0..RECORDS {
        let Reservation::Completed(record) = db.reserve(&scope, &key(i), b"req").unwrap() else {
            panic!("record {i} is completed");
        };
        assert_eq!(record.response(), Some(&response_of(i)[..]));
        assert!(matches!(
            db.reserve(&scope, &key(i), b"other").unwrap(),
            Reservation::Mismatch
        ));
    }
}

/// A settled record (finished, response and key in the log) takes the dense tier's packed
/// slot: at most 96 bytes of the store's memory a record, once finished and after a
/// reopen (which once sized the dedup tables for the records as well, 20 bytes a record
/// more), and each still replays, refuses a mismatch and answers its key's collision
/// check from the log.
#[test]
fn settled_records_take_at_most_96_bytes_each() {
    const MANY: u32 = 100_000;
    let disk = MemStorage::new();
    let clock = manual_clock();
    let scope = Scope::new("org", "pay");
    let open = || {
        Db::open(options(
            Arc::new(disk.clone()),
            &clock,
            Durability::Buffered,
        ))
        .unwrap()
    };
    let db = open();
    let empty = db.stats().index_bytes;
    for i in 0..MANY {
        let Reservation::Acquired(lease) = db.reserve(&scope, &i.to_le_bytes(), b"req").unwrap()
        else {
            panic!("a fresh key is acquired");
        };
        lease.complete(&i.to_be_bytes()).unwrap();
    }
    let per_record = |db: &Db| (db.stats().index_bytes - empty) / u64::from(MANY);
    assert!(per_record(&db) <= 96, "{} bytes a record", per_record(&db));
    drop(db);
    disk.process_crash();
    let db = open();
    assert!(
        per_record(&db) <= 96,
        "after a reopen: {} bytes",
        per_record(&db)
    );
    for i in (0..MANY).step_by(997) {
        let Reservation::Completed(record) = db.reserve(&scope, &i.to_le_bytes(), b"req").unwrap()
        else {
            panic!("record {i} is completed");
        };
        assert_eq!(record.response(), Some(&i.to_be_bytes()[..]));
        assert!(matches!(
            db.reserve(&scope, &i.to_le_bytes(), b"other").unwrap(),
            Reservation::Mismatch
        ));
    }
}

/// A key damaged on disk in a record's reserve frame is `Corrupted` when the record is
/// next looked up in compact form, never a replay of unchecked bytes.
#[test]
fn a_key_damaged_after_open_is_corrupted_on_lookup() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let scope = Scope::new("org", "pay");
    let db = Db::open(options(Arc::new(disk.clone()), &clock, Durability::Sync)).unwrap();
    let key = b"a key long enough to be found on disk";
    let Reservation::Acquired(lease) = db.reserve(&scope, key, b"req").unwrap() else {
        panic!("a fresh key is acquired");
    };
    lease.complete(b"done").unwrap();
    let path = first_segment(&disk);
    let mut bytes = disk.contents(&path).unwrap();
    let at = bytes.windows(key.len()).position(|w| w == key).unwrap();
    bytes[at + 3] ^= 0x01;
    disk.set_contents(&path, bytes);
    for request in [&b"req"[..], b"other"] {
        let answer = db.reserve(&scope, key, request);
        assert!(matches!(answer, Err(Error::Corrupted { .. })), "{answer:?}");
    }
    assert!(matches!(db.get(&scope, key), Err(Error::Corrupted { .. })));
}

fn first_segment(disk: &MemStorage) -> std::path::PathBuf {
    disk.list(Path::new("/db"))
        .unwrap()
        .into_iter()
        .find(|p| p.file_name().unwrap().to_str().unwrap().starts_with("seg-"))
        .unwrap()
}

/// A response damaged on disk after open is `Corrupted` on replay, never other bytes.
#[test]
fn a_response_damaged_after_open_is_corrupted_on_replay() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let scope = Scope::new("org", "pay");
    let db = Db::open(options(Arc::new(disk.clone()), &clock, Durability::Sync)).unwrap();
    complete_all(&db, &scope);
    let path = first_segment(&disk);
    let mut bytes = disk.contents(&path).unwrap();
    // Inside the first record's response.
    let response = response_of(0);
    let at = bytes
        .windows(response.len())
        .position(|w| w == &response[..])
        .unwrap();
    bytes[at + 100] ^= 0x40;
    disk.set_contents(&path, bytes);
    let answer = db.reserve(&scope, &0u32.to_le_bytes(), b"req");
    assert!(matches!(answer, Err(Error::Corrupted { .. })), "{answer:?}");
    assert!(matches!(
        db.get(&scope, &0u32.to_le_bytes()),
        Err(Error::Corrupted { .. })
    ));
}

/// A failed read is reported and poisons the store, like a failed write.
#[test]
fn a_failed_read_of_a_response_poisons_the_store() {
    let disk = MemStorage::new();
    let faulty = FaultyStorage::new(Arc::new(disk));
    let clock = manual_clock();
    let scope = Scope::new("org", "pay");
    let db = Db::open(options(Arc::new(faulty.clone()), &clock, Durability::Sync)).unwrap();
    complete_all(&db, &scope);
    faulty.fail_reads(true);
    assert!(matches!(
        db.reserve(&scope, &1u32.to_le_bytes(), b"req"),
        Err(Error::Io(_))
    ));
    faulty.fail_reads(false);
    assert!(matches!(
        db.insert_if_absent(b"after"),
        Err(Error::Poisoned)
    ));
}

/// The file descriptors of this process that point at a `seg-` file of `dir`, with
/// the targets the kernel names (a removed file's ends with "(deleted)").
fn open_segments(dir: &Path) -> Vec<String> {
    std::fs::read_dir("/proc/self/fd")
        .unwrap()
        .filter_map(|fd| std::fs::read_link(fd.ok()?.path()).ok())
        .map(|target| target.display().to_string())
        .filter(|target| target.starts_with(&dir.display().to_string()) && target.contains("/seg-"))
        .collect()
}

/// On the real file system a replay reads through the segment's file, opened at the
/// first replay and kept: moved away after that, every response still replays. The
/// handles of segments that expire are let go, so their disk space is freed.
#[test]
fn replays_read_through_segment_files_kept_open_until_they_expire() {
    let _files = crate::support::real_files();
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let scope = Scope::new("org", "pay");
    let options =
        || crate::support::durable_options(dir.path(), &clock).durability(Durability::Buffered);
    let db = Db::open(options()).unwrap();
    complete_all(&db, &scope);
    db.flush().unwrap();
    replays_all(&db, &scope);
    let segments: Vec<std::path::PathBuf> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .filter(|path| {
            path.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("seg-")
        })
        .collect();
    let moved = |path: &Path| path.with_extension("moved");
    for path in &segments {
        std::fs::rename(path, moved(path)).unwrap();
    }
    replays_all(&db, &scope);
    for path in &segments {
        std::fs::rename(moved(path), path).unwrap();
    }
    assert!(!open_segments(dir.path()).is_empty());
    clock.forward(WINDOW + BUCKET);
    assert!(db.insert_if_absent(b"now").unwrap());
    db.flush().unwrap();
    assert!(db.stats().segments_deleted > 0);
    let deleted: Vec<String> = open_segments(dir.path())
        .into_iter()
        .filter(|target| target.ends_with("(deleted)"))
        .collect();
    assert!(
        deleted.is_empty(),
        "expired segments held open: {deleted:?}"
    );
    drop(db);
    let db = Db::open(options()).unwrap();
    assert!(!db.insert_if_absent(b"now").unwrap());
}
