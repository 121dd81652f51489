//! [`Storage`] on the real file system.

#![expect(
    clippy::cast_possible_truncation,
    reason = "a file read whole was checked against the caller's limit first"
)]

use std::any::Any;
use std::fs::{self, File, OpenOptions};
use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

use super::{ReadAtFile, Storage, StorageFile};

/// The operating system's file system.
#[derive(Debug, Clone, Copy, Default)]
pub struct StdStorage;

struct StdFile(File);

/// A file opened once for positioned reads.
struct StdReadFile(File);

impl ReadAtFile for StdReadFile {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&self.0, buf, offset)
    }
}

impl StorageFile for StdFile {
    fn append(&mut self, data: &[u8]) -> io::Result<()> {
        self.0.write_all(data)
    }

    fn sync(&mut self) -> io::Result<()> {
        self.0.sync_data()
    }

    fn len(&self) -> io::Result<u64> {
        Ok(self.0.metadata()?.len())
    }

    fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.0.set_len(len)
    }
}

impl Storage for StdStorage {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        fs::create_dir_all(dir)
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        let mut files = Vec::new();
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            if entry.file_type()?.is_file() {
                files.push(entry.path());
            }
        }
        files.sort();
        Ok(files)
    }

    fn open_append(&self, path: &Path, create: bool) -> io::Result<Box<dyn StorageFile>> {
        let file = OpenOptions::new()
            .append(true)
            .create_new(create)
            .open(path)?;
        Ok(Box::new(StdFile(file)))
    }

    fn read(&self, path: &Path, max_bytes: u64) -> io::Result<Vec<u8>> {
        let file = File::open(path)?;
        let len = file.metadata()?.len();
        if len > max_bytes {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!("file is {len} bytes, more than the {max_bytes} allowed"),
            ));
        }
        let mut data = Vec::with_capacity(len as usize);
        file.take(max_bytes).read_to_end(&mut data)?;
        Ok(data)
    }

    fn file_len(&self, path: &Path) -> io::Result<u64> {
        Ok(fs::metadata(path)?.len())
    }

    fn read_at(&self, path: &Path, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(&File::open(path)?, buf, offset)
    }

    fn open_read(&self, path: &Path) -> io::Result<Option<Box<dyn ReadAtFile>>> {
        Ok(Some(Box::new(StdReadFile(File::open(path)?))))
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::rename(from, to)
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        fs::remove_file(path)
    }

    fn hard_link(&self, from: &Path, to: &Path) -> io::Result<()> {
        fs::hard_link(from, to).map_err(|err| {
            // Another file system: the caller copies.
            if err.kind() == io::ErrorKind::CrossesDevices {
                io::ErrorKind::Unsupported.into()
            } else {
                err
            }
        })
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        File::open(dir)?.sync_all()
    }

    fn lock(&self, path: &Path) -> io::Result<Box<dyn Any + Send + Sync>> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)?;
        match file.try_lock() {
            Ok(()) => Ok(Box::new(file)),
            Err(fs::TryLockError::WouldBlock) => Err(io::ErrorKind::WouldBlock.into()),
            Err(fs::TryLockError::Error(err)) => Err(err),
        }
    }
}
