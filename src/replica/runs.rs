//! The sealed runs of a restore: fetched after the log, each checked whole (its footer,
//! filters and every data page against their checksums) before it takes its name.
//!
//! The shipper publishes a run only once every run with a lower id is whole on the
//! stream, so the runs below the first one held in part are a set the store had: each
//! kept run covers (`RunSummary::covers`) only keys that it or a kept run holds, or that
//! expired. The first run held in part and every later one are left out; their keys are
//! in the log, which the opening store replays past the kept runs' cover.

use std::collections::BTreeMap;
use std::path::Path;

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::OrderedConfig;
use async_nats::jetstream::stream::Stream;
use futures_util::StreamExt;

use super::held::{HeldRun, offset_of, replica_path, run_subjects};
use super::layout::{PULL_BATCH, parse_run_subject, runs_filter};
use super::restore::{RestoreReport, STALL_TIMEOUT};
use super::unavailable;
use crate::base::{Error, Result};
use crate::io::{Storage, StorageFile};
use crate::wal::{RunKind, open_run, run_path};

/// Fetches into `dir` every run the replica holds whole, below the first it holds in
/// part, with one ordered consumer over the run subjects (one pass over the stream); a
/// damaged one is `Corrupted`.
pub(super) async fn fetch_runs(
    stream: &Stream,
    name: &str,
    (storage, dir): (&dyn Storage, &Path),
    database_id: u64,
    report: &mut RestoreReport,
) -> Result<()> {
    let kept: BTreeMap<u64, HeldRun> = run_subjects(stream, name)
        .await?
        .into_iter()
        .take_while(|(_, held)| held.complete())
        .collect();
    if kept.is_empty() {
        return Ok(());
    }
    let temp = |run_id: u64| dir.join(format!("run-{run_id:020}.tmp"));
    let mut files = BTreeMap::new();
    for &run_id in kept.keys() {
        let mut file = storage.open_append(&temp(run_id), true)?;
        file.truncate(0)?;
        files.insert(run_id, (file, 0u64));
    }
    copy_runs(stream, name, &kept, &mut files, report).await?;
    for (run_id, (mut file, _)) in files {
        file.sync()?;
        drop(file);
        let kind = check_run(storage, &temp(run_id), (name, run_id, &kept), database_id)?;
        storage.rename(&temp(run_id), &run_path(dir, run_id, kind))?;
        report.runs += 1;
    }
    storage.sync_dir(dir)?;
    Ok(())
}

/// Opens the fetched run `path` and checks every page of it against its checksums; what
/// it holds names it.
fn check_run(
    storage: &dyn Storage,
    path: &Path,
    (name, run_id, kept): (&str, u64, &BTreeMap<u64, HeldRun>),
    database_id: u64,
) -> Result<RunKind> {
    let checked = open_run(storage, path, database_id).and_then(|run| {
        run.check_pages(storage)?;
        Ok((run.summary().run_id, run.summary().kind))
    });
    let damaged = |reason: String| Error::Corrupted {
        path: replica_path(
            name,
            kept.get(&run_id).map_or("", |held| held.subject.as_str()),
        ),
        offset: 0,
        reason,
    };
    match checked {
        Ok((id, kind)) if id == run_id => Ok(kind),
        Ok((id, _)) => Err(damaged(format!(
            "the subject of run {run_id} holds run {id}"
        ))),
        Err(Error::Corrupted { reason, .. }) => Err(damaged(reason)),
        Err(err) => Err(err),
    }
}

/// Appends the chunks of the `kept` runs to their files, in stream order, until each
/// holds its whole length.
async fn copy_runs(
    stream: &Stream,
    name: &str,
    kept: &BTreeMap<u64, HeldRun>,
    files: &mut BTreeMap<u64, (Box<dyn StorageFile>, u64)>,
    report: &mut RestoreReport,
) -> Result<()> {
    let mut messages = stream
        .create_consumer(OrderedConfig {
            filter_subject: runs_filter(name),
            deliver_policy: DeliverPolicy::All,
            max_batch: PULL_BATCH,
            ..Default::default()
        })
        .await
        .map_err(unavailable)?
        .messages()
        .await
        .map_err(unavailable)?;
    let whole = |files: &BTreeMap<u64, (Box<dyn StorageFile>, u64)>| {
        kept.iter()
            .all(|(run_id, held)| files.get(run_id).is_some_and(|(_, len)| *len >= held.len))
    };
    while !whole(files) {
        let next = tokio::time::timeout(STALL_TIMEOUT, messages.next())
            .await
            .map_err(|_| unavailable(format!("replica {name}: no message for {STALL_TIMEOUT:?}")))?
            .ok_or_else(|| unavailable(format!("replica {name}: the consumer ended")))?
            .map_err(unavailable)?;
        report.messages += 1;
        let subject = next.subject.as_str();
        let Some(run_id) = parse_run_subject(name, subject) else {
            continue;
        };
        let (Some(held), Some((file, written))) = (kept.get(&run_id), files.get_mut(&run_id))
        else {
            continue;
        };
        let damaged = |offset: u64, reason: &str| Error::Corrupted {
            path: replica_path(name, subject),
            offset,
            reason: reason.to_owned(),
        };
        let offset = next
            .headers
            .as_ref()
            .and_then(offset_of)
            .ok_or_else(|| damaged(*written, "a run chunk without its offset"))?;
        if offset > *written {
            return Err(damaged(*written, "the replica misses bytes of this run"));
        }
        let payload: &[u8] = &next.payload;
        let fresh = payload
            .get(usize::try_from(*written - offset).unwrap_or(usize::MAX)..)
            .unwrap_or_default();
        let room = usize::try_from(held.len - *written).unwrap_or(usize::MAX);
        let fresh = fresh.get(..room.min(fresh.len())).unwrap_or_default();
        file.append(fresh)?;
        *written += fresh.len() as u64;
        report.bytes += fresh.len() as u64;
    }
    Ok(())
}
