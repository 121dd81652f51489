//! The shipper: a thread with a tokio runtime of its own that claims or checks the
//! store's ownership of its replica at open, then publishes the log's fsynced bytes as
//! they come (every chunk carrying the stream's expected last sequence), purges the
//! segments that left the window, and reports each acknowledged position to the journal.

use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use async_nats::HeaderMap;
use async_nats::jetstream::context::PublishErrorKind;
use async_nats::jetstream::stream::{Config, Stream};

use super::held::run_subjects;
use super::held::{last_message, segment_end, segment_subjects};
use super::layout::{
    CHUNK_BYTES, DUPLICATE_WINDOW, LENGTH_HEADER, OFFSET_HEADER, OWNER_HEADER, all_subjects,
    manifest_subject, owner_subject, run_subject, segment_subject, stream_name, token_text,
};
use super::removal::Removal;
use super::{Replication, owner, unavailable};
use crate::base::{Error, Result, random_secret};
use crate::wal::{FeedSnapshot, LogFeed, RunsOnReplica, parse_run_name, read_cover};

/// How long the shipper waits for more log before it looks again (for expiries).
const IDLE_WAIT: Duration = Duration::from_millis(500);
/// How often the shipper lists the directory for sealed runs it has not shipped yet.
const RUN_LIST_EVERY: Duration = Duration::from_millis(500);
/// Chunks of sealed runs a round of shipping publishes at most, so that a large run
/// never holds the log's groups (and sync writers) back for long.
const RUN_CHUNKS_PER_ROUND: usize = 8;
/// Messages a round deletes at most (against servers that need one request a message,
/// `removal.rs`), so that removals never hold the next round back for long.
const DELETES_PER_ROUND: usize = 64;

/// Whole chunks a round publishes at most to compact sealed segments.
const COMPACT_CHUNKS_PER_ROUND: usize = 8;
/// How long it waits before trying an unreachable JetStream again.
const RETRY_WAIT: Duration = Duration::from_millis(200);

/// The running shipper of a store; stopped (and joined) when dropped.
pub(crate) struct Shipper {
    stop: Arc<AtomicBool>,
    feed: Arc<LogFeed>,
    thread: Option<JoinHandle<()>>,
}

/// Why a round of shipping stopped.
enum Halt {
    /// Reading the store's own files failed: an I/O failure of the store, which the feed
    /// has poisoned; shipping ends.
    Failed(String),
    /// Another store claimed the replica.
    NotOwner,
    /// JetStream could not be reached or refused; try again.
    Down(String),
}

impl Shipper {
    /// Connects to the replica, claims it (a replica nobody claimed yet) or checks that
    /// this store's claim stands (a restore claimed it for this directory before copying),
    /// and starts shipping. Fails
    /// (and ships nothing) when the replica cannot be reached, is another store's, or
    /// holds log this store lacks.
    pub(crate) fn start(replication: Replication, feed: LogFeed, dir: PathBuf) -> Result<Shipper> {
        replication.check()?;
        let stop = Arc::new(AtomicBool::new(false));
        let feed = Arc::new(feed);
        let (ready, started) = std::sync::mpsc::channel();
        let thread = {
            let (feed, stop) = (Arc::clone(&feed), Arc::clone(&stop));
            std::thread::Builder::new()
                .name("oncedb-replica".into())
                .spawn(move || run(&replication, &feed, &dir, &stop, &ready))?
        };
        let outcome = started
            .recv()
            .unwrap_or_else(|_| Err(unavailable("the replica thread ended at start")));
        let shipper = Shipper {
            stop,
            feed,
            thread: Some(thread),
        };
        outcome.map(|()| shipper)
    }
}

impl Drop for Shipper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        self.feed.wake();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn run(
    replication: &Replication,
    feed: &Arc<LogFeed>,
    dir: &std::path::Path,
    stop: &Arc<AtomicBool>,
    ready: &std::sync::mpsc::Sender<Result<()>>,
) {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(err) => {
            let _ = ready.send(Err(err.into()));
            return;
        }
    };
    runtime.block_on(async {
        let opened = match Link::open(replication, feed, dir).await {
            Ok(mut link) => link.ship_backlog(replication, feed).await.map(|()| link),
            Err(err) => Err(err),
        };
        let mut link = match opened {
            Ok(link) => {
                let _ = ready.send(Ok(()));
                link
            }
            Err(err) => {
                let _ = ready.send(Err(err));
                return;
            }
        };
        link.ship_until_stopped(feed, stop).await;
    });
}

/// The connection to the replica's stream and what has been shipped to it.
struct Link {
    name: String,
    js: async_nats::jetstream::Context,
    stream: Stream,
    token: u64,
    /// The stream's last sequence as this store last saw it: every publish expects it.
    last_seq: u64,
    /// Per segment, the bytes the stream holds.
    cursors: BTreeMap<(u64, u32), u64>,
    /// Sealed segments the stream holds in whole chunks (compacted, or shipped so).
    compacted: BTreeSet<(u64, u32)>,
    /// The manifest as last published.
    manifest: Option<Vec<u8>>,
    /// The store's directory, listed for sealed runs.
    dir: PathBuf,
    /// Per sealed run, the bytes the stream holds.
    runs: BTreeMap<u64, u64>,
    /// When the directory was last listed for runs; `None`: list it next round.
    runs_listed: Option<std::time::Instant>,
    /// Whether a run waits to be shipped, or shipped only in part.
    runs_pending: bool,
    /// How messages leave the stream on the server connected to.
    removal: Removal,
    /// Subjects of segments and runs that left the store, still on the stream: removed
    /// after a round's acknowledgements, a budget a round.
    removing: VecDeque<String>,
    /// The compaction under way, if it was left part-way.
    compaction: Option<Compaction>,
}

/// A sealed segment being published again in whole chunks ([`Link::compact_some`]).
#[derive(Debug, Clone)]
struct Compaction {
    id: (u64, u32),
    path: PathBuf,
    end: u64,
    /// Where the next whole chunk starts.
    offset: u64,
    /// The stream sequence of the first whole chunk: the chunks before it are purged.
    first: Option<u64>,
}

/// A stream JetStream would not create: too few nodes for the copies asked is the
/// caller's setting to change, and says so; anything else is an outage.
fn stream_refused(replication: &Replication, err: &impl std::fmt::Display) -> Error {
    let text = err.to_string();
    let lower = text.to_ascii_lowercase();
    if lower.contains("replicas") || lower.contains("insufficient resources") {
        return Error::InvalidOptions(format!(
            "replica {}: JetStream cannot keep {} copies of its stream ({text}): ask for \
             fewer copies (Replication::replicas, the tool's --replica-copies) or add nodes",
            replication.name, replication.replicas
        ));
    }
    unavailable(text)
}

/// Refuses an existing stream whose settings differ from what the store needs: the
/// copies asked, message retention by limits with none set (an interest or work-queue
/// stream, or a limit, would drop log the store still needs), and the duplicate window
/// the shipper's message ids rely on.
fn check_stream(replication: &Replication, config: &Config) -> Result<()> {
    use async_nats::jetstream::stream::RetentionPolicy;
    let mut differences = Vec::new();
    if config.num_replicas != replication.replicas {
        differences.push(format!(
            "it keeps {} copies where this store asks for {} (Replication::replicas, the \
             tool's --replica-copies)",
            config.num_replicas, replication.replicas
        ));
    }
    if config.retention != RetentionPolicy::Limits {
        differences.push(format!(
            "its retention is {:?}, not limits",
            config.retention
        ));
    }
    if config.max_messages > 0 || config.max_bytes > 0 || !config.max_age.is_zero() {
        differences.push(format!(
            "it has limits (max_messages {}, max_bytes {}, max_age {:?}) that drop log",
            config.max_messages, config.max_bytes, config.max_age
        ));
    }
    if config.duplicate_window != DUPLICATE_WINDOW {
        differences.push(format!(
            "its duplicate window is {:?}, not {:?}",
            config.duplicate_window, DUPLICATE_WINDOW
        ));
    }
    if differences.is_empty() {
        return Ok(());
    }
    Err(Error::InvalidOptions(format!(
        "replica {}: its stream {} differs from what the store needs: {}",
        replication.name,
        config.name,
        differences.join("; ")
    )))
}

/// The stream a replica lives in, as a store creates it.
fn stream_config(replication: &Replication) -> Config {
    Config {
        name: stream_name(&replication.name),
        subjects: vec![all_subjects(&replication.name)],
        num_replicas: replication.replicas,
        duplicate_window: DUPLICATE_WINDOW,
        ..Default::default()
    }
}

impl Link {
    /// A link to `stream` that has shipped nothing and holds no owner token yet.
    fn unsettled(
        replication: &Replication,
        (js, stream): (async_nats::jetstream::Context, Stream),
        dir: &std::path::Path,
        removal: Removal,
    ) -> Link {
        Link {
            name: replication.name.clone(),
            js,
            stream,
            token: 0,
            last_seq: 0,
            cursors: BTreeMap::new(),
            compacted: BTreeSet::new(),
            manifest: None,
            dir: dir.to_path_buf(),
            runs: BTreeMap::new(),
            runs_listed: None,
            runs_pending: false,
            removal,
            removing: VecDeque::new(),
            compaction: None,
        }
    }

    async fn open(
        replication: &Replication,
        feed: &LogFeed,
        dir: &std::path::Path,
    ) -> Result<Link> {
        let client = super::connect(replication).await?;
        let server = client.server_info();
        let clustered = server
            .cluster
            .as_deref()
            .is_some_and(|name| !name.is_empty());
        let removal = Removal::for_server(&server.version, clustered);
        if removal == Removal::Delete {
            log::warn!(
                "oncedb: replica {}: nats-server {:?} may replay a purge as a purge of the \
                 whole stream when a node restarts (nats-server#4196): messages leave the \
                 replica one delete at a time and sealed segments stay uncompacted; run \
                 nats-server 2.10 or later",
                replication.name,
                server.version
            );
        }
        let js = async_nats::jetstream::new(client);
        let mut stream = js
            .get_or_create_stream(stream_config(replication))
            .await
            .map_err(|err| stream_refused(replication, &err))?;
        let info = stream.info().await.map_err(unavailable)?;
        check_stream(replication, &info.config)?;
        let mut link = Link::unsettled(replication, (js, stream), dir, removal);
        link.settle_ownership(feed, dir).await?;
        link.resume(feed).await?;
        Ok(link)
    }

    /// Claims a new replica, or checks this store's claim.
    async fn settle_ownership(&mut self, feed: &LogFeed, dir: &std::path::Path) -> Result<()> {
        let info = self.stream.get_info().await.map_err(unavailable)?;
        self.last_seq = info.state.last_sequence;
        let claimed = owner::load(feed.storage(), dir)?;
        let current = last_message(&self.stream, &owner_subject(&self.name)).await?;
        let current_owner = current
            .as_ref()
            .and_then(|message| owner_of(&message.headers));
        match (current_owner, claimed) {
            (Some(owner), Some(mine)) if owner == mine => {
                self.token = mine;
                Ok(())
            }
            (None, _) if info.state.messages == 0 => self.claim(feed, dir).await,
            _ => Err(Error::NotOwner {
                replica: self.name.clone(),
            }),
        }
    }

    /// Publishes a new owner token after the stream's last message; the old owner's
    /// next publish then expects a sequence that has moved on, and is refused.
    async fn claim(&mut self, feed: &LogFeed, dir: &std::path::Path) -> Result<()> {
        self.token = random_secret();
        match self
            .publish(owner_subject(&self.name), None, Vec::new(), ("", None))
            .await
        {
            Ok(_) => {}
            Err(Halt::NotOwner) => {
                return Err(Error::NotOwner {
                    replica: self.name.clone(),
                });
            }
            Err(Halt::Down(why)) => return Err(unavailable(why)),
            Err(Halt::Failed(why)) => return Err(Error::Io(std::io::Error::other(why))),
        }
        owner::store(feed.storage(), dir, self.token)
    }

    /// Reads where the stream's copy of each local segment ends; refuses a stream that
    /// holds bytes this store lacks, and purges the segments that left the window.
    async fn resume(&mut self, feed: &LogFeed) -> Result<()> {
        let snapshot = feed.snapshot();
        for segment in &snapshot.segments {
            let subject = segment_subject(&self.name, segment.id);
            let held = segment_end(&self.stream, &self.name, &subject)
                .await?
                .unwrap_or(0);
            if held > segment.end {
                return Err(self.lacking(segment.id, held - segment.end));
            }
            self.cursors.insert(segment.id, held);
        }
        let newest = snapshot.segments.last().map(|segment| segment.id);
        for (id, subject, count) in segment_subjects(&self.stream, &self.name).await? {
            if let Some(segment) = snapshot.segments.iter().find(|segment| segment.id == id) {
                if segment.sealed && count as u64 <= segment.end.div_ceil(CHUNK_BYTES) {
                    self.compacted.insert(id);
                }
                continue;
            }
            if newest.is_none_or(|newest| id > newest) {
                return Err(self.lacking(id, 0));
            }
            self.queue_removal(subject);
        }
        if let Some(message) = last_message(&self.stream, &manifest_subject(&self.name)).await? {
            self.manifest = Some(message.payload.to_vec());
        }
        // A run shipped in part is completed from where the stream's copy ends (its
        // chunks go in order); one gone from the directory (merged away or expired) is
        // purged by the first round.
        for (run_id, held) in run_subjects(&self.stream, &self.name).await? {
            self.runs.insert(run_id, held.end);
        }
        Ok(())
    }

    /// The log from before this open that the replica lacks (a crash or a stall left it
    /// unshipped): counted in the lag until a round ships it. Under a sync replica it is
    /// shipped now, before the store answers anything that may rest on it; an open that
    /// cannot ship it is `Unavailable` (or `NotOwner`).
    async fn ship_backlog(&mut self, replication: &Replication, feed: &LogFeed) -> Result<()> {
        let snapshot = feed.snapshot();
        let backlog: u64 = snapshot
            .segments
            .iter()
            .map(|segment| {
                let held = self.cursors.get(&segment.id).copied().unwrap_or(0);
                segment.end.saturating_sub(held)
            })
            .sum();
        if backlog == 0 {
            return Ok(());
        }
        feed.backlog(backlog);
        if replication.mode != super::ReplicaMode::Sync {
            return Ok(());
        }
        match self.ship(feed, &snapshot).await {
            Ok(()) => {
                feed.shipped(snapshot.counter);
                Ok(())
            }
            Err(Halt::NotOwner) => Err(Error::NotOwner {
                replica: self.name.clone(),
            }),
            Err(Halt::Down(why)) => Err(unavailable(format!(
                "replica {} lacks {backlog} bytes of this store's log from before it opened, \
                 and could not take them: {why}",
                self.name
            ))),
            Err(Halt::Failed(why)) => Err(Error::Io(std::io::Error::other(why))),
        }
    }

    fn lacking(&self, id: (u64, u32), bytes: u64) -> Error {
        Error::InvalidOptions(format!(
            "replica {} holds log this store lacks (segment {}-{}, {bytes} bytes past its end): \
             restore the replica (oncedb restore) instead of opening this copy",
            self.name, id.0, id.1
        ))
    }

    async fn ship_until_stopped(&mut self, feed: &Arc<LogFeed>, stop: &AtomicBool) {
        let mut snapshot = feed.snapshot();
        while !stop.load(Ordering::Acquire) {
            // Compaction and removals follow the round's acknowledgements: no writer
            // waits on them.
            let round = match self.ship(feed, &snapshot).await {
                Ok(()) => {
                    feed.shipped(snapshot.counter);
                    self.tidy(feed, &snapshot).await
                }
                Err(halt) => Err(halt),
            };
            match round {
                Ok(()) => {}
                Err(Halt::NotOwner) => {
                    log::error!("oncedb: replica {} was claimed by another store", self.name);
                    feed.lose_ownership();
                    return;
                }
                Err(Halt::Failed(why)) => {
                    log::error!("oncedb: shipping to replica {} stopped: {why}", self.name);
                    return;
                }
                Err(Halt::Down(why)) => {
                    feed.replica_down(why);
                    tokio::time::sleep(RETRY_WAIT).await;
                    snapshot = feed.snapshot();
                    continue;
                }
            }
            // While a run, a compaction or a removal waits, the next round starts as soon
            // as it may.
            let wait =
                if self.runs_pending || self.compaction.is_some() || !self.removing.is_empty() {
                    Duration::ZERO
                } else {
                    IDLE_WAIT
                };
            let (waiting, shipped) = (Arc::clone(feed), snapshot.counter);
            let next = tokio::task::spawn_blocking(move || waiting.wait_past(shipped, wait));
            match next.await {
                Ok(Some(next)) => snapshot = next,
                _ => return,
            }
        }
    }

    /// Publishes what `snapshot` holds beyond the cursors, the manifest first if it
    /// changed, then purges the segments that left the log.
    async fn ship(&mut self, feed: &LogFeed, snapshot: &FeedSnapshot) -> Result<(), Halt> {
        let manifest = feed.manifest_bytes().to_vec();
        if self.manifest.as_ref() != Some(&manifest) {
            self.publish(
                manifest_subject(&self.name),
                None,
                manifest.clone(),
                ("", None),
            )
            .await?;
            self.manifest = Some(manifest);
        }
        for segment in &snapshot.segments {
            let mut offset = self.cursors.get(&segment.id).copied().unwrap_or(0);
            while offset < segment.end {
                let len = (segment.end - offset).min(CHUNK_BYTES);
                let mut chunk = vec![0u8; usize::try_from(len).unwrap_or(0)];
                match feed.storage().read_at(&segment.path, offset, &mut chunk) {
                    Ok(()) => {}
                    // Its bucket left the window meanwhile: nothing more of it ships.
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => break,
                    Err(err) => return Err(local_failure(feed, "reading the log", err)),
                }
                let subject = segment_subject(&self.name, segment.id);
                self.publish(subject, Some(offset), chunk, ("", None))
                    .await?;
                offset += len;
                self.cursors.insert(segment.id, offset);
            }
        }
        let live: BTreeSet<(u64, u32)> = snapshot.segments.iter().map(|s| s.id).collect();
        let gone: Vec<(u64, u32)> = self
            .cursors
            .keys()
            .filter(|id| !live.contains(id))
            .copied()
            .collect();
        for id in gone {
            self.queue_removal(segment_subject(&self.name, id));
            self.cursors.remove(&id);
            self.compacted.remove(&id);
            if self.compaction.as_ref().is_some_and(|job| job.id == id) {
                self.compaction = None;
            }
        }
        Ok(())
    }

    /// What a round does once its log is acknowledged: compaction, sealed runs and
    /// removals, a few chunks or deletes each, so that no writer waits for them.
    async fn tidy(&mut self, feed: &LogFeed, snapshot: &FeedSnapshot) -> Result<(), Halt> {
        self.compact_some(feed, snapshot).await?;
        self.ship_runs(feed).await?;
        self.remove_queued().await
    }

    /// Publishes the sealed runs of the directory the stream lacks, in run id order and
    /// a few chunks a round, each chunk carrying its offset and the run's whole length;
    /// once every run is whole on the stream, purges the runs the directory no longer
    /// holds (merged away, or expired). A restore keeps the runs below the first one
    /// the stream holds in part (`docs/format.md`, "Replica"): a run is published only
    /// after every run with a lower id is whole, so a kept run never covers keys that
    /// only a dropped one holds.
    async fn ship_runs(&mut self, feed: &LogFeed) -> Result<(), Halt> {
        if !self.runs_pending
            && self
                .runs_listed
                .is_some_and(|listed| listed.elapsed() < RUN_LIST_EVERY)
        {
            return Ok(());
        }
        self.runs_listed = Some(std::time::Instant::now());
        let local = local_runs(feed.storage(), &self.dir)
            .map_err(|err| local_failure(feed, "listing the sealed runs", err))?;
        let seen = |runs: &BTreeMap<u64, u64>, awaiting_log: u64| RunsOnReplica {
            whole: local
                .iter()
                .filter(|(run_id, (_, len))| runs.get(run_id) == Some(len))
                .map(|(&run_id, _)| run_id)
                .collect(),
            awaiting_log,
        };
        let mut budget = RUN_CHUNKS_PER_ROUND;
        self.runs_pending = false;
        for (&run_id, (path, len)) in &local {
            let mut offset = self.runs.get(&run_id).copied().unwrap_or(0);
            if offset == 0 && !self.holds_cover_of(feed, path)? {
                // Its cover names log the stream lacks yet: a restore would refuse it. It
                // (and every later run) waits for a round that ships that log: the next
                // round lists again, started by the next fsync or the idle wait (not at
                // once, which would spin until `Interval`'s next fsync).
                self.runs_listed = None;
                let awaiting = local.range(run_id..).count() as u64;
                feed.runs_shipped(seen(&self.runs, awaiting));
                return Ok(());
            }
            while offset < *len {
                if budget == 0 {
                    self.runs_pending = true;
                    feed.runs_shipped(seen(&self.runs, 0));
                    return Ok(());
                }
                let size = (len - offset).min(CHUNK_BYTES);
                let mut chunk = vec![0u8; usize::try_from(size).unwrap_or(0)];
                match feed.storage().read_at(path, offset, &mut chunk) {
                    Ok(()) => {}
                    // Merged away or expired meanwhile: the next listing purges it.
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => break,
                    Err(err) => return Err(local_failure(feed, "reading the sealed runs", err)),
                }
                let subject = run_subject(&self.name, run_id);
                self.publish(subject, Some(offset), chunk, ("", Some(*len)))
                    .await?;
                offset += size;
                self.runs.insert(run_id, offset);
                budget -= 1;
            }
        }
        feed.runs_shipped(seen(&self.runs, 0));
        let gone: Vec<u64> = self
            .runs
            .keys()
            .filter(|run_id| !local.contains_key(run_id))
            .copied()
            .collect();
        for run_id in gone {
            self.queue_removal(run_subject(&self.name, run_id));
            self.runs.remove(&run_id);
        }
        Ok(())
    }

    /// Whether the stream holds the log up to the cover of the run at `path`: its cover
    /// segment up to the cover's offset, or a segment older than every one shipped (it
    /// left the window).
    fn holds_cover_of(&self, feed: &LogFeed, path: &std::path::Path) -> Result<bool, Halt> {
        let cover = match read_cover(feed.storage(), path) {
            Ok(cover) => cover,
            // Merged away or expired meanwhile: the next listing purges it.
            Err(Error::Io(err)) if err.kind() == std::io::ErrorKind::NotFound => return Ok(false),
            Err(Error::Io(err)) => return Err(local_failure(feed, "reading a run's footer", err)),
            Err(err) => return Err(Halt::Failed(err.to_string())),
        };
        let segment = (cover.bucket, cover.seq);
        Ok(match self.cursors.get(&segment) {
            Some(&held) => held >= u64::from(cover.offset),
            None => self
                .cursors
                .keys()
                .next()
                .is_some_and(|&oldest| segment < oldest),
        })
    }

    /// Compacts sealed segments, at most `COMPACT_CHUNKS_PER_ROUND` chunks a round, after
    /// the round's acknowledgement: a sealed segment is published again in whole
    /// chunks, then the chunks before them are purged, so that the stream holds it in
    /// about its own size, where a segment shipped group by group took one message (and
    /// its headers) per group. A restore meanwhile reads both, and skips the bytes it
    /// already has. A compaction left part-way goes on from its offset next round.
    async fn compact_some(&mut self, feed: &LogFeed, snapshot: &FeedSnapshot) -> Result<(), Halt> {
        let mut budget = COMPACT_CHUNKS_PER_ROUND;
        loop {
            let mut job = match self.compaction.take() {
                Some(job) => job,
                None => match self.next_compaction(snapshot) {
                    Some(job) => job,
                    None => return Ok(()),
                },
            };
            let subject = segment_subject(&self.name, job.id);
            while job.offset < job.end {
                if budget == 0 {
                    self.compaction = Some(job);
                    return Ok(());
                }
                let len = (job.end - job.offset).min(CHUNK_BYTES);
                let mut chunk = vec![0u8; usize::try_from(len).unwrap_or(0)];
                match feed.storage().read_at(&job.path, job.offset, &mut chunk) {
                    Ok(()) => {}
                    // Its bucket left the window meanwhile: the next round purges it.
                    Err(err) if err.kind() == std::io::ErrorKind::NotFound => break,
                    Err(err) => return Err(local_failure(feed, "reading the log", err)),
                }
                let published = self
                    .publish(subject.clone(), Some(job.offset), chunk, ("whole.", None))
                    .await;
                let sequence = published.inspect_err(|_| self.compaction = Some(job.clone()))?;
                job.first.get_or_insert(sequence);
                job.offset += len;
                budget -= 1;
            }
            if let (Some(first), true) = (job.first, job.offset >= job.end) {
                let mut budget = usize::MAX;
                self.removal
                    .remove(&self.stream, &subject, Some(first), &mut budget)
                    .await
                    .map_err(Halt::Down)?;
            }
            self.compacted.insert(job.id);
        }
    }

    /// The next sealed segment to compact: shipped whole, and not compacted yet.
    fn next_compaction(&self, snapshot: &FeedSnapshot) -> Option<Compaction> {
        if !self.removal.compacts() {
            return None;
        }
        let segment = snapshot.segments.iter().find(|segment| {
            segment.sealed
                && !self.compacted.contains(&segment.id)
                && self
                    .cursors
                    .get(&segment.id)
                    .is_some_and(|&held| held >= segment.end)
        })?;
        Some(Compaction {
            id: segment.id,
            path: segment.path.clone(),
            end: segment.end,
            offset: 0,
            first: None,
        })
    }

    /// Publishes one message after the last one this store saw. A refusal for a wrong
    /// last sequence is this store's own message whose acknowledgement was lost (the
    /// stream's last message carries this store's token: the sequence is taken from it
    /// and the message sent again, which the duplicate window drops if it was a chunk),
    /// or another store's claim.
    /// `kind` tells chunks of one offset apart in their message ids (a compaction's from
    /// the first shipping's); a run's chunks carry the run's length. Returns the
    /// message's stream sequence.
    async fn publish(
        &mut self,
        subject: String,
        offset: Option<u64>,
        payload: Vec<u8>,
        (kind, run_len): (&str, Option<u64>),
    ) -> Result<u64, Halt> {
        for _ in 0..2 {
            let mut headers = HeaderMap::new();
            headers.insert(
                async_nats::header::NATS_EXPECTED_LAST_SEQUENCE,
                self.last_seq.to_string().as_str(),
            );
            headers.insert(OWNER_HEADER, token_text(self.token).as_str());
            if let Some(offset) = offset {
                headers.insert(OFFSET_HEADER, offset.to_string().as_str());
                let id = chunk_id(self.token, &subject, kind, offset, payload.len());
                headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
            }
            if let Some(run_len) = run_len {
                headers.insert(LENGTH_HEADER, run_len.to_string().as_str());
            }
            let sent = self
                .js
                .publish_with_headers(subject.clone(), headers, payload.clone().into())
                .await
                .map_err(|err| Halt::Down(err.to_string()))?;
            match sent.await {
                Ok(ack) => {
                    self.last_seq = self.last_seq.max(ack.sequence);
                    return Ok(ack.sequence);
                }
                Err(err) if err.kind() == PublishErrorKind::WrongLastSequence => {
                    self.catch_up().await?;
                }
                Err(err) => return Err(Halt::Down(err.to_string())),
            }
        }
        Err(Halt::NotOwner)
    }

    /// After a refused publish: takes the stream's last sequence if its last message is
    /// this store's; otherwise the replica is another store's.
    async fn catch_up(&mut self) -> Result<(), Halt> {
        let info = self
            .stream
            .get_info()
            .await
            .map_err(|err| Halt::Down(err.to_string()))?;
        self.check_owner().await?;
        self.last_seq = info.state.last_sequence;
        Ok(())
    }

    /// `NotOwner` unless the stream's newest owner message is this store's claim: then
    /// every message after it is this store's. Asked of the owner subject, not of the
    /// stream's last message, which a purge may have removed.
    async fn check_owner(&self) -> Result<(), Halt> {
        let owner = last_message(&self.stream, &owner_subject(&self.name))
            .await
            .map_err(|err| Halt::Down(err.to_string()))?;
        match owner
            .as_ref()
            .and_then(|message| owner_of(&message.headers))
        {
            Some(token) if token == self.token => Ok(()),
            _ => Err(Halt::NotOwner),
        }
    }

    /// Queues `subject` (a segment or run that left the store) for removal.
    fn queue_removal(&mut self, subject: String) {
        if !self.removing.contains(&subject) {
            self.removing.push_back(subject);
        }
    }

    /// Removes the queued subjects, up to a round's budget of deletions, if this store
    /// still owns the replica: a removal carries no expected sequence, so a fenced
    /// store, whose clock may run ahead of the new owner's, must not remove what the new
    /// owner still needs.
    async fn remove_queued(&mut self) -> Result<(), Halt> {
        if self.removing.is_empty() {
            return Ok(());
        }
        self.check_owner().await?;
        let mut budget = DELETES_PER_ROUND;
        while let Some(subject) = self.removing.front() {
            let done = self
                .removal
                .remove(&self.stream, subject, None, &mut budget)
                .await
                .map_err(Halt::Down)?;
            if !done {
                break;
            }
            self.removing.pop_front();
        }
        Ok(())
    }
}

/// The message id of a chunk: its owner, subject, kind, offset and length. A re-send
/// from the same offset that carries more bytes (the log was fsynced further while an
/// acknowledgement was lost) gets another id, so JetStream stores it rather than drop it
/// as the first copy's duplicate: a duplicate's acknowledgement then always means these
/// very bytes are held, and the cursor never moves past bytes the stream lacks.
fn chunk_id(token: u64, subject: &str, kind: &str, offset: u64, len: usize) -> String {
    format!("{}.{subject}.{kind}{offset}+{len}", token_text(token))
}

/// The sealed runs in `dir`, by id, with their paths and lengths (a run removed while
/// it is listed is left out).
fn local_runs(
    storage: &dyn crate::io::Storage,
    dir: &std::path::Path,
) -> std::io::Result<BTreeMap<u64, (PathBuf, u64)>> {
    let mut runs = BTreeMap::new();
    for path in storage.list(dir)? {
        let Some((run_id, _)) = parse_run_name(&path) else {
            continue;
        };
        match storage.file_len(&path) {
            Ok(len) => {
                runs.insert(run_id, (path, len));
            }
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => {}
            Err(err) => return Err(err),
        }
    }
    Ok(runs)
}

/// A failed read of the store's own files: an I/O failure, which poisons the store like
/// any other (its writers are answered `Poisoned`, not `Unavailable`), and ends shipping.
fn local_failure(feed: &LogFeed, what: &str, err: std::io::Error) -> Halt {
    let why = format!("{what}: {err}");
    feed.fail(err);
    Halt::Failed(why)
}

/// The owner token a message carries.
fn owner_of(headers: &HeaderMap) -> Option<u64> {
    let text = headers.get(OWNER_HEADER)?.as_str();
    u64::from_str_radix(text, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use oncedb_testkit::servers::{nats::NatsServer, runtime};
    use std::path::Path;

    /// A link for replica `name` as a store holding `token` would have it, with
    /// `removing` queued: the state of a store that a restore fenced between two rounds,
    /// before its next publish (which would have told it).
    async fn fenced_link(server: &NatsServer, name: &str, token: u64, removing: &str) -> Link {
        let replication = Replication::new(server.url(), name).replicas(1);
        let js = async_nats::jetstream::new(async_nats::connect(server.url()).await.unwrap());
        let stream = js
            .get_or_create_stream(stream_config(&replication))
            .await
            .unwrap();
        let mut link = Link::unsettled(&replication, (js, stream), Path::new(""), Removal::Purge);
        link.token = token;
        link.removing.push_back(removing.to_owned());
        link
    }

    /// Finding: a fenced owner removed subjects by its own clock. A store fenced by a
    /// restore, with a segment queued for removal (its clock moved the segment's bucket
    /// out of its window) and nothing to publish, must not purge what the new owner
    /// still holds: a removal carries no expected sequence, so only the owner check
    /// before the round refuses it.
    #[test]
    fn a_fenced_owner_removes_nothing() {
        let server = NatsServer::start();
        runtime().block_on(async {
            let name = "fenced-removal";
            let segment = segment_subject(name, (7, 0));
            let (old, new) = (0x01d_u64, 0x0e_u64);
            let mut link = fenced_link(&server, name, old, &segment).await;
            // The old owner's claim and chunk, then the new owner's claim.
            let messages = [
                (owner_subject(name), old, None),
                (segment.clone(), old, Some("0")),
                (owner_subject(name), new, None),
            ];
            for (subject, token, offset) in messages {
                let mut headers = HeaderMap::new();
                headers.insert(OWNER_HEADER, token_text(token).as_str());
                if let Some(offset) = offset {
                    headers.insert(OFFSET_HEADER, offset);
                }
                link.js
                    .publish_with_headers(subject, headers, "bytes".into())
                    .await
                    .unwrap()
                    .await
                    .unwrap();
            }

            assert!(matches!(link.remove_queued().await, Err(Halt::NotOwner)));
            let held = last_message(&link.stream, &segment).await.unwrap();
            assert!(
                held.is_some(),
                "the fenced owner purged the new owner's segment"
            );

            // The owner itself removes it.
            link.token = new;
            assert!(link.remove_queued().await.is_ok());
            assert!(
                last_message(&link.stream, &segment)
                    .await
                    .unwrap()
                    .is_none()
            );
        });
    }
}
