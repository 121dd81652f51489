//! Restore: a store rebuilt in an empty directory from its replica. The replica's
//! manifest is read first (its window decides which segments are still live); then every
//! chunk of the live segments, in stream order, is appended to its segment file at the
//! offset it carries (a chunk already held, re-sent after a lost acknowledgement, is
//! skipped; a gap is `Corrupted`); every file is fsynced, the manifest written last, and
//! the directory fsynced. Opening the directory then checks every frame's checksum, as
//! any open does, and claims the replica.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use async_nats::jetstream::consumer::pull::OrderedConfig;
use async_nats::jetstream::stream::LastRawMessageErrorKind;
use futures_util::StreamExt;

use super::layout::{manifest_subject, parse_segment_subject, segments_filter, stream_name};
use super::shipper::offset_of;
use super::{Replication, unavailable};
use crate::base::{Error, Result, Window};
use crate::io::{Storage, StorageFile};
use crate::wal::{Manifest, segment_path};

/// What a restore fetched.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RestoreReport {
    /// Segment files written.
    pub segments: u64,
    /// Bytes written into them.
    pub bytes: u64,
    /// Messages read from the replica's stream.
    pub messages: u64,
    /// Messages of segments whose bucket had left the window, skipped.
    pub expired_messages: u64,
}

/// Fetches replica `replication` into the empty directory `dir` (on `storage`), keeping
/// the segments live at `now_ms`. `progress` is told the messages read so far and the
/// total.
pub(crate) fn fetch(
    replication: &Replication,
    storage: &dyn Storage,
    dir: &Path,
    now_ms: u64,
    progress: &mut (dyn FnMut(u64, u64) + Send),
) -> Result<RestoreReport> {
    replication.check()?;
    crate::wal::prepare_checkpoint_dir(storage, dir)?;
    // On a thread of its own: the caller may be on an async runtime of its own, where a
    // runtime cannot be entered.
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                runtime.block_on(fetch_async(replication, storage, dir, now_ms, progress))
            })
            .join()
            .unwrap_or_else(|_| Err(unavailable("the restore thread panicked")))
    })
}

async fn fetch_async(
    replication: &Replication,
    storage: &dyn Storage,
    dir: &Path,
    now_ms: u64,
    progress: &mut (dyn FnMut(u64, u64) + Send),
) -> Result<RestoreReport> {
    let name = replication.name.as_str();
    let client = super::connect(replication).await?;
    let js = async_nats::jetstream::new(client);
    let mut stream = js.get_stream(stream_name(name)).await.map_err(|err| {
        use async_nats::jetstream::context::GetStreamErrorKind;
        match err.kind() {
            GetStreamErrorKind::JetStream(found) if found.code() == 404 => Error::ReplicaNotFound {
                replica: name.to_owned(),
            },
            _ => unavailable(err),
        }
    })?;
    let manifest_message = match stream
        .get_last_raw_message_by_subject(&manifest_subject(name))
        .await
    {
        Ok(message) => message,
        Err(err) if err.kind() == LastRawMessageErrorKind::NoMessageFound => {
            return Err(Error::InvalidOptions(format!(
                "replica {name} holds no manifest: nothing to restore"
            )));
        }
        Err(err) => return Err(unavailable(err)),
    };
    let manifest =
        Manifest::decode(&manifest_message.payload).map_err(|reason| Error::Corrupted {
            path: replica_path(name, &manifest_subject(name)),
            offset: manifest_message.sequence,
            reason: reason.to_owned(),
        })?;
    let window = Window::new(manifest.window_ms, manifest.bucket_width_ms);
    let current = window.bucket_of(now_ms);
    let total = stream.info().await.map_err(unavailable)?.state.messages;
    let mut report = RestoreReport::default();
    let mut files: Files = BTreeMap::new();
    // Where each live segment ends, as the stream's leader says: the restore is done once
    // every file reaches it (a consumer placed on a replica that is catching up delivers
    // late, never less).
    let expected = segment_ends(&stream, name, &window, current).await?;
    if !expected.is_empty() {
        let consumer = stream
            .create_consumer(OrderedConfig {
                filter_subject: segments_filter(name),
                ..Default::default()
            })
            .await
            .map_err(unavailable)?;
        let mut messages = consumer.messages().await.map_err(unavailable)?;
        while !reached(&expected, &files) {
            let next = tokio::time::timeout(STALL_TIMEOUT, messages.next())
                .await
                .map_err(|_| {
                    unavailable(format!("replica {name}: no message for {STALL_TIMEOUT:?}"))
                })?;
            let Some(message) = next else {
                return Err(unavailable(format!(
                    "replica {name}: the consumer ended early"
                )));
            };
            let message = message.map_err(unavailable)?;
            report.messages += 1;
            progress(report.messages, total);
            let chunk = Chunk {
                name,
                window: &window,
                current,
            };
            let live = apply(storage, dir, &chunk, &message, &mut files, &mut report)?;
            report.expired_messages += u64::from(!live);
        }
    }
    for (_, (mut file, _)) in files {
        file.sync()?;
    }
    manifest.store(storage, dir)?;
    Ok(report)
}

/// How long a restore waits for the next message before it gives up.
const STALL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// The segment files being written, and how many bytes each holds.
type Files = BTreeMap<(u64, u32), (Box<dyn StorageFile>, u64)>;

/// Whether every live segment's file reached the end the stream's leader gave.
fn reached(expected: &BTreeMap<(u64, u32), u64>, files: &Files) -> bool {
    expected
        .iter()
        .all(|(id, end)| files.get(id).is_some_and(|(_, len)| len >= end))
}

/// Where each live segment of the replica ends: the offset and length of the last
/// chunk of its subject.
async fn segment_ends(
    stream: &async_nats::jetstream::stream::Stream,
    name: &str,
    window: &Window,
    current: u64,
) -> Result<BTreeMap<(u64, u32), u64>> {
    let mut subjects = stream
        .info_with_subjects(segments_filter(name))
        .await
        .map_err(unavailable)?;
    let mut live = Vec::new();
    while let Some(subject) = subjects.next().await {
        let (subject, _) = subject.map_err(unavailable)?;
        if let Some(id) = parse_segment_subject(name, &subject)
            && window.is_live(id.0, current)
        {
            live.push((id, subject));
        }
    }
    let mut ends = BTreeMap::new();
    for (id, subject) in live {
        let last = stream
            .get_last_raw_message_by_subject(&subject)
            .await
            .map_err(unavailable)?;
        let offset = offset_of(&last.headers).ok_or_else(|| Error::Corrupted {
            path: replica_path(name, &subject),
            offset: last.sequence,
            reason: "a chunk without its offset".to_owned(),
        })?;
        ends.insert(id, offset + last.payload.len() as u64);
    }
    Ok(ends)
}

/// Which replica a chunk belongs to, and the window it is judged live in.
struct Chunk<'a> {
    name: &'a str,
    window: &'a Window,
    current: u64,
}

/// Appends one chunk to its segment file; `false` if its segment is expired.
fn apply(
    storage: &dyn Storage,
    dir: &Path,
    chunk: &Chunk<'_>,
    message: &async_nats::jetstream::Message,
    files: &mut Files,
    report: &mut RestoreReport,
) -> Result<bool> {
    let (name, window, current) = (chunk.name, chunk.window, chunk.current);
    let subject = message.subject.as_str();
    let damaged = |offset: u64, reason: &str| Error::Corrupted {
        path: replica_path(name, subject),
        offset,
        reason: reason.to_owned(),
    };
    let id =
        parse_segment_subject(name, subject).ok_or_else(|| damaged(0, "not a segment subject"))?;
    if !window.is_live(id.0, current) {
        return Ok(false);
    }
    let headers = message.headers.as_ref();
    let offset = headers
        .and_then(offset_of)
        .ok_or_else(|| damaged(0, "a chunk without its offset"))?;
    let (file, len) = match files.entry(id) {
        std::collections::btree_map::Entry::Occupied(held) => held.into_mut(),
        std::collections::btree_map::Entry::Vacant(new) => {
            let file = storage.open_append(&segment_path(dir, id.0, id.1), true)?;
            report.segments += 1;
            new.insert((file, 0))
        }
    };
    let payload: &[u8] = &message.payload;
    let end = offset + payload.len() as u64;
    if offset > *len {
        return Err(damaged(*len, "the replica misses bytes of this segment"));
    }
    if end > *len {
        let fresh = payload
            .get(usize::try_from(*len - offset).unwrap_or(usize::MAX)..)
            .unwrap_or_default();
        file.append(fresh)?;
        report.bytes += fresh.len() as u64;
        *len = end;
    }
    Ok(true)
}

/// A path naming a subject of a replica, for errors: `jetstream:ONCEDB_<name>/<subject>`.
fn replica_path(name: &str, subject: &str) -> PathBuf {
    PathBuf::from(format!("jetstream:{}/{subject}", stream_name(name)))
}
