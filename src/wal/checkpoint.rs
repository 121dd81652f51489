//! The file work of a checkpoint: immutable files (sealed segments, sealed runs) linked
//! into the copy, or copied where the storage cannot link (another file system); the
//! active segment copied up to the end of its last fsynced group; the manifest written;
//! every copied file and the copy's directory fsynced. The engine decides what to copy
//! and when (`Engine::checkpoint`); nothing here writes to the source directory.

use std::io;
use std::path::Path;

use super::manifest::Manifest;
use super::run::LogPosition;
use crate::base::{Error, Result};
use crate::io::Storage;

/// Bytes copied per read.
const COPY_CHUNK_BYTES: u64 = 1 << 20;

/// What [`Db::checkpoint`](crate::Db::checkpoint) made: where the copy's log ends, and
/// how its files got there.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Checkpoint {
    /// The end of the log the copy holds: every write acknowledged before the call (and
    /// every write appended before it, whatever the durability) lies before it.
    pub position: LogPosition,
    /// Immutable files (sealed segments and sealed runs) linked into the copy: they
    /// share their bytes with the source's.
    pub files_linked: u64,
    /// Files copied (the active segment, and immutable files the storage could not
    /// link, as across file systems), each fsynced.
    pub files_copied: u64,
    /// Bytes of the copied files.
    pub bytes_copied: u64,
}

/// Creates `dir` for a checkpoint (durably: a power loss keeps its entry in its parent);
/// it must not exist or be empty, so that no file of another store mixes with the copy.
pub(crate) fn prepare_dir(storage: &dyn Storage, dir: &Path) -> Result<()> {
    super::archive::create_dir_durably(storage, dir)?;
    if !storage.list(dir)?.is_empty() {
        return Err(Error::InvalidOptions(format!(
            "checkpoint directory {} is not empty",
            dir.display()
        )));
    }
    Ok(())
}

/// Links the immutable file `from` into `dir` under its own name, or copies it whole
/// where the storage cannot link. `Ok(false)` if `from` is gone (its bucket left the
/// window meanwhile: nothing of it belongs in the copy).
pub(crate) fn link_or_copy(
    storage: &dyn Storage,
    from: &Path,
    dir: &Path,
    copied: &mut Checkpoint,
) -> Result<bool> {
    let to = dir.join(from.file_name().unwrap_or_default());
    match storage.hard_link(from, &to) {
        Ok(()) => {
            copied.files_linked += 1;
            return Ok(true);
        }
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(err) if err.kind() == io::ErrorKind::Unsupported => {}
        Err(err) => return Err(err.into()),
    }
    let len = match storage.file_len(from) {
        Ok(len) => len,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(err) => return Err(err.into()),
    };
    copy_prefix(storage, from, &to, len, copied)?;
    Ok(true)
}

/// Copies bytes `0..len` of `from` to the new file `to`, and fsyncs it.
pub(crate) fn copy_prefix(
    storage: &dyn Storage,
    from: &Path,
    to: &Path,
    len: u64,
    copied: &mut Checkpoint,
) -> Result<()> {
    let mut file = storage.open_append(to, true)?;
    let mut buffer = vec![0u8; usize::try_from(COPY_CHUNK_BYTES.min(len)).unwrap_or(0)];
    let mut offset = 0;
    while offset < len {
        let chunk = usize::try_from((len - offset).min(COPY_CHUNK_BYTES)).unwrap_or(0);
        let part = buffer.get_mut(..chunk).unwrap_or_default();
        storage.read_at(from, offset, part)?;
        file.append(part)?;
        offset += chunk as u64;
    }
    file.sync()?;
    copied.files_copied += 1;
    copied.bytes_copied += len;
    Ok(())
}

/// Writes `manifest` into `dir` and fsyncs the directory: the copy is complete.
pub(crate) fn finish(storage: &dyn Storage, dir: &Path, manifest: &Manifest) -> Result<()> {
    manifest.store(storage, dir)
}
