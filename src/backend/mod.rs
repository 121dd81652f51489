//! [`Store`](crate::Store) on shared engines, each behind its own feature: `redis` (Redis
//! and Redis Cluster) and `postgres` (PostgreSQL, with the transactional inbox and
//! outbox).

#[cfg(feature = "postgres")]
pub mod postgres;
#[cfg(feature = "redis")]
pub(crate) mod redis;
#[cfg(any(feature = "redis", feature = "postgres"))]
mod tls;

use crate::base::Error;

/// The server could not be reached or answered too late: [`Error::Unavailable`], which
/// an [`OutagePolicy`](crate::OutagePolicy) acts on.
pub(crate) fn unavailable(engine: &'static str, message: impl Into<String>) -> Error {
    Error::Unavailable {
        engine,
        message: message.into(),
    }
}

/// The server answered with an error of its own: [`Error::Backend`].
pub(crate) fn refused(engine: &'static str, message: impl Into<String>) -> Error {
    Error::Backend {
        engine,
        message: message.into(),
    }
}

/// The server's answer did not have the shape this code expects.
pub(crate) fn unexpected(engine: &'static str, what: &str) -> Error {
    refused(engine, format!("unexpected reply to {what}"))
}

/// The server cancelled a call that waited too long: [`Error::TimedOut`], never an
/// outage.
#[cfg(feature = "postgres")]
pub(crate) fn timed_out(engine: &'static str, message: impl Into<String>) -> Error {
    Error::TimedOut {
        engine,
        message: message.into(),
    }
}

/// TLS or credentials failed: [`Error::Authentication`], never an outage.
pub(crate) fn unauthenticated(engine: &'static str, message: impl Into<String>) -> Error {
    Error::Authentication {
        engine,
        message: message.into(),
    }
}
