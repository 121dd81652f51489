//! One asynchronous interface to dedup keys and idempotency records, whatever holds them
//! (feature `async`). The embedded [`Db`] implements it here; services written against
//! [`Store`] can move to a shared engine without changing their request path.
//!
//! The embedded implementation never blocks a runtime thread on an fsync: a durable
//! store's write changes memory and appends to the log's buffer on the calling task, then
//! awaits its group commit through a waker, led by the journal's committer thread, so no
//! thread is held per waiting call. A write that would come close to file work it must do
//! inline (a segment roll-over, a sealing check, a lease floor raise), and `take_over`,
//! `advance` and `note`, run on tokio's blocking pool (`spawn_blocking`); calls on an
//! in-memory store, which never touch a file, run inline. `docs/scaling.md` gives the
//! measured cost of each. One exception is the caller's: dropping the last handle of a
//! durable `Db` closes it, which seals the newest segment with an fsync in the dropping
//! thread; drop it off the runtime (`spawn_blocking(move || drop(db))`) where that matters.

mod once;
mod renewals;

#[cfg(feature = "http")]
pub(crate) use once::Held;
mod outage;

pub use outage::{Guarded, GuardedLease, HeldLease, OutagePolicy};

use std::future::Future;
use std::time::Duration;

use crate::api::{
    Advance, Db, InFlight, Lease, LeaseWatch, Once, Options, Record, Reservation, RunOnce, Scope,
};
use crate::base::{DEFAULT_MAX_KEY_BYTES, DEFAULT_MAX_RESPONSE_BYTES, Error, Result};

/// What every shared store is built with: the window, the input limits (the embedded
/// store's defaults, so that every store refuses the same input before writing) and how
/// long to wait for a server.
#[derive(Clone)]
pub struct StoreOptions {
    pub(crate) window: Duration,
    pub(crate) max_key_bytes: usize,
    pub(crate) max_response_bytes: usize,
    pub(crate) connect_timeout: Duration,
    pub(crate) response_timeout: Duration,
    pub(crate) lease_timeout: Option<Duration>,
    pub(crate) naming_secret: Option<u64>,
    pub(crate) tls_roots_pem: Option<Vec<u8>>,
    pub(crate) accept_eviction: bool,
}

/// Every setting but the naming secret, which is a secret: only whether one is set.
impl std::fmt::Debug for StoreOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreOptions")
            .field("window", &self.window)
            .field("max_key_bytes", &self.max_key_bytes)
            .field("max_response_bytes", &self.max_response_bytes)
            .field("connect_timeout", &self.connect_timeout)
            .field("response_timeout", &self.response_timeout)
            .field("lease_timeout", &self.lease_timeout)
            .field("naming_secret_set", &self.naming_secret.is_some())
            .field(
                "tls_roots_pem_bytes",
                &self.tls_roots_pem.as_ref().map(Vec::len),
            )
            .field("accept_eviction", &self.accept_eviction)
            .finish()
    }
}

impl StoreOptions {
    /// Keys remembered for `window`; every other setting at its default.
    pub fn new(window: Duration) -> StoreOptions {
        StoreOptions {
            window,
            max_key_bytes: DEFAULT_MAX_KEY_BYTES,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            connect_timeout: Duration::from_secs(5),
            response_timeout: Duration::from_secs(5),
            lease_timeout: None,
            naming_secret: None,
            tls_roots_pem: None,
            accept_eviction: false,
        }
    }

    /// How long keys are remembered.
    pub fn window(&self) -> Duration {
        self.window
    }

    /// `options` with the settings every store shares taken from these: the window, the
    /// key and response limits and the lease timeout. A service configured once opens
    /// the embedded store or a shared one with the same answers. The bucket width stays
    /// `options`' own and must divide the window.
    pub fn embedded(&self, options: Options) -> Options {
        let options = options
            .window(self.window)
            .max_key_bytes(self.max_key_bytes)
            .max_response_bytes(self.max_response_bytes);
        match self.lease_timeout {
            Some(timeout) => options.lease_timeout(timeout),
            None => options,
        }
    }

    /// Longest key accepted, as [`Options::max_key_bytes`](crate::Options::max_key_bytes).
    /// Default 1 KiB.
    pub fn max_key_bytes(mut self, bytes: usize) -> Self {
        self.max_key_bytes = bytes;
        self
    }

    /// Largest response stored, as
    /// [`Options::max_response_bytes`](crate::Options::max_response_bytes). Default 1 MiB.
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.max_response_bytes = bytes;
        self
    }

    /// How long to wait for a connection to a server. Default 5 s.
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// How long to wait for a server's answer to one call; a call that waits longer
    /// fails with [`Error::Unavailable`]. Default 5 s.
    pub fn response_timeout(mut self, timeout: Duration) -> Self {
        self.response_timeout = timeout;
        self
    }

    /// Takes over records left in flight, as
    /// [`Options::lease_timeout`](crate::Options::lease_timeout) (whose safety note
    /// applies): a reserve that finds the record in flight under a lease granted at least
    /// `timeout` ago acquires it with a higher epoch. The timeout counts from the grant
    /// of the lease (its reservation or take-over; a note does not reset it) on the
    /// server's clock where there is a server (PostgreSQL's `now()`, Redis's `TIME`),
    /// and on the store's [`Clock`](crate::Clock) when embedded, so no client's clock
    /// decides. Off by default.
    pub fn lease_timeout(mut self, timeout: Duration) -> Self {
        self.lease_timeout = Some(timeout);
        self
    }

    /// Redis only: the secret that seeds key names, given by the application instead of
    /// kept in Redis. By default the first store to connect sets a random secret under
    /// `<prefix>:secret` and every later one reads it; a Redis without persistence loses
    /// it in a restart, and then stores connected before and after name keys differently
    /// (each admitting what the other holds). Give every instance the same secret from
    /// configuration (a random value, kept like a password) to rule that out. Ignored by
    /// the other stores.
    pub fn naming_secret(mut self, secret: u64) -> Self {
        self.naming_secret = Some(secret);
        self
    }

    /// The certificate authorities trusted for TLS connections, as PEM (one or more
    /// `CERTIFICATE` blocks), instead of the system's roots: for servers whose
    /// certificates a private authority signed. TLS itself is asked for by the URL
    /// (`sslmode=require` for PostgreSQL, `rediss://` for Redis); every TLS connection
    /// verifies the server's chain and name. Refused with [`Error::InvalidOptions`] at
    /// connect when the PEM holds no certificate. Ignored by the embedded store.
    pub fn tls_root_certificates(mut self, pem: impl Into<Vec<u8>>) -> Self {
        self.tls_roots_pem = Some(pem.into());
        self
    }

    /// Redis only: accept a server whose `maxmemory-policy` evicts keys (anything but
    /// `noeviction`). By default a store refuses such a server at connect with
    /// [`Error::InvalidOptions`]: under memory pressure it evicts dedup keys and records
    /// in flight or finished (`volatile-*` and `allkeys-*` alike, since every key has a
    /// TTL) and the naming secret (`allkeys-*`), and each evicted key lets a duplicate
    /// through. With this set, the store connects and such losses are the caller's
    /// accepted risk. Under `noeviction` a full server refuses writes, answered as
    /// [`Error::Full`]. Ignored by the other stores.
    pub fn accept_eviction(mut self, accept: bool) -> Self {
        self.accept_eviction = accept;
        self
    }

    /// Refuses a key the embedded store would refuse.
    #[cfg(any(feature = "redis", feature = "postgres"))]
    pub(crate) fn check_key(&self, key: &[u8]) -> Result<()> {
        crate::base::check_key(key, self.max_key_bytes)
    }

    /// Refuses a response over the limit.
    #[cfg(any(feature = "redis", feature = "postgres"))]
    pub(crate) fn check_response(&self, response: &[u8]) -> Result<()> {
        if response.len() > self.max_response_bytes {
            return Err(Error::ResponseTooLarge {
                len: response.len(),
                max: self.max_response_bytes,
            });
        }
        Ok(())
    }

    /// Refuses a note over [`MAX_NOTE_BYTES`](crate::MAX_NOTE_BYTES).
    #[cfg(any(feature = "redis", feature = "postgres"))]
    pub(crate) fn check_note(note: &[u8]) -> Result<()> {
        if note.len() > crate::base::MAX_NOTE_BYTES {
            return Err(Error::NoteTooLong { len: note.len() });
        }
        Ok(())
    }
}

/// Marks the first occurrence of each key in `keys`; later ones are duplicates.
pub(crate) fn first_occurrences(keys: &[Vec<u8>]) -> Vec<bool> {
    let mut seen = std::collections::HashSet::with_capacity(keys.len());
    keys.iter().map(|key| seen.insert(key.as_slice())).collect()
}

/// Keys and records behind one asynchronous interface. Every method has the semantics of
/// the [`Db`] method of the same name.
pub trait Store: Send + Sync + 'static {
    /// A lease on one record in flight.
    type Lease: StoreLease;

    /// [`Db::insert_if_absent`].
    fn insert_if_absent(&self, key: &[u8]) -> impl Future<Output = Result<bool>> + Send;

    /// [`Db::insert_many`].
    fn insert_many(&self, keys: Vec<Vec<u8>>) -> impl Future<Output = Result<Vec<bool>>> + Send;

    /// [`Db::reserve`].
    fn reserve(
        &self,
        scope: &Scope,
        key: &[u8],
        request: &[u8],
    ) -> impl Future<Output = Result<Reservation<Self::Lease>>> + Send;

    /// [`Db::get`].
    fn get(&self, scope: &Scope, key: &[u8])
    -> impl Future<Output = Result<Option<Record>>> + Send;

    /// [`Db::in_flight`].
    fn in_flight(&self, older_than: Duration)
    -> impl Future<Output = Result<Vec<InFlight>>> + Send;

    /// [`Db::take_over`].
    fn take_over(
        &self,
        scope: &Scope,
        key: &[u8],
    ) -> impl Future<Output = Result<Option<Self::Lease>>> + Send;

    /// [`Db::resume`]: the lease of `epoch` on the record of `key` in `scope`, for a
    /// worker that kept the epoch across a restart. `Error::Fenced` if a take-over
    /// replaced that epoch, `Error::LeaseLost` if the record is no longer in flight under
    /// it (finished, released, expired, or never this key's).
    fn resume(
        &self,
        scope: &Scope,
        key: &[u8],
        epoch: u64,
    ) -> impl Future<Output = Result<Self::Lease>> + Send;

    /// The largest response a lease of this store accepts: a larger one is refused
    /// with [`Error::ResponseTooLarge`] before anything is written. Callers that buffer
    /// responses (the HTTP layer) read no more than this.
    fn max_response_bytes(&self) -> usize;

    /// [`Db::advance`].
    fn advance(
        &self,
        scope: &Scope,
        aggregate_id: &[u8],
        version: u64,
    ) -> impl Future<Output = Result<Advance>> + Send;

    /// [`Db::wait_finished`]: the record of `key` in `scope` once it is no longer in
    /// flight, or as it is when `timeout` passes. How a store learns of the ending is
    /// its own (`docs/guarantees.md`, "Waiting for an outcome"): the embedded store is
    /// woken by it, PostgreSQL by `LISTEN`/`NOTIFY`, Redis polls at a bounded interval.
    /// Every store also looks again at least every lease timeout. Needs a runtime with
    /// timers (`enable_time`, or `enable_all` as `#[tokio::main]` builds it), for the
    /// deadline.
    fn wait_finished(
        &self,
        scope: &Scope,
        key: &[u8],
        timeout: Duration,
    ) -> impl Future<Output = Result<Option<Record>>> + Send;

    /// [`Db::run_once`] on this store: reserves `key` for `request` in `scope`, runs
    /// `operation` (given a [`LeaseWatch`]: the lease's epoch, and whether the lease was
    /// lost) while a task of its own renews the lease every third of the store's lease
    /// timeout (a failed renewal is retried with back-off while the lease holds), and
    /// completes, releases or fails the record as [`RunOnce`] says; a retry replays,
    /// waits for an attempt in flight, or is told of a mismatch, exactly as on the
    /// embedded store.
    ///
    /// Dropping the future while the operation runs (a timeout, a `select!`, a client
    /// that left) leaves the record in flight with a note, "outcome unknown", and so
    /// does a panic of the operation: no store takes a noted record over automatically,
    /// so the operation never runs twice for it; a reconciler settles it
    /// ([`Store::in_flight`], [`Store::take_over`]). To let the operation run to its end
    /// whatever the caller does, spawn the call (`tokio::spawn`): a dropped `JoinHandle`
    /// does not cancel its task. Under a lease timeout the renewals sleep on the
    /// runtime's timers: build it with timers (`enable_time`, or `enable_all` as
    /// `#[tokio::main]` does).
    fn run_once<F, Fut, E>(
        &self,
        scope: &Scope,
        (key, request): (&[u8], &[u8]),
        how: RunOnce,
        operation: F,
    ) -> impl Future<Output = Result<Once<E>>> + Send
    where
        Self: Sized,
        F: FnOnce(LeaseWatch) -> Fut + Send,
        Fut: Future<Output = std::result::Result<Vec<u8>, E>> + Send,
        E: std::fmt::Display + Send,
    {
        once::run_once(self, scope, (key, request), how, operation)
    }

    /// The lease timeout this store takes records in flight over after, if any: how
    /// often `run_once` renews its lease.
    fn lease_timeout(&self) -> Option<Duration>;
}

/// A lease of a [`Store`]: the semantics of [`Lease`]. A call refused with an input
/// error changes nothing; the caller keeps nothing to retry with but may reserve or take
/// over again.
pub trait StoreLease: Send + Sync + 'static {
    /// [`Lease::epoch`].
    fn epoch(&self) -> u64;
    /// [`Lease::complete`].
    fn complete(self, response: &[u8]) -> impl Future<Output = Result<()>> + Send;
    /// [`Lease::fail`].
    fn fail(self, response: &[u8]) -> impl Future<Output = Result<()>> + Send;
    /// [`Lease::release`].
    fn release(self) -> impl Future<Output = Result<()>> + Send;
    /// [`Lease::note`].
    fn note(&self, note: &[u8]) -> impl Future<Output = Result<()>> + Send;
    /// [`Lease::keep_alive`]: the lease timeout counts from now, on the store's clock.
    fn keep_alive(&self) -> impl Future<Output = Result<()>> + Send;
}

/// Runs `work` on the blocking pool: for a write that may do blocking file work on the
/// way (see [`Db::may_block_on_files`]).
async fn run_blocking<T: Send + 'static>(
    db: &Db,
    work: impl FnOnce(Db) -> Result<T> + Send + 'static,
) -> Result<T> {
    let db = db.clone();
    tokio::task::spawn_blocking(move || work(db))
        .await
        .map_err(|err| Error::Io(std::io::Error::other(err)))?
}

impl Store for Db {
    type Lease = Lease;

    fn max_response_bytes(&self) -> usize {
        Db::max_response_bytes(self)
    }

    async fn insert_if_absent(&self, key: &[u8]) -> Result<bool> {
        if self.may_block_on_files(key.len(), 1, 0) {
            let key = key.to_vec();
            return run_blocking(self, move |db| db.insert_if_absent(&key)).await;
        }
        self.insert_if_absent_committed(key).await
    }

    async fn insert_many(&self, keys: Vec<Vec<u8>>) -> Result<Vec<bool>> {
        if self.may_block_on_files(0, keys.len(), 0) {
            return run_blocking(self, move |db| db.insert_many(&keys)).await;
        }
        self.insert_many_committed(&keys).await
    }

    async fn reserve(
        &self,
        scope: &Scope,
        key: &[u8],
        request: &[u8],
    ) -> Result<Reservation<Lease>> {
        if self.may_block_on_files(key.len() + request.len(), 0, 1) {
            let (scope, key, request) = (scope.clone(), key.to_vec(), request.to_vec());
            return run_blocking(self, move |db| db.reserve(&scope, &key, &request)).await;
        }
        self.reserve_committed(scope, key, request).await
    }

    async fn get(&self, scope: &Scope, key: &[u8]) -> Result<Option<Record>> {
        // A read touches no file; it may wait for the write it shows (under `Sync`).
        self.get_committed(scope, key).await
    }

    async fn in_flight(&self, older_than: Duration) -> Result<Vec<InFlight>> {
        Ok(Db::in_flight(self, older_than))
    }

    async fn take_over(&self, scope: &Scope, key: &[u8]) -> Result<Option<Lease>> {
        if self.may_block_on_files(key.len(), 0, 1) {
            let (scope, key) = (scope.clone(), key.to_vec());
            return run_blocking(self, move |db| db.take_over(&scope, &key)).await;
        }
        self.take_over_committed(scope, key).await
    }

    async fn resume(&self, scope: &Scope, key: &[u8], epoch: u64) -> Result<Lease> {
        // Reads the record in memory; writes nothing.
        Db::resume(self, scope, key, epoch)
    }

    async fn wait_finished(
        &self,
        scope: &Scope,
        key: &[u8],
        timeout: Duration,
    ) -> Result<Option<Record>> {
        self.wait_finished_async(scope, key, timeout).await
    }

    fn lease_timeout(&self) -> Option<Duration> {
        Db::lease_timeout(self)
    }

    async fn advance(&self, scope: &Scope, aggregate_id: &[u8], version: u64) -> Result<Advance> {
        if self.may_block_on_files(aggregate_id.len(), 0, 0) {
            let (scope, aggregate_id) = (scope.clone(), aggregate_id.to_vec());
            return run_blocking(self, move |db| db.advance(&scope, &aggregate_id, version)).await;
        }
        self.advance_committed(scope, aggregate_id, version).await
    }
}

impl StoreLease for Lease {
    fn epoch(&self) -> u64 {
        Lease::epoch(self)
    }

    async fn complete(self, response: &[u8]) -> Result<()> {
        if self.may_block_on_files(response.len()) {
            let response = response.to_vec();
            return self
                .finish(move |lease| lease.complete(&response).map_err(Error::from))
                .await;
        }
        self.complete_committed(response).await
    }

    async fn fail(self, response: &[u8]) -> Result<()> {
        if self.may_block_on_files(response.len()) {
            let response = response.to_vec();
            return self
                .finish(move |lease| lease.fail(&response).map_err(Error::from))
                .await;
        }
        self.fail_committed(response).await
    }

    async fn release(self) -> Result<()> {
        if self.may_block_on_files(0) {
            return self
                .finish(move |lease| lease.release().map_err(Error::from))
                .await;
        }
        self.release_committed().await
    }

    async fn note(&self, note: &[u8]) -> Result<()> {
        if self.may_block_on_files(note.len()) {
            let (lease, note) = (self.handle(), note.to_vec());
            return tokio::task::spawn_blocking(move || lease.note(&note))
                .await
                .map_err(|err| Error::Io(std::io::Error::other(err)))?;
        }
        self.note_committed(note).await
    }

    async fn keep_alive(&self) -> Result<()> {
        if self.may_block_on_files(0) {
            let lease = self.handle();
            return tokio::task::spawn_blocking(move || lease.keep_alive())
                .await
                .map_err(|err| Error::Io(std::io::Error::other(err)))?;
        }
        self.keep_alive_committed().await
    }
}

impl Lease {
    /// Ends the lease on the blocking pool if its store may touch files, else inline.
    async fn finish(self, end: impl FnOnce(Lease) -> Result<()> + Send + 'static) -> Result<()> {
        if !self.engine.is_durable() {
            return end(self);
        }
        tokio::task::spawn_blocking(move || end(self))
            .await
            .map_err(|err| Error::Io(std::io::Error::other(err)))?
    }
}
