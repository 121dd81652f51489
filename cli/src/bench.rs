//! `oncedb bench`: one configurable workload, or with no workload flags a default suite
//! that covers the in-memory and durable paths in under a minute.

#![expect(
    clippy::cast_possible_truncation,
    reason = "benchmark tool: sizes and rates fit their types on any machine it runs on"
)]
#![expect(
    clippy::expect_used,
    reason = "benchmark tool: a failure aborts the run with its message"
)]
#![expect(
    clippy::indexing_slicing,
    reason = "benchmark tool: indices come from the workload it generates"
)]

use crate::output::Failure;
use std::path::PathBuf;
use std::time::{Duration, Instant, SystemTime};

use clap::{Args, ValueEnum};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use oncedb::{
    Db, Durability, ManualClock, Options, ReplicaMode, Replication, Reservation, Scope, Stats,
};

use oncedb_testkit::workload::{KeyStream, peak_rss_bytes, response_body_of, rss_bytes};

/// Flags of `oncedb bench`.
#[derive(Args, Debug, Clone)]
pub struct BenchArgs {
    /// Operations to run (keys in the stream, duplicates included).
    #[arg(long)]
    keys: Option<usize>,
    /// Fraction of operations that repeat an earlier key.
    #[arg(long, default_value_t = 0.2)]
    dup_rate: f64,
    /// Writer threads; the stream is split between them.
    #[arg(long)]
    threads: Option<usize>,
    /// Keys per `insert_many` call (1 = `insert_if_absent`).
    #[arg(long)]
    batch: Option<usize>,
    /// memory, buffered, sync, or interval:<ms>.
    #[arg(long)]
    durability: Option<String>,
    /// ids (16-byte message ids, insert_if_absent) or records (60-byte idempotency keys,
    /// reserve + complete with a 256-byte response).
    #[arg(long, value_enum)]
    workload: Option<Workload>,
    /// Window length: a duration (`24h`, `90s`, `7d`), or a bare number of seconds.
    #[arg(long, default_value = "24h", value_parser = parse_span)]
    window: Duration,
    /// Bucket width, as --window.
    #[arg(long, default_value = "15m", value_parser = parse_span)]
    bucket: Duration,
    /// Bytes of each stored response in the records workload.
    #[arg(long, default_value_t = 256)]
    response_bytes: usize,
    /// Fraction of the records workload's operations that repeat an earlier key with
    /// another request (each must answer `Mismatch`); the other repeats are retries, each
    /// replay checked byte for byte.
    #[arg(long, default_value_t = 0.01)]
    mismatch_rate: f64,
    /// Bound the memory of dedup keys and idempotency records (`Options::memory_budget`):
    /// `512MiB`, `1GiB`, or a plain number of bytes. Durable runs only.
    #[arg(long, value_parser = parse_bytes)]
    memory_budget: Option<u64>,
    /// Parent directory for durable stores (default: the system temp directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// After a durable run, close and reopen the store and time the recovery.
    #[arg(long)]
    reopen: bool,
    /// Drive the store with a manual clock moved forward one bucket after every N
    /// operations (0: the system clock). With a short --window this drops a whole bucket
    /// every N operations; the first call after each advance rolls the segment over, and
    /// its latencies are printed apart from the other calls'.
    #[arg(long, default_value_t = 0)]
    advance_every: usize,
    /// Time one single-key call in N for the latency histogram (1: every call; reading the
    /// clock twice per call costs about as much as the call).
    #[arg(long, default_value_t = 8)]
    sample_every: usize,
    /// Size the tables for this many live keys up front (0: grow as needed).
    #[arg(long, default_value_t = 0)]
    expected_keys: u64,
    /// Keep the dedup tables on 4 KiB pages (the default maps tables of 2 MiB and more
    /// and advises them for transparent huge pages).
    #[arg(long)]
    small_pages: bool,
    /// Run the backend suite through the `Store` trait against: embedded, postgres://...,
    /// redis://... or redis+cluster://host:port,host:port,... (needs the binary built
    /// with the `async`, `postgres` or `redis` feature).
    #[arg(long)]
    backend: Option<String>,
    /// Concurrent client tasks for --backend.
    #[arg(long, default_value_t = 8)]
    tasks: usize,
    /// Replicate durable runs to NATS JetStream at this URL (several separated by
    /// commas): each run's store ships to a replica of its own.
    #[arg(long)]
    replicate: Option<String>,
    /// `sync` or `async`, with --replicate.
    #[arg(long, default_value = "sync", value_parser = crate::restore::parse_mode)]
    replica_mode: ReplicaMode,
    /// Stream replicas JetStream keeps, with --replicate.
    #[arg(long, default_value_t = oncedb::DEFAULT_REPLICAS, value_parser = crate::dedup::parse_copies)]
    replica_copies: usize,
    /// After a run with --replicate, restore its store from the replica into a new
    /// directory and time it.
    #[arg(long)]
    restore: bool,
    /// The changelog-style anchor for --restore: publish this many keys to the NATS
    /// server at --replicate, one message each, and time their replay into an empty
    /// store.
    #[arg(long)]
    changelog: Option<u64>,
    /// With --replicate: keep a standby of the store during the run (`Db::standby`),
    /// report its lag when the run ends, then time its promotion.
    #[arg(long)]
    standby: bool,
}

/// The operation mix.
#[derive(ValueEnum, Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// 16-byte ids through insert_if_absent / insert_many.
    Ids,
    /// Idempotency keys through reserve + complete.
    Records,
}

#[derive(Debug, Clone)]
struct Scenario {
    name: String,
    keys: usize,
    dup_rate: f64,
    threads: usize,
    batch: usize,
    durability: Option<Durability>,
    workload: Workload,
    reopen: bool,
}

/// One row of the summary.
struct Outcome {
    scenario: Scenario,
    elapsed: Duration,
    latency: Histogram<u64>,
    stats: Stats,
    rss_growth: u64,
    peak_rss: u64,
    reopen: Option<Duration>,
}

pub fn run(args: &BenchArgs) -> Result<(), Failure> {
    if let (Some(keys), Some(url)) = (args.changelog, &args.replicate) {
        return crate::changelog::measure(url, keys).map_err(Failure::from);
    }
    if let Some(backend) = &args.backend {
        return crate::backends::run(
            backend,
            args.keys,
            args.tasks,
            args.batch,
            args.dup_rate,
            args.window,
        );
    }
    let scenarios = if args.keys.is_none()
        && args.threads.is_none()
        && args.batch.is_none()
        && args.durability.is_none()
        && args.workload.is_none()
    {
        default_suite(args)
    } else {
        vec![scenario_from(args)?]
    };
    outln!(
        "oncedb bench: window {} s, bucket {} s, dup rate {:.0}%, keys generated as they go",
        args.window.as_secs_f64(),
        args.bucket.as_secs_f64(),
        args.dup_rate * 100.0
    )?;
    let mut outcomes = Vec::new();
    for scenario in scenarios {
        outcomes.push(run_scenario(args, scenario)?);
    }
    print_table(&outcomes)?;
    Ok(())
}

fn default_suite(args: &BenchArgs) -> Vec<Scenario> {
    let base = Scenario {
        name: String::new(),
        keys: 10_000_000,
        dup_rate: args.dup_rate,
        threads: 1,
        batch: 1024,
        durability: None,
        workload: Workload::Ids,
        reopen: false,
    };
    vec![
        Scenario {
            name: "memory, insert_many x1024".into(),
            ..base.clone()
        },
        Scenario {
            name: "memory, insert_if_absent".into(),
            batch: 1,
            keys: 5_000_000,
            ..base.clone()
        },
        Scenario {
            name: "memory, insert_many, 2 threads".into(),
            threads: 2,
            ..base.clone()
        },
        Scenario {
            name: "disk Interval(10ms), insert_many x1024".into(),
            keys: 5_000_000,
            durability: Some(Durability::Interval(Duration::from_millis(10))),
            reopen: true,
            ..base.clone()
        },
        Scenario {
            name: "disk Sync, insert_if_absent, 64 threads".into(),
            keys: 200_000,
            batch: 1,
            threads: 64,
            durability: Some(Durability::Sync),
            ..base.clone()
        },
        Scenario {
            name: "memory, records reserve+complete".into(),
            keys: 1_000_000,
            batch: 1,
            workload: Workload::Records,
            ..base
        },
    ]
}

/// A size flag: a number of bytes, or one with a unit (`KiB`, `MiB`, `GiB`, `TiB`;
/// `KB`, `MB`, `GB`, `TB` in powers of ten).
fn parse_bytes(text: &str) -> Result<u64, String> {
    let digits = text.trim().bytes().take_while(u8::is_ascii_digit).count();
    let (number, unit) = text.trim().split_at(digits);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("`{text}` is not a size: a number, optionally with KiB, MiB, GiB"))?;
    let scale: u64 = match unit.trim() {
        "" | "B" => 1,
        "KiB" => 1 << 10,
        "MiB" => 1 << 20,
        "GiB" => 1 << 30,
        "TiB" => 1 << 40,
        "KB" => 1_000,
        "MB" => 1_000_000,
        "GB" => 1_000_000_000,
        "TB" => 1_000_000_000_000,
        other => {
            return Err(format!(
                "unknown size unit `{other}` in `{text}`: KiB, MiB, GiB, TiB, KB, MB, GB, TB"
            ));
        }
    };
    number
        .checked_mul(scale)
        .ok_or_else(|| format!("`{text}` is too large"))
}

/// A duration flag: `24h`, `15m`, `500ms`, or a bare number of seconds.
fn parse_span(text: &str) -> Result<Duration, String> {
    if !text.is_empty() && text.bytes().all(|b| b.is_ascii_digit()) {
        let secs = text.parse().map_err(|_| format!("`{text}` is too large"))?;
        return Ok(Duration::from_secs(secs));
    }
    crate::duration::parse(text)
}

fn parse_durability(text: &str) -> Result<Option<Durability>, String> {
    match text {
        "memory" => Ok(None),
        "buffered" => Ok(Some(Durability::Buffered)),
        "sync" => Ok(Some(Durability::Sync)),
        _ => {
            let ms = text
                .strip_prefix("interval:")
                .and_then(|ms| ms.parse::<u64>().ok())
                .ok_or_else(|| {
                    format!("unknown durability {text:?}: memory, buffered, sync or interval:<ms>")
                })?;
            Ok(Some(Durability::Interval(Duration::from_millis(ms))))
        }
    }
}

fn scenario_from(args: &BenchArgs) -> Result<Scenario, String> {
    let durability = parse_durability(args.durability.as_deref().unwrap_or("memory"))?;
    let batch = args.batch.unwrap_or(1024);
    if batch == 0 || batch > oncedb::MAX_BATCH_KEYS {
        return Err(format!(
            "--batch must be between 1 and {}",
            oncedb::MAX_BATCH_KEYS
        ));
    }
    let threads = args.threads.unwrap_or(1).max(1);
    Ok(Scenario {
        name: format!(
            "{}, batch {batch}, {threads} thread(s)",
            args.durability.as_deref().unwrap_or("memory")
        ),
        keys: args.keys.unwrap_or(2_000_000),
        dup_rate: args.dup_rate,
        threads,
        batch,
        durability,
        workload: args.workload.unwrap_or(Workload::Ids),
        reopen: args.reopen,
    })
}

fn options(
    args: &BenchArgs,
    scenario: &Scenario,
    dir: Option<&PathBuf>,
    clock: Option<&ManualClock>,
) -> Options {
    let base = match dir {
        Some(dir) => Options::new(dir).durability(scenario.durability.unwrap_or(Durability::Sync)),
        None => Options::in_memory(),
    };
    let base = base
        .huge_pages(!args.small_pages)
        .window(args.window)
        .bucket_width(args.bucket);
    let base = match (args.memory_budget, dir) {
        (Some(budget), Some(_)) => base.memory_budget(budget),
        _ => base,
    };
    let base = match (&args.replicate, dir) {
        (Some(url), Some(_)) => base.replicate(
            Replication::new(url, replica_name(scenario))
                .mode(args.replica_mode)
                .replicas(args.replica_copies),
        ),
        _ => base,
    };
    let base = if args.response_bytes > 1 << 20 {
        base.max_response_bytes(args.response_bytes)
    } else {
        base
    };
    match clock {
        Some(clock) => base.clock(clock.clone()),
        None => base,
    }
}

/// The replica a run's store ships to: one per run of this process.
fn replica_name(scenario: &Scenario) -> String {
    format!("bench-{}-{}", std::process::id(), scenario.name.len())
}

/// With --standby and --replicate: a standby of the run's replica, in `dir` +
/// `.standby`.
fn start_standby(
    args: &BenchArgs,
    scenario: &Scenario,
    dir: Option<&PathBuf>,
) -> Result<Option<(oncedb::Standby, PathBuf)>, String> {
    let (true, Some(_), Some(dir)) = (args.standby, &args.replicate, dir) else {
        return Ok(None);
    };
    let target = dir.with_extension("standby");
    let _ = std::fs::remove_dir_all(&target);
    let standby =
        Db::standby(options(args, scenario, Some(&target), None)).map_err(|e| e.to_string())?;
    Ok(Some((standby, target)))
}

/// Reports how far `standby` is behind when the run ends, then promotes it (it claims
/// the replica: the run's store is refused its next write) and times the promotion.
fn time_promotion(
    standby: oncedb::Standby,
    lag: oncedb::StandbyLag,
    target: &std::path::Path,
) -> Result<(), String> {
    let started = Instant::now();
    let (db, report) = standby.promote().map_err(|e| e.to_string())?;
    let took = started.elapsed();
    noteln!(
        "   standby: {} chunks applied during the run, {} pending at its end; promoted after the run in {:.3} s ({} chunks in all, {} keys live)",
        lag.applied_messages,
        lag.pending_messages,
        took.as_secs_f64(),
        report.messages,
        db.stats().live_keys
    );
    drop(db);
    let _ = std::fs::remove_dir_all(target);
    Ok(())
}

/// Restores the run's store from its replica into `dir` + `-restored` and prints how
/// long it took.
/// Waits until the replica holds every live sealed run whole, so that the restore timed
/// next fetches them (the shipper lists the directory twice a second).
fn wait_for_runs_shipped(db: &Db) {
    let started = Instant::now();
    if db.stats().replication_runs_unshipped == 0 {
        return;
    }
    while db.stats().replication_runs_unshipped > 0 {
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    noteln!(
        "   replica: every sealed run shipped {:.3} s after the last write",
        started.elapsed().as_secs_f64()
    );
}

fn time_restore(
    args: &BenchArgs,
    scenario: &Scenario,
    dir: &std::path::Path,
) -> Result<(), String> {
    let target = dir.with_extension("restored");
    let _ = std::fs::remove_dir_all(&target);
    let started = Instant::now();
    let (db, report) = Db::restore(options(args, scenario, Some(&target), None), &mut |_, _| {})
        .map_err(|e| e.to_string())?;
    let took = started.elapsed();
    let keys = db.stats().live_keys + db.stats().sealed_keys;
    noteln!(
        "   restore: {keys} keys from {} messages ({} bytes of {} segments and {} sealed runs) in {:.3} s ({:.2} M keys/s)",
        report.messages,
        report.bytes,
        report.segments,
        report.runs,
        took.as_secs_f64(),
        keys as f64 / took.as_secs_f64() / 1e6
    );
    drop(db);
    let _ = std::fs::remove_dir_all(&target);
    Ok(())
}

fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 600_000_000_000, 3).expect("valid histogram bounds")
}

fn run_scenario(args: &BenchArgs, scenario: Scenario) -> Result<Outcome, String> {
    noteln!("== {}: {} operations", scenario.name, scenario.keys);
    let dir = scenario.durability.map(|_| {
        args.dir
            .clone()
            .unwrap_or_else(std::env::temp_dir)
            .join(format!(
                "oncedb-bench-{}-{}",
                std::process::id(),
                scenario.name.len()
            ))
    });
    if let Some(dir) = &dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    let clock = (args.advance_every > 0).then(|| ManualClock::new(SystemTime::now()));
    let rss_before = rss_bytes();
    let db = Db::open(
        options(args, &scenario, dir.as_ref(), clock.as_ref()).expected_keys(args.expected_keys),
    )
    .map_err(|e| e.to_string())?;
    let progress = ProgressBar::new(scenario.keys as u64);
    progress.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} ops {per_sec} eta {eta}")
            .expect("valid progress template"),
    );
    let started = Instant::now();
    let driver = Driver {
        scenario: &scenario,
        progress: &progress,
        sample_every: args.sample_every.max(1),
        clock: clock
            .as_ref()
            .map(|clock| (clock, args.advance_every, args.bucket)),
        response: response_body_of(args.response_bytes, 7),
        mismatch_every: mismatch_every(args.dup_rate, args.mismatch_rate),
    };
    let standby = start_standby(args, &scenario, dir.as_ref())?;
    let latencies = run_threads(&db, &driver)?;
    // How far the standby is behind as the run ends (it is promoted once the run's store
    // is closed).
    let standby_lag = standby
        .as_ref()
        .map(|(standby, _)| standby.lag())
        .transpose()
        .map_err(|err| err.to_string())?;
    check_admitted(args, &scenario, &latencies, started.elapsed())?;
    if scenario.workload == Workload::Records {
        check_retries(&latencies)?;
    }
    if !latencies.after_advance.is_empty() {
        for (label, histogram) in [
            ("first calls after an advance", &latencies.after_advance),
            ("all other calls", &latencies.others),
        ] {
            noteln!(
                "   {label:<28} {:>7}: p50 {} us, p99 {} us, p99.9 {} us, max {} us",
                histogram.len(),
                micros(histogram.value_at_quantile(0.5)),
                micros(histogram.value_at_quantile(0.99)),
                micros(histogram.value_at_quantile(0.999)),
                micros(histogram.max())
            );
        }
    }
    let latency = latencies.all;
    let elapsed = started.elapsed();
    progress.finish_and_clear();
    if scenario.workload == Workload::Records && args.advance_every == 0 {
        replay_sample(&db, &driver)?;
    }
    // The figures are taken; settle the store (the seal under way with a budget) so that
    // the summary counts every run.
    db.flush().map_err(|e| e.to_string())?;
    let stats = db.stats();
    if stats.sealed_record_runs > 0 {
        noteln!(
            "   sealed records: {} record runs holding {} records, {} records in memory; filters and fences of every run {:.1} MiB",
            stats.sealed_record_runs,
            stats.sealed_records,
            stats.live_records,
            stats.sealed_filter_bytes as f64 / f64::from(1 << 20),
        );
    }
    if stats.sealed_runs > 0 {
        noteln!(
            "   sealed: {} runs written, {} merges, {} live holding {} keys; filters and fences {:.1} MiB ({:.2} bytes a sealed key); {} keys in memory; writers waited at the budget {} times",
            stats.runs_sealed,
            stats.runs_merged,
            stats.sealed_runs,
            stats.sealed_keys,
            stats.sealed_filter_bytes as f64 / f64::from(1 << 20),
            stats.sealed_filter_bytes as f64 / stats.sealed_keys.max(1) as f64,
            stats.live_keys,
            stats.budget_waits
        );
    }
    if stats.commit_waits > 0 {
        noteln!(
            "   group commits: {:.2} waits an op ({} calls slept until a group commit covered them)",
            stats.commit_waits as f64 / scenario.keys.max(1) as f64,
            stats.commit_waits
        );
    }
    if scenario.workload == Workload::Records {
        noteln!(
            "   index: {:.1} MiB counted by the store, {:.1} bytes a live record",
            stats.index_bytes as f64 / f64::from(1 << 20),
            stats.index_bytes as f64 / stats.live_records.max(1) as f64
        );
    }
    let rss_growth = rss_bytes().saturating_sub(rss_before);
    let peak_rss = peak_rss_bytes();
    if args.restore && args.replicate.is_some() {
        wait_for_runs_shipped(&db);
    }
    let reopen = if scenario.reopen && dir.is_some() {
        drop(db);
        let started = Instant::now();
        let db = Db::open(options(args, &scenario, dir.as_ref(), clock.as_ref()))
            .map_err(|e| e.to_string())?;
        let took = started.elapsed();
        noteln!(
            "   reopen: {} keys rebuilt from {} log records in {:.3} s ({:.2} M keys/s)",
            db.stats().live_keys,
            db.stats().recovered_records,
            took.as_secs_f64(),
            db.stats().live_keys as f64 / took.as_secs_f64() / 1e6
        );
        Some(took)
    } else {
        drop(db);
        None
    };
    if let (true, Some(_), Some(dir)) = (args.restore, &args.replicate, &dir) {
        time_restore(args, &scenario, dir)?;
    }
    if let (Some((standby, target)), Some(lag)) = (standby, standby_lag) {
        time_promotion(standby, lag, &target)?;
    }
    if let Some(dir) = &dir {
        let _ = std::fs::remove_dir_all(dir);
    }
    Ok(Outcome {
        scenario,
        elapsed,
        latency,
        stats,
        rss_growth,
        peak_rss,
        reopen,
    })
}

/// The run's answers are exact: the store admitted (or acquired) each distinct key of
/// the stream once. Checked unless keys could expire during the run (the clock moved by a
/// window or more), when a repeat of an expired key is admitted again by design.
fn check_admitted(
    args: &BenchArgs,
    scenario: &Scenario,
    latencies: &Latencies,
    elapsed: Duration,
) -> Result<(), String> {
    let advances = if args.advance_every > 0 {
        scenario.keys.div_ceil(args.advance_every) as u32
    } else {
        0
    };
    let moved = args.bucket.saturating_mul(advances).max(elapsed);
    if moved >= args.window {
        noteln!(
            "   admitted {} of {} distinct keys: not checked, keys expired during the run",
            latencies.admitted,
            latencies.distinct
        );
        return Ok(());
    }
    if latencies.admitted != latencies.distinct {
        return Err(format!(
            "{}: admitted {} keys of a stream with {} distinct ones",
            scenario.name, latencies.admitted, latencies.distinct
        ));
    }
    noteln!(
        "   admitted {} of {} distinct keys: exact",
        latencies.admitted,
        latencies.distinct
    );
    Ok(())
}

/// What every writer thread shares.
struct Driver<'a> {
    scenario: &'a Scenario,
    progress: &'a ProgressBar,
    /// The manual clock, how many operations between advances, and by how much.
    clock: Option<(&'a ManualClock, usize, Duration)>,
    sample_every: usize,
    /// What a records run stores per completed key.
    response: Vec<u8>,
    /// Every how many repeats of a records run one is sent with another request (0:
    /// none).
    mismatch_every: u64,
}

/// Every how many repeats one is a mismatch, for `mismatch_rate` of the operations when
/// `dup_rate` of them are repeats.
fn mismatch_every(dup_rate: f64, mismatch_rate: f64) -> u64 {
    if mismatch_rate <= 0.0 || dup_rate <= 0.0 {
        return 0;
    }
    (dup_rate / mismatch_rate).round().max(1.0) as u64
}

/// The records run's retries were all answered as they must be: each replay byte for
/// byte, each mismatch refused (every repeat one or the other, unless keys expired).
fn check_retries(latencies: &Latencies) -> Result<(), String> {
    let Retries {
        repeats,
        replayed,
        mismatched,
        readmitted,
    } = latencies.retries;
    if readmitted == 0 && replayed + mismatched != repeats {
        return Err(format!(
            "{repeats} repeats answered {replayed} replays and {mismatched} mismatches"
        ));
    }
    noteln!(
        "   retries: {replayed} replayed byte for byte, {mismatched} mismatches refused, {readmitted} expired and admitted again: exact"
    );
    Ok(())
}

/// How the repeats of a records run were answered.
#[derive(Debug, Clone, Copy, Default)]
struct Retries {
    repeats: u64,
    /// Retries answered with the stored response, byte for byte.
    replayed: u64,
    /// Repeats with another request, answered `Mismatch`.
    mismatched: u64,
    /// Repeats whose key had expired (the clock moved by a window): a new record.
    readmitted: u64,
}

/// Latencies of all timed calls, of the first call after each clock advance (the one that
/// rolls the segment over to the new bucket and drops the expired one), and of the rest.
struct Latencies {
    all: Histogram<u64>,
    after_advance: Histogram<u64>,
    others: Histogram<u64>,
    /// Keys the store admitted (ids) or acquired (records).
    admitted: u64,
    /// Distinct keys of the stream.
    distinct: u64,
    retries: Retries,
}

fn run_threads(db: &Db, driver: &Driver<'_>) -> Result<Latencies, String> {
    let (keys, threads) = (driver.scenario.keys, driver.scenario.threads);
    let per_thread = keys.div_ceil(threads).max(1);
    let results: Vec<Result<Latencies, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|lane| {
                let ops = per_thread.min(keys.saturating_sub(lane * per_thread));
                s.spawn(move || run_lane(db, lane as u64, ops, driver))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("bench thread panicked"))
            .collect()
    });
    let mut merged = Latencies {
        all: new_histogram(),
        after_advance: new_histogram(),
        others: new_histogram(),
        admitted: 0,
        distinct: 0,
        retries: Retries::default(),
    };
    for result in results {
        let latencies = result?;
        merged.all.add(latencies.all).map_err(|e| e.to_string())?;
        merged
            .after_advance
            .add(latencies.after_advance)
            .map_err(|e| e.to_string())?;
        merged
            .others
            .add(latencies.others)
            .map_err(|e| e.to_string())?;
        merged.admitted += latencies.admitted;
        let (total, lane) = (&mut merged.retries, latencies.retries);
        total.repeats += lane.repeats;
        total.replayed += lane.replayed;
        total.mismatched += lane.mismatched;
        total.readmitted += lane.readmitted;
        merged.distinct += latencies.distinct;
    }
    Ok(merged)
}

/// One batch of a lane's stream: generated outside the timed call.
enum Batch {
    Ids(Vec<[u8; 16]>),
    /// Idempotency keys, and whether each repeats an earlier one.
    Keys(Vec<String>, Vec<bool>),
}

/// One writer thread: `ops` operations of key stream `lane`, generated batch by batch.
fn run_lane(db: &Db, lane: u64, ops: usize, driver: &Driver<'_>) -> Result<Latencies, String> {
    let (scenario, progress) = (driver.scenario, driver.progress);
    let mut stream = KeyStream::new(scenario.dup_rate, 42, lane);
    let mut since_advance = 0;
    let mut just_advanced = false;
    let mut after_advance = new_histogram();
    let mut others = new_histogram();
    let mut latency = new_histogram();
    let mut answers = Vec::with_capacity(scenario.batch);
    let mut retries = Retries::default();
    let scope = Scope::new("bench", "create_payment");
    let step = scenario.batch.max(1);
    let mut batch = match scenario.workload {
        Workload::Ids => Batch::Ids(Vec::with_capacity(step)),
        Workload::Records => Batch::Keys(Vec::with_capacity(step), Vec::with_capacity(step)),
    };
    let (mut since_report, mut admitted, mut done) = (0, 0u64, 0);
    for call in 0.. {
        let len = step.min(ops - done);
        if len == 0 {
            break;
        }
        match &mut batch {
            Batch::Ids(ids) => stream.fill_ids(len, ids),
            Batch::Keys(keys, repeats) => stream.fill_idempotency_keys_marked(len, keys, repeats),
        }
        let timed = step > 1 || just_advanced || call % driver.sample_every == 0;
        let started = timed.then(Instant::now);
        admitted += match &batch {
            Batch::Keys(keys, repeats) => {
                reserve_checked(db, (&scope, keys, repeats), driver, &mut retries)?
            }
            Batch::Ids(ids) if step == 1 => {
                u64::from(db.insert_if_absent(&ids[0]).map_err(|e| e.to_string())?)
            }
            Batch::Ids(ids) => {
                db.insert_many_into(ids, &mut answers)
                    .map_err(|e| e.to_string())?;
                answers.iter().filter(|&&new| new).count() as u64
            }
        };
        if let Some(started) = started {
            let nanos = started.elapsed().as_nanos() as u64;
            latency.saturating_record(nanos);
            if just_advanced {
                after_advance.saturating_record(nanos);
            } else {
                others.saturating_record(nanos);
            }
        }
        just_advanced = false;
        done += len;
        since_report += len;
        since_advance += len;
        if let Some((clock, every, by)) = driver.clock
            && since_advance >= every
        {
            clock.forward(by);
            since_advance = 0;
            just_advanced = true;
        }
        if since_report >= 65_536 {
            progress.inc(since_report as u64);
            since_report = 0;
        }
    }
    progress.inc(since_report as u64);
    Ok(Latencies {
        all: latency,
        after_advance,
        others,
        admitted,
        distinct: stream.distinct(),
        retries,
    })
}

/// Reserve + complete for each new key; each repeat must replay the stored response
/// byte for byte, or, for every `mismatch_every`-th repeat (sent with another request),
/// answer `Mismatch`. Returns how many keys were acquired.
fn reserve_checked(
    db: &Db,
    (scope, keys, repeats): (&Scope, &[String], &[bool]),
    driver: &Driver<'_>,
    retries: &mut Retries,
) -> Result<u64, String> {
    let mut acquired = 0;
    for (key, &repeat) in keys.iter().zip(repeats) {
        retries.repeats += u64::from(repeat);
        let mismatch = repeat
            && driver.mismatch_every > 0
            && retries.repeats.is_multiple_of(driver.mismatch_every);
        let request = if mismatch {
            b"another request"
        } else {
            key.as_bytes()
        };
        let answer = db
            .reserve(scope, key.as_bytes(), request)
            .map_err(|e| e.to_string())?;
        match answer {
            Reservation::Acquired(lease) if mismatch => {
                // An expired key: no record is left bound to the other request.
                lease.release().map_err(|e| e.to_string())?;
                retries.readmitted += 1;
            }
            Reservation::Acquired(lease) => {
                lease
                    .complete(&driver.response)
                    .map_err(|e| e.to_string())?;
                acquired += 1;
                retries.readmitted += u64::from(repeat);
            }
            Reservation::Mismatch if mismatch => retries.mismatched += 1,
            Reservation::Completed(record)
                if repeat && !mismatch && record.response() == Some(&driver.response[..]) =>
            {
                retries.replayed += 1;
            }
            other => {
                return Err(format!(
                    "{key} (repeat {repeat}, mismatch {mismatch}) answered {other:?}"
                ));
            }
        }
    }
    Ok(acquired)
}

/// Replays the first keys of lane 0's stream (each a retry of a completed record),
/// timing every call and checking every replayed response, byte for byte.
/// Replays the first and the last keys the first thread reserved, each answer checked
/// byte for byte: the oldest records (sealed into record runs when a memory budget made
/// the store seal them) and the newest (in memory).
fn replay_sample(db: &Db, driver: &Driver<'_>) -> Result<(), String> {
    const REPLAYS: usize = 100_000;
    let ops = driver.scenario.keys.div_ceil(driver.scenario.threads);
    let sample = ops.min(REPLAYS);
    let mut stream = KeyStream::new(driver.scenario.dup_rate, 42, 0);
    let (mut oldest, mut newest) = (Vec::with_capacity(sample), Vec::with_capacity(sample));
    stream.fill_idempotency_keys(sample, &mut oldest);
    let mut left = ops - sample;
    while left > 0 {
        let chunk = left.min(REPLAYS);
        stream.fill_idempotency_keys(chunk, &mut newest);
        left -= chunk;
    }
    let sealed = db.stats().sealed_records > 0;
    let label = if sealed { "oldest (sealed)" } else { "oldest" };
    replay_keys(db, driver, &oldest, label)?;
    if !newest.is_empty() {
        replay_keys(db, driver, &newest, "newest (in memory)")?;
    }
    Ok(())
}

/// Replays `keys` and prints the latency percentiles under `label`.
fn replay_keys(db: &Db, driver: &Driver<'_>, keys: &[String], label: &str) -> Result<(), String> {
    let scope = Scope::new("bench", "create_payment");
    let mut histogram = new_histogram();
    for key in keys {
        let started = Instant::now();
        let answer = db
            .reserve(&scope, key.as_bytes(), key.as_bytes())
            .map_err(|e| e.to_string())?;
        histogram.saturating_record(started.elapsed().as_nanos() as u64);
        match answer {
            Reservation::Completed(record) if record.response() == Some(&driver.response[..]) => {}
            other => return Err(format!("a replay of {key} answered {other:?}")),
        }
    }
    noteln!(
        "   replay {:>7} {label} completed records: p50 {} us, p99 {} us, p99.9 {} us, max {} us",
        histogram.len(),
        micros(histogram.value_at_quantile(0.5)),
        micros(histogram.value_at_quantile(0.99)),
        micros(histogram.value_at_quantile(0.999)),
        micros(histogram.max())
    );
    Ok(())
}

fn micros(ns: u64) -> String {
    format!("{:.1}", ns as f64 / 1_000.0)
}

fn print_table(outcomes: &[Outcome]) -> Result<(), Failure> {
    outln!(
        "{:<42} {:>10} {:>9} {:>9} {:>9} {:>10} {:>8} {:>9} {:>8} {:>9} {:>9} {:>8}",
        "scenario",
        "Mops/s",
        "p50 us",
        "p99 us",
        "p99.9 us",
        "max us",
        "B/live",
        "peak MiB",
        "fsyncs",
        "ops/fsync",
        "reopen s",
        "probes"
    )?;
    for outcome in outcomes {
        let scenario = &outcome.scenario;
        let ops_per_sec = scenario.keys as f64 / outcome.elapsed.as_secs_f64();
        let latency = &outcome.latency;
        let live = outcome.stats.live_keys
            + outcome.stats.live_records
            + outcome.stats.sealed_keys
            + outcome.stats.sealed_records;
        let bytes_per_key = if live > 0 {
            format!("{:.1}", outcome.rss_growth as f64 / live as f64)
        } else {
            "-".into()
        };
        let (fsyncs, per_fsync) = match outcome.stats.fsyncs {
            0 => ("-".to_string(), "-".to_string()),
            n => (
                n.to_string(),
                format!("{:.1}", scenario.keys as f64 / n as f64),
            ),
        };
        outln!(
            "{:<42} {:>10.3} {:>9} {:>9} {:>9} {:>10} {:>8} {:>9} {:>8} {:>9} {:>9} {:>8.2}",
            scenario.name,
            ops_per_sec / 1e6,
            micros(latency.value_at_quantile(0.5)),
            micros(latency.value_at_quantile(0.99)),
            micros(latency.value_at_quantile(0.999)),
            micros(latency.max()),
            bytes_per_key,
            outcome.peak_rss / (1 << 20),
            fsyncs,
            per_fsync,
            outcome
                .reopen
                .map_or("-".into(), |d| format!("{:.2}", d.as_secs_f64())),
            outcome.stats.table_probes as f64 / scenario.keys as f64,
        )?;
    }
    outln!(
        "latency is per call: one key (sampled per --sample-every), one batch, or one reserve + complete; B/live: resident bytes the run added per live key or record; peak MiB: the process's peak resident set; probes: table slots read per op"
    )
}
