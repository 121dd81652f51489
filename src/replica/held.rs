//! What the replica's stream holds, read one way by the shipper (at open, to resume) and
//! by restores and standbys (to know where each segment ends).

use std::path::PathBuf;

use async_nats::HeaderMap;
use async_nats::jetstream::message::StreamMessage;
use async_nats::jetstream::stream::{LastRawMessageErrorKind, Stream};
use futures_util::StreamExt;

use super::layout::{OFFSET_HEADER, parse_segment_subject, segments_filter, stream_name};
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
    let offset = offset_of(&last.headers).ok_or_else(|| Error::Corrupted {
        path: replica_path(name, subject),
        offset: last.sequence,
        reason: "a chunk without its offset".to_owned(),
    })?;
    Ok(Some(offset + last.payload.len() as u64))
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

/// The segment offset a chunk carries.
pub(super) fn offset_of(headers: &HeaderMap) -> Option<u64> {
    headers.get(OFFSET_HEADER)?.as_str().parse().ok()
}

/// A path naming a subject of a replica, for errors: `jetstream:ONCEDB_<name>/<subject>`.
pub(super) fn replica_path(name: &str, subject: &str) -> PathBuf {
    PathBuf::from(format!("jetstream:{}/{subject}", stream_name(name)))
}
