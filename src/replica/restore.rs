//! Restore and standby: a store rebuilt in a directory from its replica. The replica's
//! manifest is read first (its window decides which segments are still live); then every
//! chunk of the live segments, in stream order, is appended to its segment file at the
//! offset it carries (a chunk already held, re-sent after a lost acknowledgement or
//! compacted, is skipped; a gap is `Corrupted`); every file is fsynced, the manifest
//! written last, and the directory fsynced. Opening the directory then checks every
//! frame's checksum, as any open does, and claims the replica.
//!
//! A restore claims the replica first, then copies: its owner message fences the old
//! owner (whose next publish expects a sequence the claim moved on, and is refused), so
//! the stream's end as of the claim holds everything the old owner had acknowledged, and
//! nothing it sends later is acknowledged. The copy then runs up to where the stream's
//! leader says each live segment ends. A standby ([`Follower`]) keeps copying as chunks
//! arrive, on a thread of its own, and at promotion claims, then copies only what it
//! still lacks, from the stream sequence it reached. The claim's token is in the
//! directory's `REPLICA` file before anything is copied: a restore that fails part-way
//! leaves a directory the same restore, run again, claims anew and completes.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use async_nats::jetstream::consumer::DeliverPolicy;
use async_nats::jetstream::consumer::pull::OrderedConfig;
use async_nats::jetstream::stream::Stream;
use futures_util::StreamExt;

use super::held::{last_message, offset_of, replica_path, segment_end, segment_subjects};
use super::layout::{
    OWNER_HEADER, PULL_BATCH, manifest_subject, owner_subject, parse_segment_subject,
    segments_filter, stream_name, token_text,
};
use super::runs::fetch_runs;
use super::{Replication, unavailable};
use crate::base::{Error, Result, Window, random_secret};
use crate::io::{Storage, StorageFile};
use crate::wal::{Manifest, is_temp_run_name, parse_run_name, parse_segment_name, segment_path};

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
    /// Sealed key runs fetched (their bytes counted in `bytes`).
    pub runs: u64,
}

/// How long a copy waits for the next message it needs before it gives up.
pub(super) const STALL_TIMEOUT: Duration = Duration::from_secs(30);

/// How long a standby waits for a message before it looks whether it should stop.
const FOLLOW_POLL: Duration = Duration::from_millis(200);

/// How long a standby that lost its replica waits before it follows again, at most.
const FOLLOW_RETRY_MAX: Duration = Duration::from_secs(2);

/// The segment files being written, and how many bytes each holds.
type Files = BTreeMap<(u64, u32), (Box<dyn StorageFile>, u64)>;

/// Progress callback: messages read so far, and the stream's total.
type Progress<'a> = &'a mut (dyn FnMut(u64, u64) + Send);

/// Fetches replica `replication` into `dir` (on `storage`), keeping the segments live at
/// `now_ms`. `dir` is new, empty, or left by a restore that was interrupted (segment files
/// and no manifest): the segment files it holds are kept and completed, so a restore
/// killed part-way is run again on the same directory.
pub(crate) fn fetch(
    replication: &Replication,
    storage: &dyn Storage,
    dir: &Path,
    now_ms: u64,
    progress: Progress<'_>,
) -> Result<RestoreReport> {
    replication.check()?;
    let held = restore_dir(storage, dir)?;
    // On a thread of its own: the caller may be on an async runtime of its own, where a
    // runtime cannot be entered.
    std::thread::scope(|scope| {
        scope
            .spawn(|| {
                on_runtime(async {
                    let mut copy = Copier::open(replication, storage, dir, held).await?;
                    copy.claim().await?;
                    copy.catch_up(now_ms, progress).await?;
                    let database_id = copy.manifest.database_id();
                    let target = (copy.storage, copy.dir.as_path());
                    fetch_runs(
                        &copy.stream,
                        &copy.name,
                        target,
                        database_id,
                        &mut copy.report,
                    )
                    .await?;
                    copy.finish()
                })
            })
            .join()
            .unwrap_or_else(|_| Err(unavailable("the restore thread panicked")))
    })
}

fn on_runtime<T>(work: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(work)
}

/// A replica being copied into a directory: what restore and standby share.
struct Copier<'a> {
    storage: &'a dyn Storage,
    dir: PathBuf,
    name: String,
    js: async_nats::jetstream::Context,
    stream: Stream,
    manifest: Manifest,
    files: Files,
    /// The last stream sequence applied.
    applied: u64,
    report: RestoreReport,
}

impl<'a> Copier<'a> {
    /// Connects and reads the manifest; `held` are the segment files `dir` already holds
    /// (a standby's, opened again), with their lengths.
    async fn open(
        replication: &Replication,
        storage: &'a dyn Storage,
        dir: &Path,
        held: Files,
    ) -> Result<Copier<'a>> {
        let name = replication.name.clone();
        let client = super::connect(replication).await?;
        let js = async_nats::jetstream::new(client);
        let stream = js.get_stream(stream_name(&name)).await.map_err(|err| {
            use async_nats::jetstream::context::GetStreamErrorKind;
            match err.kind() {
                GetStreamErrorKind::JetStream(found) if found.code() == 404 => {
                    Error::ReplicaNotFound {
                        replica: name.clone(),
                    }
                }
                _ => unavailable(err),
            }
        })?;
        let manifest = read_manifest(&stream, &name).await?;
        Ok(Copier {
            storage,
            dir: dir.to_path_buf(),
            name,
            js,
            stream,
            manifest,
            files: held,
            applied: 0,
            report: RestoreReport::default(),
        })
    }

    fn window(&self) -> Window {
        Window::new(self.manifest.window_ms, self.manifest.bucket_width_ms)
    }

    /// Claims the replica for the store this directory becomes: publishes an owner
    /// message under a new token (whatever the stream's last sequence: a claim takes over
    /// unconditionally) and records the token in the directory's `REPLICA` file. From the
    /// claim on, the old owner's publishes are refused, so the stream's end is fixed for
    /// the copy that follows.
    async fn claim(&mut self) -> Result<()> {
        let token = random_secret();
        let mut headers = async_nats::HeaderMap::new();
        headers.insert(OWNER_HEADER, token_text(token).as_str());
        self.js
            .publish_with_headers(owner_subject(&self.name), headers, Vec::new().into())
            .await
            .map_err(unavailable)?
            .await
            .map_err(unavailable)?;
        super::owner::store(self.storage, &self.dir, token)
    }

    /// An ordered consumer of the segment chunks after the last one applied.
    async fn chunks(&self) -> Result<async_nats::jetstream::consumer::pull::Ordered> {
        let deliver_policy = match self.applied {
            0 => DeliverPolicy::All,
            applied => DeliverPolicy::ByStartSequence {
                start_sequence: applied + 1,
            },
        };
        self.stream
            .create_consumer(OrderedConfig {
                filter_subject: segments_filter(&self.name),
                deliver_policy,
                max_batch: PULL_BATCH,
                ..Default::default()
            })
            .await
            .map_err(unavailable)?
            .messages()
            .await
            .map_err(unavailable)
    }

    /// Copies until every live segment reaches the end the stream's leader gives (a
    /// consumer placed on a replica that is catching up delivers late, never less).
    async fn catch_up(&mut self, now_ms: u64, progress: Progress<'_>) -> Result<()> {
        self.manifest = read_manifest(&self.stream, &self.name).await?;
        let current = self.window().bucket_of(now_ms);
        let expected = self.segment_ends(current).await?;
        if reached(&expected, &self.files) {
            return Ok(());
        }
        let total = self
            .stream
            .get_info()
            .await
            .map_err(unavailable)?
            .state
            .messages;
        let mut messages = self.chunks().await?;
        while !reached(&expected, &self.files) {
            let next = tokio::time::timeout(STALL_TIMEOUT, messages.next())
                .await
                .map_err(|_| {
                    unavailable(format!(
                        "replica {}: no message for {STALL_TIMEOUT:?}",
                        self.name
                    ))
                })?;
            let Some(message) = next else {
                return Err(unavailable(format!(
                    "replica {}: the consumer ended",
                    self.name
                )));
            };
            self.apply(&message.map_err(unavailable)?, current)?;
            progress(self.report.messages, total);
        }
        Ok(())
    }

    /// Copies chunks as they arrive until `stop` is set; `lag` is told the messages
    /// still pending after each, and `trouble` cleared once a chunk arrives.
    async fn follow(
        &mut self,
        clock: &dyn crate::base::Clock,
        stop: &AtomicBool,
        (pending, applied, trouble): (&AtomicU64, &AtomicU64, &Trouble),
    ) -> Result<()> {
        let mut messages = self.chunks().await?;
        let mut recorded = self.applied;
        while !stop.load(Ordering::Acquire) {
            let Ok(next) = tokio::time::timeout(FOLLOW_POLL, messages.next()).await else {
                // Idle: make what was applied durable and remember where to resume.
                if recorded != self.applied {
                    self.record_progress()?;
                    recorded = self.applied;
                }
                // The consumer waits through a lost connection without a word: say so,
                // until the connection is back.
                let state = self.js.client().connection_state();
                if state == async_nats::connection::State::Connected {
                    trouble.clear();
                } else {
                    trouble.set(format!("the connection to JetStream is {state}"));
                }
                continue;
            };
            let Some(message) = next else {
                return Err(unavailable(format!(
                    "replica {}: the consumer ended",
                    self.name
                )));
            };
            let message = message.map_err(unavailable)?;
            pending.store(
                message.info().map_err(unavailable)?.pending,
                Ordering::Release,
            );
            let current = self.window().bucket_of(clock.now_ms());
            self.apply(&message, current)?;
            applied.store(self.report.messages, Ordering::Release);
            trouble.clear();
        }
        if recorded != self.applied {
            self.record_progress()?;
        }
        Ok(())
    }

    /// Fsyncs every segment file, then records the stream sequence applied
    /// ([`standby_mark`]), so that a standby started again on the directory resumes
    /// after it instead of reading the stream from its start.
    fn record_progress(&mut self) -> Result<()> {
        for (file, _) in self.files.values_mut() {
            file.sync()?;
        }
        standby_mark::store(self.storage, &self.dir, self.applied)
    }

    /// Fsyncs every file and writes the manifest last.
    fn finish(self) -> Result<RestoreReport> {
        for (_, (mut file, _)) in self.files {
            file.sync()?;
        }
        self.manifest.store(self.storage, &self.dir)?;
        Ok(self.report)
    }

    /// Where each live segment of the replica ends: the offset and length of the last
    /// chunk of its subject.
    async fn segment_ends(&self, current: u64) -> Result<BTreeMap<(u64, u32), u64>> {
        let window = self.window();
        let mut ends = BTreeMap::new();
        for (id, subject, _) in segment_subjects(&self.stream, &self.name).await? {
            if window.is_live(id.0, current)
                && let Some(end) = segment_end(&self.stream, &self.name, &subject).await?
            {
                ends.insert(id, end);
            }
        }
        Ok(ends)
    }

    /// Appends one chunk to its segment file (unless its segment is expired at
    /// `current`).
    fn apply(&mut self, message: &async_nats::jetstream::Message, current: u64) -> Result<()> {
        self.report.messages += 1;
        if let Ok(info) = message.info() {
            self.applied = self.applied.max(info.stream_sequence);
        }
        let subject = message.subject.as_str();
        let damaged = |offset: u64, reason: &str| Error::Corrupted {
            path: replica_path(&self.name, subject),
            offset,
            reason: reason.to_owned(),
        };
        let id = parse_segment_subject(&self.name, subject)
            .ok_or_else(|| damaged(0, "not a segment subject"))?;
        if !self.window().is_live(id.0, current) {
            self.report.expired_messages += 1;
            return Ok(());
        }
        let offset = message
            .headers
            .as_ref()
            .and_then(offset_of)
            .ok_or_else(|| damaged(0, "a chunk without its offset"))?;
        let (file, len) = match self.files.entry(id) {
            std::collections::btree_map::Entry::Occupied(held) => held.into_mut(),
            std::collections::btree_map::Entry::Vacant(new) => {
                let path = segment_path(&self.dir, id.0, id.1);
                let file = self.storage.open_append(&path, true)?;
                self.report.segments += 1;
                new.insert((file, 0))
            }
        };
        let payload: &[u8] = &message.payload;
        let end = offset
            .checked_add(payload.len() as u64)
            .ok_or_else(|| damaged(offset, "a chunk whose offset overflows"))?;
        if offset > *len {
            return Err(damaged(*len, "the replica misses bytes of this segment"));
        }
        if end > *len {
            let fresh = payload
                .get(usize::try_from(*len - offset).unwrap_or(usize::MAX)..)
                .unwrap_or_default();
            file.append(fresh)?;
            self.report.bytes += fresh.len() as u64;
            *len = end;
        }
        Ok(())
    }
}

async fn read_manifest(stream: &Stream, name: &str) -> Result<Manifest> {
    let Some(message) = last_message(stream, &manifest_subject(name)).await? else {
        return Err(Error::InvalidOptions(format!(
            "replica {name} holds no manifest: nothing to restore"
        )));
    };
    Manifest::decode(&message.payload).map_err(|reason| Error::Corrupted {
        path: replica_path(name, &manifest_subject(name)),
        offset: message.sequence,
        reason: reason.to_owned(),
    })
}

/// Whether every live segment's file reached the end the stream's leader gave.
fn reached(expected: &BTreeMap<(u64, u32), u64>, files: &Files) -> bool {
    expected
        .iter()
        .all(|(id, end)| files.get(id).is_some_and(|(_, len)| len >= end))
}

/// How far a standby is behind its replica.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StandbyLag {
    /// Chunks the standby applied since it started.
    pub applied_messages: u64,
    /// Chunks the stream holds that the standby has not applied yet (as of the last
    /// one it applied).
    pub pending_messages: u64,
}

/// Why a standby is not following its replica now, if it is not: set when it loses the
/// replica (it follows again after a while) or stops for good, cleared by the next chunk.
#[derive(Default)]
struct Trouble(parking_lot::Mutex<Option<String>>);

impl Trouble {
    fn set(&self, why: String) {
        *self.0.lock() = Some(why);
    }

    fn clear(&self) {
        let mut trouble = self.0.lock();
        if trouble.is_some() {
            *trouble = None;
        }
    }

    fn get(&self) -> Option<String> {
        self.0.lock().clone()
    }
}

/// A standby: a warm copy of a replica in a directory, kept by a thread that applies
/// the stream's chunks as they arrive. It follows again after losing the replica (a
/// node down, the connection lost), from the sequence it reached; [`Follower::lag`]
/// reports the failure meanwhile.
pub(crate) struct Follower {
    stop: Arc<AtomicBool>,
    pending: Arc<AtomicU64>,
    applied: Arc<AtomicU64>,
    trouble: Arc<Trouble>,
    thread: Option<JoinHandle<Result<(Files, u64, RestoreReport)>>>,
    replication: Replication,
    storage: Arc<dyn Storage>,
    dir: PathBuf,
}

impl Follower {
    /// Starts following replica `replication` into `dir` (new, empty, or a standby's
    /// directory from an earlier run, whose segment files it appends to).
    pub(crate) fn start(
        replication: Replication,
        storage: Arc<dyn Storage>,
        dir: PathBuf,
        clock: Arc<dyn crate::base::Clock>,
    ) -> Result<Follower> {
        replication.check()?;
        crate::wal::create_dir_durably(&*storage, &dir)?;
        let held = held_segments(&*storage, &dir)?;
        let resume_after = standby_mark::load(&*storage, &dir)?;
        let (stop, pending, applied) = (
            Arc::new(AtomicBool::new(false)),
            Arc::new(AtomicU64::new(0)),
            Arc::new(AtomicU64::new(0)),
        );
        let trouble = Arc::new(Trouble::default());
        let (ready, started) = std::sync::mpsc::channel();
        let thread = {
            let (replication, storage, dir) =
                (replication.clone(), Arc::clone(&storage), dir.clone());
            let (stop, pending, applied, trouble) = (
                Arc::clone(&stop),
                Arc::clone(&pending),
                Arc::clone(&applied),
                Arc::clone(&trouble),
            );
            std::thread::Builder::new()
                .name("oncedb-standby".into())
                .spawn(move || {
                    on_runtime(async {
                        let opened = Copier::open(&replication, &*storage, &dir, held).await;
                        let mut copy = match opened {
                            Ok(mut copy) => {
                                copy.applied = resume_after;
                                let _ = ready.send(Ok(()));
                                copy
                            }
                            Err(err) => {
                                let _ = ready.send(Err(err.to_string()));
                                return Err(err);
                            }
                        };
                        let progress = (&*pending, &*applied, &*trouble);
                        follow_through_outages(&mut copy, &*clock, &stop, progress).await?;
                        Ok((std::mem::take(&mut copy.files), copy.applied, copy.report))
                    })
                })?
        };
        match started.recv() {
            Ok(Ok(())) => {}
            Ok(Err(_)) | Err(_) => {
                let outcome = thread.join();
                return Err(match outcome {
                    Ok(Err(err)) => err,
                    _ => unavailable("the standby thread ended at start"),
                });
            }
        }
        Ok(Follower {
            stop,
            pending,
            applied,
            trouble,
            thread: Some(thread),
            replication,
            storage,
            dir,
        })
    }

    /// How far behind the replica the standby is; `Unavailable` while it is not
    /// following (it lost the replica and follows again, or stopped for good), with why.
    pub(crate) fn lag(&self) -> Result<StandbyLag> {
        if let Some(why) = self.trouble.get() {
            return Err(unavailable(format!(
                "the standby of replica {} is not following: {why}",
                self.replication.name
            )));
        }
        Ok(StandbyLag {
            applied_messages: self.applied.load(Ordering::Acquire),
            pending_messages: self.pending.load(Ordering::Acquire),
        })
    }

    /// Stops following, copies what the standby still lacks (from the sequence it
    /// reached), and writes the manifest: the directory is a store, ready to open.
    pub(crate) fn catch_up(mut self, now_ms: u64) -> Result<RestoreReport> {
        self.stop.store(true, Ordering::Release);
        let (files, applied, report) = match self.thread.take().map(JoinHandle::join) {
            Some(Ok(outcome)) => outcome?,
            _ => return Err(unavailable("the standby thread panicked")),
        };
        let (replication, storage, dir) = (&self.replication, &*self.storage, &self.dir);
        std::thread::scope(|scope| {
            scope
                .spawn(move || {
                    on_runtime(async move {
                        let mut copy = Copier::open(replication, storage, dir, files).await?;
                        copy.applied = applied;
                        copy.report = report;
                        copy.claim().await?;
                        copy.catch_up(now_ms, &mut |_, _| {}).await?;
                        let report = copy.finish()?;
                        standby_mark::remove(storage, dir)?;
                        Ok(report)
                    })
                })
                .join()
                .unwrap_or_else(|_| Err(unavailable("the promotion thread panicked")))
        })
    }
}

/// Follows until `stop`; after losing the replica (`Unavailable`: a node down, the
/// connection lost) it reports why through `trouble` and follows again from the
/// sequence it reached, waiting a little longer each time, up to `FOLLOW_RETRY_MAX`. Any
/// other failure (a damaged chunk) stops it for good, reported the same way.
async fn follow_through_outages(
    copy: &mut Copier<'_>,
    clock: &dyn crate::base::Clock,
    stop: &AtomicBool,
    (pending, applied, trouble): (&AtomicU64, &AtomicU64, &Trouble),
) -> Result<()> {
    let mut wait = FOLLOW_POLL;
    loop {
        match copy.follow(clock, stop, (pending, applied, trouble)).await {
            Ok(()) => return Ok(()),
            Err(err @ Error::Unavailable { .. }) => {
                log::warn!(
                    "oncedb: standby of replica {}: {err}; following again",
                    copy.name
                );
                trouble.set(err.to_string());
                let until = std::time::Instant::now() + wait;
                while std::time::Instant::now() < until && !stop.load(Ordering::Acquire) {
                    tokio::time::sleep(FOLLOW_POLL.min(wait)).await;
                }
                if stop.load(Ordering::Acquire) {
                    return Ok(());
                }
                wait = (wait * 2).min(FOLLOW_RETRY_MAX);
            }
            Err(err) => {
                trouble.set(format!("stopped for good: {err}"));
                return Err(err);
            }
        }
    }
}

impl Drop for Follower {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Readies `dir` for a restore: created if missing; refused if it holds a store (a
/// manifest) or any file but segment files, runs and a claim; the segment files an
/// interrupted restore left are opened to be completed, its runs removed (the claim is
/// made again).
fn restore_dir(storage: &dyn Storage, dir: &Path) -> Result<Files> {
    crate::wal::create_dir_durably(storage, dir)?;
    let mut stray = None;
    for path in storage.list(dir)? {
        if parse_run_name(&path).is_some() || is_temp_run_name(&path) {
            // Runs are fetched again whole, after the log.
            storage.remove(&path)?;
        } else if parse_segment_name(&path).is_none() && !super::owner::is_claim_file(&path) {
            stray = Some(path);
        }
    }
    if let Some(stray) = stray {
        return Err(Error::InvalidOptions(format!(
            "{} holds {}: a restore needs a new or empty directory, or one an interrupted \
             restore left (segment files and its claim only)",
            dir.display(),
            stray.display()
        )));
    }
    held_segments(storage, dir)
}

/// The segment files a standby's directory already holds, opened for appending.
fn held_segments(storage: &dyn Storage, dir: &Path) -> Result<Files> {
    let mut held = Files::new();
    for path in storage.list(dir)? {
        if let Some(id) = parse_segment_name(&path) {
            let len = storage.file_len(&path)?;
            held.insert(id, (storage.open_append(&path, false)?, len));
        }
    }
    Ok(held)
}

/// The file `STANDBY` of a standby's directory: the last stream sequence whose chunk the
/// segment files hold durably (24 bytes: magic `ONCESTB\0`, the sequence as u64 LE, and
/// the XXH3-64 of bytes 0..16). Removed by the promotion, which writes the manifest.
mod standby_mark {
    use std::path::Path;

    use xxhash_rust::xxh3::xxh3_64;

    use crate::base::{Error, Result};
    use crate::io::Storage;

    const NAME: &str = "STANDBY";
    const TEMP_NAME: &str = "STANDBY.tmp";
    const MAGIC: &[u8; 8] = b"ONCESTB\0";
    const LEN: usize = 24;

    /// The sequence recorded in `dir`, or 0 if none is.
    pub(super) fn load(storage: &dyn Storage, dir: &Path) -> Result<u64> {
        let path = dir.join(NAME);
        let bytes = match storage.read(&path, LEN as u64) {
            Ok(bytes) => bytes,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(err) => return Err(err.into()),
        };
        let word = |range: std::ops::Range<usize>| {
            let mut out = [0u8; 8];
            out.copy_from_slice(bytes.get(range).unwrap_or(&[0; 8]));
            u64::from_le_bytes(out)
        };
        if bytes.len() != LEN
            || bytes.get(..8) != Some(&MAGIC[..])
            || word(16..24) != xxh3_64(bytes.get(..16).unwrap_or_default())
        {
            return Err(Error::Corrupted {
                path,
                offset: 0,
                reason: "not a standby's progress file".to_owned(),
            });
        }
        Ok(word(8..16))
    }

    /// Removes the record (a promoted standby is a store).
    pub(super) fn remove(storage: &dyn Storage, dir: &Path) -> Result<()> {
        match storage.remove(&dir.join(NAME)) {
            Err(err) if err.kind() != std::io::ErrorKind::NotFound => Err(err.into()),
            _ => storage.sync_dir(dir).map_err(Into::into),
        }
    }

    /// Records `sequence` durably.
    pub(super) fn store(storage: &dyn Storage, dir: &Path, sequence: u64) -> Result<()> {
        let mut bytes = Vec::with_capacity(LEN);
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&sequence.to_le_bytes());
        let checksum = xxh3_64(&bytes);
        bytes.extend_from_slice(&checksum.to_le_bytes());
        crate::wal::store_small_file(storage, dir, (NAME, TEMP_NAME), &bytes)
    }
}
