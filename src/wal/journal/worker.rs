//! The segment worker: the file work of a roll-over that no writer has to wait for.
//!
//! After every roll-over (and once at open) the worker runs one round:
//!
//! 1. if the active segment's directory entry is not durable yet (it was a prepared file
//!    renamed into the log), fsync the directory;
//! 2. unlink (or move into the archive) every segment whose bucket has left the window,
//!    then fsync the directories;
//! 3. remove prepared files whose names the log has passed;
//! 4. prepare the segments a roll-over can ask for next: sequence 0 of the bucket after
//!    the active one (a roll-over at a bucket boundary), and, once the active segment is
//!    half full, the next sequence number of its bucket (a roll-over at the size limit;
//!    the writer asks for a round when the segment passes half). Each is created under
//!    its prepared name with its header written and fsynced.
//!
//! Step 1 comes first, so a segment's directory entry is durable before any older
//! segment is unlinked (a file whose unlink a power loss undoes is then never taken for
//! the newest). The worker works outside the writer's lock and takes it only to read the
//! plan and to publish the results. Any failure poisons the store, like a writer's.

use std::sync::atomic::Ordering;

use parking_lot::MutexGuard;

use super::{Shared, WriterState, next_segment};
use crate::base::Result;
use crate::io::StorageFile;
use crate::wal::archive::retire;
use crate::wal::names::prepared_path;

/// What one round does, read under the lock.
struct Plan {
    /// The active segment, if its directory entry still has to be made durable.
    sync_entry_of: Option<(u64, u32)>,
    expired: Vec<(u64, u32)>,
    stale: Vec<((u64, u32), Box<dyn StorageFile>)>,
    wanted: Vec<(u64, u32)>,
}

impl Plan {
    fn of(shared: &Shared, state: &mut WriterState) -> Plan {
        let Some(active) = state.active.as_ref() else {
            return Plan {
                sync_entry_of: None,
                expired: Vec::new(),
                stale: Vec::new(),
                wanted: Vec::new(),
            };
        };
        let current = (active.bucket, active.seq);
        let expired = state
            .segments
            .keys()
            .copied()
            .take_while(|&(bucket, _)| !shared.window.is_live(bucket, active.bucket))
            .filter(|&id| id != current)
            .collect();
        let newest = state
            .segments
            .keys()
            .next_back()
            .copied()
            .unwrap_or(current);
        let wanted = successors(newest, shared.half_full(active))
            .into_iter()
            .filter(|id| !state.prepared.contains_key(id))
            .collect();
        let stale_ids: Vec<(u64, u32)> =
            state.prepared.range(..=newest).map(|(&id, _)| id).collect();
        let stale = stale_ids
            .into_iter()
            .filter_map(|id| state.prepared.remove(&id).map(|file| (id, file)))
            .collect();
        Plan {
            sync_entry_of: (!active.entry_durable).then_some(current),
            expired,
            stale,
            wanted,
        }
    }
}

/// The names a roll-over after segment `newest` can ask for, each once, in order:
/// sequence 0 of the next bucket, and (`size_limit`) the next sequence number of the same
/// bucket. When the bucket's sequence numbers are used up, both are the same name, which
/// must be prepared only once.
fn successors(newest: (u64, u32), size_limit: bool) -> Vec<(u64, u32)> {
    let mut names: Vec<(u64, u32)> = [newest.0.checked_add(1), size_limit.then_some(newest.0)]
        .into_iter()
        .flatten()
        .filter_map(|bucket| next_segment(Some(newest), bucket))
        .collect();
    names.sort_unstable();
    names.dedup();
    names
}

/// What a round did, published under the lock.
struct Done {
    entry_synced: Option<(u64, u32)>,
    deleted: Vec<(u64, u32)>,
    prepared: Vec<((u64, u32), Box<dyn StorageFile>)>,
}

impl Shared {
    /// The worker thread's loop: one round per request until shutdown or a failure.
    pub(super) fn run_worker(&self) {
        let mut state = self.state.lock();
        loop {
            if self.shutdown.load(Ordering::Acquire) || self.check_writable().is_err() {
                return;
            }
            if state.work_done >= state.work_requested {
                self.worker_wake.wait(&mut state);
                continue;
            }
            let target = state.work_requested;
            let plan = Plan::of(self, &mut state);
            let result = MutexGuard::unlocked(&mut state, || self.carry_out(plan));
            match result {
                Ok(done) => self.publish(&mut state, done),
                Err(err) => {
                    let _ = self.poison(err);
                    return;
                }
            }
            state.work_done = target;
            self.changed.notify_all();
        }
    }

    /// Waits until the rounds asked for so far are done; the worker's failure is reported
    /// as the poisoning it caused.
    pub(super) fn drain_worker(&self, state: &mut MutexGuard<'_, WriterState>) -> Result<()> {
        let target = state.work_requested;
        loop {
            self.check_writable()?;
            if state.work_done >= target {
                return Ok(());
            }
            self.changed.wait(state);
        }
    }

    fn carry_out(&self, plan: Plan) -> std::io::Result<Done> {
        if plan.sync_entry_of.is_some() {
            self.sync_times
                .time(&self.fsyncs, || self.storage.sync_dir(&self.dir))?;
        }
        retire(
            &*self.storage,
            &self.dir,
            self.archive.as_deref(),
            &plan.expired,
            &mut |dir| {
                self.sync_times
                    .time(&self.fsyncs, || self.storage.sync_dir(dir))
            },
        )?;
        self.readers.forget(&plan.expired);
        for ((bucket, seq), file) in plan.stale {
            drop(file);
            self.storage
                .remove(&prepared_path(&self.dir, bucket, seq))?;
        }
        let mut prepared = Vec::with_capacity(plan.wanted.len());
        for (bucket, seq) in plan.wanted {
            prepared.push(((bucket, seq), self.prepare(bucket, seq)?));
        }
        Ok(Done {
            entry_synced: plan.sync_entry_of,
            deleted: plan.expired,
            prepared,
        })
    }

    /// Creates segment `(bucket, seq)` under its prepared name with its header fsynced.
    /// No directory fsync: the rename into the log is made durable later (see
    /// `Active::entry_durable`), and a prepared file lost to a power loss held nothing.
    fn prepare(&self, bucket: u64, seq: u32) -> std::io::Result<Box<dyn StorageFile>> {
        self.create_with_header(&prepared_path(&self.dir, bucket, seq), bucket, seq)
    }

    fn publish(&self, state: &mut WriterState, done: Done) {
        if let Some(active) = state.active.as_mut()
            && done.entry_synced == Some((active.bucket, active.seq))
        {
            active.entry_durable = true;
        }
        for id in &done.deleted {
            state.segments.remove(id);
        }
        self.segments_deleted
            .fetch_add(done.deleted.len() as u64, Ordering::Relaxed);
        let newest = state.segments.keys().next_back().copied();
        let mut stale = false;
        for (id, file) in done.prepared {
            // A roll-over may have passed the name while the file was being prepared:
            // the next round removes it.
            stale |= newest.is_some_and(|newest| id <= newest);
            state.prepared.insert(id, file);
        }
        if stale {
            state.work_requested += 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::successors;

    #[test]
    fn every_successor_is_prepared_once() {
        assert_eq!(successors((5, 3), false), [(6, 0)]);
        assert_eq!(successors((5, 3), true), [(5, 4), (6, 0)]);
        // The last sequence number of bucket 5: both roll-overs lead to (6, 0).
        assert_eq!(successors((5, u32::MAX), true), [(6, 0)]);
        assert_eq!(successors((u64::MAX, u32::MAX), true), []);
    }
}
