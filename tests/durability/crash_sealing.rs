//! Kill -9 crash tests at every step of sealing, on the real file system.
//!
//! A writer child (this test binary re-run) admits batches of keys, and finishes a few
//! idempotency records with each batch, into a store with the smallest memory budget, so
//! that it seals keys and records every few thousand and merges every four seals of a
//! kind. Its storage stops the sealing thread right after one chosen step (the run's
//! temporary file created, fsynced, renamed into place, the directory fsynced, a merged
//! run's input removed); the child says so and the parent kills it there, while the
//! writer thread may still be admitting keys. Other rounds kill the writer after a
//! random number of acknowledged batches. After every kill the parent reopens the store
//! and checks that every key acknowledged in any round is a duplicate, every record
//! acknowledged replays its response byte for byte, and that `oncedb::verify` finds the
//! store clean. Rounds: 15, or `ONCEDB_CRASH_ROUNDS`.

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::support::{PausingStorage, Step, say, spawning_children};
use oncedb::io::SplitMix64;
use oncedb::{Db, Durability, Options, Reservation, Scope};

const CHILD_DIR: &str = "ONCEDB_SEAL_DIR";
const CHILD_FIRST_KEY: &str = "ONCEDB_SEAL_FIRST_KEY";
const CHILD_PAUSE_AT: &str = "ONCEDB_SEAL_PAUSE_AT";
const BATCH: u64 = 64;
/// Records finished with each batch (the batch's first keys, as record keys).
const RECORDS_A_BATCH: u64 = 16;
/// A child that has not paused after this many acknowledged keys is killed anyway.
const MOST_KEYS_A_ROUND: u64 = 40_000;

/// The steps of sealing the child can stop after, one a round in turn; `""` kills the
/// writer after a random number of batches instead.
const STEPS: [&str; 6] = ["create", "sync", "rename", "sync_dir", "remove", ""];

fn options(dir: &Path) -> Options {
    Options::new(dir)
        .durability(Durability::Buffered)
        .memory_budget(1 << 16)
        .shards(4)
}

fn key(n: u64) -> [u8; 8] {
    n.to_le_bytes()
}

fn response_of(n: u64) -> Vec<u8> {
    format!("response of {n}").into_bytes()
}

fn scope() -> Scope {
    Scope::new("org", "pay")
}

/// The writer: admits batches of fresh keys until it is killed, printing `keys N` after
/// each batch `N..N + BATCH` is acknowledged.
#[test]
#[ignore = "child process of the sealing crash test"]
fn crash_sealing_child() {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    // End the test harness's "test ... " line, so every line after it is ours.
    say("\n");
    let first: u64 = std::env::var(CHILD_FIRST_KEY).unwrap().parse().unwrap();
    let storage = Arc::new(pausing_at(
        std::env::var(CHILD_PAUSE_AT).unwrap_or_default(),
    ));
    let db = Db::open(options(Path::new(&dir)).storage(storage)).unwrap();
    say("opened\n");
    let mut n = first;
    loop {
        let keys: Vec<[u8; 8]> = (n..n + BATCH).map(key).collect();
        let admitted = db.insert_many(&keys).unwrap();
        assert!(admitted.iter().all(|&new| new), "fresh keys from {n}");
        for record in n..n + RECORDS_A_BATCH {
            let Reservation::Acquired(lease) = db.reserve(&scope(), &key(record), b"req").unwrap()
            else {
                panic!("record {record} is new");
            };
            lease.complete(&response_of(record)).unwrap();
        }
        say(&format!("keys {n}\n"));
        n += BATCH;
    }
}

fn is_run(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|name| name.to_string_lossy().starts_with("run-"))
}

fn has_extension(path: &Path, extension: &str) -> bool {
    is_run(path) && path.extension().is_some_and(|e| e == extension)
}

/// The real file system, except that the chosen step of sealing is made and then never
/// returns. Calls on other files never pause.
fn pausing_at(pause_at: String) -> PausingStorage {
    // A run was renamed into place: the next directory fsync makes it durable.
    let run_renamed = AtomicBool::new(false);
    PausingStorage::new(move |step| match step {
        Step::Created(path) => pause_at == "create" && has_extension(path, "tmp"),
        Step::Synced(path) => pause_at == "sync" && has_extension(path, "tmp"),
        Step::Renamed(to) => {
            let run = has_extension(to, "keys") || has_extension(to, "records");
            run_renamed.fetch_or(run, Ordering::SeqCst);
            run && pause_at == "rename"
        }
        Step::DirSynced => pause_at == "sync_dir" && run_renamed.swap(false, Ordering::SeqCst),
        Step::Removed(path) => {
            pause_at == "remove" && (has_extension(path, "keys") || has_extension(path, "records"))
        }
        Step::Truncated(_) => false,
    })
}

/// Runs a writer from key `first` with `pause_at`, kills it where it pauses (or after
/// `kill_after` acknowledged keys), and returns the first key of every acknowledged
/// batch and whether it paused.
fn run_writer(dir: &Path, first: u64, pause_at: &str, kill_after: u64) -> (Vec<u64>, bool) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "crash_sealing::crash_sealing_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DIR, dir)
        .env(CHILD_FIRST_KEY, first.to_string())
        .env(CHILD_PAUSE_AT, pause_at)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let (mut batches, mut paused, mut killed) = (Vec::new(), false, false);
    for line in lines.map_while(Result::ok) {
        if line == "paused" && !killed {
            paused = true;
        } else if let Some(n) = line.strip_prefix("keys ") {
            batches.push(n.parse().unwrap());
        }
        if !killed && (paused || batches.len() as u64 * BATCH >= kill_after) {
            child.kill().unwrap();
            killed = true;
        }
    }
    child.wait().unwrap();
    assert!(killed, "the writer stopped before it was killed");
    (batches, paused)
}

/// Reopens the store and checks that every acknowledged batch is there, whole: its keys
/// and its records.
fn check(dir: &Path, batches: &[u64]) -> oncedb::Stats {
    let db = Db::open(options(dir)).expect("reopen after SIGKILL must succeed");
    for &first in batches {
        for n in first..first + BATCH {
            assert!(db.contains(&key(n)).unwrap(), "acknowledged key {n} lost");
        }
        for n in first..first + RECORDS_A_BATCH {
            match db.reserve(&scope(), &key(n), b"req").unwrap() {
                Reservation::Completed(record) => {
                    assert_eq!(record.response(), Some(&response_of(n)[..]), "record {n}");
                }
                other => panic!("acknowledged record {n}: {other:?}"),
            }
        }
    }
    assert!(!db.contains(&key(u64::MAX)).unwrap());
    let stats = db.stats();
    drop(db);
    let report = oncedb::verify(dir).unwrap();
    assert!(report.is_clean(), "{report}");
    stats
}

#[test]
fn keys_and_records_survive_sigkill_at_every_step_of_sealing() {
    let _children = spawning_children();
    let rounds: u64 = std::env::var("ONCEDB_CRASH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(15);
    let dir = tempfile::tempdir().unwrap();
    let mut rng = SplitMix64::new(0x5ea1);
    let (mut acked, mut paused_at) = (Vec::new(), Vec::new());
    let mut stats = None;
    for round in 0..rounds {
        let pause_at = STEPS[(round % STEPS.len() as u64) as usize];
        let kill_after = if pause_at.is_empty() {
            BATCH + rng.next_u64() % 8_000
        } else {
            MOST_KEYS_A_ROUND
        };
        let (batches, paused) = run_writer(dir.path(), (round + 1) << 32, pause_at, kill_after);
        if paused {
            paused_at.push(pause_at);
        }
        acked.extend(batches);
        // Every earlier round's acknowledgements must survive every later kill too.
        stats = Some(check(dir.path(), &acked));
    }
    let stats = stats.unwrap();
    eprintln!(
        "{} keys acknowledged, killed at {paused_at:?}, {stats:?}",
        acked.len() as u64 * BATCH
    );
    assert!(stats.sealed_runs > 0, "{stats:?}");
    assert!(stats.sealed_record_runs > 0, "{stats:?}");
    for step in STEPS.iter().filter(|step| !step.is_empty()) {
        assert!(
            paused_at.contains(step),
            "no writer was killed after {step}"
        );
    }
}
