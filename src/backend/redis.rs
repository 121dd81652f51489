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

use ::redis::aio::{ConnectionLike, MultiplexedConnection};
use ::redis::cluster_async::ClusterConnection;
use ::redis::{Cmd, Pipeline, RedisFuture, Script, Value};

use super::{refused, unavailable};
use crate::api::{Advance, InFlight, Record, RecordStatus, Reservation, Scope};
use crate::base::{Error, Result, check_key, duration_to_ms, ms_to_system_time, system_time_to_ms};
use crate::store::{Store, StoreLease};

/// Highest version the Redis ordering guard accepts.
pub const MAX_REDIS_VERSION: u64 = (1 << 53) - 1;

const RESERVE: &str = r"
if redis.call('EXISTS', KEYS[1]) == 0 then
  local epoch = redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], 2 * tonumber(ARGV[3]))
  redis.call('HSET', KEYS[1], 'status', 'in_flight', 'req', ARGV[1], 'epoch', epoch,
    'first', epoch, 'created', ARGV[2], 'sk', ARGV[4])
  redis.call('PEXPIRE', KEYS[1], ARGV[3])
  return {'acquired', tostring(epoch), ARGV[2]}
end
local f = redis.call('HMGET', KEYS[1], 'req', 'status', 'created', 'response', 'finished')
if f[1] ~= ARGV[1] then return {'mismatch'} end
if f[2] == 'in_flight' then return {'in_flight', f[3]} end
return {f[2], f[3], f[4], f[5]}
";

/// Shared by every lease call: `owned` when lease ARGV[1] holds the record in flight,
/// else `fenced` (a later lease of the same record) or `lost`.
const OWNER: &str = r"
local function owner(key, mine)
  if redis.call('EXISTS', key) == 0 then return 'lost' end
  local f = redis.call('HMGET', key, 'status', 'epoch', 'first')
  local cur, first = tonumber(f[2]), tonumber(f[3])
  if f[1] == 'in_flight' and cur == mine then return 'owned' end
  if first <= mine and mine < cur then return 'fenced' end
  return 'lost'
end
";

const FINISH: &str = r"
local state = owner(KEYS[1], tonumber(ARGV[1]))
if state ~= 'owned' then return state end
if ARGV[2] == 'release' then
  redis.call('DEL', KEYS[1])
else
  redis.call('HSET', KEYS[1], 'status', ARGV[2], 'response', ARGV[3], 'finished', ARGV[4])
end
return 'ok'
";

const NOTE: &str = r"
local state = owner(KEYS[1], tonumber(ARGV[1]))
if state ~= 'owned' then return state end
redis.call('HSET', KEYS[1], 'note', ARGV[2])
return 'ok'
";

const RESUME: &str = r"
local state = owner(KEYS[1], tonumber(ARGV[1]))
if state ~= 'owned' then return {state} end
return {'ok', redis.call('HGET', KEYS[1], 'created')}
";

const TAKE_OVER: &str = r"
if redis.call('HGET', KEYS[1], 'status') ~= 'in_flight' then return {} end
local epoch = redis.call('INCR', KEYS[2])
redis.call('PEXPIRE', KEYS[2], 2 * tonumber(ARGV[1]))
redis.call('HSET', KEYS[1], 'epoch', epoch)
return {tostring(epoch), redis.call('HGET', KEYS[1], 'created')}
";

const ADVANCE: &str = r"
local v = tonumber(ARGV[1])
local cur = redis.call('GET', KEYS[1])
if cur then cur = tonumber(cur) end
if (not cur) or v == cur + 1 then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return {'applied'}
end
if v == cur then return {'duplicate'} end
if v < cur then return {'stale', tostring(cur)} end
return {'gap', tostring(cur + 1)}
";

/// A connection to one server or to a cluster.
#[derive(Clone)]
enum Connection {
    Single(MultiplexedConnection),
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

fn backend(err: ::redis::RedisError) -> Error {
    if err.is_io_error()
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
#[derive(Clone)]
pub struct RedisStore {
    conn: Connection,
    /// The servers to scan for records in flight (every primary of a cluster).
    nodes: Vec<String>,
    prefix: String,
    window_ms: u64,
    max_key_bytes: usize,
}

impl RedisStore {
    /// A store on the Redis server at `url` (`redis://host:port`), keys prefixed `prefix`,
    /// remembered for `window`.
    pub async fn connect(url: &str, prefix: &str, window: Duration) -> Result<RedisStore> {
        let client = ::redis::Client::open(url).map_err(backend)?;
        let conn = client
            .get_multiplexed_async_connection()
            .await
            .map_err(backend)?;
        Ok(RedisStore::new(
            Connection::Single(conn),
            vec![url.to_owned()],
            prefix,
            window,
        ))
    }

    /// A store on the Redis Cluster whose primaries are `nodes`.
    pub async fn connect_cluster(
        nodes: &[&str],
        prefix: &str,
        window: Duration,
    ) -> Result<RedisStore> {
        let client = ::redis::cluster::ClusterClient::new(nodes.to_vec()).map_err(backend)?;
        let conn = client.get_async_connection().await.map_err(backend)?;
        let nodes = nodes.iter().map(|node| (*node).to_owned()).collect();
        Ok(RedisStore::new(
            Connection::Cluster(conn),
            nodes,
            prefix,
            window,
        ))
    }

    fn new(conn: Connection, nodes: Vec<String>, prefix: &str, window: Duration) -> RedisStore {
        RedisStore {
            conn,
            nodes,
            prefix: prefix.to_owned(),
            window_ms: duration_to_ms(window).max(1),
            max_key_bytes: 1024,
        }
    }

    /// The key of kind `kind` for `bytes` in domain `domain`.
    fn key(&self, domain: u8, bytes: &[u8], kind: &str) -> String {
        let mut hasher = xxhash_rust::xxh3::Xxh3::new();
        hasher.update(&[domain]);
        hasher.update(bytes);
        format!("{}:{{{:032x}}}:{kind}", self.prefix, hasher.digest128())
    }

    fn check_key(&self, key: &[u8]) -> Result<()> {
        check_key(key, self.max_key_bytes)
    }

    fn record_keys(&self, scope: &Scope, key: &[u8]) -> Result<(Vec<u8>, String, String)> {
        self.check_key(key)?;
        let scoped = scope.encode_key(key)?;
        let record = self.key(b'r', &scoped, "r");
        let epoch = self.key(b'r', &scoped, "e");
        Ok((scoped, record, epoch))
    }

    /// Runs `script` with `keys` and `args`, reading its reply as `T`.
    async fn invoke<T: ::redis::FromRedisValue>(
        &self,
        script: &str,
        keys: &[&str],
        args: &[&[u8]],
    ) -> Result<T> {
        let script = Script::new(script);
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

    async fn lines(&self, script: &str, keys: &[&str], args: &[&[u8]]) -> Result<Vec<Vec<u8>>> {
        self.invoke(script, keys, args).await
    }

    async fn status(&self, script: &str, keys: &[&str], args: &[&[u8]]) -> Result<String> {
        self.invoke(script, keys, args).await
    }
}

fn number(bytes: Option<&Vec<u8>>, what: &str) -> Result<u64> {
    bytes
        .and_then(|b| std::str::from_utf8(b).ok())
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| unexpected(what))
}

fn now_ms() -> u64 {
    system_time_to_ms(SystemTime::now())
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

impl Store for RedisStore {
    type Lease = RedisLease;

    async fn insert_if_absent(&self, key: &[u8]) -> Result<bool> {
        self.check_key(key)?;
        let mut conn = self.conn.clone();
        let set: Option<String> = ::redis::cmd("SET")
            .arg(self.key(b'k', key, "k"))
            .arg(1)
            .arg("NX")
            .arg("PX")
            .arg(self.window_ms)
            .query_async(&mut conn)
            .await
            .map_err(backend)?;
        Ok(set.is_some())
    }

    async fn insert_many(&self, keys: Vec<Vec<u8>>) -> Result<Vec<bool>> {
        for key in &keys {
            self.check_key(key)?;
        }
        // One pipeline per slot on a cluster (one in all on a single server), sent
        // concurrently; a key repeated in the batch is a duplicate the second time, as
        // SET NX gives in order within a pipeline.
        let cluster = matches!(self.conn, Connection::Cluster(_));
        let mut groups: BTreeMap<u16, (Pipeline, Vec<usize>)> = BTreeMap::new();
        for (index, key) in keys.iter().enumerate() {
            let name = self.key(b'k', key, "k");
            let group = if cluster { slot(&name) } else { 0 };
            let (pipe, indices) = groups
                .entry(group)
                .or_insert_with(|| (::redis::pipe(), Vec::new()));
            pipe.cmd("SET")
                .arg(name)
                .arg(1)
                .arg("NX")
                .arg("PX")
                .arg(self.window_ms);
            indices.push(index);
        }
        let mut sent = tokio::task::JoinSet::new();
        for (pipe, indices) in groups.into_values() {
            let mut conn = self.conn.clone();
            sent.spawn(async move {
                let replies: ::redis::RedisResult<Vec<Option<String>>> =
                    pipe.query_async(&mut conn).await;
                (indices, replies)
            });
        }
        let mut answers = vec![false; keys.len()];
        while let Some(done) = sent.join_next().await {
            let (indices, replies) = done.map_err(|err| unexpected(&err.to_string()))?;
            for (index, reply) in indices.into_iter().zip(replies.map_err(backend)?) {
                if let Some(answer) = answers.get_mut(index) {
                    *answer = reply.is_some();
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
        let (scoped, record, epoch) = self.record_keys(scope, key)?;
        let request_hash = format!("{:032x}", xxhash_rust::xxh3::xxh3_128(request));
        let now = now_ms().to_string();
        let window = self.window_ms.to_string();
        let reply = self
            .lines(
                RESERVE,
                &[&record, &epoch],
                &[
                    request_hash.as_bytes(),
                    now.as_bytes(),
                    window.as_bytes(),
                    &scoped,
                ],
            )
            .await?;
        let kind = reply.first().map(Vec::as_slice);
        Ok(match kind {
            Some(b"acquired") => Reservation::Acquired(RedisLease {
                store: self.clone(),
                record,
                epoch: number(reply.get(1), "reserve")?,
                since_ms: number(reply.get(2), "reserve")?,
            }),
            Some(b"mismatch") => Reservation::Mismatch,
            Some(b"in_flight") => Reservation::InFlight {
                since: ms_to_system_time(number(reply.get(1), "reserve")?),
            },
            Some(b"completed") | Some(b"failed") => {
                let record = Record {
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
        let (_, record, _) = self.record_keys(scope, key)?;
        let mut conn = self.conn.clone();
        let fields: Vec<Option<Vec<u8>>> = ::redis::cmd("HMGET")
            .arg(&record)
            .arg(&["status", "created", "response", "finished"])
            .query_async(&mut conn)
            .await
            .map_err(backend)?;
        let field = |i: usize| fields.get(i).cloned().flatten();
        let Some(status) = field(0) else {
            return Ok(None);
        };
        let status = match status.as_slice() {
            b"in_flight" => RecordStatus::InFlight,
            b"completed" => RecordStatus::Completed,
            b"failed" => RecordStatus::Failed,
            _ => return Err(unexpected("get")),
        };
        Ok(Some(Record {
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
        let before_ms = now_ms().saturating_sub(duration_to_ms(older_than));
        let pattern = format!("{}:*:r", self.prefix);
        let mut seen = BTreeSet::new();
        let mut found = Vec::new();
        for node in &self.nodes {
            let client = ::redis::Client::open(node.as_str()).map_err(backend)?;
            let mut conn = client
                .get_multiplexed_async_connection()
                .await
                .map_err(backend)?;
            let mut cursor: u64 = 0;
            loop {
                let (next, keys): (u64, Vec<String>) = ::redis::cmd("SCAN")
                    .arg(cursor)
                    .arg("MATCH")
                    .arg(&pattern)
                    .arg("COUNT")
                    .arg(1000)
                    .query_async(&mut conn)
                    .await
                    .map_err(backend)?;
                for key in keys {
                    if !seen.insert(key.clone()) {
                        continue;
                    }
                    let fields: Vec<Option<Vec<u8>>> = ::redis::cmd("HMGET")
                        .arg(&key)
                        .arg(&["status", "created", "epoch", "sk", "note"])
                        .query_async(&mut conn)
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
                    break;
                }
            }
        }
        Ok(found)
    }

    async fn take_over(&self, scope: &Scope, key: &[u8]) -> Result<Option<RedisLease>> {
        let (_, record, epoch) = self.record_keys(scope, key)?;
        let window = self.window_ms.to_string();
        let reply = self
            .lines(TAKE_OVER, &[&record, &epoch], &[window.as_bytes()])
            .await?;
        if reply.is_empty() {
            return Ok(None);
        }
        Ok(Some(RedisLease {
            store: self.clone(),
            record,
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
        let (version, window) = (version.to_string(), self.window_ms.to_string());
        let reply = self
            .lines(ADVANCE, &[&mark], &[version.as_bytes(), window.as_bytes()])
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
}

/// A lease on a record in Redis: its key and fencing epoch.
#[derive(Debug, Clone)]
pub struct RedisLease {
    store: RedisStore,
    record: String,
    epoch: u64,
    since_ms: u64,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisStore")
            .field("nodes", &self.nodes)
            .field("prefix", &self.prefix)
            .field("window_ms", &self.window_ms)
            .finish_non_exhaustive()
    }
}

impl RedisLease {
    /// When the record was reserved.
    pub fn since(&self) -> SystemTime {
        ms_to_system_time(self.since_ms)
    }

    async fn call(&self, script: &str, args: &[&[u8]]) -> Result<()> {
        let epoch = self.epoch.to_string();
        let mut all: Vec<&[u8]> = vec![epoch.as_bytes()];
        all.extend_from_slice(args);
        let script = format!("{OWNER}{script}");
        match self
            .store
            .status(&script, &[&self.record], &all)
            .await?
            .as_str()
        {
            "ok" => Ok(()),
            "fenced" => Err(Error::Fenced),
            "lost" => Err(Error::LeaseLost),
            _ => Err(unexpected("a lease call")),
        }
    }
}

impl StoreLease for RedisLease {
    fn epoch(&self) -> u64 {
        self.epoch
    }

    async fn complete(self, response: &[u8]) -> Result<()> {
        let now = now_ms().to_string();
        self.call(FINISH, &[b"completed", response, now.as_bytes()])
            .await
    }

    async fn fail(self, response: &[u8]) -> Result<()> {
        let now = now_ms().to_string();
        self.call(FINISH, &[b"failed", response, now.as_bytes()])
            .await
    }

    async fn release(self) -> Result<()> {
        self.call(FINISH, &[b"release", b"", b"0"]).await
    }

    async fn note(&self, note: &[u8]) -> Result<()> {
        if note.len() > crate::base::MAX_NOTE_BYTES {
            return Err(Error::NoteTooLong { len: note.len() });
        }
        self.call(NOTE, &[note]).await
    }
}

impl RedisStore {
    /// The lease of `epoch` on the record of `key` in `scope`, as [`Db::resume`](crate::Db::resume).
    pub async fn resume(&self, scope: &Scope, key: &[u8], epoch: u64) -> Result<RedisLease> {
        let (_, record, _) = self.record_keys(scope, key)?;
        let epoch_arg = epoch.to_string();
        let script = format!("{OWNER}{RESUME}");
        let reply = self
            .lines(&script, &[&record], &[epoch_arg.as_bytes()])
            .await?;
        match reply.first().map(Vec::as_slice) {
            Some(b"ok") => Ok(RedisLease {
                store: self.clone(),
                record,
                epoch,
                since_ms: number(reply.get(1), "resume")?,
            }),
            Some(b"fenced") => Err(Error::Fenced),
            Some(b"lost") => Err(Error::LeaseLost),
            _ => Err(unexpected("resume")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::slot;

    #[test]
    fn slots_follow_the_hash_tag() {
        // Values from the Redis Cluster specification's CRC16 (XMODEM) examples.
        assert_eq!(slot("123456789"), 0x31c3 & 0x3fff);
        assert_eq!(slot("{user1000}.following"), slot("{user1000}.followers"));
        assert_eq!(slot("foo{}{bar}"), slot("foo{}{bar}"));
    }
}
