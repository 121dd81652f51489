//! Fuzz harness: the input damages the sealed key run or the record run of a small real
//! database with a memory budget (`Options::memory_budget`), on a simulated disk, then the
//! database is opened. Opening must return `Ok` or an error, never panic, hang or allocate
//! beyond the file's size. A database that opened must answer lookups of its sealed keys
//! with "present" or `Corrupted` (never "absent", never a panic), replays of its sealed
//! records with their responses byte for byte or `Corrupted` (never another answer),
//! take writes, and open again.
//!
//! Raw damage (flips, overwrites, truncation, replacement) mostly meets the footer
//! checksum. The footer mode edits the footer's fields and the section mode a section
//! table row, and both recompute the checksums (layout in `docs/format.md`, "Sealed key
//! runs"), so that well-checksummed but inconsistent runs reach the geometry checks.
//!
//! Shared by the fuzz target `fuzz/fuzz_targets/run_decode.rs` and the corpus replay
//! test `tests/durability/fuzz_corpus.rs`.

#![expect(
    clippy::cast_possible_truncation,
    reason = "test code: values are small and chosen by the test"
)]
#![expect(clippy::expect_used, reason = "test code: a panic is the test failing")]
#![expect(
    clippy::indexing_slicing,
    reason = "test code: a panic is the test failing"
)]
#![expect(clippy::unwrap_used, reason = "test code: a panic is the test failing")]

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, UNIX_EPOCH};

use oncedb::io::{MemStorage, Storage};
use oncedb::{Db, Durability, Error, ManualClock, Options, Reservation, Scope};
use xxhash_rust::xxh3::xxh3_64;

const DIR: &str = "/db";
const BUCKET_MS: u64 = 1_000;
const FIRST_BUCKET: u64 = 1_700_000_000;
/// Keys the baseline admits; the first seal takes most of them.
const KEYS: u32 = 6_000;
/// Records the baseline finishes before its keys: the first look at the budget (after
/// 4,096 calls) seals them, and the next one (after 4,096 keys) seals the keys.
const RECORDS: u32 = 4_096;
/// Damage modes per run: the first six damage the key run, the next six the record run.
const MODES: u8 = 6;
const FOOTER_LEN: usize = 112;
/// The footer's checksummed bytes (all but its last 8).
const FOOTER_BODY: usize = FOOTER_LEN - 8;
const ROW_LEN: usize = 40;

fn clock() -> ManualClock {
    ManualClock::new(UNIX_EPOCH + Duration::from_millis(FIRST_BUCKET * BUCKET_MS + 250))
}

fn options(disk: &MemStorage, clock: &ManualClock) -> Options {
    Options::new(DIR)
        .window(Duration::from_millis(8 * BUCKET_MS))
        .bucket_width(Duration::from_millis(BUCKET_MS))
        .durability(Durability::Buffered)
        .shards(2)
        .memory_budget(1 << 16)
        .clock(clock.clone())
        .storage(Arc::new(disk.clone()))
}

fn key(n: u32) -> [u8; 4] {
    n.to_le_bytes()
}

fn scope() -> Scope {
    Scope::new("org", "pay")
}

fn response_of(n: u32) -> [u8; 12] {
    let mut response = [(n % 251) as u8; 12];
    response[..4].copy_from_slice(&n.to_le_bytes());
    response
}

/// A store's files, and the paths of its (first) key run and (first) record run.
type Baseline = (Vec<(PathBuf, Vec<u8>)>, [PathBuf; 2]);

/// The baseline's files and the paths of its first runs, built once.
fn baseline() -> &'static Baseline {
    static FILES: OnceLock<Baseline> = OnceLock::new();
    FILES.get_or_init(|| {
        let disk = MemStorage::new();
        let clock = clock();
        let db = Db::open(options(&disk, &clock)).unwrap();
        for n in 0..RECORDS {
            let Reservation::Acquired(lease) = db.reserve(&scope(), &key(n), b"req").unwrap()
            else {
                panic!("record {n} is new");
            };
            lease.complete(&response_of(n)).unwrap();
        }
        db.flush().unwrap();
        let keys: Vec<[u8; 4]> = (0..KEYS).map(key).collect();
        for batch in keys.chunks(100) {
            db.insert_many(batch).unwrap();
        }
        // Waits for the seal under way.
        db.flush().unwrap();
        assert!(db.stats().sealed_runs >= 1, "the baseline seals keys");
        assert!(
            db.stats().sealed_record_runs >= 1,
            "the baseline seals records"
        );
        drop(db);
        let files: Vec<(PathBuf, Vec<u8>)> = disk
            .list(Path::new(DIR))
            .unwrap()
            .into_iter()
            .map(|path| {
                let bytes = disk.contents(&path).unwrap();
                (path, bytes)
            })
            .collect();
        let run = |extension: &str| {
            files
                .iter()
                .map(|(path, _)| path.clone())
                .find(|path| path.extension().is_some_and(|e| e == extension))
                .expect("a run file")
        };
        let runs = [run("keys"), run("records")];
        (files, runs)
    })
}

/// Reads the input front to back; reads past the end give zeros.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        match self.0.split_first() {
            Some((&first, rest)) => {
                self.0 = rest;
                first
            }
            None => 0,
        }
    }

    fn u32(&mut self) -> u32 {
        u32::from_le_bytes([self.byte(), self.byte(), self.byte(), self.byte()])
    }

    fn u64(&mut self) -> u64 {
        (u64::from(self.u32()) << 32) | u64::from(self.u32())
    }
}

/// Recomputes the footer's checksum, and the section table's if `table` is set.
fn reseal(run: &mut [u8], table: bool) {
    let len = run.len();
    if len < FOOTER_LEN {
        return;
    }
    let footer = len - FOOTER_LEN;
    if table {
        let table_at = u64::from_le_bytes(run[footer + 72..footer + 80].try_into().unwrap());
        let rows = u64::from_le_bytes(run[footer + 80..footer + 88].try_into().unwrap());
        let rows_len = rows.saturating_mul(ROW_LEN as u64);
        if let Some(end) = table_at.checked_add(rows_len)
            && end + 8 <= footer as u64
        {
            let (start, end) = (table_at as usize, end as usize);
            let checksum = xxh3_64(&run[start..end]);
            run[end..end + 8].copy_from_slice(&checksum.to_le_bytes());
        }
    }
    let checksum = xxh3_64(&run[footer..footer + FOOTER_BODY]);
    run[footer + FOOTER_BODY..].copy_from_slice(&checksum.to_le_bytes());
}

/// The baseline's run with the input's damage.
fn damaged_run(input: &mut Input<'_>, pristine: &[u8], mode: u8) -> Vec<u8> {
    let mut run = pristine.to_vec();
    match mode {
        0 => {
            // Flips: (offset, mask) pairs.
            for _ in 0..(input.byte() % 8 + 1) {
                let at = input.u32() as usize % run.len();
                run[at] ^= input.byte().max(1);
            }
        }
        1 => {
            // Overwrite a range with the rest of the input.
            let at = input.u32() as usize % run.len();
            let rest = input.0;
            let end = (at + rest.len()).min(run.len());
            run[at..end].copy_from_slice(&rest[..end - at]);
        }
        2 => run.truncate(input.u32() as usize % run.len()),
        3 => run = input.0.to_vec(),
        4 => {
            // A footer field (by its 8-byte slot) set to the input's value, resealed.
            let footer = run.len() - FOOTER_LEN;
            let slot = usize::from(input.byte()) % (FOOTER_BODY / 8);
            let value = input.u64().to_le_bytes();
            run[footer + 8 * slot..footer + 8 * slot + 8].copy_from_slice(&value);
            reseal(&mut run, false);
        }
        _ => {
            // A section table field set to the input's value, table and footer resealed.
            let footer = run.len() - FOOTER_LEN;
            let table_at =
                u64::from_le_bytes(run[footer + 72..footer + 80].try_into().unwrap()) as usize;
            let slot = usize::from(input.byte()) % 10;
            let value = input.u64().to_le_bytes();
            run[table_at + 8 * slot..table_at + 8 * slot + 8].copy_from_slice(&value);
            reseal(&mut run, true);
        }
    }
    run
}

/// Whether the input forges a footer field no bound at open can check (mode 4): the
/// oldest bucket (slot 5: entries of a key run are relative to it) or the covered log
/// position's segment and offset (slot 8).
fn forges_an_unbounded_field(data: &[u8]) -> bool {
    let mut input = Input(data);
    input.byte() % MODES == 4 && [5, 8].contains(&(usize::from(input.byte()) % (FOOTER_BODY / 8)))
}

/// Runs one input.
pub fn run(data: &[u8]) {
    let (files, runs) = baseline();
    let disk = MemStorage::new();
    disk.create_dir_all(Path::new(DIR)).unwrap();
    let mut input = Input(data);
    let selector = input.byte();
    let (mode, run_path) = (selector % MODES, &runs[usize::from(selector / MODES % 2)]);
    for (path, bytes) in files {
        let bytes = if path == run_path {
            damaged_run(&mut input, bytes, mode)
        } else {
            bytes.clone()
        };
        disk.set_contents(path, bytes);
    }
    let clock = clock();
    let Ok(db) = Db::open(options(&disk, &clock)) else {
        return;
    };
    // Never a smaller window: every key admitted is present, or the lookup that reads
    // damage says so (a forged footer's newest bucket included). Two footer fields can
    // still hide keys when forged with the checksum recomputed, and no bound at open can
    // tell: a log position within the segment it names (it looks like a crash that lost
    // that segment's unwritten tail) and a lower oldest bucket (every entry's bucket is
    // relative to it, and a run's entries may span any number of buckets below its
    // newest). See docs/format.md, "Sealed key runs".
    let unbounded = forges_an_unbounded_field(data);
    for n in (0..KEYS).step_by(13) {
        match db.contains(&key(n)) {
            Ok(found) => assert!(found || unbounded, "key {n} reads as never seen"),
            Err(Error::Corrupted { .. }) => {}
            Err(err) => panic!("key {n}: {err}"),
        }
    }
    // Every sealed record replays byte for byte, or the lookup that reads damage says so.
    for n in (0..RECORDS).step_by(11) {
        match db.reserve(&scope(), &key(n), b"req") {
            Ok(Reservation::Completed(record)) => {
                assert_eq!(record.response(), Some(&response_of(n)[..]), "record {n}");
            }
            Ok(Reservation::Acquired(_)) if unbounded => {}
            Err(Error::Corrupted { .. }) => {}
            other => panic!("record {n}: {other:?}"),
        }
    }
    // The database takes writes and keeps them across a clean reopen.
    let written = db.insert_if_absent(b"written after open").is_ok() && db.flush().is_ok();
    drop(db);
    let db = Db::open(options(&disk, &clock))
        .unwrap_or_else(|err| panic!("a database that opened must open again: {err}"));
    if written {
        assert!(db.contains(b"written after open").unwrap());
    }
}

/// Seed inputs, one per mode and a few variants.
#[allow(
    dead_code,
    reason = "used to write the seed corpus, not by the fuzz target"
)]
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    let mut seeds = Vec::new();
    for mode in 0..2 * MODES {
        for variant in 0..3u8 {
            let mut data = vec![mode, variant + 1];
            data.extend((0..24u8).map(|i| i.wrapping_mul(37).wrapping_add(variant)));
            seeds.push((format!("mode{mode}-{variant}"), data));
        }
    }
    seeds
}
