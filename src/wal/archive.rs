//! The archive: where expired segments go instead of being unlinked, when the store has
//! an archive directory (`Options::archive_dir`), for audit trails that must outlive
//! the window.
//!
//! An archive holds segment files under their log names (moved by one rename each, so
//! the archive must be on the store's file system), a copy of the store's manifest (whose
//! secret keys the frame checksums, so `verify` and `inspect` read the archive as they
//! read a store), and an empty `ARCHIVE` marker, which `Db::open` refuses: opening an
//! archive as a store would expire every segment in it.
//!
//! Order on disk when a segment expires: rename into the archive, fsync the archive
//! directory, fsync the store directory. A crash before the store directory's fsync may
//! leave the segment's name in the store directory too (on a file system that does not
//! journal renames), where the next open or roll-over moves it again, over the archived
//! copy of the same file; it is never lost.

use std::path::Path;

use super::manifest::Manifest;
use super::names::segment_file_name;
use crate::base::{Error, Result};
use crate::io::Storage;

/// Name of the marker file that makes a directory an archive.
pub(crate) const ARCHIVE_MARKER: &str = "ARCHIVE";
/// A file renamed from the store into the archive at open, to find out early that the
/// two are on one file system.
const PROBE_NAME: &str = "ARCHIVE.probe";

/// Whether `dir` is an archive (it holds the marker).
pub(crate) fn is_archive(storage: &dyn Storage, dir: &Path) -> Result<bool> {
    match storage.list(dir) {
        Ok(files) => Ok(files.contains(&dir.join(ARCHIVE_MARKER))),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(false),
        Err(err) => Err(err.into()),
    }
}

/// Makes `archive` ready for the segments of the store in `dir` with `manifest`: the
/// directory, its marker and a copy of the manifest, each durable. An archive of another
/// database, or one on another file system, is refused with `InvalidOptions`.
pub(crate) fn prepare(
    storage: &dyn Storage,
    dir: &Path,
    archive: &Path,
    manifest: &Manifest,
) -> Result<()> {
    let invalid =
        |why: String| Error::InvalidOptions(format!("archive_dir {}: {why}", archive.display()));
    if archive == dir {
        return Err(invalid("is the store's own directory".into()));
    }
    create_dir_durably(storage, archive)?;
    match Manifest::load(storage, archive)? {
        Some(kept) if kept.database_id() != manifest.database_id() => {
            return Err(invalid("holds the segments of another store".into()));
        }
        Some(_) => {}
        None => manifest.store(storage, archive)?,
    }
    let files = storage.list(archive)?;
    if !files.contains(&archive.join(ARCHIVE_MARKER)) {
        let mut marker = storage.open_append(&archive.join(ARCHIVE_MARKER), true)?;
        marker.sync()?;
        drop(marker);
        storage.sync_dir(archive)?;
    }
    let probe = dir.join(PROBE_NAME);
    if storage.list(dir)?.contains(&probe) {
        storage.remove(&probe)?;
    }
    drop(storage.open_append(&probe, true)?);
    let moved = archive.join(PROBE_NAME);
    if let Err(err) = storage.rename(&probe, &moved) {
        let _ = storage.remove(&probe);
        return Err(invalid(format!(
            "cannot take segments by rename (it must be on the store's file system): {err}"
        )));
    }
    storage.remove(&moved)?;
    Ok(())
}

/// Retires the expired segments `expired` of `dir`: moved into `archive` if there is one,
/// else unlinked; then the directories are made durable with `sync_dir` (the archive's
/// first).
pub(crate) fn retire(
    storage: &dyn Storage,
    dir: &Path,
    archive: Option<&Path>,
    expired: &[(u64, u32)],
    sync_dir: &mut dyn FnMut(&Path) -> std::io::Result<()>,
) -> std::io::Result<()> {
    let names: Vec<String> = expired
        .iter()
        .map(|&(bucket, seq)| segment_file_name(bucket, seq))
        .collect();
    retire_names(storage, dir, archive, &names, sync_dir)
}

/// As [`retire`], for whole files of `dir` named by path (sealed runs).
pub(crate) fn retire_files(
    storage: &dyn Storage,
    dir: &Path,
    archive: Option<&Path>,
    expired: &[std::path::PathBuf],
) -> Result<()> {
    let names: Vec<String> = expired
        .iter()
        .filter_map(|path| path.file_name()?.to_str().map(str::to_owned))
        .collect();
    retire_names(storage, dir, archive, &names, &mut |d| storage.sync_dir(d))?;
    Ok(())
}

fn retire_names(
    storage: &dyn Storage,
    dir: &Path,
    archive: Option<&Path>,
    names: &[String],
    sync_dir: &mut dyn FnMut(&Path) -> std::io::Result<()>,
) -> std::io::Result<()> {
    if names.is_empty() {
        return Ok(());
    }
    for name in names {
        match archive {
            Some(archive) => storage.rename(&dir.join(name), &archive.join(name))?,
            None => storage.remove(&dir.join(name))?,
        }
    }
    if let Some(archive) = archive {
        sync_dir(archive)?;
    }
    sync_dir(dir)
}

/// Creates `dir` and its missing parents so that a power loss cannot take them: each new
/// directory's entry is fsynced in its parent, top down. An existing `dir` costs one
/// listing and no fsync.
pub(crate) fn create_dir_durably(storage: &dyn Storage, dir: &std::path::Path) -> Result<()> {
    let missing: Vec<&std::path::Path> = dir
        .ancestors()
        .take_while(|at| at.parent().is_some() && storage.list(at).is_err())
        .collect();
    storage.create_dir_all(dir)?;
    for created in missing.iter().rev() {
        if let Some(parent) = created.parent().filter(|p| !p.as_os_str().is_empty()) {
            storage.sync_dir(parent)?;
        }
    }
    Ok(())
}
