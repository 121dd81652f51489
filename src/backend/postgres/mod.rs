//! [`Store`] on PostgreSQL (feature `postgres`), for records that must commit with the
//! business update, and the transactional inbox and outbox.
//!
//! - Reservations are `INSERT ... ON CONFLICT DO UPDATE ... WHERE expires_at <= now()`:
//!   a live row is never touched (`ON CONFLICT DO NOTHING`), an expired one is
//!   replaced in the same statement, so exactly one of any number of racing inserts wins.
//! - Time is the server's (`now()`), one clock for every service instance.
//! - Fencing epochs come from one sequence, so a later lease always has a larger epoch.
//! - Expired rows are deleted by [`PostgresStore::purge_expired`] in batches of bounded
//!   size; readers ignore them before that.
//! - Schema changes are shipped in the crate and applied only by
//!   [`PostgresStore::migrate`].
//!
//! [`inbox`] and [`outbox`] take the caller's open transaction; [`outbox::Relay`]
//! publishes committed outbox rows.

pub mod inbox;
#[cfg(feature = "nats")]
pub mod jetstream;
mod listen;
mod migrations;
pub mod outbox;
mod sql;

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod};
use tokio_postgres::NoTls;
use tokio_postgres::config::SslMode;
use tokio_postgres::types::ToSql;
use tokio_postgres_rustls::MakeRustlsConnect;

use super::{refused, tls, unavailable};
use crate::api::{Advance, InFlight, Record, RecordStatus, Reservation, Scope};
use crate::base::{Error, Result, duration_to_ms, system_time_to_ms};
use crate::store::{Store, StoreLease, StoreOptions, first_occurrences};

/// The pool crate this module uses, for building a [`Pool`] by hand.
pub use deadpool_postgres;
pub use migrations::MIGRATIONS;
/// The driver this module uses: [`inbox`] and [`outbox`] take its `Transaction`.
pub use tokio_postgres;

/// Highest version the PostgreSQL ordering guard accepts (`bigint`, with room for `+ 1`).
pub const MAX_POSTGRES_VERSION: u64 = (i64::MAX - 1) as u64;

/// Most keys one `insert_many` statement carries; longer batches are split.
const MAX_KEYS_PER_STATEMENT: usize = 4096;

/// A PostgreSQL error met while running a statement, as an oncedb error, by its kind
/// ([`classify`]); what is none of the known kinds is [`Error::Backend`].
pub(crate) fn pg_error(err: tokio_postgres::Error) -> Error {
    classify(err, refused)
}

/// A PostgreSQL error met while opening a connection. Besides what [`pg_error`] tells
/// apart, an error that is neither the server's word nor a socket failure is the driver
/// refusing the server (TLS declined under `sslmode=require`, an authentication
/// exchange it could not complete): [`Error::Authentication`].
fn connect_error(err: tokio_postgres::Error) -> Error {
    classify(err, |engine, message| {
        super::unauthenticated(engine, message)
    })
}

/// The server's word by its SQLSTATE ([`server_error`]); a TLS failure anywhere in the
/// chain (an untrusted certificate, a failed handshake, a tampered record) is
/// [`Error::Authentication`], never an outage; a broken connection is
/// [`Error::Unavailable`]; anything else goes to `otherwise`.
fn classify(err: tokio_postgres::Error, otherwise: fn(&'static str, String) -> Error) -> Error {
    if let Some(db) = err.as_db_error() {
        return server_error(db);
    }
    if tls::is_tls_failure(&err) {
        return super::unauthenticated(ENGINE, describe(&err));
    }
    if is_lost_connection(&err) {
        return unavailable(ENGINE, describe(&err));
    }
    otherwise(ENGINE, describe(&err))
}

/// What the server said, by its SQLSTATE class: an outage ([`is_outage`]) is
/// [`Error::Unavailable`]; a statement cancelled by its timeout or a lock wait that gave
/// up is [`Error::TimedOut`]; a refused login (class 28) is [`Error::Authentication`];
/// anything else [`Error::Backend`].
fn server_error(db: &tokio_postgres::error::DbError) -> Error {
    use tokio_postgres::error::SqlState;
    let message = format!("{} ({})", db.message(), db.code().code());
    let code = db.code();
    if is_outage(code) {
        unavailable(ENGINE, message)
    } else if *code == SqlState::QUERY_CANCELED || *code == SqlState::LOCK_NOT_AVAILABLE {
        super::timed_out(ENGINE, message)
    } else if code.code().starts_with("28") {
        super::unauthenticated(ENGINE, message)
    } else {
        refused(ENGINE, message)
    }
}

/// Whether the connection broke: the driver found it closed, or a socket call failed
/// (refused, reset, timed out).
fn is_lost_connection(err: &tokio_postgres::Error) -> bool {
    if err.is_closed() {
        return true;
    }
    let mut next: Option<&(dyn std::error::Error + 'static)> = std::error::Error::source(err);
    // A chain longer than this is not one the driver builds; stop rather than loop.
    for _ in 0..16 {
        let Some(cause) = next else {
            return false;
        };
        if cause.is::<std::io::Error>() {
            return true;
        }
        next = cause.source();
    }
    false
}

fn describe(err: &tokio_postgres::Error) -> String {
    match std::error::Error::source(err) {
        Some(source) => format!("{err}: {source}"),
        None => err.to_string(),
    }
}

/// The engine named in this store's errors.
const ENGINE: &str = "postgres";

/// Conditions the server reports while it cannot serve, which an
/// [`OutagePolicy`](crate::OutagePolicy) acts on: a connection exception (class 08), a
/// server shutting down or starting (57P01, 57P02, 57P03), too many connections (53300)
/// and a read-only standby (25006). A statement cancelled by its timeout (57014) is not
/// one: it waited behind another caller's lock as often as on a slow server.
fn is_outage(code: &tokio_postgres::error::SqlState) -> bool {
    use tokio_postgres::error::SqlState;
    code.code().starts_with("08")
        || [
            SqlState::ADMIN_SHUTDOWN,
            SqlState::CRASH_SHUTDOWN,
            SqlState::CANNOT_CONNECT_NOW,
            SqlState::TOO_MANY_CONNECTIONS,
            SqlState::READ_ONLY_SQL_TRANSACTION,
        ]
        .contains(code)
}

/// Where a statement runs: a pooled connection (statements cached per connection), or
/// the caller's transaction, for reservations that commit with the business update.
trait Runner: Sync {
    /// Runs `sql`; at most one row.
    fn opt(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> impl std::future::Future<Output = Result<Option<tokio_postgres::Row>>> + Send;

    /// Runs `sql`; the rows it changed.
    fn exec(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> impl std::future::Future<Output = Result<u64>> + Send;
}

impl Runner for Object {
    async fn opt(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<tokio_postgres::Row>> {
        query_opt(self, sql, params).await
    }

    async fn exec(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<u64> {
        let statement = prepare(self, sql).await?;
        self.execute(&statement, params).await.map_err(pg_error)
    }
}

impl Runner for tokio_postgres::Transaction<'_> {
    async fn opt(
        &self,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Option<tokio_postgres::Row>> {
        self.query_opt(sql, params).await.map_err(pg_error)
    }

    async fn exec(&self, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<u64> {
        self.execute(sql, params).await.map_err(pg_error)
    }
}

/// The cached statement for `sql` on `client`: every call prepares once per connection.
async fn prepare(client: &Object, sql: &str) -> Result<tokio_postgres::Statement> {
    client.prepare_cached(sql).await.map_err(pg_error)
}

/// Runs cached statement `sql`; at most one row.
async fn query_opt(
    client: &Object,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Option<tokio_postgres::Row>> {
    let statement = prepare(client, sql).await?;
    client.query_opt(&statement, params).await.map_err(pg_error)
}

/// Runs cached statement `sql`; every row.
async fn query(
    client: &Object,
    sql: &str,
    params: &[&(dyn ToSql + Sync)],
) -> Result<Vec<tokio_postgres::Row>> {
    let statement = prepare(client, sql).await?;
    client.query(&statement, params).await.map_err(pg_error)
}

/// Column `index` (a name or a position) of `row`.
fn column<'a, T: tokio_postgres::types::FromSql<'a>>(
    row: &'a tokio_postgres::Row,
    index: impl tokio_postgres::row::RowIndex + std::fmt::Display,
) -> Result<T> {
    row.try_get(index).map_err(pg_error)
}

/// A pool's error: its backend errors are connection errors ([`connect_error`]).
fn pool_error(err: PoolError) -> Error {
    match err {
        PoolError::Backend(err) => connect_error(err),
        other => unavailable(ENGINE, other.to_string()),
    }
}

fn unexpected(what: &str) -> Error {
    super::unexpected(ENGINE, what)
}

/// A `bigint` read from the server as an epoch or version (never negative in a sound
/// schema).
fn unsigned(value: i64, what: &str) -> Result<u64> {
    u64::try_from(value).map_err(|_| unexpected(what))
}

fn signed(value: u64, what: &str) -> Result<i64> {
    i64::try_from(value)
        .map_err(|_| Error::InvalidOptions(format!("{what} {value} exceeds 2^63-1")))
}

fn request_hash(request: &[u8]) -> String {
    format!("{:032x}", xxhash_rust::xxh3::xxh3_128(request))
}

/// Keys, records and ordering marks in PostgreSQL, through a connection pool.
#[derive(Clone)]
pub struct PostgresStore {
    pool: Pool,
    window_ms: i64,
    options: StoreOptions,
    /// Wakes the waiters for an outcome.
    listener: std::sync::Arc<listen::Listener>,
}

impl std::fmt::Debug for PostgresStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PostgresStore")
            .field("window_ms", &self.window_ms)
            .field("pool", &self.pool.status())
            .finish_non_exhaustive()
    }
}

impl PostgresStore {
    /// A store on the database at `url` (`postgres://user@host:port/db` or a key=value
    /// string) with a pool of at most 16 connections, records remembered for `window`.
    /// Nothing is sent until the first call; run [`migrate`](Self::migrate) once first.
    pub fn connect(url: &str, window: Duration) -> Result<PostgresStore> {
        PostgresStore::connect_with(url, StoreOptions::new(window))
    }

    /// A store on the database at `url` with `options`. The response timeout bounds
    /// every statement on the server (`statement_timeout`), the wait for a pooled
    /// connection, and a dead TCP connection (`tcp_user_timeout` and keepalives), so no
    /// call hangs for longer than a few timeouts; the connect timeout bounds each new
    /// connection. A statement the server cancels at the timeout (it waited behind
    /// another transaction's lock, or ran too long) is [`Error::TimedOut`], not an
    /// outage.
    ///
    /// TLS: `sslmode=require` verifies the server's chain and name (the roots of
    /// [`StoreOptions::tls_root_certificates`], or the system's); `sslmode=disable`, or
    /// no `sslmode` at all, speaks plain text; `sslmode=prefer` is refused with
    /// [`Error::InvalidOptions`], since it falls back to plain text.
    pub fn connect_with(url: &str, options: StoreOptions) -> Result<PostgresStore> {
        let mut config: tokio_postgres::Config = url.parse().map_err(|err| {
            Error::InvalidOptions(format!("bad PostgreSQL connection string: {err}"))
        })?;
        let timeout_ms = duration_to_ms(options.response_timeout).max(1);
        config
            .connect_timeout(options.connect_timeout)
            .tcp_user_timeout(options.response_timeout)
            .keepalives_idle(Duration::from_secs(10))
            .keepalives_interval(Duration::from_secs(2))
            .keepalives_retries(3)
            .options(format!("-c statement_timeout={timeout_ms}"));
        let manager_config = ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        };
        let (manager, connector) = match tls_mode(url, &config)? {
            SslMode::Disable => (
                Manager::from_config(config.clone(), NoTls, manager_config),
                listen::connector(config, NoTls),
            ),
            // `require`: rustls, verifying the server's chain and name.
            _ => {
                let tls =
                    MakeRustlsConnect::new(tls::client_config(options.tls_roots_pem.as_deref())?);
                (
                    Manager::from_config(config.clone(), tls.clone(), manager_config),
                    listen::connector(config, tls),
                )
            }
        };
        let pool = Pool::builder(manager)
            .max_size(16)
            .runtime(deadpool_postgres::Runtime::Tokio1)
            .wait_timeout(Some(options.response_timeout))
            .create_timeout(Some(options.connect_timeout))
            .recycle_timeout(Some(options.response_timeout))
            .build()
            .map_err(|err| Error::InvalidOptions(format!("connection pool: {err}")))?;
        let mut store = PostgresStore::from_pool_with(pool, options)?;
        store.listener = std::sync::Arc::new(listen::Listener::new(Some(connector)));
        Ok(store)
    }

    /// A store on an existing pool (for TLS, pool sizing or shared pools). The pool's
    /// own TLS settings apply: its `sslmode` is not checked here. Such a store has no
    /// connection to listen for endings on: its waits for an outcome
    /// ([`Store::wait_finished`]) poll the record every 50 ms.
    pub fn from_pool(pool: Pool, window: Duration) -> Result<PostgresStore> {
        PostgresStore::from_pool_with(pool, StoreOptions::new(window))
    }

    /// A store on an existing pool with `options` (its limits; the pool's own settings
    /// govern connections and timeouts).
    pub fn from_pool_with(pool: Pool, options: StoreOptions) -> Result<PostgresStore> {
        let window_ms = i64::try_from(duration_to_ms(options.window).max(1))
            .map_err(|_| Error::InvalidOptions("window too long".to_owned()))?;
        Ok(PostgresStore {
            pool,
            window_ms,
            options,
            listener: std::sync::Arc::new(listen::Listener::new(None)),
        })
    }

    /// The connection pool, for the caller's own transactions (inbox and outbox).
    pub fn pool(&self) -> &Pool {
        &self.pool
    }

    /// Applies the schema migrations this version ships that the database lacks, in one
    /// transaction under an advisory lock, without the response timeout (a migration may
    /// rewrite whole tables: migration 4 rewrites `idempotency_records`, `dedup_keys`
    /// and `ordering_marks` under an exclusive lock, so run it when those tables are
    /// small or the service is quiet). Returns how many it applied.
    pub async fn migrate(&self) -> Result<usize> {
        let mut client = self.client().await?;
        migrations::apply(&mut client).await
    }

    /// Deletes expired rows (records, keys, ordering marks) and outbox rows published and
    /// inbox rows processed more than `retention` ago, at most `batch` rows per statement,
    /// so no statement holds locks for long. A purge never waits on a row lock: rows that
    /// a writer holds (a reservation, a batch, a transaction of the caller's) are left
    /// for the next purge, so it cannot deadlock with a batch, and a row re-admitted
    /// while the purge runs is never deleted. Returns how many rows it deleted.
    pub async fn purge_expired(&self, batch: usize, retention: Duration) -> Result<u64> {
        let batch = i64::try_from(batch.clamp(1, 100_000)).unwrap_or(1000);
        let retention_ms = i64::try_from(duration_to_ms(retention)).unwrap_or(i64::MAX);
        let client = self.client().await?;
        let mut deleted = 0;
        for statement in sql::PURGE_EXPIRED {
            deleted += purge_all(&client, statement, batch, &[&batch]).await?;
        }
        for statement in sql::PURGE_RETAINED {
            deleted += purge_all(&client, statement, batch, &[&batch, &retention_ms]).await?;
        }
        Ok(deleted)
    }

    /// One look at the record of `key`, and a sleep until `signal` (the ending's
    /// notification) or a time to look again: `Some` answer if the record is no longer
    /// in flight or the deadline passed, `None` to look again.
    async fn wait_once(
        &self,
        scope: &Scope,
        key: &[u8],
        signal: Option<&tokio::sync::Notify>,
        deadline: tokio::time::Instant,
    ) -> Option<Result<Option<Record>>> {
        let woken = signal.map(tokio::sync::Notify::notified);
        let mut woken = std::pin::pin!(woken);
        if let Some(woken) = woken.as_mut().as_pin_mut() {
            woken.enable();
        }
        let record = self.get(scope, key).await;
        let now = tokio::time::Instant::now();
        let in_flight = matches!(&record, Ok(Some(r)) if r.status() == RecordStatus::InFlight);
        if !in_flight || now >= deadline {
            return Some(record);
        }
        let left = match self.lease_left(scope, key).await {
            Ok(left) => left,
            Err(err) => return Some(Err(err)),
        };
        // A lapsed lease answers at once: the caller may take the record over now.
        if left.is_some_and(|left| left.is_zero()) {
            return Some(record);
        }
        // Woken by NOTIFY, and looking again when the holder's lease runs out and at
        // least every second: NOTIFY alone may miss an ending (a pooler in transaction
        // mode, a wait registered while the listener closes).
        let look_again = match (signal, left) {
            (None, _) => listen::POLL_WITHOUT_LISTENER,
            (Some(_), Some(left)) => left.min(listen::LOOK_AGAIN_WHILE_LISTENING),
            (Some(_), None) => listen::LOOK_AGAIN_WHILE_LISTENING,
        };
        let wake = deadline.min(now + look_again);
        match woken.as_mut().as_pin_mut() {
            Some(woken) => {
                let _ = tokio::time::timeout_at(wake, woken).await;
            }
            None => tokio::time::sleep_until(wake).await,
        }
        None
    }

    /// How long the lease holding the record of `key` in flight has left before a
    /// reserve may take it over, by the server's clock: `None` without a lease timeout,
    /// for a noted record, or a record not in flight.
    async fn lease_left(&self, scope: &Scope, key: &[u8]) -> Result<Option<Duration>> {
        let Some(timeout) = self.options.lease_timeout else {
            return Ok(None);
        };
        let client = self.client().await?;
        let row = client
            .opt(sql::LEASE_AGE, &[&scope.tenant(), &scope.operation(), &key])
            .await?;
        let Some(row) = row else {
            return Ok(None);
        };
        let (age_ms, noted): (Option<i64>, bool) = (row.get(0), row.get(1));
        if noted {
            return Ok(None);
        }
        let age_ms = u64::try_from(age_ms.unwrap_or(0)).unwrap_or(0);
        let timeout_ms = crate::base::duration_to_ms(timeout).max(1);
        Ok(Some(Duration::from_millis(
            timeout_ms.saturating_sub(age_ms),
        )))
    }

    async fn client(&self) -> Result<Object> {
        self.pool.get().await.map_err(pool_error)
    }

    fn record_params(&self, scope: &Scope, key: &[u8]) -> Result<()> {
        self.options.check_key(key)?;
        // Checks the scope's part lengths as every other store does.
        scope.encode_key(key).map(drop)
    }

    /// Reads the live record, or `None` when it is absent or expired.
    async fn live(&self, client: &impl Runner, scope: &Scope, key: &[u8]) -> Result<Option<Row>> {
        let row = client
            .opt(sql::GET, &[&scope.tenant(), &scope.operation(), &key])
            .await?;
        row.map(|row| Row::read(&row)).transpose()
    }

    /// The reservation of [`Store::reserve`], run on `client`.
    async fn reserve_on(
        &self,
        client: &impl Runner,
        scope: &Scope,
        key: &[u8],
        request: &[u8],
    ) -> Result<Reservation<PostgresLease>> {
        self.record_params(scope, key)?;
        let hash = request_hash(request);
        // A row seen conflicting may be released or expire before it is read: try again.
        loop {
            let params: [&(dyn ToSql + Sync); 5] = [
                &scope.tenant(),
                &scope.operation(),
                &key,
                &hash,
                &self.window_ms,
            ];
            if let Some(row) = client.opt(sql::RESERVE, &params).await? {
                return Ok(Reservation::Acquired(self.lease(scope, key, &row)?));
            }
            let Some(row) = self.live(client, scope, key).await? else {
                continue;
            };
            if row.request_hash != hash {
                return Ok(Reservation::Mismatch);
            }
            if row.status == RecordStatus::InFlight
                && let Some(lease) = self.take_over_stuck(client, scope, key, &hash).await?
            {
                return Ok(Reservation::Acquired(lease));
            }
            return Ok(match row.status {
                RecordStatus::InFlight => Reservation::InFlight {
                    since: row.created,
                    note: row.note,
                },
                RecordStatus::Completed => Reservation::Completed(row.record()),
                RecordStatus::Failed => Reservation::Failed(row.record()),
            });
        }
    }

    /// With a lease timeout: takes over the record of `key` if it has been in flight
    /// under one lease (without a note) for that long.
    async fn take_over_stuck(
        &self,
        client: &impl Runner,
        scope: &Scope,
        key: &[u8],
        hash: &str,
    ) -> Result<Option<PostgresLease>> {
        let Some(timeout) = self.options.lease_timeout else {
            return Ok(None);
        };
        let timeout_ms = i64::try_from(duration_to_ms(timeout).max(1)).unwrap_or(i64::MAX);
        let params: [&(dyn ToSql + Sync); 5] = [
            &scope.tenant(),
            &scope.operation(),
            &key,
            &hash,
            &timeout_ms,
        ];
        let row = client.opt(sql::TAKE_OVER_STUCK, &params).await?;
        row.map(|row| self.lease(scope, key, &row)).transpose()
    }

    /// [`Store::reserve`] inside the caller's transaction `tx`, so that the record
    /// commits (or rolls back) with the business update, as the inbox does: a crash or a
    /// rollback before the commit leaves neither. The new row stays locked until `tx`
    /// ends, so a racing reservation of the same key waits for it, then sees the record
    /// (after a commit) or acquires (after a rollback). Finish the lease in the same
    /// transaction with [`PostgresLease::complete_in`] (or `fail_in`, `release_in`).
    pub async fn reserve_in(
        &self,
        tx: &tokio_postgres::Transaction<'_>,
        scope: &Scope,
        key: &[u8],
        request: &[u8],
    ) -> Result<Reservation<PostgresLease>> {
        self.reserve_on(tx, scope, key, request).await
    }
}

/// The TLS mode of connection string `url`: `sslmode=require` (verified TLS or no
/// connection) or `disable` (plain text), which is also what a string that names no
/// `sslmode` gets. `sslmode=prefer` is refused: it falls back to plain text when the
/// server (or anyone in between) answers that it speaks no TLS.
fn tls_mode(url: &str, config: &tokio_postgres::Config) -> Result<SslMode> {
    // The driver's default is `prefer`; only a string that names a mode gets one.
    if !url.contains("sslmode") {
        return Ok(SslMode::Disable);
    }
    match config.get_ssl_mode() {
        SslMode::Disable => Ok(SslMode::Disable),
        SslMode::Require => Ok(SslMode::Require),
        _ => Err(Error::InvalidOptions(
            "sslmode=prefer falls back to plain text when the server declines TLS: \
             use sslmode=require (verified TLS) or sslmode=disable"
                .to_owned(),
        )),
    }
}

/// Runs a `DELETE` of at most `batch` rows until it deletes fewer than that.
async fn purge_all(
    client: &Object,
    statement: &str,
    batch: i64,
    params: &[&(dyn ToSql + Sync)],
) -> Result<u64> {
    let statement = prepare(client, statement).await?;
    let batch = u64::try_from(batch).unwrap_or(1);
    let mut total = 0;
    loop {
        let deleted = client.execute(&statement, params).await.map_err(pg_error)?;
        total += deleted;
        if deleted < batch {
            return Ok(total);
        }
    }
}

/// One `idempotency_records` row as the API sees it.
struct Row {
    request_hash: String,
    status: RecordStatus,
    response: Option<Vec<u8>>,
    created: SystemTime,
    finished: Option<SystemTime>,
    /// What the lease holder noted while in flight.
    note: Option<Vec<u8>>,
}

impl Row {
    fn read(row: &tokio_postgres::Row) -> Result<Row> {
        let status: String = column(row, "status")?;
        Ok(Row {
            request_hash: column(row, "request_hash")?,
            status: parse_status(&status)?,
            response: column(row, "response_body")?,
            created: column(row, "created_at")?,
            finished: column(row, "finished_at")?,
            note: column(row, "note")?,
        })
    }

    fn record(self) -> Record {
        Record {
            logged: None,
            key_logged: None,
            status: self.status,
            response: self.response.map(Into::into),
            created_ms: system_time_to_ms(self.created),
            finished_ms: self.finished.map(system_time_to_ms),
        }
    }
}

fn parse_status(status: &str) -> Result<RecordStatus> {
    match status {
        "processing" => Ok(RecordStatus::InFlight),
        "completed" => Ok(RecordStatus::Completed),
        "failed" => Ok(RecordStatus::Failed),
        _ => Err(unexpected("idempotency_records.status")),
    }
}

impl Store for PostgresStore {
    type Lease = PostgresLease;

    fn lease_timeout(&self) -> Option<Duration> {
        self.options.lease_timeout
    }

    /// Woken by the ending's `NOTIFY` (see `listen.rs`); looks again at least every
    /// lease timeout, and every 50 ms while no connection listens.
    async fn wait_finished(
        &self,
        scope: &Scope,
        key: &[u8],
        timeout: Duration,
    ) -> Result<Option<Record>> {
        self.record_params(scope, key)?;
        let topic = listen::topic(scope, key)?;
        let deadline = tokio::time::Instant::from_std(crate::base::deadline_after(timeout));
        loop {
            let signal = self.listener.watch(&topic).await;
            let ended = self
                .wait_once(scope, key, signal.as_deref(), deadline)
                .await;
            self.listener.forget(signal);
            if let Some(record) = ended {
                return record;
            }
        }
    }

    fn max_response_bytes(&self) -> usize {
        self.options.max_response_bytes
    }

    async fn insert_if_absent(&self, key: &[u8]) -> Result<bool> {
        self.options.check_key(key)?;
        let client = self.client().await?;
        let row = query_opt(&client, sql::INSERT_KEY, &[&key, &self.window_ms]).await?;
        Ok(row.is_some())
    }

    async fn insert_many(&self, keys: Vec<Vec<u8>>) -> Result<Vec<bool>> {
        for key in &keys {
            self.options.check_key(key)?;
        }
        let mut answers = first_occurrences(&keys);
        // Sorted, so concurrent batches lock rows in one order and never deadlock.
        let mut distinct: Vec<&[u8]> = keys
            .iter()
            .zip(&answers)
            .filter(|(_, first)| **first)
            .map(|(key, _)| key.as_slice())
            .collect();
        distinct.sort_unstable();
        // One transaction: a batch is admitted whole or not at all, as in the embedded
        // store, however many statements its chunks take.
        let mut client = self.client().await?;
        let tx = client.transaction().await.map_err(pg_error)?;
        let statement = tx
            .prepare_cached(sql::INSERT_KEYS)
            .await
            .map_err(pg_error)?;
        let mut admitted: HashSet<Vec<u8>> = HashSet::with_capacity(distinct.len());
        for chunk in distinct.chunks(MAX_KEYS_PER_STATEMENT) {
            let rows = tx
                .query(&statement, &[&chunk, &self.window_ms])
                .await
                .map_err(pg_error)?;
            for row in rows {
                admitted.insert(column(&row, 0)?);
            }
        }
        tx.commit().await.map_err(pg_error)?;
        for (answer, key) in answers.iter_mut().zip(&keys) {
            *answer = *answer && admitted.contains(key);
        }
        Ok(answers)
    }

    async fn reserve(
        &self,
        scope: &Scope,
        key: &[u8],
        request: &[u8],
    ) -> Result<Reservation<PostgresLease>> {
        let client = self.client().await?;
        self.reserve_on(&client, scope, key, request).await
    }

    async fn get(&self, scope: &Scope, key: &[u8]) -> Result<Option<Record>> {
        self.record_params(scope, key)?;
        let client = self.client().await?;
        Ok(self.live(&client, scope, key).await?.map(Row::record))
    }

    async fn in_flight(&self, older_than: Duration) -> Result<Vec<InFlight>> {
        let older_than_ms = i64::try_from(duration_to_ms(older_than)).unwrap_or(i64::MAX);
        let client = self.client().await?;
        let rows = query(&client, sql::IN_FLIGHT, &[&older_than_ms]).await?;
        rows.iter()
            .map(|row| {
                let tenant: Vec<u8> = column(row, "tenant_id")?;
                let operation: Vec<u8> = column(row, "operation")?;
                Ok(InFlight {
                    scope: Scope::new(tenant, operation),
                    key: column(row, "idempotency_key")?,
                    since: column(row, "created_at")?,
                    epoch: unsigned(column(row, "epoch")?, "epoch")?,
                    note: column(row, "note")?,
                })
            })
            .collect()
    }

    async fn take_over(&self, scope: &Scope, key: &[u8]) -> Result<Option<PostgresLease>> {
        self.record_params(scope, key)?;
        let client = self.client().await?;
        let row = query_opt(
            &client,
            sql::TAKE_OVER,
            &[&scope.tenant(), &scope.operation(), &key],
        )
        .await?;
        row.map(|row| self.lease(scope, key, &row)).transpose()
    }

    async fn advance(&self, scope: &Scope, aggregate_id: &[u8], version: u64) -> Result<Advance> {
        self.record_params(scope, aggregate_id)?;
        if version > MAX_POSTGRES_VERSION {
            return Err(Error::InvalidOptions(format!(
                "version {version} exceeds {MAX_POSTGRES_VERSION}, the most the PostgreSQL ordering guard holds"
            )));
        }
        let signed_version = signed(version, "version")?;
        let client = self.client().await?;
        let apply = prepare(&client, sql::ADVANCE).await?;
        let read = prepare(&client, sql::MARK).await?;
        let ids: [&(dyn ToSql + Sync); 3] = [&scope.tenant(), &scope.operation(), &aggregate_id];
        loop {
            let applied = client
                .query_opt(
                    &apply,
                    &[ids[0], ids[1], ids[2], &signed_version, &self.window_ms],
                )
                .await
                .map_err(pg_error)?;
            if applied.is_some() {
                return Ok(Advance::Applied);
            }
            let Some(row) = client.query_opt(&read, &ids).await.map_err(pg_error)? else {
                continue;
            };
            let current = unsigned(column(&row, 0)?, "version")?;
            match version.cmp(&current) {
                std::cmp::Ordering::Equal => return Ok(Advance::Duplicate),
                std::cmp::Ordering::Less => return Ok(Advance::Stale { current }),
                std::cmp::Ordering::Greater if version > current + 1 => {
                    return Ok(Advance::Gap {
                        expected: current + 1,
                    });
                }
                // The mark moved between the two statements: try again.
                std::cmp::Ordering::Greater => continue,
            }
        }
    }

    async fn resume(&self, scope: &Scope, key: &[u8], epoch: u64) -> Result<PostgresLease> {
        self.record_params(scope, key)?;
        let client = self.client().await?;
        let row = query_opt(
            &client,
            sql::LEASE_STATE,
            &[&scope.tenant(), &scope.operation(), &key],
        )
        .await?;
        let lease = PostgresLease {
            store: self.clone(),
            scope: scope.clone(),
            key: key.to_vec(),
            epoch,
            since: SystemTime::UNIX_EPOCH,
        };
        let Some(row) = row else {
            return Err(Error::LeaseLost);
        };
        match ownership(&row, epoch)? {
            Ownership::Owned => Ok(PostgresLease {
                since: column(&row, "created_at")?,
                ..lease
            }),
            Ownership::Fenced => Err(Error::Fenced),
            Ownership::Lost => Err(Error::LeaseLost),
        }
    }
}

impl PostgresStore {
    fn lease(&self, scope: &Scope, key: &[u8], row: &tokio_postgres::Row) -> Result<PostgresLease> {
        Ok(PostgresLease {
            store: self.clone(),
            scope: scope.clone(),
            key: key.to_vec(),
            epoch: unsigned(column(row, "epoch")?, "epoch")?,
            since: column(row, "created_at")?,
        })
    }
}

enum Ownership {
    Owned,
    Fenced,
    Lost,
}

/// Whether lease `epoch` owns the record in `row` (status, epoch, taken_epochs): exactly the epochs take-overs replaced are fenced.
fn ownership(row: &tokio_postgres::Row, epoch: u64) -> Result<Ownership> {
    let status: String = column(row, "status")?;
    let current = unsigned(column(row, "epoch")?, "epoch")?;
    let taken: Vec<i64> = column(row, "taken_epochs")?;
    Ok(if status == "processing" && current == epoch {
        Ownership::Owned
    } else if taken.iter().any(|&taken| u64::try_from(taken) == Ok(epoch)) {
        Ownership::Fenced
    } else {
        Ownership::Lost
    })
}

/// A lease on a record in PostgreSQL: its key and fencing epoch.
#[derive(Debug, Clone)]
pub struct PostgresLease {
    store: PostgresStore,
    scope: Scope,
    key: Vec<u8>,
    epoch: u64,
    since: SystemTime,
}

impl PostgresLease {
    /// When the record was reserved.
    pub fn since(&self) -> SystemTime {
        self.since
    }

    /// Runs `statement` (which changes the record only while this lease owns it) with
    /// the record's key, this lease's epoch and `extra`, on a pooled connection or in
    /// the caller's transaction; explains a refusal.
    async fn call_on(
        &self,
        client: &impl Runner,
        statement: &str,
        extra: &[&(dyn ToSql + Sync)],
    ) -> Result<()> {
        let epoch = signed(self.epoch, "epoch")?;
        let (tenant, operation) = (self.scope.tenant(), self.scope.operation());
        let mut params: Vec<&(dyn ToSql + Sync)> = vec![&tenant, &operation, &self.key, &epoch];
        params.extend_from_slice(extra);
        if client.exec(statement, &params).await? == 1 {
            return Ok(());
        }
        let row = client
            .opt(sql::LEASE_STATE, &[&tenant, &operation, &self.key])
            .await?;
        match row.map(|row| ownership(&row, self.epoch)).transpose()? {
            Some(Ownership::Fenced) => Err(Error::Fenced),
            _ => Err(Error::LeaseLost),
        }
    }

    async fn call(&self, statement: &str, extra: &[&(dyn ToSql + Sync)]) -> Result<()> {
        let client = self.store.client().await?;
        self.call_on(&client, statement, extra).await
    }

    async fn finish(self, status: &str, response: &[u8]) -> Result<()> {
        self.store.options.check_response(response)?;
        let topic = listen::topic(&self.scope, &self.key)?;
        self.call(sql::FINISH, &[&status, &response, &topic]).await
    }

    /// [`StoreLease::complete`] inside the caller's transaction `tx`: the response
    /// commits with the business update, or neither does.
    pub async fn complete_in(
        self,
        tx: &tokio_postgres::Transaction<'_>,
        response: &[u8],
    ) -> Result<()> {
        self.store.options.check_response(response)?;
        let topic = listen::topic(&self.scope, &self.key)?;
        self.call_on(tx, sql::FINISH, &[&"completed", &response, &topic])
            .await
    }

    /// [`StoreLease::fail`] inside the caller's transaction `tx`.
    pub async fn fail_in(
        self,
        tx: &tokio_postgres::Transaction<'_>,
        response: &[u8],
    ) -> Result<()> {
        self.store.options.check_response(response)?;
        let topic = listen::topic(&self.scope, &self.key)?;
        self.call_on(tx, sql::FINISH, &[&"failed", &response, &topic])
            .await
    }

    /// [`StoreLease::release`] inside the caller's transaction `tx`.
    pub async fn release_in(self, tx: &tokio_postgres::Transaction<'_>) -> Result<()> {
        let topic = listen::topic(&self.scope, &self.key)?;
        self.call_on(tx, sql::RELEASE, &[&topic]).await
    }
}

impl StoreLease for PostgresLease {
    fn epoch(&self) -> u64 {
        self.epoch
    }

    async fn complete(self, response: &[u8]) -> Result<()> {
        self.finish("completed", response).await
    }

    async fn fail(self, response: &[u8]) -> Result<()> {
        self.finish("failed", response).await
    }

    async fn release(self) -> Result<()> {
        let topic = listen::topic(&self.scope, &self.key)?;
        self.call(sql::RELEASE, &[&topic]).await
    }

    async fn note(&self, note: &[u8]) -> Result<()> {
        StoreOptions::check_note(note)?;
        self.call(sql::NOTE, &[&note]).await
    }

    async fn keep_alive(&self) -> Result<()> {
        self.call(sql::RENEW, &[]).await
    }
}
