//! Commit notification for asynchronous callers: a future that completes when the log is
//! durable (or written, as the mode asks) up to a ticket, without a thread waiting for it.
//!
//! A pending [`Commit`] leaves its waker in [`WriterState::commits`]. Whoever finishes a
//! group commit (a blocking writer, the interval flusher, or the committer thread) wakes
//! the commits it covered. The committer thread leads a group commit while some pending
//! commit is past what is done and no blocking writer leads one for it: one thread for
//! every asynchronous caller, where a blocking pool would hold a thread per waiting call.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll, Waker};
use std::time::Instant;

use super::{INTERVAL_BUFFER_BYTES, Journal, Shared, Ticket, WriterState};
use crate::base::{Durability, Result};

/// An asynchronous caller waiting for the log up to `target`.
pub(super) struct PendingCommit {
    id: u64,
    target: u64,
    waker: Waker,
    /// When a commit waiting for a sync replica's acknowledgement gives up.
    deadline: Option<Instant>,
}

/// The log durable (or written) up to a ticket, as [`Journal::wait`] would block for.
/// Dropping it before it completes withdraws its waker; the entries stay appended.
#[must_use = "a commit does nothing unless awaited"]
pub(crate) struct Commit<'a> {
    shared: &'a Shared,
    id: u64,
    /// Zero when nothing needs waiting for (`Interval` with a small buffer).
    target: u64,
    sync: bool,
    registered: bool,
    /// Under a sync replica: when the wait is answered `Unavailable` (the replica's
    /// acknowledgement timeout, as [`Journal::wait`] waits at most).
    deadline: Option<Instant>,
}

impl Journal {
    /// A future that completes when [`Journal::wait`] on `ticket` would return.
    pub(crate) fn commit(&self, ticket: Ticket) -> Commit<'_> {
        let shared = &*self.shared;
        let (target, sync) = match shared.durability {
            Durability::Sync => (ticket.0, true),
            Durability::Buffered => (ticket.0, false),
            Durability::Interval(_) => {
                let large = shared.state.lock().buffer.len() >= INTERVAL_BUFFER_BYTES;
                (if large { ticket.0 } else { 0 }, false)
            }
        };
        let deadline = shared
            .replica
            .as_ref()
            .filter(|gate| gate.sync && sync)
            .map(|gate| Instant::now() + gate.ack_timeout);
        Commit {
            shared,
            id: shared.next_commit.fetch_add(1, Ordering::Relaxed),
            target,
            sync,
            registered: false,
            deadline,
        }
    }
}

impl Future for Commit<'_> {
    type Output = Result<()>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<()>> {
        let shared = self.shared;
        let mut state = shared.state.lock();
        let reached = if self.sync {
            shared.acknowledged(&state)
        } else {
            state.written
        };
        let mut outcome = shared.check_writable();
        if outcome.is_ok()
            && reached < self.target
            && self
                .deadline
                .is_some_and(|deadline| Instant::now() >= deadline)
        {
            outcome = Err(shared.unacknowledged());
        }
        if outcome.is_err() || reached >= self.target {
            self.withdraw(&mut state);
            return Poll::Ready(outcome);
        }
        let (id, deadline) = (self.id, self.deadline);
        match state.commits.iter_mut().find(|pending| pending.id == id) {
            Some(pending) => pending.waker.clone_from(cx.waker()),
            None => state.commits.push(PendingCommit {
                id,
                target: self.target,
                waker: cx.waker().clone(),
                deadline,
            }),
        }
        self.registered = true;
        shared.commit_wanted.notify_one();
        Poll::Pending
    }
}

impl Commit<'_> {
    fn withdraw(&mut self, state: &mut WriterState) {
        if std::mem::take(&mut self.registered) {
            let id = self.id;
            state.commits.retain(|pending| pending.id != id);
        }
    }
}

impl Drop for Commit<'_> {
    fn drop(&mut self) {
        if self.registered {
            let shared = self.shared;
            self.withdraw(&mut shared.state.lock());
        }
    }
}

/// Wakes (and drops) the pending commits whose deadline passed: each answers
/// `Unavailable` when polled.
fn wake_expired(commits: &mut Vec<PendingCommit>) {
    let now = Instant::now();
    commits.retain(|pending| {
        let expired = pending.deadline.is_some_and(|deadline| now >= deadline);
        if expired {
            pending.waker.wake_by_ref();
        }
        !expired
    });
}

impl Shared {
    /// Wakes every pending commit: the store stopped taking writes (fenced), and each
    /// reports why when polled. Only the replica's shipping stops a store this way.
    #[cfg(feature = "replicate")]
    pub(super) fn wake_all_commits(&self, state: &mut WriterState) {
        for pending in state.commits.drain(..) {
            pending.waker.wake();
        }
    }

    /// Wakes the pending commits the log now covers.
    pub(super) fn wake_commits(&self, state: &mut WriterState) {
        if state.commits.is_empty() {
            return;
        }
        let reached = match self.durability {
            Durability::Sync => self.acknowledged(state),
            Durability::Buffered | Durability::Interval(_) => state.written,
        };
        state.commits.retain(|pending| {
            let done = pending.target <= reached;
            if done {
                pending.waker.wake_by_ref();
            }
            !done
        });
    }

    /// The committer thread: leads a group commit whenever a pending commit is past what
    /// is done, until shutdown. Writers that block lead their own groups meanwhile; the
    /// leader election in [`Shared::persist`] keeps one group in flight at a time.
    ///
    /// It sleeps only when no pending commit is past what is done, so a commit never
    /// waits on it unseen; once the store is poisoned, it wakes every pending commit
    /// (each then reports the failure) and later ones never register.
    pub(super) fn run_committer(&self) {
        let sync = matches!(self.durability, Durability::Sync);
        let mut state = self.state.lock();
        while !self.shutdown.load(Ordering::Acquire) {
            if self.check_writable().is_err() {
                for pending in state.commits.drain(..) {
                    pending.waker.wake();
                }
                self.commit_wanted.wait(&mut state);
                continue;
            }
            let wanted = state.commits.iter().map(|pending| pending.target).max();
            let reached = if sync { state.synced } else { state.written };
            match wanted {
                // A failure poisons the store: the next round wakes the commits. Commits
                // fsynced and waiting for a replica's acknowledgement are woken by it, or
                // at their deadline.
                Some(target) if target > reached => {
                    let _ = self.persist(&mut state, target, sync);
                }
                _ => match state
                    .commits
                    .iter()
                    .filter_map(|pending| pending.deadline)
                    .min()
                {
                    Some(deadline) => {
                        let _ = self.commit_wanted.wait_until(&mut state, deadline);
                        wake_expired(&mut state.commits);
                    }
                    None => self.commit_wanted.wait(&mut state),
                },
            }
        }
    }
}
