//! Idempotency records: scopes, stored outcomes, reservations and leases.

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use crate::base::{Fingerprint, Finish, MAX_SCOPE_PART_BYTES, Record, Result, ms_to_system_time};
use crate::engine::Engine;

/// The tenant and operation a key belongs to. The same key in two scopes names two
/// independent records.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    /// The tenant, then the operation, in one allocation: a lease clones its scope, and
    /// one reference count is half the atomic updates of two.
    parts: Arc<[u8]>,
    tenant_len: usize,
}

impl Scope {
    /// A scope for `tenant` (an account, organisation or consumer name) and `operation`
    /// (an endpoint or message type). Each part may be at most
    /// [`MAX_SCOPE_PART_BYTES`](crate::MAX_SCOPE_PART_BYTES) long; longer parts are
    /// rejected by the call that uses the scope.
    pub fn new(tenant: impl AsRef<[u8]>, operation: impl AsRef<[u8]>) -> Self {
        let (tenant, operation) = (tenant.as_ref(), operation.as_ref());
        Scope {
            parts: [tenant, operation].concat().into(),
            tenant_len: tenant.len(),
        }
    }

    /// The tenant part.
    pub fn tenant(&self) -> &[u8] {
        self.parts.get(..self.tenant_len).unwrap_or_default()
    }

    /// The operation part.
    pub fn operation(&self) -> &[u8] {
        self.parts.get(self.tenant_len..).unwrap_or_default()
    }

    /// Length-prefixed encoding `tenant_len u16 | tenant | operation_len u16 | operation |
    /// key`; the prefixes keep ("ab", "c") and ("a", "bc") apart. Fails on a part longer
    /// than [`MAX_SCOPE_PART_BYTES`]. (The shared-store backends use it; `Db` encodes
    /// into a reused buffer with [`Scope::encode_key_into`].)
    #[cfg(any(feature = "redis", feature = "postgres"))]
    pub(crate) fn encode_key(&self, key: &[u8]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.encode_key_into(key, &mut out)?;
        Ok(out)
    }

    /// [`Scope::encode_key`] into `out` (cleared first), reusing its capacity.
    pub(crate) fn encode_key_into(&self, key: &[u8], out: &mut Vec<u8>) -> Result<()> {
        out.clear();
        out.reserve_exact(4 + self.parts.len() + key.len());
        for part in [self.tenant(), self.operation()] {
            let len = u16::try_from(part.len())
                .ok()
                .filter(|&len| usize::from(len) <= MAX_SCOPE_PART_BYTES)
                .ok_or(crate::base::Error::ScopeTooLong { len: part.len() })?;
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(part);
        }
        out.extend_from_slice(key);
        Ok(())
    }
}

impl Scope {
    /// The scope and key an encoded scoped key holds, or `None` if it is malformed.
    pub(crate) fn decode_key(bytes: &[u8]) -> Option<(Scope, &[u8])> {
        let (tenant, rest) = split_part(bytes)?;
        let (operation, key) = split_part(rest)?;
        Some((Scope::new(tenant, operation), key))
    }
}

/// A length-prefixed part and what follows it.
fn split_part(bytes: &[u8]) -> Option<(&[u8], &[u8])> {
    let len = usize::from(u16::from_le_bytes([*bytes.first()?, *bytes.get(1)?]));
    let part = bytes.get(2..2 + len)?;
    Some((part, bytes.get(2 + len..)?))
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scope")
            .field("tenant", &String::from_utf8_lossy(self.tenant()))
            .field("operation", &String::from_utf8_lossy(self.operation()))
            .finish()
    }
}

/// The answer of [`Db::reserve`](crate::Db::reserve) and of every
/// [`Store::reserve`](crate::Store::reserve), with the store's own lease type `L`.
#[derive(Debug)]
#[must_use = "a reservation says whether to run the operation or replay a stored result"]
pub enum Reservation<L = Lease> {
    /// This caller owns the key: run the operation, then complete, fail or release.
    Acquired(L),
    /// Another attempt holds the key and has not finished (or crashed without finishing).
    InFlight {
        /// When that attempt reserved the key.
        since: SystemTime,
        /// What that attempt's lease holder noted ([`Lease::note`]), if anything: a note
        /// says the attempt reached a point it recorded (an outcome unknown after a
        /// provider timeout, say), its absence that it is still running or crashed
        /// before noting anything.
        note: Option<Vec<u8>>,
    },
    /// The operation finished; replay the stored response.
    Completed(Record),
    /// The operation failed deterministically; replay the stored failure.
    Failed(Record),
    /// The operation finished (the record's status says how), but its response aged
    /// out ([`Options::response_retention`](crate::Options::response_retention) is
    /// shorter than the window): nothing to replay, and the operation must not run
    /// again. Only the embedded store has a retention shorter than the window; the
    /// shared stores never answer this.
    Expired(Record),
    /// The key was used with a different request: reject this one.
    Mismatch,
}

impl<L> Reservation<L> {
    /// The same answer with the lease (if acquired) turned into another type: how a
    /// wrapping store such as [`Guarded`](crate::Guarded) hands out its own leases.
    pub fn map_lease<M>(self, f: impl FnOnce(L) -> M) -> Reservation<M> {
        match self {
            Reservation::Acquired(lease) => Reservation::Acquired(f(lease)),
            Reservation::InFlight { since, note } => Reservation::InFlight { since, note },
            Reservation::Completed(record) => Reservation::Completed(record),
            Reservation::Failed(record) => Reservation::Failed(record),
            Reservation::Expired(record) => Reservation::Expired(record),
            Reservation::Mismatch => Reservation::Mismatch,
        }
    }
}

/// Ownership of one in-flight record. It owns what it needs (no borrow of the `Db`), so
/// it can cross threads and `.await` points.
///
/// Dropping a lease without finishing leaves the record in flight: the outcome is unknown
/// and retries see [`Reservation::InFlight`] until the record expires with its window.
#[must_use = "a dropped lease leaves its record in flight until the window expires"]
pub struct Lease {
    pub(crate) engine: Arc<Engine>,
    /// For metrics and events.
    pub(crate) scope: Scope,
    /// For events: see `observe::key_hash_of`.
    pub(crate) key_hash: u64,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) lease_id: u64,
    pub(crate) since_ms: u64,
}

/// A lease ending that was refused, with the lease handed back: an input error such as
/// [`Error::ResponseTooLarge`](crate::base::Error::ResponseTooLarge) changed nothing, so the
/// caller can complete with a smaller response, fail or release. Converts into
/// [`Error`](crate::Error) for `?`.
#[derive(Debug)]
pub struct LeaseError {
    error: crate::base::Error,
    /// Boxed: the error path pays for the allocation, not every `Ok`.
    lease: Box<Lease>,
}

impl LeaseError {
    /// Why the call was refused.
    pub fn error(&self) -> &crate::base::Error {
        &self.error
    }

    /// The lease, to try again. After an error other than an input error (the lease had
    /// ended, the store is poisoned) every further call is refused too.
    pub fn into_lease(self) -> Lease {
        *self.lease
    }
}

impl fmt::Display for LeaseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.error.fmt(f)
    }
}

impl std::error::Error for LeaseError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        Some(&self.error)
    }
}

impl From<LeaseError> for crate::base::Error {
    fn from(err: LeaseError) -> Self {
        err.error
    }
}

impl Lease {
    /// Stores `response` for replay and marks the record completed.
    ///
    /// A refused call changes nothing and hands the lease back in the [`LeaseError`].
    pub fn complete(self, response: &[u8]) -> Result<(), LeaseError> {
        if let Err(error) = self.engine.check_response(response) {
            return Err(LeaseError {
                error,
                lease: Box::new(self),
            });
        }
        self.end(Finish::Complete(response), "completed")
    }

    /// Stores a deterministic failure for replay and marks the record failed. A refused
    /// call hands the lease back, as for [`Lease::complete`].
    pub fn fail(self, response: &[u8]) -> Result<(), LeaseError> {
        if let Err(error) = self.engine.check_response(response) {
            return Err(LeaseError {
                error,
                lease: Box::new(self),
            });
        }
        self.end(Finish::Fail(response), "failed")
    }

    /// Deletes the record so that a retry may run the operation again. Use only when the
    /// operation certainly had no effect.
    pub fn release(self) -> Result<(), LeaseError> {
        self.end(Finish::Release, "released")
    }

    /// Attaches a short note (at most [`MAX_NOTE_BYTES`](crate::MAX_NOTE_BYTES)) to the
    /// record while it is in flight, durably: for example
    /// `provider_outcome_unknown` after a provider timeout, for the reconciliation worker
    /// that [`Db::in_flight`](crate::Db::in_flight) shows it to. A later note replaces
    /// an earlier one. After a take-over, [`Error::Fenced`](crate::base::Error::Fenced).
    pub fn note(&self, note: &[u8]) -> Result<()> {
        let result = self.engine.note(self.fingerprint, self.lease_id, note);
        self.observe(&result, "noted");
        result
    }

    /// Keeps the lease alive: its [`lease_timeout`](crate::Options::lease_timeout)
    /// counts from now, durably (the renewal is logged, so a reopen keeps it). Call it
    /// more often than the timeout while the operation runs: a holder that stops
    /// renewing is taken over once the timeout passes, and one that renews never is.
    /// After a take-over, [`Error::Fenced`](crate::base::Error::Fenced); after the
    /// record ended, [`Error::LeaseLost`](crate::base::Error::LeaseLost).
    pub fn keep_alive(&self) -> Result<()> {
        let result = self.engine.renew_settled(
            (self.fingerprint, self.lease_id),
            &mut crate::engine::Settle::Block,
        );
        self.observe(&result, "renewed");
        result
    }

    /// The lease's fencing epoch: unique in the database and higher than the epoch of
    /// every earlier lease on the same record. A worker that persists it can come back
    /// with [`Db::resume`](crate::Db::resume).
    pub fn epoch(&self) -> u64 {
        self.lease_id
    }

    fn end(self, finish: Finish<'_>, ending: &'static str) -> Result<(), LeaseError> {
        let result = self.engine.finish(self.fingerprint, self.lease_id, finish);
        self.observe(&result, ending);
        match result {
            Ok(()) => Ok(()),
            Err(error) => Err(LeaseError {
                error,
                lease: Box::new(self),
            }),
        }
    }

    pub(super) fn observe(&self, result: &Result<()>, ending: &'static str) {
        let ending = match result {
            // A renewal is not an ending: counted on its own.
            Ok(()) if ending == "renewed" => {
                super::observe::renewal(&self.scope);
                return;
            }
            Ok(()) => ending,
            Err(crate::base::Error::Fenced) => "fenced",
            Err(crate::base::Error::LeaseLost) => "lost",
            Err(_) => return,
        };
        super::observe::lease_ending(&self.scope, self.key_hash, ending);
    }

    /// A second handle on the same lease, for moving a `&self` call to another thread.
    pub(crate) fn handle(&self) -> Lease {
        Lease {
            engine: Arc::clone(&self.engine),
            scope: self.scope.clone(),
            key_hash: self.key_hash,
            fingerprint: self.fingerprint,
            lease_id: self.lease_id,
            since_ms: self.since_ms,
        }
    }

    /// When the record was reserved.
    pub fn since(&self) -> SystemTime {
        ms_to_system_time(self.since_ms)
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("epoch", &self.lease_id)
            .field("since_ms", &self.since_ms)
            .finish_non_exhaustive()
    }
}

/// A record still in flight, as [`Db::in_flight`](crate::Db::in_flight) lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InFlight {
    /// The record's scope.
    pub scope: Scope,
    /// The record's key.
    pub key: Vec<u8>,
    /// When the record was reserved.
    pub since: SystemTime,
    /// The fencing epoch of the lease that holds it.
    pub epoch: u64,
    /// The note its lease holder attached, if any.
    pub note: Option<Vec<u8>>,
}
