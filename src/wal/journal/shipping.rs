//! What a replica is fed from the journal: the log's fsynced bytes, segment by segment,
//! and the acknowledgements that come back. The journal knows nothing of where they go;
//! the replica room (`crate::replica`) reads them through a [`LogFeed`].
//!
//! Positions are the journal's counter of bytes fsynced since open (`WriterState::synced`):
//! a snapshot pairs that counter with the segment lengths it covers, so that once every
//! byte of a snapshot is shipped, the shipper reports the counter, and writers waiting
//! for a replica's acknowledgement compare their tickets with it.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::{Journal, RunsOnReplica, Shared, WriterState};
use crate::io::Storage;
use crate::wal::manifest::MANIFEST_LEN;
use crate::wal::names::segment_path;

/// One segment of a [`FeedSnapshot`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct FeedSegment {
    /// (bucket, sequence).
    pub(crate) id: (u64, u32),
    pub(crate) path: PathBuf,
    /// Bytes `0..end` are fsynced: the whole file of a sealed segment, the active one up
    /// to its last fsynced group.
    pub(crate) end: u64,
    /// Whether the segment is sealed: it will not grow again.
    pub(crate) sealed: bool,
}

/// The log's fsynced bytes at one moment.
#[derive(Debug, Clone)]
pub(crate) struct FeedSnapshot {
    /// The journal's fsynced counter the snapshot covers.
    pub(crate) counter: u64,
    /// Every segment on disk, oldest first.
    pub(crate) segments: Vec<FeedSegment>,
}

/// The replica's handle on the journal.
pub(crate) struct LogFeed(Arc<Shared>);

impl Journal {
    /// The feed a replica ships from.
    pub(crate) fn feed(&self) -> LogFeed {
        LogFeed(Arc::clone(&self.shared))
    }
}

impl LogFeed {
    /// The fsynced log now.
    pub(crate) fn snapshot(&self) -> FeedSnapshot {
        let shared = &*self.0;
        snapshot_of(shared, &shared.state.lock())
    }

    /// Waits until the log is fsynced past `shipped` (or `timeout` passes, or a wake),
    /// and returns the log then; `None` once the store is closing. It may return with
    /// nothing new: the caller looks, and waits again.
    pub(crate) fn wait_past(&self, shipped: u64, timeout: Duration) -> Option<FeedSnapshot> {
        let shared = &*self.0;
        let deadline = Instant::now() + timeout;
        let mut state = shared.state.lock();
        if state.synced <= shipped && !shared.shutdown.load(Ordering::Acquire) {
            let _ = shared.changed.wait_until(&mut state, deadline);
        }
        if shared.shutdown.load(Ordering::Acquire) {
            return None;
        }
        Some(snapshot_of(shared, &state))
    }

    /// Wakes a shipper waiting in [`LogFeed::wait_past`], to see that it should stop.
    pub(crate) fn wake(&self) {
        let _state = self.0.state.lock();
        self.0.changed.notify_all();
    }

    /// Everything up to `counter` is acknowledged by the replica: writers waiting for it
    /// are answered, and the replica is up.
    pub(crate) fn shipped(&self, counter: u64) {
        let shared = &*self.0;
        let mut state = shared.state.lock();
        state.shipped = state.shipped.max(counter);
        // A round shipped every segment to its end: the log from before open too.
        shared.backlog.store(0, Ordering::Release);
        shared.publish_acknowledged(&state);
        shared.update_lag(&state);
        *shared.replica_down.lock() = None;
        shared.shipped_changed.notify_all();
        #[cfg(feature = "async")]
        {
            shared.wake_commits(&mut state);
            shared.commit_wanted.notify_one();
        }
    }

    /// The replica lacks `bytes` of the log from before this open: counted in the lag
    /// (and bounded by an async replica's `max_lag_bytes`) until a round ships them.
    pub(crate) fn backlog(&self, bytes: u64) {
        let shared = &*self.0;
        let state = shared.state.lock();
        shared.backlog.store(bytes, Ordering::Release);
        shared.update_lag(&state);
    }

    /// The replica cannot be reached (`why`): writers waiting for it time out with it.
    pub(crate) fn replica_down(&self, why: String) {
        *self.0.replica_down.lock() = Some(why);
    }

    /// What the replica holds of the sealed runs now.
    pub(crate) fn runs_shipped(&self, runs: RunsOnReplica) {
        *self.0.runs_shipped.lock() = runs;
    }

    /// Reading the log (or a run) to ship it failed: an I/O failure of the store, which
    /// poisons it like any other; writers waiting for the replica are answered now.
    pub(crate) fn fail(&self, err: std::io::Error) {
        let shared = &*self.0;
        let _ = shared.poison(err);
        let mut state = shared.state.lock();
        shared.shipped_changed.notify_all();
        #[cfg(feature = "async")]
        shared.wake_all_commits(&mut state);
        drop(state);
    }

    /// Another store took the replica over: this one may not write again.
    pub(crate) fn lose_ownership(&self) {
        let shared = &*self.0;
        shared.not_owner.store(true, Ordering::Release);
        let mut state = shared.state.lock();
        shared.shipped_changed.notify_all();
        shared.changed.notify_all();
        // Pending asynchronous commits answer `NotOwner` now, not never.
        #[cfg(feature = "async")]
        shared.wake_all_commits(&mut state);
        drop(state);
    }

    pub(crate) fn storage(&self) -> &dyn Storage {
        &*self.0.storage
    }

    /// The manifest as the store holds it now.
    pub(crate) fn manifest_bytes(&self) -> [u8; MANIFEST_LEN] {
        self.0.manifest.lock().encode()
    }
}

fn snapshot_of(shared: &Shared, state: &WriterState) -> FeedSnapshot {
    let active = state
        .active
        .as_ref()
        .map(|active| ((active.bucket, active.seq), active.synced_len));
    let segments = state
        .segments
        .iter()
        .map(|(&id, &len)| {
            let (end, sealed) = match active {
                Some((active_id, synced)) if active_id == id => (synced, false),
                _ => (len, true),
            };
            FeedSegment {
                id,
                path: segment_path(&shared.dir, id.0, id.1),
                end,
                sealed,
            }
        })
        .collect();
    FeedSnapshot {
        counter: state.synced,
        segments,
    }
}
