//! Kill -9 crash tests: the test binary re-runs itself as a writer child, is killed with
//! SIGKILL after a random number of acknowledged writes, and the parent checks that every
//! acknowledged key and record survived. Rounds: 20 per mode, or `ONCEDB_CRASH_ROUNDS`.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::Arc;

use crate::support::spawning_children;
use oncedb::io::SplitMix64;
use oncedb::{Db, Durability, Options, RecordStatus, Reservation, Scope};

const CHILD_DIR: &str = "ONCEDB_CRASH_DIR";
const CHILD_MODE: &str = "ONCEDB_CRASH_MODE";
const CHILD_FIRST_KEY: &str = "ONCEDB_CRASH_FIRST_KEY";
const WRITER_THREADS: u64 = 4;
const KEYS_PER_THREAD: u64 = 100_000;

fn options(dir: &Path, mode: &str) -> Options {
    let durability = match mode {
        "sync" => Durability::Sync,
        "buffered" => Durability::Buffered,
        other => panic!("unknown mode {other}"),
    };
    Options::new(dir).durability(durability)
}

fn scope() -> Scope {
    Scope::new("crash-test", "write")
}

/// The writer: never returns; prints `key N` or `record N` after each acknowledgement.
#[test]
#[ignore = "child process of the crash tests"]
fn crash_writer_child() {
    let Ok(dir) = std::env::var(CHILD_DIR) else {
        return;
    };
    let mode = std::env::var(CHILD_MODE).unwrap();
    let first: u64 = std::env::var(CHILD_FIRST_KEY).unwrap().parse().unwrap();
    let db = Arc::new(Db::open(options(Path::new(&dir), &mode)).unwrap());
    let threads: Vec<_> = (0..WRITER_THREADS)
        .map(|thread| {
            let db = Arc::clone(&db);
            std::thread::spawn(move || {
                let start = first + thread * KEYS_PER_THREAD;
                for n in start..start + KEYS_PER_THREAD {
                    write_one(&db, n);
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
}

fn write_one(db: &Db, n: u64) {
    let key = n.to_le_bytes();
    let line = if n.is_multiple_of(8) {
        let Reservation::Acquired(lease) = db.reserve(&scope(), &key, &key).unwrap() else {
            panic!("fresh record {n} must be acquired");
        };
        lease.complete(format!("response {n}").as_bytes()).unwrap();
        format!("record {n}\n")
    } else if n % 8 == 1 {
        let batch = [key, (n | 1 << 62).to_le_bytes()];
        assert_eq!(db.insert_many(&batch).unwrap(), vec![true, true]);
        format!("key {n}\nkey {}\n", n | 1 << 62)
    } else {
        assert!(db.insert_if_absent(&key).unwrap());
        format!("key {n}\n")
    };
    let mut out = std::io::stdout().lock();
    out.write_all(line.as_bytes()).unwrap();
    out.flush().unwrap();
}

#[derive(Default)]
struct Acked {
    keys: Vec<u64>,
    records: Vec<u64>,
}

/// Runs one child until it has acknowledged `kill_after` writes, kills it, and returns
/// every acknowledgement it printed.
fn run_child(dir: &Path, mode: &str, first_key: u64, kill_after: usize) -> Acked {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "crash_recovery::crash_writer_child",
            "--exact",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DIR, dir)
        .env(CHILD_MODE, mode)
        .env(CHILD_FIRST_KEY, first_key.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut acked = Acked::default();
    let mut seen = 0;
    let mut killed = false;
    while let Some(Ok(line)) = lines.next() {
        if let Some(n) = line.strip_prefix("key ") {
            acked.keys.push(n.parse().unwrap());
        } else if let Some(n) = line.strip_prefix("record ") {
            acked.records.push(n.parse().unwrap());
        } else {
            continue;
        }
        seen += 1;
        if seen == kill_after && !killed {
            child.kill().unwrap();
            killed = true;
        }
    }
    child.wait().unwrap();
    assert!(killed, "the child stopped before it was killed");
    acked
}

fn check_recovered(dir: &Path, mode: &str, acked: &Acked) {
    let db = Db::open(options(dir, mode)).expect("reopen after SIGKILL must succeed");
    for &n in &acked.keys {
        assert!(
            db.contains(&n.to_le_bytes()).unwrap(),
            "{mode}: acknowledged key {n} lost"
        );
    }
    for &n in &acked.records {
        let record = db.get(&scope(), &n.to_le_bytes()).unwrap();
        let record = record.unwrap_or_else(|| panic!("{mode}: acknowledged record {n} lost"));
        assert_eq!(record.status(), RecordStatus::Completed);
        assert_eq!(record.response(), Some(format!("response {n}").as_bytes()));
    }
}

fn crash_rounds(mode: &str, seed: u64) {
    let rounds: u64 = std::env::var("ONCEDB_CRASH_ROUNDS")
        .ok()
        .and_then(|r| r.parse().ok())
        .unwrap_or(20);
    let dir = tempfile::tempdir().unwrap();
    let mut rng = SplitMix64::new(seed);
    let mut all = Acked::default();
    for round in 0..rounds {
        let kill_after = 1 + (rng.next_u64() % 400) as usize;
        let first_key = (round + 1) * 1_000_000_000;
        let acked = run_child(dir.path(), mode, first_key, kill_after);
        assert!(acked.keys.len() + acked.records.len() >= kill_after);
        all.keys.extend(acked.keys);
        all.records.extend(acked.records);
        // Every earlier round's acknowledgements must survive every later crash too.
        check_recovered(dir.path(), mode, &all);
    }
}

#[test]
fn sync_writes_survive_sigkill() {
    let _children = spawning_children();
    crash_rounds("sync", 1);
}

#[test]
fn buffered_writes_survive_sigkill() {
    let _children = spawning_children();
    crash_rounds("buffered", 2);
}
