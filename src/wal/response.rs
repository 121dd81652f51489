//! Reading one stored response back: a finished record whose response stays in the log
//! keeps only the span of its finish frame in memory, and a replay reads that frame
//! with one positioned read.

use std::path::Path;
use std::sync::Arc;

use super::entry::{DecodedEntry, DecodedFinish, decode_entry};
use super::format::{FrameError, MAX_APPEND_BYTES, decode_frame_at};
use crate::base::{Error, Fingerprint, LogSpan, Result};
use crate::io::Storage;

/// The response of the finish frame at `span` of the segment at `path`. The frame must
/// verify (position, header check, checksum under `seed`) and end lease `lease_id` of
/// `fingerprint` with a response; anything else is `Corrupted`, since memory said that
/// frame was written there.
pub(crate) fn read(
    storage: &dyn Storage,
    path: &Path,
    seed: u64,
    span: LogSpan,
    (fingerprint, lease_id): (Fingerprint, u64),
) -> Result<Arc<[u8]>> {
    let corrupted = |reason: &str| Error::Corrupted {
        path: path.to_path_buf(),
        offset: u64::from(span.start),
        reason: reason.to_owned(),
    };
    let len = span.len as usize;
    if len > MAX_APPEND_BYTES {
        return Err(corrupted("a response span exceeds the frame limit"));
    }
    let mut frame = vec![0; len];
    storage.read_at(path, u64::from(span.start), &mut frame)?;
    let decoded = decode_frame_at(&frame, span.start as usize, seed).map_err(|err| match err {
        FrameError::Truncated => corrupted("the response frame is cut short"),
        FrameError::Invalid(reason) => corrupted(reason),
    })?;
    if decoded.end - decoded.start != len {
        return Err(corrupted("the response frame's length changed"));
    }
    match decode_entry(decoded.kind, decoded.payload, u64::from(span.start)).map_err(corrupted)? {
        DecodedEntry::Finish {
            fingerprint: found,
            lease_id: found_lease,
            finish: DecodedFinish::Complete(response) | DecodedFinish::Fail(response),
            ..
        } if found == fingerprint && found_lease == lease_id => Ok(Arc::from(response)),
        _ => Err(corrupted("the frame is not the record's finish entry")),
    }
}
