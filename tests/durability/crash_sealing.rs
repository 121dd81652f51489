//! Kill -9 crash tests at every step of sealing, on the real file system.
//!
//! A writer child (this test binary re-run) admits batches of keys into a store with the
//! smallest memory budget, so that it seals every few thousand keys and merges every four
//! seals. Its storage stops the sealing thread right after one chosen step (the run's
//! temporary file created, fsynced, renamed into place, the directory fsynced, a merged
//! run's input removed); the child says so and the parent kills it there, while the
//! writer thread may still be admitting keys. Other rounds kill the writer after a
//! random number of acknowledged batches. After every kill the parent reopens the store
//! and checks that every key acknowledged in any round is a duplicate, and that
//! `oncedb::verify` finds the store clean. Rounds: 15, or `ONCEDB_CRASH_ROUNDS`.

use std::any::Any;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use crate::support::spawning_children;
use oncedb::io::{ReadAtFile, SplitMix64, StdStorage, Storage, StorageFile};
use oncedb::{Db, Durability, Options};

const CHILD_DIR: &str = "ONCEDB_SEAL_DIR";
const CHILD_FIRST_KEY: &str = "ONCEDB_SEAL_FIRST_KEY";
const CHILD_PAUSE_AT: &str = "ONCEDB_SEAL_PAUSE_AT";
const BATCH: u64 = 64;
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

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    out.write_all(line.as_bytes()).unwrap();
    out.flush().unwrap();
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
    let storage = Arc::new(PausingStorage {
        pause_at: std::env::var(CHILD_PAUSE_AT).unwrap_or_default(),
        run_renamed: AtomicBool::new(false),
    });
    let db = Db::open(options(Path::new(&dir)).storage(storage)).unwrap();
    say("opened\n");
    let mut n = first;
    loop {
        let keys: Vec<[u8; 8]> = (n..n + BATCH).map(key).collect();
        let admitted = db.insert_many(&keys).unwrap();
        assert!(admitted.iter().all(|&new| new), "fresh keys from {n}");
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

/// Parks the calling thread for good after saying so: the parent kills the process.
fn pause() -> ! {
    say("paused\n");
    loop {
        std::thread::park();
    }
}

/// The real file system, except that the chosen step of sealing is made and then never
/// returns. Calls on other files never pause.
struct PausingStorage {
    pause_at: String,
    /// A run was renamed into place: the next directory fsync is the one that makes it
    /// durable.
    run_renamed: AtomicBool,
}

struct PausingFile {
    inner: Box<dyn StorageFile>,
    pause_after_sync: bool,
}

impl StorageFile for PausingFile {
    fn append(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.inner.append(data)
    }
    fn sync(&mut self) -> std::io::Result<()> {
        self.inner.sync()?;
        if self.pause_after_sync {
            pause();
        }
        Ok(())
    }
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }
    fn truncate(&mut self, len: u64) -> std::io::Result<()> {
        self.inner.truncate(len)
    }
}

impl Storage for PausingStorage {
    fn create_dir_all(&self, dir: &Path) -> std::io::Result<()> {
        StdStorage.create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
        StdStorage.list(dir)
    }
    fn open_append(&self, path: &Path, create: bool) -> std::io::Result<Box<dyn StorageFile>> {
        let inner = StdStorage.open_append(path, create)?;
        let temp_run = has_extension(path, "tmp");
        if temp_run && self.pause_at == "create" {
            pause();
        }
        Ok(Box::new(PausingFile {
            inner,
            pause_after_sync: temp_run && self.pause_at == "sync",
        }))
    }
    fn read(&self, path: &Path, max_bytes: u64) -> std::io::Result<Vec<u8>> {
        StdStorage.read(path, max_bytes)
    }
    fn read_at(&self, path: &Path, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        StdStorage.read_at(path, offset, buf)
    }
    fn open_read(&self, path: &Path) -> std::io::Result<Option<Box<dyn ReadAtFile>>> {
        StdStorage.open_read(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        StdStorage.rename(from, to)?;
        if has_extension(to, "keys") {
            if self.pause_at == "rename" {
                pause();
            }
            self.run_renamed.store(true, Ordering::SeqCst);
        }
        Ok(())
    }
    fn remove(&self, path: &Path) -> std::io::Result<()> {
        StdStorage.remove(path)?;
        if has_extension(path, "keys") && self.pause_at == "remove" {
            pause();
        }
        Ok(())
    }
    fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
        StdStorage.sync_dir(dir)?;
        if self.pause_at == "sync_dir" && self.run_renamed.swap(false, Ordering::SeqCst) {
            pause();
        }
        Ok(())
    }
    fn lock(&self, path: &Path) -> std::io::Result<Box<dyn Any + Send + Sync>> {
        StdStorage.lock(path)
    }
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

/// Reopens the store and checks that every acknowledged batch is there, whole.
fn check(dir: &Path, batches: &[u64]) -> oncedb::Stats {
    let db = Db::open(options(dir)).expect("reopen after SIGKILL must succeed");
    for &first in batches {
        for n in first..first + BATCH {
            assert!(db.contains(&key(n)).unwrap(), "acknowledged key {n} lost");
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
fn keys_survive_sigkill_at_every_step_of_sealing() {
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
    for step in STEPS.iter().filter(|step| !step.is_empty()) {
        assert!(
            paused_at.contains(step),
            "no writer was killed after {step}"
        );
    }
}
