//! Reading one stored response back: a finished record whose response stays in the log
//! keeps only the span of its finish frame in memory, and a replay reads that frame
//! with one positioned read.

use std::path::Path;
use std::sync::Arc;

use super::entry::{DecodedEntry, DecodedFinish, decode_entry};
use super::format::{FrameError, MAX_APPEND_BYTES, decode_frame_at};
use crate::base::{Error, Fingerprint, LogSpan, Result};
use crate::io::{ReadAtFile, Storage};

/// Where a logged frame is read from: the segment's handle kept open for replays, or
/// else its path (which errors name either way).
pub(crate) struct FrameSource<'a> {
    pub(crate) path: &'a Path,
    pub(crate) storage: &'a dyn Storage,
    pub(crate) file: Option<&'a dyn ReadAtFile>,
}

impl FrameSource<'_> {
    fn read_at(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        match self.file {
            Some(file) => file.read_at(offset, buf),
            None => self.storage.read_at(self.path, offset, buf),
        }
    }
}

/// The response of the finish frame at `span` of the segment at `path`. The frame must
/// verify (position, header check, checksum under `seed`) and end lease `lease_id` of
/// `fingerprint` with a response; anything else is `Corrupted`, since memory said that
/// frame was written there.
pub(crate) fn read(
    source: FrameSource<'_>,
    seed: u64,
    span: LogSpan,
    (fingerprint, lease_id): (Fingerprint, u64),
) -> Result<Arc<[u8]>> {
    read_entry(&source, (seed, span), |entry| match entry {
        DecodedEntry::Finish {
            fingerprint: found,
            lease_id: found_lease,
            finish: DecodedFinish::Complete(response) | DecodedFinish::Fail(response),
            ..
        } if found == fingerprint && found_lease == lease_id => Ok(Arc::from(response)),
        _ => Err("the frame is not the record's finish entry"),
    })
}

/// The scoped key of the reserve frame at `span` of the segment at `path`, which must
/// verify and reserve a record of `fingerprint` (under any lease: a take-over keeps the
/// key and its frame); anything else is `Corrupted`.
pub(crate) fn read_key(
    source: FrameSource<'_>,
    seed: u64,
    span: LogSpan,
    fingerprint: Fingerprint,
) -> Result<Box<[u8]>> {
    read_entry(&source, (seed, span), |entry| match entry {
        DecodedEntry::Reserve {
            fingerprint: found,
            scoped_key,
            ..
        } if found == fingerprint => Ok(Box::from(scoped_key)),
        _ => Err("the frame is not the record's reserve entry"),
    })
}

/// Reads the frame at `span` with one positioned read, checks that it verifies and spans
/// exactly `span`, and hands its entry to `pick`.
fn read_entry<T>(
    source: &FrameSource<'_>,
    (seed, span): (u64, LogSpan),
    pick: impl FnOnce(DecodedEntry<'_>) -> std::result::Result<T, &'static str>,
) -> Result<T> {
    let corrupted = |reason: &str| Error::Corrupted {
        path: source.path.to_path_buf(),
        offset: u64::from(span.start),
        reason: reason.to_owned(),
    };
    let len = span.len as usize;
    if len > MAX_APPEND_BYTES {
        return Err(corrupted("a logged frame's span exceeds the frame limit"));
    }
    let mut frame = vec![0; len];
    source.read_at(u64::from(span.start), &mut frame)?;
    let decoded = decode_frame_at(&frame, span.start as usize, seed).map_err(|err| match err {
        FrameError::Truncated => corrupted("the logged frame is cut short"),
        FrameError::Invalid(reason) => corrupted(reason),
    })?;
    if decoded.end - decoded.start != len {
        return Err(corrupted("the logged frame's length changed"));
    }
    let entry =
        decode_entry(decoded.kind, decoded.payload, u64::from(span.start)).map_err(corrupted)?;
    pick(entry).map_err(corrupted)
}
