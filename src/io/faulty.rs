//! A [`Storage`] wrapper that fails a chosen call, for fault-injection tests.

use std::any::Any;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{Storage, StorageFile};

/// The calls that count toward the failure point: every call that changes state.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// `StorageFile::append`.
    Write,
    /// `StorageFile::sync`.
    Sync,
    /// `StorageFile::truncate`.
    Truncate,
    /// `Storage::open_append` with `create`.
    Create,
    /// `Storage::rename`.
    Rename,
    /// `Storage::remove`.
    Remove,
    /// `Storage::sync_dir`.
    SyncDir,
}

#[derive(Debug)]
struct Plan {
    calls: AtomicU64,
    fail_at: AtomicU64,
    persistent: AtomicU64,
    failures: AtomicU64,
    /// Positioned reads fail while set (they are not counted as calls: reads change
    /// nothing, and the sweeps count state-changing calls).
    fail_reads: std::sync::atomic::AtomicBool,
    /// Positioned reads made, failed or not.
    reads: AtomicU64,
}

impl Plan {
    /// Counts one call and says whether it fails.
    fn hit(&self) -> io::Result<()> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst) + 1;
        let fail_at = self.fail_at.load(Ordering::SeqCst);
        let persistent = self.persistent.load(Ordering::SeqCst) == 1;
        if fail_at != 0 && (call == fail_at || (persistent && call > fail_at)) {
            self.failures.fetch_add(1, Ordering::SeqCst);
            return Err(io::Error::other(format!("injected failure at call {call}")));
        }
        Ok(())
    }
}

/// Wraps a [`Storage`] and fails its N-th state-changing call (and, if persistent, every
/// later one). Clones share the plan and counters.
#[derive(Clone)]
pub struct FaultyStorage {
    inner: Arc<dyn Storage>,
    plan: Arc<Plan>,
}

impl FaultyStorage {
    /// A wrapper that fails nothing until told to.
    pub fn new(inner: Arc<dyn Storage>) -> Self {
        FaultyStorage {
            inner,
            plan: Arc::new(Plan {
                calls: AtomicU64::new(0),
                fail_at: AtomicU64::new(0),
                persistent: AtomicU64::new(0),
                failures: AtomicU64::new(0),
                fail_reads: std::sync::atomic::AtomicBool::new(false),
                reads: AtomicU64::new(0),
            }),
        }
    }

    /// Fails call number `call` (counting from 1 after [`reset`](Self::reset)); with
    /// `persistent`, every call after it fails too.
    pub fn fail_at(&self, call: u64, persistent: bool) {
        self.plan
            .persistent
            .store(u64::from(persistent), Ordering::SeqCst);
        self.plan.fail_at.store(call, Ordering::SeqCst);
    }

    /// Makes every positioned read ([`Storage::read_at`]) fail, or succeed again.
    pub fn fail_reads(&self, fail: bool) {
        self.plan.fail_reads.store(fail, Ordering::SeqCst);
    }

    /// Stops failing and restarts the count.
    pub fn reset(&self) {
        self.plan.fail_at.store(0, Ordering::SeqCst);
        self.plan.calls.store(0, Ordering::SeqCst);
        self.plan.failures.store(0, Ordering::SeqCst);
    }

    /// State-changing calls counted so far.
    pub fn calls(&self) -> u64 {
        self.plan.calls.load(Ordering::SeqCst)
    }

    /// Positioned reads ([`Storage::read_at`]) made so far; not reset by
    /// [`reset`](Self::reset).
    pub fn reads(&self) -> u64 {
        self.plan.reads.load(Ordering::SeqCst)
    }

    /// Calls failed so far.
    pub fn failures(&self) -> u64 {
        self.plan.failures.load(Ordering::SeqCst)
    }
}

struct FaultyFile {
    inner: Box<dyn StorageFile>,
    plan: Arc<Plan>,
}

impl StorageFile for FaultyFile {
    fn append(&mut self, data: &[u8]) -> io::Result<()> {
        self.plan.hit()?;
        self.inner.append(data)
    }

    fn sync(&mut self) -> io::Result<()> {
        self.plan.hit()?;
        self.inner.sync()
    }

    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }

    fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.plan.hit()?;
        self.inner.truncate(len)
    }
}

impl Storage for FaultyStorage {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        self.inner.create_dir_all(dir)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        self.inner.list(dir)
    }

    fn open_append(&self, path: &Path, create: bool) -> io::Result<Box<dyn StorageFile>> {
        if create {
            self.plan.hit()?;
        }
        Ok(Box::new(FaultyFile {
            inner: self.inner.open_append(path, create)?,
            plan: Arc::clone(&self.plan),
        }))
    }

    fn read(&self, path: &Path, max_bytes: u64) -> io::Result<Vec<u8>> {
        self.inner.read(path, max_bytes)
    }

    fn file_len(&self, path: &Path) -> io::Result<u64> {
        self.inner.file_len(path)
    }

    fn read_at(&self, path: &Path, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        self.plan.reads.fetch_add(1, Ordering::SeqCst);
        if self.plan.fail_reads.load(Ordering::SeqCst) {
            return Err(io::Error::other("injected read failure"));
        }
        self.inner.read_at(path, offset, buf)
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.plan.hit()?;
        self.inner.rename(from, to)
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        self.plan.hit()?;
        self.inner.remove(path)
    }

    fn hard_link(&self, from: &Path, to: &Path) -> io::Result<()> {
        self.plan.hit()?;
        self.inner.hard_link(from, to)
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        self.plan.hit()?;
        self.inner.sync_dir(dir)
    }

    fn lock(&self, path: &Path) -> io::Result<Box<dyn Any + Send + Sync>> {
        self.inner.lock(path)
    }
}
