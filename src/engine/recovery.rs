//! Opening a durable store: lock, manifest, expiry, replay, torn-tail repair, seal.
//! Recovery builds an index, replays the log into it, starts the journal, and hands the
//! parts to [`Engine::from_parts`]: it sets no field of a finished engine.

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use super::sealing::{Covered, Reached, Sealer};
use super::{Config, Engine, Parts};
use crate::base::{
    Error, Fingerprint, LogSpan, RecordStatus, RecoveryMode, Result, Window, random_secret,
};
use crate::index::{Index, NewRecord};
use crate::io::Storage;
use crate::wal::{
    DecodedEntry, DecodedFinish, Journal, JournalConfig, LOCK_NAME, LogPosition, MANIFEST_NAME,
    MANIFEST_TEMP_NAME, MAX_SEGMENT_FILE_BYTES, Manifest, RecoveryReport, SEGMENT_HEADER_LEN, Scan,
    SkippedRange, TornTail, Verdict, create_dir_durably, encode_mark, frame_seed, header_problem,
    is_archive, is_prepared_name, parse_run_name, parse_segment_name, prepare_archive, retire,
    scan, segment_path,
};

/// One live segment to replay.
struct Segment {
    path: PathBuf,
    bucket: u64,
    seq: u32,
    newest: bool,
}

/// What replay carries from segment to segment.
struct Replay<'a> {
    storage: &'a dyn Storage,
    index: &'a Index,
    mode: RecoveryMode,
    seed: u64,
    database_id: u64,
    /// Highest lease id replayed.
    max_lease: u64,
    /// The newest segment, if it holds nothing but its header: the journal appends to it.
    adopt: Option<(u64, u32)>,
    /// Keys entries before `covered.keys` are in key runs: not replayed. A record whose
    /// ending before `covered.records` settles it is in a record run: memory drops it.
    covered: Covered,
    /// The record runs, so that a late reserve never hides a record a run holds.
    sealed: Option<&'a dyn crate::index::SealedRecords>,
    report: RecoveryReport,
}

/// Segment names an open requires after the newest one.
const MIN_NAMES_LEFT: u128 = 1 << 20;

/// How many segment names come after (`bucket`, `seq`).
fn names_left(bucket: u64, seq: u32) -> u128 {
    u128::from(u64::MAX - bucket) * (u128::from(u32::MAX) + 1) + u128::from(u32::MAX - seq)
}

/// Opens the durable store of `config.dir`.
pub(crate) fn open(config: &Config) -> Result<Engine> {
    let Some(dir) = config.dir.clone() else {
        unreachable!("recovery is only called for durable stores");
    };
    let storage: &dyn Storage = &*config.storage;
    if is_archive(storage, &dir)? {
        return Err(Error::InvalidOptions(format!(
            "{} is an archive of expired segments, not a store: read it with `oncedb verify` or `oncedb inspect`",
            dir.display()
        )));
    }
    create_dir_durably(storage, &dir)?;
    let lock = storage.lock(&dir.join(LOCK_NAME)).map_err(|err| {
        if err.kind() == ErrorKind::WouldBlock {
            Error::Locked(dir.clone())
        } else {
            Error::Io(err)
        }
    })?;
    let segments = list_segments(storage, &dir)?;
    let manifest = load_or_create_manifest(config, storage, &dir, segments.is_empty())?;
    let window = config.window();
    let clock_bucket = window.bucket_of(config.clock.now_ms());
    let newest = segments.last().map_or(0, |&(bucket, _)| bucket);
    let provisional = clock_bucket.max(newest);
    let archive = config.archive_dir.as_deref();
    if let Some(archive) = archive {
        prepare_archive(storage, &dir, archive, &manifest)?;
    }
    // A store that holds sealed runs keeps using them when opened without a budget (it
    // just seals nothing new): its log alone no longer says which keys the runs hold.
    let has_runs = storage
        .list(&dir)?
        .iter()
        .any(|path| parse_run_name(path).is_some());
    let budget = config.memory_budget_bytes.or(has_runs.then_some(u64::MAX));
    let (sealer, covered) = match budget {
        Some(budget) => {
            let (sealer, covered) = Sealer::open(
                &config.storage,
                &dir,
                archive,
                (manifest.database_id(), budget, manifest.run_floor),
                Reached {
                    window,
                    bucket: provisional,
                    newest_segment: segments.last().copied(),
                },
            )?;
            (Some(sealer), covered)
        }
        None => (None, Covered::default()),
    };
    // No run covers a position past this: the journal appends after it.
    let covers = covered.keys.max(covered.records);
    // The store has seen every bucket a run holds keys of: time resumes no earlier.
    let high_water = provisional.max(sealer.as_ref().map_or(0, Sealer::newest_bucket));

    let mut report = RecoveryReport {
        mode: config.recovery_mode,
        ..RecoveryReport::default()
    };
    let live = delete_expired(
        storage,
        &dir,
        archive,
        &segments,
        window,
        high_water,
        &mut report,
    )?;
    let start = live.first().map_or(high_water, |&(bucket, _)| bucket);
    let seed = frame_seed(manifest.secret);
    let logged = count_logged_keys(storage, &dir, &live, (seed, covered.keys));
    let index = config.build_index(config.expected_keys.max(logged), start)?;
    let mut replay = Replay {
        storage,
        index: &index,
        mode: config.recovery_mode,
        seed,
        database_id: manifest.database_id(),
        max_lease: 0,
        adopt: None,
        covered,
        sealed: sealer
            .as_ref()
            .map(|sealer| sealer.runs() as &dyn crate::index::SealedRecords),
        report,
    };
    let mut kept = BTreeMap::new();
    for (position, &(bucket, seq)) in live.iter().enumerate() {
        let segment = Segment {
            path: segment_path(&dir, bucket, seq),
            bucket,
            seq,
            newest: position + 1 == live.len(),
        };
        if let Some(len) = replay.segment(&segment)? {
            kept.insert((bucket, seq), len);
        }
    }
    let (max_lease, adopt, report) = (replay.max_lease, replay.adopt, replay.report);
    // Every open may name a segment or two, and a store never comes near the end of the
    // 2^96 names; a name that does was crafted. Refuse it now, while a later open could
    // still be refused for the same reason, rather than run out of names in use.
    if let Some((&(bucket, seq), _)) = kept.iter().next_back()
        && names_left(bucket, seq) < MIN_NAMES_LEFT
    {
        return Err(corrupted(
            &segment_path(&dir, bucket, seq),
            0,
            "segment name is too close to the end of the name space",
        ));
    }
    let journal = Journal::new(JournalConfig {
        storage: Arc::clone(&config.storage),
        dir,
        archive: config.archive_dir.clone(),
        durability: config.durability,
        window,
        manifest,
        frame_seed: seed,
        segment_max_bytes: config.segment_max_bytes,
        segments: kept,
        lock,
        segments_deleted: report.segments_deleted,
        adopt,
        bucket: high_water,
        names_after: (covers != LogPosition::default()).then_some((covers.bucket, covers.seq)),
        replica: replica_gate(config),
    })?;
    #[cfg(feature = "replicate")]
    let shipper = start_shipper(config, &journal)?;
    Ok(Engine::from_parts(
        config,
        Parts {
            index,
            secret: manifest.secret,
            high_water,
            // The floor covers every id handed out before, even ids whose entries expired
            // with their segments: counting resumes above both.
            next_lease: (max_lease + 1).max(manifest.lease_floor),
            lease_floor: manifest.lease_floor,
            journal: Some(journal),
            recovery: Some(report),
            sealer,
            #[cfg(feature = "replicate")]
            shipper,
        },
    ))
}

/// How a replica gates the journal's writers, if the store replicates.
fn replica_gate(config: &Config) -> Option<crate::wal::ReplicaGate> {
    #[cfg(feature = "replicate")]
    if let Some(replication) = &config.replication {
        return Some(replication.gate());
    }
    let _ = config;
    None
}

/// Starts shipping the log to the replica, if the store replicates: after the journal
/// opened, before any write.
#[cfg(feature = "replicate")]
fn start_shipper(config: &Config, journal: &Journal) -> Result<Option<crate::replica::Shipper>> {
    let Some(replication) = &config.replication else {
        return Ok(None);
    };
    let dir = config.dir.clone().unwrap_or_default();
    crate::replica::Shipper::start(replication.clone(), journal.feed(), dir).map(Some)
}

/// Dedup keys the live segments admit (not records or ordering marks, which the dedup
/// tables do not hold), counted from their valid frames, so the tables can be sized once
/// instead of growing during replay. Damage is left to replay
/// to report; a file that cannot be read counts as empty here.
fn count_logged_keys(
    storage: &dyn Storage,
    dir: &Path,
    segments: &[(u64, u32)],
    (seed, covers): (u64, LogPosition),
) -> u64 {
    let mut keys = 0;
    for &(bucket, seq) in segments {
        let Ok(bytes) = storage.read(&segment_path(dir, bucket, seq), MAX_SEGMENT_FILE_BYTES)
        else {
            continue;
        };
        for (frame, entry) in scan(&bytes, seed).frames {
            let sealed = position_of(bucket, seq, frame.start) < covers;
            keys += match entry {
                DecodedEntry::Keys { .. } if sealed => 0,
                DecodedEntry::Keys { fingerprints, .. } => fingerprints.len() as u64,
                // Records and ordering marks have maps of their own: the dedup table
                // sized for them would hold nothing in their slots.
                DecodedEntry::Reserve { .. }
                | DecodedEntry::Advance { .. }
                | DecodedEntry::Finish { .. }
                | DecodedEntry::Mark { .. }
                | DecodedEntry::Note { .. }
                | DecodedEntry::TakeOver { .. } => 0,
            };
        }
    }
    keys
}

/// Segment files of `dir` in replay order; any other name is ignored. A stale manifest
/// temp file and segments prepared ahead of need (never part of the log) are removed.
fn list_segments(storage: &dyn Storage, dir: &Path) -> Result<Vec<(u64, u32)>> {
    let mut segments = Vec::new();
    for path in storage.list(dir)? {
        if let Some(id) = parse_segment_name(&path) {
            segments.push(id);
        } else if is_prepared_name(&path)
            || path
                .file_name()
                .is_some_and(|name| name == MANIFEST_TEMP_NAME)
        {
            storage.remove(&path)?;
        }
    }
    segments.sort_unstable();
    Ok(segments)
}

fn load_or_create_manifest(
    config: &Config,
    storage: &dyn Storage,
    dir: &Path,
    no_segments: bool,
) -> Result<Manifest> {
    let window_ms = config.window().width_ms * config.window().span;
    let width_ms = config.window().width_ms;
    if let Some(manifest) = Manifest::load(storage, dir)? {
        if manifest.window_ms != window_ms || manifest.bucket_width_ms != width_ms {
            return Err(Error::IncompatibleOptions(format!(
                "{} was created with window {} ms and bucket_width {} ms; opened with {} ms and {} ms",
                dir.display(),
                manifest.window_ms,
                manifest.bucket_width_ms,
                window_ms,
                width_ms
            )));
        }
        return Ok(manifest);
    }
    if !no_segments {
        return Err(Error::Corrupted {
            path: dir.join(MANIFEST_NAME),
            offset: 0,
            reason: "segments exist but the manifest is missing".into(),
        });
    }
    let manifest = Manifest {
        secret: random_secret(),
        window_ms,
        bucket_width_ms: width_ms,
        lease_floor: 0,
        run_floor: 0,
    };
    manifest.store(storage, dir)?;
    Ok(manifest)
}

/// Unlinks (or archives) segments whose bucket has left the window; returns the rest.
fn delete_expired(
    storage: &dyn Storage,
    dir: &Path,
    archive: Option<&Path>,
    segments: &[(u64, u32)],
    window: Window,
    current: u64,
    report: &mut RecoveryReport,
) -> Result<Vec<(u64, u32)>> {
    let (expired, live): (Vec<_>, Vec<_>) = segments
        .iter()
        .partition(|&&(bucket, _)| !window.is_live(bucket, current));
    retire(storage, dir, archive, &expired, &mut |d| {
        storage.sync_dir(d)
    })?;
    report.segments_deleted += expired.len() as u64;
    Ok(live)
}

/// The log position of the frame at `start` of segment (`bucket`, `seq`).
fn position_of(bucket: u64, seq: u32, start: usize) -> LogPosition {
    LogPosition {
        bucket,
        seq,
        offset: frame_offset(start),
    }
}

/// A frame offset or length within a segment, which stays below 4 GiB.
fn frame_offset(offset: usize) -> u32 {
    const _: () = assert!(MAX_SEGMENT_FILE_BYTES <= u32::MAX as u64);
    u32::try_from(offset).unwrap_or(u32::MAX)
}

fn corrupted(path: &Path, offset: u64, reason: &str) -> Error {
    Error::Corrupted {
        path: path.to_path_buf(),
        offset,
        reason: reason.to_string(),
    }
}

impl Replay<'_> {
    /// Replays one segment and returns its length afterwards, or `None` if the newest
    /// segment had no valid header and was removed (a crash while creating it).
    fn segment(&mut self, segment: &Segment) -> Result<Option<u64>> {
        let path = &segment.path;
        let bytes = match self.storage.read(path, MAX_SEGMENT_FILE_BYTES) {
            Ok(bytes) => bytes,
            Err(err) if err.kind() == ErrorKind::InvalidData => {
                return Err(corrupted(path, 0, "segment file exceeds the size limit"));
            }
            Err(err) => return Err(err.into()),
        };
        let scanned = scan(&bytes, self.seed);
        let problem = header_problem(
            &scanned.header,
            segment.bucket,
            segment.seq,
            self.database_id,
        );
        if let Some(reason) = problem {
            if segment.newest && bytes.len() <= SEGMENT_HEADER_LEN {
                return self.remove_torn_header(path, bytes.len() as u64);
            }
            self.damaged(path, 0, bytes.len() as u64, reason)?;
        }
        let end = match scanned.verdict(segment.newest) {
            Verdict::Clean => {
                self.apply_all(segment, &scanned, u64::MAX)?;
                scanned.len
            }
            Verdict::TornTail {
                offset,
                frames_dropped,
            } => {
                self.apply_all(segment, &scanned, offset)?;
                self.cut_tail(path, offset, scanned.len, frames_dropped)?;
                offset
            }
            Verdict::Corrupted { offset, reason } => {
                self.damaged(path, offset, scanned.len, reason)?;
                for damage in &scanned.damage {
                    self.skipped(path, damage.start, damage.end, damage.reason);
                }
                if scanned.damage.is_empty() {
                    // Nothing to skip, but something to report: a missing seal.
                    self.skipped(path, offset, offset, reason);
                }
                self.apply_all(segment, &scanned, u64::MAX)?;
                return Ok(Some(scanned.len));
            }
        };
        if segment.newest {
            // An empty newest segment is appended to again, unless a sealed run covers a
            // position past its header: appends never land before a run's position.
            let after_runs = position_of(segment.bucket, segment.seq, SEGMENT_HEADER_LEN)
                >= self.covered.keys.max(self.covered.records);
            if end == SEGMENT_HEADER_LEN as u64 && after_runs {
                self.adopt = Some((segment.bucket, segment.seq));
            } else {
                let sealed = end == scanned.len && scanned.ends_sealed;
                return self.seal_newest(path, sealed).map(Some);
            }
        }
        Ok(Some(end))
    }

    /// Under `Strict`, damage is an error; under `Salvage`, it is reported and skipped.
    fn damaged(&mut self, path: &Path, offset: u64, end: u64, reason: &str) -> Result<()> {
        match self.mode {
            RecoveryMode::Strict => Err(corrupted(path, offset, reason)),
            RecoveryMode::Salvage => {
                if offset == 0 && end > 0 {
                    self.skipped(path, 0, end.min(SEGMENT_HEADER_LEN as u64), reason);
                }
                Ok(())
            }
        }
    }

    fn skipped(&mut self, path: &Path, start: u64, end: u64, reason: &str) {
        log::warn!(
            "oncedb: salvage skipped bytes {start}..{end} of {}: {reason}",
            path.display()
        );
        self.report.skipped.push(SkippedRange {
            path: path.to_path_buf(),
            start,
            end,
            reason: reason.to_string(),
        });
    }

    fn remove_torn_header(&mut self, path: &Path, len: u64) -> Result<Option<u64>> {
        log::warn!(
            "oncedb: removing {} ({len} bytes): its header was torn",
            path.display()
        );
        self.storage.remove(path)?;
        self.storage
            .sync_dir(path.parent().unwrap_or(Path::new(".")))?;
        self.report.torn_tails.push(TornTail {
            path: path.to_path_buf(),
            offset: 0,
            bytes: len,
            frames_dropped: 0,
        });
        Ok(None)
    }

    fn cut_tail(&mut self, path: &Path, offset: u64, len: u64, frames_dropped: u64) -> Result<()> {
        log::warn!(
            "oncedb: cutting the torn tail of {} at byte {offset}: {} bytes, {frames_dropped} frames dropped",
            path.display(),
            len - offset
        );
        let mut file = self.storage.open_append(path, false)?;
        file.truncate(offset)?;
        file.sync()?;
        self.report.torn_tails.push(TornTail {
            path: path.to_path_buf(),
            offset,
            bytes: len - offset,
            frames_dropped,
        });
        Ok(())
    }

    /// Makes the newest segment's bytes durable (the previous process may have left
    /// unsynced appends in the page cache) and seals it unless it ends with a seal, so
    /// its last commit group is vouched for from now on. The journal then starts a new
    /// segment: every segment but the newest ends with a seal.
    fn seal_newest(&mut self, path: &Path, sealed: bool) -> Result<u64> {
        let mut file = self.storage.open_append(path, false)?;
        file.sync()?;
        if !sealed {
            let len = file.len()?;
            let mut seal = Vec::new();
            encode_mark(&mut seal, self.seed, len, len, true);
            file.append(&seal)?;
            file.sync()?;
        }
        Ok(file.len()?)
    }

    /// Applies every valid frame that starts before `end`.
    fn apply_all(&mut self, segment: &Segment, scanned: &Scan<'_>, end: u64) -> Result<()> {
        for (frame, entry) in &scanned.frames {
            if frame.start as u64 >= end {
                break;
            }
            let span = LogSpan {
                bucket: segment.bucket,
                seq: segment.seq,
                start: frame_offset(frame.start),
                len: frame_offset(frame.end - frame.start),
            };
            let position = position_of(segment.bucket, segment.seq, frame.start);
            if matches!(entry, DecodedEntry::Keys { .. }) && position < self.covered.keys {
                // In a sealed run already.
                continue;
            }
            let sealed = position < self.covered.records;
            if let Err(reason) = self.apply(span, entry, sealed) {
                self.damaged(&segment.path, frame.start as u64, frame.end as u64, reason)?;
                self.skipped(&segment.path, frame.start as u64, frame.end as u64, reason);
            }
        }
        Ok(())
    }

    /// Applies the entry whose frame lies at `span`. A finished record keeps the span,
    /// not its response's bytes.
    /// A finish that is `sealed` (before the record runs' cover) and settles its record
    /// drops it: a record run holds it.
    fn apply(
        &mut self,
        span: LogSpan,
        entry: &DecodedEntry<'_>,
        sealed: bool,
    ) -> Result<(), &'static str> {
        if let Some(problem) = entry.placement_problem(span.bucket) {
            return Err(problem);
        }
        match entry {
            DecodedEntry::Keys {
                bucket,
                fingerprints,
            } => {
                let fingerprints: Vec<Fingerprint> = fingerprints.iter().collect();
                self.index.restore_keys(*bucket, &fingerprints);
            }
            DecodedEntry::Reserve {
                fingerprint,
                lease_id,
                request_hash,
                created_ms,
                bucket,
                scoped_key,
            } => {
                self.max_lease = self.max_lease.max(*lease_id);
                let record = NewRecord {
                    fingerprint: *fingerprint,
                    scoped_key,
                    request_hash: *request_hash,
                    lease_id: *lease_id,
                    created_ms: *created_ms,
                    key_at: Some(span),
                };
                // A reserve past the record runs' cover is checked against them too: one
                // that reached the log late must not hide a record a run holds. (One
                // before the cover is its own record's reserve, settled by a finish that
                // a run holds: no lookup needed.)
                let runs = if sealed { None } else { self.sealed };
                self.index
                    .lock(*fingerprint, *bucket)
                    .restore_record(&record, *bucket, runs);
            }
            DecodedEntry::Finish {
                fingerprint,
                lease_id,
                at_ms,
                finish,
            } => {
                let ending = match finish {
                    DecodedFinish::Complete(_) => Some((RecordStatus::Completed, span)),
                    DecodedFinish::Fail(_) => Some((RecordStatus::Failed, span)),
                    DecodedFinish::Release => None,
                };
                // A finish applies to the record as the shard stands now: no advance.
                self.index.lock(*fingerprint, 0).restore_finish(
                    *fingerprint,
                    (*lease_id, ending),
                    *at_ms,
                    sealed,
                );
            }
            DecodedEntry::Note {
                fingerprint,
                lease_id,
                note,
            } => {
                let note = Arc::from(*note);
                self.index
                    .lock(*fingerprint, 0)
                    .restore_note(*fingerprint, *lease_id, &note);
            }
            DecodedEntry::TakeOver {
                fingerprint,
                old,
                new,
                at_ms,
            } => {
                self.max_lease = self.max_lease.max(*new);
                self.index.lock(*fingerprint, 0).restore_take_over(
                    *fingerprint,
                    (*old, *new),
                    *at_ms,
                );
            }
            DecodedEntry::Advance {
                fingerprint,
                version,
                bucket,
                scoped_key,
            } => {
                self.index.lock(*fingerprint, *bucket).restore_mark(
                    *fingerprint,
                    scoped_key,
                    *version,
                    *bucket,
                );
            }
            DecodedEntry::Mark { .. } => return Ok(()),
        }
        self.report.entries_replayed += 1;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    //! Replay of logs that the writer can produce under races, crafted frame by frame.

    use std::path::Path;
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;
    use crate::base::Hasher;
    use crate::base::ManualClock;
    use crate::base::{Durability, FullPolicy};
    use crate::base::{Finish, RecordStatus};
    use crate::engine::{ClockStep, Grant, Reserved};
    use crate::io::MemStorage;
    use crate::wal::LogEntry;

    const WIDTH_MS: u64 = 1_000;
    const SPAN: u64 = 4;
    const START: u64 = 1_700_000_000;

    fn config(disk: &MemStorage, clock: &ManualClock) -> Config {
        Config {
            dir: Some("/db".into()),
            window_ms: SPAN * WIDTH_MS,
            bucket_width_ms: WIDTH_MS,
            durability: Durability::Sync,
            clock: Arc::new(clock.clone()),
            shards: 4,
            expected_keys: 0,
            max_key_bytes: 64,
            max_response_bytes: 64,
            segment_max_bytes: 1 << 20,
            storage: Arc::new(disk.clone()),
            max_keys: None,
            full_policy: FullPolicy::Reject,
            huge_pages: false,
            recovery_mode: RecoveryMode::Strict,
            stuck_after_ms: 60_000,
            clock_step: ClockStep::Default,
            custom_clock: true,
            lease_timeout_ms: None,
            archive_dir: None,
            response_retention_ms: None,
            memory_budget_bytes: None,
            #[cfg(feature = "replicate")]
            replication: None,
        }
    }

    fn clock_at(bucket: u64) -> ManualClock {
        ManualClock::new(UNIX_EPOCH + Duration::from_millis(bucket * WIDTH_MS))
    }

    fn set_bucket(clock: &ManualClock, bucket: u64) {
        clock.set(UNIX_EPOCH + Duration::from_millis(bucket * WIDTH_MS));
    }

    /// Appends `entries` to the newest segment of `/db` as if the writer had.
    fn append_to_newest(disk: &MemStorage, entries: &[LogEntry<'_>]) -> Hasher {
        let dir = Path::new("/db");
        let manifest = Manifest::load(disk, dir).unwrap().unwrap();
        let seed = frame_seed(manifest.secret);
        let newest = disk
            .list(dir)
            .unwrap()
            .into_iter()
            .filter(|path| parse_segment_name(path).is_some())
            .max()
            .unwrap();
        let mut bytes = disk.contents(&newest).unwrap();
        for entry in entries {
            let position = bytes.len() as u64;
            entry.encode(&mut bytes, seed, position);
        }
        disk.set_contents(&newest, bytes);
        Hasher::new(manifest.secret)
    }

    fn secret_hasher(disk: &MemStorage) -> Hasher {
        Hasher::new(
            Manifest::load(disk, Path::new("/db"))
                .unwrap()
                .unwrap()
                .secret,
        )
    }

    /// A reserve that reached the log after a newer reserve and completion of the same
    /// key (its thread stalled between the index and the log) must not undo them.
    #[test]
    fn a_late_reserve_never_replaces_a_newer_record() {
        let disk = MemStorage::new();
        let clock = clock_at(START);
        let key = b"\x00\x01t\x00\x01ok";
        let engine = Engine::open(&config(&disk, &clock)).unwrap();
        let Reserved::Acquired(Grant { lease_id: old, .. }) = engine.reserve(key, b"req").unwrap()
        else {
            panic!("first reserve acquires");
        };
        // The first record expires; a second attempt reserves afresh and completes.
        set_bucket(&clock, START + SPAN + 1);
        let Reserved::Acquired(Grant {
            fingerprint,
            lease_id: new,
            ..
        }) = engine.reserve(key, b"req").unwrap()
        else {
            panic!("reserve after expiry acquires");
        };
        assert!(new > old);
        engine
            .finish(fingerprint, new, Finish::Complete(b"done"))
            .unwrap();
        drop(engine);
        let hasher = secret_hasher(&disk);
        let request_hash = hasher.request(b"req");
        // The stalled first reserve, as it would reach the log: its own stamp, and one
        // stamped in the live bucket (an event-time clock can do that).
        for bucket in [START, START + SPAN + 1] {
            let late = LogEntry::Reserve {
                fingerprint,
                lease_id: old,
                request_hash,
                created_ms: START * WIDTH_MS,
                bucket,
                scoped_key: key,
            };
            append_to_newest(&disk, &[late]);
            let engine = Engine::open(&config(&disk, &clock)).unwrap();
            let record = engine.get(key).unwrap().unwrap();
            assert_eq!(
                record.status,
                RecordStatus::Completed,
                "late reserve at bucket {bucket}"
            );
            assert_eq!(record.response.as_deref(), Some(&b"done"[..]));
        }
    }

    /// A finished record in compact form keeps its key only in the log, and still
    /// compares it: a record logged under the fingerprint of one key but holding
    /// another (what a fingerprint collision would look like) answers
    /// `FingerprintCollision` to every lookup, never the other key's record.
    #[test]
    fn a_compact_record_compares_its_key_from_the_log() {
        let disk = MemStorage::new();
        let clock = clock_at(START);
        let (asked, held) = (b"\x00\x01t\x00\x01ok", b"\x00\x01t\x00\x01no");
        let engine = Engine::open(&config(&disk, &clock)).unwrap();
        assert!(engine.insert_if_absent(b"a segment").unwrap());
        drop(engine);
        let hasher = secret_hasher(&disk);
        let fingerprint = hasher.record(asked);
        let reserve = LogEntry::Reserve {
            fingerprint,
            lease_id: 1,
            request_hash: hasher.request(b"req"),
            created_ms: START * WIDTH_MS,
            bucket: START,
            scoped_key: held,
        };
        let done = Finish::Complete(b"done");
        let finish = LogEntry::Finish {
            fingerprint,
            lease_id: 1,
            at_ms: START * WIDTH_MS,
            finish: &done,
        };
        append_to_newest(&disk, &[reserve, finish]);
        let engine = Engine::open(&config(&disk, &clock)).unwrap();
        assert!(matches!(
            engine.get(asked),
            Err(Error::FingerprintCollision)
        ));
        for request in [&b"req"[..], b"other"] {
            let answer = engine.reserve(asked, request);
            assert!(
                matches!(answer, Err(Error::FingerprintCollision)),
                "{answer:?}"
            );
        }
    }

    /// Epochs never repeat in a store's lifetime: a reopen after every segment expired
    /// (and was deleted) still counts above every lease handed out before, and the old
    /// lease cannot resume the new attempt.
    #[test]
    fn epochs_never_repeat_after_every_segment_expired() {
        let disk = MemStorage::new();
        let clock = clock_at(START);
        let key = b"\x00\x01t\x00\x01ok";
        let engine = Engine::open(&config(&disk, &clock)).unwrap();
        let Reserved::Acquired(Grant { lease_id: old, .. }) = engine.reserve(key, b"req").unwrap()
        else {
            panic!("first reserve acquires");
        };
        drop(engine);
        // Long after the window: recovery deletes every segment it finds.
        set_bucket(&clock, START + 50 * SPAN);
        let engine = Engine::open(&config(&disk, &clock)).unwrap();
        let deleted = engine.recovery_report().map_or(0, |r| r.segments_deleted);
        assert!(deleted >= 1, "every segment expired");
        let Reserved::Acquired(Grant { lease_id: new, .. }) = engine.reserve(key, b"req").unwrap()
        else {
            panic!("a reserve after expiry acquires");
        };
        assert!(new > old, "epoch {new} repeats or precedes {old}");
        assert!(matches!(engine.resume(key, old), Err(Error::LeaseLost)));
        assert!(engine.resume(key, new).is_ok());
    }

    /// Fencing is between the leases of one record: an epoch that lies between a
    /// record's first and current epoch but belongs to another key is `LeaseLost` on it,
    /// and only the epochs a take-over replaced are `Fenced`, before and after a reopen.
    #[test]
    fn only_the_epochs_a_take_over_replaced_are_fenced() {
        let disk = MemStorage::new();
        let clock = clock_at(START);
        let (k1, k2) = (&b"\x00\x01t\x00\x01k1"[..], &b"\x00\x01t\x00\x01k2"[..]);
        let engine = Engine::open(&config(&disk, &clock)).unwrap();
        let acquired = |key| match engine.reserve(key, b"req").unwrap() {
            Reserved::Acquired(grant) => grant.lease_id,
            other => panic!("{other:?}"),
        };
        let first = acquired(k2);
        let other_key = acquired(k1);
        let current = engine.take_over(k2).unwrap().unwrap().lease_id;
        assert!(first < other_key && other_key < current);
        let check = |engine: &Engine| {
            assert!(matches!(
                engine.resume(k2, other_key),
                Err(Error::LeaseLost)
            ));
            assert!(matches!(engine.resume(k2, first), Err(Error::Fenced)));
            assert!(engine.resume(k2, current).is_ok());
            assert!(engine.resume(k1, other_key).is_ok());
        };
        check(&engine);
        drop(engine);
        check(&Engine::open(&config(&disk, &clock)).unwrap());
    }

    /// A new store's directory is fsynced in its parent: a power loss right after the
    /// first acknowledged write keeps the directory and the write.
    #[test]
    fn a_new_store_survives_a_power_loss_with_its_directory() {
        let disk = MemStorage::new();
        let clock = clock_at(START);
        let fresh = || Config {
            dir: Some("/var/lib/new/db".into()),
            ..config(&disk, &clock)
        };
        let engine = Engine::open(&fresh()).unwrap();
        assert!(engine.insert_if_absent(b"first").unwrap());
        drop(engine);
        disk.power_loss();
        let engine = Engine::open(&fresh()).unwrap();
        assert!(engine.contains(b"first").unwrap());
    }

    /// A clock reading far ahead of the store's time (a bad NTP step) is held back and
    /// counted: nothing expires early and nothing is stamped in the far future; once the
    /// clock is back, time moves on and keys expire on schedule.
    #[test]
    fn a_far_future_clock_reading_is_held_back() {
        let disk = MemStorage::new();
        let clock = clock_at(START);
        let limited = Config {
            clock_step: ClockStep::Limit(SPAN * WIDTH_MS),
            ..config(&disk, &clock)
        };
        let engine = Engine::open(&limited).unwrap();
        assert!(engine.insert_if_absent(b"before").unwrap());
        set_bucket(&clock, START + 1000 * SPAN);
        assert!(
            engine.contains(b"before").unwrap(),
            "a bad step expires nothing"
        );
        assert!(engine.insert_if_absent(b"during").unwrap());
        assert!(engine.stats().clock_held_back >= 2);
        set_bucket(&clock, START + 1);
        assert!(engine.contains(b"during").unwrap());
        // Back on time: keys expire one window after they were admitted.
        set_bucket(&clock, START + SPAN + 1);
        assert!(!engine.contains(b"before").unwrap());
        assert!(
            !engine.contains(b"during").unwrap(),
            "stamped at the store's time"
        );
        drop(engine);
        // A caller's clock with no limit adopts every reading (event time may jump).
        let unlimited = Engine::open(&config(&disk, &clock)).unwrap();
        assert!(unlimited.insert_if_absent(b"k").unwrap());
        set_bucket(&clock, START + 1000 * SPAN);
        assert!(!unlimited.contains(b"k").unwrap());
    }

    /// With a lease timeout, a reserve that finds the record in flight for that long
    /// takes it over: a higher epoch, the old lease fenced, durably (across a reopen);
    /// before the timeout it answers in flight, and the timeout counts from the last
    /// grant.
    #[test]
    fn a_lease_timeout_turns_a_stuck_reserve_into_a_take_over() {
        let disk = MemStorage::new();
        let clock = clock_at(START);
        let timed = || Config {
            lease_timeout_ms: Some(1_500),
            ..config(&disk, &clock)
        };
        let key = b"\x00\x01t\x00\x01ok";
        let engine = Engine::open(&timed()).unwrap();
        let Reserved::Acquired(first) = engine.reserve(key, b"req").unwrap() else {
            panic!("first reserve acquires");
        };
        clock.forward(std::time::Duration::from_millis(1_000));
        assert!(matches!(
            engine.reserve(key, b"req").unwrap(),
            Reserved::InFlight { .. }
        ));
        clock.forward(std::time::Duration::from_millis(500));
        let Reserved::TakenOver { grant, old } = engine.reserve(key, b"req").unwrap() else {
            panic!("a stuck record is taken over");
        };
        assert_eq!(old, first.lease_id);
        assert!(grant.lease_id > first.lease_id);
        assert_eq!(grant.since_ms, first.since_ms);
        // The new lease was granted just now: not taken over again yet.
        assert!(matches!(
            engine.reserve(key, b"req").unwrap(),
            Reserved::InFlight { .. }
        ));
        drop(engine);
        let engine = Engine::open(&timed()).unwrap();
        assert!(matches!(
            engine.resume(key, first.lease_id),
            Err(Error::Fenced)
        ));
        assert!(engine.resume(key, grant.lease_id).is_ok());
        assert!(matches!(
            engine.reserve(key, b"req").unwrap(),
            Reserved::InFlight { .. }
        ));
    }

    /// Replay stamps each key with the bucket it was admitted in, not with the bucket of
    /// the segment it reached: a restart neither lengthens nor shortens a window.
    #[test]
    fn keys_replay_with_their_own_bucket() {
        let disk = MemStorage::new();
        let clock = clock_at(START);
        let engine = Engine::open(&config(&disk, &clock)).unwrap();
        assert!(engine.insert_if_absent(b"early").unwrap());
        set_bucket(&clock, START + 3);
        assert!(engine.insert_if_absent(b"late").unwrap());
        drop(engine);
        let hasher = secret_hasher(&disk);
        let stalled = hasher.key(b"stalled");
        // Admitted in bucket START, logged after the writer moved to bucket START + 3.
        append_to_newest(
            &disk,
            &[LogEntry::Keys {
                bucket: START,
                fingerprints: &[stalled],
            }],
        );
        set_bucket(&clock, START + SPAN);
        let engine = Engine::open(&config(&disk, &clock)).unwrap();
        assert!(
            engine.contains(b"stalled").unwrap(),
            "still inside its window"
        );
        drop(engine);
        set_bucket(&clock, START + SPAN + 1);
        let engine = Engine::open(&config(&disk, &clock)).unwrap();
        assert!(!engine.contains(b"early").unwrap());
        assert!(
            !engine.contains(b"stalled").unwrap(),
            "its window ended with bucket START + SPAN, whatever segment holds it"
        );
        assert!(engine.contains(b"late").unwrap());
    }

    /// An entry stamped after its segment's bucket cannot come from the writer.
    #[test]
    fn an_entry_stamped_after_its_segment_is_corruption() {
        let disk = MemStorage::new();
        let clock = clock_at(START);
        let engine = Engine::open(&config(&disk, &clock)).unwrap();
        assert!(engine.insert_if_absent(b"k").unwrap());
        drop(engine);
        let stamp = START + 2;
        let hasher = secret_hasher(&disk);
        append_to_newest(
            &disk,
            &[LogEntry::Keys {
                bucket: stamp,
                fingerprints: &[hasher.key(b"future")],
            }],
        );
        // `verify` applies the same rule as `open`.
        let report = crate::wal::verify_with(&disk, Path::new("/db")).unwrap();
        assert!(
            report
                .segments
                .iter()
                .any(|segment| matches!(segment.state, crate::wal::SegmentState::Corrupted { .. })),
            "{report:?}"
        );
        assert!(matches!(
            Engine::open(&config(&disk, &clock)),
            Err(Error::Corrupted { .. })
        ));
    }
}
