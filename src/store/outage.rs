//! What a service does while its shared store cannot be reached: [`OutagePolicy`],
//! applied by the [`Guarded`] wrapper, which also counts every outage it meets.
//!
//! Only [`Error::Unavailable`] (connection refused, lost or timed out, a server that
//! reports it cannot serve) is an outage. Any other error passes through unchanged under
//! both policies: input errors, [`Error::TimedOut`] (the server cancelled a call that
//! waited behind another caller's lock: that caller may be running the same work),
//! [`Error::Authentication`] (an untrusted certificate or refused credentials: a
//! configuration error or an attack, never a reason to run unprotected) and
//! [`Error::Full`]. Lease calls follow the policy too: under
//! `FailOpen`, a `complete`, `fail`, `release` or `note` that meets an outage answers
//! `Ok` and is counted in [`Guarded::lease_outages`]; the store never learnt the outcome,
//! so its record stays in flight until a take-over, a lease timeout or the end of the
//! window, and retries meanwhile see `InFlight`. Outages are logged at the 1st, 2nd,
//! 4th, 8th, ... occurrence, so a long outage cannot flood the log.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{Store, StoreLease, first_occurrences};
use crate::api::{Advance, InFlight, Record, Reservation, Scope};
use crate::base::{Error, Result};

/// What a call does while its store is unreachable: availability or duplicate risk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutagePolicy {
    /// Refuse: every call returns [`Error::Unavailable`]. For payments, payouts and
    /// inventory, where a duplicate costs more than a refusal.
    FailClosed,
    /// Carry on unprotected: `insert_if_absent` and `insert_many` admit every key (but
    /// the second of a key repeated in one batch),
    /// `reserve` acquires a [`GuardedLease::Unprotected`] whose calls store nothing,
    /// `advance` answers `Applied`, and lease calls answer `Ok`. Duplicates may pass while the outage lasts. Reads
    /// (`get`, `in_flight`, `take_over`) still return the error: there is nothing to
    /// pretend.
    FailOpen,
}

/// A [`Store`] that applies an [`OutagePolicy`] and counts outages.
#[derive(Debug, Clone)]
pub struct Guarded<S> {
    inner: S,
    guard: Arc<Guard>,
}

/// The policy and the counts, shared by a store's clones and its leases.
#[derive(Debug)]
struct Guard {
    policy: OutagePolicy,
    outages: AtomicU64,
    lease_outages: AtomicU64,
}

impl<S: Store> Guarded<S> {
    /// `inner` with `policy` applied.
    pub fn new(inner: S, policy: OutagePolicy) -> Guarded<S> {
        Guarded {
            inner,
            guard: Arc::new(Guard {
                policy,
                outages: AtomicU64::new(0),
                lease_outages: AtomicU64::new(0),
            }),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Calls that met an outage so far, lease calls included (each clone shares the
    /// count).
    pub fn outages(&self) -> u64 {
        self.guard.outages.load(Ordering::Relaxed)
    }

    /// Lease calls (`complete`, `fail`, `release`, `note`) that met an outage: under
    /// `FailOpen`, records whose outcome the store never learnt.
    pub fn lease_outages(&self) -> u64 {
        self.guard.lease_outages.load(Ordering::Relaxed)
    }

    fn decide<T>(&self, answer: Result<T>, open: impl FnOnce() -> T) -> Result<T> {
        self.guard.decide(answer, open)
    }

    /// Counts an outage and returns the error whatever the policy.
    fn closed<T>(&self, answer: Result<T>) -> Result<T> {
        if let Err(err @ Error::Unavailable { .. }) = &answer {
            self.guard.count(err);
        }
        answer
    }

    fn held(&self, lease: S::Lease) -> GuardedLease<S::Lease> {
        GuardedLease::Held(HeldLease {
            lease,
            guard: Arc::clone(&self.guard),
        })
    }
}

impl Guard {
    /// Counts an outage (and logs it at the 1st, 2nd, 4th, ... one).
    fn count(&self, err: &Error) {
        let n = self.outages.fetch_add(1, Ordering::Relaxed) + 1;
        #[cfg(feature = "metrics")]
        metrics::counter!("oncedb_store_outages_total").increment(1);
        if n.is_power_of_two() {
            log::warn!("store outage ({:?}, {n} so far): {err}", self.policy);
        }
    }

    /// Counts an outage; under `FailOpen` returns `open` instead of the error.
    fn decide<T>(&self, answer: Result<T>, open: impl FnOnce() -> T) -> Result<T> {
        match answer {
            Err(err @ Error::Unavailable { .. }) => {
                self.count(&err);
                match self.policy {
                    OutagePolicy::FailClosed => Err(err),
                    OutagePolicy::FailOpen => Ok(open()),
                }
            }
            other => other,
        }
    }

    /// A lease call's answer under the policy.
    fn lease_call(&self, answer: Result<()>) -> Result<()> {
        if matches!(answer, Err(Error::Unavailable { .. })) {
            self.lease_outages.fetch_add(1, Ordering::Relaxed);
        }
        self.decide(answer, || ())
    }
}

/// A lease of a [`Guarded`] store.
#[derive(Debug)]
pub enum GuardedLease<L> {
    /// A lease the store holds; its calls follow the store's policy.
    Held(HeldLease<L>),
    /// Handed out under [`OutagePolicy::FailOpen`] while the store was unreachable:
    /// nothing is stored, and every call succeeds without effect.
    Unprotected,
}

/// A lease the wrapped store holds, with the policy its calls follow.
#[derive(Debug)]
pub struct HeldLease<L> {
    lease: L,
    guard: Arc<Guard>,
}

impl<L> HeldLease<L> {
    /// The wrapped store's lease.
    pub fn lease(&self) -> &L {
        &self.lease
    }
}

impl<S: Store> Store for Guarded<S> {
    type Lease = GuardedLease<S::Lease>;

    fn max_response_bytes(&self) -> usize {
        self.inner.max_response_bytes()
    }

    async fn insert_if_absent(&self, key: &[u8]) -> Result<bool> {
        let answer = self.inner.insert_if_absent(key).await;
        self.decide(answer, || true)
    }

    async fn insert_many(&self, keys: Vec<Vec<u8>>) -> Result<Vec<bool>> {
        // Under `FailOpen` a key repeated in the batch is still a duplicate the second
        // time, as every store answers: only the store's memory is missing.
        let first = match self.guard.policy {
            OutagePolicy::FailOpen => first_occurrences(&keys),
            OutagePolicy::FailClosed => Vec::new(),
        };
        let answer = self.inner.insert_many(keys).await;
        self.decide(answer, || first)
    }

    async fn reserve(
        &self,
        scope: &Scope,
        key: &[u8],
        request: &[u8],
    ) -> Result<Reservation<Self::Lease>> {
        let answer = self
            .inner
            .reserve(scope, key, request)
            .await
            .map(|reservation| reservation.map_lease(|lease| self.held(lease)));
        self.decide(answer, || Reservation::Acquired(GuardedLease::Unprotected))
    }

    async fn get(&self, scope: &Scope, key: &[u8]) -> Result<Option<Record>> {
        let answer = self.inner.get(scope, key).await;
        self.closed(answer)
    }

    async fn in_flight(&self, older_than: Duration) -> Result<Vec<InFlight>> {
        let answer = self.inner.in_flight(older_than).await;
        self.closed(answer)
    }

    async fn take_over(&self, scope: &Scope, key: &[u8]) -> Result<Option<Self::Lease>> {
        let answer = self.inner.take_over(scope, key).await;
        self.closed(answer)
            .map(|lease| lease.map(|lease| self.held(lease)))
    }

    async fn resume(&self, scope: &Scope, key: &[u8], epoch: u64) -> Result<Self::Lease> {
        let answer = self.inner.resume(scope, key, epoch).await;
        self.closed(answer).map(|lease| self.held(lease))
    }

    async fn advance(&self, scope: &Scope, aggregate_id: &[u8], version: u64) -> Result<Advance> {
        let answer = self.inner.advance(scope, aggregate_id, version).await;
        self.decide(answer, || Advance::Applied)
    }

    async fn wait_finished(
        &self,
        scope: &Scope,
        key: &[u8],
        timeout: Duration,
    ) -> Result<Option<Record>> {
        let answer = self.inner.wait_finished(scope, key, timeout).await;
        self.closed(answer)
    }

    fn lease_timeout(&self) -> Option<Duration> {
        self.inner.lease_timeout()
    }
}

impl<L: StoreLease> StoreLease for GuardedLease<L> {
    fn epoch(&self) -> u64 {
        match self {
            GuardedLease::Held(held) => held.lease.epoch(),
            GuardedLease::Unprotected => 0,
        }
    }

    async fn complete(self, response: &[u8]) -> Result<()> {
        match self {
            GuardedLease::Held(held) => {
                let answer = held.lease.complete(response).await;
                held.guard.lease_call(answer)
            }
            GuardedLease::Unprotected => Ok(()),
        }
    }

    async fn fail(self, response: &[u8]) -> Result<()> {
        match self {
            GuardedLease::Held(held) => {
                let answer = held.lease.fail(response).await;
                held.guard.lease_call(answer)
            }
            GuardedLease::Unprotected => Ok(()),
        }
    }

    async fn release(self) -> Result<()> {
        match self {
            GuardedLease::Held(held) => {
                let answer = held.lease.release().await;
                held.guard.lease_call(answer)
            }
            GuardedLease::Unprotected => Ok(()),
        }
    }

    async fn note(&self, note: &[u8]) -> Result<()> {
        match self {
            GuardedLease::Held(held) => {
                let answer = held.lease.note(note).await;
                held.guard.lease_call(answer)
            }
            GuardedLease::Unprotected => Ok(()),
        }
    }

    async fn keep_alive(&self) -> Result<()> {
        match self {
            GuardedLease::Held(held) => {
                let answer = held.lease.keep_alive().await;
                held.guard.lease_call(answer)
            }
            GuardedLease::Unprotected => Ok(()),
        }
    }
}
