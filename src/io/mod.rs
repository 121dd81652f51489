//! The file-system layer. Every byte a durable store reads or writes goes through the
//! [`Storage`] trait, so tests can fail any single call ([`FaultyStorage`]) or simulate a
//! power loss that drops unsynced writes ([`MemStorage`]).

mod faulty;
mod mem;
mod random;
mod std_fs;

use std::any::Any;
use std::io;
use std::path::{Path, PathBuf};

pub use faulty::{FaultKind, FaultyStorage};
pub use mem::MemStorage;
pub use random::SplitMix64;
pub use std_fs::StdStorage;

/// A file opened for appending.
#[expect(
    clippy::len_without_is_empty,
    reason = "a file's emptiness is never asked on its own"
)]
pub trait StorageFile: Send + Sync {
    /// Appends all of `data` at the end of the file.
    fn append(&mut self, data: &[u8]) -> io::Result<()>;
    /// Makes everything appended so far durable (`fdatasync`).
    fn sync(&mut self) -> io::Result<()>;
    /// Current length in bytes.
    fn len(&self) -> io::Result<u64>;
    /// Cuts the file to `len` bytes.
    fn truncate(&mut self, len: u64) -> io::Result<()>;
}

/// A file kept open for positioned reads: one open for many reads (a sealed run's data
/// pages), where [`Storage::read_at`] by path opens the file for each.
pub trait ReadAtFile: Send + Sync {
    /// Fills `buf` with the file's bytes from `offset` (one positioned read); fails with
    /// `UnexpectedEof` if the file ends first.
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()>;
}

/// The operations oncedb performs on a directory and its files.
pub trait Storage: Send + Sync + 'static {
    /// Creates `dir` and its parents if missing.
    fn create_dir_all(&self, dir: &Path) -> io::Result<()>;
    /// Paths of the regular files directly inside `dir`.
    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>>;
    /// Opens `path` for appending. With `create`, creates it empty and fails with
    /// `AlreadyExists` if it exists: a new segment or manifest never lands on top of an
    /// old file.
    fn open_append(&self, path: &Path, create: bool) -> io::Result<Box<dyn StorageFile>>;
    /// Reads the whole file; fails with `InvalidData` if it is longer than `max_bytes`.
    fn read(&self, path: &Path, max_bytes: u64) -> io::Result<Vec<u8>>;
    /// The file's length in bytes. The default reads the whole file, for wrappers that
    /// have no cheaper way; a real file system overrides it.
    fn file_len(&self, path: &Path) -> io::Result<u64> {
        Ok(self.read(path, u64::MAX)?.len() as u64)
    }
    /// Fills `buf` with the file's bytes from `offset` (one positioned read); fails with
    /// `UnexpectedEof` if the file ends first. The default reads the whole file, for
    /// wrappers that have no cheaper way; a real file system overrides it.
    fn read_at(&self, path: &Path, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let data = self.read(path, u64::MAX)?;
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::UnexpectedEof)?;
        let bytes = data
            .get(start..start + buf.len())
            .ok_or(io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(bytes);
        Ok(())
    }
    /// Opens `path` for many positioned reads, where the storage has a cheaper way than
    /// [`Storage::read_at`] by path: a real file system opens the file once, and the
    /// handle reads it even after a rename or removal. `None` (the default) leaves every
    /// read to `read_at` by path, so a wrapper that counts or fails reads sees each one.
    fn open_read(&self, _path: &Path) -> io::Result<Option<Box<dyn ReadAtFile>>> {
        Ok(None)
    }
    /// Atomically replaces `to` with `from`.
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()>;
    /// Makes `to` (which must not exist) a second name of the file `from`, sharing its
    /// bytes: for immutable files copied into a checkpoint. Fails with `Unsupported`
    /// (the default, and a real file system across devices), and the caller copies the
    /// bytes instead.
    fn hard_link(&self, _from: &Path, _to: &Path) -> io::Result<()> {
        Err(io::ErrorKind::Unsupported.into())
    }
    /// Deletes a file.
    fn remove(&self, path: &Path) -> io::Result<()>;
    /// Makes creations, renames and deletions inside `dir` durable.
    fn sync_dir(&self, dir: &Path) -> io::Result<()>;
    /// Takes an exclusive lock on `path` (created if missing), held until the returned
    /// guard drops; fails with `WouldBlock` if another holder has it.
    fn lock(&self, path: &Path) -> io::Result<Box<dyn Any + Send + Sync>>;
}
