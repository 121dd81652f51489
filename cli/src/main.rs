//! `oncedb`: command-line tools for oncedb. `oncedb dedup` is a persistent `uniq` for
//! event streams; `oncedb inspect` shows what a store holds; `oncedb checkpoint` copies
//! a store consistently into a new directory; `oncedb restore` rebuilds one from its
//! replica on NATS JetStream, and `oncedb standby` keeps a warm copy of it to promote;
//! `oncedb verify` checks a
//! store's files without changing them; `oncedb bench` measures throughput, latency,
//! memory per key and fsync batching on this machine.

#[macro_use]
mod output;
mod backends;
mod bench;
mod changelog;
mod checkpoint;
mod dedup;
mod duration;
mod inspect;
mod restore;
mod standby;
mod verify;

use std::process::ExitCode;

/// The tool's allocator. Sealing and merging under a memory budget free large blocks
/// (tables, section buffers, filter builds) between long-lived filters; glibc's `malloc`
/// keeps most of that freed memory resident (measured in docs/performance.md, "One
/// billion keys"), mimalloc gives it back to the system.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "oncedb",
    version,
    about = "oncedb: deduplication windows and idempotency records"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a benchmark workload and print a summary table.
    Bench(bench::BenchArgs),
    /// Check every file of a store without changing it. Exits 0 when clean, 1 when
    /// damaged, 2 on bad arguments or a directory that cannot be read or is in use.
    Verify(verify::VerifyArgs),
    /// Pass each stdin line whose key was not seen within the window to stdout, and
    /// remember the keys across runs.
    Dedup(dedup::DedupArgs),
    /// Show a store's buckets, records in flight and settings.
    Inspect(inspect::InspectArgs),
    /// Copy a store into a new directory, consistently, as one that opens on its own.
    Checkpoint(checkpoint::CheckpointArgs),
    /// Rebuild a store in a new directory from its replica on NATS JetStream, and claim
    /// the replica.
    Restore(restore::RestoreArgs),
    /// Keep a warm copy of a replica until standard input ends, then (with `--promote`)
    /// take the replica over.
    Standby(standby::StandbyArgs),
}

/// Exit code for bad arguments.
const USAGE: u8 = 2;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(err) if !err.use_stderr() => {
            // --help and --version.
            let _ = err.print();
            return ExitCode::SUCCESS;
        }
        Err(err) => {
            let text = err.to_string();
            let first = text.lines().next().unwrap_or("bad arguments");
            noteln!("oncedb: {}", first.trim_start_matches("error: "));
            return ExitCode::from(USAGE);
        }
    };
    let (name, result) = match cli.command {
        Command::Bench(args) => ("bench", bench::run(&args)),
        Command::Verify(args) => return verify::run(&args),
        Command::Dedup(args) => ("dedup", dedup::run(&args)),
        Command::Inspect(args) => ("inspect", inspect::run(&args)),
        Command::Checkpoint(args) => ("checkpoint", checkpoint::run(&args)),
        Command::Restore(args) => ("restore", restore::run(&args)),
        Command::Standby(args) => ("standby", standby::run(&args)),
    };
    match result {
        Ok(()) | Err(output::Failure::Closed) => ExitCode::SUCCESS,
        Err(output::Failure::Message(err)) => {
            noteln!("oncedb {name}: {err}");
            ExitCode::FAILURE
        }
    }
}
