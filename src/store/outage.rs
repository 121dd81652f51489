//! What a service does while its shared store cannot be reached: [`OutagePolicy`],
//! applied by the [`Guarded`] wrapper, which also counts every outage it meets.
//!
//! Only [`Error::Unavailable`] (connection refused or lost, pool timeout) is an outage.
//! Any other error, input errors included, passes through unchanged under both policies.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use super::{Store, StoreLease};
use crate::api::{Advance, InFlight, Record, Reservation, Scope};
use crate::base::{Error, Result};

/// What a call does while its store is unreachable: availability or duplicate risk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OutagePolicy {
    /// Refuse: every call returns [`Error::Unavailable`]. For payments, payouts and
    /// inventory, where a duplicate costs more than a refusal.
    FailClosed,
    /// Carry on unprotected: `insert_if_absent` and `insert_many` admit every key,
    /// `reserve` acquires a [`GuardedLease::Unprotected`] whose calls store nothing, and
    /// `advance` answers `Applied`. Duplicates may pass while the outage lasts. Reads
    /// (`get`, `in_flight`, `take_over`) still return the error: there is nothing to
    /// pretend.
    FailOpen,
}

/// A [`Store`] that applies an [`OutagePolicy`] and counts outages.
#[derive(Debug, Clone)]
pub struct Guarded<S> {
    inner: S,
    policy: OutagePolicy,
    outages: Arc<AtomicU64>,
}

impl<S: Store> Guarded<S> {
    /// `inner` with `policy` applied.
    pub fn new(inner: S, policy: OutagePolicy) -> Guarded<S> {
        Guarded {
            inner,
            policy,
            outages: Arc::new(AtomicU64::new(0)),
        }
    }

    /// The wrapped store.
    pub fn inner(&self) -> &S {
        &self.inner
    }

    /// Calls that met an outage so far (each clone shares the count).
    pub fn outages(&self) -> u64 {
        self.outages.load(Ordering::Relaxed)
    }

    /// Counts an outage; under `FailOpen` returns `open` instead of the error.
    fn decide<T>(&self, answer: Result<T>, open: impl FnOnce() -> T) -> Result<T> {
        match answer {
            Err(err @ Error::Unavailable { .. }) => {
                self.outages.fetch_add(1, Ordering::Relaxed);
                #[cfg(feature = "metrics")]
                metrics::counter!("oncedb_store_outages_total").increment(1);
                log::warn!("store outage ({:?}): {err}", self.policy);
                match self.policy {
                    OutagePolicy::FailClosed => Err(err),
                    OutagePolicy::FailOpen => Ok(open()),
                }
            }
            other => other,
        }
    }

    /// Counts an outage and returns the error whatever the policy.
    fn closed<T>(&self, answer: Result<T>) -> Result<T> {
        if matches!(answer, Err(Error::Unavailable { .. })) {
            self.outages.fetch_add(1, Ordering::Relaxed);
            #[cfg(feature = "metrics")]
            metrics::counter!("oncedb_store_outages_total").increment(1);
        }
        answer
    }
}

/// A lease of a [`Guarded`] store.
#[derive(Debug)]
pub enum GuardedLease<L> {
    /// A lease the store holds.
    Held(L),
    /// Handed out under [`OutagePolicy::FailOpen`] while the store was unreachable:
    /// nothing is stored, and every call succeeds without effect.
    Unprotected,
}

impl<S: Store> Store for Guarded<S> {
    type Lease = GuardedLease<S::Lease>;

    async fn insert_if_absent(&self, key: &[u8]) -> Result<bool> {
        let answer = self.inner.insert_if_absent(key).await;
        self.decide(answer, || true)
    }

    async fn insert_many(&self, keys: Vec<Vec<u8>>) -> Result<Vec<bool>> {
        let len = keys.len();
        let answer = self.inner.insert_many(keys).await;
        self.decide(answer, || vec![true; len])
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
            .map(|reservation| reservation.map_lease(GuardedLease::Held));
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
            .map(|lease| lease.map(GuardedLease::Held))
    }

    async fn advance(&self, scope: &Scope, aggregate_id: &[u8], version: u64) -> Result<Advance> {
        let answer = self.inner.advance(scope, aggregate_id, version).await;
        self.decide(answer, || Advance::Applied)
    }
}

impl<L: StoreLease> StoreLease for GuardedLease<L> {
    fn epoch(&self) -> u64 {
        match self {
            GuardedLease::Held(lease) => lease.epoch(),
            GuardedLease::Unprotected => 0,
        }
    }

    async fn complete(self, response: &[u8]) -> Result<()> {
        match self {
            GuardedLease::Held(lease) => lease.complete(response).await,
            GuardedLease::Unprotected => Ok(()),
        }
    }

    async fn fail(self, response: &[u8]) -> Result<()> {
        match self {
            GuardedLease::Held(lease) => lease.fail(response).await,
            GuardedLease::Unprotected => Ok(()),
        }
    }

    async fn release(self) -> Result<()> {
        match self {
            GuardedLease::Held(lease) => lease.release().await,
            GuardedLease::Unprotected => Ok(()),
        }
    }

    async fn note(&self, note: &[u8]) -> Result<()> {
        match self {
            GuardedLease::Held(lease) => lease.note(note).await,
            GuardedLease::Unprotected => Ok(()),
        }
    }
}
