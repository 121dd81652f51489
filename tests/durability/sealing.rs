//! `Options::memory_budget`: dedup keys beyond the budget are sealed into immutable runs
//! on disk; answers stay exact, in memory and after a reopen; a fault (and a crash or
//! power loss) at any I/O call of sealing loses no acknowledged key; a damaged run is
//! `Corrupted`, never a smaller window; runs leave whole with their window.

use std::path::Path;
use std::sync::Arc;

use crate::support::{BUCKET, WINDOW, manual_clock};
use oncedb::io::{FaultyStorage, MemStorage, Storage};
use oncedb::{Db, Durability, Error, ManualClock, Options};
use oncedb_testkit::gate::SyncGate;
use oncedb_testkit::watched::WatchedStorage;

/// A small budget over few shards: the tables seal every few thousand keys.
const BUDGET: u64 = 1 << 18;

/// The smallest budget worth a seal: the tables seal every two thousand keys or so, and
/// runs merge every four seals.
const SMALL_BUDGET: u64 = 1 << 16;

fn options(storage: Arc<dyn Storage>, clock: &ManualClock) -> Options {
    budgeted(storage, clock, BUDGET)
}

fn budgeted(storage: Arc<dyn Storage>, clock: &ManualClock, budget: u64) -> Options {
    Options::new("/db")
        .window(WINDOW)
        .bucket_width(BUCKET)
        .clock(clock.clone())
        .durability(Durability::Buffered)
        .memory_budget(budget)
        .shards(4)
        .storage(storage)
}

fn key(n: u32) -> [u8; 16] {
    let mut key = [7u8; 16];
    key[..4].copy_from_slice(&n.to_le_bytes());
    key
}

/// Admits keys `range` in batches of 256 and returns how many were new, then flushes
/// (which waits for the seal under way: the stats and files are settled).
fn admit(db: &Db, range: std::ops::Range<u32>) -> Result<usize, Error> {
    let new = admit_unflushed(db, range)?;
    db.flush()?;
    Ok(new)
}

/// [`admit`] without the flush.
fn admit_unflushed(db: &Db, range: std::ops::Range<u32>) -> Result<usize, Error> {
    let keys: Vec<[u8; 16]> = range.map(key).collect();
    let mut new = 0;
    for batch in keys.chunks(256) {
        new += db.insert_many(batch)?.iter().filter(|&&n| n).count();
    }
    Ok(new)
}

fn runs_on(disk: &MemStorage) -> Vec<std::path::PathBuf> {
    disk.list(Path::new("/db"))
        .unwrap()
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "keys"))
        .collect()
}

#[test]
fn keys_beyond_the_budget_are_sealed_and_every_answer_stays_exact() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
    assert_eq!(admit(&db, 0..60_000).unwrap(), 60_000);
    let stats = db.stats();
    assert!(stats.runs_sealed >= 2, "{stats:?}");
    assert!(stats.index_bytes <= BUDGET, "{stats:?}");
    assert_eq!(stats.sealed_keys + stats.live_keys, 60_000, "{stats:?}");
    // Every key is a duplicate, single or batched, wherever it lives; new keys are new.
    assert_eq!(admit(&db, 0..60_000).unwrap(), 0);
    for n in (0..60_000).step_by(97) {
        assert!(!db.insert_if_absent(&key(n)).unwrap(), "key {n}");
        assert!(db.contains(&key(n)).unwrap());
    }
    assert!(!db.contains(&key(60_000)).unwrap());
    assert_eq!(admit(&db, 60_000..61_000).unwrap(), 1_000);
    // A reopen after a crash opens the runs and replays only what they do not cover.
    drop(db);
    disk.process_crash();
    let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
    let stats = db.stats();
    assert!(stats.sealed_runs >= 2);
    assert!(
        stats.live_keys < 30_000,
        "replayed {} keys",
        stats.live_keys
    );
    assert_eq!(admit(&db, 0..61_000).unwrap(), 0);
    // The window moves on: runs leave whole, and their keys are new again.
    clock.forward(WINDOW + BUCKET);
    assert_eq!(admit(&db, 0..8_000).unwrap(), 8_000);
    assert!(db.stats().runs_expired >= 2);
    assert!(runs_on(&disk).len() <= 2, "{:?}", runs_on(&disk));
}

/// A batch checks the sealed runs in one pass per run: each data page its keys may be
/// in is read once, however many of the batch's keys it holds (here 1,024 repeats of
/// sealed keys in a run of 4 sections of a few pages each), and every answer is exact.
#[test]
fn a_batch_reads_each_page_of_a_run_once() {
    let disk = MemStorage::new();
    let faulty = FaultyStorage::new(Arc::new(disk.clone()));
    let clock = manual_clock();
    let db = Db::open(options(Arc::new(faulty.clone()), &clock)).unwrap();
    let mut admitted = 0;
    while runs_on(&disk).is_empty() {
        assert_eq!(admit(&db, admitted..admitted + 256).unwrap(), 256);
        admitted += 256;
    }
    let sealed = db.stats().sealed_keys;
    assert!(sealed >= 1_024, "{sealed} keys sealed");
    let repeats: Vec<[u8; 16]> = (0..1_024).map(key).collect();
    let before = faulty.reads();
    let answers = db.insert_many(&repeats).unwrap();
    let reads = faulty.reads() - before;
    assert!(answers.iter().all(|&new| !new), "every key is a repeat");
    assert!(reads <= 64, "{reads} page reads for 1,024 sealed keys");
    let fresh: Vec<[u8; 16]> = (admitted..admitted + 1_024).map(key).collect();
    assert!(db.insert_many(&fresh).unwrap().iter().all(|&new| new));
}

/// A seal runs on a thread of its own: with the sealing thread held inside the new run's
/// fsync, a writer goes on admitting keys, the frozen keys stay duplicates, and once the
/// seal ends (`flush` waits for it) the run answers for them. A seal on the writer's path
/// would stall the writer at the gate for as long as the seal is held.
#[test]
fn writers_go_on_while_a_seal_runs() {
    let disk = MemStorage::new();
    let gate = SyncGate::thread("oncedb-sealer");
    let clock = manual_clock();
    let db = Db::open(options(Arc::new(gate.storage(disk.clone())), &clock)).unwrap();
    let release = gate.release_on_drop();
    gate.hold(1);
    let limit = std::time::Duration::from_secs(30);
    let (done, outcome) = std::sync::mpsc::channel();
    let admitted = std::thread::scope(|s| {
        s.spawn(|| {
            let mut admitted = 0;
            // A seal starts when the tables freeze: their keys stop counting as live.
            while db.stats().live_keys == u64::from(admitted) && admitted < 100_000 {
                assert_eq!(admit_unflushed(&db, admitted..admitted + 256).unwrap(), 256);
                admitted += 256;
            }
            let held = gate.await_held_within(1, limit);
            let seal_under_way = db.stats().runs_sealed == 0;
            // The seal is stuck in its fsync: writes go on, and every answer stays exact.
            let fresh = admit_unflushed(&db, admitted..admitted + 1_024).unwrap();
            let repeats = admit_unflushed(&db, 0..admitted + 1_024).unwrap();
            let _ = done.send((admitted, held, seal_under_way, fresh, repeats));
        });
        let outcome = outcome.recv_timeout(2 * limit);
        drop(release);
        let (admitted, held, seal_under_way, fresh, repeats) =
            outcome.expect("the writer stalled while the seal was held");
        assert!(held, "no seal reached its fsync on a thread of its own");
        assert!(seal_under_way, "the seal ended while held");
        assert_eq!((fresh, repeats), (1_024, 0));
        admitted
    });
    db.flush().unwrap();
    let stats = db.stats();
    assert_eq!(stats.runs_sealed, 1, "{stats:?}");
    assert_eq!(
        stats.sealed_keys + stats.live_keys,
        u64::from(admitted) + 1_024
    );
    assert_eq!(admit(&db, 0..admitted + 1_024).unwrap(), 0);
    drop(db);
    disk.process_crash();
    let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
    assert_eq!(admit(&db, 0..admitted + 1_024).unwrap(), 0);
}

/// While a merge runs, the frozen tables of the seal that made it due are gone (its run
/// is published), and writers wait when the fresh tables reach half the budget: the
/// merge holds its inputs' filters and its output's together meanwhile.
#[test]
fn a_merge_under_way_holds_no_frozen_table_and_writers_at_half_the_budget() {
    const BUDGET_BYTES: u64 = 1 << 20;
    let disk = MemStorage::new();
    let gate = SyncGate::thread("oncedb-sealer");
    let clock = manual_clock();
    let storage = Arc::new(gate.storage(disk.clone()));
    let db = Db::open(budgeted(storage, &clock, BUDGET_BYTES)).unwrap();
    let release = gate.release_on_drop();
    gate.hold(u32::MAX);
    let stop = std::sync::atomic::AtomicBool::new(false);
    let limit = std::time::Duration::from_secs(30);
    let admitted = std::thread::scope(|s| {
        let writer = s.spawn(|| {
            let mut admitted = 0;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) && admitted < 2_000_000 {
                assert_eq!(admit_unflushed(&db, admitted..admitted + 256).unwrap(), 256);
                admitted += 256;
            }
            admitted
        });
        // Let the sealing thread's fsyncs go one at a time until the one held is the
        // merge's: the fourth run is published and nothing is merged yet.
        let mut held = 1;
        while gate.await_held_within(held, limit) && db.stats().runs_sealed < 4 {
            gate.release_one();
            held += 1;
        }
        let stats = db.stats();
        assert_eq!((stats.runs_sealed, stats.runs_merged), (4, 0), "{stats:?}");
        // The writer may still be waiting from the seal (its frozen tables held) until it
        // looks again: it then lets them go, and waits for the merge.
        let stats = crate::support::until_the_writer_waits(
            &db,
            &writer,
            limit,
            ("the merge", |stats| {
                stats.budget_waiters > 0 && stats.frozen_table_bytes == 0
            }),
        );
        assert_eq!(stats.budget_waiters, 1, "{stats:?}");
        assert_eq!(stats.frozen_table_bytes, 0, "{stats:?}");
        // Outside a merge, writers wait at what the filters leave of the budget.
        let tables = stats.index_bytes - stats.sealed_filter_bytes;
        let bound_outside_merges = BUDGET_BYTES - stats.sealed_filter_bytes - 1;
        assert!(
            tables < bound_outside_merges,
            "{tables} bytes of tables: {stats:?}"
        );
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        drop(release);
        writer.join().unwrap()
    });
    db.flush().unwrap();
    let stats = db.stats();
    assert_eq!(stats.runs_merged, 1, "{stats:?}");
    assert_eq!(stats.budget_waiters, 0, "{stats:?}");
    assert_eq!(stats.sealed_keys + stats.live_keys, u64::from(admitted));
    assert_eq!(admit(&db, 0..admitted).unwrap(), 0);
}

#[test]
fn a_budget_needs_a_durable_store_and_no_key_limit() {
    let clock = manual_clock();
    for options in [
        Options::in_memory().memory_budget(BUDGET),
        Options::new("/db")
            .storage(Arc::new(MemStorage::new()))
            .memory_budget(BUDGET)
            .max_keys(10),
        Options::new("/db")
            .storage(Arc::new(MemStorage::new()))
            .memory_budget(100),
    ] {
        let options = options.clock(clock.clone());
        assert!(matches!(Db::open(options), Err(Error::InvalidOptions(_))));
    }
}

/// The sweep's workload: batches of 1,024 keys, each flushed; returns the keys
/// acknowledged before the first error.
fn flushed_batches(db: &Db) -> u32 {
    let keys: Vec<[u8; 16]> = (0..SWEEP_KEYS).map(key).collect();
    let mut acked = 0;
    for batch in keys.chunks(1024) {
        if db.insert_many(batch).and_then(|_| db.flush()).is_err() {
            break;
        }
        acked += batch.len() as u32;
    }
    acked
}

/// Keys the sweep admits: enough for four seals and a merge.
const SWEEP_KEYS: u32 = 18_000;

/// The sweep's store: a small budget, so that its workload seals and merges.
fn sweep_options(storage: Arc<dyn Storage>, clock: &ManualClock) -> Options {
    budgeted(storage, clock, SMALL_BUDGET)
}

/// The workload's I/O calls, with no fault.
fn clean_calls() -> u64 {
    let faulty = FaultyStorage::new(Arc::new(MemStorage::new()));
    let clock = manual_clock();
    let db = Db::open(sweep_options(Arc::new(faulty.clone()), &clock)).unwrap();
    assert_eq!(flushed_batches(&db), SWEEP_KEYS);
    assert!(
        db.stats().runs_sealed >= 4,
        "the sweep covers seals: {:?}",
        db.stats()
    );
    assert!(db.stats().runs_merged >= 1, "the sweep covers a merge");
    drop(db);
    faulty.calls()
}

/// A fault at any I/O call while keys are admitted, sealed and merged (each run's create,
/// appends, fsync, rename and directory fsync, and the merge's reads and removals among
/// them), then a crash or a power loss: the fault
/// is reported, and every key acknowledged before it is a duplicate after a reopen.
#[test]
fn a_fault_at_any_step_of_sealing_loses_no_acknowledged_key() {
    let calls = clean_calls();
    assert!(calls > 10, "the workload makes {calls} calls");
    let clock = manual_clock();
    crate::support::sweep_faults(
        calls,
        |storage| Db::open(sweep_options(storage, &clock)),
        (flushed_batches, SWEEP_KEYS),
        |db, acked, round| {
            for n in 0..acked {
                assert!(
                    db.contains(&key(n)).unwrap(),
                    "{round}: acknowledged key {n} lost"
                );
            }
        },
    );
}

/// Flipped bytes anywhere in a run: open says `Corrupted`, or a lookup that reads the
/// damaged page does; no answer is ever silently "new" for a sealed key.
#[test]
fn a_damaged_run_is_corrupted_never_a_smaller_window() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    {
        let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
        admit(&db, 0..20_000).unwrap();
        assert!(db.stats().runs_sealed >= 1);
    }
    let run = runs_on(&disk).into_iter().next().unwrap();
    let pristine = disk.contents(&run).unwrap();
    let step = (pristine.len() / 300).max(1);
    for at in (0..pristine.len()).step_by(step) {
        let mut damaged = pristine.clone();
        damaged[at] ^= 0x10;
        disk.set_contents(&run, damaged);
        match Db::open(options(Arc::new(disk.clone()), &clock)) {
            Err(Error::Corrupted { .. }) => {}
            Err(err) => panic!("byte {at}: {err}"),
            Ok(db) => {
                for n in (0..20_000).step_by(7) {
                    match db.contains(&key(n)) {
                        Ok(found) => assert!(found, "byte {at}: sealed key {n} reads as new"),
                        Err(Error::Corrupted { .. }) => break,
                        Err(err) => panic!("byte {at}: {err}"),
                    }
                }
            }
        }
    }
    disk.set_contents(&run, pristine);
}

/// `verify` reads sealed runs whole: a clean run is listed with its keys, and a flipped
/// byte in any page (not only in the footer, table or filters that open reads) is
/// reported as damage to the run.
#[test]
fn verify_reads_every_page_of_a_run() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    {
        let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
        admit(&db, 0..20_000).unwrap();
    }
    let report = oncedb::verify_with(&disk, "/db").unwrap();
    assert!(report.is_clean(), "{report}");
    assert!(!report.runs.is_empty());
    let sealed: u64 = report.runs.iter().map(|run| run.keys).sum();
    assert!(sealed > 0 && report.stray_files.is_empty(), "{report}");
    let run = runs_on(&disk).into_iter().next().unwrap();
    let pristine = disk.contents(&run).unwrap();
    // The middle of the first section's data: a page no lookup has read.
    let mut damaged = pristine.clone();
    damaged[5 * 4092 + 100] ^= 1;
    disk.set_contents(&run, damaged);
    let report = oncedb::verify_with(&disk, "/db").unwrap();
    let (path, _, reason) = report.first_damage().expect("the damaged page is found");
    assert_eq!(path, run, "{reason}");
    assert!(format!("{report}").contains("CORRUPTED"));
    disk.set_contents(&run, pristine);
}

/// A store with sealed runs opened without a budget keeps answering from its runs (it
/// seals nothing new): every key stays a duplicate, and the runs still retire whole.
#[test]
fn a_store_with_runs_opened_without_a_budget_keeps_using_them() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    {
        let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
        admit(&db, 0..20_000).unwrap();
        assert!(db.stats().runs_sealed >= 1);
    }
    let unbudgeted = || {
        Options::new("/db")
            .window(WINDOW)
            .bucket_width(BUCKET)
            .clock(clock.clone())
            .durability(Durability::Buffered)
            .shards(4)
            .storage(Arc::new(disk.clone()))
    };
    let db = Db::open(unbudgeted()).unwrap();
    assert!(db.stats().sealed_runs >= 1);
    assert!(
        db.stats().live_keys < 20_000,
        "the runs' keys are not replayed"
    );
    assert_eq!(admit(&db, 0..20_000).unwrap(), 0);
    assert_eq!(db.stats().runs_sealed, 0, "nothing new is sealed");
    clock.forward(WINDOW + BUCKET);
    assert_eq!(admit(&db, 0..5_000).unwrap(), 5_000);
    assert!(runs_on(&disk).is_empty(), "{:?}", runs_on(&disk));
}

/// Runs of one level merge into one of the next, so the runs a key is probed against
/// stay few as sealed keys grow; answers stay exact before and after a reopen, and the
/// store holds no file but the live runs.
#[test]
fn runs_merge_into_fewer_and_every_answer_stays_exact() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let db = Db::open(budgeted(Arc::new(disk.clone()), &clock, SMALL_BUDGET)).unwrap();
    assert_eq!(admit(&db, 0..80_000).unwrap(), 80_000);
    let stats = db.stats();
    assert!(stats.runs_sealed >= 16, "{stats:?}");
    assert!(stats.runs_merged >= 4, "{stats:?}");
    // Every four runs of a level became one: at most three a level remain.
    let levels = 64 - stats.runs_sealed.leading_zeros() as u64;
    assert!(stats.sealed_runs <= 3 * levels.div_ceil(2), "{stats:?}");
    assert_eq!(stats.sealed_keys + stats.live_keys, 80_000, "{stats:?}");
    assert_eq!(runs_on(&disk).len() as u64, stats.sealed_runs);
    assert_eq!(admit(&db, 0..80_000).unwrap(), 0);
    assert_eq!(admit(&db, 80_000..81_000).unwrap(), 1_000);
    drop(db);
    disk.process_crash();
    let db = Db::open(budgeted(Arc::new(disk.clone()), &clock, SMALL_BUDGET)).unwrap();
    assert_eq!(admit(&db, 0..81_000).unwrap(), 0);
    let before = runs_on(&disk);
    clock.forward(WINDOW + BUCKET);
    assert_eq!(admit(&db, 0..8_000).unwrap(), 8_000);
    let after = runs_on(&disk);
    assert!(before.iter().all(|run| !after.contains(run)), "{after:?}");
}

/// A crash after a merge published its run and before it removed its inputs leaves
/// runs the merged one replaces: the next open removes them, and answers are the same.
#[test]
fn runs_a_merge_replaced_are_removed_at_the_next_open() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let mut seen = std::collections::BTreeMap::new();
    let db = Db::open(budgeted(Arc::new(disk.clone()), &clock, SMALL_BUDGET)).unwrap();
    let mut next = 0;
    while db.stats().runs_merged == 0 {
        assert!(next < 100_000, "no merge after {next} keys");
        for path in runs_on(&disk) {
            let bytes = disk.contents(&path).unwrap();
            seen.insert(path, bytes);
        }
        admit(&db, next..next + 256).unwrap();
        next += 256;
    }
    let runs = db.stats().sealed_runs;
    drop(db);
    // Put back the runs the merge removed, as a crash before their removal leaves them.
    let live = runs_on(&disk);
    let replaced: Vec<_> = seen.keys().filter(|p| !live.contains(p)).cloned().collect();
    // The fourth may have been written and merged within one batch.
    assert!(replaced.len() >= 3, "{replaced:?}");
    for path in &replaced {
        disk.set_contents(path, seen[path].clone());
    }
    disk.power_loss();
    let db = Db::open(budgeted(Arc::new(disk.clone()), &clock, SMALL_BUDGET)).unwrap();
    assert_eq!(db.stats().sealed_runs, runs);
    assert_eq!(runs_on(&disk), live);
    assert_eq!(admit(&db, 0..next).unwrap(), 0);
}

/// A key admitted again after its first admission left the window is in two runs, with
/// two buckets; the run they merge into keeps the newer, so the key stays a duplicate.
#[test]
fn a_merge_keeps_the_newest_admission_of_a_key() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let db = Db::open(budgeted(Arc::new(disk.clone()), &clock, SMALL_BUDGET)).unwrap();
    assert_eq!(admit(&db, 0..3_000).unwrap(), 3_000);
    clock.forward(BUCKET * 50);
    admit(&db, 3_000..5_000).unwrap();
    assert_eq!(
        db.stats().runs_sealed,
        1,
        "keys 0..3000 sealed with bucket 0"
    );
    // Bucket 0 leaves the window; the first run (newest bucket 50) does not.
    clock.forward(BUCKET * 12);
    assert_eq!(
        admit(&db, 0..3_000).unwrap(),
        3_000,
        "their first admission expired"
    );
    let mut next = 5_000;
    while db.stats().runs_merged == 0 {
        assert!(next < 100_000, "no merge after {next} keys");
        admit(&db, next..next + 1_000).unwrap();
        next += 1_000;
    }
    assert_eq!(admit(&db, 0..3_000).unwrap(), 0);
}

/// The runs in the archive, with their bytes.
fn archived_runs(disk: &MemStorage) -> Vec<(std::path::PathBuf, Vec<u8>)> {
    let mut runs: Vec<_> = disk
        .list(Path::new("/archive"))
        .unwrap_or_default()
        .into_iter()
        .filter(|p| p.extension().is_some_and(|e| e == "keys"))
        .map(|p| {
            let bytes = disk.contents(&p).unwrap();
            (p, bytes)
        })
        .collect();
    runs.sort();
    runs
}

/// Run ids never repeat, even once every run has expired and the store reopened: the
/// runs sealed afterwards take new names, so an archived run is never written over.
#[test]
fn run_ids_never_repeat_so_the_archive_is_never_rewritten() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let opts = || options(Arc::new(disk.clone()), &clock).archive_dir("/archive");
    let mut archived: Vec<(std::path::PathBuf, Vec<u8>)> = Vec::new();
    for round in 0..2u32 {
        {
            let db = Db::open(opts()).unwrap();
            admit(&db, round * 100_000..round * 100_000 + 20_000).unwrap();
            assert!(db.stats().runs_sealed >= 1);
        }
        // The window passes: the next open moves every run into the archive.
        clock.forward(WINDOW + BUCKET);
        let db = Db::open(opts()).unwrap();
        assert_eq!(db.stats().sealed_runs, 0);
        drop(db);
        let now = archived_runs(&disk);
        for (path, bytes) in &archived {
            let kept = now.iter().find(|(p, _)| p == path);
            assert_eq!(
                kept.map(|(_, b)| b),
                Some(bytes),
                "{} was rewritten",
                path.display()
            );
        }
        assert!(
            now.len() > archived.len(),
            "round {round} archived no new run"
        );
        archived = now;
    }
}

/// Sets the footer field at `offset` of the run file `bytes` to `value` and recomputes
/// the footer's checksum (`docs/format.md`, "Sealed key runs").
fn forge_footer(bytes: &mut [u8], offset: usize, value: u64) {
    const FOOTER_LEN: usize = 112;
    let footer = bytes.len() - FOOTER_LEN;
    bytes[footer + offset..footer + offset + 8].copy_from_slice(&value.to_le_bytes());
    let checksum = xxhash_rust::xxh3::xxh3_64(&bytes[footer..footer + FOOTER_LEN - 8]);
    bytes[footer + FOOTER_LEN - 8..].copy_from_slice(&checksum.to_le_bytes());
}

/// A run whose footer claims buckets or a log position the store never reached
/// (checksum recomputed) is `Corrupted`: it neither raises the store's time, which would
/// retire every segment, nor skips keys the log holds, nor overflows when its entries'
/// buckets are read.
#[test]
fn a_run_claiming_buckets_the_store_never_reached_is_corrupted() {
    const OLDEST: usize = 40;
    const NEWEST: usize = 48;
    let disk = MemStorage::new();
    let clock = manual_clock();
    {
        let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
        admit(&db, 0..20_000).unwrap();
        assert!(db.stats().runs_sealed >= 1);
    }
    let run = runs_on(&disk).into_iter().next().unwrap();
    let pristine = disk.contents(&run).unwrap();
    let files = disk.list(Path::new("/db")).unwrap().len();
    let far = 1u64 << 40;
    // The covered log position's segment number (low half) and offset (high half).
    const COVERS_SEQ: usize = 64;
    let cases = [
        (NEWEST, far),
        (NEWEST, u64::MAX),
        (OLDEST, u64::MAX - 3),
        (COVERS_SEQ, 1_000_000),
    ];
    for (field, value) in cases {
        let mut forged = pristine.clone();
        forge_footer(&mut forged, field, value);
        if field == OLDEST {
            forge_footer(&mut forged, NEWEST, u64::MAX);
        }
        disk.set_contents(&run, forged);
        match Db::open(options(Arc::new(disk.clone()), &clock)) {
            Err(Error::Corrupted { path, .. }) => assert_eq!(path, run),
            Err(err) => panic!("field {field} = {value}: {err}"),
            Ok(_) => panic!("field {field} = {value}: a forged run opened"),
        }
        assert_eq!(
            disk.list(Path::new("/db")).unwrap().len(),
            files,
            "files were retired"
        );
        // `verify` reads every entry's bucket: reported as damage, never an overflow.
        let report = oncedb::verify_with(&disk, "/db").unwrap();
        if field == OLDEST {
            let (path, _, _) = report.first_damage().expect("the forged run is damage");
            assert_eq!(path, run);
        }
    }
    disk.set_contents(&run, pristine);
    let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
    assert!(db.contains(&key(7)).unwrap());
}

/// A seal task that fails for any reason, not only an I/O error, poisons the store: a
/// merge that meets a damaged page (`Corrupted`) leaves no half-done seal for the next one
/// to build on, and every later write is refused until a reopen.
#[test]
fn a_seal_task_that_fails_poisons_the_store() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let db = Db::open(budgeted(Arc::new(disk.clone()), &clock, SMALL_BUDGET)).unwrap();
    let mut next = 0;
    while runs_on(&disk).is_empty() {
        assert!(next < 100_000, "no run was sealed");
        admit(&db, next..next + 1_000).unwrap();
        next += 1_000;
    }
    let run = runs_on(&disk).into_iter().next().unwrap();
    let mut damaged = disk.contents(&run).unwrap();
    damaged[100] ^= 0x10; // the first page of its first section: a merge reads it
    disk.set_contents(&run, damaged);
    // A lookup that meets the damage answers `Corrupted` for its call alone; the merge
    // that meets it fails the seal task, which poisons the store.
    loop {
        assert!(next < 400_000, "no failed seal poisoned the store");
        match admit_unflushed(&db, next..next + 2_000) {
            Ok(_) | Err(Error::Corrupted { .. }) => next += 2_000,
            Err(Error::Poisoned) => break,
            Err(err) => panic!("{err}"),
        }
    }
    match db.insert_if_absent(b"after the failed seal") {
        Err(Error::Poisoned) => {}
        other => panic!("the store took a write after a failed seal: {other:?}"),
    }
}

/// A store with one sealed run whose first page is damaged, and the keys admitted before
/// that run was sealed (every one of them in the run, the damaged page among them).
fn store_with_a_damaged_run(disk: &MemStorage, clock: &ManualClock) -> (Db, u32) {
    let db = Db::open(budgeted(Arc::new(disk.clone()), clock, SMALL_BUDGET)).unwrap();
    let mut sealed = 0;
    while runs_on(disk).is_empty() {
        assert!(sealed < 100_000, "no run was sealed");
        admit(&db, sealed..sealed + 1_000).unwrap();
        sealed += 1_000;
    }
    let run = runs_on(disk).into_iter().next().unwrap();
    let mut damaged = disk.contents(&run).unwrap();
    damaged[100] ^= 0x10; // the first page of the first section
    disk.set_contents(&run, damaged);
    (db, sealed)
}

/// Whether `key` reads as admitted (a lookup that meets the damage is not an answer).
fn admitted(db: &Db, key: &[u8]) -> bool {
    match db.contains(key) {
        Ok(found) => found,
        Err(Error::Corrupted { .. }) => false,
        Err(err) => panic!("{err}"),
    }
}

/// A batch that meets a damaged run page in one shard is refused whole: no key of it is
/// admitted, in any shard, so a retry after a reopen runs them all.
#[test]
fn a_batch_that_meets_a_damaged_run_admits_nothing() {
    let (disk, clock) = (MemStorage::new(), manual_clock());
    let (db, sealed) = store_with_a_damaged_run(&disk, &clock);
    // Batches start at a shard that depends on their first key: several, so that some
    // reach the damaged shard after others.
    for attempt in 0..8u32 {
        let fresh: Vec<[u8; 16]> = (0..64)
            .map(|n| key(2_000_000 + attempt * 100 + n))
            .collect();
        let mut batch = vec![fresh[0]];
        batch.extend((0..sealed).map(key));
        batch.extend(&fresh[1..]);
        match db.insert_many(&batch) {
            Err(Error::Corrupted { .. }) => {}
            other => panic!("attempt {attempt}: {other:?}"),
        }
        for fresh in &fresh {
            assert!(
                !admitted(&db, fresh),
                "attempt {attempt}: a refused batch admitted a key"
            );
        }
    }
}

/// The budget's own work (freezing, starting a seal, retiring runs) runs after a write's
/// keys are logged, single or batched: a failure there poisons the store for the calls
/// after, and never fails a call whose key memory admitted and the log lacks.
#[test]
fn budget_work_fails_no_call_whose_key_is_admitted() {
    for batched in [false, true] {
        let disk = MemStorage::new();
        let clock = manual_clock();
        let armed = Arc::new(std::sync::atomic::AtomicBool::new(false));
        // Once armed, the manifest cannot be rewritten (the run floor's raise, before the
        // first seal starts).
        let refuse = Arc::clone(&armed);
        let storage = WatchedStorage::refusing_opens(disk.clone(), move |path| {
            let manifest = path.file_name().is_some_and(|name| name == "MANIFEST.tmp");
            manifest && refuse.load(std::sync::atomic::Ordering::SeqCst)
        });
        let db = Db::open(budgeted(Arc::new(storage), &clock, SMALL_BUDGET)).unwrap();
        armed.store(true, std::sync::atomic::Ordering::SeqCst);
        let mut acknowledged = Vec::new();
        let refusal = loop {
            let n = acknowledged.len() as u32;
            assert!(n < 200_000, "no seal started");
            let answer = if batched {
                db.insert_many(&[key(n)]).map(|_| ())
            } else {
                db.insert_if_absent(&key(n)).map(|_| ())
            };
            match answer {
                Ok(()) => acknowledged.push(n),
                Err(err) => break err,
            }
        };
        assert!(
            matches!(refusal, Error::Poisoned),
            "batched {batched}: {refusal}"
        );
        drop(db);
        armed.store(false, std::sync::atomic::Ordering::SeqCst);
        let db = Db::open(budgeted(Arc::new(disk.clone()), &clock, SMALL_BUDGET)).unwrap();
        for &n in acknowledged.iter().rev().take(100) {
            assert!(
                db.contains(&key(n)).unwrap(),
                "batched {batched}: key {n} was lost"
            );
        }
    }
}

/// A merge's working memory (about 41 bytes per key of the section it writes) stays
/// within a quarter of the budget: over one shard, the runs of a few seals make sections
/// too large to merge, and they stay as they are; over 64 shards, the same keys merge.
/// While a seal runs, `Stats::seal_work_bytes` counts its working memory.
#[test]
fn a_merge_too_large_for_a_quarter_of_the_budget_is_not_made() {
    const BUDGET: u64 = 4 << 20;
    for (shards, merges) in [(1, false), (64, true)] {
        let disk = MemStorage::new();
        let clock = manual_clock();
        let gate = SyncGate::thread("oncedb-sealer");
        let options = budgeted(Arc::new(gate.storage(disk.clone())), &clock, BUDGET).shards(shards);
        let db = Db::open(options).unwrap();
        let _release = gate.release_on_drop();
        gate.hold(1);
        let work_seen = std::thread::scope(|scope| {
            // Reads the working memory while the first seal is held inside its fsync.
            let watcher = scope.spawn(|| {
                let held = gate.await_held_within(1, std::time::Duration::from_secs(60));
                let work = db.stats().seal_work_bytes;
                gate.release_all();
                held.then_some(work)
            });
            let mut next = 0;
            while db.stats().runs_sealed < 6 {
                assert!(next < 4_000_000, "{shards} shards: too few seals");
                admit(&db, next..next + 8_192).unwrap();
                next += 8_192;
            }
            watcher.join().unwrap()
        });
        let stats = db.stats();
        assert_eq!(stats.runs_merged > 0, merges, "{shards} shards: {stats:?}");
        assert_eq!(stats.seal_work_bytes, 0, "{stats:?}");
        let work_seen = work_seen.expect("the first seal reached its fsync");
        assert!(
            work_seen > 0,
            "{shards} shards: the seal showed no working memory"
        );
    }
}
