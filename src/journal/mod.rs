//! The journal writer: appends log entries to the active segment with group commit, rolls
//! segments over per bucket and size, and deletes the segments of expired buckets.

use std::any::Any;
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use parking_lot::{Condvar, Mutex, MutexGuard};

use crate::error::{Error, Result};
use crate::index::window::Window;
use crate::io::{Storage, StorageFile};
use crate::options::Durability;
pub(crate) use crate::segment::entry::LogEntry;
use crate::segment::format::SegmentHeader;
use crate::segment::segment_path;
use crate::stats::Stats;

/// In `Interval` mode, a writer that finds this much buffered writes it out itself.
const INTERVAL_BUFFER_BYTES: usize = 1 << 20;

/// What recovery hands to the writer.
pub(crate) struct JournalConfig {
    pub(crate) storage: Arc<dyn Storage>,
    pub(crate) dir: PathBuf,
    pub(crate) durability: Durability,
    pub(crate) window: Window,
    pub(crate) database_id: u64,
    pub(crate) segment_max_bytes: u64,
    /// Segments on disk after recovery, as (bucket, seq).
    pub(crate) segments: BTreeSet<(u64, u32)>,
    pub(crate) lock: Box<dyn Any + Send + Sync>,
    pub(crate) recovered_records: u64,
    pub(crate) recovered_truncated_bytes: u64,
    pub(crate) segments_deleted: u64,
}

struct Active {
    bucket: u64,
    /// Taken by the group-commit leader while it writes outside the lock.
    file: Option<Box<dyn StorageFile>>,
    len: u64,
}

struct WriterState {
    buffer: Vec<u8>,
    /// Log positions (bytes since open): appended to the buffer, written, synced.
    appended: u64,
    written: u64,
    synced: u64,
    leader: bool,
    active: Option<Active>,
    segments: BTreeSet<(u64, u32)>,
}

struct Shared {
    state: Mutex<WriterState>,
    changed: Condvar,
    /// Wakes the interval flusher for shutdown.
    flusher_wake: Condvar,
    poisoned: AtomicBool,
    shutdown: AtomicBool,
    storage: Arc<dyn Storage>,
    dir: PathBuf,
    durability: Durability,
    window: Window,
    database_id: u64,
    segment_max_bytes: u64,
    fsyncs: AtomicU64,
    records: AtomicU64,
    bytes: AtomicU64,
    segments_deleted: AtomicU64,
    recovered_records: u64,
    recovered_truncated_bytes: u64,
}

/// The append side of a durable store.
pub(crate) struct Journal {
    shared: Arc<Shared>,
    flusher: Option<JoinHandle<()>>,
    _lock: Box<dyn Any + Send + Sync>,
}

impl Journal {
    pub(crate) fn new(config: JournalConfig) -> Result<Journal> {
        let shared = Arc::new(Shared {
            state: Mutex::new(WriterState {
                buffer: Vec::new(),
                appended: 0,
                written: 0,
                synced: 0,
                leader: false,
                active: None,
                segments: config.segments,
            }),
            changed: Condvar::new(),
            flusher_wake: Condvar::new(),
            poisoned: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            storage: config.storage,
            dir: config.dir,
            durability: config.durability,
            window: config.window,
            database_id: config.database_id,
            segment_max_bytes: config.segment_max_bytes,
            fsyncs: AtomicU64::new(0),
            records: AtomicU64::new(0),
            bytes: AtomicU64::new(0),
            segments_deleted: AtomicU64::new(config.segments_deleted),
            recovered_records: config.recovered_records,
            recovered_truncated_bytes: config.recovered_truncated_bytes,
        });
        let flusher = match config.durability {
            Durability::Interval(interval) => {
                let shared = Arc::clone(&shared);
                Some(
                    std::thread::Builder::new()
                        .name("oncedb-flusher".into())
                        .spawn(move || shared.run_flusher(interval))?,
                )
            }
            Durability::Buffered | Durability::Sync => None,
        };
        Ok(Journal {
            shared,
            flusher,
            _lock: config.lock,
        })
    }

    pub(crate) fn check_writable(&self) -> Result<()> {
        self.shared.check_writable()
    }

    /// Appends `entry`, stamped no earlier than `bucket`, and waits as the mode requires.
    pub(crate) fn append(&self, bucket: u64, entry: &LogEntry<'_>) -> Result<()> {
        let shared = &*self.shared;
        let mut state = shared.state.lock();
        shared.check_writable()?;
        shared.ensure_segment(&mut state, bucket)?;
        let before = state.buffer.len();
        entry.encode(&mut state.buffer);
        let added = (state.buffer.len() - before) as u64;
        state.appended += added;
        shared.records.fetch_add(1, Ordering::Relaxed);
        shared.bytes.fetch_add(added, Ordering::Relaxed);
        let target = state.appended;
        match shared.durability {
            Durability::Sync => shared.persist(&mut state, target, true),
            Durability::Buffered => shared.persist(&mut state, target, false),
            Durability::Interval(_) if state.buffer.len() >= INTERVAL_BUFFER_BYTES => {
                shared.persist(&mut state, target, false)
            }
            Durability::Interval(_) => Ok(()),
        }
    }

    /// Writes and fsyncs everything appended so far.
    pub(crate) fn flush(&self) -> Result<()> {
        let shared = &*self.shared;
        let mut state = shared.state.lock();
        shared.check_writable()?;
        let target = state.appended;
        shared.persist(&mut state, target, true)
    }

    pub(crate) fn add_stats(&self, stats: &mut Stats) {
        let shared = &*self.shared;
        stats.fsyncs = shared.fsyncs.load(Ordering::Relaxed);
        stats.log_records = shared.records.load(Ordering::Relaxed);
        stats.log_bytes = shared.bytes.load(Ordering::Relaxed);
        stats.recovered_records = shared.recovered_records;
        stats.recovered_truncated_bytes = shared.recovered_truncated_bytes;
        stats.segments_deleted = shared.segments_deleted.load(Ordering::Relaxed);
    }
}

impl Drop for Journal {
    fn drop(&mut self) {
        self.shared.shutdown.store(true, Ordering::Release);
        {
            let _state = self.shared.state.lock();
            self.shared.flusher_wake.notify_all();
        }
        if let Some(flusher) = self.flusher.take() {
            let _ = flusher.join();
        }
        // A clean close persists what is buffered; a failure has poisoned the store and
        // there is no caller left to tell.
        let _ = self.flush();
    }
}

impl Shared {
    fn check_writable(&self) -> Result<()> {
        if self.poisoned.load(Ordering::Acquire) {
            Err(Error::Poisoned)
        } else {
            Ok(())
        }
    }

    fn poison(&self, err: std::io::Error) -> Error {
        self.poisoned.store(true, Ordering::Release);
        self.changed.notify_all();
        Error::Io(err)
    }

    /// Waits until the log is written (and synced, if `sync`) up to `target`. The first
    /// waiter without a leader becomes one and writes everything buffered for all.
    fn persist(
        &self,
        state: &mut MutexGuard<'_, WriterState>,
        target: u64,
        sync: bool,
    ) -> Result<()> {
        loop {
            self.check_writable()?;
            let reached = if sync { state.synced } else { state.written };
            if reached >= target {
                return Ok(());
            }
            if state.leader {
                self.changed.wait(state);
                continue;
            }
            self.lead(state, sync)?;
        }
    }

    /// One group commit: write the buffer (and fsync) outside the lock.
    fn lead(&self, state: &mut MutexGuard<'_, WriterState>, sync: bool) -> Result<()> {
        let Some(active) = state.active.as_mut() else {
            return Ok(());
        };
        let mut file = active.file.take().expect("only the leader takes the file");
        state.leader = true;
        let data = std::mem::take(&mut state.buffer);
        let end = state.appended;
        let result = MutexGuard::unlocked(state, || {
            if !data.is_empty() {
                file.append(&data)?;
            }
            if sync {
                file.sync()?;
            }
            Ok(())
        });
        state.leader = false;
        let active = state
            .active
            .as_mut()
            .expect("active segment stays while leading");
        active.file = Some(file);
        self.changed.notify_all();
        if let Err(err) = result {
            return Err(self.poison(err));
        }
        active.len += data.len() as u64;
        state.written = end;
        if sync {
            state.synced = end;
            self.fsyncs.fetch_add(1, Ordering::Relaxed);
        }
        if state.buffer.is_empty() {
            let mut data = data;
            data.clear();
            state.buffer = data;
        }
        Ok(())
    }

    /// Rolls over to a new segment when `bucket` is past the active one or it is full.
    fn ensure_segment(&self, state: &mut MutexGuard<'_, WriterState>, bucket: u64) -> Result<()> {
        let needed = match &state.active {
            None => true,
            Some(active) => {
                bucket > active.bucket
                    || active.len + state.buffer.len() as u64 >= self.segment_max_bytes
            }
        };
        if !needed {
            return Ok(());
        }
        while state.leader {
            self.changed.wait(state);
        }
        self.check_writable()?;
        // Only the newest segment may have a torn tail: seal the old one first.
        if state.active.is_some() {
            let target = state.appended;
            self.persist(state, target, true)?;
        }
        let bucket = bucket.max(state.active.as_ref().map_or(0, |a| a.bucket));
        let seq = state
            .segments
            .range((bucket, 0)..=(bucket, u32::MAX))
            .next_back()
            .map_or(Some(0), |&(_, seq)| seq.checked_add(1))
            .ok_or_else(|| {
                self.poison(std::io::Error::other(
                    "segment sequence numbers of this bucket are exhausted",
                ))
            })?;
        let file = self
            .create_segment(bucket, seq)
            .map_err(|err| self.poison(err))?;
        state.segments.insert((bucket, seq));
        state.active = Some(Active {
            bucket,
            file: Some(file),
            len: crate::segment::format::SEGMENT_HEADER_LEN as u64,
        });
        self.delete_expired(state, bucket)
            .map_err(|err| self.poison(err))
    }

    fn create_segment(&self, bucket: u64, seq: u32) -> std::io::Result<Box<dyn StorageFile>> {
        let path = segment_path(&self.dir, bucket, seq);
        let mut file = self.storage.open_append(&path, true)?;
        let header = SegmentHeader {
            bucket,
            seq,
            database_id: self.database_id,
        };
        file.append(&header.encode())?;
        file.sync()?;
        self.storage.sync_dir(&self.dir)?;
        self.fsyncs.fetch_add(2, Ordering::Relaxed);
        Ok(file)
    }

    /// Unlinks the segments of buckets that have left the window, then syncs the
    /// directory once.
    fn delete_expired(&self, state: &mut WriterState, current: u64) -> std::io::Result<()> {
        let expired: Vec<(u64, u32)> = state
            .segments
            .iter()
            .copied()
            .take_while(|&(bucket, _)| !self.window.is_live(bucket, current))
            .collect();
        if expired.is_empty() {
            return Ok(());
        }
        for &(bucket, seq) in &expired {
            self.storage.remove(&segment_path(&self.dir, bucket, seq))?;
            state.segments.remove(&(bucket, seq));
            self.segments_deleted.fetch_add(1, Ordering::Relaxed);
        }
        self.storage.sync_dir(&self.dir)
    }

    fn run_flusher(&self, interval: Duration) {
        let mut state = self.state.lock();
        while !self.shutdown.load(Ordering::Acquire) {
            self.flusher_wake.wait_for(&mut state, interval);
            if self.poisoned.load(Ordering::Acquire) {
                return;
            }
            let target = state.appended;
            if state.synced < target {
                // An error has poisoned the store; writers report it.
                let _ = self.persist(&mut state, target, true);
            }
        }
    }
}
