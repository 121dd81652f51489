//! What a record holds and what the ordering guard answers: the values every room
//! passes up unchanged, from the index to the API and every `Store`.

use std::fmt;
use std::sync::Arc;
use std::time::SystemTime;

use super::time::ms_to_system_time;

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
    pub(crate) response: Option<ResponseBytes>,
    /// A response still in the log: its finish frame and the lease that wrote it. The
    /// engine reads it into `response` before the record leaves the engine.
    pub(crate) logged: Option<(LogSpan, u64)>,
    /// A record kept in compact form has its scoped key only in the log, in its reserve
    /// entry's frame: the engine compares it with the caller's key before the record
    /// leaves the engine.
    pub(crate) key_logged: Option<LogSpan>,
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

/// A stored response, shared without a copy: a record in memory keeps its scoped key
/// and its response in one buffer, and a snapshot shares that buffer from where the
/// response starts.
#[derive(Clone)]
pub(crate) struct ResponseBytes {
    buffer: Arc<[u8]>,
    start: usize,
}

impl ResponseBytes {
    /// The bytes of `buffer` from `start` on.
    pub(crate) fn after(buffer: Arc<[u8]>, start: usize) -> ResponseBytes {
        ResponseBytes { buffer, start }
    }
}

impl std::ops::Deref for ResponseBytes {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        self.buffer.get(self.start..).unwrap_or_default()
    }
}

impl From<Arc<[u8]>> for ResponseBytes {
    fn from(buffer: Arc<[u8]>) -> ResponseBytes {
        ResponseBytes::after(buffer, 0)
    }
}

impl From<Vec<u8>> for ResponseBytes {
    fn from(bytes: Vec<u8>) -> ResponseBytes {
        ResponseBytes::from(Arc::<[u8]>::from(bytes))
    }
}

impl fmt::Debug for ResponseBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ResponseBytes")
            .field("len", &self.len())
            .finish()
    }
}

impl PartialEq for ResponseBytes {
    fn eq(&self, other: &ResponseBytes) -> bool {
        **self == **other
    }
}

impl Eq for ResponseBytes {}

/// Where a log entry's frame lies: its segment (bucket, sequence) and byte range. A
/// finished record whose response stays on disk keeps this instead of the bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct LogSpan {
    pub(crate) bucket: u64,
    pub(crate) seq: u32,
    /// Segment offset of the frame.
    pub(crate) start: u32,
    /// The frame's length, header included.
    pub(crate) len: u32,
}

/// A finished record whose response and scoped key are both in the log, and which has no
/// take-over to remember: it never changes again. Memory packs it (`index`'s dense tier)
/// and a record run holds it on disk (`wal::run`), in this one form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SettledRecord {
    pub(crate) request_hash: u128,
    /// The bucket the record is stamped with (it leaves the window with it).
    pub(crate) bucket: u64,
    pub(crate) created_ms: u64,
    /// The lease that ended it.
    pub(crate) lease_id: u64,
    /// `Completed` or `Failed`.
    pub(crate) status: RecordStatus,
    pub(crate) finished_ms: u64,
    /// The finish entry's frame, which holds the response.
    pub(crate) response: LogSpan,
    /// The reserve entry's frame, which holds the scoped key.
    pub(crate) key: LogSpan,
}

/// The answer of [`Db::advance`](crate::Db::advance), the ordering guard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use = "the answer says whether to apply, skip, reject or buffer the event"]
pub enum Advance {
    /// The version is the next one (or the aggregate has no version inside the window):
    /// it is now the aggregate's version. Apply the event.
    Applied,
    /// The version equals the aggregate's version: a redelivery. Skip it.
    Duplicate,
    /// The version is older than the aggregate's: an out-of-order or replayed event.
    /// Skip or reject it.
    Stale {
        /// The aggregate's version.
        current: u64,
    },
    /// A version was skipped: buffer this event and wait for `expected`, or refetch the
    /// aggregate. Nothing changed.
    Gap {
        /// The version that would be applied next.
        expected: u64,
    },
}
