//! The `oncedb._oncedb` extension module: the embedded engine behind Python classes.
//! The Python package `oncedb` re-exports it with docstrings and types (`oncedb/`).
//!
//! Every call that may wait on an fsync (or on the store's locks) runs with the GIL
//! released (`Python::detach`), so other Python threads run during a commit. Keys are
//! `bytes` or `str` (encoded as UTF-8); responses, notes and requests are `bytes`.

use std::borrow::Cow;
use std::sync::Mutex;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use pyo3::BoundObject;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};

mod shared;

use shared::{AnyLease, waited, widened};

create_exception!(_oncedb, Error, PyException, "Any error the store reports.");
create_exception!(
    _oncedb,
    InvalidInput,
    Error,
    "A key, scope, response, note or batch over its limit, or bad options: nothing changed."
);
create_exception!(
    _oncedb,
    LeaseLost,
    Error,
    "The lease's record expired, was released or ended already."
);
create_exception!(
    _oncedb,
    Fenced,
    Error,
    "A take-over replaced this lease: its holder must stop."
);
create_exception!(
    _oncedb,
    Full,
    Error,
    "The store holds max_keys live entries and rejects new ones."
);
create_exception!(
    _oncedb,
    Poisoned,
    Error,
    "An earlier I/O failure closed the store for writes: reopen it."
);
create_exception!(
    _oncedb,
    Locked,
    Error,
    "Another process has the store open."
);
create_exception!(
    _oncedb,
    Corrupted,
    Error,
    "A file is damaged: the store refuses to guess."
);
create_exception!(
    _oncedb,
    StoreIoError,
    Error,
    "A file system call failed (the store is poisoned)."
);
create_exception!(_oncedb, Closed, Error, "The Db was closed.");
create_exception!(
    _oncedb,
    Unavailable,
    Error,
    "A shared store's server did not answer in time, or refused the connection: retry later."
);
create_exception!(
    _oncedb,
    TimedOut,
    Error,
    "A shared store's server gave up on a statement that waited too long (another caller's lock)."
);

/// The Python exception for a store error, with its message.
fn raise(err: oncedb::Error) -> PyErr {
    raise_ref(&err)
}

fn raise_ref(err: &oncedb::Error) -> PyErr {
    classify(err).error(err.to_string())
}

/// The Python exception class of a store error.
#[derive(Clone, Copy)]
enum Kind {
    LeaseLost,
    Fenced,
    Full,
    Poisoned,
    Locked,
    Corrupted,
    Io,
    InvalidInput,
    Unavailable,
    TimedOut,
    Other,
}

impl Kind {
    fn error(self, message: String) -> PyErr {
        match self {
            Kind::LeaseLost => LeaseLost::new_err(message),
            Kind::Fenced => Fenced::new_err(message),
            Kind::Full => Full::new_err(message),
            Kind::Poisoned => Poisoned::new_err(message),
            Kind::Locked => Locked::new_err(message),
            Kind::Corrupted => Corrupted::new_err(message),
            Kind::Io => StoreIoError::new_err(message),
            Kind::InvalidInput => InvalidInput::new_err(message),
            Kind::Unavailable => Unavailable::new_err(message),
            Kind::TimedOut => TimedOut::new_err(message),
            Kind::Other => Error::new_err(message),
        }
    }
}

fn classify(err: &oncedb::Error) -> Kind {
    match err {
        oncedb::Error::LeaseLost => Kind::LeaseLost,
        oncedb::Error::Fenced => Kind::Fenced,
        oncedb::Error::Full => Kind::Full,
        oncedb::Error::Poisoned => Kind::Poisoned,
        oncedb::Error::Locked(_) => Kind::Locked,
        oncedb::Error::Corrupted { .. } => Kind::Corrupted,
        oncedb::Error::Io(_) => Kind::Io,
        oncedb::Error::InvalidOptions(_)
        | oncedb::Error::IncompatibleOptions(_)
        | oncedb::Error::KeyTooLong { .. }
        | oncedb::Error::EmptyKey
        | oncedb::Error::ScopeTooLong { .. }
        | oncedb::Error::ResponseTooLarge { .. }
        | oncedb::Error::BatchTooLarge { .. }
        | oncedb::Error::NoteTooLong { .. } => Kind::InvalidInput,
        oncedb::Error::Unavailable { .. } => Kind::Unavailable,
        oncedb::Error::TimedOut { .. } => Kind::TimedOut,
        _ => Kind::Other,
    }
}

/// A key: `bytes` as they are, `str` as UTF-8.
fn key_of<'a>(key: &'a Bound<'_, PyAny>) -> PyResult<Cow<'a, [u8]>> {
    if let Ok(bytes) = key.cast::<PyBytes>() {
        return Ok(Cow::Owned(bytes.as_bytes().to_vec()));
    }
    if let Ok(text) = key.cast::<PyString>() {
        return Ok(Cow::Owned(text.to_cow()?.as_bytes().to_vec()));
    }
    Err(PyTypeError::new_err("a key is bytes or str"))
}

/// A record's scope and key, from the Python arguments (each `bytes` or `str`).
fn scoped(
    tenant: &Bound<'_, PyAny>,
    operation: &Bound<'_, PyAny>,
    key: &Bound<'_, PyAny>,
) -> PyResult<(oncedb::Scope, Vec<u8>)> {
    let scope = oncedb::Scope::new(key_of(tenant)?, key_of(operation)?);
    Ok((scope, key_of(key)?.into_owned()))
}

/// A duration: seconds (int or float) or a `datetime.timedelta`.
fn duration_of(value: &Bound<'_, PyAny>) -> PyResult<Duration> {
    let seconds: f64 = if value.hasattr("total_seconds")? {
        value.call_method0("total_seconds")?.extract()?
    } else {
        value.extract()?
    };
    Duration::try_from_secs_f64(seconds)
        .map_err(|_| PyValueError::new_err(format!("{seconds} is not a duration in seconds")))
}

/// `"sync"`, `"buffered"`, or `"interval:<n>ms"` (a bare `<n>` is milliseconds).
fn durability_of(text: &str) -> PyResult<oncedb::Durability> {
    match text {
        "sync" => Ok(oncedb::Durability::Sync),
        "buffered" => Ok(oncedb::Durability::Buffered),
        _ => text
            .strip_prefix("interval:")
            .map(|ms| ms.strip_suffix("ms").unwrap_or(ms))
            .and_then(|ms| ms.parse::<u64>().ok())
            .map(|ms| oncedb::Durability::Interval(Duration::from_millis(ms)))
            .ok_or_else(|| {
                InvalidInput::new_err(format!(
                    "durability {text:?}: \"sync\", \"buffered\" or \"interval:<n>ms\""
                ))
            }),
    }
}

fn unix_seconds(time: SystemTime) -> f64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0.0, |since| since.as_secs_f64())
}

/// A store: durable in `path`, or in memory with `path=None`.
#[pyclass(module = "oncedb._oncedb", frozen)]
struct Db {
    /// `None` once closed.
    db: Mutex<Option<std::sync::Arc<oncedb::Db>>>,
    /// The process that opened it: a forked worker has a copy of its memory (its own
    /// index, no background threads, the parent's directory lock) and must not use it.
    pid: u32,
}

/// Refuses a store (or lease) opened by another process: this one was forked from it.
fn same_process(pid: u32) -> PyResult<()> {
    let here = std::process::id();
    if here == pid {
        return Ok(());
    }
    Err(Error::new_err(format!(
        "this Db was opened by process {pid} and is used in process {here}, forked from it: \
         a forked worker has its own copy of the index, so two workers could both acquire \
         one key. Open the Db in each worker after the fork, each with its own directory \
         (route each key to one worker), or share a PostgreSQL or Redis store"
    )))
}

impl Drop for Db {
    /// In a process forked from the one that opened it (a worker that exits normally,
    /// `os.fork()` then `sys.exit`), the store is left alone: its drop would wait for a
    /// group-commit leader that lives only in the parent, or seal and rename the
    /// parent's files. The child's copy of its memory is leaked instead, and the parent
    /// goes on with its store.
    fn drop(&mut self) {
        if std::process::id() == self.pid {
            return;
        }
        let inherited = match self.db.get_mut() {
            Ok(db) => db.take(),
            Err(poisoned) => poisoned.into_inner().take(),
        };
        std::mem::forget(inherited);
    }
}

impl Db {
    fn handle(&self) -> PyResult<std::sync::Arc<oncedb::Db>> {
        same_process(self.pid)?;
        self.db
            .lock()
            .map_err(|_| Error::new_err("the Db's lock is poisoned"))?
            .clone()
            .ok_or_else(|| Closed::new_err("the Db is closed"))
    }
}

#[pymethods]
impl Db {
    #[new]
    #[pyo3(signature = (path=None, *, window=None, bucket=None, durability="sync", max_keys=None, memory_budget=None, response_retention=None, shards=None, lease_timeout=None))]
    #[expect(
        clippy::too_many_arguments,
        reason = "Python keyword arguments, all optional"
    )]
    fn new(
        py: Python<'_>,
        path: Option<std::path::PathBuf>,
        window: Option<&Bound<'_, PyAny>>,
        bucket: Option<&Bound<'_, PyAny>>,
        durability: &str,
        max_keys: Option<u64>,
        memory_budget: Option<u64>,
        response_retention: Option<&Bound<'_, PyAny>>,
        shards: Option<usize>,
        lease_timeout: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Db> {
        let mut options = match &path {
            Some(path) => oncedb::Options::new(path).durability(durability_of(durability)?),
            None => oncedb::Options::in_memory(),
        };
        if let Some(window) = window {
            options = options.window(duration_of(window)?);
        }
        if let Some(bucket) = bucket {
            options = options.bucket_width(duration_of(bucket)?);
        }
        if let Some(retention) = response_retention {
            options = options.response_retention(duration_of(retention)?);
        }
        if let Some(keys) = max_keys {
            options = options.max_keys(keys);
        }
        if let Some(bytes) = memory_budget {
            options = options.memory_budget(bytes);
        }
        if let Some(shards) = shards {
            options = options.shards(shards);
        }
        if let Some(timeout) = lease_timeout {
            options = options.lease_timeout(duration_of(timeout)?);
        }
        let db = py.detach(|| oncedb::Db::open(options)).map_err(raise)?;
        Ok(Db {
            db: Mutex::new(Some(std::sync::Arc::new(db))),
            pid: std::process::id(),
        })
    }

    /// Admits `key` unless it is live: `True` if it was new.
    fn insert_if_absent(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let (db, key) = (self.handle()?, key_of(key)?.into_owned());
        py.detach(|| db.insert_if_absent(&key)).map_err(raise)
    }

    /// Admits many keys at once: one answer per key, in order.
    fn insert_many(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<bool>> {
        let db = self.handle()?;
        let keys: Vec<Vec<u8>> = keys
            .iter()
            .map(|key| key_of(key).map(Cow::into_owned))
            .collect::<PyResult<_>>()?;
        py.detach(|| db.insert_many(&keys)).map_err(raise)
    }

    /// Whether `key` is live.
    fn contains(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let (db, key) = (self.handle()?, key_of(key)?.into_owned());
        py.detach(|| db.contains(&key)).map_err(raise)
    }

    /// Looks up or creates the record of `key` in (`tenant`, `operation`), bound to
    /// `request`.
    fn reserve(
        &self,
        py: Python<'_>,
        tenant: &Bound<'_, PyAny>,
        operation: &Bound<'_, PyAny>,
        key: &Bound<'_, PyAny>,
        request: Vec<u8>,
    ) -> PyResult<Reservation> {
        let db = self.handle()?;
        let (scope, key) = scoped(tenant, operation, key)?;
        let reservation = py
            .detach(|| db.reserve(&scope, &key, &request))
            .map_err(raise)?;
        let reservation = widened(reservation, AnyLease::Embedded);
        Ok(Reservation::from(reservation, db.max_response_bytes()))
    }

    /// Waits until the record of `key` in (`tenant`, `operation`) is no longer in flight
    /// or `timeout` passes (the GIL released, woken by the ending itself): the record
    /// as it then is, as a `Reservation` whose status is "completed", "failed" or
    /// "in_flight"; `None` if there is none (released, expired, never reserved).
    fn wait_finished(
        &self,
        py: Python<'_>,
        tenant: &Bound<'_, PyAny>,
        operation: &Bound<'_, PyAny>,
        key: &Bound<'_, PyAny>,
        timeout: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Reservation>> {
        let db = self.handle()?;
        let ((scope, key), timeout) = (scoped(tenant, operation, key)?, duration_of(timeout)?);
        let record = py
            .detach(|| db.wait_finished(&scope, &key, timeout))
            .map_err(raise)?;
        Ok(record.map(|record| Reservation::of_record(&record)))
    }

    /// The lease timeout after which a record in flight is taken over, in seconds, or
    /// `None`.
    #[getter]
    fn lease_timeout(&self) -> PyResult<Option<f64>> {
        Ok(self.handle()?.lease_timeout().map(|t| t.as_secs_f64()))
    }

    /// Takes over the record of `key` if it is in flight: a new lease, the old one
    /// fenced; `None` if there is no record in flight.
    fn take_over(
        &self,
        py: Python<'_>,
        tenant: &Bound<'_, PyAny>,
        operation: &Bound<'_, PyAny>,
        key: &Bound<'_, PyAny>,
    ) -> PyResult<Option<Lease>> {
        let db = self.handle()?;
        let (scope, key) = scoped(tenant, operation, key)?;
        let lease = py.detach(|| db.take_over(&scope, &key)).map_err(raise)?;
        let max = db.max_response_bytes();
        Ok(lease.map(|lease| Lease::new(AnyLease::Embedded(lease), max)))
    }

    /// Records in flight for at least `older_than` seconds: dicts with tenant,
    /// operation, key, since (unix seconds), epoch and note.
    fn in_flight<'py>(
        &self,
        py: Python<'py>,
        older_than: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let (db, age) = (self.handle()?, duration_of(older_than)?);
        in_flight_dicts(py, py.detach(|| db.in_flight(age)))
    }

    /// The ordering guard: `("applied" | "duplicate", None)`, `("stale", current)` or
    /// `("gap", expected)` for `version` of `aggregate_id`.
    fn advance(
        &self,
        py: Python<'_>,
        tenant: &Bound<'_, PyAny>,
        operation: &Bound<'_, PyAny>,
        aggregate_id: &Bound<'_, PyAny>,
        version: u64,
    ) -> PyResult<(&'static str, Option<u64>)> {
        let db = self.handle()?;
        let (scope, id) = scoped(tenant, operation, aggregate_id)?;
        let answer = py
            .detach(|| db.advance(&scope, &id, version))
            .map_err(raise)?;
        Ok(advanced(answer))
    }

    /// Makes everything acknowledged so far durable (an fsync).
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        let db = self.handle()?;
        py.detach(|| db.flush()).map_err(raise)
    }

    /// Counters and sizes, as a dict.
    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.handle()?.stats();
        let dict = PyDict::new(py);
        macro_rules! put {
            ($($field:ident),* $(,)?) => { $(dict.set_item(stringify!($field), stats.$field)?;)* };
        }
        put!(
            live_keys,
            live_records,
            admitted,
            duplicates,
            acquired,
            in_flight_hits,
            replays,
            mismatches,
            completed,
            failed,
            released,
            leases_lost,
            fenced,
            take_overs,
            stuck_records,
            outcome_waiters,
            full_rejections,
            buckets_live,
            buckets_dropped,
            index_bytes,
            fsyncs,
            log_records,
            log_bytes,
            segments,
            bytes_on_disk,
            sealed_runs,
            sealed_keys,
            sealed_record_runs,
            sealed_records,
        );
        Ok(dict)
    }

    /// Whether the store writes files.
    #[getter]
    fn durable(&self) -> PyResult<bool> {
        Ok(self.handle()?.is_durable())
    }

    /// Closes the store (flushing a durable one and releasing its lock). Later calls
    /// raise `Closed`; closing twice is fine. Leases still held keep the store open
    /// until they end.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        let db = self
            .db
            .lock()
            .map_err(|_| Error::new_err("the Db's lock is poisoned"))?
            .take();
        py.detach(|| drop(db));
        Ok(())
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    fn __exit__(
        &self,
        py: Python<'_>,
        _kind: &Bound<'_, PyAny>,
        _value: &Bound<'_, PyAny>,
        _traceback: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }
}

/// What `reserve` answered.
#[pyclass(module = "oncedb._oncedb", frozen)]
struct Reservation {
    /// "acquired", "in_flight", "completed", "failed", "expired" or "mismatch".
    #[pyo3(get)]
    status: &'static str,
    /// The lease, when acquired.
    #[pyo3(get)]
    lease: Option<Py<Lease>>,
    response: Option<Vec<u8>>,
    /// When the record was reserved (unix seconds), for in_flight.
    #[pyo3(get)]
    since: Option<f64>,
    note: Option<Vec<u8>>,
}

impl Reservation {
    /// A record as `wait_finished` returns it.
    fn of_record(record: &oncedb::Record) -> Reservation {
        Reservation {
            status: match record.status() {
                oncedb::RecordStatus::Completed => "completed",
                oncedb::RecordStatus::Failed => "failed",
                _ => "in_flight",
            },
            lease: None,
            response: record.response().map(<[u8]>::to_vec),
            since: Some(unix_seconds(record.created_at())),
            note: None,
        }
    }

    fn from(reservation: oncedb::Reservation<AnyLease>, max_response_bytes: usize) -> Reservation {
        let mut answer = Reservation {
            status: "mismatch",
            lease: None,
            response: None,
            since: None,
            note: None,
        };
        match reservation {
            oncedb::Reservation::Acquired(lease) => {
                answer.status = "acquired";
                answer.lease =
                    Python::attach(|py| Py::new(py, Lease::new(lease, max_response_bytes)).ok());
            }
            oncedb::Reservation::InFlight { since, note } => {
                answer.status = "in_flight";
                answer.since = Some(unix_seconds(since));
                answer.note = note;
            }
            oncedb::Reservation::Completed(record) => {
                answer.status = "completed";
                answer.response = record.response().map(<[u8]>::to_vec);
            }
            oncedb::Reservation::Failed(record) => {
                answer.status = "failed";
                answer.response = record.response().map(<[u8]>::to_vec);
            }
            oncedb::Reservation::Expired(_) => answer.status = "expired",
            oncedb::Reservation::Mismatch => {}
        }
        answer
    }
}

#[pymethods]
impl Reservation {
    /// The stored response (completed) or failure (failed); `None` otherwise.
    #[getter]
    fn response<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.response.as_deref().map(|r| PyBytes::new(py, r))
    }

    /// The note of the record in flight, if its lease holder left one.
    #[getter]
    fn note<'py>(&self, py: Python<'py>) -> Option<Bound<'py, PyBytes>> {
        self.note.as_deref().map(|n| PyBytes::new(py, n))
    }

    fn __repr__(&self) -> String {
        format!("Reservation(status={:?})", self.status)
    }
}

/// The right to finish one record: complete, fail or release it once.
#[pyclass(module = "oncedb._oncedb", frozen)]
struct Lease {
    /// One call at a time: a renewal in progress holds it, so an ending waits for the
    /// renewal instead of finding the lease gone. Locked by a thread only with the GIL
    /// released (inside `py.detach`), so a call waiting on the lock and a call waiting
    /// for the GIL cannot wait on each other; the runtime thread awaits it.
    lease: tokio::sync::Mutex<Option<AnyLease>>,
    pid: u32,
    /// The store's response limit: checked before an awaitable end takes the lease.
    max_response_bytes: usize,
    /// Where its awaitable calls start: a lease of the embedded store tries them here.
    start: Start,
    /// The fencing epoch: pass it to downstream writes so that a replaced holder's
    /// writes can be refused.
    #[pyo3(get)]
    epoch: u64,
}

/// How a lease ends.
enum Ending {
    Complete(Vec<u8>),
    Fail(Vec<u8>),
    Release,
}

impl Ending {
    fn response_len(&self) -> usize {
        match self {
            Ending::Complete(response) | Ending::Fail(response) => response.len(),
            Ending::Release => 0,
        }
    }

    /// On the engine's own lease, whose refusal hands the lease back.
    fn embedded(self, lease: oncedb::Lease) -> Result<(), oncedb::LeaseError> {
        match self {
            Ending::Complete(response) => lease.complete(&response),
            Ending::Fail(response) => lease.fail(&response),
            Ending::Release => lease.release(),
        }
    }

    /// On any lease, awaited.
    async fn on(self, lease: AnyLease) -> oncedb::Result<()> {
        use oncedb::StoreLease;
        match self {
            Ending::Complete(response) => lease.complete(&response).await,
            Ending::Fail(response) => lease.fail(&response).await,
            Ending::Release => lease.release().await,
        }
    }
}

/// A call that keeps the lease.
enum Kept {
    Note(Vec<u8>),
    KeepAlive,
}

impl Kept {
    fn embedded(&self, lease: &oncedb::Lease) -> oncedb::Result<()> {
        match self {
            Kept::Note(note) => lease.note(note),
            Kept::KeepAlive => lease.keep_alive(),
        }
    }

    /// On any lease, awaited.
    async fn on(&self, lease: &AnyLease) -> oncedb::Result<()> {
        use oncedb::StoreLease;
        match self {
            Kept::Note(note) => lease.note(note).await,
            Kept::KeepAlive => lease.keep_alive().await,
        }
    }
}

impl Lease {
    fn new(lease: AnyLease, max_response_bytes: usize) -> Lease {
        let start = match &lease {
            AnyLease::Embedded(_) => Start::Here,
            _ => Start::OnRuntime,
        };
        Lease {
            epoch: oncedb::StoreLease::epoch(&lease),
            start,
            lease: tokio::sync::Mutex::new(Some(lease)),
            pid: std::process::id(),
            max_response_bytes,
        }
    }

    /// An awaitable end, once the response was checked against the store's limit (a
    /// refused one changes nothing and keeps the lease).
    fn aend(slf: Bound<'_, Self>, ending: Ending) -> PyResult<Bound<'_, PyAny>> {
        let py = slf.py();
        let lease = slf.get();
        same_process(lease.pid)?;
        let len = ending.response_len();
        if len > lease.max_response_bytes {
            return Err(InvalidInput::new_err(format!(
                "response of {len} bytes exceeds the limit of {} bytes",
                lease.max_response_bytes
            )));
        }
        let (start, this) = (lease.start, slf.unbind());
        awaitable(py, start, async move {
            let lease = this.get().lease.lock().await.take().ok_or_else(gone)?;
            ending.on(lease).await.map_err(|err| carried(&err))
        })
    }

    /// An awaitable call that keeps the lease (a note, a renewal).
    fn akeep(slf: Bound<'_, Self>, kept: Kept) -> PyResult<Bound<'_, PyAny>> {
        let py = slf.py();
        same_process(slf.get().pid)?;
        let (start, this) = (slf.get().start, slf.unbind());
        awaitable(py, start, async move {
            let slot = this.get().lease.lock().await;
            let lease = slot.as_ref().ok_or_else(gone)?;
            kept.on(lease).await.map_err(|err| carried(&err))
        })
    }

    /// Ends the lease, the GIL released (the lock taken only then). A refused end of the
    /// engine's lease gives it back, so that a retry (after an I/O error) can end it; a
    /// shared store's lease is ended on the runtime thread, the lock released.
    fn end(&self, py: Python<'_>, ending: Ending) -> PyResult<()> {
        same_process(self.pid)?;
        let ended = py.detach(|| {
            let mut slot = self.lease.blocking_lock();
            match slot.take().ok_or(Ended::Gone)? {
                AnyLease::Embedded(lease) => ending.embedded(lease).map_err(|err| {
                    let refused = Ended::Refused(err.error().to_string(), classify(err.error()));
                    *slot = Some(AnyLease::Embedded(err.into_lease()));
                    refused
                }),
                shared => {
                    drop(slot);
                    let runtime =
                        runtime_handle().map_err(|err| Ended::Refused(err, Kind::Other))?;
                    let outcome = waited(runtime, async move { ending.on(shared).await });
                    outcome.map_err(|(message, kind)| Ended::Refused(message, kind))
                }
            }
        });
        ended.map_err(Ended::into_py)
    }

    /// Runs `kept` on the lease, the GIL released (the lock taken only then, and held
    /// while the runtime thread runs a shared store's call).
    fn with(&self, py: Python<'_>, kept: Kept) -> PyResult<()> {
        same_process(self.pid)?;
        let done = py.detach(|| {
            let mut slot = self.lease.blocking_lock();
            let lease = slot.take().ok_or(Ended::Gone)?;
            if let AnyLease::Embedded(embedded) = &lease {
                let outcome = kept.embedded(embedded);
                *slot = Some(lease);
                return outcome.map_err(|err| Ended::Refused(err.to_string(), classify(&err)));
            }
            let runtime = runtime_handle().map_err(|err| Ended::Refused(err, Kind::Other))?;
            let (lease, outcome) = waited(runtime, async move {
                let outcome = kept.on(&lease).await;
                Ok((lease, outcome))
            })
            .map_err(|(message, kind)| Ended::Refused(message, kind))?;
            *slot = Some(lease);
            outcome.map_err(|err| Ended::Refused(err.to_string(), classify(&err)))
        });
        done.map_err(Ended::into_py)
    }
}

/// The error of a lease that already ended.
fn gone() -> (String, Kind) {
    ("the lease already ended".to_owned(), Kind::LeaseLost)
}

/// Why a lease call failed, carried out of a section without the GIL (where no Python
/// object may be made).
enum Ended {
    Gone,
    Refused(String, Kind),
}

impl Ended {
    fn into_py(self) -> PyErr {
        match self {
            Ended::Gone => LeaseLost::new_err("the lease already ended"),
            Ended::Refused(message, kind) => kind.error(message),
        }
    }
}

#[pymethods]
impl Lease {
    /// Stores `response` for replay to every retry.
    fn complete(&self, py: Python<'_>, response: Vec<u8>) -> PyResult<()> {
        self.end(py, Ending::Complete(response))
    }

    /// Stores a deterministic failure for replay.
    fn fail(&self, py: Python<'_>, response: Vec<u8>) -> PyResult<()> {
        self.end(py, Ending::Fail(response))
    }

    /// Deletes the record so that a retry may run.
    fn release(&self, py: Python<'_>) -> PyResult<()> {
        self.end(py, Ending::Release)
    }

    /// `complete`, as an awaitable that holds no thread while it awaits the commit.
    fn acomplete(slf: Bound<'_, Self>, response: Vec<u8>) -> PyResult<Bound<'_, PyAny>> {
        Lease::aend(slf, Ending::Complete(response))
    }

    /// `fail`, as an awaitable.
    fn afail(slf: Bound<'_, Self>, response: Vec<u8>) -> PyResult<Bound<'_, PyAny>> {
        Lease::aend(slf, Ending::Fail(response))
    }

    /// `release`, as an awaitable.
    fn arelease(slf: Bound<'_, Self>) -> PyResult<Bound<'_, PyAny>> {
        Lease::aend(slf, Ending::Release)
    }

    /// `note`, as an awaitable.
    fn anote(slf: Bound<'_, Self>, note: Vec<u8>) -> PyResult<Bound<'_, PyAny>> {
        Lease::akeep(slf, Kept::Note(note))
    }

    /// `keep_alive`, as an awaitable.
    fn akeep_alive(slf: Bound<'_, Self>) -> PyResult<Bound<'_, PyAny>> {
        Lease::akeep(slf, Kept::KeepAlive)
    }

    /// Attaches a short note to the record while in flight (what a reconciler sees).
    fn note(&self, py: Python<'_>, note: Vec<u8>) -> PyResult<()> {
        self.with(py, Kept::Note(note))
    }

    /// Renews the lease: the store's lease timeout counts from now, durably. Call it
    /// more often than the timeout while the work runs.
    fn keep_alive(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, Kept::KeepAlive)
    }
}

/// The extension module.
#[pymodule]
fn _oncedb(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<Db>()?;
    m.add_function(wrap_pyfunction!(_settle, m)?)?;
    // A test hook of debug builds: an attribute, not in `__all__` (so not in the stubs).
    #[cfg(debug_assertions)]
    m.setattr(
        "_awaitable_that_panics",
        wrap_pyfunction!(_awaitable_that_panics, m)?,
    )?;
    m.add_class::<Reservation>()?;
    m.add_class::<Lease>()?;
    m.add_class::<shared::SharedStore>()?;
    m.add_class::<shared::PostgresStore>()?;
    m.add_class::<shared::RedisStore>()?;
    for (name, class) in [
        ("Error", py.get_type::<Error>()),
        ("InvalidInput", py.get_type::<InvalidInput>()),
        ("LeaseLost", py.get_type::<LeaseLost>()),
        ("Fenced", py.get_type::<Fenced>()),
        ("Full", py.get_type::<Full>()),
        ("Poisoned", py.get_type::<Poisoned>()),
        ("Locked", py.get_type::<Locked>()),
        ("Corrupted", py.get_type::<Corrupted>()),
        ("StoreIoError", py.get_type::<StoreIoError>()),
        ("Closed", py.get_type::<Closed>()),
        ("Unavailable", py.get_type::<Unavailable>()),
        ("TimedOut", py.get_type::<TimedOut>()),
    ] {
        m.add(name, class)?;
    }
    Ok(())
}

/// The runtime the awaitables and the shared stores run on: one thread of its own,
/// whatever the number of calls waiting (a write awaits its group commit or its server
/// through a waker, holding no thread). Made again in a forked child, where the parent's
/// thread does not exist.
fn runtime() -> PyResult<tokio::runtime::Handle> {
    runtime_handle().map_err(Error::new_err)
}

/// `runtime`, for a caller without the GIL.
fn runtime_handle() -> Result<tokio::runtime::Handle, String> {
    static RUNTIME: Mutex<Option<(u32, tokio::runtime::Handle)>> = Mutex::new(None);
    let mut slot = RUNTIME
        .lock()
        .map_err(|_| "the runtime's lock is poisoned".to_owned())?;
    let pid = std::process::id();
    if let Some((owner, handle)) = slot.as_ref()
        && *owner == pid
    {
        return Ok(handle.clone());
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|err| format!("starting oncedb's runtime: {err}"))?;
    let handle = runtime.handle().clone();
    std::thread::Builder::new()
        .name("oncedb-async".into())
        .spawn(move || runtime.block_on(std::future::pending::<()>()))
        .map_err(|err| format!("starting oncedb's runtime: {err}"))?;
    *slot = Some((pid, handle.clone()));
    Ok(handle)
}

/// Where an awaitable's call starts.
#[derive(Debug, Clone, Copy)]
enum Start {
    /// On the calling thread (the GIL released), for the embedded store: its first poll
    /// answers at once unless the call waits for an fsync, the log's writer or a file's
    /// work, which then goes on on the runtime thread. No crossing of threads, and no
    /// wait for the GIL to settle the future, when nothing is to be waited for.
    Here,
    /// On the runtime thread: a shared store's call waits on its server.
    OnRuntime,
}

/// An asyncio future of the running loop, settled by `work`'s outcome: at once if `start`
/// is [`Start::Here`] and its first poll (on this thread, the GIL released, in the
/// runtime's context) answers; otherwise from the runtime thread (through
/// `call_soon_threadsafe`, so the loop's own thread sets it). A future cancelled
/// meanwhile is left alone. A task that panics settles it too, with `oncedb.Error`
/// (outcome unknown), instead of leaving it pending.
fn awaitable<'py, T>(
    py: Python<'py>,
    start: Start,
    work: impl std::future::Future<Output = Result<T, (String, Kind)>> + Send + 'static,
) -> PyResult<Bound<'py, PyAny>>
where
    T: for<'a> IntoPyObject<'a> + Send + 'static,
{
    let running = py.import("asyncio")?.call_method0("get_running_loop")?;
    let future = running.call_method0("create_future")?;
    let handle = runtime()?;
    let mut work = Box::pin(work);
    if matches!(start, Start::Here)
        && let Some(outcome) = py.detach(|| first_poll(&handle, work.as_mut()))
    {
        let (ok, value) = python_outcome(py, outcome);
        future.call_method1(if ok { "set_result" } else { "set_exception" }, (value,))?;
        return Ok(future);
    }
    let mut settler = Settler {
        event_loop: running.unbind(),
        target: future.clone().unbind(),
        settle: py.import("oncedb._oncedb")?.getattr("_settle")?.unbind(),
        settled: false,
    };
    handle.spawn(async move {
        let outcome = work.await;
        Python::attach(|py| {
            let (ok, value) = python_outcome(py, outcome);
            settler.settle(py, ok, value);
        });
    });
    Ok(future)
}

/// Polls `work` once on this thread, in the runtime's context (a call that hands file
/// work to the blocking pool, or waits on a timer, finds them), with a waker that does
/// nothing: the runtime polls it again, with its own, if it is not ready. A panic is
/// the call's outcome, unknown.
fn first_poll<T>(
    handle: &tokio::runtime::Handle,
    work: std::pin::Pin<
        &mut (impl std::future::Future<Output = Result<T, (String, Kind)>> + ?Sized),
    >,
) -> Option<Result<T, (String, Kind)>> {
    let _entered = handle.enter();
    let mut context = std::task::Context::from_waker(std::task::Waker::noop());
    let polled = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| work.poll(&mut context)));
    match polled {
        Ok(std::task::Poll::Ready(outcome)) => Some(outcome),
        Ok(std::task::Poll::Pending) => None,
        Err(_) => Some(Err((
            "oncedb's call panicked: its outcome is unknown".to_owned(),
            Kind::Other,
        ))),
    }
}

/// A call's outcome as Python sees it: whether it is a result, and the result or the
/// exception.
fn python_outcome<T>(py: Python<'_>, outcome: Result<T, (String, Kind)>) -> (bool, Py<PyAny>)
where
    T: for<'a> IntoPyObject<'a>,
{
    let value: PyResult<(bool, Py<PyAny>)> = match outcome {
        Ok(value) => value
            .into_pyobject(py)
            .map(|v| (true, v.into_any().unbind()))
            .map_err(Into::into),
        Err((message, kind)) => Ok((false, kind.error(message).into_value(py).into_any())),
    };
    value.unwrap_or_else(|err| (false, err.into_value(py).into_any()))
}

/// Settles one asyncio future from the runtime thread, once: with the task's outcome,
/// or, dropped unsettled (the task panicked and is unwinding), with an error.
struct Settler {
    event_loop: Py<PyAny>,
    target: Py<PyAny>,
    settle: Py<PyAny>,
    settled: bool,
}

impl Settler {
    fn settle(&mut self, py: Python<'_>, ok: bool, value: Py<PyAny>) {
        self.settled = true;
        let (settle, target) = (self.settle.clone_ref(py), self.target.clone_ref(py));
        let _ =
            self.event_loop
                .call_method1(py, "call_soon_threadsafe", (settle, target, ok, value));
    }
}

impl Drop for Settler {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        Python::attach(|py| {
            let message = "oncedb's task for this call panicked: its outcome is unknown";
            let error = Kind::Other
                .error(message.to_owned())
                .into_value(py)
                .into_any();
            self.settle(py, false, error);
        });
    }
}

/// An awaitable whose task panics, for the test that a panic settles its future.
#[cfg(debug_assertions)]
#[pyfunction]
fn _awaitable_that_panics(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    #[expect(clippy::panic, reason = "the panic under test")]
    async fn panics() -> Result<(), (String, Kind)> {
        panic!("a task of oncedb's runtime panicked (test)")
    }
    awaitable(py, Start::OnRuntime, panics())
}

/// Settles `future` with `value` (a result if `ok`, else an exception), unless it was
/// cancelled: the callback the runtime thread schedules on the loop.
#[pyfunction]
fn _settle(future: &Bound<'_, PyAny>, ok: bool, value: &Bound<'_, PyAny>) -> PyResult<()> {
    if future.call_method0("done")?.extract::<bool>()? {
        return Ok(());
    }
    if ok {
        future.call_method1("set_result", (value,))?;
    } else {
        future.call_method1("set_exception", (value,))?;
    }
    Ok(())
}

/// The awaitables of a store class (`Db`, `SharedStore`): the same calls through one
/// generic helper each, each holding no thread while it waits (for a group commit, a
/// server, an ending); `$wrap` makes the store's lease one of the module's.
macro_rules! awaitables {
    ($class:ty, $wrap:expr, $start:expr) => {
        #[pymethods]
        impl $class {
            /// `insert_if_absent`, as an awaitable.
            fn ainsert_if_absent<'py>(
                &self,
                py: Python<'py>,
                key: &Bound<'_, PyAny>,
            ) -> PyResult<Bound<'py, PyAny>> {
                ainsert_on(py, $start, self.handle()?, key)
            }

            /// `reserve`, as an awaitable.
            fn areserve<'py>(
                &self,
                py: Python<'py>,
                tenant: &Bound<'_, PyAny>,
                operation: &Bound<'_, PyAny>,
                key: &Bound<'_, PyAny>,
                request: Vec<u8>,
            ) -> PyResult<Bound<'py, PyAny>> {
                let scoped = scoped(tenant, operation, key)?;
                areserve_on(py, $start, self.handle()?, $wrap, scoped, request)
            }

            /// `wait_finished`, as an awaitable woken by the ending.
            fn await_finished<'py>(
                &self,
                py: Python<'py>,
                tenant: &Bound<'_, PyAny>,
                operation: &Bound<'_, PyAny>,
                key: &Bound<'_, PyAny>,
                timeout: &Bound<'_, PyAny>,
            ) -> PyResult<Bound<'py, PyAny>> {
                let scoped = scoped(tenant, operation, key)?;
                await_finished_on(py, $start, self.handle()?, scoped, duration_of(timeout)?)
            }
        }
    };
}

awaitables!(Db, AnyLease::Embedded, Start::Here);
awaitables!(
    shared::SharedStore,
    std::convert::identity,
    Start::OnRuntime
);

/// A store error carried out of the runtime thread (no Python object is made there).
fn carried(err: &oncedb::Error) -> (String, Kind) {
    (err.to_string(), classify(err))
}

/// `insert_if_absent` on any store, as an awaitable.
fn ainsert_on<'py, S: oncedb::Store>(
    py: Python<'py>,
    start: Start,
    store: std::sync::Arc<S>,
    key: &Bound<'_, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let key = key_of(key)?.into_owned();
    awaitable(py, start, async move {
        let admitted = store.insert_if_absent(&key).await;
        admitted.map_err(|err| carried(&err))
    })
}

/// `reserve` on any store, as an awaitable; `wrap` makes its lease one of the module's.
fn areserve_on<'py, S: oncedb::Store>(
    py: Python<'py>,
    start: Start,
    store: std::sync::Arc<S>,
    wrap: fn(S::Lease) -> AnyLease,
    (scope, key): (oncedb::Scope, Vec<u8>),
    request: Vec<u8>,
) -> PyResult<Bound<'py, PyAny>> {
    awaitable(py, start, async move {
        let reserved = store.reserve(&scope, &key, &request).await;
        let reservation = reserved.map_err(|err| carried(&err))?;
        let max = store.max_response_bytes();
        Ok(Reservation::from(widened(reservation, wrap), max))
    })
}

/// `wait_finished` on any store, as an awaitable.
fn await_finished_on<'py, S: oncedb::Store>(
    py: Python<'py>,
    start: Start,
    store: std::sync::Arc<S>,
    (scope, key): (oncedb::Scope, Vec<u8>),
    timeout: Duration,
) -> PyResult<Bound<'py, PyAny>> {
    awaitable(py, start, async move {
        let record = store.wait_finished(&scope, &key, timeout).await;
        let record = record.map_err(|err| carried(&err))?;
        Ok(record.map(|record| Reservation::of_record(&record)))
    })
}

/// Records in flight as dicts with tenant, operation, key, since (unix seconds), epoch
/// and note.
fn in_flight_dicts(
    py: Python<'_>,
    records: Vec<oncedb::InFlight>,
) -> PyResult<Vec<Bound<'_, PyDict>>> {
    records
        .into_iter()
        .map(|record| {
            let dict = PyDict::new(py);
            dict.set_item("tenant", PyBytes::new(py, record.scope.tenant()))?;
            dict.set_item("operation", PyBytes::new(py, record.scope.operation()))?;
            dict.set_item("key", PyBytes::new(py, &record.key))?;
            dict.set_item("since", unix_seconds(record.since))?;
            dict.set_item("epoch", record.epoch)?;
            dict.set_item("note", record.note.as_deref().map(|n| PyBytes::new(py, n)))?;
            Ok(dict)
        })
        .collect()
}

/// The ordering guard's answer as Python sees it.
fn advanced(answer: oncedb::Advance) -> (&'static str, Option<u64>) {
    match answer {
        oncedb::Advance::Applied => ("applied", None),
        oncedb::Advance::Duplicate => ("duplicate", None),
        oncedb::Advance::Stale { current } => ("stale", Some(current)),
        oncedb::Advance::Gap { expected } => ("gap", Some(expected)),
    }
}
