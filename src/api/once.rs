//! Any operation made once-only: [`Db::run_once`] reserves the key, runs the operation
//! under the lease (renewing it while the store has a lease timeout), completes with its
//! output or, on an error, releases the record or stores the failure, as the caller
//! chose; a retry gets the stored output, and a retry during the first attempt waits for
//! its outcome ([`Db::wait_finished`]) instead of failing at once. The asynchronous
//! form for every store is [`Store::run_once`](crate::Store::run_once).

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use parking_lot::{Condvar, Mutex};
use std::task::{Poll, Waker};
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

/// The first wait before a failed renewal is sent again; it doubles up to a third of the
/// lease timeout.
const FIRST_RETRY: Duration = Duration::from_millis(10);

/// When the next renewal of a lease goes out, given how the last ones went: every third
/// of the lease timeout; after a refusal that may pass (a lock wait, an unreachable
/// store), again with a growing back-off while the lease still holds; never after
/// `Fenced` or `LeaseLost`, or once the lease timeout passed since the last renewal the
/// store took (another caller may have taken the record over).
#[derive(Debug)]
pub(crate) struct Renewals {
    timeout: Duration,
    /// Until when the store's last accepted renewal (or the grant) holds the lease.
    held_until: Instant,
    retry: Duration,
}

impl Renewals {
    /// Renewals of a lease asked for at `asked`, under `timeout`.
    pub(crate) fn new(timeout: Duration, asked: Instant) -> Renewals {
        Renewals {
            timeout,
            held_until: asked.checked_add(timeout).unwrap_or(asked),
            retry: FIRST_RETRY,
        }
    }

    /// How long to wait before the first renewal.
    pub(crate) fn first(&self) -> Duration {
        renew_every(self.timeout)
    }

    /// The answer to a renewal sent at `sent`: how long to wait before the next one, or
    /// `None` when the lease is lost and renewals stop.
    pub(crate) fn after(&mut self, sent: Instant, answer: &Result<()>) -> Option<Duration> {
        match answer {
            Ok(()) => {
                self.held_until = sent.checked_add(self.timeout).unwrap_or(sent);
                self.retry = FIRST_RETRY;
                Some(renew_every(self.timeout))
            }
            Err(Error::Fenced | Error::LeaseLost) => None,
            Err(_) => {
                let left = self.held_until.saturating_duration_since(Instant::now());
                if left.is_zero() {
                    return None;
                }
                let wait = self.retry.min(left);
                self.retry = (self.retry * 2).min(renew_every(self.timeout));
                Some(wait)
            }
        }
    }
}

/// What an operation run by `run_once` knows of its lease: the fencing epoch to guard its
/// own side effects with, and whether the lease was lost while it ran (a renewal was
/// refused as `Fenced` or `LeaseLost`, or none was taken for a whole lease timeout, so
/// another caller may run the operation now). An operation told so should stop before
/// its side effect, or fence it with the epoch; its output will not be stored.
#[derive(Debug, Clone)]
pub struct LeaseWatch {
    inner: Arc<Watched>,
}

#[derive(Debug)]
struct Watched {
    epoch: u64,
    lost: AtomicBool,
    /// Until when the last renewal the store took holds the lease, in microseconds
    /// after `origin`; `u64::MAX` without a lease timeout.
    held_until_us: AtomicU64,
    origin: Instant,
    waiters: Mutex<Vec<Waker>>,
    changed: Condvar,
}

impl LeaseWatch {
    /// The watch of a lease asked for at `asked` (its grant came after: the lease is
    /// counted from there, at the earliest the store may count it from), under
    /// `timeout` if the store has one.
    pub(crate) fn new(epoch: u64, timeout: Option<Duration>, asked: Instant) -> LeaseWatch {
        let held_until_us = timeout.map_or(u64::MAX, |timeout| {
            u64::try_from(timeout.as_micros()).unwrap_or(u64::MAX)
        });
        LeaseWatch {
            inner: Arc::new(Watched {
                epoch,
                lost: AtomicBool::new(false),
                held_until_us: AtomicU64::new(held_until_us),
                origin: asked,
                waiters: Mutex::new(Vec::new()),
                changed: Condvar::new(),
            }),
        }
    }

    /// The lease's fencing epoch ([`Lease::epoch`]).
    pub fn epoch(&self) -> u64 {
        self.inner.epoch
    }

    /// Whether the lease was lost: a renewal was refused as lost, or a whole lease
    /// timeout passed since the last renewal the store took. The second is read from the
    /// clock here, so it holds even while the renewals are held up (a starved thread).
    pub fn is_lost(&self) -> bool {
        if self.inner.lost.load(Ordering::Acquire) {
            return true;
        }
        let held_until_us = self.inner.held_until_us.load(Ordering::Acquire);
        let now_us = u64::try_from(self.inner.origin.elapsed().as_micros()).unwrap_or(u64::MAX);
        now_us >= held_until_us
    }

    /// How long until the last renewal the store took lapses.
    fn until_lapse(&self) -> Duration {
        let held_until_us = self.inner.held_until_us.load(Ordering::Acquire);
        let now_us = u64::try_from(self.inner.origin.elapsed().as_micros()).unwrap_or(u64::MAX);
        Duration::from_micros(held_until_us.saturating_sub(now_us))
    }

    /// A renewal sent at `sent` was taken: the lease holds until a timeout after it.
    pub(crate) fn renewed(&self, sent: Instant, timeout: Duration) {
        let until = sent.saturating_duration_since(self.inner.origin) + timeout;
        let until_us = u64::try_from(until.as_micros()).unwrap_or(u64::MAX);
        self.inner
            .held_until_us
            .fetch_max(until_us, Ordering::AcqRel);
    }

    /// Blocks until the lease is lost or `timeout` passes; whether it was lost. For a
    /// synchronous operation that waits on something of its own.
    pub fn wait_lost(&self, timeout: Duration) -> bool {
        let deadline = crate::base::deadline_after(timeout);
        let mut waiters = self.inner.waiters.lock();
        while !self.is_lost() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            // Woken by a refused renewal, or at the lapse of the last renewal taken.
            let left = left.min(self.until_lapse());
            self.inner.changed.wait_for(&mut waiters, left);
        }
        true
    }

    /// A future that ends when the lease is lost: `select!` it against the operation's
    /// work to stop that work.
    pub fn lost(&self) -> Lost {
        Lost {
            watch: self.clone(),
        }
    }

    /// Marks the lease lost and wakes everything waiting for that.
    pub(crate) fn mark_lost(&self) {
        self.inner.lost.store(true, Ordering::Release);
        let waiters = std::mem::take(&mut *self.inner.waiters.lock());
        self.inner.changed.notify_all();
        for waker in waiters {
            waker.wake();
        }
    }
}

/// The future of [`LeaseWatch::lost`].
#[derive(Debug)]
#[must_use = "a future does nothing unless awaited"]
pub struct Lost {
    watch: LeaseWatch,
}

impl std::future::Future for Lost {
    type Output = ();

    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<()> {
        if self.watch.is_lost() {
            return Poll::Ready(());
        }
        let mut waiters = self.watch.inner.waiters.lock();
        // Checked again under the lock `mark_lost` takes: no wake-up is missed.
        if self.watch.is_lost() {
            return Poll::Ready(());
        }
        if !waiters.iter().any(|waiter| waiter.will_wake(cx.waker())) {
            waiters.push(cx.waker().clone());
        }
        Poll::Pending
    }
}

/// The text a record whose operation's output was over the store's limit is failed with.
pub(crate) fn too_large_note(len: usize, max: usize) -> String {
    format!("the output of {len} bytes is over the store's limit of {max} bytes: not stored")
}

/// `text` cut to at most `max` bytes, at a character boundary.
pub(crate) fn cut_to(text: &str, max: usize) -> &str {
    let mut end = text.len().min(max);
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    text.get(..end).unwrap_or_default()
}

/// The note a record is left with when its operation was cancelled or panicked: a
/// side effect may have happened, so nothing takes the record over automatically; a
/// reconciler (`in_flight`, then `take_over`) settles it.
pub(crate) fn unfinished_note() -> &'static [u8] {
    if std::thread::panicking() {
        b"run_once: the operation panicked: outcome unknown"
    } else {
        b"run_once: the operation was cancelled: outcome unknown"
    }
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
    /// - the first caller reserves the key and runs `operation` with the lease and a
    ///   [`LeaseWatch`]. While it runs, a thread renews the lease every third of the
    ///   lease timeout (when the store has one), retrying a failed renewal with back-off
    ///   while the lease holds; the watch says when the lease was lost. Its output is
    ///   stored and returned as [`Once::Ran`]; its error releases the record or stores
    ///   the failure ([`RunOnce::on_error`]) and is returned as [`Once::Errored`];
    /// - a retry after that gets the stored record, [`Once::Replayed`];
    /// - a retry while the first attempt runs waits for its outcome (up to
    ///   [`RunOnce::wait`]) and replays it, or runs the operation itself if the first
    ///   attempt released the record or was taken over after its lease timed out;
    ///   waiting longer gives [`Error::StillInFlight`];
    /// - the key used with another request gives [`Error::RequestMismatch`].
    ///
    /// Every ending is an ending: an output over the store's limit fails the record with
    /// a short text saying so (a retry replays that failure) and answers
    /// [`Error::ResponseTooLarge`]; a failure text over it is cut to the limit. An
    /// operation that panics leaves the record in flight with a note ("outcome
    /// unknown"), which nothing takes over automatically. A lease lost while the
    /// operation ran makes its completion `Fenced`: `run_once` never answers `Ran` for
    /// output made after another caller took the record over.
    pub fn run_once<E: std::fmt::Display>(
        &self,
        scope: &Scope,
        (key, request): (&[u8], &[u8]),
        how: RunOnce,
        operation: impl FnOnce(&Lease, &LeaseWatch) -> std::result::Result<Vec<u8>, E>,
    ) -> Result<Once<E>> {
        // Read the clock only when an attempt is in flight: the common call acquires.
        let mut deadline = None;
        loop {
            let asked = Instant::now();
            match self.reserve(scope, key, request)? {
                Reservation::Acquired(lease) => {
                    return self.run_leased((lease, asked), how, operation);
                }
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
        (lease, asked): (Lease, Instant),
        how: RunOnce,
        operation: impl FnOnce(&Lease, &LeaseWatch) -> std::result::Result<Vec<u8>, E>,
    ) -> Result<Once<E>> {
        let watch = LeaseWatch::new(lease.epoch(), self.engine.lease_timeout(), asked);
        let output = {
            let _unfinished = NoteOnPanic(&lease);
            match self.engine.lease_timeout() {
                Some(timeout) => kept_alive(&lease, &watch, (timeout, asked), operation),
                None => operation(&lease, &watch),
            }
        };
        let max = self.max_response_bytes();
        match output {
            Ok(output) if output.len() > max => {
                lease.fail(cut_to(&too_large_note(output.len(), max), max).as_bytes())?;
                Err(Error::ResponseTooLarge {
                    len: output.len(),
                    max,
                })
            }
            Ok(output) => {
                lease.complete(&output)?;
                Ok(Once::Ran(output))
            }
            Err(err) => {
                match how.on_error {
                    OnError::Release => lease.release()?,
                    OnError::Fail => lease.fail(cut_to(&err.to_string(), max).as_bytes())?,
                }
                Ok(Once::Errored(err))
            }
        }
    }
}

/// Notes the record "outcome unknown" if the operation panics past it.
struct NoteOnPanic<'a>(&'a Lease);

impl Drop for NoteOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            let _ = self.0.note(unfinished_note());
        }
    }
}

/// Runs `operation` while the process's renewal thread renews `lease` ([`Renewals`],
/// `renewer.rs`); the renewals stop when it returns, or when the lease is lost, which
/// `watch` then says.
fn kept_alive<T>(
    lease: &Lease,
    watch: &LeaseWatch,
    (timeout, asked): (Duration, Instant),
    operation: impl FnOnce(&Lease, &LeaseWatch) -> T,
) -> T {
    let _renewing = super::renewer::register(lease, watch, (timeout, asked));
    operation(lease, watch)
}

#[cfg(test)]
mod tests {
    use super::{LeaseWatch, Renewals};
    use crate::base::Error;
    use std::time::{Duration, Instant};

    /// A refusal that may pass is retried while the lease holds, with a growing
    /// back-off; `Fenced`, `LeaseLost`, or a whole timeout without a renewal stop them.
    #[test]
    fn renewals_retry_until_the_lease_lapses_and_stop_when_fenced() {
        let timeout = Duration::from_secs(3);
        let mut renewals = Renewals::new(timeout, Instant::now());
        assert_eq!(renewals.first(), Duration::from_secs(1));
        let busy = Err(Error::TimedOut {
            engine: "postgres",
            message: "lock wait".to_owned(),
        });
        let first = renewals.after(Instant::now(), &busy).expect("retried");
        let second = renewals
            .after(Instant::now(), &busy)
            .expect("retried again");
        assert!(first < second && second <= Duration::from_secs(1));
        assert_eq!(
            renewals.after(Instant::now(), &Ok(())),
            Some(Duration::from_secs(1))
        );
        assert_eq!(renewals.after(Instant::now(), &Err(Error::Fenced)), None);
        assert_eq!(renewals.after(Instant::now(), &Err(Error::LeaseLost)), None);
        // The last accepted renewal was sent a whole timeout ago: the lease lapsed.
        let _ = renewals.after(Instant::now() - timeout, &Ok(()));
        assert_eq!(renewals.after(Instant::now(), &busy), None);
    }

    #[test]
    fn a_watch_tells_every_waiter_once_the_lease_is_lost() {
        let watch = LeaseWatch::new(7, None, Instant::now());
        assert_eq!(watch.epoch(), 7);
        assert!(!watch.is_lost());
        assert!(!watch.wait_lost(Duration::from_millis(1)));
        let waiter = {
            let watch = watch.clone();
            std::thread::spawn(move || watch.wait_lost(Duration::from_secs(60)))
        };
        watch.mark_lost();
        assert!(waiter.join().unwrap());
        assert!(watch.is_lost());
        // A lease whose timeout passed with no renewal taken is lost, whether or not a
        // renewal was refused yet.
        let lapsed = LeaseWatch::new(8, Some(Duration::ZERO), Instant::now());
        assert!(lapsed.is_lost() && lapsed.wait_lost(Duration::from_secs(60)));
        let renewed = LeaseWatch::new(9, Some(Duration::ZERO), Instant::now());
        renewed.renewed(Instant::now(), Duration::from_secs(60));
        assert!(!renewed.is_lost());
    }
}
