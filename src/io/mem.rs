//! An in-memory [`Storage`] that models what survives a power loss.
//!
//! Each file keeps its bytes as last synced; each directory keeps its entries as last
//! synced. [`MemStorage::power_loss`] rolls everything back to that synced state: unsynced
//! appends vanish, files created or renamed without a directory sync disappear, and files
//! removed without one come back. [`MemStorage::torn_power_loss`] does the same to
//! directories but tears each file's unsynced appends the way a disk may: it keeps a
//! prefix of them, zero-fills a range inside what it keeps, or keeps later pages while
//! dropping (zeroing) earlier ones.

#![expect(
    clippy::cast_possible_truncation,
    reason = "a simulated disk in memory: lengths fit usize"
)]
#![expect(
    clippy::expect_used,
    reason = "a simulated disk: a missing file id is a bug in the double"
)]
#![expect(
    clippy::indexing_slicing,
    reason = "a simulated disk: ids and offsets come from its own maps"
)]

use std::any::Any;
use std::collections::{BTreeMap, BTreeSet};
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use parking_lot::Mutex;

use super::{SplitMix64, Storage, StorageFile};

#[derive(Debug, Clone, Default)]
struct FileData {
    /// Bytes as the running process sees them.
    current: Vec<u8>,
    /// Bytes as of the last sync.
    synced: Vec<u8>,
}

/// A file identity: renames move the identity between names.
type FileId = u64;

#[derive(Debug, Default)]
struct Disk {
    files: BTreeMap<FileId, FileData>,
    /// Names as the running process sees them.
    names: BTreeMap<PathBuf, FileId>,
    /// Names as of the last directory sync of their directory.
    synced_names: BTreeMap<PathBuf, FileId>,
    dirs: BTreeSet<PathBuf>,
    /// Directories whose entry a sync of their parent made durable; a power loss
    /// forgets the others, with every file inside them.
    synced_dirs: BTreeSet<PathBuf>,
    locks: BTreeSet<PathBuf>,
    next_id: FileId,
    /// Simulated crashes so far: a handle made before the latest belongs to a dead
    /// process, and its changes fail.
    crashes: u64,
}

impl Disk {
    fn file_mut(&mut self, path: &Path) -> io::Result<&mut FileData> {
        let id = *self.names.get(path).ok_or(io::ErrorKind::NotFound)?;
        Ok(self.files.get_mut(&id).expect("named files exist"))
    }
}

/// What a power loss leaves of the directory tree: synced names, in directories whose
/// own entries were synced (a directory no sync made durable vanishes with its files).
/// The root and directories the disk never created always stay.
fn forget_unsynced_entries(disk: &mut Disk) {
    let durable = |dir: &Path, disk: &Disk| {
        dir.ancestors()
            .filter(|a| a.parent().is_some() && disk.dirs.contains(*a))
            .all(|a| disk.synced_dirs.contains(a))
    };
    let dirs: BTreeSet<PathBuf> = disk
        .dirs
        .iter()
        .filter(|dir| durable(dir, disk))
        .cloned()
        .collect();
    let names = disk
        .synced_names
        .iter()
        .filter(|(path, _)| durable(parent(path), disk))
        .map(|(path, &id)| (path.clone(), id))
        .collect();
    disk.dirs = dirs;
    disk.names = names;
    disk.synced_names = disk.names.clone();
}

/// A simulated disk. Clones share it.
///
/// A clone belongs to the process that made it: after a simulated crash (or power loss),
/// every change made through a clone (or a file or lock) from before it fails, as the
/// threads of a dead process do nothing more. The handle the crash was simulated through
/// stays usable, as does every clone made after it.
#[derive(Debug, Default)]
pub struct MemStorage {
    disk: Arc<Mutex<Disk>>,
    /// The crash count when this handle was made.
    born: AtomicU64,
}

impl Clone for MemStorage {
    fn clone(&self) -> Self {
        MemStorage {
            disk: Arc::clone(&self.disk),
            born: AtomicU64::new(self.disk.lock().crashes),
        }
    }
}

/// The error of a change made by a process that has crashed.
fn dead_process() -> io::Error {
    io::Error::other("the simulated process that made this handle has crashed")
}

/// Fails unless `born` is the disk's current crash count.
fn alive(disk: &Disk, born: u64) -> io::Result<()> {
    if disk.crashes == born {
        Ok(())
    } else {
        Err(dead_process())
    }
}

impl MemStorage {
    /// An empty disk.
    pub fn new() -> Self {
        MemStorage::default()
    }

    /// Simulates a power loss: every file and directory returns to its last synced
    /// state. Locks are released (the process died).
    pub fn power_loss(&self) {
        let mut disk = self.crash();
        forget_unsynced_entries(&mut disk);
        let live: BTreeSet<FileId> = disk.names.values().copied().collect();
        disk.files.retain(|id, _| live.contains(id));
        for file in disk.files.values_mut() {
            file.current = file.synced.clone();
        }
        disk.locks.clear();
    }

    /// Simulates a power loss that tears unsynced appends; `seed` picks how, per file:
    /// - drop them all (as [`MemStorage::power_loss`]);
    /// - keep a prefix of them, cut anywhere;
    /// - keep a prefix, with a range inside it reading as zeros;
    /// - keep some 4 KiB pages (by file offset) and not others: pages not kept read as
    ///   zeros when a later page was kept, and the file ends after the last kept page.
    ///
    /// Bytes that were synced are never changed. Directory entries roll back as in
    /// [`MemStorage::power_loss`].
    pub fn torn_power_loss(&self, seed: u64) {
        let mut disk = self.crash();
        forget_unsynced_entries(&mut disk);
        let live: BTreeSet<FileId> = disk.names.values().copied().collect();
        disk.files.retain(|id, _| live.contains(id));
        let mut random = SplitMix64::new(seed);
        for file in disk.files.values_mut() {
            let torn = tear(&file.synced, &file.current, &mut random);
            file.current = torn.clone();
            file.synced = torn;
        }
        disk.locks.clear();
    }

    /// Simulates a process crash: all writes survive (the page cache is the kernel's),
    /// only the locks are released.
    pub fn process_crash(&self) {
        self.crash().locks.clear();
    }

    /// Counts a crash: handles from before it are dead, except this one.
    fn crash(&self) -> parking_lot::MutexGuard<'_, Disk> {
        let mut disk = self.disk.lock();
        disk.crashes += 1;
        self.born.store(disk.crashes, Ordering::Relaxed);
        disk
    }

    fn lock_alive(&self) -> io::Result<parking_lot::MutexGuard<'_, Disk>> {
        let disk = self.disk.lock();
        alive(&disk, self.born.load(Ordering::Relaxed))?;
        Ok(disk)
    }

    /// The bytes of `path` that a power loss would keep (its last fsync), for tests that
    /// check what is durable.
    pub fn synced(&self, path: &Path) -> Option<Vec<u8>> {
        let disk = self.disk.lock();
        let id = disk.names.get(path)?;
        Some(disk.files.get(id)?.synced.clone())
    }

    /// The current bytes of `path`, for tests that damage files.
    pub fn contents(&self, path: &Path) -> Option<Vec<u8>> {
        let disk = self.disk.lock();
        let id = disk.names.get(path)?;
        Some(disk.files[id].current.clone())
    }

    /// Replaces the bytes of `path` (creating it if missing) as if written and synced,
    /// directory entry included.
    pub fn set_contents(&self, path: &Path, bytes: Vec<u8>) {
        let mut disk = self.disk.lock();
        let id = match disk.names.get(path) {
            Some(&id) => id,
            None => {
                disk.next_id += 1;
                let id = disk.next_id;
                disk.names.insert(path.to_path_buf(), id);
                id
            }
        };
        disk.synced_names.insert(path.to_path_buf(), id);
        disk.files.insert(
            id,
            FileData {
                current: bytes.clone(),
                synced: bytes,
            },
        );
    }
}

const PAGE: usize = 4096;

/// What a power loss leaves of a file whose synced bytes are `synced` and whose bytes
/// before the loss were `current`.
fn tear(synced: &[u8], current: &[u8], random: &mut SplitMix64) -> Vec<u8> {
    let Some(unsynced) = current.strip_prefix(synced).filter(|rest| !rest.is_empty()) else {
        // Nothing appended since the sync (or a truncation not yet synced): the synced
        // bytes are what the disk has.
        return synced.to_vec();
    };
    let mut out = synced.to_vec();
    match random.next_u64() % 4 {
        0 => {}
        1 => out.extend_from_slice(&unsynced[..random.upto(unsynced.len())]),
        2 => {
            let keep = &unsynced[..random.upto(unsynced.len())];
            let zero_from = random.upto(keep.len());
            let zero_to = zero_from + random.upto(keep.len() - zero_from);
            out.extend_from_slice(keep);
            out[synced.len() + zero_from..synced.len() + zero_to].fill(0);
        }
        _ => {
            // Pages by file offset: the first unsynced page may share a page with
            // synced bytes; only its unsynced part can be lost.
            let mut kept_end = synced.len();
            let mut at = synced.len();
            out.resize(current.len(), 0);
            while at < current.len() {
                let page_end = ((at / PAGE) + 1) * PAGE;
                let end = page_end.min(current.len());
                if random.next_u64().is_multiple_of(2) {
                    out[at..end].copy_from_slice(&current[at..end]);
                    kept_end = end;
                }
                at = end;
            }
            out.truncate(kept_end);
        }
    }
    out
}

struct MemFile {
    disk: Arc<Mutex<Disk>>,
    id: FileId,
    born: u64,
}

impl MemFile {
    fn with<T>(&self, f: impl FnOnce(&mut FileData) -> T) -> io::Result<T> {
        let mut disk = self.disk.lock();
        alive(&disk, self.born)?;
        let file = disk
            .files
            .get_mut(&self.id)
            .ok_or(io::ErrorKind::NotFound)?;
        Ok(f(file))
    }
}

impl StorageFile for MemFile {
    fn append(&mut self, data: &[u8]) -> io::Result<()> {
        self.with(|file| file.current.extend_from_slice(data))
    }

    fn sync(&mut self) -> io::Result<()> {
        self.with(|file| file.synced = file.current.clone())
    }

    fn len(&self) -> io::Result<u64> {
        self.with(|file| file.current.len() as u64)
    }

    fn truncate(&mut self, len: u64) -> io::Result<()> {
        self.with(|file| file.current.truncate(len as usize))
    }
}

fn parent(path: &Path) -> &Path {
    path.parent().unwrap_or(Path::new(""))
}

impl Storage for MemStorage {
    fn create_dir_all(&self, dir: &Path) -> io::Result<()> {
        let mut disk = self.lock_alive()?;
        for ancestor in dir.ancestors().filter(|a| !a.as_os_str().is_empty()) {
            disk.dirs.insert(ancestor.to_path_buf());
        }
        Ok(())
    }

    fn list(&self, dir: &Path) -> io::Result<Vec<PathBuf>> {
        let disk = self.disk.lock();
        if !disk.dirs.contains(dir) {
            return Err(io::ErrorKind::NotFound.into());
        }
        Ok(disk
            .names
            .keys()
            .filter(|path| parent(path) == dir)
            .cloned()
            .collect())
    }

    fn open_append(&self, path: &Path, create: bool) -> io::Result<Box<dyn StorageFile>> {
        let mut disk = self.lock_alive()?;
        let id = match disk.names.get(path) {
            Some(_) if create => return Err(io::ErrorKind::AlreadyExists.into()),
            Some(&id) => id,
            None if create => {
                if !disk.dirs.contains(parent(path)) {
                    return Err(io::ErrorKind::NotFound.into());
                }
                disk.next_id += 1;
                let id = disk.next_id;
                disk.files.insert(id, FileData::default());
                disk.names.insert(path.to_path_buf(), id);
                id
            }
            None => return Err(io::ErrorKind::NotFound.into()),
        };
        Ok(Box::new(MemFile {
            disk: Arc::clone(&self.disk),
            id,
            born: disk.crashes,
        }))
    }

    fn read(&self, path: &Path, max_bytes: u64) -> io::Result<Vec<u8>> {
        let mut disk = self.disk.lock();
        let file = disk.file_mut(path)?;
        if file.current.len() as u64 > max_bytes {
            return Err(io::ErrorKind::InvalidData.into());
        }
        Ok(file.current.clone())
    }

    fn file_len(&self, path: &Path) -> io::Result<u64> {
        Ok(self.disk.lock().file_mut(path)?.current.len() as u64)
    }

    fn read_at(&self, path: &Path, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        let mut disk = self.disk.lock();
        let file = disk.file_mut(path)?;
        let start = usize::try_from(offset).map_err(|_| io::ErrorKind::UnexpectedEof)?;
        let bytes = file
            .current
            .get(start..start.saturating_add(buf.len()))
            .ok_or(io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(bytes);
        Ok(())
    }

    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        let mut disk = self.lock_alive()?;
        let id = disk.names.remove(from).ok_or(io::ErrorKind::NotFound)?;
        disk.names.insert(to.to_path_buf(), id);
        Ok(())
    }

    fn remove(&self, path: &Path) -> io::Result<()> {
        let mut disk = self.lock_alive()?;
        disk.names.remove(path).ok_or(io::ErrorKind::NotFound)?;
        Ok(())
    }

    fn sync_dir(&self, dir: &Path) -> io::Result<()> {
        let mut disk = self.lock_alive()?;
        let disk = &mut *disk;
        disk.synced_names.retain(|path, _| parent(path) != dir);
        for (path, &id) in &disk.names {
            if parent(path) == dir {
                disk.synced_names.insert(path.clone(), id);
            }
        }
        let children: Vec<PathBuf> = disk
            .dirs
            .iter()
            .filter(|child| parent(child) == dir)
            .cloned()
            .collect();
        disk.synced_dirs.extend(children);
        Ok(())
    }

    fn lock(&self, path: &Path) -> io::Result<Box<dyn Any + Send + Sync>> {
        let mut disk = self.lock_alive()?;
        if !disk.locks.insert(path.to_path_buf()) {
            return Err(io::ErrorKind::WouldBlock.into());
        }
        Ok(Box::new(MemLock {
            disk: Arc::clone(&self.disk),
            path: path.to_path_buf(),
            born: disk.crashes,
        }))
    }
}

struct MemLock {
    disk: Arc<Mutex<Disk>>,
    path: PathBuf,
    born: u64,
}

impl Drop for MemLock {
    fn drop(&mut self) {
        // A dead process's lock went with it; the path may be another process's now.
        let mut disk = self.disk.lock();
        if disk.crashes == self.born {
            disk.locks.remove(&self.path);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_from_before_a_crash_change_nothing() {
        let disk = MemStorage::new();
        let dir = Path::new("/db");
        disk.create_dir_all(dir).unwrap();
        let before = disk.clone();
        let mut file = before.open_append(&dir.join("a"), true).unwrap();
        file.append(b"kept").unwrap();
        let lock = before.lock(&dir.join("LOCK")).unwrap();
        disk.process_crash();
        assert!(file.append(b"late").is_err());
        assert!(before.open_append(&dir.join("b"), true).is_err());
        assert!(before.remove(&dir.join("a")).is_err());
        let after = disk.clone();
        let _new_lock = after.lock(&dir.join("LOCK")).unwrap();
        // The dead process's lock guard must not release the new holder's lock.
        drop(lock);
        assert!(after.lock(&dir.join("LOCK")).is_err());
        assert_eq!(disk.contents(&dir.join("a")).unwrap(), b"kept");
        after.open_append(&dir.join("b"), true).unwrap();
    }

    /// Creating refuses an existing file, as `O_EXCL` does, so a new segment never
    /// lands on top of an old one (a second header appended to it).
    #[test]
    fn create_refuses_an_existing_file() {
        for storage in [
            &MemStorage::new() as &dyn Storage,
            &crate::io::StdStorage as &dyn Storage,
        ] {
            let temp = std::env::temp_dir().join(format!("oncedb-excl-{}", std::process::id()));
            storage.create_dir_all(&temp).unwrap();
            let path = temp.join("seg");
            storage
                .open_append(&path, true)
                .unwrap()
                .append(b"h")
                .unwrap();
            let again = storage.open_append(&path, true).err().map(|err| err.kind());
            assert_eq!(again, Some(io::ErrorKind::AlreadyExists));
            storage.open_append(&path, false).unwrap();
            storage.remove(&path).unwrap();
            let _ = std::fs::remove_dir(&temp);
        }
    }

    /// A directory is durable only once its parent was synced after its creation; a
    /// power loss before that takes it and every file inside it, however well synced.
    #[test]
    fn a_new_directory_needs_its_parent_synced() {
        let storage = MemStorage::new();
        let dir = Path::new("/var/db");
        storage.create_dir_all(dir).unwrap();
        let file = dir.join("MANIFEST");
        storage.open_append(&file, true).unwrap().sync().unwrap();
        storage.sync_dir(dir).unwrap();
        storage.power_loss();
        assert!(storage.contents(&file).is_none());
        assert!(storage.list(dir).is_err(), "the directory itself is gone");
        storage.create_dir_all(dir).unwrap();
        storage.open_append(&file, true).unwrap().sync().unwrap();
        storage.sync_dir(dir).unwrap();
        storage.sync_dir(Path::new("/var")).unwrap();
        storage.sync_dir(Path::new("/")).unwrap();
        storage.power_loss();
        assert!(storage.contents(&file).is_some());
    }

    #[test]
    fn power_loss_keeps_only_synced_state() {
        let storage = MemStorage::new();
        let dir = Path::new("/db");
        storage.create_dir_all(dir).unwrap();
        storage.sync_dir(Path::new("/")).unwrap();
        let a = dir.join("a");
        let mut file = storage.open_append(&a, true).unwrap();
        file.append(b"synced").unwrap();
        file.sync().unwrap();
        storage.sync_dir(dir).unwrap();
        file.append(b"-lost").unwrap();
        let b = dir.join("b");
        storage.open_append(&b, true).unwrap().sync().unwrap();
        storage.power_loss();
        assert_eq!(storage.contents(&a).unwrap(), b"synced");
        assert!(
            storage.contents(&b).is_none(),
            "b's directory entry was never synced"
        );
    }

    #[test]
    fn torn_power_loss_keeps_synced_bytes_and_tears_the_rest() {
        let dir = Path::new("/db");
        let mut shapes = BTreeSet::new();
        for seed in 0..64 {
            let storage = MemStorage::new();
            storage.create_dir_all(dir).unwrap();
            storage.sync_dir(Path::new("/")).unwrap();
            let a = dir.join("a");
            let mut file = storage.open_append(&a, true).unwrap();
            file.append(&[1; 5000]).unwrap();
            file.sync().unwrap();
            storage.sync_dir(dir).unwrap();
            file.append(&[2; 10_000]).unwrap();
            storage.torn_power_loss(seed);
            let after = storage.contents(&a).unwrap();
            assert!(after.len() >= 5000 && after.len() <= 15_000);
            assert_eq!(&after[..5000], &[1; 5000][..], "synced bytes never change");
            assert!(after[5000..].iter().all(|&b| b == 0 || b == 2));
            let zeros_then_data = after[5000..]
                .iter()
                .position(|&b| b == 2)
                .is_some_and(|first| {
                    after[5000..first + 5000].iter().all(|&b| b == 0) && first > 0
                });
            shapes.insert((after.len() == 5000, after.len() == 15_000, zeros_then_data));
        }
        assert!(shapes.len() >= 3, "tears of several shapes: {shapes:?}");
    }

    #[test]
    fn unsynced_remove_is_undone() {
        let storage = MemStorage::new();
        let dir = Path::new("/db");
        storage.create_dir_all(dir).unwrap();
        storage.sync_dir(Path::new("/")).unwrap();
        let a = dir.join("a");
        storage.open_append(&a, true).unwrap().sync().unwrap();
        storage.sync_dir(dir).unwrap();
        storage.remove(&a).unwrap();
        storage.power_loss();
        assert!(storage.contents(&a).is_some());
    }
}
