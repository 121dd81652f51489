//! [`Store::run_once`] on every store: the loop of [`Db::run_once`](crate::Db::run_once),
//! asynchronous, with the lease renewed beside the operation (the process's renewal
//! timer, then a task of its own once the first renewal comes due).
//!
//! Every ending is an ending: the operation's output completes the record, its error
//! releases or fails it, an output over the store's limit fails it with a short text,
//! and a cancelled or panicking operation leaves it in flight with a note ("outcome
//! unknown"), which no store takes over automatically.

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;

use super::renewals::{Registration, Timer};
use super::{Store, StoreLease};
use crate::api::{
    LeaseWatch, OnError, Once, Renewals, Reservation, RunOnce, Scope, cut_to, too_large_note,
    unfinished_note,
};
use crate::base::{Error, Result};

pub(super) async fn run_once<S, F, Fut, E>(
    store: &S,
    scope: &Scope,
    (key, request): (&[u8], &[u8]),
    how: RunOnce,
    operation: F,
) -> Result<Once<E>>
where
    S: Store,
    F: FnOnce(LeaseWatch) -> Fut + Send,
    Fut: Future<Output = std::result::Result<Vec<u8>, E>> + Send,
    E: std::fmt::Display + Send,
{
    // Read the clock only when an attempt is in flight: the common call acquires.
    let mut deadline = None;
    loop {
        let asked = Instant::now();
        match store.reserve(scope, key, request).await? {
            Reservation::Acquired(lease) => {
                let held = Held::start((lease, asked), store.lease_timeout());
                let output = operation(held.watch.clone()).await;
                let lease = held.stop().await?;
                return finish(lease, how, store.max_response_bytes(), output).await;
            }
            Reservation::InFlight { since, .. } => {
                let deadline =
                    *deadline.get_or_insert_with(|| tokio::time::Instant::from_std(how.deadline()));
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                if left.is_zero() {
                    return Err(Error::StillInFlight { since });
                }
                store.wait_finished(scope, key, left).await?;
            }
            Reservation::Completed(record)
            | Reservation::Failed(record)
            | Reservation::Expired(record) => return Ok(Once::Replayed(record)),
            Reservation::Mismatch => return Err(Error::RequestMismatch),
        }
    }
}

/// A lease while its operation runs, and, if dropped before [`Held::stop`] (the caller's
/// future was cancelled, or the operation panicked), left in flight with a note. Its
/// first renewal is registered with the process's renewal timer ([`Timer`]); if the
/// operation is still running when it comes due, the lease gets a renewal task of its
/// own on its runtime from then on (so an operation that keeps its own task busy does not starve the
/// renewals on a multi-threaded runtime).
pub(crate) struct Held<L: StoreLease> {
    lease: Option<Arc<L>>,
    renewing: Option<Arc<Mutex<Renewing>>>,
    /// What the operation is told of its lease.
    pub(crate) watch: LeaseWatch,
}

/// Where a held lease's renewals are.
enum Renewing {
    /// Its first renewal is registered with the timer (`None` for the moment between
    /// the registration and its answer).
    Armed(Option<Registration>),
    /// It came due: the lease's renewal task.
    Running(tokio::task::JoinHandle<()>),
    /// The operation ended: nothing more starts.
    Stopped,
}

impl<L: StoreLease> Held<L> {
    /// Starts renewing `lease`, asked for at `asked`, every third of `lease_timeout`, if
    /// set. Called on a runtime: a renewal task, once one is due, is spawned onto it.
    pub(crate) fn start((lease, asked): (L, Instant), lease_timeout: Option<Duration>) -> Held<L> {
        let watch = LeaseWatch::new(lease.epoch(), lease_timeout, asked);
        let lease = Arc::new(lease);
        let renewing = lease_timeout.map(|timeout| {
            let state = Arc::new(Mutex::new(Renewing::Armed(None)));
            // The task holds the lease weakly, and strongly only while a renewal is on
            // its way: `stop` then takes the lease back without waiting for the task.
            let due = {
                let (lease, watch, state) =
                    (Arc::downgrade(&lease), watch.clone(), Arc::clone(&state));
                let runtime = tokio::runtime::Handle::current();
                Box::new(move || {
                    let mut state = state.lock();
                    if matches!(*state, Renewing::Armed(_)) {
                        let task = renew(lease, watch, (timeout, asked), Duration::ZERO);
                        *state = Renewing::Running(runtime.spawn(task));
                    }
                })
            };
            let first = Renewals::new(timeout, asked).first();
            let at = asked.checked_add(first).unwrap_or(asked);
            let registration = Timer::get().register(timeout, at, due);
            let mut armed = state.lock();
            if matches!(*armed, Renewing::Armed(None)) {
                *armed = Renewing::Armed(Some(registration));
            }
            drop(armed);
            state
        });
        Held {
            lease: Some(lease),
            renewing,
            watch,
        }
    }

    /// Ends the renewals: takes the first one back, or stops the renewal task; the task,
    /// if there was one.
    fn stop_renewals(&mut self) -> Option<tokio::task::JoinHandle<()>> {
        stop_renewing(self.renewing.take()?)
    }

    /// Stops the renewals and hands the lease back, to end it.
    pub(crate) async fn stop(mut self) -> Result<L> {
        let renewer = self.stop_renewals();
        let Some(lease) = self.lease.take() else {
            return Err(still_shared());
        };
        match Arc::try_unwrap(lease) {
            Ok(lease) => Ok(lease),
            // A renewal on its way holds the lease: once the aborted task has ended, it
            // no longer does.
            Err(lease) => {
                if let Some(renewer) = renewer {
                    let _ = renewer.await;
                }
                Arc::try_unwrap(lease).map_err(|_| still_shared())
            }
        }
    }
}

/// Ends the renewals of `state`: takes the first one back, or stops the renewal task;
/// the task, if there was one.
fn stop_renewing(state: Arc<Mutex<Renewing>>) -> Option<tokio::task::JoinHandle<()>> {
    let previous = std::mem::replace(&mut *state.lock(), Renewing::Stopped);
    match previous {
        Renewing::Armed(Some(registration)) => {
            Timer::get().cancel(registration);
            None
        }
        Renewing::Armed(None) | Renewing::Stopped => None,
        Renewing::Running(task) => {
            task.abort();
            Some(task)
        }
    }
}

impl<L: StoreLease> Drop for Held<L> {
    fn drop(&mut self) {
        let renewing = self.renewing.take();
        let Some(lease) = self.lease.take() else {
            drop(renewing.and_then(stop_renewing));
            return;
        };
        let note = unfinished_note();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                // The renewals go on until the note has landed: a lease that lapsed
                // first could be taken over, and the operation run again, although its
                // outcome is unknown.
                drop(runtime.spawn(async move {
                    if let Err(err) = lease.note(note).await {
                        log::warn!("run_once: noting an unfinished operation: {err}");
                    }
                    drop(renewing.and_then(stop_renewing));
                }));
            }
            Err(_) => {
                drop(renewing.and_then(stop_renewing));
                log::warn!("run_once: an unfinished operation outside a runtime");
            }
        }
    }
}

fn still_shared() -> Error {
    Error::Io(std::io::Error::other(
        "run_once: the lease is still shared after its renewals stopped",
    ))
}

/// Renews `lease` as [`Renewals`] says, the first time after `first`, until it is lost
/// (then `watch` says so), gone, or the task is aborted.
async fn renew<L: StoreLease>(
    lease: std::sync::Weak<L>,
    watch: LeaseWatch,
    (timeout, asked): (Duration, Instant),
    first: Duration,
) {
    let mut renewals = Renewals::new(timeout, asked);
    let mut wait = first;
    loop {
        tokio::time::sleep(wait).await;
        let Some(lease) = lease.upgrade() else {
            return;
        };
        let sent = Instant::now();
        let answer = lease.keep_alive().await;
        drop(lease);
        if answer.is_ok() {
            watch.renewed(sent, timeout);
        }
        match renewals.after(sent, &answer) {
            Some(next) => wait = next,
            None => {
                watch.mark_lost();
                return;
            }
        }
    }
}

async fn finish<L: StoreLease, E: std::fmt::Display>(
    lease: L,
    how: RunOnce,
    max: usize,
    output: std::result::Result<Vec<u8>, E>,
) -> Result<Once<E>> {
    match output {
        Ok(output) if output.len() > max => {
            lease
                .fail(cut_to(&too_large_note(output.len(), max), max).as_bytes())
                .await?;
            Err(Error::ResponseTooLarge {
                len: output.len(),
                max,
            })
        }
        Ok(output) => {
            lease.complete(&output).await?;
            Ok(Once::Ran(output))
        }
        Err(err) => {
            match how.on_error {
                OnError::Release => lease.release().await?,
                OnError::Fail => {
                    lease.fail(cut_to(&err.to_string(), max).as_bytes()).await?;
                }
            }
            Ok(Once::Errored(err))
        }
    }
}
