//! The asynchronous `Store` interface over the embedded `Db` (feature `async`): the same
//! semantics as the synchronous API (the whole conformance suite), and no fsync on a
//! runtime thread.

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;
use std::time::{Duration, SystemTime};

use crate::conformance::suite;
use oncedb::io::{MemStorage, Storage, StorageFile};
use oncedb::{Db, Durability, ManualClock, Options};

/// Records the thread of every file sync.
#[derive(Clone, Default)]
struct SyncThreads {
    disk: MemStorage,
    threads: Arc<Mutex<Vec<ThreadId>>>,
}

struct File {
    inner: Box<dyn StorageFile>,
    threads: Arc<Mutex<Vec<ThreadId>>>,
}

impl StorageFile for File {
    fn append(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.inner.append(data)
    }
    fn sync(&mut self) -> std::io::Result<()> {
        self.threads
            .lock()
            .unwrap()
            .push(std::thread::current().id());
        self.inner.sync()
    }
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }
    fn truncate(&mut self, len: u64) -> std::io::Result<()> {
        self.inner.truncate(len)
    }
}

impl Storage for SyncThreads {
    fn create_dir_all(&self, dir: &Path) -> std::io::Result<()> {
        self.disk.create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
        self.disk.list(dir)
    }
    fn open_append(&self, path: &Path, create: bool) -> std::io::Result<Box<dyn StorageFile>> {
        Ok(Box::new(File {
            inner: self.disk.open_append(path, create)?,
            threads: Arc::clone(&self.threads),
        }))
    }
    fn read(&self, path: &Path, max_bytes: u64) -> std::io::Result<Vec<u8>> {
        self.disk.read(path, max_bytes)
    }
    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        self.disk.rename(from, to)
    }
    fn remove(&self, path: &Path) -> std::io::Result<()> {
        self.disk.remove(path)
    }
    fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
        self.threads
            .lock()
            .unwrap()
            .push(std::thread::current().id());
        self.disk.sync_dir(dir)
    }
    fn lock(&self, path: &Path) -> std::io::Result<Box<dyn Any + Send + Sync>> {
        self.disk.lock(path)
    }
}

/// Durable stores on the recording storage, opened on the blocking pool, on a manual
/// clock. It keeps a handle to each: dropping the last handle of a durable `Db` closes
/// its journal, which syncs on the dropping thread, and that is not what is under test.
struct Recorded {
    storage: SyncThreads,
    clock: ManualClock,
    stores: Mutex<Vec<Db>>,
}

impl suite::Harness for Recorded {
    type S = Db;

    async fn store(&self, window: Duration) -> Db {
        let n = self.stores.lock().unwrap().len();
        let options = Options::new(format!("/db/{n}"))
            .storage(Arc::new(self.storage.clone()))
            .durability(Durability::Sync)
            .window(window)
            .bucket_width(window / 10)
            .clock(self.clock.clone());
        // Opening syncs files too: not on the runtime thread either.
        let db = tokio::task::spawn_blocking(move || Db::open(options))
            .await
            .unwrap()
            .unwrap();
        self.stores.lock().unwrap().push(db.clone());
        db
    }

    async fn pass(&self, _store: &Db, window: Duration) {
        self.clock.forward(window + window / 5);
    }

    async fn approach(&self, _store: &Db, window: Duration) {
        self.clock.forward(window - Duration::from_millis(1));
    }
}

/// The whole conformance suite (insert_many, take_over, advance, release and the races
/// included) on a current-thread runtime: every fsync ran on another thread.
#[test]
fn a_durable_db_never_fsyncs_on_the_runtime_thread() {
    let harness = Recorded {
        storage: SyncThreads::default(),
        clock: ManualClock::new(SystemTime::now()),
        stores: Mutex::new(Vec::new()),
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(suite::run(&harness));
    let runtime_thread = std::thread::current().id();
    // Before the harness drops the stores.
    let threads = harness.storage.threads.lock().unwrap().clone();
    assert_eq!(harness.stores.lock().unwrap().len(), 2);
    assert!(
        threads.len() > 40,
        "the writes were fsynced: {}",
        threads.len()
    );
    assert!(
        threads.iter().all(|&thread| thread != runtime_thread),
        "an fsync ran on the runtime thread"
    );
}
