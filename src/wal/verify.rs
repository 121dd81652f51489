//! `verify`: reads a store's files and reports what `Db::open` would find, changing
//! nothing.

use std::io::ErrorKind;
use std::path::Path;

use super::archive::ARCHIVE_MARKER;
use super::entry::DecodedEntry;
use super::format::{MAX_SEGMENT_FILE_BYTES, frame_seed};
use super::manifest::{MANIFEST_NAME, Manifest};
use super::names::{LOCK_NAME, MANIFEST_TEMP_NAME, is_prepared_name, parse_segment_name};
use super::report::{RunReport, SegmentReport, SegmentState, VerifyReport};
use super::run::{RunKind, is_temp_run_name, parse_run_name};
use super::scan::{Verdict, scan};
use crate::base::{Error, Result};
use crate::io::Storage;

/// Reads the store in `dir` through `storage` and reports what `Db::open` would find.
pub(crate) fn verify_with(storage: &dyn Storage, dir: &Path) -> Result<VerifyReport> {
    let files = storage.list(dir)?;
    let lock_path = dir.join(LOCK_NAME);
    // Lock only a store that has a lock file: creating one would change the directory.
    let _lock = if files.contains(&lock_path) {
        Some(storage.lock(&lock_path).map_err(|err| {
            if err.kind() == ErrorKind::WouldBlock {
                Error::Locked(dir.to_path_buf())
            } else {
                Error::Io(err)
            }
        })?)
    } else {
        None
    };
    let mut report = VerifyReport::default();
    let mut segments = Vec::new();
    let mut runs = Vec::new();
    for path in files {
        match parse_segment_name(&path) {
            Some(id) => segments.push(id),
            None if parse_run_name(&path).is_some() => runs.push(path),
            None if is_temp_run_name(&path) => {}
            None => {
                let known = [LOCK_NAME, MANIFEST_NAME, MANIFEST_TEMP_NAME, ARCHIVE_MARKER];
                if !is_prepared_name(&path)
                    && !path
                        .file_name()
                        .is_some_and(|name| known.iter().any(|k| name == *k))
                {
                    report.stray_files.push(path);
                }
            }
        }
    }
    segments.sort_unstable();
    let manifest = match Manifest::load(storage, dir) {
        Ok(Some(manifest)) => manifest,
        Ok(None) => {
            report.manifest_problem = Some("the manifest is missing".into());
            return Ok(report);
        }
        Err(Error::Corrupted { reason, .. }) => {
            report.manifest_problem = Some(reason);
            return Ok(report);
        }
        Err(err) => return Err(err),
    };
    let seed = frame_seed(manifest.secret);
    for (index, &(bucket, seq)) in segments.iter().enumerate() {
        let newest = index + 1 == segments.len();
        let path = super::names::segment_path(dir, bucket, seq);
        report.segments.push(verify_segment(
            storage,
            &path,
            (bucket, seq),
            newest,
            seed,
            manifest.database_id(),
        )?);
    }
    runs.sort();
    for path in runs {
        report
            .runs
            .push(verify_run(storage, &path, manifest.database_id())?);
    }
    Ok(report)
}

/// Opens the run at `path` as a store would, then reads every data page against its
/// fence's checksum.
fn verify_run(storage: &dyn Storage, path: &Path, database_id: u64) -> Result<RunReport> {
    let mut report = RunReport {
        path: path.to_path_buf(),
        keys: 0,
        records: 0,
        buckets: None,
        filter_bytes: 0,
        damage: None,
    };
    let checked = super::run::open(storage, path, database_id).and_then(|run| {
        let summary = *run.summary();
        match summary.kind {
            RunKind::Keys => report.keys = summary.entries,
            RunKind::Records => report.records = summary.entries,
        }
        report.buckets = Some((summary.oldest_bucket, summary.newest_bucket));
        report.filter_bytes = run.heap_bytes() as u64;
        run.check_pages(storage)
    });
    match checked {
        Ok(()) => {}
        Err(Error::Corrupted { offset, reason, .. }) => report.damage = Some((offset, reason)),
        Err(err) => return Err(err),
    }
    Ok(report)
}

fn verify_segment(
    storage: &dyn Storage,
    path: &Path,
    (bucket, seq): (u64, u32),
    newest: bool,
    seed: u64,
    database_id: u64,
) -> Result<SegmentReport> {
    let mut segment = SegmentReport {
        path: path.to_path_buf(),
        bucket,
        seq,
        bytes: 0,
        frames: 0,
        keys: 0,
        records: 0,
        finishes: 0,
        versions: 0,
        stamps: None,
        sealed: false,
        state: SegmentState::Clean,
    };
    let bytes = match storage.read(path, MAX_SEGMENT_FILE_BYTES) {
        Ok(bytes) => bytes,
        Err(err) if err.kind() == ErrorKind::InvalidData => {
            segment.state = corrupted(0, "segment file exceeds the size limit");
            return Ok(segment);
        }
        Err(err) => return Err(err.into()),
    };
    segment.bytes = bytes.len() as u64;
    let scanned = scan(&bytes, seed);
    if let Some(problem) = header_problem(&scanned.header, bucket, seq, database_id) {
        segment.state = if newest && bytes.len() <= super::format::SEGMENT_HEADER_LEN {
            SegmentState::TornTail { offset: 0 }
        } else {
            corrupted(0, problem)
        };
        return Ok(segment);
    }
    let mut misplaced = None;
    for (frame, entry) in &scanned.frames {
        segment.frames += 1;
        if misplaced.is_none() {
            misplaced = entry
                .placement_problem(bucket)
                .map(|problem| (frame.start as u64, problem));
        }
        let stamp = match entry {
            DecodedEntry::Keys {
                bucket,
                fingerprints,
            } => {
                segment.keys += fingerprints.len() as u64;
                Some(*bucket)
            }
            DecodedEntry::Reserve { bucket, .. } => {
                segment.records += 1;
                Some(*bucket)
            }
            DecodedEntry::Finish { .. } => {
                segment.finishes += 1;
                None
            }
            DecodedEntry::Advance { bucket, .. } => {
                segment.versions += 1;
                Some(*bucket)
            }
            DecodedEntry::Mark { .. }
            | DecodedEntry::Note { .. }
            | DecodedEntry::TakeOver { .. } => None,
        };
        if let Some(stamp) = stamp {
            let (low, high) = segment.stamps.unwrap_or((stamp, stamp));
            segment.stamps = Some((low.min(stamp), high.max(stamp)));
        }
    }
    segment.sealed = scanned.sealed;
    segment.state = match scanned.verdict(newest) {
        Verdict::Clean => SegmentState::Clean,
        Verdict::TornTail { offset, .. } => SegmentState::TornTail { offset },
        Verdict::Corrupted { offset, reason } => corrupted(offset, reason),
    };
    // An entry `Db::open` would refuse comes before any damage found after it.
    if let Some((offset, problem)) = misplaced {
        let first = match &segment.state {
            SegmentState::Corrupted { offset: at, .. } => offset < *at,
            _ => true,
        };
        if first {
            segment.state = corrupted(offset, problem);
        }
    }
    Ok(segment)
}

/// What is wrong with a segment's header, given the name it was found under.
pub(crate) fn header_problem(
    header: &Result<super::format::SegmentHeader, &'static str>,
    bucket: u64,
    seq: u32,
    database_id: u64,
) -> Option<&'static str> {
    match header {
        Err(reason) => Some(reason),
        Ok(header) if header.bucket != bucket || header.seq != seq => {
            Some("segment header does not match its file name")
        }
        Ok(header) if header.database_id != database_id => {
            Some("segment belongs to another database")
        }
        Ok(_) => None,
    }
}

fn corrupted(offset: u64, reason: &str) -> SegmentState {
    SegmentState::Corrupted {
        offset,
        reason: reason.to_string(),
    }
}
