//! Fault injection: fail the N-th state-changing I/O call, for every N of a scripted
//! workload, once and persistently. The store must report the failure (and refuse later
//! writes), and a reopen must hold every write acknowledged before it.

use std::sync::Arc;

use crate::support::{BUCKET, WINDOW, manual_clock};
use oncedb::io::{FaultyStorage, MemStorage, Storage};
use oncedb::{Db, Durability, Error, ManualClock, Options, RecordStatus, Reservation, Scope};

/// Where the archived runs keep expired segments.
const ARCHIVE: &str = "/archive";

fn options(storage: Arc<dyn Storage>, clock: &ManualClock) -> Options {
    archived(storage, clock, false)
}

/// The store's options, with an archive directory if `archive`.
fn archived(storage: Arc<dyn Storage>, clock: &ManualClock, archive: bool) -> Options {
    let options = if archive {
        Options::new("/db").archive_dir(ARCHIVE)
    } else {
        Options::new("/db")
    };
    options
        .window(WINDOW)
        .bucket_width(BUCKET)
        .clock(clock.clone())
        .durability(Durability::Sync)
        .segment_max_bytes(4096)
        .storage(storage)
}

/// What the workload had acknowledged, each with when it was written.
#[derive(Default, Debug)]
struct Acked {
    keys: Vec<(u32, std::time::SystemTime)>,
    records: Vec<(u32, std::time::SystemTime)>,
}

/// The scripted workload: single inserts, batches, records, bucket rollovers, segment
/// rollovers and expiry. Stops at the first error and returns what was acknowledged.
fn workload(db: &Db, clock: &ManualClock, acked: &mut Acked) -> Result<(), Error> {
    let scope = Scope::new("org", "op");
    for round in 0..6u32 {
        for i in 0..40u32 {
            let n = round * 1_000 + i;
            db.insert_if_absent(&n.to_le_bytes())?;
            acked.keys.push((n, clock.now()));
        }
        let batch: Vec<[u8; 4]> = (500..520)
            .map(|i: u32| (round * 1_000 + i).to_le_bytes())
            .collect();
        db.insert_many(&batch)?;
        acked
            .keys
            .extend((500..520).map(|i| (round * 1_000 + i, clock.now())));
        let Reservation::Acquired(lease) = db.reserve(&scope, &round.to_le_bytes(), b"req")? else {
            panic!("fresh record must be acquired");
        };
        lease.complete(&round.to_le_bytes())?;
        acked.records.push((round, clock.now()));
        // Move to the next bucket; the last rounds push early buckets out of the window.
        clock.forward(if round == 3 {
            WINDOW - 3 * BUCKET
        } else {
            BUCKET
        });
    }
    db.flush()
}

fn verify(storage: Arc<dyn Storage>, clock: &ManualClock, acked: &Acked, archive: bool) {
    if archive {
        // Nothing acknowledged ever leaves the disk: its key is in a segment of the store
        // or of the archive (a segment whose move a power loss half undid is in both).
        let keys = |dir: &str| match oncedb::verify_with(&*storage, dir) {
            Ok(report) => report.segments.iter().map(|s| s.keys).sum::<u64>(),
            // Not created before the fault.
            Err(Error::Io(err)) if err.kind() == std::io::ErrorKind::NotFound => 0,
            Err(err) => panic!("{dir}: {err}"),
        };
        let on_disk = keys("/db") + keys(ARCHIVE);
        assert!(
            on_disk >= acked.keys.len() as u64,
            "{on_disk} keys on disk, {} acknowledged",
            acked.keys.len()
        );
    }
    let db =
        Db::open(archived(storage, clock, archive)).expect("reopen after a fault must succeed");
    let scope = Scope::new("org", "op");
    // Everything written less than a window before the verify time must be there; older
    // entries may have expired legitimately (the workload's last rounds push the first
    // ones out).
    let inside = |written: std::time::SystemTime| {
        clock
            .now()
            .duration_since(written)
            .is_ok_and(|age| age < WINDOW)
    };
    for &(n, written) in &acked.keys {
        if inside(written) {
            assert!(
                db.contains(&n.to_le_bytes()).unwrap(),
                "acknowledged key {n} lost"
            );
        }
    }
    for &(round, written) in &acked.records {
        if inside(written) {
            let record = db.get(&scope, &round.to_le_bytes()).unwrap();
            let record = record.unwrap_or_else(|| panic!("acknowledged record {round} lost"));
            assert_eq!(record.status(), RecordStatus::Completed);
        }
    }
}

/// Counts the workload's state-changing calls in a run without faults.
fn clean_run_calls(archive: bool) -> u64 {
    clean_run(archive).0
}

/// The I/O calls of the workload without a fault, and the disk it leaves.
fn clean_run(archive: bool) -> (u64, MemStorage) {
    let disk = MemStorage::new();
    let storage = FaultyStorage::new(Arc::new(disk.clone()));
    let clock = manual_clock();
    let db = Db::open(archived(Arc::new(storage.clone()), &clock, archive)).unwrap();
    workload(&db, &clock, &mut Acked::default()).unwrap();
    drop(db);
    (storage.calls(), disk)
}

/// What ends the process after the workload.
#[derive(Debug, Clone, Copy)]
enum End {
    ProcessCrash,
    PowerLoss,
    /// A power loss that tears unsynced appends, with this seed.
    TornPowerLoss(u64),
}

fn run_with_fault(call: u64, persistent: bool, end: End) {
    run_with_fault_in(call, persistent, end, false);
}

fn run_with_fault_in(call: u64, persistent: bool, end: End, archive: bool) {
    let disk = MemStorage::new();
    let faulty = FaultyStorage::new(Arc::new(disk.clone()));
    faulty.fail_at(call, persistent);
    let clock = manual_clock();
    let mut acked = Acked::default();
    match Db::open(archived(Arc::new(faulty.clone()), &clock, archive)) {
        Ok(db) => {
            let result = workload(&db, &clock, &mut acked);
            if faulty.failures() > 0 {
                assert!(
                    result.is_err(),
                    "call {call}: a failed I/O call was reported as success"
                );
                // Fail closed: once poisoned, every write is refused.
                assert!(matches!(
                    db.insert_if_absent(b"after-fault"),
                    Err(Error::Poisoned)
                ));
                assert!(matches!(db.flush(), Err(Error::Poisoned)));
            }
            drop(db);
        }
        Err(_) => assert!(faulty.failures() > 0, "open failed without a fault"),
    }
    match end {
        End::ProcessCrash => disk.process_crash(),
        End::PowerLoss => disk.power_loss(),
        End::TornPowerLoss(seed) => disk.torn_power_loss(seed),
    }
    verify(Arc::new(disk), &clock, &acked, archive);
}

#[test]
fn every_single_fault_is_reported_and_recovered() {
    let calls = clean_run_calls(false);
    assert!(
        calls > 50,
        "the workload should make many I/O calls, made {calls}"
    );
    for call in 1..=calls + 1 {
        run_with_fault(call, false, End::ProcessCrash);
        run_with_fault(call, false, End::PowerLoss);
        run_with_fault(call, false, End::TornPowerLoss(call));
    }
}

/// With an archive, expired segments move instead of being unlinked: a fault at any call
/// (the moves and the archive's syncs included) is reported, and no acknowledged key
/// leaves the disk, whatever a crash or power loss then undoes.
#[test]
fn every_fault_with_an_archive_is_reported_and_loses_no_segment() {
    // The moves into the archive happen within the workload's calls, so the sweep
    // below fails each of them in turn.
    let (calls, disk) = clean_run(true);
    let archived = disk.list(std::path::Path::new(ARCHIVE)).unwrap();
    assert!(
        archived.len() > 2,
        "the workload archives segments: {archived:?}"
    );
    for call in 1..=calls + 1 {
        run_with_fault_in(call, false, End::ProcessCrash, true);
        run_with_fault_in(call, false, End::PowerLoss, true);
        run_with_fault_in(call, true, End::TornPowerLoss(call), true);
    }
}

#[test]
fn every_persistent_fault_is_reported_and_recovered() {
    let calls = clean_run_calls(false);
    for call in 1..=calls + 1 {
        run_with_fault(call, true, End::ProcessCrash);
        run_with_fault(call, true, End::PowerLoss);
        run_with_fault(call, true, End::TornPowerLoss(call ^ 0x5eed));
    }
}

#[test]
fn power_loss_keeps_every_synced_write() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let mut acked = Acked::default();
    {
        let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
        workload(&db, &clock, &mut acked).unwrap();
        db.insert_if_absent(b"tail").unwrap();
        // The process dies without dropping the handle's buffers.
        std::mem::forget(db);
    }
    disk.power_loss();
    verify(Arc::new(disk.clone()), &clock, &acked, false);
    let db = Db::open(options(Arc::new(disk), &clock)).unwrap();
    assert!(
        db.contains(b"tail").unwrap(),
        "a Sync write was acknowledged, so it is durable"
    );
}

#[test]
fn interval_mode_loses_at_most_unflushed_writes_on_power_loss() {
    let disk = MemStorage::new();
    let clock = manual_clock();
    let options = |disk: &MemStorage| {
        options(Arc::new(disk.clone()), &clock)
            .durability(Durability::Interval(std::time::Duration::from_secs(3600)))
    };
    {
        let db = Db::open(options(&disk)).unwrap();
        db.insert_if_absent(b"flushed").unwrap();
        db.flush().unwrap();
        db.insert_if_absent(b"unflushed").unwrap();
        std::mem::forget(db);
    }
    disk.power_loss();
    let db = Db::open(options(&disk)).unwrap();
    assert!(db.contains(b"flushed").unwrap());
    assert!(
        !db.contains(b"unflushed").unwrap(),
        "nothing synced it within the interval"
    );
}

#[test]
fn torn_power_losses_keep_every_synced_write_and_report_the_tear() {
    let mut torn = 0;
    for seed in 0..48 {
        let disk = MemStorage::new();
        let clock = manual_clock();
        let mut acked = Acked::default();
        {
            let options = options(Arc::new(disk.clone()), &clock).durability(Durability::Buffered);
            let db = Db::open(options).unwrap();
            workload(&db, &clock, &mut acked).unwrap();
            // Written, never synced: a power loss may tear these in any way.
            for i in 0..300u32 {
                db.insert_if_absent(&(90_000 + i).to_le_bytes()).unwrap();
            }
            std::mem::forget(db);
        }
        disk.torn_power_loss(seed);
        let db = Db::open(options(Arc::new(disk.clone()), &clock)).unwrap();
        torn += u64::from(!db.recovery_report().unwrap().torn_tails.is_empty());
        drop(db);
        verify(Arc::new(disk), &clock, &acked, false);
    }
    assert!(torn > 0, "some tears must leave a torn tail to cut");
}
