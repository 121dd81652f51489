//! A [`MemStorage`] that tells a hook about every sync, for tests that check who syncs
//! (which thread) and when (a background flusher's own fsync), instead of timing it; and
//! that refuses to open the files a test names, for an I/O error at one chosen step.

use std::any::Any;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use oncedb::io::{MemStorage, Storage, StorageFile};

/// What runs after each successful file or directory sync, on the syncing thread.
pub type SyncHook = Arc<dyn Fn() + Send + Sync>;

/// Whether opening the file at a path for appending fails (with an injected I/O error).
pub type OpenRefusal = Arc<dyn Fn(&Path) -> bool + Send + Sync>;

/// Storage over a [`MemStorage`] (shared with the test, for power cuts and reads) that
/// calls its hook after every successful sync of a file or a directory.
#[derive(Clone)]
pub struct WatchedStorage {
    disk: MemStorage,
    on_sync: SyncHook,
    refuse_open: Option<OpenRefusal>,
}

impl WatchedStorage {
    /// Storage on `disk` calling `on_sync` after each sync.
    pub fn new(disk: MemStorage, on_sync: impl Fn() + Send + Sync + 'static) -> WatchedStorage {
        WatchedStorage {
            disk,
            on_sync: Arc::new(on_sync),
            refuse_open: None,
        }
    }

    /// Storage on `disk` whose opens for appending fail where `refuse` says so, at the
    /// time of the call.
    pub fn refusing_opens(
        disk: MemStorage,
        refuse: impl Fn(&Path) -> bool + Send + Sync + 'static,
    ) -> WatchedStorage {
        WatchedStorage {
            refuse_open: Some(Arc::new(refuse)),
            ..WatchedStorage::new(disk, || {})
        }
    }
}

struct WatchedFile {
    inner: Box<dyn StorageFile>,
    on_sync: SyncHook,
}

impl StorageFile for WatchedFile {
    fn append(&mut self, data: &[u8]) -> std::io::Result<()> {
        self.inner.append(data)
    }
    fn sync(&mut self) -> std::io::Result<()> {
        self.inner.sync()?;
        (self.on_sync)();
        Ok(())
    }
    fn len(&self) -> std::io::Result<u64> {
        self.inner.len()
    }
    fn truncate(&mut self, len: u64) -> std::io::Result<()> {
        self.inner.truncate(len)
    }
}

impl Storage for WatchedStorage {
    fn create_dir_all(&self, dir: &Path) -> std::io::Result<()> {
        self.disk.create_dir_all(dir)
    }
    fn list(&self, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
        self.disk.list(dir)
    }
    fn open_append(&self, path: &Path, create: bool) -> std::io::Result<Box<dyn StorageFile>> {
        if self.refuse_open.as_ref().is_some_and(|refuse| refuse(path)) {
            return Err(std::io::Error::other(format!(
                "injected: {} cannot be opened",
                path.display()
            )));
        }
        Ok(Box::new(WatchedFile {
            inner: self.disk.open_append(path, create)?,
            on_sync: Arc::clone(&self.on_sync),
        }))
    }
    fn read(&self, path: &Path, max_bytes: u64) -> std::io::Result<Vec<u8>> {
        self.disk.read(path, max_bytes)
    }
    fn file_len(&self, path: &Path) -> std::io::Result<u64> {
        self.disk.file_len(path)
    }
    fn read_at(&self, path: &Path, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        self.disk.read_at(path, offset, buf)
    }
    fn rename(&self, from: &Path, to: &Path) -> std::io::Result<()> {
        self.disk.rename(from, to)
    }
    fn remove(&self, path: &Path) -> std::io::Result<()> {
        self.disk.remove(path)
    }
    fn sync_dir(&self, dir: &Path) -> std::io::Result<()> {
        self.disk.sync_dir(dir)?;
        (self.on_sync)();
        Ok(())
    }
    fn lock(&self, path: &Path) -> std::io::Result<Box<dyn Any + Send + Sync>> {
        self.disk.lock(path)
    }
}
