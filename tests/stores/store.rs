//! The asynchronous `Store` interface over the embedded `Db` (feature `async`): the same
//! semantics as the synchronous API, and no fsync on a runtime thread.

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::ThreadId;

use crate::conformance::suite;
use oncedb::io::{MemStorage, Storage, StorageFile};
use oncedb::{Db, Options, Store};

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

#[test]
fn a_durable_db_never_fsyncs_on_the_runtime_thread() {
    let storage = SyncThreads::default();
    let db = Db::open(Options::new("/db").storage(Arc::new(storage.clone()))).unwrap();
    let opened = storage.threads.lock().unwrap().len();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    runtime.block_on(async {
        suite::lifecycle(&db).await;
        assert!(Store::insert_if_absent(&db, b"k").await.unwrap());
    });
    let runtime_thread = std::thread::current().id();
    let threads = storage.threads.lock().unwrap();
    assert!(threads.len() > opened + 6, "the writes were fsynced");
    assert!(
        threads[opened..]
            .iter()
            .all(|&thread| thread != runtime_thread),
        "an fsync ran on the runtime thread"
    );
}
