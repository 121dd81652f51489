//! The baseline for `oncedb bench` at large sizes: the same key stream (seed 42, lane 0,
//! the same repeat rate) admitted into fjall 3, one `contains_key` and, when absent, one
//! `insert` per key, with a `persist(SyncAll)` at most every `--persist-ms` milliseconds
//! (the counterpart of `--durability interval:10`), and a block cache of `--cache-mib`
//! (1024 by default, the memory budget oncedb is given at this size).
//!
//! ```sh
//! cargo run --release --example fjall_baseline -- --keys 200000000 --dir D [--dup-rate 0.2]
//! ```
//!
//! It prints admitted against distinct (exact, or it fails), throughput, the p99 and max
//! batch, and the peak RSS; every 5 M operations a progress line on stderr.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use oncedb_testkit::workload::{KeyStream, peak_rss_bytes};

/// Operations between two progress lines on stderr.
const PROGRESS_EVERY: u64 = 5_000_000;

/// Parsed command line.
struct Args {
    keys: u64,
    dir: PathBuf,
    dup_rate: f64,
    batch: usize,
    persist_ms: u64,
    cache_mib: u64,
}

fn parse_args() -> Result<Args, String> {
    let mut args = Args {
        keys: 1_000_000,
        dir: PathBuf::new(),
        dup_rate: 0.2,
        batch: 1024,
        persist_ms: 10,
        cache_mib: 1024,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let value = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {value}: {e}");
        match flag.as_str() {
            "--keys" => args.keys = value.parse().map_err(|e| bad(&e))?,
            "--dir" => args.dir = PathBuf::from(&value),
            "--dup-rate" => args.dup_rate = value.parse().map_err(|e| bad(&e))?,
            "--batch" => args.batch = value.parse().map_err(|e| bad(&e))?,
            "--persist-ms" => args.persist_ms = value.parse().map_err(|e| bad(&e))?,
            "--cache-mib" => args.cache_mib = value.parse().map_err(|e| bad(&e))?,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if args.dir.as_os_str().is_empty() {
        return Err("--dir is required".into());
    }
    if args.batch == 0 {
        return Err("--batch must be at least 1".into());
    }
    Ok(args)
}

/// What one run measured.
struct Outcome {
    admitted: u64,
    distinct: u64,
    elapsed: Duration,
    batch_nanos: Vec<u64>,
}

fn run(args: &Args) -> Result<Outcome, fjall::Error> {
    let db = fjall::Database::builder(&args.dir)
        .cache_size(args.cache_mib << 20)
        .open()?;
    let keyspace = db.keyspace("ids", fjall::KeyspaceCreateOptions::default)?;
    let mut stream = KeyStream::new(args.dup_rate, 42, 0);
    let mut ids = Vec::with_capacity(args.batch);
    let mut batch_nanos = Vec::new();
    let (mut admitted, mut done) = (0u64, 0u64);
    let persist_every = Duration::from_millis(args.persist_ms);
    let started = Instant::now();
    let mut persisted = started;
    while done < args.keys {
        let len = usize::try_from((args.keys - done).min(args.batch as u64)).unwrap_or(args.batch);
        stream.fill_ids(len, &mut ids);
        let batch_started = Instant::now();
        for id in &ids {
            if !keyspace.contains_key(id)? {
                keyspace.insert(id, [])?;
                admitted += 1;
            }
        }
        if persisted.elapsed() >= persist_every {
            db.persist(fjall::PersistMode::SyncAll)?;
            persisted = Instant::now();
        }
        batch_nanos.push(u64::try_from(batch_started.elapsed().as_nanos()).unwrap_or(u64::MAX));
        let before = done;
        done += len as u64;
        if done / PROGRESS_EVERY != before / PROGRESS_EVERY {
            eprintln!(
                "fjall: {done} ops, {admitted} held, {:.3} M ops/s so far",
                done as f64 / started.elapsed().as_secs_f64() / 1e6
            );
        }
    }
    db.persist(fjall::PersistMode::SyncAll)?;
    Ok(Outcome {
        admitted,
        distinct: stream.distinct(),
        elapsed: started.elapsed(),
        batch_nanos,
    })
}

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(args) => args,
        Err(message) => {
            eprintln!("fjall_baseline: {message}");
            return ExitCode::from(2);
        }
    };
    let mut outcome = match run(&args) {
        Ok(outcome) => outcome,
        Err(e) => {
            eprintln!("fjall_baseline: {e}");
            return ExitCode::FAILURE;
        }
    };
    outcome.batch_nanos.sort_unstable();
    // The batch time at `permille` thousandths of the sorted list (1000 is the maximum).
    let at = |permille: usize| {
        let n = outcome.batch_nanos.len();
        let index = (n * permille / 1000).min(n.saturating_sub(1));
        outcome.batch_nanos.get(index).copied().unwrap_or(0)
    };
    println!(
        "fjall: {} ops, admitted {} of {} distinct, {:.3} M ops/s, batch p99 {:.2} ms, max {:.1} ms, peak RSS {} MiB",
        args.keys,
        outcome.admitted,
        outcome.distinct,
        args.keys as f64 / outcome.elapsed.as_secs_f64() / 1e6,
        at(990) as f64 / 1e6,
        at(1000) as f64 / 1e6,
        peak_rss_bytes() >> 20,
    );
    if outcome.admitted == outcome.distinct {
        ExitCode::SUCCESS
    } else {
        eprintln!("fjall_baseline: admitted differs from the distinct keys of the stream");
        ExitCode::FAILURE
    }
}
