//! How a replica's acknowledgements gate the journal's writers: in sync mode a write is
//! acknowledged once the replica acknowledged it; in async mode writes are refused while
//! the replica lags by more than allowed. The journal's counter of bytes fsynced since
//! open (`WriterState::synced`) and the replica's acknowledged position
//! (`WriterState::shipped`) are compared; `shipping` (feature `replicate`) moves the
//! latter.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use parking_lot::MutexGuard;

use super::{Shared, WriterState};
use crate::base::{Error, Result};

/// How a replica's acknowledgements gate the journal's writers.
#[derive(Debug, Clone)]
pub(crate) struct ReplicaGate {
    /// The replica's name, for errors.
    pub(crate) name: Arc<str>,
    /// A write is acknowledged only once the replica acknowledged it.
    pub(crate) sync: bool,
    /// In async mode, writes are refused while more fsynced bytes than this wait to be
    /// shipped.
    pub(crate) max_lag_bytes: u64,
    /// In sync mode, how long a write waits for the replica before it is answered
    /// `Unavailable`.
    pub(crate) ack_timeout: Duration,
}

impl Shared {
    /// How far a `Sync` write counts as done: fsynced, and acknowledged by a replica in
    /// sync mode.
    pub(super) fn acknowledged(&self, state: &WriterState) -> u64 {
        match &self.replica {
            Some(gate) if gate.sync => state.synced.min(state.shipped),
            _ => state.synced,
        }
    }

    /// Publishes [`Shared::acknowledged`] for readers without the lock; call whenever
    /// `synced` or `shipped` moves.
    pub(super) fn publish_acknowledged(&self, state: &WriterState) {
        self.acknowledged_to
            .fetch_max(self.acknowledged(state), Ordering::AcqRel);
    }

    /// Under a replica in sync mode: waits until the replica acknowledged the log up to
    /// `target`, at most the gate's timeout.
    pub(super) fn wait_shipped(
        &self,
        state: &mut MutexGuard<'_, WriterState>,
        target: u64,
    ) -> Result<()> {
        let Some(gate) = self.replica.as_ref().filter(|gate| gate.sync) else {
            return Ok(());
        };
        let deadline = Instant::now() + gate.ack_timeout;
        loop {
            self.check_writable()?;
            if state.shipped >= target {
                return Ok(());
            }
            if self.shipped_changed.wait_until(state, deadline).timed_out()
                && state.shipped < target
            {
                return Err(self.unacknowledged());
            }
        }
    }

    /// The answer to a write a sync replica did not acknowledge in time: its outcome is
    /// unknown (it is in the local log, and shipped once the replica is back).
    pub(super) fn unacknowledged(&self) -> Error {
        let why = self
            .replica_down
            .lock()
            .clone()
            .unwrap_or_else(|| "no acknowledgement".to_owned());
        let (name, timeout) = self
            .replica
            .as_ref()
            .map_or((Arc::from(""), Duration::ZERO), |gate| {
                (Arc::clone(&gate.name), gate.ack_timeout)
            });
        Error::Unavailable {
            engine: "jetstream",
            message: format!("replica {name} did not acknowledge within {timeout:?}: {why}"),
        }
    }

    /// Under a replica in async mode: refuses a write while the replica lags by more
    /// than the gate allows.
    pub(super) fn check_lag(&self, state: &WriterState) -> Result<()> {
        let Some(gate) = self.replica.as_ref().filter(|gate| !gate.sync) else {
            return Ok(());
        };
        let lag = self.replica_lag(state);
        if lag > gate.max_lag_bytes {
            let why = self.replica_down.lock().clone().unwrap_or_default();
            return Err(Error::Unavailable {
                engine: "jetstream",
                message: format!(
                    "replica {} lags by {lag} bytes, more than {}: {why}",
                    gate.name, gate.max_lag_bytes
                ),
            });
        }
        Ok(())
    }

    /// Marks whether an async replica lags by more than it may (read without the lock
    /// by every write's check); call whenever `synced` or `shipped` moves.
    pub(super) fn update_lag(&self, state: &WriterState) {
        if let Some(gate) = self.replica.as_ref().filter(|gate| !gate.sync) {
            let lagging = self.replica_lag(state) > gate.max_lag_bytes;
            self.lagging.store(lagging, Ordering::Release);
        }
    }

    /// Bytes fsynced and not yet acknowledged by the replica, the log from before this
    /// open that it lacks included.
    pub(super) fn replica_lag(&self, state: &WriterState) -> u64 {
        match &self.replica {
            Some(_) => state
                .synced
                .saturating_sub(state.shipped)
                .saturating_add(self.backlog.load(Ordering::Acquire)),
            None => 0,
        }
    }
}
