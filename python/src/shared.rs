//! The shared stores, `PostgresStore` and `RedisStore`: the reservation API of `Db` on a
//! server that several worker processes share. Every call runs on the module's runtime
//! thread: an awaitable holds no thread while the server answers, and a blocking call
//! waits with the GIL released.

use std::sync::Arc;
use std::time::Duration;

use oncedb::{Advance, InFlight, Record, Reservation, Result, Scope, Store, StoreLease};
use pyo3::prelude::*;

use crate::{
    Kind, advanced, carried, duration_of, in_flight_dicts, key_of, runtime, same_process, scoped,
};

/// A server-backed store, as the Python classes hold it.
pub(crate) enum Backend {
    Postgres(oncedb::PostgresStore),
    Redis(oncedb::RedisStore),
}

/// A lease of any store the module opens: the engine's own, or a server's.
pub(crate) enum AnyLease {
    Embedded(oncedb::Lease),
    Postgres(oncedb::PostgresLease),
    Redis(oncedb::RedisLease),
}

/// One call on whichever store or lease `$on` holds, as `$bound` in `$body`.
macro_rules! on_backend {
    ($on:expr, $bound:ident => $body:expr) => {
        match $on {
            Backend::Postgres($bound) => $body,
            Backend::Redis($bound) => $body,
        }
    };
}

macro_rules! on_lease {
    ($on:expr, $bound:ident => $body:expr) => {
        match $on {
            AnyLease::Embedded($bound) => $body,
            AnyLease::Postgres($bound) => $body,
            AnyLease::Redis($bound) => $body,
        }
    };
}

/// A reservation of the backend's own lease type, as one of this module's leases.
pub(crate) fn widened<L>(answer: Reservation<L>, wrap: fn(L) -> AnyLease) -> Reservation<AnyLease> {
    match answer {
        Reservation::Acquired(lease) => Reservation::Acquired(wrap(lease)),
        Reservation::InFlight { since, note } => Reservation::InFlight { since, note },
        Reservation::Completed(record) => Reservation::Completed(record),
        Reservation::Failed(record) => Reservation::Failed(record),
        Reservation::Expired(record) => Reservation::Expired(record),
        Reservation::Mismatch => Reservation::Mismatch,
    }
}

impl Store for Backend {
    type Lease = AnyLease;

    async fn insert_if_absent(&self, key: &[u8]) -> Result<bool> {
        on_backend!(self, store => store.insert_if_absent(key).await)
    }

    async fn insert_many(&self, keys: Vec<Vec<u8>>) -> Result<Vec<bool>> {
        on_backend!(self, store => store.insert_many(keys).await)
    }

    async fn reserve(
        &self,
        scope: &Scope,
        key: &[u8],
        request: &[u8],
    ) -> Result<Reservation<AnyLease>> {
        match self {
            Backend::Postgres(store) => {
                let answer = store.reserve(scope, key, request).await?;
                Ok(widened(answer, AnyLease::Postgres))
            }
            Backend::Redis(store) => {
                let answer = store.reserve(scope, key, request).await?;
                Ok(widened(answer, AnyLease::Redis))
            }
        }
    }

    async fn get(&self, scope: &Scope, key: &[u8]) -> Result<Option<Record>> {
        on_backend!(self, store => store.get(scope, key).await)
    }

    async fn in_flight(&self, older_than: Duration) -> Result<Vec<InFlight>> {
        on_backend!(self, store => store.in_flight(older_than).await)
    }

    async fn take_over(&self, scope: &Scope, key: &[u8]) -> Result<Option<AnyLease>> {
        Ok(match self {
            Backend::Postgres(store) => store.take_over(scope, key).await?.map(AnyLease::Postgres),
            Backend::Redis(store) => store.take_over(scope, key).await?.map(AnyLease::Redis),
        })
    }

    async fn resume(&self, scope: &Scope, key: &[u8], epoch: u64) -> Result<AnyLease> {
        Ok(match self {
            Backend::Postgres(store) => AnyLease::Postgres(store.resume(scope, key, epoch).await?),
            Backend::Redis(store) => AnyLease::Redis(store.resume(scope, key, epoch).await?),
        })
    }

    fn max_response_bytes(&self) -> usize {
        on_backend!(self, store => store.max_response_bytes())
    }

    async fn advance(&self, scope: &Scope, aggregate_id: &[u8], version: u64) -> Result<Advance> {
        on_backend!(self, store => store.advance(scope, aggregate_id, version).await)
    }

    async fn wait_finished(
        &self,
        scope: &Scope,
        key: &[u8],
        timeout: Duration,
    ) -> Result<Option<Record>> {
        on_backend!(self, store => store.wait_finished(scope, key, timeout).await)
    }

    fn lease_timeout(&self) -> Option<Duration> {
        on_backend!(self, store => Store::lease_timeout(store))
    }
}

impl StoreLease for AnyLease {
    fn epoch(&self) -> u64 {
        on_lease!(self, lease => StoreLease::epoch(lease))
    }

    async fn complete(self, response: &[u8]) -> Result<()> {
        on_lease!(self, lease => StoreLease::complete(lease, response).await)
    }

    async fn fail(self, response: &[u8]) -> Result<()> {
        on_lease!(self, lease => StoreLease::fail(lease, response).await)
    }

    async fn release(self) -> Result<()> {
        on_lease!(self, lease => StoreLease::release(lease).await)
    }

    async fn note(&self, note: &[u8]) -> Result<()> {
        on_lease!(self, lease => StoreLease::note(lease, note).await)
    }

    async fn keep_alive(&self) -> Result<()> {
        on_lease!(self, lease => StoreLease::keep_alive(lease).await)
    }
}

/// Runs `work` on the module's runtime and waits for it with the GIL released.
pub(crate) fn blocking<T: Send + 'static>(
    py: Python<'_>,
    work: impl std::future::Future<Output = Result<T>> + Send + 'static,
) -> PyResult<T> {
    let runtime = runtime()?;
    let outcome = py.detach(|| waited(runtime, work));
    outcome.map_err(|(message, kind)| kind.error(message))
}

/// `blocking` without the GIL to release: for a caller that has released it already.
pub(crate) fn waited<T: Send + 'static>(
    runtime: tokio::runtime::Handle,
    work: impl std::future::Future<Output = Result<T>> + Send + 'static,
) -> std::result::Result<T, (String, Kind)> {
    let (sender, answer) = std::sync::mpsc::sync_channel(1);
    runtime.spawn(async move {
        let _ = sender.send(work.await.map_err(|err| carried(&err)));
    });
    answer
        .recv()
        .map_err(|_| ("oncedb's runtime stopped".to_owned(), Kind::Other))?
}

/// The settings every shared store takes from Python.
fn options_of(
    window: &Bound<'_, PyAny>,
    lease_timeout: Option<&Bound<'_, PyAny>>,
    response_timeout: Option<&Bound<'_, PyAny>>,
    max_response_bytes: Option<usize>,
) -> PyResult<oncedb::StoreOptions> {
    let mut options = oncedb::StoreOptions::new(duration_of(window)?);
    if let Some(timeout) = lease_timeout {
        options = options.lease_timeout(duration_of(timeout)?);
    }
    if let Some(timeout) = response_timeout {
        options = options.response_timeout(duration_of(timeout)?);
    }
    if let Some(bytes) = max_response_bytes {
        options = options.max_response_bytes(bytes);
    }
    Ok(options)
}

/// A store several processes share: the methods of `Db`'s reservation API. The process
/// that opened it alone may use it (its connections live on that process's runtime).
#[pyclass(module = "oncedb._oncedb", frozen, subclass)]
pub(crate) struct SharedStore {
    store: Arc<Backend>,
    pid: u32,
}

impl Drop for SharedStore {
    /// In a forked process the store's connections belong to the parent's runtime
    /// thread, which the child lacks: the child's copy is leaked, not closed.
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            std::mem::forget(Arc::clone(&self.store));
        }
    }
}

impl SharedStore {
    fn new(store: Backend) -> SharedStore {
        SharedStore {
            store: Arc::new(store),
            pid: std::process::id(),
        }
    }

    pub(crate) fn handle(&self) -> PyResult<Arc<Backend>> {
        same_process(self.pid)?;
        Ok(self.store.clone())
    }
}

/// Records, keys and ordering marks in PostgreSQL (`oncedb::PostgresStore`).
#[pyclass(module = "oncedb._oncedb", frozen, extends = SharedStore)]
pub(crate) struct PostgresStore;

#[pymethods]
impl PostgresStore {
    /// Connects to the database at `url` and applies the schema migrations it lacks
    /// (under an advisory lock: several workers may start at once).
    #[new]
    #[pyo3(signature = (url, *, window, lease_timeout=None, response_timeout=None, max_response_bytes=None, migrate=true))]
    fn new(
        py: Python<'_>,
        url: String,
        window: &Bound<'_, PyAny>,
        lease_timeout: Option<&Bound<'_, PyAny>>,
        response_timeout: Option<&Bound<'_, PyAny>>,
        max_response_bytes: Option<usize>,
        migrate: bool,
    ) -> PyResult<(PostgresStore, SharedStore)> {
        let options = options_of(window, lease_timeout, response_timeout, max_response_bytes)?;
        let store = blocking(py, async move {
            let store = oncedb::PostgresStore::connect_with(&url, options)?;
            if migrate {
                store.migrate().await?;
            }
            Ok(store)
        })?;
        Ok((PostgresStore, SharedStore::new(Backend::Postgres(store))))
    }
}

/// Keys and records in Redis or a Redis Cluster (`oncedb::RedisStore`).
#[pyclass(module = "oncedb._oncedb", frozen, extends = SharedStore)]
pub(crate) struct RedisStore;

#[pymethods]
impl RedisStore {
    /// Connects to the Redis server at `url` (`redis://host:port`), or to the cluster
    /// whose seed nodes `url` lists; every key name starts with `prefix`.
    #[new]
    #[pyo3(signature = (url, *, window, prefix="oncedb", lease_timeout=None, response_timeout=None, max_response_bytes=None))]
    fn new(
        py: Python<'_>,
        url: &Bound<'_, PyAny>,
        window: &Bound<'_, PyAny>,
        prefix: &str,
        lease_timeout: Option<&Bound<'_, PyAny>>,
        response_timeout: Option<&Bound<'_, PyAny>>,
        max_response_bytes: Option<usize>,
    ) -> PyResult<(RedisStore, SharedStore)> {
        let options = options_of(window, lease_timeout, response_timeout, max_response_bytes)?;
        // One server's URL, or the seed nodes of a cluster.
        let (seeds, cluster) = match url.extract::<String>() {
            Ok(one) => (vec![one], false),
            Err(_) => (url.extract::<Vec<String>>()?, true),
        };
        let prefix = prefix.to_owned();
        let store = blocking(py, async move {
            let seeds: Vec<&str> = seeds.iter().map(String::as_str).collect();
            match (cluster, seeds.first()) {
                (false, Some(url)) => oncedb::RedisStore::connect_with(url, &prefix, options).await,
                _ => oncedb::RedisStore::connect_cluster_with(&seeds, &prefix, options).await,
            }
        })?;
        Ok((RedisStore, SharedStore::new(Backend::Redis(store))))
    }
}

#[pymethods]
impl SharedStore {
    /// Admits `key` unless it is live: `True` if it was new.
    fn insert_if_absent(&self, py: Python<'_>, key: &Bound<'_, PyAny>) -> PyResult<bool> {
        let (store, key) = (self.handle()?, key_of(key)?.into_owned());
        blocking(py, async move { store.insert_if_absent(&key).await })
    }

    /// Admits many keys at once: one answer per key, in order.
    fn insert_many(&self, py: Python<'_>, keys: Vec<Bound<'_, PyAny>>) -> PyResult<Vec<bool>> {
        let store = self.handle()?;
        let keys: Vec<Vec<u8>> = keys
            .iter()
            .map(|key| key_of(key).map(std::borrow::Cow::into_owned))
            .collect::<PyResult<_>>()?;
        blocking(py, async move { store.insert_many(keys).await })
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
    ) -> PyResult<crate::Reservation> {
        let store = self.handle()?;
        let (scope, key) = scoped(tenant, operation, key)?;
        let max = store.max_response_bytes();
        let answer = blocking(
            py,
            async move { store.reserve(&scope, &key, &request).await },
        )?;
        Ok(crate::Reservation::from(answer, max))
    }

    /// Waits until the record of `key` is no longer in flight or `timeout` passes (woken
    /// by PostgreSQL's notification of the ending; Redis is polled): the record as it
    /// then is, or `None`.
    fn wait_finished(
        &self,
        py: Python<'_>,
        tenant: &Bound<'_, PyAny>,
        operation: &Bound<'_, PyAny>,
        key: &Bound<'_, PyAny>,
        timeout: &Bound<'_, PyAny>,
    ) -> PyResult<Option<crate::Reservation>> {
        let store = self.handle()?;
        let ((scope, key), timeout) = (scoped(tenant, operation, key)?, duration_of(timeout)?);
        let record = blocking(py, async move {
            store.wait_finished(&scope, &key, timeout).await
        })?;
        Ok(record.map(|record| crate::Reservation::of_record(&record)))
    }

    /// Takes over the record of `key` if it is in flight: a new lease, the old one
    /// fenced; `None` if there is no record in flight.
    fn take_over(
        &self,
        py: Python<'_>,
        tenant: &Bound<'_, PyAny>,
        operation: &Bound<'_, PyAny>,
        key: &Bound<'_, PyAny>,
    ) -> PyResult<Option<crate::Lease>> {
        let store = self.handle()?;
        let (scope, key) = scoped(tenant, operation, key)?;
        let max = store.max_response_bytes();
        let lease = blocking(py, async move { store.take_over(&scope, &key).await })?;
        Ok(lease.map(|lease| crate::Lease::new(lease, max)))
    }

    /// Records in flight for at least `older_than` seconds, as `Db.in_flight` lists them.
    fn in_flight<'py>(
        &self,
        py: Python<'py>,
        older_than: &Bound<'py, PyAny>,
    ) -> PyResult<Vec<Bound<'py, pyo3::types::PyDict>>> {
        let (store, age) = (self.handle()?, duration_of(older_than)?);
        let records = blocking(py, async move { store.in_flight(age).await })?;
        in_flight_dicts(py, records)
    }

    /// The ordering guard, as `Db.advance` answers it.
    fn advance(
        &self,
        py: Python<'_>,
        tenant: &Bound<'_, PyAny>,
        operation: &Bound<'_, PyAny>,
        aggregate_id: &Bound<'_, PyAny>,
        version: u64,
    ) -> PyResult<(&'static str, Option<u64>)> {
        let store = self.handle()?;
        let (scope, id) = scoped(tenant, operation, aggregate_id)?;
        let answer = blocking(py, async move { store.advance(&scope, &id, version).await })?;
        Ok(advanced(answer))
    }

    /// The lease timeout after which a record in flight is taken over, in seconds, or
    /// `None`.
    #[getter]
    fn lease_timeout(&self) -> PyResult<Option<f64>> {
        Ok(Store::lease_timeout(&*self.handle()?).map(|t| t.as_secs_f64()))
    }
}
