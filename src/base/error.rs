//! The error type of every fallible oncedb call.

use std::fmt;
use std::io;
use std::path::PathBuf;

/// Result alias used throughout oncedb.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong in oncedb.
///
/// "Already present" is not an error: it is the `false` of
/// [`Db::insert_if_absent`](crate::Db::insert_if_absent) or a
/// [`Reservation`](crate::Reservation) variant.
#[derive(Debug)]
#[non_exhaustive]
pub enum Error {
    /// The options passed to [`Db::open`](crate::Db::open) are inconsistent or out of range.
    InvalidOptions(String),
    /// A key is longer than the configured limit.
    KeyTooLong {
        /// Length of the rejected key in bytes.
        len: usize,
        /// The limit in force (`Options::max_key_bytes`).
        max: usize,
    },
    /// A key is empty.
    EmptyKey,
    /// A scope component (tenant or operation) is longer than
    /// [`MAX_SCOPE_PART_BYTES`](crate::MAX_SCOPE_PART_BYTES).
    ScopeTooLong {
        /// Length of the rejected component in bytes.
        len: usize,
    },
    /// A stored response is longer than the configured limit.
    ResponseTooLarge {
        /// Length of the rejected response in bytes.
        len: usize,
        /// The limit in force (`Options::max_response_bytes`).
        max: usize,
    },
    /// A batch holds more keys than [`crate::MAX_BATCH_KEYS`].
    BatchTooLarge {
        /// Number of keys in the rejected batch.
        len: usize,
        /// The limit.
        max: usize,
    },
    /// The lease no longer owns its record: the record expired with its window, was
    /// released, or was already finished by this lease.
    LeaseLost,
    /// A newer lease took the record over ([`Db::take_over`](crate::Db::take_over)):
    /// this lease's calls change nothing.
    Fenced,
    /// A note is longer than [`MAX_NOTE_BYTES`](crate::MAX_NOTE_BYTES).
    NoteTooLong {
        /// Length of the rejected note in bytes.
        len: usize,
    },
    /// Two different scoped keys share a 128-bit fingerprint; the operation was refused
    /// rather than mixing their records. With a seeded 128-bit hash this is not expected
    /// to happen in the lifetime of any deployment.
    FingerprintCollision,
    /// The store holds `Options::max_keys` live keys and its
    /// [`FullPolicy`](crate::FullPolicy) could not make room, or a shared engine is out
    /// of memory (Redis at `maxmemory` under `noeviction`): nothing was admitted.
    Full,
    /// Every lease id below the limit has been handed out; the store refuses new
    /// reservations rather than reuse one.
    LeaseIdsExhausted,
    /// An earlier I/O failure poisoned the store; it refuses writes until reopened.
    Poisoned,
    /// Another process (or another `Db` in this process) holds the directory's lock file.
    Locked(PathBuf),
    /// A file is not in a format oncedb wrote, or its checksum does not match.
    Corrupted {
        /// The damaged file.
        path: PathBuf,
        /// Byte offset of the first damaged record or header.
        offset: u64,
        /// What was wrong.
        reason: String,
    },
    /// The directory was created with different settings than the ones passed to open.
    IncompatibleOptions(String),
    /// The operating system reported an I/O error.
    Io(io::Error),
    /// A shared engine behind a `Store` (Redis) refused a call or could not be reached;
    /// whether the call took effect is unknown, as for any lost reply.
    Backend {
        /// Which engine.
        engine: &'static str,
        /// What it said.
        message: String,
    },
    /// A shared engine behind a `Store` could not be reached (connection refused or
    /// dropped, pool timeout). The call may or may not have taken effect; an
    /// [`OutagePolicy`](crate::OutagePolicy) decides what a caller does next.
    Unavailable {
        /// Which engine.
        engine: &'static str,
        /// What failed.
        message: String,
    },
    /// Another store took this store's replica over (it restored the replica elsewhere
    /// and claimed it): this store may not write again, and reopening it does not give
    /// the replica back. Restore the replica to write here again.
    NotOwner {
        /// The replica's name.
        replica: String,
    },
    /// A restore found no replica of that name on the server: nothing was ever
    /// replicated under it (or its stream was deleted).
    ReplicaNotFound {
        /// The replica's name.
        replica: String,
    },
    /// A shared engine answered that the call waited longer than the response timeout
    /// (behind another transaction's row lock, or a statement that ran too long) and
    /// cancelled it: the call took no effect. Not an outage: the server is up and
    /// another caller may hold the record, so no [`OutagePolicy`](crate::OutagePolicy)
    /// turns it into an admission. Try again later.
    TimedOut {
        /// Which engine.
        engine: &'static str,
        /// What the server said.
        message: String,
    },
    /// The connection to a shared engine failed to authenticate: the server's TLS
    /// certificate was not trusted (or the handshake failed), or the server refused the
    /// credentials. A configuration error, never an outage: no
    /// [`OutagePolicy`](crate::OutagePolicy) turns it into an admission.
    Authentication {
        /// Which engine.
        engine: &'static str,
        /// What failed.
        message: String,
    },
    /// `run_once`: the key was used before with a different request
    /// ([`Reservation::Mismatch`](crate::Reservation::Mismatch)); nothing ran.
    RequestMismatch,
    /// `run_once`: another attempt still held the key when the wait for its outcome
    /// ended; nothing ran. Try again later.
    StillInFlight {
        /// When that attempt reserved the key.
        since: std::time::SystemTime,
    },
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::InvalidOptions(why) => write!(f, "invalid options: {why}"),
            Error::KeyTooLong { len, max } => {
                write!(f, "key of {len} bytes exceeds the limit of {max} bytes")
            }
            Error::EmptyKey => write!(f, "key is empty"),
            Error::ScopeTooLong { len } => write!(
                f,
                "scope component of {len} bytes exceeds the limit of {} bytes",
                crate::base::limits::MAX_SCOPE_PART_BYTES
            ),
            Error::ResponseTooLarge { len, max } => {
                write!(
                    f,
                    "response of {len} bytes exceeds the limit of {max} bytes"
                )
            }
            Error::BatchTooLarge { len, max } => {
                write!(f, "batch of {len} keys exceeds the limit of {max} keys")
            }
            Error::LeaseLost => write!(f, "the lease's record has expired or was removed"),
            Error::Fenced => write!(f, "the record was taken over by a newer lease"),
            Error::NoteTooLong { len } => write!(
                f,
                "note of {len} bytes exceeds the limit of {} bytes",
                crate::base::limits::MAX_NOTE_BYTES
            ),
            Error::FingerprintCollision => {
                write!(f, "two different keys share a 128-bit fingerprint")
            }
            Error::Full => write!(f, "store is full: no room for another key"),
            Error::LeaseIdsExhausted => write!(f, "every lease id has been handed out"),
            Error::Poisoned => write!(
                f,
                "store is poisoned by an earlier I/O failure; reopen it to recover"
            ),
            Error::Locked(path) => write!(f, "{} is locked by another process", path.display()),
            Error::Corrupted {
                path,
                offset,
                reason,
            } => write!(
                f,
                "{} is corrupted at byte {offset}: {reason}",
                path.display()
            ),
            Error::IncompatibleOptions(why) => write!(f, "incompatible options: {why}"),
            Error::Io(err) => write!(f, "I/O error: {err}"),
            Error::Backend { engine, message } => write!(f, "{engine}: {message}"),
            Error::Unavailable { engine, message } => write!(f, "{engine} unavailable: {message}"),
            Error::NotOwner { replica } => write!(
                f,
                "replica {replica} is owned by another store; restore it to write here"
            ),
            Error::ReplicaNotFound { replica } => {
                write!(f, "no replica named {replica} on the server")
            }
            Error::TimedOut { engine, message } => {
                write!(
                    f,
                    "{engine} cancelled a call that waited too long: {message}"
                )
            }
            Error::Authentication { engine, message } => {
                write!(f, "{engine} authentication failed: {message}")
            }
            Error::RequestMismatch => {
                write!(f, "the key was used before with a different request")
            }
            Error::StillInFlight { since } => {
                let age = since.elapsed().unwrap_or_default();
                write!(
                    f,
                    "another attempt has held the key for {:.1} s and has not finished",
                    age.as_secs_f64()
                )
            }
        }
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            Error::Io(err) => Some(err),
            _ => None,
        }
    }
}

impl From<io::Error> for Error {
    fn from(err: io::Error) -> Self {
        Error::Io(err)
    }
}
