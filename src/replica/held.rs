//! What the replica's stream holds, read one way by the shipper (at open, to resume) and
//! by restores and standbys (to know where each segment ends).

use std::collections::BTreeMap;
use std::path::PathBuf;

use async_nats::HeaderMap;
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::{LastRawMessageErrorKind, Stream};
use futures_util::StreamExt;

use super::layout::{
    LENGTH_HEADER, OFFSET_HEADER, parse_run_subject, parse_segment_subject, runs_filter,
    segments_filter, stream_name,
};
use super::unavailable;
use crate::base::{Error, Result};

/// The last message on `subject`, if any.
pub(super) async fn last_message(stream: &Stream, subject: &str) -> Result<Option<StreamMessage>> {
    match stream.get_last_raw_message_by_subject(subject).await {
        Ok(message) => Ok(Some(message)),
        Err(err) if err.kind() == LastRawMessageErrorKind::NoMessageFound => Ok(None),
        Err(err) => Err(unavailable(err)),
    }
}

/// Where the stream's copy of the segment on `subject` of replica `name` ends: the offset
/// of its last chunk plus that chunk's length; `None` if it holds no chunk. A chunk
/// without its offset is `Corrupted`.
pub(super) async fn segment_end(stream: &Stream, name: &str, subject: &str) -> Result<Option<u64>> {
    let Some(last) = last_message(stream, subject).await? else {
        return Ok(None);
    };
    let damaged = |reason: &str| Error::Corrupted {
        path: replica_path(name, subject),
        offset: last.sequence,
        reason: reason.to_owned(),
    };
    let offset = offset_of(&last.headers).ok_or_else(|| damaged("a chunk without its offset"))?;
    offset
        .checked_add(last.payload.len() as u64)
        .map(Some)
        .ok_or_else(|| damaged("a chunk whose offset overflows"))
}

/// Every segment subject of replica `name`: the segment, the subject, and how many
/// chunks it holds.
pub(super) async fn segment_subjects(
    stream: &Stream,
    name: &str,
) -> Result<Vec<((u64, u32), String, usize)>> {
    let mut subjects = stream
        .info_with_subjects(segments_filter(name))
        .await
        .map_err(unavailable)?;
    let mut found = Vec::new();
    while let Some(subject) = subjects.next().await {
        let (subject, count) = subject.map_err(unavailable)?;
        if let Some(id) = parse_segment_subject(name, &subject) {
            found.push((id, subject, count));
        }
    }
    Ok(found)
}

/// What the stream holds of one sealed run.
#[derive(Debug, Clone)]
pub(super) struct HeldRun {
    pub(super) subject: String,
    /// Where its last chunk ends.
    pub(super) end: u64,
    /// The run's whole length, as its last chunk gives it.
    pub(super) len: u64,
}

impl HeldRun {
    /// Whether the stream holds the whole run.
    pub(super) fn complete(&self) -> bool {
        self.end == self.len
    }
}

/// Every sealed run the stream of replica `name` holds a chunk of, by run id. A chunk
/// without its offset or length is `Corrupted`.
pub(super) async fn run_subjects(stream: &Stream, name: &str) -> Result<BTreeMap<u64, HeldRun>> {
    let mut subjects = stream
        .info_with_subjects(runs_filter(name))
        .await
        .map_err(unavailable)?;
    let mut listed = Vec::new();
    while let Some(subject) = subjects.next().await {
        let (subject, _) = subject.map_err(unavailable)?;
        if let Some(run_id) = parse_run_subject(name, &subject) {
            listed.push((run_id, subject));
        }
    }
    let mut found = BTreeMap::new();
    for (run_id, subject) in listed {
        let Some(last) = last_message(stream, &subject).await? else {
            continue;
        };
        let damaged = || Error::Corrupted {
            path: replica_path(name, &subject),
            offset: last.sequence,
            reason: "a run chunk without its offset or length".to_owned(),
        };
        let offset = offset_of(&last.headers).ok_or_else(damaged)?;
        let len = length_of(&last.headers).ok_or_else(damaged)?;
        let end = offset
            .checked_add(last.payload.len() as u64)
            .ok_or_else(damaged)?;
        if end > len {
            return Err(Error::Corrupted {
                path: replica_path(name, &subject),
                offset: last.sequence,
                reason: format!("a run chunk ends at {end}, past the run's {len} bytes"),
            });
        }
        found.insert(run_id, HeldRun { subject, end, len });
    }
    Ok(found)
}

/// The run length a run's chunk carries.
pub(super) fn length_of(headers: &HeaderMap) -> Option<u64> {
    headers.get(LENGTH_HEADER)?.as_str().parse().ok()
}

/// The segment offset a chunk carries.
pub(super) fn offset_of(headers: &HeaderMap) -> Option<u64> {
    headers.get(OFFSET_HEADER)?.as_str().parse().ok()
}

/// A path naming a subject of a replica, for errors: `jetstream:ONCEDB_<name>/<subject>`.
pub(super) fn replica_path(name: &str, subject: &str) -> PathBuf {
    PathBuf::from(format!("jetstream:{}/{subject}", stream_name(name)))
}
