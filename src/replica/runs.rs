//! The sealed runs of a restore: fetched after the log, each checked whole (its footer,
//! filters and every data page against their checksums) before it takes its name.
//!
//! The shipper publishes a run only once every run with a lower id is whole on the
//! stream, so the runs below the first one held in part are a set the store had: each
//! kept run covers (`RunSummary::covers`) only keys that it or a kept run holds, or that
//! expired. The first run held in part and every later one are left out; their keys are
//! in the log, which the opening store replays past the kept runs' cover.

use std::path::Path;

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::OrderedConfig;
use async_nats::jetstream::stream::Stream;
use futures_util::StreamExt;

use super::held::{HeldRun, offset_of, replica_path, run_subjects};
use super::restore::{RestoreReport, STALL_TIMEOUT};
use super::unavailable;
use crate::base::{Error, Result};
use crate::io::Storage;
use crate::wal::{open_run, run_path};

/// Fetches into `dir` every run the replica holds whole, below the first it holds in
/// part; a damaged one is `Corrupted`.
pub(super) async fn fetch_runs(
    stream: &Stream,
    name: &str,
    (storage, dir): (&dyn Storage, &Path),
    database_id: u64,
    report: &mut RestoreReport,
) -> Result<()> {
    for (run_id, held) in run_subjects(stream, name).await? {
        if !held.complete() {
            break;
        }
        let temp = dir.join(format!("run-{run_id:020}.tmp"));
        copy_run(stream, name, &held, (storage, &temp), report).await?;
        let checked = open_run(storage, &temp, database_id).and_then(|run| {
            run.check_pages(storage)?;
            Ok(run.summary().run_id)
        });
        let damaged = |reason: String| Error::Corrupted {
            path: replica_path(name, &held.subject),
            offset: 0,
            reason,
        };
        match checked {
            Ok(id) if id == run_id => {}
            Ok(id) => {
                return Err(damaged(format!(
                    "the subject of run {run_id} holds run {id}"
                )));
            }
            Err(Error::Corrupted { reason, .. }) => return Err(damaged(reason)),
            Err(err) => return Err(err),
        }
        storage.rename(&temp, &run_path(dir, run_id))?;
        report.runs += 1;
    }
    storage.sync_dir(dir)?;
    Ok(())
}

/// Copies the chunks of run `held` into the file `temp`, in order, and fsyncs it.
async fn copy_run(
    stream: &Stream,
    name: &str,
    held: &HeldRun,
    (storage, temp): (&dyn Storage, &Path),
    report: &mut RestoreReport,
) -> Result<()> {
    let damaged = |offset: u64, reason: &str| Error::Corrupted {
        path: replica_path(name, &held.subject),
        offset,
        reason: reason.to_owned(),
    };
    let mut file = storage.open_append(temp, true)?;
    file.truncate(0)?;
    let mut messages = stream
        .create_consumer(OrderedConfig {
            filter_subject: held.subject.clone(),
            deliver_policy: DeliverPolicy::All,
            ..Default::default()
        })
        .await
        .map_err(unavailable)?
        .messages()
        .await
        .map_err(unavailable)?;
    let mut written = 0;
    while written < held.len {
        let next = tokio::time::timeout(STALL_TIMEOUT, messages.next())
            .await
            .map_err(|_| unavailable(format!("replica {name}: no message for {STALL_TIMEOUT:?}")))?
            .ok_or_else(|| unavailable(format!("replica {name}: the consumer ended")))?
            .map_err(unavailable)?;
        report.messages += 1;
        let offset = next
            .headers
            .as_ref()
            .and_then(offset_of)
            .ok_or_else(|| damaged(written, "a run chunk without its offset"))?;
        let payload: &[u8] = &next.payload;
        if offset > written {
            return Err(damaged(written, "the replica misses bytes of this run"));
        }
        let fresh = payload
            .get(usize::try_from(written - offset).unwrap_or(usize::MAX)..)
            .unwrap_or_default();
        let room = usize::try_from(held.len - written).unwrap_or(usize::MAX);
        let fresh = fresh.get(..room.min(fresh.len())).unwrap_or_default();
        file.append(fresh)?;
        written += fresh.len() as u64;
        report.bytes += fresh.len() as u64;
    }
    file.sync()?;
    Ok(())
}
