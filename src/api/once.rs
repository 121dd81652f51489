//! Any operation made once-only: [`Db::run_once`] reserves the key, runs the operation
//! under the lease (renewing it while the store has a lease timeout), completes with its
//! output or, on an error, releases the record or stores the failure, as the caller
//! chose; a retry gets the stored output, and a retry during the first attempt waits for
//! its outcome ([`Db::wait_finished`]) instead of failing at once. The asynchronous
//! form for every store is [`Store::run_once`](crate::Store::run_once).

use std::time::{Duration, Instant};

use super::db::{Db, with_scoped_key};
use super::record::{Lease, Reservation, Scope};
use crate::base::{Error, Record, Result};

/// What `run_once` does with the record when the operation returns an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum OnError {
    /// Deletes the record, so that a retry runs the operation again: for errors that
    /// certainly left no effect (a refused connection, a validation error).
    #[default]
    Release,
    /// Stores the error's text as the record's failure, replayed to every retry: for
    /// deterministic failures (a declined card).
    Fail,
}

/// How `run_once` runs: how long a retry waits for an attempt in flight, and what an
/// error of the operation does to the record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunOnce {
    pub(crate) wait: Duration,
    pub(crate) on_error: OnError,
}

impl Default for RunOnce {
    fn default() -> Self {
        RunOnce::new()
    }
}

impl RunOnce {
    /// Waits up to 10 s for an attempt in flight; an error releases the record.
    pub fn new() -> RunOnce {
        RunOnce {
            wait: Duration::from_secs(10),
            on_error: OnError::Release,
        }
    }

    /// How long a call that finds another attempt in flight waits for its outcome
    /// before it gives up with [`Error::StillInFlight`]. Zero: give up at once.
    pub fn wait(mut self, wait: Duration) -> Self {
        self.wait = wait;
        self
    }

    /// What an error of the operation does to the record. Default
    /// [`OnError::Release`].
    pub fn on_error(mut self, on_error: OnError) -> Self {
        self.on_error = on_error;
        self
    }

    /// When to stop waiting, from now.
    pub(crate) fn deadline(&self) -> Instant {
        crate::base::deadline_after(self.wait)
    }
}

/// What `run_once` did.
#[derive(Debug)]
#[non_exhaustive]
pub enum Once<E> {
    /// This call ran the operation and stored its output (returned here).
    Ran(Vec<u8>),
    /// This call ran the operation, which returned this error; the record was released
    /// or the failure stored, as [`RunOnce::on_error`] said.
    Errored(E),
    /// An earlier attempt finished: its record, whose status says how (completed,
    /// failed, or finished with its response aged out).
    Replayed(Record),
}

/// How often a lease is renewed while its operation runs: three times a timeout, so
/// that one late renewal does not lose it.
pub(crate) fn renew_every(lease_timeout: Duration) -> Duration {
    (lease_timeout / 3).max(Duration::from_millis(1))
}

impl Db {
    /// Waits until the record of `key` in `scope` is no longer in flight (completed,
    /// failed, released or expired) or `timeout` passes, and returns the record as it
    /// then is (`None` if there is none: released, expired, or never reserved). Woken
    /// by the ending itself once its entry is committed, never by polling; with a
    /// lease timeout set it also looks again every timeout, so that a caller learns of
    /// a holder that stopped renewing.
    pub fn wait_finished(
        &self,
        scope: &Scope,
        key: &[u8],
        timeout: Duration,
    ) -> Result<Option<Record>> {
        self.engine.check_key(key)?;
        let deadline = crate::base::deadline_after(timeout);
        with_scoped_key(scope, key, |scoped| {
            self.engine.wait_finished(scoped, deadline)
        })
    }

    /// Runs `operation` once for `key` in `scope` and `request`, whoever calls:
    ///
    /// - the first caller reserves the key and runs `operation` with the lease (renewed
    ///   every third of the lease timeout while it runs, when the store has one); its
    ///   output is stored and returned as [`Once::Ran`]; its error releases the record
    ///   or stores the failure ([`RunOnce::on_error`]) and is returned as
    ///   [`Once::Errored`];
    /// - a retry after that gets the stored record, [`Once::Replayed`];
    /// - a retry while the first attempt runs waits for its outcome (up to
    ///   [`RunOnce::wait`]) and replays it, or runs the operation itself if the first
    ///   attempt released the record or was taken over after its lease timed out;
    ///   waiting longer gives [`Error::StillInFlight`];
    /// - the key used with another request gives [`Error::RequestMismatch`].
    ///
    /// An operation that panics leaves the record in flight (as a dropped lease does).
    pub fn run_once<E: std::fmt::Display>(
        &self,
        scope: &Scope,
        (key, request): (&[u8], &[u8]),
        how: RunOnce,
        operation: impl FnOnce(&Lease) -> std::result::Result<Vec<u8>, E>,
    ) -> Result<Once<E>> {
        // Read the clock only when an attempt is in flight: the common call acquires.
        let mut deadline = None;
        loop {
            match self.reserve(scope, key, request)? {
                Reservation::Acquired(lease) => return self.run_leased(lease, how, operation),
                Reservation::InFlight { since, .. } => {
                    let deadline = *deadline.get_or_insert_with(|| how.deadline());
                    let left = deadline.saturating_duration_since(Instant::now());
                    if left.is_zero() {
                        return Err(Error::StillInFlight { since });
                    }
                    self.wait_finished(scope, key, left)?;
                }
                Reservation::Completed(record)
                | Reservation::Failed(record)
                | Reservation::Expired(record) => return Ok(Once::Replayed(record)),
                Reservation::Mismatch => return Err(Error::RequestMismatch),
            }
        }
    }

    fn run_leased<E: std::fmt::Display>(
        &self,
        lease: Lease,
        how: RunOnce,
        operation: impl FnOnce(&Lease) -> std::result::Result<Vec<u8>, E>,
    ) -> Result<Once<E>> {
        let output = match self.engine.lease_timeout() {
            Some(timeout) => kept_alive(&lease, renew_every(timeout), operation),
            None => operation(&lease),
        };
        match output {
            Ok(output) => {
                lease.complete(&output)?;
                Ok(Once::Ran(output))
            }
            Err(err) => {
                match how.on_error {
                    OnError::Release => lease.release()?,
                    OnError::Fail => lease.fail(err.to_string().as_bytes())?,
                }
                Ok(Once::Errored(err))
            }
        }
    }
}

/// Runs `operation` while a second thread renews `lease` every `every`; the renewals
/// stop when it returns (or when one is refused: the lease was lost, and completing
/// will say so).
fn kept_alive<T>(lease: &Lease, every: Duration, operation: impl FnOnce(&Lease) -> T) -> T {
    let (done, stopped) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|scope| {
        scope.spawn(move || {
            while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = stopped.recv_timeout(every)
            {
                if lease.keep_alive().is_err() {
                    return;
                }
            }
        });
        let output = operation(lease);
        drop(done);
        output
    })
}
