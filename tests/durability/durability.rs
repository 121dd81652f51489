//! Durable stores: reopen, locking, manifest checks, segment expiry, group commit.
//!
//! Every test here on the real file system holds `support::real_files()`, so that no
//! crash test's child process holds a copy of a store's lock while the store is reopened.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::support::{BUCKET, WINDOW, durable_options, manual_clock, real_files};
use oncedb::io::{StdStorage, Storage, StorageFile};
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
    let _files = real_files();
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
    let _files = real_files();
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
    let _files = real_files();
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
    let _files = real_files();
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
    let _files = real_files();
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    {
        let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
        db.insert_if_absent(b"early").unwrap();
        clock.forward(WINDOW / 2);
        db.insert_if_absent(b"late").unwrap();
    }
    clock.forward(WINDOW / 2 + BUCKET);
    let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
    assert!(
        !db.contains(b"early").unwrap(),
        "replay must not extend a key's window"
    );
    assert!(db.contains(b"late").unwrap());
}

#[test]
fn expired_segments_are_deleted_whole() {
    let _files = real_files();
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
    for i in 0..5u32 {
        db.insert_if_absent(&i.to_le_bytes()).unwrap();
        clock.forward(BUCKET);
    }
    assert_eq!(segment_files(dir.path()).len(), 5);
    clock.forward(WINDOW);
    db.insert_if_absent(b"now").unwrap();
    // The segment worker deletes expired segments off the writer's path; a flush waits
    // for it.
    db.flush().unwrap();
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
    let _files = real_files();
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    drop({
        let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
        db.insert_if_absent(b"old").unwrap();
        db
    });
    clock.forward(WINDOW + BUCKET);
    let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
    assert!(segment_files(dir.path()).is_empty());
    // The sealed segment holding "old" and the empty one its clean close started.
    assert_eq!(db.stats().segments_deleted, 2);
    assert!(db.insert_if_absent(b"old").unwrap());
}

#[test]
fn segments_roll_over_at_the_size_limit() {
    let _files = real_files();
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
    let _files = real_files();
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let db = Db::open(durable_options(dir.path(), &clock).durability(Durability::Sync)).unwrap();
    db.insert_if_absent(b"warm-up").unwrap();
    // The warm-up rolled over to the first segment: let the segment worker finish its
    // fsyncs (it prepares the next segments) before counting the batch's.
    db.flush().unwrap();
    let before = db.stats().fsyncs;
    let keys: Vec<[u8; 4]> = (0..1_000u32).map(u32::to_le_bytes).collect();
    db.insert_many(&keys).unwrap();
    assert_eq!(db.stats().fsyncs - before, 1);

    let threads = 16;
    let per_thread = 60u32;
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

/// `Sync` group commits wake each waiter once: the writers that append while a leader
/// syncs sleep until the next group, which one of them leads (the only one the leader
/// wakes) and which covers the others. A leader that woke every sleeper would wake all
/// of them while the next group's fsync runs, and they would sleep again.
#[test]
fn a_group_commit_wakes_only_the_waiters_it_covers() {
    let disk = oncedb::io::MemStorage::new();
    let gate = oncedb_testkit::gate::SyncGate::writers();
    let watch = gate.storage(disk);
    let options = Options::new("/db")
        .window(WINDOW)
        .bucket_width(BUCKET)
        .clock(manual_clock())
        .durability(Durability::Sync)
        .storage(std::sync::Arc::new(watch));
    let db = Db::open(options).unwrap();
    db.insert_if_absent(b"warm-up").unwrap();
    db.flush().unwrap();
    let before = db.stats();
    let writers = 8u64;
    gate.hold(2);
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    let mut woken_first = 0;
    std::thread::scope(|s| {
        s.spawn(|| assert!(db.insert_if_absent(b"leader").unwrap()));
        gate.await_held(1);
        // The leader is inside its fsync: every writer now appends and sleeps.
        for w in 0..writers {
            let db = &db;
            s.spawn(move || assert!(db.insert_if_absent(&w.to_le_bytes()).unwrap()));
        }
        while db.stats().commit_waits - before.commit_waits < writers {
            assert!(std::time::Instant::now() < deadline, "writers never waited");
            std::thread::yield_now();
        }
        gate.release_one();
        // The next group's leader is inside its fsync: the first group's end woke it
        // and no other writer.
        gate.await_held(2);
        woken_first = db.stats().commit_wakeups - before.commit_wakeups;
        gate.release_one();
    });
    assert_eq!(
        woken_first, 1,
        "the first group's end woke the next leader alone"
    );
    let stats = db.stats();
    assert_eq!(
        stats.fsyncs - before.fsyncs,
        2,
        "the leader's group and the next"
    );
    assert_eq!(
        stats.commit_waits - before.commit_waits,
        writers,
        "each slept once"
    );
    assert_eq!(
        stats.commit_wakeups - before.commit_wakeups,
        writers,
        "each woke once"
    );
    assert!((0..writers).all(|w| db.contains(&w.to_le_bytes()).unwrap()));
}

#[test]
fn in_memory_flush_is_a_no_op_and_open_needs_no_directory() {
    let db = Db::open(Options::in_memory()).unwrap();
    db.flush().unwrap();
    assert_eq!(db.stats().fsyncs, 0);
}

#[test]
fn segments_stay_within_their_limit_and_roll_over_once_per_boundary() {
    let _files = real_files();
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
    let _files = real_files();
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
    clock.forward(BUCKET);
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

/// One state-changing call: the calling thread's name, the operation, the file name.
type Call = (String, &'static str, String);

/// A [`Storage`] over the real file system that records which thread made each
/// state-changing call.
#[derive(Clone, Default)]
struct RecordingStorage {
    calls: std::sync::Arc<parking_lot::Mutex<Vec<Call>>>,
}

impl RecordingStorage {
    fn record(&self, op: &'static str, path: &std::path::Path) {
        let thread = std::thread::current().name().unwrap_or("").to_string();
        let name = path.file_name().map(|n| n.to_string_lossy().into_owned());
        self.calls
            .lock()
            .push((thread, op, name.unwrap_or_default()));
    }

    fn take(&self) -> Vec<Call> {
        std::mem::take(&mut *self.calls.lock())
    }
}

struct RecordingFile {
    inner: Box<dyn StorageFile>,
    storage: RecordingStorage,
    path: PathBuf,
}

impl StorageFile for RecordingFile {
    fn append(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.inner.append(data)
    }
    fn sync(&mut self) -> std::io::Result<()> {
        self.storage.record("sync", &self.path);
        self.inner.sync()
    }
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }
    fn truncate(&mut self, len: u64) -> std::io::Result<()> {
        self.inner.truncate(len)
    }
}

impl Storage for RecordingStorage {
    fn create_dir_all(&self, dir: &Path) -> std::io::Result<()> {
        StdStorage.create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
        StdStorage.list(dir)
    }
    fn open_append(&self, path: &Path, create: bool) -> std::io::Result<Box<dyn StorageFile>> {
        if create {
            self.record("create", path);
        }
        Ok(Box::new(RecordingFile {
            inner: StdStorage.open_append(path, create)?,
            storage: self.clone(),
            path: path.to_path_buf(),
        }))
    }
    fn read(&self, path: &Path, max_bytes: u64) -> std::io::Result<Vec<u8>> {
        StdStorage.read(path, max_bytes)
    }
    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        self.record("rename", to);
        StdStorage.rename(from, to)
    }
    fn remove(&self, path: &Path) -> std::io::Result<()> {
        self.record("remove", path);
        StdStorage.remove(path)
    }
    fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
        self.record("sync_dir", dir);
        StdStorage.sync_dir(dir)
    }
    fn lock(&self, path: &Path) -> std::io::Result<Box<dyn std::any::Any + Send + Sync>> {
        StdStorage.lock(path)
    }
}

#[test]
fn roll_over_and_expiry_leave_the_writer_one_seal() {
    let _files = real_files();
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let storage = RecordingStorage::default();
    let options = durable_options(dir.path(), &clock)
        .window(3 * BUCKET)
        .durability(Durability::Buffered)
        .storage(std::sync::Arc::new(storage.clone()));
    let db = Db::open(options).unwrap();
    // Four buckets, one segment each; the fourth advance takes the first bucket's
    // segment out of the window (it lives through bucket 0 + 3) at the next roll-over.
    for i in 0..4u32 {
        db.insert_if_absent(&i.to_le_bytes()).unwrap();
        clock.forward(BUCKET);
    }
    db.flush().unwrap();
    storage.take();
    let writer = std::thread::current().name().unwrap_or("").to_string();
    db.insert_if_absent(b"rolls over").unwrap();
    // The worker may already have begun its round: its calls are kept for below.
    let since_roll_over = storage.take();
    let on_writer: Vec<_> = since_roll_over
        .iter()
        .filter(|(thread, _, _)| *thread == writer)
        .map(|(_, op, name)| (*op, name.clone()))
        .collect();
    // The writer seals the old segment (one fsync; nothing was unsynced) and renames the
    // prepared segment into the log; no create, no directory fsync, no unlink.
    assert_eq!(on_writer.len(), 2, "{on_writer:?}");
    assert_eq!(on_writer[0].0, "sync");
    assert_eq!(on_writer[1].0, "rename");
    assert!(on_writer[1].1.starts_with("seg-"), "{on_writer:?}");
    db.flush().unwrap();
    let mut on_worker = since_roll_over;
    on_worker.extend(storage.take());
    assert!(
        on_worker
            .iter()
            .any(|(thread, op, _)| thread == "oncedb-segments" && *op == "remove"),
        "{on_worker:?}"
    );
    assert_eq!(db.stats().segments_deleted, 1);
    assert!(db.contains(b"rolls over").unwrap());
    drop(db);
    // A clean close leaves no prepared file, and the store reopens with every key.
    assert!(std::fs::read_dir(dir.path()).unwrap().all(|e| {
        !e.unwrap()
            .file_name()
            .to_string_lossy()
            .starts_with("prep-")
    }));
}

#[test]
fn a_prepared_file_left_by_a_crash_is_removed_at_open() {
    let _files = real_files();
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    drop(Db::open(durable_options(dir.path(), &clock)).unwrap());
    // What a crash can leave: a prepared segment, possibly torn.
    let stale = dir.path().join("prep-00000000000099999999-0000000000.log");
    std::fs::write(&stale, b"torn header").unwrap();
    let db = Db::open(durable_options(dir.path(), &clock)).unwrap();
    assert!(!stale.exists());
    assert!(db.insert_if_absent(b"after").unwrap());
}

#[test]
fn a_roll_over_at_the_size_limit_takes_a_prepared_segment_too() {
    let _files = real_files();
    let dir = tempfile::tempdir().unwrap();
    let clock = manual_clock();
    let storage = RecordingStorage::default();
    let options = durable_options(dir.path(), &clock)
        .durability(Durability::Buffered)
        .segment_max_bytes(4096)
        .storage(std::sync::Arc::new(storage.clone()));
    let db = Db::open(options).unwrap();
    let writer = std::thread::current().name().unwrap_or("").to_string();
    let mut renamed = Vec::new();
    for i in 0..400u32 {
        // The flush lets the worker finish the round the writer asked for at half full.
        db.flush().unwrap();
        storage.take();
        db.insert_if_absent(&i.to_le_bytes()).unwrap();
        for (thread, op, name) in storage.take() {
            if thread != writer {
                continue;
            }
            if i > 0 {
                // The first insert creates the store's first segment itself.
                assert!(
                    op == "sync" || op == "rename",
                    "insert {i}: the writer did {op} {name}"
                );
            }
            if op == "rename" {
                renamed.push(name);
            }
        }
    }
    // Every key is 4 bytes, so 400 of them fill several 4 KiB segments of one bucket.
    assert!(renamed.len() >= 3, "{renamed:?}");
    assert!(renamed.iter().all(|name| name.starts_with("seg-")));
    drop(db);
    let db = Db::open(durable_options(dir.path(), &clock).segment_max_bytes(4096)).unwrap();
    assert!((0..400u32).all(|i| db.contains(&i.to_le_bytes()).unwrap()));
}

/// `Durability::Interval(d)`: the flusher makes writes durable by itself, without a later
/// write or a flush, so a power loss after it ran keeps them (a flusher that never runs
/// loses the key). The test waits for the flusher thread's fsync itself, then cuts the
/// power.
#[test]
fn interval_durability_syncs_on_its_own() {
    let disk = oncedb::io::MemStorage::new();
    let clock = manual_clock();
    let (synced, flushes) = std::sync::mpsc::sync_channel(1);
    // Reports every fsync the interval flusher thread makes.
    let watch = oncedb_testkit::watched::WatchedStorage::new(disk.clone(), move || {
        if std::thread::current().name() == Some("oncedb-flusher") {
            let _ = synced.try_send(());
        }
    });
    let options = |storage: std::sync::Arc<dyn Storage>| {
        Options::new("/db")
            .window(WINDOW)
            .bucket_width(BUCKET)
            .clock(clock.clone())
            .durability(Durability::Interval(Duration::from_millis(20)))
            .storage(storage)
    };
    let db = Db::open(options(std::sync::Arc::new(watch))).unwrap();
    // Bytes of log entries (past each segment's 48-byte header) that a power loss would
    // keep.
    let durable = || -> usize {
        let files = disk.list(Path::new("/db")).unwrap();
        files
            .iter()
            .filter(|p| {
                p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("seg-"))
            })
            .filter_map(|p| disk.synced(p))
            .map(|bytes| bytes.len().saturating_sub(48))
            .sum()
    };
    let durable_before = durable();
    assert!(db.insert_if_absent(b"interval-key").unwrap());
    // The write waits in the journal's buffer: wait for flusher syncs until the segment's
    // durable bytes have grown (a sync that began before the insert may not cover it).
    while durable() == durable_before {
        flushes
            .recv_timeout(Duration::from_secs(30))
            .expect("the interval flusher synced");
    }
    disk.power_loss();
    let reopened = Db::open(options(std::sync::Arc::new(disk.clone()))).unwrap();
    assert!(reopened.contains(b"interval-key").unwrap());
    drop(db);
}
