//! [`Store`] on Redis or Redis Cluster (feature `redis`), for short windows shared by many
//! service instances.
//!
//! - Dedup keys are `SET key 1 NX PX window`.
//! - A record is one hash; reserve, complete, fail, release, note, take-over and resume
//!   are Lua scripts, so status, fencing epoch and response change atomically.
//! - Every key is `<prefix>:{<hash>}:<kind>` where `<hash>` is the XXH3-128 of the scoped
//!   key: the braces make it the Redis Cluster hash tag, so a record, its epoch counter
//!   and its other keys share one slot. Batches are sent as one pipeline per slot.
//! - Ordering marks keep versions below 2^53 (Lua numbers are doubles).
//!
//! Durability is Redis's: see `docs/scaling.md` for the loss window of each persistence
//! setting.

use std::collections::{BTreeMap, BTreeSet};
use std::time::{Duration, SystemTime};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use ::redis::aio::{
    ConnectionLike, ConnectionManager, ConnectionManagerConfig, MultiplexedConnection,
};
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Cmd, Pipeline, RedisFuture, Script, Value};

use super::{refused, tls, unavailable};
use crate::api::{Advance, InFlight, Record, RecordStatus, Reservation, Scope};
use crate::base::{Error, Result, duration_to_ms, ms_to_system_time, random_secret};
use crate::store::{Store, StoreLease, StoreOptions};

/// Highest version the Redis ordering guard accepts.
pub const MAX_REDIS_VERSION: u64 = (1 << 53) - 1;

/// Helpers every script starts with. Lua 5.1 numbers are doubles, and `tostring` prints
/// them with 14 significant digits: every number goes back to Redis through `str`, which
/// is exact below 2^53. Time is the server's (`TIME`), one clock for every client: a
/// record's times and its lease timeout never depend on a client's clock. Epochs come
/// from the server's clock in microseconds (below 2^53 until the year 2255) and rise by
/// at least one per lease of a record, so a record recreated after it expired gets an
/// epoch above every earlier lease of the key, without a counter that would have to
/// outlive the record.
const PRELUDE: &str = r"
local function str(n) return string.format('%.0f', n) end
local function now_ms()
  local t = redis.call('TIME')
  return tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
end
local function next_epoch(cur)
  local t = redis.call('TIME')
  local e = tonumber(t[1]) * 1000000 + tonumber(t[2])
  if cur and e <= cur then e = cur + 1 end
  return e
end
local function owner(key, mine)
  if redis.call('EXISTS', key) == 0 then return 'lost' end
  local f = redis.call('HMGET', key, 'status', 'epoch', 'taken')
  if f[1] == 'in_flight' and f[2] == mine then return 'owned' end
  if f[3] and string.find(' ' .. f[3] .. ' ', ' ' .. mine .. ' ', 1, true) then
    return 'fenced'
  end
  return 'lost'
end
";

/// KEYS: record. ARGV: request hash, window (ms), scoped key, call token, lease timeout
/// (ms, 0 for none). `gtok` holds the token of the call that was granted the current
/// epoch (a reserve, a lease timeout's take-over, a take-over), and only that call:
/// a reserve re-sent by the client after its first run finds its own token and answers
/// `acquired` with its own epoch again, while one re-sent after another call took the
/// record over no longer finds it. Another scoped key under the same name is a
/// `collision`; a record in flight under a lease granted a lease timeout ago (by the
/// server's clock) is taken over.
const RESERVE: &str = r"
local now = now_ms()
if redis.call('EXISTS', KEYS[1]) == 0 then
  local epoch = str(next_epoch(nil))
  redis.call('HSET', KEYS[1], 'status', 'in_flight', 'req', ARGV[1], 'epoch', epoch,
    'created', str(now), 'leased', str(now), 'sk', ARGV[3], 'gtok', ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {'acquired', epoch, str(now)}
end
local f = redis.call('HMGET', KEYS[1], 'sk', 'req', 'status', 'created', 'response',
  'finished', 'gtok', 'epoch', 'leased', 'taken', 'note')
if f[1] ~= ARGV[3] then return {'collision'} end
if f[3] == 'in_flight' and f[7] == ARGV[4] then return {'acquired', f[8], f[4]} end
if f[2] ~= ARGV[1] then return {'mismatch'} end
local timeout = tonumber(ARGV[5])
if f[3] == 'in_flight' and timeout > 0 and not f[11]
  and now - tonumber(f[9] or f[4]) >= timeout then
  local epoch = str(next_epoch(tonumber(f[8])))
  local taken = f[8]
  if f[10] then taken = f[10] .. ' ' .. f[8] end
  redis.call('HSET', KEYS[1], 'epoch', epoch, 'taken', taken, 'leased', str(now),
    'gtok', ARGV[4])
  return {'acquired', epoch, f[4]}
end
if f[3] == 'in_flight' and f[11] then return {'in_flight', f[4], f[11]} end
if f[3] == 'in_flight' then return {'in_flight', f[4]} end
return {f[3], f[4], f[5], f[6]}
";

/// KEYS: record, release marker. ARGV: epoch, `completed` | `failed` | `release`,
/// response, call token, window (ms). A finish re-sent after its first run recognises
/// its token (in the record, beside its own epoch, or in the release marker) and
/// answers `ok`.
const FINISH: &str = r"
local state = owner(KEYS[1], ARGV[1])
if state ~= 'owned' then
  local f = redis.call('HMGET', KEYS[1], 'epoch', 'ftok')
  if f[1] == ARGV[1] and f[2] == ARGV[4] then return 'ok' end
  if redis.call('GET', KEYS[2]) == ARGV[4] then return 'ok' end
  return state
end
if ARGV[2] == 'release' then
  redis.call('DEL', KEYS[1])
  redis.call('SET', KEYS[2], ARGV[4], 'PX', ARGV[5])
else
  redis.call('HSET', KEYS[1], 'status', ARGV[2], 'response', ARGV[3],
    'finished', str(now_ms()), 'ftok', ARGV[4])
end
return 'ok'
";

/// A note changes the note only: the lease timeout still counts from the grant.
const NOTE: &str = r"
local state = owner(KEYS[1], ARGV[1])
if state ~= 'owned' then return state end
redis.call('HSET', KEYS[1], 'note', ARGV[2])
return 'ok'
";

/// KEYS: record. ARGV: epoch. The lease timeout counts from now, on the server's clock.
const RENEW: &str = r"
local state = owner(KEYS[1], ARGV[1])
if state ~= 'owned' then return state end
redis.call('HSET', KEYS[1], 'leased', str(now_ms()))
return 'ok'
";

/// KEYS: record. How long ago the lease holding the record in flight was granted or
/// renewed, by the server's clock; -1 if the record is not in flight or is noted (never
/// taken over automatically).
const LEASE_AGE: &str = r"
local f = redis.call('HMGET', KEYS[1], 'status', 'leased', 'created', 'note')
if f[1] ~= 'in_flight' or f[4] then return -1 end
return now_ms() - tonumber(f[2] or f[3])
";

const RESUME: &str = r"
local state = owner(KEYS[1], ARGV[1])
if state ~= 'owned' then return {state} end
return {'ok', redis.call('HGET', KEYS[1], 'created')}
";

/// KEYS: record. ARGV: call token. The replaced epoch joins the record's `taken` list,
/// exactly the epochs fenced on it. A take-over re-sent after its first run finds its
/// token in `gtok` while it still holds the current epoch, and answers that epoch; once
/// another call was granted the record, it takes the record over anew.
const TAKE_OVER: &str = r"
local f = redis.call('HMGET', KEYS[1], 'status', 'epoch', 'taken', 'gtok', 'created')
if f[1] ~= 'in_flight' then return {} end
if f[4] == ARGV[1] then return {f[2], f[5]} end
local epoch = str(next_epoch(tonumber(f[2])))
local taken = f[2]
if f[3] then taken = f[3] .. ' ' .. f[2] end
redis.call('HSET', KEYS[1], 'epoch', epoch, 'taken', taken, 'gtok', ARGV[1],
  'leased', str(now_ms()))
return {epoch, f[5]}
";

/// KEYS: mark. ARGV: version, window (ms), call token. The mark holds the current
/// version followed by the tokens of the calls that applied it and the versions before
/// it, newest first (at most [`ADVANCE_TOKENS_KEPT`]), so an apply re-sent after other
/// clients applied later versions still answers `applied`; versions travel as the
/// strings read.
const ADVANCE: &str = r"
local kept_tokens = KEPT_TOKENS
local mark = redis.call('GET', KEYS[1])
local v = tonumber(ARGV[1])
if not mark then
  redis.call('SET', KEYS[1], ARGV[1] .. ' ' .. ARGV[3], 'PX', ARGV[2])
  return {'applied'}
end
local parts = {}
for word in string.gmatch(mark, '%S+') do parts[#parts + 1] = word end
local cur = tonumber(parts[1])
local back = cur - v
if back >= 0 and back < kept_tokens and parts[back + 2] == ARGV[3] then
  return {'applied'}
end
if v == cur + 1 then
  local kept = {ARGV[1], ARGV[3]}
  for i = 2, math.min(#parts, kept_tokens) do kept[#kept + 1] = parts[i] end
  redis.call('SET', KEYS[1], table.concat(kept, ' '), 'PX', ARGV[2])
  return {'applied'}
end
if v == cur then return {'duplicate'} end
if v < cur then return {'stale', parts[1]} end
return {'gap', str(cur + 1)}
";

/// How many tokens of applied versions an ordering mark keeps (the `kept_tokens` of
/// [`ADVANCE`]): a re-sent `advance` is recognised while fewer than this many versions
/// were applied after its own.
const ADVANCE_TOKENS_KEPT: u64 = 8;

/// A connection to one server or to a cluster.
#[derive(Clone)]
enum Connection {
    Single(ConnectionManager),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Connection {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Connection::Single(conn) => conn.req_packed_command(cmd),
            Connection::Cluster(conn) => conn.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Connection::Single(conn) => conn.req_packed_commands(cmd, offset, count),
            Connection::Cluster(conn) => conn.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Connection::Single(conn) => conn.get_db(),
            Connection::Cluster(conn) => conn.get_db(),
        }
    }
}

/// A Redis error as an oncedb error, by its kind and code, never its text:
/// - a lost, refused or timed-out connection, and the conditions a server reports while
///   it cannot serve (loading its data, a read-only replica, a cluster without a quorum
///   or without a primary for the slot, a slot in migration), are
///   [`Error::Unavailable`], which an [`OutagePolicy`](crate::OutagePolicy) acts on;
/// - a TLS failure (an untrusted certificate, a failed handshake) and refused
///   credentials are [`Error::Authentication`], never an outage;
/// - a server out of memory under `noeviction` (`OOM`) is [`Error::Full`], as the
///   embedded store answers when it has no room;
/// - anything else the server said is [`Error::Backend`].
fn backend(err: ::redis::RedisError) -> Error {
    use ::redis::ErrorKind;
    if tls::is_tls_failure(&err)
        || err.kind() == ErrorKind::AuthenticationFailed
        || matches!(err.code(), Some("NOAUTH" | "WRONGPASS" | "NOPERM"))
    {
        return super::unauthenticated(ENGINE, err.to_string());
    }
    if err.code() == Some("OOM") {
        return Error::Full;
    }
    let outage = matches!(
        err.kind(),
        ErrorKind::BusyLoadingError
            | ErrorKind::ReadOnly
            | ErrorKind::ClusterDown
            | ErrorKind::MasterDown
            | ErrorKind::TryAgain
            | ErrorKind::ClusterConnectionNotFound
    );
    if outage
        || err.is_io_error()
        || err.is_connection_refusal()
        || err.is_connection_dropped()
        || err.is_timeout()
    {
        return unavailable(ENGINE, err.to_string());
    }
    refused(ENGINE, err.to_string())
}

fn unexpected(what: &str) -> Error {
    super::unexpected(ENGINE, what)
}

/// The engine named in this store's errors.
const ENGINE: &str = "redis";

/// Keys, records and ordering marks in Redis or a Redis Cluster.
///
/// A single-server store reconnects by itself after the server restarts (calls during
/// the outage fail with [`Error::Unavailable`]); a cluster store follows the cluster's
/// topology. Every call waits at most the response timeout of its [`StoreOptions`].
#[derive(Clone)]
pub struct RedisStore {
    conn: Connection,
    /// The servers to scan for records in flight (every primary of a cluster). They may
    /// carry credentials: never printed.
    nodes: Vec<String>,
    prefix: String,
    /// Seeds the key names: a per-store secret kept in Redis, so names cannot be chosen
    /// to collide.
    seed: u64,
    options: StoreOptions,
    tokens: Arc<Tokens>,
}

/// Tokens that make each write recognisable when a client re-sends it.
struct Tokens {
    base: u64,
    next: AtomicU64,
}

impl Tokens {
    fn new() -> Tokens {
        Tokens {
            base: random_secret(),
            next: AtomicU64::new(0),
        }
    }

    /// A token no other call of any client uses.
    fn next(&self) -> String {
        let n = self.next.fetch_add(1, Ordering::Relaxed);
        format!("{:016x}{n:x}", self.base)
    }
}

impl RedisStore {
    /// A store on the Redis server at `url` (`redis://host:port`), keys prefixed `prefix`,
    /// remembered for `window`, every other setting at its default.
    pub async fn connect(url: &str, prefix: &str, window: Duration) -> Result<RedisStore> {
        RedisStore::connect_with(url, prefix, StoreOptions::new(window)).await
    }

    /// A store on the Redis server at `url` with `options`.
    pub async fn connect_with(
        url: &str,
        prefix: &str,
        options: StoreOptions,
    ) -> Result<RedisStore> {
        let client = client(url, &options)?;
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(options.connect_timeout)
            .set_response_timeout(options.response_timeout)
            .set_number_of_retries(1)
            .set_max_delay(500);
        let conn = client
            .get_connection_manager_with_config(config)
            .await
            .map_err(backend)?;
        RedisStore::new(
            Connection::Single(conn),
            vec![url.to_owned()],
            prefix,
            options,
        )
        .await
    }

    /// A store on the Redis Cluster reached through the seed nodes `nodes`.
    pub async fn connect_cluster(
        nodes: &[&str],
        prefix: &str,
        window: Duration,
    ) -> Result<RedisStore> {
        RedisStore::connect_cluster_with(nodes, prefix, StoreOptions::new(window)).await
    }

    /// A store on the Redis Cluster reached through the seed nodes `nodes`, with
    /// `options`. Calls follow the cluster's topology as it changes; the seeds' scheme
    /// and credentials are used for every primary.
    pub async fn connect_cluster_with(
        nodes: &[&str],
        prefix: &str,
        options: StoreOptions,
    ) -> Result<RedisStore> {
        let mut builder = ::redis::cluster::ClusterClient::builder(nodes.to_vec())
            .connection_timeout(options.connect_timeout)
            .response_timeout(options.response_timeout);
        if let Some(certificates) = certificates(nodes.iter().copied(), &options)? {
            builder = builder.certs(certificates);
        }
        let client = builder.build().map_err(backend)?;
        let conn = client.get_async_connection().await.map_err(backend)?;
        let nodes = nodes.iter().map(|node| (*node).to_owned()).collect();
        RedisStore::new(Connection::Cluster(conn), nodes, prefix, options).await
    }

    async fn new(
        conn: Connection,
        nodes: Vec<String>,
        prefix: &str,
        options: StoreOptions,
    ) -> Result<RedisStore> {
        let seed = match options.naming_secret {
            Some(secret) => secret,
            None => store_secret(&conn, prefix).await?,
        };
        let store = RedisStore {
            conn,
            nodes,
            prefix: prefix.to_owned(),
            seed,
            options,
            tokens: Arc::new(Tokens::new()),
        };
        store.check_eviction().await?;
        Ok(store)
    }

    fn window_ms(&self) -> u64 {
        duration_to_ms(self.options.window).max(1)
    }

    /// The key of kind `kind` for `bytes` in domain `domain`: the keyed XXH3-128 of the
    /// bytes in braces, the Redis Cluster hash tag that puts every key of one record in
    /// one slot.
    fn key(&self, domain: u8, bytes: &[u8], kind: &str) -> String {
        let mut hasher = xxhash_rust::xxh3::Xxh3::with_seed(self.seed);
        hasher.update(&[domain]);
        hasher.update(bytes);
        format!("{}:{{{:032x}}}:{kind}", self.prefix, hasher.digest128())
    }

    fn check_key(&self, key: &[u8]) -> Result<()> {
        self.options.check_key(key)
    }

    /// The scoped key, the record's name and its release marker's name.
    fn record_keys(&self, scope: &Scope, key: &[u8]) -> Result<(Vec<u8>, String, String)> {
        self.check_key(key)?;
        let scoped = scope.encode_key(key)?;
        let record = self.key(b'r', &scoped, "r");
        let released = self.key(b'r', &scoped, "x");
        Ok((scoped, record, released))
    }

    /// Runs `script` with `keys` and `args`, reading its reply as `T`.
    async fn invoke<T: ::redis::FromRedisValue>(
        &self,
        script: &Script,
        keys: &[&str],
        args: &[&[u8]],
    ) -> Result<T> {
        let mut invocation = script.prepare_invoke();
        for key in keys {
            invocation.key(*key);
        }
        for arg in args {
            invocation.arg(*arg);
        }
        let mut conn = self.conn.clone();
        invocation.invoke_async(&mut conn).await.map_err(backend)
    }

    /// How long the lease holding the record of `key` in flight has left before a
    /// reserve may take it over: `None` without a lease timeout, for a noted record, or
    /// a record not in flight.
    async fn lease_left(&self, scope: &Scope, key: &[u8]) -> Result<Option<Duration>> {
        let Some(timeout) = self.options.lease_timeout else {
            return Ok(None);
        };
        let (_, record, _) = self.record_keys(scope, key)?;
        let age_ms: i64 = self.invoke(&SCRIPTS.lease_age, &[&record], &[]).await?;
        let Ok(age_ms) = u64::try_from(age_ms) else {
            return Ok(None);
        };
        let timeout_ms = duration_to_ms(timeout).max(1);
        Ok(Some(Duration::from_millis(
            timeout_ms.saturating_sub(age_ms),
        )))
    }

    async fn lines(&self, script: &Script, keys: &[&str], args: &[&[u8]]) -> Result<Vec<Vec<u8>>> {
        self.invoke(script, keys, args).await
    }

    async fn status(&self, script: &Script, keys: &[&str], args: &[&[u8]]) -> Result<String> {
        self.invoke(script, keys, args).await
    }

    /// `SET name token NX GET PX window`: whether the key was admitted by this call. A
    /// command the client re-sent after its first run finds its own token and still
    /// answers `true`.
    fn admit(&self, name: String, token: &str) -> Cmd {
        let mut command = ::redis::cmd("SET");
        command
            .arg(name)
            .arg(token)
            .arg("NX")
            .arg("GET")
            .arg("PX")
            .arg(self.window_ms());
        command
    }
}

/// Sends the `SET NX GET` commands of one group of `insert_many` (index, token,
/// command), as one pipeline on a single server and one request each on a cluster;
/// answers whether each key was admitted by its command.
async fn send_group(
    mut conn: Connection,
    group: Vec<(usize, String, Cmd)>,
    cluster: bool,
) -> ::redis::RedisResult<Vec<(usize, bool)>> {
    let admitted =
        |token: &str, earlier: Option<String>| earlier.is_none_or(|earlier| earlier == token);
    if cluster {
        let mut answers = Vec::with_capacity(group.len());
        for (index, token, command) in group {
            // `ASKING` written with its command, as one pipeline: where the slot is being
            // imported, the flag it sets is the one this command uses, whatever other
            // calls share the connection (a pipeline's commands are written together).
            let mut pipe = ::redis::pipe();
            pipe.cmd("ASKING").ignore().add_command(command);
            let (earlier,): (Option<String>,) = pipe.query_async(&mut conn).await?;
            answers.push((index, admitted(&token, earlier)));
        }
        return Ok(answers);
    }
    let mut pipe = ::redis::pipe();
    for (_, _, command) in &group {
        pipe.add_command(command.clone());
    }
    let replies: Vec<Option<String>> = pipe.query_async(&mut conn).await?;
    Ok(group
        .into_iter()
        .zip(replies)
        .map(|((index, token, _), earlier)| (index, admitted(&token, earlier)))
        .collect())
}

/// Each script with the prelude, hashed once.
struct Scripts {
    reserve: Script,
    finish: Script,
    note: Script,
    renew: Script,
    lease_age: Script,
    resume: Script,
    take_over: Script,
    advance: Script,
}

static SCRIPTS: std::sync::LazyLock<Scripts> = std::sync::LazyLock::new(|| {
    let script = |body: &str| Script::new(&format!("{PRELUDE}{body}"));
    Scripts {
        reserve: script(RESERVE),
        finish: script(FINISH),
        note: script(NOTE),
        renew: script(RENEW),
        lease_age: script(LEASE_AGE),
        resume: script(RESUME),
        take_over: script(TAKE_OVER),
        advance: script(&ADVANCE.replace("KEPT_TOKENS", &ADVANCE_TOKENS_KEPT.to_string())),
    }
});

/// The client of the server at `url`, over TLS for a `rediss://` URL.
fn client(url: &str, options: &StoreOptions) -> Result<::redis::Client> {
    match certificates([url], options)? {
        Some(certificates) if url.starts_with("rediss://") => {
            ::redis::Client::build_with_tls(url, certificates)
        }
        _ => ::redis::Client::open(url),
    }
    .map_err(backend)
}

/// The roots to trust when they are given (checked here, so bad PEM is an
/// `InvalidOptions` before any connection), and the TLS provider set up when any of
/// `urls` asks for TLS.
fn certificates<'a>(
    urls: impl IntoIterator<Item = &'a str>,
    options: &StoreOptions,
) -> Result<Option<::redis::TlsCertificates>> {
    let secure = urls.into_iter().any(|url| url.starts_with("rediss://"));
    if secure || options.tls_roots_pem.is_some() {
        tls::install_default_provider();
    }
    let Some(pem) = &options.tls_roots_pem else {
        return Ok(None);
    };
    tls::parse_roots(pem)?;
    Ok(Some(::redis::TlsCertificates {
        client_tls: None,
        root_cert: Some(pem.clone()),
    }))
}

/// The store's secret, kept under `<prefix>:secret`: the first client to connect sets it,
/// every later one reads it.
async fn store_secret(conn: &Connection, prefix: &str) -> Result<u64> {
    let name = format!("{prefix}:secret");
    let mut conn = conn.clone();
    let _: Option<String> = ::redis::cmd("SET")
        .arg(&name)
        .arg(format!("{:016x}", random_secret()))
        .arg("NX")
        .query_async(&mut conn)
        .await
        .map_err(backend)?;
    let secret: Option<String> = ::redis::cmd("GET")
        .arg(&name)
        .query_async(&mut conn)
        .await
        .map_err(backend)?;
    secret
        .and_then(|text| u64::from_str_radix(&text, 16).ok())
        .ok_or_else(|| unexpected("the store secret"))
}

fn number(bytes: Option<&Vec<u8>>, what: &str) -> Result<u64> {
    bytes
        .and_then(|b| std::str::from_utf8(b).ok())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| unexpected(what))
}

/// The server's clock (`TIME`) in milliseconds: the clock every record time is on.
async fn server_now_ms(conn: &mut MultiplexedConnection) -> Result<u64> {
    let (seconds, micros): (u64, u64) = ::redis::cmd("TIME")
        .query_async(conn)
        .await
        .map_err(backend)?;
    Ok(seconds.saturating_mul(1000).saturating_add(micros / 1000))
}

/// The addresses (`host:port`) of the primaries in a `CLUSTER NODES` reply that serve at
/// least one slot, failing or not (a failed primary's records cannot be listed, and a
/// listing must say so rather than leave them out). A node's announced hostname is
/// preferred to its address.
fn serving_primaries(nodes: &str) -> Vec<String> {
    nodes
        .lines()
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (address, flags) = (fields.get(1)?, fields.get(2)?);
            let primary = flags.split(',').any(|flag| flag == "master");
            // Fields 8 and on are the slots served.
            (primary && fields.len() > 8).then_some(())?;
            let (endpoint, extra) = address.split_once(',').unwrap_or((address, ""));
            let (ip_port, _bus) = endpoint.split_once('@').unwrap_or((endpoint, ""));
            let (ip, port) = ip_port.rsplit_once(':')?;
            let host = match extra.split(',').next() {
                Some(hostname) if !hostname.is_empty() => hostname,
                _ => ip,
            };
            // A node that never met another one does not know its own address, and
            // shows ":port": `with_address` keeps the seed's host for it.
            Some(if host.contains(':') {
                format!("[{host}]:{port}")
            } else {
                format!("{host}:{port}")
            })
        })
        .collect()
}

/// `url` (`redis://[user:password@]host:port[/db]`) with `address` for its host and
/// port: a primary reached with the seed's scheme, credentials and database.
fn with_address(url: &str, address: &str) -> String {
    let Some((scheme, rest)) = url.split_once("://") else {
        return format!("redis://{address}");
    };
    let (authority, path) = rest
        .find('/')
        .map_or((rest, ""), |slash| rest.split_at(slash));
    let at = authority.rfind('@').map_or(0, |at| at + 1);
    let (credentials, seed_address) = authority.split_at(at);
    let address = match address.strip_prefix(':') {
        // No host known to the node itself: the seed's host, the node's port.
        Some(port) => {
            let host = seed_address
                .rsplit_once(':')
                .map_or(seed_address, |(host, _)| host);
            format!("{host}:{port}")
        }
        None => address.to_owned(),
    };
    format!("{scheme}://{credentials}{address}{path}")
}

/// The Redis Cluster slot of `key` (CRC16/XMODEM of its hash tag, modulo 16384).
fn slot(key: &str) -> u16 {
    let bytes = key.as_bytes();
    let tag = key
        .find('{')
        .and_then(|open| {
            let close = key.get(open + 1..)?.find('}')?;
            (close > 0)
                .then(|| bytes.get(open + 1..open + 1 + close))
                .flatten()
        })
        .unwrap_or(bytes);
    let mut crc: u16 = 0;
    for &byte in tag {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc & 0x3fff
}

/// The first and the longest interval between two looks of a wait for an outcome on
/// Redis, which polls the record (doubling the interval from the first to the longest).
const WAIT_POLL_FIRST: Duration = Duration::from_millis(2);
const WAIT_POLL_MAX: Duration = Duration::from_millis(50);

impl Store for RedisStore {
    type Lease = RedisLease;

    fn lease_timeout(&self) -> Option<Duration> {
        self.options.lease_timeout
    }

    /// Polls the record: every 2 ms at first, the interval doubling up to 50 ms, so a
    /// waiter learns of an ending within 50 ms (and within a few ms of a quick one) at
    /// the cost of at most 20 reads a second.
    async fn wait_finished(
        &self,
        scope: &Scope,
        key: &[u8],
        timeout: Duration,
    ) -> Result<Option<Record>> {
        let deadline = tokio::time::Instant::from_std(crate::base::deadline_after(timeout));
        let mut interval = WAIT_POLL_FIRST;
        loop {
            let record = self.get(scope, key).await?;
            let now = tokio::time::Instant::now();
            if record
                .as_ref()
                .is_none_or(|r| r.status() != RecordStatus::InFlight)
                || now >= deadline
            {
                return Ok(record);
            }
            // A lapsed lease answers at once: the caller may take the record over now.
            let left = self.lease_left(scope, key).await?;
            if left.is_some_and(|left| left.is_zero()) {
                return Ok(record);
            }
            let look_again = left.map_or(interval, |left| interval.min(left));
            tokio::time::sleep_until(deadline.min(now + look_again)).await;
            interval = (interval * 2).min(WAIT_POLL_MAX);
        }
    }

    fn max_response_bytes(&self) -> usize {
        self.options.max_response_bytes
    }

    async fn insert_if_absent(&self, key: &[u8]) -> Result<bool> {
        self.check_key(key)?;
        let token = self.tokens.next();
        let command = self.admit(self.key(b'k', key, "k"), &token);
        let mut conn = self.conn.clone();
        let earlier: Option<String> = command.query_async(&mut conn).await.map_err(backend)?;
        Ok(earlier.is_none_or(|earlier| earlier == token))
    }

    async fn insert_many(&self, keys: Vec<Vec<u8>>) -> Result<Vec<bool>> {
        for key in &keys {
            self.check_key(key)?;
        }
        if keys.len() > crate::base::MAX_BATCH_KEYS {
            return Err(Error::BatchTooLarge {
                len: keys.len(),
                max: crate::base::MAX_BATCH_KEYS,
            });
        }
        // On a single server, one pipeline. On a cluster, one group of commands per slot,
        // the groups sent concurrently and each command of a group as a request of its
        // own behind its own `ASKING`: the cluster client follows a MOVED or ASK
        // redirection per command, so a batch meeting a slot in migration lands each key
        // where the cluster says, where a pipeline of several keys would be re-sent
        // whole after one ASKING (its other keys bouncing between MOVED and ASK). Each
        // key gets its own token, so a key repeated in the batch is a duplicate the
        // second time (SET NX in order within a group), while a command re-sent by the
        // client recognises its own write.
        //
        // Not atomic: a failure part-way may leave some keys admitted, and the batch's
        // answer is then an error; a retry calls those keys duplicates.
        let cluster = matches!(self.conn, Connection::Cluster(_));
        let base = self.tokens.next();
        let mut groups: BTreeMap<u16, Vec<(usize, String, Cmd)>> = BTreeMap::new();
        for (index, key) in keys.iter().enumerate() {
            let name = self.key(b'k', key, "k");
            let group = if cluster { slot(&name) } else { 0 };
            let token = format!("{base}.{index}");
            let command = self.admit(name, &token);
            groups
                .entry(group)
                .or_default()
                .push((index, token, command));
        }
        let mut sent = tokio::task::JoinSet::new();
        for group in groups.into_values() {
            let conn = self.conn.clone();
            sent.spawn(send_group(conn, group, cluster));
        }
        let mut answers = vec![false; keys.len()];
        while let Some(done) = sent.join_next().await {
            let replies = done.map_err(|err| unexpected(&err.to_string()))?;
            for (index, admitted) in replies.map_err(backend)? {
                if let Some(answer) = answers.get_mut(index) {
                    *answer = admitted;
                }
            }
        }
        Ok(answers)
    }

    async fn reserve(
        &self,
        scope: &Scope,
        key: &[u8],
        request: &[u8],
    ) -> Result<Reservation<RedisLease>> {
        let (scoped, record, released) = self.record_keys(scope, key)?;
        let request_hash = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(request));
        let window = self.window_ms().to_string();
        let token = self.tokens.next();
        let timeout = self
            .options
            .lease_timeout
            .map_or(0, |timeout| duration_to_ms(timeout).max(1))
            .to_string();
        let reply = self
            .lines(
                &SCRIPTS.reserve,
                &[&record],
                &[
                    request_hash.as_bytes(),
                    window.as_bytes(),
                    &scoped,
                    token.as_bytes(),
                    timeout.as_bytes(),
                ],
            )
            .await?;
        let kind = reply.first().map(Vec::as_slice);
        Ok(match kind {
            Some(b"acquired") => Reservation::Acquired(RedisLease {
                store: self.clone(),
                record,
                released,
                epoch: number(reply.get(1), "reserve")?,
                since_ms: number(reply.get(2), "reserve")?,
            }),
            Some(b"collision") => return Err(Error::FingerprintCollision),
            Some(b"mismatch") => Reservation::Mismatch,
            Some(b"in_flight") => Reservation::InFlight {
                since: ms_to_system_time(number(reply.get(1), "reserve")?),
                note: reply.get(2).cloned(),
            },
            Some(b"completed") | Some(b"failed") => {
                let record = Record {
                    logged: None,
                    key_logged: None,
                    status: if kind == Some(b"completed") {
                        RecordStatus::Completed
                    } else {
                        RecordStatus::Failed
                    },
                    response: Some(reply.get(2).cloned().unwrap_or_default().into()),
                    created_ms: number(reply.get(1), "reserve")?,
                    finished_ms: Some(number(reply.get(3), "reserve")?),
                };
                if record.status == RecordStatus::Completed {
                    Reservation::Completed(record)
                } else {
                    Reservation::Failed(record)
                }
            }
            _ => return Err(unexpected("reserve")),
        })
    }

    async fn get(&self, scope: &Scope, key: &[u8]) -> Result<Option<Record>> {
        let (scoped, record, _) = self.record_keys(scope, key)?;
        let mut conn = self.conn.clone();
        let fields: Vec<Option<Vec<u8>>> = ::redis::cmd("HMGET")
            .arg(&record)
            .arg(&["status", "created", "response", "finished", "sk"])
            .query_async(&mut conn)
            .await
            .map_err(backend)?;
        let field = |i: usize| fields.get(i).cloned().flatten();
        let Some(status) = field(0) else {
            return Ok(None);
        };
        if field(4).as_deref() != Some(&scoped[..]) {
            return Err(Error::FingerprintCollision);
        }
        let status = match status.as_slice() {
            b"in_flight" => RecordStatus::InFlight,
            b"completed" => RecordStatus::Completed,
            b"failed" => RecordStatus::Failed,
            _ => return Err(unexpected("get")),
        };
        Ok(Some(Record {
            logged: None,
            key_logged: None,
            status,
            response: field(2).map(Into::into),
            created_ms: number(field(1).as_ref(), "get")?,
            finished_ms: match field(3) {
                Some(ms) => Some(number(Some(&ms), "get")?),
                None => None,
            },
        }))
    }

    async fn in_flight(&self, older_than: Duration) -> Result<Vec<InFlight>> {
        let mut seen = BTreeSet::new();
        let mut found = Vec::new();
        for node in self.primaries().await? {
            let mut conn = self.node(&node).await?;
            let before_ms = server_now_ms(&mut conn)
                .await?
                .saturating_sub(duration_to_ms(older_than));
            self.scan_in_flight(&mut conn, before_ms, &mut seen, &mut found)
                .await?;
        }
        Ok(found)
    }

    async fn take_over(&self, scope: &Scope, key: &[u8]) -> Result<Option<RedisLease>> {
        let (_, record, released) = self.record_keys(scope, key)?;
        let token = self.tokens.next();
        let reply = self
            .lines(&SCRIPTS.take_over, &[&record], &[token.as_bytes()])
            .await?;
        if reply.is_empty() {
            return Ok(None);
        }
        Ok(Some(RedisLease {
            store: self.clone(),
            record,
            released,
            epoch: number(reply.first(), "take_over")?,
            since_ms: number(reply.get(1), "take_over")?,
        }))
    }

    async fn advance(&self, scope: &Scope, aggregate_id: &[u8], version: u64) -> Result<Advance> {
        self.check_key(aggregate_id)?;
        if version > MAX_REDIS_VERSION {
            return Err(Error::InvalidOptions(format!(
                "version {version} exceeds {MAX_REDIS_VERSION}, the most the Redis ordering guard holds"
            )));
        }
        let scoped = scope.encode_key(aggregate_id)?;
        let mark = self.key(b'm', &scoped, "m");
        let (version, window) = (version.to_string(), self.window_ms().to_string());
        let token = self.tokens.next();
        let reply = self
            .lines(
                &SCRIPTS.advance,
                &[&mark],
                &[version.as_bytes(), window.as_bytes(), token.as_bytes()],
            )
            .await?;
        Ok(match reply.first().map(Vec::as_slice) {
            Some(b"applied") => Advance::Applied,
            Some(b"duplicate") => Advance::Duplicate,
            Some(b"stale") => Advance::Stale {
                current: number(reply.get(1), "advance")?,
            },
            Some(b"gap") => Advance::Gap {
                expected: number(reply.get(1), "advance")?,
            },
            _ => return Err(unexpected("advance")),
        })
    }

    async fn resume(&self, scope: &Scope, key: &[u8], epoch: u64) -> Result<RedisLease> {
        let (_, record, released) = self.record_keys(scope, key)?;
        let epoch_arg = epoch.to_string();
        let reply = self
            .lines(&SCRIPTS.resume, &[&record], &[epoch_arg.as_bytes()])
            .await?;
        match reply.first().map(Vec::as_slice) {
            Some(b"ok") => Ok(RedisLease {
                store: self.clone(),
                record,
                released,
                epoch,
                since_ms: number(reply.get(1), "resume")?,
            }),
            Some(b"fenced") => Err(Error::Fenced),
            Some(b"lost") => Err(Error::LeaseLost),
            _ => Err(unexpected("resume")),
        }
    }
}

impl RedisStore {
    /// The servers that hold keys now: the one server, or every primary serving slots in
    /// the cluster's current topology (asked of the cluster, so primaries added after
    /// connect are found and seeds since removed are not asked), each as a URL with the
    /// first seed's scheme and credentials.
    async fn primaries(&self) -> Result<Vec<String>> {
        let Connection::Cluster(cluster) = &self.conn else {
            return Ok(self.nodes.clone());
        };
        let mut conn = cluster.clone();
        let nodes: String = ::redis::cmd("CLUSTER")
            .arg("NODES")
            .query_async(&mut conn)
            .await
            .map_err(backend)?;
        let seed = self
            .nodes
            .first()
            .ok_or_else(|| unexpected("a cluster without seed nodes"))?;
        let primaries: Vec<String> = serving_primaries(&nodes)
            .iter()
            .map(|address| with_address(seed, address))
            .collect();
        if primaries.is_empty() {
            return Err(unexpected("CLUSTER NODES: no primary serves a slot"));
        }
        Ok(primaries)
    }

    /// A connection of its own to the server at `url`.
    async fn node(&self, url: &str) -> Result<MultiplexedConnection> {
        let client = client(url, &self.options)?;
        let config = ::redis::AsyncConnectionConfig::new()
            .set_connection_timeout(self.options.connect_timeout)
            .set_response_timeout(self.options.response_timeout);
        client
            .get_multiplexed_async_connection_with_config(&config)
            .await
            .map_err(backend)
    }

    /// Refuses a server (or a primary) whose `maxmemory-policy` evicts keys, unless the
    /// options accept eviction: read from `INFO memory`, which managed services that
    /// disable `CONFIG` still answer.
    async fn check_eviction(&self) -> Result<()> {
        if self.options.accept_eviction {
            return Ok(());
        }
        for node in self.primaries().await? {
            let mut conn = self.node(&node).await?;
            let info: String = ::redis::cmd("INFO")
                .arg("memory")
                .query_async(&mut conn)
                .await
                .map_err(backend)?;
            let policy = info
                .lines()
                .find_map(|line| line.trim().strip_prefix("maxmemory_policy:"))
                .ok_or_else(|| unexpected("INFO memory: no maxmemory_policy"))?;
            if policy != "noeviction" {
                return Err(Error::InvalidOptions(format!(
                    "a Redis server runs maxmemory-policy {policy}, which evicts dedup keys \
                     and records under memory pressure and lets duplicates through: set \
                     maxmemory-policy noeviction, or accept the loss with \
                     StoreOptions::accept_eviction"
                )));
            }
        }
        Ok(())
    }

    /// Adds the records in flight since `before_ms` that the server of `conn` holds.
    async fn scan_in_flight(
        &self,
        conn: &mut MultiplexedConnection,
        before_ms: u64,
        seen: &mut BTreeSet<String>,
        found: &mut Vec<InFlight>,
    ) -> Result<()> {
        let pattern = format!("{}:*:r", self.prefix);
        let mut cursor: u64 = 0;
        loop {
            let (next, keys): (u64, Vec<String>) = ::redis::cmd("SCAN")
                .arg(cursor)
                .arg("MATCH")
                .arg(&pattern)
                .arg("COUNT")
                .arg(1000)
                .query_async(conn)
                .await
                .map_err(backend)?;
            for key in keys {
                if !seen.insert(key.clone()) {
                    continue;
                }
                let fields: Vec<Option<Vec<u8>>> = ::redis::cmd("HMGET")
                    .arg(&key)
                    .arg(&["status", "created", "epoch", "sk", "note"])
                    .query_async(conn)
                    .await
                    .map_err(backend)?;
                let field = |i: usize| fields.get(i).cloned().flatten();
                if field(0).as_deref() != Some(b"in_flight") {
                    continue;
                }
                let created = number(field(1).as_ref(), "in_flight")?;
                let scoped = field(3).unwrap_or_default();
                let Some((scope, key)) = Scope::decode_key(&scoped) else {
                    continue;
                };
                if created <= before_ms {
                    found.push(InFlight {
                        scope,
                        key: key.to_vec(),
                        since: ms_to_system_time(created),
                        epoch: number(field(2).as_ref(), "in_flight")?,
                        note: field(4),
                    });
                }
            }
            cursor = next;
            if cursor == 0 {
                return Ok(());
            }
        }
    }
}

/// A lease on a record in Redis: its key and fencing epoch.
#[derive(Debug, Clone)]
pub struct RedisLease {
    store: RedisStore,
    record: String,
    /// Where a release leaves its token, so that a re-sent release is recognised.
    released: String,
    epoch: u64,
    since_ms: u64,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("nodes", &self.nodes.len())
            .field("prefix", &self.prefix)
            .field("options", &self.options)
            .finish_non_exhaustive()
    }
}

impl RedisLease {
    /// When the record was reserved.
    pub fn since(&self) -> SystemTime {
        ms_to_system_time(self.since_ms)
    }

    async fn call(&self, script: &Script, keys: &[&str], args: &[&[u8]]) -> Result<()> {
        let epoch = self.epoch.to_string();
        let mut all: Vec<&[u8]> = vec![epoch.as_bytes()];
        all.extend_from_slice(args);
        match self.store.status(script, keys, &all).await?.as_str() {
            "ok" => Ok(()),
            "fenced" => Err(Error::Fenced),
            "lost" => Err(Error::LeaseLost),
            _ => Err(unexpected("a lease call")),
        }
    }

    async fn finish(&self, kind: &[u8], response: &[u8]) -> Result<()> {
        self.store.options.check_response(response)?;
        let token = self.store.tokens.next();
        let window = self.store.window_ms().to_string();
        self.call(
            &SCRIPTS.finish,
            &[&self.record, &self.released],
            &[kind, response, token.as_bytes(), window.as_bytes()],
        )
        .await
    }
}

impl StoreLease for RedisLease {
    fn epoch(&self) -> u64 {
        self.epoch
    }

    async fn complete(self, response: &[u8]) -> Result<()> {
        self.finish(b"completed", response).await
    }

    async fn fail(self, response: &[u8]) -> Result<()> {
        self.finish(b"failed", response).await
    }

    async fn release(self) -> Result<()> {
        self.finish(b"release", b"").await
    }

    async fn note(&self, note: &[u8]) -> Result<()> {
        StoreOptions::check_note(note)?;
        self.call(&SCRIPTS.note, &[&self.record], &[note]).await
    }

    async fn keep_alive(&self) -> Result<()> {
        self.call(&SCRIPTS.renew, &[&self.record], &[]).await
    }
}

#[cfg(test)]
mod tests {
    use super::{serving_primaries, slot, with_address};

    #[test]
    fn primaries_are_the_masters_serving_slots() {
        let nodes = "\
a1 127.0.0.1:7001@17001 myself,master - 0 0 1 connected 0-5460
b2 127.0.0.1:7002@17002 master - 0 0 2 connected 5461-10922
c3 127.0.0.1:7003@17003 slave b2 0 0 2 connected
d4 127.0.0.1:7004@17004 master - 0 0 4 connected
e5 10.0.0.5:7005@17005,node-e.example master,fail - 0 0 5 connected 10923-16383
f6 ::1:7006@17006 master - 0 0 6 connected 100
g7 :7007@17007 myself,master - 0 0 7 connected 200
";
        assert_eq!(
            serving_primaries(nodes),
            vec![
                "127.0.0.1:7001",
                "127.0.0.1:7002",
                "node-e.example:7005",
                "[::1]:7006",
                ":7007"
            ]
        );
    }

    #[test]
    fn a_primary_is_reached_with_the_seeds_scheme_and_credentials() {
        assert_eq!(
            with_address("rediss://user:p@ss@seed:6379/2", "10.0.0.1:7000"),
            "rediss://user:p@ss@10.0.0.1:7000/2"
        );
        assert_eq!(with_address("redis://127.0.0.1:6379", "h:1"), "redis://h:1");
        assert_eq!(with_address("seed:6379", "h:1"), "redis://h:1");
        assert_eq!(
            with_address("redis://u@10.1.1.1:6379/", ":7000"),
            "redis://u@10.1.1.1:7000/"
        );
    }

    #[test]
    fn slots_follow_the_hash_tag() {
        // Values from the Redis Cluster specification's CRC16 (XMODEM) examples.
        assert_eq!(slot("123456789"), 0x31c3 & 0x3fff);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        assert_eq!(slot("foo{}{bar}"), slot("foo{}{bar}"));
    }
}
