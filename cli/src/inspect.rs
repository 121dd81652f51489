//! `oncedb inspect`: the buckets of a store with their time ranges, contents, bytes and
//! expiry; the records in flight with their age and note; the settings the store was
//! created with. `--json` for machines.

use crate::output::Failure;
use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oncedb::{Db, Options};
use serde_json::json;

/// Arguments of `oncedb inspect`.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// The store's directory.
    #[arg(long)]
    dir: PathBuf,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    json: bool,
}

fn unix_ms(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

fn age_secs(since: SystemTime) -> u64 {
    SystemTime::now()
        .duration_since(since)
        .map_or(0, |age| age.as_secs())
}

fn lossy(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

/// Opens the store (taking its lock, like any open) and prints what it holds; an archive
/// of expired segments is read without opening it, segment by segment.
pub fn run(args: &InspectArgs) -> Result<(), Failure> {
    if oncedb::is_archive(&args.dir).map_err(|err| err.to_string())? {
        return archive(args);
    }
    let options = Options::from_dir(&args.dir).map_err(|err| err.to_string())?;
    let db = Db::open(options).map_err(|err| err.to_string())?;
    let (window, bucket) = (db.window(), db.bucket_width());
    let buckets = db.buckets();
    let in_flight = db.in_flight(Duration::ZERO);
    let stats = db.stats();
    if args.json {
        let report = json!({
            "dir": args.dir.display().to_string(),
            "window_ms": u64::try_from(window.as_millis()).unwrap_or(u64::MAX),
            "bucket_ms": u64::try_from(bucket.as_millis()).unwrap_or(u64::MAX),
            "live_keys": stats.live_keys,
            "live_records": stats.live_records,
            "live_aggregates": stats.live_aggregates,
            "bytes_on_disk": stats.bytes_on_disk,
            "segments": stats.segments,
            "buckets": buckets.iter().map(|b| json!({
                "start_ms": unix_ms(b.start),
                "end_ms": unix_ms(b.end),
                "expires_ms": unix_ms(b.expires),
                "keys": b.keys,
                "records": b.records,
                "aggregates": b.aggregates,
                "bytes": b.bytes,
            })).collect::<Vec<_>>(),
            "in_flight": in_flight.iter().map(|r| json!({
                "tenant": lossy(r.scope.tenant()),
                "operation": lossy(r.scope.operation()),
                "key": lossy(&r.key),
                "since_ms": unix_ms(r.since),
                "age_s": age_secs(r.since),
                "epoch": r.epoch,
                "note": r.note.as_deref().map(lossy),
            })).collect::<Vec<_>>(),
        });
        outln!("{report:#}")?;
        return Ok(());
    }
    outln!("store {}", args.dir.display())?;
    outln!(
        "  window {:?} in buckets of {:?}; {} keys, {} records, {} aggregates live; {} bytes in {} segments",
        window,
        bucket,
        stats.live_keys,
        stats.live_records,
        stats.live_aggregates,
        stats.bytes_on_disk,
        stats.segments
    )?;
    outln!("buckets (unix ms)")?;
    outln!(
        "  {:>15} {:>15} {:>15} {:>10} {:>8} {:>10} {:>12}",
        "start",
        "end",
        "expires",
        "keys",
        "records",
        "aggregates",
        "bytes"
    )?;
    for b in &buckets {
        outln!(
            "  {:>15} {:>15} {:>15} {:>10} {:>8} {:>10} {:>12}",
            unix_ms(b.start),
            unix_ms(b.end),
            unix_ms(b.expires),
            b.keys,
            b.records,
            b.aggregates,
            b.bytes
        )?;
    }
    outln!("records in flight: {}", in_flight.len())?;
    for r in &in_flight {
        outln!(
            "  {}/{} key {:?}: {} s in flight, epoch {}{}",
            lossy(r.scope.tenant()),
            lossy(r.scope.operation()),
            lossy(&r.key),
            age_secs(r.since),
            r.epoch,
            r.note
                .as_deref()
                .map(|note| format!(", note {:?}", lossy(note)))
                .unwrap_or_default()
        )?;
    }
    Ok(())
}

/// An archive: what each expired segment holds, as `verify` reads it.
fn archive(args: &InspectArgs) -> Result<(), Failure> {
    let report = oncedb::verify(&args.dir).map_err(|err| err.to_string())?;
    if args.json {
        let segments: Vec<_> = report
            .segments
            .iter()
            .map(|s| {
                json!({
                    "bucket": s.bucket,
                    "seq": s.seq,
                    "bytes": s.bytes,
                    "keys": s.keys,
                    "records": s.records,
                    "finishes": s.finishes,
                    "versions": s.versions,
                    "sealed": s.sealed,
                })
            })
            .collect();
        let report = json!({
            "archive": args.dir.display().to_string(),
            "clean": report.is_clean(),
            "segments": segments,
        });
        outln!("{report:#}")?;
        return Ok(());
    }
    outln!(
        "archive {} ({} segments, {})",
        args.dir.display(),
        report.segments.len(),
        if report.is_clean() {
            "clean"
        } else {
            "damaged: run oncedb verify"
        }
    )?;
    outln!(
        "  {:>20} {:>10} {:>12} {:>10} {:>8} {:>9} {:>9}",
        "bucket",
        "seq",
        "bytes",
        "keys",
        "records",
        "finishes",
        "versions"
    )?;
    for s in &report.segments {
        outln!(
            "  {:>20} {:>10} {:>12} {:>10} {:>8} {:>9} {:>9}",
            s.bucket,
            s.seq,
            s.bytes,
            s.keys,
            s.records,
            s.finishes,
            s.versions
        )?;
    }
    Ok(())
}
