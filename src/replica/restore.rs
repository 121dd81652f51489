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
    progress: &mut dyn FnMut(u64, u64),
) -> Result<RestoreReport> {
    replication.check()?;
    crate::wal::prepare_checkpoint_dir(storage, dir)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(fetch_async(replication, storage, dir, now_ms, progress))
}

async fn fetch_async(
    replication: &Replication,
    storage: &dyn Storage,
    dir: &Path,
    now_ms: u64,
    progress: &mut dyn FnMut(u64, u64),
) -> Result<RestoreReport> {
    let name = replication.name.as_str();
    let client = super::connect(replication).await?;
    let js = async_nats::jetstream::new(client);
    let mut stream = js.get_stream(stream_name(name)).await.map_err(|err| {
        use async_nats::jetstream::context::GetStreamErrorKind;
        match err.kind() {
            GetStreamErrorKind::JetStream(found) if found.code() == 404 => {
                Error::InvalidOptions(format!("no replica named {name} on the server"))
            }
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
    let mut files: BTreeMap<(u64, u32), (Box<dyn StorageFile>, u64)> = BTreeMap::new();
    if has_segments(&stream, name).await? {
        let consumer = stream
            .create_consumer(OrderedConfig {
                filter_subject: segments_filter(name),
                ..Default::default()
            })
            .await
            .map_err(unavailable)?;
        let mut messages = consumer.messages().await.map_err(unavailable)?;
        while let Some(message) = messages.next().await {
            let message = message.map_err(unavailable)?;
            let pending = message.info().map_err(unavailable)?.pending;
            report.messages += 1;
            progress(report.messages, total);
            let live = apply(
                storage,
                dir,
                name,
                &window,
                current,
                &message,
                &mut files,
                &mut report,
            )?;
            report.expired_messages += u64::from(!live);
            if pending == 0 {
                break;
            }
        }
    }
    for (_, (mut file, _)) in files {
        file.sync()?;
    }
    manifest.store(storage, dir)?;
    Ok(report)
}

/// Whether the stream holds any segment chunk.
async fn has_segments(stream: &async_nats::jetstream::stream::Stream, name: &str) -> Result<bool> {
    let mut subjects = stream
        .info_with_subjects(segments_filter(name))
        .await
        .map_err(unavailable)?;
    Ok(match subjects.next().await {
        Some(subject) => subject.map(|(_, count)| count > 0).map_err(unavailable)?,
        None => false,
    })
}

/// Appends one chunk to its segment file; `false` if its segment is expired.
#[expect(
    clippy::too_many_arguments,
    reason = "one chunk and everything it lands in"
)]
fn apply(
    storage: &dyn Storage,
    dir: &Path,
    name: &str,
    window: &Window,
    current: u64,
    message: &async_nats::jetstream::Message,
    files: &mut BTreeMap<(u64, u32), (Box<dyn StorageFile>, u64)>,
    report: &mut RestoreReport,
) -> Result<bool> {
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
    if !files.contains_key(&id) {
        let file = storage.open_append(&segment_path(dir, id.0, id.1), true)?;
        files.insert(id, (file, 0));
        report.segments += 1;
    }
    let Some((file, len)) = files.get_mut(&id) else {
        return Ok(true);
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
