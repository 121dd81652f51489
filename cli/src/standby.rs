//! `oncedb standby`: keeps a warm copy of a replica in a directory (`Db::standby`), its
//! lag on stderr every second, until its standard input ends (a supervisor closes it, or
//! Ctrl-D); then, with `--promote`, copies only what it still lacks, opens the store and
//! claims the replica. Without `--promote` the directory keeps its progress, and a later
//! `oncedb standby` on it resumes from there.

use crate::output::Failure;
use std::io::Read;
use std::path::PathBuf;
use std::sync::mpsc::RecvTimeoutError;
use std::time::Duration;

use oncedb::Db;

/// Arguments of `oncedb standby`.
#[derive(clap::Args, Debug)]
pub struct StandbyArgs {
    #[command(flatten)]
    source: crate::restore::ReplicaSource,
    /// The standby's directory: new, empty, or a standby's from an earlier run.
    #[arg(long)]
    dir: PathBuf,
    /// Once standard input ends, promote: take the replica over and open the store.
    #[arg(long)]
    promote: bool,
}

/// How often the lag is reported.
const REPORT_EVERY: Duration = Duration::from_secs(1);

/// Follows the replica until standard input ends, then promotes or stops.
pub fn run(args: &StandbyArgs) -> Result<(), Failure> {
    let standby = Db::standby(args.source.options(&args.dir))?;
    let (ended, input_ended) = std::sync::mpsc::channel::<()>();
    std::thread::spawn(move || {
        // Reads (and drops) standard input to its end: the signal to stop following.
        let _ = std::io::copy(
            &mut std::io::stdin().lock().take(u64::MAX),
            &mut std::io::sink(),
        );
        let _ = ended.send(());
    });
    while let Err(RecvTimeoutError::Timeout) = input_ended.recv_timeout(REPORT_EVERY) {
        match standby.lag() {
            Ok(lag) => noteln!(
                "standby {}: {} chunks applied, {} pending",
                args.source.replica,
                lag.applied_messages,
                lag.pending_messages
            ),
            Err(err) => noteln!("standby {}: {err}", args.source.replica),
        }
    }
    if !args.promote {
        drop(standby);
        outln!(
            "standby {} stopped; {} resumes from here",
            args.source.replica,
            args.dir.display()
        )?;
        return Ok(());
    }
    let (db, report) = standby.promote()?;
    db.flush()?;
    let stats = db.stats();
    outln!(
        "promoted {} from {}: {} bytes from {} messages at promotion; {} keys and {} records live",
        args.dir.display(),
        args.source.replica,
        report.bytes,
        report.messages,
        stats.live_keys + stats.sealed_keys,
        stats.live_records
    )?;
    Ok(())
}
