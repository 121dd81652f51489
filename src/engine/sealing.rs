//! The memory budget (`Options::memory_budget`): when the dedup tables reach half of it,
//! every key in memory is sealed into an immutable run on disk and the tables start
//! empty. `docs/design.md` ("Sealed key runs") gives the argument; in short:
//!
//! 1. Read the log position `covers` (the end of everything appended so far).
//! 2. Freeze every shard's table (a fresh one takes the writes; the frozen one still
//!    answers lookups). Each key logged before `covers` was inserted into memory before
//!    its entry was appended, so before its shard froze: it is in a frozen table.
//! 3. Write the run from the frozen tables, fsync, rename, fsync the directory.
//! 4. Publish the run to lookups, then drop the frozen tables.
//!
//! Steps 1 and 2 run on the writer whose check found the tables over the threshold;
//! steps 3 and 4 (and any merge the new run makes due) run on a thread of their own,
//! `oncedb-sealer`, while writers go on. One seal runs at a time. The frozen tables go
//! at the first look after the run is published, even if merges follow. A writer that
//! finds the tables at the bound waits until a step of the task frees memory: the bound
//! is the whole budget while the run is written (the frozen tables count), and half of
//! it while a merge runs (whose filters, old and new, are held together meanwhile).
//!
//! Recovery opens the runs and skips the keys entries logged before the newest run's
//! `covers`; a crash before step 3 ends leaves a temporary file that open removes, and the
//! log still holds every key.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use std::thread::JoinHandle;

use parking_lot::{Condvar, Mutex, RwLock};

use super::Engine;

use crate::base::{Error, Fingerprint, Liveness, Result, SettledRecord, Window};
use crate::index::{DedupTable, Index, Sealable, SealedKeys, SealedRecords};
use crate::io::Storage;
use crate::wal::{
    LogPosition, Run, RunKind, RunSummary, RunWriter, SealHandle, is_temp_run_name, open_run,
    parse_run_name, retire_files,
};

/// The smallest tables worth a seal.
const MIN_SEAL_BYTES: u64 = 1 << 15;

/// Admitted keys between two looks at the tables' size.
const CHECK_EVERY_KEYS: u64 = 4096;

/// Runs of one level merged into one run of the next: with `F` of them, a key is probed
/// against at most `F - 1` runs per level, and a level holds `F` times its predecessor's
/// keys, so the runs a key is probed against grow with the logarithm of the sealed keys.
const MERGE_FANOUT: usize = 4;

/// Run ids a seal task may take (its run, and the merges it makes due: at most one per
/// level) before the run floor must rise again.
const RUN_ID_SLACK: u64 = 64;

/// How far a raise of the run floor reaches past the next id: one manifest rewrite per
/// this many runs.
const RUN_FLOOR_STEP: u64 = 1024;

/// The working memory a seal or a merge holds per key of the one section it writes at a
/// time: its entries as (tag, bucket), 16 bytes, then the filter's construction, about
/// 25 more (a merge holds its inputs' entries and the merged ones, 32 bytes, before it
/// drops the inputs and builds the filter).
const WORK_BYTES_PER_KEY: u64 = 41;

/// The working memory a seal or a merge of record runs holds per record of the section it
/// writes: the records read (a fingerprint and a settled record), then as many merged,
/// then the filter's construction.
const WORK_BYTES_PER_RECORD: u64 = 2 * size_of::<(u128, SettledRecord)>() as u64 + 25;

/// How long a merge of merged runs may still keep a waiting writer before it gives way,
/// in nanoseconds: half a second.
const MERGE_WAIT_LIMIT_NS: u64 = 500_000_000;

/// A merge's pace before it has measured its own: about 60 ns a key (four runs of
/// 100 M keys took 24 s).
const MERGE_NS_PER_KEY: u64 = 60;

/// The working memory a merge may take whatever the budget (small budgets merge too).
const MIN_MERGE_WORK_BYTES: u64 = 4 << 20;

/// The sealed runs of a store with a memory budget, and what writing them needs: shared
/// by the store's writers and the thread that seals.
pub(crate) struct SealedRuns {
    storage: Arc<dyn Storage>,
    dir: PathBuf,
    archive: Option<PathBuf>,
    database_id: u64,
    budget_bytes: u64,
    /// Live key runs, oldest first.
    runs: RwLock<Vec<Arc<Run>>>,
    /// `runs.len()`, read on every lookup without the lock.
    live_runs: std::sync::atomic::AtomicUsize,
    /// Live record runs, oldest first.
    record_runs: RwLock<Vec<Arc<Run>>>,
    /// `record_runs.len()`, read on every lookup of a record memory does not hold.
    live_record_runs: std::sync::atomic::AtomicUsize,
    next_run_id: AtomicU64,
    /// The manifest's run floor: no id at or above it was handed out. Raised on the
    /// writer that starts a seal, before the task may reach it.
    run_floor: AtomicU64,
    /// The working memory of the seal or merge under way ([`WORK_BYTES_PER_KEY`]).
    work_bytes: AtomicU64,
    /// Writers waiting now at the bound for the task under way: a merge of merged runs
    /// gives way to them.
    waiting: AtomicU64,
    /// Merges abandoned since open because writers waited.
    yielded: AtomicU64,
    /// [`MERGE_WAIT_LIMIT_NS`] (a test sets 0).
    merge_wait_limit_ns: AtomicU64,
    /// Runs written, removed and merged since open.
    sealed: AtomicU64,
    expired: AtomicU64,
    merged: AtomicU64,
    /// Where the seal task under way is (one at a time).
    progress: Progress,
}

/// The steps of a seal task that change what memory it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Writing the run: the frozen tables are needed.
    Sealing,
    /// The run is published: the frozen tables may go.
    Published,
    /// A merge runs: its inputs' filters and its output's are held together.
    Merging,
    /// The task ended (or none was started): joining it does not wait.
    Ended,
}

/// The phase of the seal task under way, and a condition variable for writers waiting
/// at the bound for it to move.
struct Progress {
    phase: Mutex<Phase>,
    moved: Condvar,
}

impl Progress {
    fn get(&self) -> Phase {
        *self.phase.lock()
    }

    fn set(&self, phase: Phase) {
        *self.phase.lock() = phase;
        self.moved.notify_all();
    }

    /// Waits until the phase is no longer `seen`.
    fn wait_past(&self, seen: Phase) {
        let mut phase = self.phase.lock();
        while *phase == seen {
            self.moved.wait(&mut phase);
        }
    }
}

/// How far the store had come when it opened: the bounds of what its runs may claim.
pub(crate) struct Reached {
    pub(crate) window: Window,
    /// The newer of the clock's bucket and the newest segment's.
    pub(crate) bucket: u64,
    /// The newest segment on disk, as (bucket, seq).
    pub(crate) newest_segment: Option<(u64, u32)>,
}

impl Reached {
    /// Whether a run's footer stays within what the store reached. Its newest bucket
    /// leads the clock and the log by less than a window (keys a shard admitted in a new
    /// bucket and had not logged when it froze); the log position it covers names a
    /// segment no newer than the newest on disk (the segment a seal reads its position
    /// from is on disk before it is appended to; an older one may have expired). A run
    /// claiming more is damaged or forged: refused, rather than let it raise the store's
    /// time (retiring every segment) or skip keys the log holds. (An offset forged
    /// within the covered segment cannot be told from a crash that lost that segment's
    /// unwritten tail, whose keys the run holds.)
    fn admits(&self, run: &RunSummary) -> bool {
        let bucket_ok = run.newest_bucket <= self.bucket.saturating_add(self.window.span);
        let covers = (run.covers.bucket, run.covers.seq);
        bucket_ok && self.newest_segment.is_none_or(|newest| covers <= newest)
    }
}

/// Where the live runs' covers reach: replay skips what they hold.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Covered {
    /// Every keys entry before it is in a key run (or expired).
    pub(crate) keys: LogPosition,
    /// Every finish entry before it that settles its record ends a record that a record
    /// run holds (or that expired).
    pub(crate) records: LogPosition,
}

/// The memory budget's bookkeeping on the engine: the runs, when to look at the tables'
/// size, and the seal under way.
pub(crate) struct Sealer {
    runs: Arc<SealedRuns>,
    since_check: AtomicU64,
    /// The seal running on its own thread, if one was started and not yet joined: at
    /// most one. Held while one is started or joined, and while runs expire (so that
    /// no merge reads a run being removed).
    task: Mutex<Option<SealTask>>,
    /// Times a writer waited at the bound.
    waits: AtomicU64,
}

/// A seal (and the merges it made due) running on the `oncedb-sealer` thread.
struct SealTask {
    thread: JoinHandle<TaskEnd>,
    /// Whether the frozen tables were dropped (once the run was published).
    released: bool,
}

/// The seal task's hold on the runs: marks the task ended when dropped.
struct EndsTask(Arc<SealedRuns>);

impl std::ops::Deref for EndsTask {
    type Target = SealedRuns;

    fn deref(&self) -> &SealedRuns {
        &self.0
    }
}

impl Drop for EndsTask {
    fn drop(&mut self) {
        self.0.progress.set(Phase::Ended);
    }
}

/// How a seal task ended: whether its run was published (so that the frozen tables may
/// go), and the first error, if any (an I/O error has poisoned the store already).
struct TaskEnd {
    published: bool,
    result: Result<()>,
}

impl Drop for Sealer {
    /// A store closing waits for the seal under way: its run is whole when the close
    /// returns. (A crash instead leaves a temporary file that the next open removes.)
    fn drop(&mut self) {
        if let Some(task) = self.task.get_mut().take() {
            drop(task.thread.join());
        }
    }
}

impl SealedKeys for SealedRuns {
    fn is_empty(&self) -> bool {
        self.live_runs.load(Ordering::Acquire) == 0
    }

    fn contains(&self, fingerprint: Fingerprint, window: Window, current: u64) -> Result<bool> {
        for run in self.runs.read().iter().rev() {
            if run.contains(&*self.storage, fingerprint, window, current)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    fn retain_absent(
        &self,
        fingerprints: &[Fingerprint],
        pending: &mut Vec<u32>,
        window: Window,
        current: u64,
    ) -> Result<()> {
        for run in self.runs.read().iter().rev() {
            if pending.is_empty() {
                break;
            }
            run.retain_absent(&*self.storage, (fingerprints, pending), window, current)?;
        }
        Ok(())
    }
}

impl SealedRecords for SealedRuns {
    fn find(
        &self,
        fingerprint: Fingerprint,
        window: Window,
        current: u64,
    ) -> Result<Option<SettledRecord>> {
        if self.live_record_runs.load(Ordering::Acquire) == 0 {
            return Ok(None);
        }
        for run in self.record_runs.read().iter().rev() {
            if let Some(record) = run.find_record(&*self.storage, fingerprint, window, current)? {
                return Ok(Some(record));
            }
        }
        Ok(None)
    }
}

/// The live runs, held ([`SealedRuns::hold`]).
pub(crate) struct HeldRuns<'a> {
    keys: parking_lot::RwLockReadGuard<'a, Vec<Arc<Run>>>,
    records: parking_lot::RwLockReadGuard<'a, Vec<Arc<Run>>>,
}

impl HeldRuns<'_> {
    /// Every held run: the key runs, then the record runs.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &Arc<Run>> {
        self.keys.iter().chain(self.records.iter())
    }
}

/// What the sealer reports in `Stats`.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SealStats {
    pub(crate) runs: u64,
    pub(crate) sealed_keys: u64,
    pub(crate) record_runs: u64,
    pub(crate) sealed_records: u64,
    pub(crate) filter_bytes: u64,
    pub(crate) runs_written: u64,
    pub(crate) runs_expired: u64,
    pub(crate) runs_merged: u64,
    pub(crate) budget_waits: u64,
    pub(crate) budget_waiters: u64,
    pub(crate) work_bytes: u64,
    pub(crate) merges_yielded: u64,
}

impl Sealer {
    /// Whether admitting `keys` more keys may reach the next expiry and sealing check.
    #[cfg(feature = "async")]
    pub(crate) fn checks_within(&self, keys: u64) -> bool {
        self.since_check.load(Ordering::Relaxed) + keys >= CHECK_EVERY_KEYS
    }

    /// The sealer of the store in `dir`: its live runs opened (fences and filters only),
    /// expired ones retired, half-written ones removed. Also returns the log positions
    /// before which every keys entry is in a key run, and every ending that settled a
    /// record is in a record run ([`Covered`]). Run ids start at the manifest's
    /// `run_floor` (or past the newest run), so no name is ever given twice, even once
    /// every run has expired.
    pub(crate) fn open(
        storage: &Arc<dyn Storage>,
        dir: &Path,
        archive: Option<&Path>,
        (database_id, budget_bytes, run_floor): (u64, u64, u64),
        reached: Reached,
    ) -> Result<(Sealer, Covered)> {
        let (window, bucket) = (reached.window, reached.bucket);
        let (mut opened, mut next_run_id) = (Vec::new(), run_floor.max(1));
        for path in storage.list(dir)? {
            if is_temp_run_name(&path) {
                storage.remove(&path)?;
            } else if let Some((run_id, _)) = parse_run_name(&path) {
                next_run_id = next_run_id.max(run_id + 1);
                opened.push(Arc::new(open_run(&**storage, &path, database_id)?));
            }
        }
        opened.sort_by_key(|run| run.summary().run_id);
        if let Some(run) = opened.iter().find(|run| !reached.admits(run.summary())) {
            return Err(Error::Corrupted {
                path: run.path().to_path_buf(),
                offset: 0,
                reason: "the run holds a bucket or covers a log position the store never reached"
                    .to_owned(),
            });
        }
        let (runs, expired): (Vec<_>, Vec<_>) = remove_merged(&**storage, dir, opened)?
            .into_iter()
            .partition(|run| window.is_live(run.summary().newest_bucket, bucket));
        let expired: Vec<PathBuf> = expired.iter().map(|run| run.path().to_path_buf()).collect();
        retire_files(&**storage, dir, archive, &expired)?;
        let (runs, record_runs): (Vec<_>, Vec<_>) = runs
            .into_iter()
            .partition(|run| run.summary().kind == RunKind::Keys);
        let covers = |runs: &[Arc<Run>]| {
            runs.iter()
                .map(|run| run.summary().covers)
                .max()
                .unwrap_or_default()
        };
        let covered = Covered {
            keys: covers(&runs),
            records: covers(&record_runs),
        };
        let runs = SealedRuns {
            storage: Arc::clone(storage),
            dir: dir.to_path_buf(),
            archive: archive.map(Path::to_path_buf),
            database_id,
            budget_bytes,
            live_runs: std::sync::atomic::AtomicUsize::new(runs.len()),
            runs: RwLock::new(runs),
            live_record_runs: std::sync::atomic::AtomicUsize::new(record_runs.len()),
            record_runs: RwLock::new(record_runs),
            next_run_id: AtomicU64::new(next_run_id),
            run_floor: AtomicU64::new(run_floor),
            work_bytes: AtomicU64::new(0),
            waiting: AtomicU64::new(0),
            yielded: AtomicU64::new(0),
            merge_wait_limit_ns: AtomicU64::new(MERGE_WAIT_LIMIT_NS),
            sealed: AtomicU64::new(0),
            expired: AtomicU64::new(expired.len() as u64),
            merged: AtomicU64::new(0),
            progress: Progress {
                phase: Mutex::new(Phase::Ended),
                moved: Condvar::new(),
            },
        };
        let sealer = Sealer {
            runs: Arc::new(runs),
            since_check: AtomicU64::new(0),
            task: Mutex::new(None),
            waits: AtomicU64::new(0),
        };
        Ok((sealer, covered))
    }

    /// The runs, as lookups see them.
    pub(crate) fn runs(&self) -> &SealedRuns {
        &self.runs
    }

    /// The newest bucket any live run holds keys of.
    pub(crate) fn newest_bucket(&self) -> u64 {
        self.runs.newest_bucket()
    }

    pub(crate) fn stats(&self) -> SealStats {
        SealStats {
            budget_waits: self.waits.load(Ordering::Relaxed),
            budget_waiters: self.runs.waiting.load(Ordering::Relaxed),
            ..self.runs.stats()
        }
    }
}

impl SealedRuns {
    /// The live runs, key runs and record runs, held as they are: no run is published,
    /// merged away or expired until the guard drops (a merge removes its inputs only
    /// after it swapped them out under the write lock), so every run listed is on disk
    /// meanwhile.
    pub(crate) fn hold(&self) -> HeldRuns<'_> {
        HeldRuns {
            keys: self.runs.read(),
            records: self.record_runs.read(),
        }
    }

    /// The newest bucket any live run holds keys of.
    pub(crate) fn newest_bucket(&self) -> u64 {
        self.runs
            .read()
            .iter()
            .map(|run| run.summary().newest_bucket)
            .max()
            .unwrap_or(0)
    }

    pub(crate) fn stats(&self) -> SealStats {
        let runs = self.runs.read();
        let record_runs = self.record_runs.read();
        SealStats {
            runs: runs.len() as u64,
            sealed_keys: runs.iter().map(|run| run.summary().entries).sum(),
            record_runs: record_runs.len() as u64,
            sealed_records: record_runs.iter().map(|run| run.summary().entries).sum(),
            filter_bytes: runs
                .iter()
                .chain(record_runs.iter())
                .map(|run| run.heap_bytes() as u64)
                .sum(),
            runs_written: self.sealed.load(Ordering::Relaxed),
            runs_expired: self.expired.load(Ordering::Relaxed),
            runs_merged: self.merged.load(Ordering::Relaxed),
            work_bytes: self.work_bytes.load(Ordering::Relaxed),
            merges_yielded: self.yielded.load(Ordering::Relaxed),
            ..SealStats::default()
        }
    }

    /// The table bytes at which writers wait: the whole budget (twice the threshold)
    /// while a run is written, since the frozen tables count; the threshold while a merge
    /// runs, which holds filters of up to a quarter of the budget on top of the runs'.
    fn bound(&self) -> u64 {
        let threshold = self.threshold();
        match self.progress.get() {
            Phase::Merging => threshold,
            Phase::Sealing | Phase::Published | Phase::Ended => 2 * threshold,
        }
    }

    /// The table size that starts a seal: half of what the runs' filters leave of the
    /// budget (so that the frozen tables and the new ones fit together), but never
    /// below an eighth of the budget (nor [`MIN_SEAL_BYTES`]), so that filters
    /// outgrowing the budget do not turn every check into a seal of a few keys.
    fn threshold(&self) -> u64 {
        (self.budget_bytes.saturating_sub(self.filter_bytes()) / 2)
            .max(self.budget_bytes / 8)
            .max(MIN_SEAL_BYTES)
    }

    /// Memory the fences and filters of every live run take, key runs and record runs.
    fn filter_bytes(&self) -> u64 {
        let (runs, record_runs) = (self.runs.read(), self.record_runs.read());
        runs.iter()
            .chain(record_runs.iter())
            .map(|run| run.heap_bytes() as u64)
            .sum()
    }

    /// The bytes of records memory holds at which a record seal starts: a quarter of the
    /// budget (or [`MIN_SEAL_BYTES`]).
    fn record_threshold(&self) -> u64 {
        (self.budget_bytes / 4).max(MIN_SEAL_BYTES)
    }

    /// Removes (or archives) the runs whose newest bucket left the window at `current`.
    /// The caller makes sure no seal task runs (a merge may be reading them).
    fn expire(&self, window: Window, current: u64) -> Result<()> {
        self.expire_from((&self.runs, &self.live_runs), window, current)?;
        self.expire_from((&self.record_runs, &self.live_record_runs), window, current)
    }

    /// [`SealedRuns::expire`] for one list of runs and its count.
    fn expire_from(
        &self,
        (runs, count): (&RwLock<Vec<Arc<Run>>>, &std::sync::atomic::AtomicUsize),
        window: Window,
        current: u64,
    ) -> Result<()> {
        let live = |run: &Arc<Run>| window.is_live(run.summary().newest_bucket, current);
        if runs.read().iter().all(live) {
            return Ok(());
        }
        let expired: Vec<Arc<Run>> = {
            let mut runs = runs.write();
            let (live, expired) = std::mem::take(&mut *runs)
                .into_iter()
                .partition(|run| window.is_live(run.summary().newest_bucket, current));
            *runs = live;
            count.store(runs.len(), Ordering::Release);
            expired
        };
        if expired.is_empty() {
            return Ok(());
        }
        let paths: Vec<PathBuf> = expired.iter().map(|run| run.path().to_path_buf()).collect();
        retire_files(&*self.storage, &self.dir, self.archive.as_deref(), &paths)?;
        self.expired
            .fetch_add(expired.len() as u64, Ordering::Relaxed);
        Ok(())
    }
    /// The newest [`MERGE_FANOUT`] runs, oldest first, if they share a level and their
    /// shards, merging them keeps the oldest one's keys on disk at most a quarter of the
    /// window (`span` buckets) past its own expiry (a merged run leaves with its newest
    /// bucket), and their filters take at most a quarter of the budget (the memory a
    /// merge adds while it runs), or [`MIN_SEAL_BYTES`] for the smallest budgets.
    fn tail_to_merge(&self, span: u64, kind: RunKind) -> Option<Vec<Arc<Run>>> {
        let runs = self.list(kind).0.read();
        let tail = runs.get(runs.len().checked_sub(MERGE_FANOUT)?..)?;
        let (first, last) = (tail.first()?.summary(), tail.last()?.summary());
        let alike = tail.iter().all(|run| {
            run.summary().level == first.level && run.summary().shard_bits == first.shard_bits
        });
        let overhang = last.newest_bucket.saturating_sub(first.newest_bucket);
        // While a merge runs, its inputs' filters and the merged run's are both held.
        let filters: u64 = tail.iter().map(|run| run.heap_bytes() as u64).sum();
        // Its working memory is bounded too: a merge too large for a quarter of the
        // budget is not made (its runs stay, each probed by lookups).
        let work = merge_work_bytes(tail);
        let quarter = self.budget_bytes / 4;
        (alike
            && overhang <= span / 4
            && filters <= quarter.max(MIN_SEAL_BYTES)
            && work <= quarter.max(MIN_MERGE_WORK_BYTES))
        .then(|| tail.to_vec())
    }

    /// The live runs of `kind`, and their count.
    fn list(&self, kind: RunKind) -> (&RwLock<Vec<Arc<Run>>>, &std::sync::atomic::AtomicUsize) {
        match kind {
            RunKind::Keys => (&self.runs, &self.live_runs),
            RunKind::Records => (&self.record_runs, &self.live_record_runs),
        }
    }

    /// Merges the newest runs of `kind` while [`SealedRuns::tail_to_merge`] finds some
    /// (on the seal task's thread). A merge of key runs holds writers at the lower bound
    /// ([`SealedRuns::bound`]); one of record runs takes no memory from the tables.
    fn merge_tail(&self, span: u64, kind: RunKind) -> Result<()> {
        while let Some(inputs) = self.tail_to_merge(span, kind) {
            if kind == RunKind::Keys {
                self.progress.set(Phase::Merging);
            }
            self.work_bytes
                .store(merge_work_bytes(&inputs), Ordering::Relaxed);
            let merged = self.merge(&inputs);
            self.work_bytes.store(0, Ordering::Relaxed);
            self.progress.set(Phase::Published);
            if !merged? {
                // It gave way to writers: the next seal (and its merges) comes first.
                break;
            }
        }
        Ok(())
    }

    /// Merges `inputs` (the newest runs, oldest first) into one run of the next level,
    /// shard by shard (each tag once, with its newest bucket), in the order a seal uses:
    /// write, fsync, rename, fsync the directory; then publish it in their place; then
    /// remove them. A crash before the removal leaves runs the merged one replaces,
    /// which the next open removes. A merge of merged runs (level 1 and up: 16 seals'
    /// keys and more, long enough to hold writers for seconds) gives way to writers that
    /// wait at the bound: it abandons its file between shards and returns `false`, and
    /// is made again at a later seal (its runs stay meanwhile, each probed by lookups).
    fn merge(&self, inputs: &[Arc<Run>]) -> Result<bool> {
        let summaries = || inputs.iter().map(|run| run.summary());
        let (Some(first), Some(newest)) =
            (inputs.first(), summaries().map(|s| s.newest_bucket).max())
        else {
            return Ok(true);
        };
        let sections = first.section_count();
        let first = first.summary();
        let summary = RunSummary {
            database_id: self.database_id,
            run_id: self.next_run_id.fetch_add(1, Ordering::Relaxed),
            shard_bits: first.shard_bits,
            kind: first.kind,
            entries: 0,
            oldest_bucket: summaries().map(|s| s.oldest_bucket).min().unwrap_or(0),
            newest_bucket: newest,
            covers: summaries().map(|s| s.covers).max().unwrap_or_default(),
            level: first.level + 1,
            replaces_from: first.replaces_from,
        };
        let yields = summary.level > 1;
        let mut writer = RunWriter::create(&*self.storage, &self.dir, summary)?;
        if !self.write_merged(inputs, sections, &mut writer, yields)? {
            writer.abandon()?;
            self.yielded.fetch_add(1, Ordering::Relaxed);
            log::info!(
                "oncedb: a merge of {} runs gave way to waiting writers",
                inputs.len()
            );
            return Ok(false);
        }
        let merged = Arc::new(writer.finish()?);
        log::info!(
            "oncedb: merged {} runs into {} ({} keys, level {})",
            inputs.len(),
            merged.path().display(),
            merged.summary().entries,
            merged.summary().level
        );
        {
            let (list, count) = self.list(merged.summary().kind);
            let mut runs = list.write();
            runs.retain(|run| !merged.summary().replaces(run.summary()));
            runs.push(merged);
            count.store(runs.len(), Ordering::Release);
        }
        for run in inputs {
            self.storage.remove(run.path())?;
        }
        self.storage.sync_dir(&self.dir)?;
        self.merged.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }
}

impl SealedRuns {
    /// Writes the merged sections of `inputs` into `writer`, one shard at a time, each tag
    /// once with its newest bucket. `false` if the merge gives way (`yields`): a writer
    /// waits at the bound, and the rest of the merge would keep it waiting longer than
    /// [`MERGE_WAIT_LIMIT_NS`], at the pace of the shards so far (or [`MERGE_NS_PER_KEY`]
    /// before the first).
    fn write_merged(
        &self,
        inputs: &[Arc<Run>],
        sections: usize,
        writer: &mut RunWriter<'_>,
        yields: bool,
    ) -> Result<bool> {
        let total: u64 = inputs.iter().map(|run| run.summary().entries).sum();
        let (started, mut done) = (std::time::Instant::now(), 0u64);
        for index in 0..sections {
            if yields && self.waiting.load(Ordering::Acquire) > 0 {
                let elapsed_ns = u64::try_from(started.elapsed().as_nanos()).unwrap_or(u64::MAX);
                let per_key_ns = match done {
                    0 => MERGE_NS_PER_KEY,
                    done => elapsed_ns / done,
                };
                let left_ns = total.saturating_sub(done).saturating_mul(per_key_ns);
                if left_ns > self.merge_wait_limit_ns.load(Ordering::Relaxed) {
                    return Ok(false);
                }
            }
            let storage = &*self.storage;
            done += match inputs.first().map(|run| run.summary().kind) {
                // Each fingerprint once, the record of the newest bucket (a record that
                // expired and was reserved again).
                Some(RunKind::Records) => merge_section(
                    inputs,
                    |run| run.read_records(storage, index),
                    (
                        |entry: &(u128, SettledRecord)| entry.0,
                        |entry: &(u128, SettledRecord)| entry.1.bucket,
                    ),
                    |merged| writer.add_records(merged),
                )?,
                _ => merge_section(
                    inputs,
                    |run| run.read_section(storage, index),
                    (|entry: &(u64, u64)| entry.0, |entry: &(u64, u64)| entry.1),
                    |merged| writer.add_section(merged),
                )?,
            };
        }
        Ok(true)
    }
}

/// Merges one section of `inputs` (each read with `read`), each `key` once with the
/// entry of the newest `bucket`, and hands the result to `write`; returns the entries read.
fn merge_section<E: Copy, K: Ord + Copy>(
    inputs: &[Arc<Run>],
    read: impl Fn(&Run) -> Result<Vec<E>>,
    (key, bucket): (impl Fn(&E) -> K, impl Fn(&E) -> u64),
    write: impl FnOnce(&[E]) -> Result<()>,
) -> Result<u64> {
    let parts = inputs
        .iter()
        .map(|run| read(run))
        .collect::<Result<Vec<_>>>()?;
    let read = parts.iter().map(|part| part.len() as u64).sum();
    let merged = merge_sections(&parts, key, bucket);
    drop(parts);
    write(&merged)?;
    Ok(read)
}
/// The working memory of merging `inputs`: per key of the largest merged section.
fn merge_work_bytes(inputs: &[Arc<Run>]) -> u64 {
    let sections = inputs.first().map_or(0, |run| run.section_count());
    let largest = (0..sections)
        .map(|index| {
            inputs
                .iter()
                .map(|run| run.section_entries(index))
                .sum::<u64>()
        })
        .max()
        .unwrap_or(0);
    let per_entry = match inputs.first().map(|run| run.summary().kind) {
        Some(RunKind::Records) => WORK_BYTES_PER_RECORD,
        _ => WORK_BYTES_PER_KEY,
    };
    largest.saturating_mul(per_entry)
}

/// The union of sections' entries, each sorted by `key` with each key once: sorted, each
/// key once, the entry with the newest `bucket` kept (the last input's among equals: the
/// inputs come oldest first).
/// One pass over all of them, into one vector.
fn merge_sections<E: Copy, K: Ord + Copy>(
    parts: &[Vec<E>],
    key: impl Fn(&E) -> K,
    bucket: impl Fn(&E) -> u64,
) -> Vec<E> {
    let mut merged = Vec::with_capacity(parts.iter().map(Vec::len).sum());
    let mut heads = vec![0; parts.len()];
    loop {
        let heads_now = parts
            .iter()
            .zip(&heads)
            .filter_map(|(part, &at)| part.get(at));
        let Some(smallest) = heads_now.map(&key).min() else {
            return merged;
        };
        let mut newest: Option<E> = None;
        for (part, at) in parts.iter().zip(&mut heads) {
            if let Some(&entry) = part.get(*at)
                && key(&entry) == smallest
            {
                // Inputs come oldest first: on a tie the newer input's copy wins (an
                // older one may name a frame a later copy replaced).
                if newest.is_none_or(|kept| bucket(&entry) >= bucket(&kept)) {
                    newest = Some(entry);
                }
                *at += 1;
            }
        }
        merged.extend(newest);
    }
}

/// Removes the runs a newer merged run replaces (a crash after a merge published its run
/// and before it removed its inputs), after checking that the merged run spans them.
fn remove_merged(storage: &dyn Storage, dir: &Path, runs: Vec<Arc<Run>>) -> Result<Vec<Arc<Run>>> {
    let replacing = |run: &Run| {
        let summary = run.summary();
        runs.iter()
            .map(|other| other.summary())
            .find(|merged| merged.replaces(summary))
            .copied()
    };
    let mut kept = Vec::with_capacity(runs.len());
    let mut removed = false;
    for run in &runs {
        let Some(merged) = replacing(run) else {
            kept.push(Arc::clone(run));
            continue;
        };
        let summary = run.summary();
        if summary.oldest_bucket < merged.oldest_bucket
            || summary.newest_bucket > merged.newest_bucket
            || summary.covers > merged.covers
            || summary.shard_bits != merged.shard_bits
        {
            return Err(Error::Corrupted {
                path: run.path().to_path_buf(),
                offset: 0,
                reason: format!(
                    "run {} replaces this run but does not span its buckets and log",
                    merged.run_id
                ),
            });
        }
        storage.remove(run.path())?;
        removed = true;
    }
    if removed {
        storage.sync_dir(dir)?;
    }
    Ok(kept)
}

impl Engine {
    /// After `admitted` keys: every few thousand, settles the seal task under way (drops
    /// the frozen tables once its run is published, joins it once it ended), retires
    /// expired runs and, if the dedup tables (with the runs' filters) hold half the
    /// memory budget, freezes them and starts a seal task. Writers go on while it runs,
    /// unless the tables reach its bound ([`SealedRuns::bound`]): then the writer that
    /// looks waits, and so does any other that looks meanwhile.
    pub(crate) fn after_inserts(&self, admitted: u64) -> Result<()> {
        let Some(sealer) = &self.sealer else {
            return Ok(());
        };
        if sealer.since_check.fetch_add(admitted, Ordering::Relaxed) + admitted < CHECK_EVERY_KEYS {
            return Ok(());
        }
        sealer.since_check.store(0, Ordering::Relaxed);
        let mut task = match sealer.task.try_lock() {
            Some(task) => task,
            None if self.over_bound(sealer) => sealer.task.lock(),
            None => return Ok(()),
        };
        self.wait_within_bound(sealer, &mut task)?;
        if task.is_some() {
            return Ok(());
        }
        sealer
            .runs
            .expire(self.window, self.current_bucket())
            .map_err(|err| self.fail(err))?;
        // Of the dedup tables and the records, the one further past its threshold seals
        // first (so that neither waits behind the other for ever).
        let held = self.index.budget_bytes();
        let keys = (held.tables, sealer.runs.threshold());
        // Records weigh by what a seal would take: records in flight, and capacity
        // their predecessors left, would have it seal nothing at every check, and keep
        // the dedup tables from ever sealing.
        let records = (held.sealable_records, sealer.runs.record_threshold());
        let past =
            |(bytes, threshold): (u64, u64)| (bytes >= threshold).then_some((bytes, threshold));
        *task = match (past(keys), past(records)) {
            (Some(keys), Some(records))
                if u128::from(records.0) * u128::from(keys.1)
                    > u128::from(keys.0) * u128::from(records.1) =>
            {
                self.start_record_seal(sealer)?
            }
            (Some(_), _) => self.start_seal(sealer)?,
            (None, Some(_)) => self.start_record_seal(sealer)?,
            (None, None) => None,
        };
        Ok(())
    }

    /// Settles the task in `slot`; while it runs and memory is at a bound (`over_bound`), waits
    /// for it to move on and settles it again.
    fn wait_within_bound(&self, sealer: &Sealer, slot: &mut Option<SealTask>) -> Result<()> {
        let mut waited = false;
        let settled = loop {
            // Read before settling: a move after it ends the wait below at once.
            let seen = sealer.runs.progress.get();
            if let Err(err) = self.settle_seal(slot, seen) {
                break Err(err);
            }
            if slot.is_none() || !self.over_bound(sealer) {
                break Ok(());
            }
            if !waited {
                waited = true;
                sealer.waits.fetch_add(1, Ordering::Relaxed);
                sealer.runs.waiting.fetch_add(1, Ordering::AcqRel);
            }
            sealer.runs.progress.wait_past(seen);
        };
        if waited {
            sealer.runs.waiting.fetch_sub(1, Ordering::AcqRel);
        }
        settled
    }

    /// Whether memory is at a bound a writer waits at while a seal task runs: the dedup
    /// tables at [`SealedRuns::bound`], or the records memory holds at twice their
    /// threshold (half the budget: records keep arriving while a record seal writes).
    fn over_bound(&self, sealer: &Sealer) -> bool {
        let held = self.index.budget_bytes();
        held.tables >= sealer.runs.bound() || held.records >= 2 * sealer.runs.record_threshold()
    }

    /// Joins the task in `slot` if it ended; otherwise drops the frozen tables once its
    /// run is published (`phase` read before the call).
    fn settle_seal(&self, slot: &mut Option<SealTask>, phase: Phase) -> Result<()> {
        let Some(task) = slot.as_mut() else {
            return Ok(());
        };
        if phase == Phase::Ended {
            // Its thread is returning: the join is short.
            return self.join_seal(slot, true);
        }
        if task.thread.is_finished() {
            return self.join_seal(slot, false);
        }
        if phase != Phase::Sealing && !task.released {
            self.index.release_frozen();
            task.released = true;
        }
        Ok(())
    }

    /// Waits for the seal task under way, if any, and joins it (for `flush`).
    pub(crate) fn wait_for_seal(&self) -> Result<()> {
        match &self.sealer {
            Some(sealer) => self.join_seal(&mut sealer.task.lock(), true),
            None => Ok(()),
        }
    }

    /// Ends the seal task in `slot` if it finished, or, with `wait`, once it does: drops
    /// the frozen tables if its run was published (and they are still held), and
    /// returns its error.
    fn join_seal(&self, slot: &mut Option<SealTask>, wait: bool) -> Result<()> {
        let Some(task) = slot.take_if(|task| wait || task.thread.is_finished()) else {
            return Ok(());
        };
        let end = task.thread.join().unwrap_or_else(|_| TaskEnd {
            published: false,
            result: Err(Error::Io(std::io::Error::other(
                "the sealing thread panicked",
            ))),
        });
        if end.published && !task.released {
            self.index.release_frozen();
        }
        end.result.map_err(|err| self.fail(err))
    }

    /// Freezes every shard's table at the log's position now and starts the task that
    /// seals them into a new run (then merges what that makes due). `None` in memory
    /// (where no budget is accepted).
    fn start_seal(&self, sealer: &Sealer) -> Result<Option<SealTask>> {
        let Some(journal) = &self.journal else {
            return Ok(None);
        };
        reserve_run_ids(sealer, journal)?;
        let covers = journal.position();
        let frozen = self.index.freeze_all();
        let span = self.window.span;
        let currents = frozen.iter().flatten().map(|&(_, _, current)| current);
        // The journal may have seen a bucket no shard has yet: the run's newest bucket
        // is at least its position's.
        let newest = currents.clone().max().unwrap_or(0).max(covers.bucket);
        let oldest = currents.min().unwrap_or(0).saturating_sub(span);
        let summary = self.new_run(sealer, RunKind::Keys, (oldest, newest), covers);
        let (runs, log) = (Arc::clone(&sealer.runs), journal.seal_handle());
        sealer.runs.progress.set(Phase::Sealing);
        self.spawn_seal_task(
            sealer,
            move || {
                // Ended even if the task panics, so that no writer waits for it forever.
                let runs = EndsTask(runs);
                let sealed = runs.write_sealed(summary, &frozen);
                drop(frozen);
                let published = sealed.is_ok();
                if published {
                    runs.progress.set(Phase::Published);
                }
                let result = sealed.and_then(|()| runs.merge_tail(span, RunKind::Keys));
                // Any failure poisons, an I/O error or not: a seal left half-done (its
                // tables still frozen, or a merge's inputs unread) is never built on.
                let result = result.map_err(|err| log.poison_with(err));
                TaskEnd { published, result }
            },
            false,
        )
    }

    /// The summary of a new run sealed from memory (level 0, replacing no other run),
    /// under the next run id, before its entries are written.
    fn new_run(
        &self,
        sealer: &Sealer,
        kind: RunKind,
        (oldest_bucket, newest_bucket): (u64, u64),
        covers: LogPosition,
    ) -> RunSummary {
        let run_id = sealer.runs.next_run_id.fetch_add(1, Ordering::Relaxed);
        RunSummary {
            database_id: sealer.runs.database_id,
            run_id,
            shard_bits: self.index.shard_bits(),
            kind,
            entries: 0,
            oldest_bucket,
            newest_bucket,
            covers,
            level: 0,
            replaces_from: run_id,
        }
    }

    /// Starts `task` on the `oncedb-sealer` thread; `released` if it freezes no tables.
    fn spawn_seal_task(
        &self,
        sealer: &Sealer,
        task: impl FnOnce() -> TaskEnd + Send + 'static,
        released: bool,
    ) -> Result<Option<SealTask>> {
        let thread = std::thread::Builder::new()
            .name("oncedb-sealer".to_owned())
            .spawn(task)
            .map_err(|err| {
                sealer.runs.progress.set(Phase::Ended);
                self.fail(Error::Io(err))
            })?;
        Ok(Some(SealTask { thread, released }))
    }

    /// Starts the task that seals every live settled record into a new record run, then
    /// drops them from memory. `None` in memory (where no budget is accepted).
    ///
    /// The run's cover is the log's position now, before any shard is looked at: a
    /// finish entry is appended under its shard's lock, with the record's ending, so
    /// every ending logged before the cover is in memory when the task takes that
    /// shard's records. Replay drops each record whose ending before the cover settles
    /// it; the task takes every settled record, and lowers the cover to the earliest
    /// frame that may end a finished record it cannot take yet (its response not yet
    /// located in the log). Records in flight are never taken.
    fn start_record_seal(&self, sealer: &Sealer) -> Result<Option<SealTask>> {
        let Some(journal) = &self.journal else {
            return Ok(None);
        };
        reserve_run_ids(sealer, journal)?;
        // The bucket range is the records', set once they are written.
        let summary = self.new_run(sealer, RunKind::Records, (0, 0), journal.position());
        let (runs, index, log) = (
            Arc::clone(&sealer.runs),
            Arc::clone(&self.index),
            journal.seal_handle(),
        );
        let span = self.window.span;
        // No tables are frozen: writers wait at the budget's whole bound, if at all.
        sealer.runs.progress.set(Phase::Published);
        self.spawn_seal_task(
            sealer,
            move || {
                let runs = EndsTask(runs);
                let result = runs
                    .seal_records(summary, &index, &log)
                    .and_then(|()| runs.merge_tail(span, RunKind::Records))
                    .map_err(|err| log.poison_with(err));
                TaskEnd {
                    published: result.is_ok(),
                    result,
                }
            },
            true,
        )
    }

    /// A failed seal or run removal: an I/O error poisons the store like a failed write.
    pub(crate) fn fail(&self, err: Error) -> Error {
        match &self.journal {
            Some(journal) => journal.fail(err),
            None => err,
        }
    }
}

/// Puts every id a seal task may take below the run floor, durably, before it starts.
fn reserve_run_ids(sealer: &Sealer, journal: &crate::wal::Journal) -> Result<()> {
    let next = sealer.runs.next_run_id.load(Ordering::Relaxed);
    if next + RUN_ID_SLACK >= sealer.runs.run_floor.load(Ordering::Acquire) {
        journal.raise_run_floor(next + RUN_FLOOR_STEP)?;
        sealer
            .runs
            .run_floor
            .store(next + RUN_FLOOR_STEP, Ordering::Release);
    }
    Ok(())
}

impl SealedRuns {
    /// Writes every live settled record of `index` into the record run `summary`
    /// describes, shard by shard (one shard's records held at a time), publishes it, then
    /// drops those records from memory. A run with no record is abandoned.
    fn seal_records(&self, mut summary: RunSummary, index: &Index, log: &SealHandle) -> Result<()> {
        let mut writer = RunWriter::create(&*self.storage, &self.dir, summary)?;
        let mut marks = Vec::with_capacity(index.shard_count());
        let (mut oldest, mut newest, mut records) = (u64::MAX, 0, 0usize);
        for shard in 0..index.shard_count() {
            let Sealable {
                records: mut taken,
                mark,
                unsettled_from,
            } = index.sealable_records(shard);
            if let Some(span) = unsettled_from {
                let from = LogPosition {
                    bucket: span.bucket,
                    seq: span.seq,
                    offset: span.start,
                };
                summary.covers = summary.covers.min(from);
            }
            taken.sort_unstable_by_key(|&(fingerprint, _)| fingerprint);
            for (_, record) in &taken {
                oldest = oldest.min(record.bucket);
                newest = newest.max(record.bucket);
            }
            records += taken.len();
            self.work_bytes.store(
                (taken.len() * size_of::<(u128, SettledRecord)>()) as u64,
                Ordering::Relaxed,
            );
            writer.add_records(&taken)?;
            marks.push(mark);
        }
        self.work_bytes.store(0, Ordering::Relaxed);
        if records == 0 {
            return writer.abandon();
        }
        // The cover's segment bucket is at most the newest: a run never claims a log
        // position past its own newest bucket.
        writer.set_range(oldest, newest.max(summary.covers.bucket), summary.covers);
        // The records' response frames, and the cover, are fsynced before the run is:
        // under `Buffered` they may only be written.
        log.sync_appended()?;
        let run = writer.finish()?;
        log::info!(
            "oncedb: sealed {} records into {} (buckets {oldest}..={newest})",
            run.summary().entries,
            run.path().display(),
        );
        {
            let mut runs = self.record_runs.write();
            runs.push(Arc::new(run));
            self.live_record_runs.store(runs.len(), Ordering::Release);
        }
        self.sealed.fetch_add(1, Ordering::Relaxed);
        for (shard, mark) in marks.iter().enumerate() {
            index.drop_sealed_records(shard, mark);
        }
        Ok(())
    }
}

/// Per shard, the frozen table (if it held anything), the liveness its stamps are read
/// with, and the shard's bucket when it froze.
type Frozen = [Option<(Arc<DedupTable>, Liveness, u64)>];

impl SealedRuns {
    /// Writes the frozen tables as the run `summary` describes (each tag once, with its
    /// newest bucket), fsyncs and renames it, then publishes it to lookups.
    fn write_sealed(&self, summary: RunSummary, frozen: &Frozen) -> Result<()> {
        let largest = frozen.iter().flatten().map(|(table, _, _)| table.used());
        let largest = largest.max().unwrap_or(0) as u64;
        self.work_bytes.store(
            largest.saturating_mul(WORK_BYTES_PER_KEY),
            Ordering::Relaxed,
        );
        let written = self.write_frozen(summary, frozen);
        self.work_bytes.store(0, Ordering::Relaxed);
        written
    }

    /// [`SealedRuns::write_sealed`]'s writing and publishing.
    fn write_frozen(&self, summary: RunSummary, frozen: &Frozen) -> Result<()> {
        let mut writer = RunWriter::create(&*self.storage, &self.dir, summary)?;
        let mut entries = Vec::new();
        for shard in frozen {
            entries.clear();
            if let Some((table, live, current)) = shard {
                let current = *current;
                entries.extend(table.live_entries(*live).map(|(tag, stamp)| {
                    #[expect(
                        clippy::cast_possible_truncation,
                        reason = "bucket stamps are the low 32 bits of the bucket"
                    )]
                    let age = (current as u32).wrapping_sub(stamp);
                    (tag, current - u64::from(age))
                }));
                // Each tag once, with its newest stamp.
                entries.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
                entries.dedup_by_key(|entry| entry.0);
            }
            writer.add_section(&entries)?;
        }
        drop(entries);
        let run = writer.finish()?;
        log::info!(
            "oncedb: sealed {} keys into {} (buckets {}..={})",
            run.summary().entries,
            run.path().display(),
            summary.oldest_bucket,
            summary.newest_bucket
        );
        let mut runs = self.runs.write();
        runs.push(Arc::new(run));
        self.live_runs.store(runs.len(), Ordering::Release);
        self.sealed.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::MemStorage;

    const DATABASE_ID: u64 = 7;

    /// Among entries of one key and one bucket, the newest input's wins: an older copy
    /// may name a frame that a later copy replaced.
    #[test]
    fn a_merge_tie_keeps_the_newest_inputs_entry() {
        let older = vec![(1u64, 5u64, "older"), (2, 5, "older")];
        let newer = vec![(1u64, 5u64, "newer"), (3, 4, "newer")];
        let merged = merge_sections(&[older, newer], |e| e.0, |e| e.1);
        assert_eq!(
            merged,
            vec![(1, 5, "newer"), (2, 5, "older"), (3, 4, "newer")]
        );
        // A newer bucket wins whichever input holds it.
        let merged = merge_sections(
            &[vec![(1u64, 6u64, "older")], vec![(1, 5, "newer")]],
            |e| e.0,
            |e| e.1,
        );
        assert_eq!(merged, vec![(1, 6, "older")]);
    }

    /// Writes four runs of `level` into `dir` (ids 4, 8, 12, 16; a merged run replacing the
    /// three ids below its own), two sections of a few keys each, and opens a sealer on them.
    fn sealer_over_four_runs(level: u32) -> (Arc<dyn Storage>, Sealer) {
        let storage: Arc<dyn Storage> = Arc::new(MemStorage::new());
        let dir = Path::new("/db");
        storage.create_dir_all(dir).unwrap();
        for n in 0..4u64 {
            let run_id = 4 * (n + 1);
            let summary = RunSummary {
                database_id: DATABASE_ID,
                run_id,
                shard_bits: 1,
                kind: RunKind::Keys,
                entries: 0,
                oldest_bucket: 0,
                newest_bucket: 5,
                covers: LogPosition::default(),
                level,
                replaces_from: if level == 0 { run_id } else { run_id - 3 },
            };
            let mut writer = RunWriter::create(&*storage, dir, summary).unwrap();
            for section in 0..2u64 {
                let entries: Vec<(u64, u64)> = (0..50)
                    .map(|k| ((section << 32) | (k * 4 + n), 5))
                    .collect();
                writer.add_section(&entries).unwrap();
            }
            writer.finish().unwrap();
        }
        let reached = Reached {
            window: Window::new(100, 1),
            bucket: 10,
            newest_segment: None,
        };
        let (sealer, _) =
            Sealer::open(&storage, dir, None, (DATABASE_ID, 1 << 20, 0), reached).unwrap();
        (storage, sealer)
    }

    fn temp_runs(storage: &Arc<dyn Storage>) -> usize {
        let listed = storage.list(Path::new("/db")).unwrap();
        listed.iter().filter(|path| is_temp_run_name(path)).count()
    }

    /// The four runs of `level` at the tail, ready to merge, and a writer waiting at the
    /// bound; `limit_ns` is how long the merge may still keep it.
    fn tail_with_a_waiting_writer(
        level: u32,
        limit_ns: u64,
    ) -> (Arc<dyn Storage>, Sealer, Vec<Arc<Run>>) {
        let (storage, sealer) = sealer_over_four_runs(level);
        let tail = sealer
            .runs()
            .tail_to_merge(100, RunKind::Keys)
            .expect("four runs of one level merge");
        sealer.runs().waiting.store(1, Ordering::Release);
        sealer
            .runs()
            .merge_wait_limit_ns
            .store(limit_ns, Ordering::Relaxed);
        (storage, sealer, tail)
    }

    #[test]
    fn a_long_merge_of_merged_runs_gives_way_to_waiting_writers() {
        // Any work left is more than the limit: the merge gives way.
        let (storage, sealer, tail) = tail_with_a_waiting_writer(1, 0);
        let runs = sealer.runs();
        assert!(
            !runs.merge(&tail).unwrap(),
            "a writer waits: the merge gives way"
        );
        let stats = runs.stats();
        assert_eq!(
            (stats.runs, stats.runs_merged, stats.merges_yielded),
            (4, 0, 1)
        );
        assert_eq!(temp_runs(&storage), 0, "the abandoned file is removed");
        runs.waiting.store(0, Ordering::Release);
        assert!(runs.merge(&tail).unwrap());
        let stats = runs.stats();
        assert_eq!(
            (stats.runs, stats.runs_merged, stats.sealed_keys),
            (1, 1, 400)
        );
    }

    #[test]
    fn a_merge_about_to_end_keeps_a_waiting_writer_waiting() {
        // 400 keys at the assumed pace: far below the limit.
        let (_storage, sealer, tail) = tail_with_a_waiting_writer(1, MERGE_WAIT_LIMIT_NS);
        assert!(sealer.runs().merge(&tail).unwrap());
        assert_eq!(sealer.runs().stats().merges_yielded, 0);
    }

    #[test]
    fn a_merge_of_sealed_runs_is_made_even_with_writers_waiting() {
        let (_storage, sealer, tail) = tail_with_a_waiting_writer(0, 0);
        assert!(sealer.runs().merge(&tail).unwrap());
        assert_eq!(sealer.runs().stats().merges_yielded, 0);
    }
}
