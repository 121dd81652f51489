//! What the modules of this binary share: the test window and a manual clock (from
//! `oncedb_testkit::fixtures`), the lock that keeps the crash tests' child processes
//! from holding on to the lock files of stores that other tests reopen, the storage
//! that stops a crash test's child right after a chosen step, and the fault sweep.

pub use oncedb_testkit::fixtures::*;

use std::any::Any;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, PoisonError, RwLock, RwLockReadGuard, RwLockWriteGuard};

use oncedb::io::{ReadAtFile, StdStorage, Storage, StorageFile};

/// Between fork and exec, a child process holds a copy of every file descriptor of this
/// process, and with it the lock of any store open at that moment. A store that a test
/// closes meanwhile stays locked until the child has exec'd, and reopening it (in this
/// process, or in a child of its own) fails with `Error::Locked`. Tests that spawn
/// children hold this lock exclusively, tests that open stores on the real file system
/// hold it shared; stores on a `MemStorage` need neither.
static CHILDREN: RwLock<()> = RwLock::new(());

/// Held for the whole of a test that spawns child processes: no other test of this binary
/// that holds [`CHILDREN`] runs meanwhile.
pub fn spawning_children() -> RwLockWriteGuard<'static, ()> {
    CHILDREN.write().unwrap_or_else(PoisonError::into_inner)
}

/// Held for the whole of a test that opens (and reopens) stores on the real file system.
pub fn real_files() -> RwLockReadGuard<'static, ()> {
    CHILDREN.read().unwrap_or_else(PoisonError::into_inner)
}

/// A step of file work after which a crash test's child may stop.
#[derive(Debug, Clone, Copy)]
pub enum Step<'a> {
    /// `open_append` with `create` made this file.
    Created(&'a Path),
    /// This file, open for appending, was fsynced.
    Synced(&'a Path),
    /// This file, open for appending, was cut to a length.
    Truncated(&'a Path),
    /// A file was renamed to this path.
    Renamed(&'a Path),
    /// This file was removed.
    Removed(&'a Path),
    /// A directory was fsynced.
    DirSynced,
}

type Stops = Arc<dyn Fn(Step<'_>) -> bool + Send + Sync>;

/// The real file system, except that after each step it asks `stops`, and where told to,
/// stops the calling thread for good ([`pause`]): the parent kills the child there.
pub struct PausingStorage {
    stops: Stops,
}

impl PausingStorage {
    pub fn new(stops: impl Fn(Step<'_>) -> bool + Send + Sync + 'static) -> PausingStorage {
        PausingStorage {
            stops: Arc::new(stops),
        }
    }
}

/// Prints `line` to stdout at once: a child's acknowledgements and its `paused`.
pub fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    out.write_all(line.as_bytes()).unwrap();
    out.flush().unwrap();
}

/// Parks the calling thread for good after saying `paused`: the parent kills the process.
pub fn pause() -> ! {
    say("paused\n");
    loop {
        std::thread::park();
    }
}

fn after(stops: &Stops, step: Step<'_>) {
    if stops(step) {
        pause();
    }
}

struct PausingFile {
    inner: Box<dyn StorageFile>,
    path: PathBuf,
    stops: Stops,
}

impl StorageFile for PausingFile {
    fn append(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.inner.append(data)
    }
    fn sync(&mut self) -> std::io::Result<()> {
        self.inner.sync()?;
        after(&self.stops, Step::Synced(&self.path));
        Ok(())
    }
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }
    fn truncate(&mut self, len: u64) -> std::io::Result<()> {
        self.inner.truncate(len)?;
        after(&self.stops, Step::Truncated(&self.path));
        Ok(())
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
        if create {
            after(&self.stops, Step::Created(path));
        }
        Ok(Box::new(PausingFile {
            inner,
            path: path.to_path_buf(),
            stops: Arc::clone(&self.stops),
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
        after(&self.stops, Step::Renamed(to));
        Ok(())
    }
    fn remove(&self, path: &Path) -> std::io::Result<()> {
        StdStorage.remove(path)?;
        after(&self.stops, Step::Removed(path));
        Ok(())
    }
    fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
        StdStorage.sync_dir(dir)?;
        after(&self.stops, Step::DirSynced);
        Ok(())
    }
    fn lock(&self, path: &Path) -> std::io::Result<Box<dyn Any + Send + Sync>> {
        StdStorage.lock(path)
    }
}

/// Polls `db`'s stats until `waiting` holds of them, or `limit` has passed (the caller's
/// assertions on the stats then fail), while `writer` must stay blocked: a writer that
/// returned first never waited for what it should have (`what`).
pub fn until_the_writer_waits<T>(
    db: &oncedb::Db,
    writer: &std::thread::ScopedJoinHandle<'_, T>,
    limit: std::time::Duration,
    (what, waiting): (&str, impl Fn(&oncedb::Stats) -> bool),
) -> oncedb::Stats {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let stats = db.stats();
        if waiting(&stats) || std::time::Instant::now() >= deadline {
            return stats;
        }
        assert!(!writer.is_finished(), "the writer never waited for {what}");
        std::thread::yield_now();
    }
}

/// The fault sweep: for each I/O call `1..=calls + 1` of a workload, and after each of a
/// process crash and a power loss, opens a store (`open`) on a storage whose `call`th
/// call fails, runs `workload` on it (which returns how many of its `all` writes it saw
/// acknowledged), checks that a failure was reported, crashes the disk, reopens the store
/// and hands it, with the acknowledged count and a label naming the round, to `check`.
pub fn sweep_faults(
    calls: u64,
    open: impl Fn(Arc<dyn Storage>) -> oncedb::Result<oncedb::Db>,
    (workload, all): (impl Fn(&oncedb::Db) -> u32, u32),
    check: impl Fn(&oncedb::Db, u32, &str),
) {
    for call in 1..=calls + 1 {
        for power_loss in [false, true] {
            let disk = oncedb::io::MemStorage::new();
            let faulty = oncedb::io::FaultyStorage::new(Arc::new(disk.clone()));
            faulty.fail_at(call, false);
            let mut acked = 0;
            if let Ok(db) = open(Arc::new(faulty.clone())) {
                acked = workload(&db);
                if faulty.failures() > 0 {
                    assert!(
                        acked < all,
                        "call {call}: a failure was reported as success"
                    );
                }
            }
            if power_loss {
                disk.power_loss();
            } else {
                disk.process_crash();
            }
            let db = open(Arc::new(disk.clone()))
                .unwrap_or_else(|err| panic!("call {call}: reopen failed: {err}"));
            check(
                &db,
                acked,
                &format!("call {call} (power loss {power_loss})"),
            );
        }
    }
}
