//! `oncedb bench --backend`: the same workloads through the asynchronous `Store` trait,
//! against the embedded engine, PostgreSQL, Redis or a Redis Cluster, from several
//! client tasks. Each run prefixes its keys with a run id, so a shared server holding
//! earlier runs' keys still admits exactly the distinct keys of this one.

#![expect(
    clippy::cast_possible_truncation,
    reason = "benchmark tool: sizes and rates fit their types on any machine it runs on"
)]
#![expect(
    clippy::expect_used,
    reason = "benchmark tool: a failure aborts the run with its message"
)]

use crate::output::Failure;
use std::collections::HashSet;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime};

use hdrhistogram::Histogram;
use oncedb::{Db, Options, Reservation, Scope, Store, StoreLease};

use oncedb_testkit::workload::{id_stream, idempotency_keys, response_body};

/// One workload of the backend suite.
#[derive(Debug, Clone, Copy)]
enum Mix {
    /// `insert_if_absent`, one key per call.
    Single,
    /// `insert_many`, this many keys per call.
    Batch(usize),
    /// `reserve` + `complete` with a 256-byte response.
    Records,
}

/// One row of the backend table.
struct Row {
    name: String,
    ops: usize,
    elapsed: Duration,
    latency: Histogram<u64>,
    admitted: u64,
    distinct: u64,
}

/// Runs the suite against `backend` and prints the table.
pub fn run(
    backend: &str,
    ops: Option<usize>,
    tasks: usize,
    batch: Option<usize>,
    dup_rate: f64,
    window: Duration,
) -> Result<(), Failure> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|err| err.to_string())?;
    let ops = ops.unwrap_or(20_000);
    let batch = batch.unwrap_or(100).max(1);
    let mixes = [Mix::Single, Mix::Batch(batch), Mix::Records];
    let run_id = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    outln!(
        "oncedb bench --backend {}: {ops} ops per workload, {tasks} client tasks, dup rate {:.0}%",
        redacted(backend),
        dup_rate * 100.0
    )?;
    let rows = runtime.block_on(async {
        let mut rows = Vec::new();
        for (n, mix) in mixes.into_iter().enumerate() {
            // Each workload its own keys: a shared server remembers the previous ones.
            let keys = Arc::new(stream(mix, ops, dup_rate, run_id + n as u64));
            let row = match connect(backend, window, run_id).await? {
                Backend::Embedded(db) => drive(db, mix, keys, tasks).await,
                #[cfg(feature = "postgres")]
                Backend::Postgres(store) => drive(store, mix, keys, tasks).await,
                #[cfg(feature = "redis")]
                Backend::Redis(store) => drive(store, mix, keys, tasks).await,
            }?;
            rows.push(row);
        }
        Ok::<_, String>(rows)
    })?;
    print_rows(&rows)?;
    if rows.iter().any(|row| row.admitted != row.distinct) {
        return Err("admitted counts differ from the distinct keys of the stream".into());
    }
    Ok(())
}

/// The workload's keys, each prefixed with the run id.
fn stream(mix: Mix, ops: usize, dup_rate: f64, run_id: u64) -> Vec<Vec<u8>> {
    let prefix = format!("{run_id:016x}/");
    let with_prefix = |key: &[u8]| {
        let mut out = prefix.clone().into_bytes();
        out.extend_from_slice(key);
        out
    };
    match mix {
        Mix::Records => idempotency_keys(ops, dup_rate, 42)
            .iter()
            .map(|key| with_prefix(key.as_bytes()))
            .collect(),
        Mix::Single | Mix::Batch(_) => id_stream(ops, dup_rate, 42)
            .iter()
            .map(|key| with_prefix(key))
            .collect(),
    }
}

enum Backend {
    Embedded(Db),
    #[cfg(feature = "postgres")]
    Postgres(oncedb::PostgresStore),
    #[cfg(feature = "redis")]
    Redis(oncedb::RedisStore),
}

async fn connect(backend: &str, window: Duration, run_id: u64) -> Result<Backend, String> {
    if backend == "embedded" {
        let db = Db::open(Options::in_memory().window(window)).map_err(|e| e.to_string())?;
        return Ok(Backend::Embedded(db));
    }
    if backend.starts_with("postgres://") || backend.starts_with("postgresql://") {
        #[cfg(feature = "postgres")]
        {
            let store =
                oncedb::PostgresStore::connect(backend, window).map_err(|e| e.to_string())?;
            store.migrate().await.map_err(|e| e.to_string())?;
            return Ok(Backend::Postgres(store));
        }
        #[cfg(not(feature = "postgres"))]
        return Err(format!(
            "--backend {} needs oncedb built with --features postgres",
            redacted(backend)
        ));
    }
    #[cfg(feature = "redis")]
    let prefix = format!("oncedb-bench-{run_id:x}");
    #[cfg(not(feature = "redis"))]
    let _ = run_id;
    if let Some(nodes) = backend.strip_prefix("redis+cluster://") {
        #[cfg(feature = "redis")]
        {
            let urls: Vec<String> = nodes
                .split(',')
                .map(|node| format!("redis://{node}/"))
                .collect();
            let urls: Vec<&str> = urls.iter().map(String::as_str).collect();
            let store = oncedb::RedisStore::connect_cluster(&urls, &prefix, window)
                .await
                .map_err(|e| e.to_string())?;
            return Ok(Backend::Redis(store));
        }
        #[cfg(not(feature = "redis"))]
        return Err(format!(
            "--backend {} needs oncedb built with --features redis",
            redacted(backend)
        ));
    }
    if backend.starts_with("redis://") || backend.starts_with("rediss://") {
        #[cfg(feature = "redis")]
        {
            let store = oncedb::RedisStore::connect(backend, &prefix, window)
                .await
                .map_err(|e| e.to_string())?;
            return Ok(Backend::Redis(store));
        }
        #[cfg(not(feature = "redis"))]
        return Err(format!(
            "--backend {} needs oncedb built with --features redis",
            redacted(backend)
        ));
    }
    Err(format!(
        "unknown backend {}: use embedded, postgres://..., redis://..., rediss://... or redis+cluster://host:port,...",
        redacted(backend)
    ))
}

/// What one client task measured.
struct Part {
    latency: Histogram<u64>,
    admitted: u64,
}

async fn drive<S: Store + Clone>(
    store: S,
    mix: Mix,
    keys: Arc<Vec<Vec<u8>>>,
    tasks: usize,
) -> Result<Row, String> {
    let distinct = keys.iter().collect::<HashSet<_>>().len() as u64;
    let tasks = tasks.max(1);
    let per_task = keys.len().div_ceil(tasks);
    let started = Instant::now();
    let mut handles = Vec::new();
    for task in 0..tasks {
        let (store, keys) = (store.clone(), Arc::clone(&keys));
        let range = (task * per_task).min(keys.len())..((task + 1) * per_task).min(keys.len());
        handles.push(tokio::spawn(async move {
            client(&store, mix, keys.get(range).unwrap_or_default()).await
        }));
    }
    let mut latency = Histogram::new(3).expect("valid histogram");
    let mut admitted = 0;
    for handle in handles {
        let part = handle.await.map_err(|e| e.to_string())??;
        latency.add(&part.latency).map_err(|e| e.to_string())?;
        admitted += part.admitted;
    }
    Ok(Row {
        name: match mix {
            Mix::Single => "ids, insert_if_absent".into(),
            Mix::Batch(n) => format!("ids, insert_many x{n}"),
            Mix::Records => "records, reserve + complete".into(),
        },
        ops: keys.len(),
        elapsed: started.elapsed(),
        latency,
        admitted,
        distinct,
    })
}

/// One client task: its slice of the stream, call by call.
async fn client<S: Store>(store: &S, mix: Mix, keys: &[Vec<u8>]) -> Result<Part, String> {
    let mut latency = Histogram::new(3).expect("valid histogram");
    let mut admitted = 0;
    let scope = Scope::new("bench", "op");
    let response = response_body(7);
    let chunk = match mix {
        Mix::Batch(n) => n,
        Mix::Single | Mix::Records => 1,
    };
    for keys in keys.chunks(chunk) {
        let started = Instant::now();
        match mix {
            Mix::Single => {
                let key = keys.first().map_or(&[][..], Vec::as_slice);
                admitted += u64::from(
                    store
                        .insert_if_absent(key)
                        .await
                        .map_err(|e| e.to_string())?,
                );
            }
            Mix::Batch(_) => {
                let answers = store
                    .insert_many(keys.to_vec())
                    .await
                    .map_err(|e| e.to_string())?;
                admitted += answers.iter().filter(|&&new| new).count() as u64;
            }
            Mix::Records => {
                for key in keys {
                    if let Reservation::Acquired(lease) = store
                        .reserve(&scope, key, key)
                        .await
                        .map_err(|e| e.to_string())?
                    {
                        lease.complete(&response).await.map_err(|e| e.to_string())?;
                        admitted += 1;
                    }
                }
            }
        }
        let _ = latency.record(started.elapsed().as_nanos() as u64);
    }
    Ok(Part { latency, admitted })
}

fn micros(ns: u64) -> String {
    format!("{:.1}", ns as f64 / 1_000.0)
}

fn print_rows(rows: &[Row]) -> Result<(), Failure> {
    outln!(
        "{:<32} {:>10} {:>9} {:>9} {:>9} {:>10} {:>9} {:>9}",
        "workload",
        "k ops/s",
        "p50 us",
        "p99 us",
        "p99.9 us",
        "max us",
        "admitted",
        "distinct"
    )?;
    for row in rows {
        outln!(
            "{:<32} {:>10.1} {:>9} {:>9} {:>9} {:>10} {:>9} {:>9}",
            row.name,
            row.ops as f64 / row.elapsed.as_secs_f64() / 1e3,
            micros(row.latency.value_at_quantile(0.5)),
            micros(row.latency.value_at_quantile(0.99)),
            micros(row.latency.value_at_quantile(0.999)),
            micros(row.latency.max()),
            row.admitted,
            row.distinct,
        )?;
    }
    outln!("latency is per call: one key, one batch, or one reserve + complete")
}

/// `url` with its password replaced by `***`, for printing: the password of a URL's user
/// part (`scheme://user:password@host`) and any `password=` setting (a query parameter
/// or a key=value connection string).
pub fn redacted(url: &str) -> String {
    let mut out = match url.split_once("://") {
        Some((scheme, rest)) => match rest.split_once('@') {
            Some((user, host)) if !user.contains('/') => match user.split_once(':') {
                Some((name, _password)) => format!("{scheme}://{name}:***@{host}"),
                None => url.to_owned(),
            },
            _ => url.to_owned(),
        },
        None => url.to_owned(),
    };
    let mut from = 0;
    while let Some(at) = out.get(from..).and_then(|rest| rest.find("password=")) {
        let start = from + at + "password=".len();
        let end = out
            .get(start..)
            .and_then(|rest| rest.find(|c: char| c == '&' || c.is_whitespace()))
            .map_or(out.len(), |len| start + len);
        out.replace_range(start..end, "***");
        from = start + 3;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::redacted;

    #[test]
    fn passwords_are_never_printed() {
        assert_eq!(
            redacted("postgres://app:hunter2@db:5432/x?sslmode=require"),
            "postgres://app:***@db:5432/x?sslmode=require"
        );
        assert_eq!(
            redacted("rediss://default:s3cret@cache:6380/"),
            "rediss://default:***@cache:6380/"
        );
        assert_eq!(
            redacted("host=db user=app password=hunter2 dbname=x"),
            "host=db user=app password=*** dbname=x"
        );
        assert_eq!(
            redacted("postgres://db/x?password=hunter2&sslmode=require"),
            "postgres://db/x?password=***&sslmode=require"
        );
        assert_eq!(redacted("redis://cache:6379/"), "redis://cache:6379/");
        assert_eq!(
            redacted("redis+cluster://a:1,b:2"),
            "redis+cluster://a:1,b:2"
        );
    }
}
