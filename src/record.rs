//! Idempotency records: scopes, stored outcomes, reservations and leases.

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use crate::clock::ms_to_system_time;
use crate::db::Inner;
use crate::error::Result;
use crate::fingerprint::Fingerprint;

/// The tenant and operation a key belongs to. The same key in two scopes names two
/// independent records.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    tenant: Arc<[u8]>,
    operation: Arc<[u8]>,
}

impl Scope {
    /// A scope for `tenant` (an account, organisation or consumer name) and `operation`
    /// (an endpoint or message type). Each part may be at most
    /// [`MAX_SCOPE_PART_BYTES`](crate::MAX_SCOPE_PART_BYTES) long; longer parts are
    /// rejected by the call that uses the scope.
    pub fn new(tenant: impl AsRef<[u8]>, operation: impl AsRef<[u8]>) -> Self {
        Scope {
            tenant: Arc::from(tenant.as_ref()),
            operation: Arc::from(operation.as_ref()),
        }
    }

    /// The tenant part.
    pub fn tenant(&self) -> &[u8] {
        &self.tenant
    }

    /// The operation part.
    pub fn operation(&self) -> &[u8] {
        &self.operation
    }

    /// Length-prefixed encoding `tenant_len u16 | tenant | operation_len u16 | operation |
    /// key`; the prefixes keep ("ab", "c") and ("a", "bc") apart.
    pub(crate) fn encode_key(&self, key: &[u8]) -> Box<[u8]> {
        let mut out = Vec::with_capacity(4 + self.tenant.len() + self.operation.len() + key.len());
        for part in [&self.tenant[..], &self.operation[..]] {
            out.extend_from_slice(&(part.len() as u16).to_le_bytes());
            out.extend_from_slice(part);
        }
        out.extend_from_slice(key);
        out.into_boxed_slice()
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Scope")
            .field("tenant", &String::from_utf8_lossy(&self.tenant))
            .field("operation", &String::from_utf8_lossy(&self.operation))
            .finish()
    }
}

/// Where a record is in its lifecycle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecordStatus {
    /// A lease holder is working on it, or crashed while working (outcome unknown).
    InFlight,
    /// Finished; the stored response is replayed to retries.
    Completed,
    /// Finished with a deterministic failure; the stored failure is replayed to retries.
    Failed,
}

/// A snapshot of one idempotency record.
#[derive(Clone, PartialEq, Eq)]
pub struct Record {
    pub(crate) status: RecordStatus,
    pub(crate) response: Option<Arc<[u8]>>,
    pub(crate) created_ms: u64,
    pub(crate) finished_ms: Option<u64>,
}

impl Record {
    /// The lifecycle state.
    pub fn status(&self) -> RecordStatus {
        self.status
    }

    /// The stored response (or failure) bytes; `None` while in flight.
    pub fn response(&self) -> Option<&[u8]> {
        self.response.as_deref()
    }

    /// When the record was reserved, by the database clock.
    pub fn created_at(&self) -> SystemTime {
        ms_to_system_time(self.created_ms)
    }

    /// When the record was completed or failed, by the database clock.
    pub fn finished_at(&self) -> Option<SystemTime> {
        self.finished_ms.map(ms_to_system_time)
    }
}

impl fmt::Debug for Record {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Record")
            .field("status", &self.status)
            .field("response_bytes", &self.response.as_ref().map(|r| r.len()))
            .field("created_ms", &self.created_ms)
            .field("finished_ms", &self.finished_ms)
            .finish()
    }
}

/// The answer of [`Db::reserve`](crate::Db::reserve).
#[derive(Debug)]
#[must_use = "a reservation says whether to run the operation or replay a stored result"]
pub enum Reservation {
    /// This caller owns the key: run the operation, then complete, fail or release.
    Acquired(Lease),
    /// Another attempt holds the key and has not finished (or crashed without finishing).
    InFlight {
        /// When that attempt reserved the key.
        since: SystemTime,
    },
    /// The operation finished; replay the stored response.
    Completed(Record),
    /// The operation failed deterministically; replay the stored failure.
    Failed(Record),
    /// The key was used with a different request: reject this one.
    Mismatch,
}

/// How a lease ends.
#[derive(Debug, Clone)]
pub(crate) enum Finish {
    Complete(Arc<[u8]>),
    Fail(Arc<[u8]>),
    Release,
}

/// Ownership of one in-flight record. It owns what it needs (no borrow of the `Db`), so
/// it can cross threads and `.await` points.
///
/// Dropping a lease without finishing leaves the record in flight: the outcome is unknown
/// and retries see [`Reservation::InFlight`] until the record expires with its window.
#[must_use = "a dropped lease leaves its record in flight until the window expires"]
pub struct Lease {
    pub(crate) db: Arc<Inner>,
    pub(crate) fingerprint: Fingerprint,
    pub(crate) lease_id: u64,
    pub(crate) since_ms: u64,
}

impl Lease {
    /// Stores `response` for replay and marks the record completed.
    pub fn complete(self, response: &[u8]) -> Result<()> {
        self.db.check_response(response)?;
        self.db.finish(
            self.fingerprint,
            self.lease_id,
            Finish::Complete(Arc::from(response)),
        )
    }

    /// Stores a deterministic failure for replay and marks the record failed.
    pub fn fail(self, response: &[u8]) -> Result<()> {
        self.db.check_response(response)?;
        self.db.finish(
            self.fingerprint,
            self.lease_id,
            Finish::Fail(Arc::from(response)),
        )
    }

    /// Deletes the record so that a retry may run the operation again. Use only when the
    /// operation certainly had no effect.
    pub fn release(self) -> Result<()> {
        self.db
            .finish(self.fingerprint, self.lease_id, Finish::Release)
    }

    /// When the record was reserved.
    pub fn since(&self) -> SystemTime {
        ms_to_system_time(self.since_ms)
    }
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Lease")
            .field("lease_id", &self.lease_id)
            .field("since_ms", &self.since_ms)
            .finish_non_exhaustive()
    }
}
