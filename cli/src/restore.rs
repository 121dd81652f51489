//! `oncedb restore`: rebuilds a store in a new directory from its replica on NATS
//! JetStream (`Db::restore`), with a progress bar on a terminal, and claims the replica:
//! the store that shipped it is refused every write from then on.

use crate::output::Failure;
use std::io::IsTerminal;
use std::path::PathBuf;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use oncedb::{Db, Durability, Options, ReplicaMode, Replication};

/// Where a replica is read from: what `oncedb restore` and `oncedb standby` share.
#[derive(clap::Args, Debug)]
pub struct ReplicaSource {
    /// The NATS servers holding the replica (`nats://HOST:PORT`, several separated by
    /// commas).
    #[arg(long)]
    pub from: String,
    /// The replica's name, as the store that shipped it was given (`--replica`).
    #[arg(long)]
    pub replica: String,
    /// The copies JetStream keeps of the replica's stream, as the store that shipped it
    /// was given (`--replica-copies`).
    #[arg(long, default_value_t = oncedb::DEFAULT_REPLICAS, value_parser = crate::dedup::parse_copies)]
    pub replica_copies: usize,
}

impl ReplicaSource {
    /// A sync-mode store in `dir` replicating to this replica.
    pub fn options(&self, dir: &std::path::Path) -> Options {
        Options::new(dir)
            .durability(Durability::Sync)
            .replicate(Replication::new(&self.from, &self.replica).replicas(self.replica_copies))
    }
}

/// Arguments of `oncedb restore`.
#[derive(clap::Args, Debug)]
pub struct RestoreArgs {
    #[command(flatten)]
    source: ReplicaSource,
    /// Where the store is rebuilt: a new or empty directory.
    #[arg(long)]
    dir: PathBuf,
}

/// `sync` or `async`.
pub fn parse_mode(text: &str) -> Result<ReplicaMode, String> {
    match text {
        "sync" => Ok(ReplicaMode::Sync),
        "async" => Ok(ReplicaMode::Async),
        _ => Err(format!("`{text}` is not sync or async")),
    }
}

/// Fetches the replica, opens the store (checking every frame) and claims the replica.
pub fn run(args: &RestoreArgs) -> Result<(), Failure> {
    let options = args.source.options(&args.dir);
    let bar = progress_bar();
    let restored = Db::restore(options, &mut |read, total| {
        bar.set_length(total);
        bar.set_position(read);
    });
    bar.finish_and_clear();
    let (db, report) = restored?;
    db.flush()?;
    let stats = db.stats();
    outln!(
        "restored {} from {}: {} segments and {} sealed runs, {} bytes from {} messages ({} of expired buckets skipped); {} keys and {} records live",
        args.dir.display(),
        args.source.replica,
        report.segments,
        report.runs,
        report.bytes,
        report.messages,
        report.expired_messages,
        stats.live_keys + stats.sealed_keys,
        stats.live_records
    )?;
    Ok(())
}

fn progress_bar() -> ProgressBar {
    if !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} messages, {per_sec}")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}
