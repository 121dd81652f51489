//! Opening a durable store: lock, manifest, segment replay, torn-tail repair, expiry.

use std::collections::BTreeSet;
use std::io::ErrorKind;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::db::Inner;
use crate::error::{Error, Result};
use crate::fingerprint::{Fingerprint, random_secret};
use crate::index::window::Window;
use crate::io::Storage;
use crate::journal::{Journal, JournalConfig};
use crate::options::Options;
use crate::record::Finish;
use crate::segment::entry::{DecodedEntry, KIND_COMPLETE, KIND_FAIL, decode_entry};
use crate::segment::format::{FrameError, SEGMENT_HEADER_LEN, SegmentHeader, decode_frame};
use crate::segment::manifest::{MANIFEST_NAME, Manifest};
use crate::segment::{parse_segment_name, segment_path};

/// Name of the lock file inside the database directory.
pub(crate) const LOCK_NAME: &str = "LOCK";
/// Largest segment file recovery reads: the size limit plus two maximal records.
const MAX_SEGMENT_FILE_BYTES: u64 = crate::options::MAX_SEGMENT_BYTES_LIMIT
    + 2 * (crate::segment::format::MAX_PAYLOAD_LEN as u64 + 16);

/// Keys and records the live segments admit, counted from their valid frames, so the
/// tables can be sized once instead of growing during replay. Damage is left to replay
/// to report; a file that cannot be read counts as empty here.
fn count_logged_keys(storage: &dyn Storage, dir: &Path, segments: &[(u64, u32)]) -> u64 {
    let mut keys = 0;
    for &(bucket, seq) in segments {
        let Ok(bytes) = storage.read(&segment_path(dir, bucket, seq), MAX_SEGMENT_FILE_BYTES)
        else {
            continue;
        };
        let mut offset = SEGMENT_HEADER_LEN;
        while let Ok(frame) = decode_frame(&bytes, offset) {
            keys += match decode_entry(frame.kind, frame.payload) {
                Ok(DecodedEntry::Keys(fingerprints)) => fingerprints.iter().count() as u64,
                Ok(DecodedEntry::Reserve { .. }) => 1,
                _ => 0,
            };
            offset = frame.end;
        }
    }
    keys
}

/// What replay found, for stats and the writer.
#[derive(Debug, Default)]
struct Replayed {
    records: u64,
    truncated_bytes: u64,
    segments: BTreeSet<(u64, u32)>,
    deleted: u64,
}

/// Opens the durable store of `options.dir`.
pub(crate) fn open(options: &Options) -> Result<Inner> {
    let dir = options
        .dir
        .clone()
        .expect("durable options have a directory");
    let storage: &dyn Storage = &*options.storage;
    storage.create_dir_all(&dir)?;
    let lock = storage.lock(&dir.join(LOCK_NAME)).map_err(|err| {
        if err.kind() == ErrorKind::WouldBlock {
            Error::Locked(dir.clone())
        } else {
            Error::Io(err)
        }
    })?;
    let segments = list_segments(storage, &dir)?;
    let manifest = load_or_create_manifest(options, storage, &dir, segments.is_empty())?;
    let window = Window::new(options.window_ms, options.bucket_width_ms);
    let clock_bucket = window.bucket_of(options.clock.now_ms());
    let newest = segments.last().map_or(0, |&(bucket, _)| bucket);
    let high_water = clock_bucket.max(newest);

    let mut replayed = Replayed::default();
    let live = delete_expired(storage, &dir, &segments, window, high_water, &mut replayed)?;
    let start = live.first().map_or(high_water, |&(bucket, _)| bucket);
    let presize = options.clone().expected_keys(
        options
            .expected_keys
            .max(count_logged_keys(storage, &dir, &live)),
    );
    let mut inner = Inner::new(&presize, manifest.secret, Some(start), None);
    for (index, &(bucket, seq)) in live.iter().enumerate() {
        let newest = index + 1 == live.len();
        let segment = Segment {
            path: segment_path(&dir, bucket, seq),
            bucket,
            seq,
            database_id: manifest.database_id(),
        };
        if replay_segment(storage, &inner, &segment, newest, &mut replayed)? {
            replayed.segments.insert((bucket, seq));
        }
    }
    inner.raise_high_water(high_water);
    inner.set_opened_bucket(high_water);
    inner.journal = Some(Journal::new(JournalConfig {
        storage: Arc::clone(&options.storage),
        dir,
        durability: options.durability,
        window,
        database_id: manifest.database_id(),
        segment_max_bytes: options.segment_max_bytes,
        segments: replayed.segments,
        lock,
        recovered_records: replayed.records,
        recovered_truncated_bytes: replayed.truncated_bytes,
        segments_deleted: replayed.deleted,
    })?);
    Ok(inner)
}

/// Segment files of `dir` in replay order. A stale manifest temp file is removed.
fn list_segments(storage: &dyn Storage, dir: &Path) -> Result<Vec<(u64, u32)>> {
    let mut segments = Vec::new();
    for path in storage.list(dir)? {
        if let Some(id) = parse_segment_name(&path) {
            segments.push(id);
        } else if path.file_name().is_some_and(|name| name == "MANIFEST.tmp") {
            storage.remove(&path)?;
        }
    }
    segments.sort_unstable();
    Ok(segments)
}

fn load_or_create_manifest(
    options: &Options,
    storage: &dyn Storage,
    dir: &Path,
    no_segments: bool,
) -> Result<Manifest> {
    if let Some(manifest) = Manifest::load(storage, dir)? {
        if manifest.window_ms != options.window_ms
            || manifest.bucket_width_ms != options.bucket_width_ms
        {
            return Err(Error::IncompatibleOptions(format!(
                "{} was created with window {} ms and bucket_width {} ms; opened with {} ms and {} ms",
                dir.display(),
                manifest.window_ms,
                manifest.bucket_width_ms,
                options.window_ms,
                options.bucket_width_ms
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
        window_ms: options.window_ms,
        bucket_width_ms: options.bucket_width_ms,
    };
    manifest.store(storage, dir)?;
    Ok(manifest)
}

/// Unlinks segments whose bucket has left the window; returns the rest.
fn delete_expired(
    storage: &dyn Storage,
    dir: &Path,
    segments: &[(u64, u32)],
    window: Window,
    current: u64,
    replayed: &mut Replayed,
) -> Result<Vec<(u64, u32)>> {
    let (expired, live): (Vec<_>, Vec<_>) = segments
        .iter()
        .partition(|&&(bucket, _)| !window.is_live(bucket, current));
    for &(bucket, seq) in &expired {
        storage.remove(&segment_path(dir, bucket, seq))?;
        replayed.deleted += 1;
    }
    if !expired.is_empty() {
        storage.sync_dir(dir)?;
    }
    Ok(live)
}

struct Segment {
    path: PathBuf,
    bucket: u64,
    seq: u32,
    database_id: u64,
}

fn corrupted(path: &Path, offset: usize, reason: &str) -> Error {
    Error::Corrupted {
        path: path.to_path_buf(),
        offset: offset as u64,
        reason: reason.to_string(),
    }
}

/// Replays one segment into `inner`. Only the newest segment may end in a torn write:
/// its tail is cut at the last valid frame (and the cut fsynced); anywhere else damage is
/// `Error::Corrupted`. Returns false if the newest segment had no valid header and was
/// removed (a crash while creating it).
fn replay_segment(
    storage: &dyn Storage,
    inner: &Inner,
    segment: &Segment,
    newest: bool,
    replayed: &mut Replayed,
) -> Result<bool> {
    let path = &segment.path;
    let bytes = match storage.read(path, MAX_SEGMENT_FILE_BYTES) {
        Ok(bytes) => bytes,
        Err(err) if err.kind() == ErrorKind::InvalidData => {
            return Err(corrupted(path, 0, "segment file exceeds the size limit"));
        }
        Err(err) => return Err(err.into()),
    };
    let header = match SegmentHeader::decode(&bytes) {
        Ok(header) => header,
        Err(_) if newest && bytes.len() <= SEGMENT_HEADER_LEN => {
            storage.remove(path)?;
            storage.sync_dir(path.parent().unwrap_or(Path::new(".")))?;
            return Ok(false);
        }
        Err(reason) => return Err(corrupted(path, 0, reason)),
    };
    if header.bucket != segment.bucket || header.seq != segment.seq {
        return Err(corrupted(
            path,
            0,
            "segment header does not match its file name",
        ));
    }
    if header.database_id != segment.database_id {
        return Err(corrupted(path, 0, "segment belongs to another database"));
    }
    let mut offset = SEGMENT_HEADER_LEN;
    while offset < bytes.len() {
        let frame = match decode_frame(&bytes, offset) {
            Ok(frame) => frame,
            Err(_) if newest => {
                truncate_tail(storage, path, offset, bytes.len(), replayed)?;
                return Ok(true);
            }
            Err(FrameError::Truncated) => {
                return Err(corrupted(path, offset, "record is truncated"));
            }
            Err(FrameError::Invalid(reason)) => return Err(corrupted(path, offset, reason)),
        };
        let entry = decode_entry(frame.kind, frame.payload)
            .map_err(|reason| corrupted(path, offset, reason))?;
        apply(inner, segment.bucket, entry);
        replayed.records += 1;
        offset = frame.end;
    }
    if newest {
        // The previous process may have left unsynced appends in the page cache; make
        // them durable before any newer segment can be created behind them.
        storage.open_append(path, false)?.sync()?;
    }
    Ok(true)
}

fn truncate_tail(
    storage: &dyn Storage,
    path: &Path,
    offset: usize,
    len: usize,
    replayed: &mut Replayed,
) -> Result<()> {
    let mut file = storage.open_append(path, false)?;
    file.truncate(offset as u64)?;
    file.sync()?;
    replayed.truncated_bytes += (len - offset) as u64;
    Ok(())
}

/// Applies one replayed entry in `bucket`.
fn apply(inner: &Inner, bucket: u64, entry: DecodedEntry<'_>) {
    match entry {
        DecodedEntry::Keys(fingerprints) => {
            let fingerprints: Vec<Fingerprint> = fingerprints.iter().collect();
            inner.restore_keys(bucket, &fingerprints);
        }
        DecodedEntry::Reserve {
            fingerprint,
            lease_id,
            request_hash,
            created_ms,
            scoped_key,
        } => {
            inner.bump_lease_ids(lease_id);
            inner.restore_shard(fingerprint, bucket).store_record(
                fingerprint,
                scoped_key.into(),
                request_hash,
                lease_id,
                created_ms,
            );
        }
        DecodedEntry::Finish {
            kind,
            fingerprint,
            lease_id,
            at_ms,
            response,
        } => {
            let finish = match kind {
                KIND_COMPLETE => Finish::Complete(Arc::from(response)),
                KIND_FAIL => Finish::Fail(Arc::from(response)),
                _ => Finish::Release,
            };
            inner.restore_shard(fingerprint, bucket).restore_finish(
                fingerprint,
                lease_id,
                &finish,
                at_ms,
            );
        }
    }
}
