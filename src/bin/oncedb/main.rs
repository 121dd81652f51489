//! `oncedb`: command-line tools for oncedb. `oncedb bench` measures throughput, latency,
//! memory per key and fsync batching on this machine; `oncedb verify` checks a store's
//! files without changing them.

mod bench;
mod verify;
mod workload;

use std::process::ExitCode;

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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Bench(args) => match bench::run(&args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(err) => {
                eprintln!("oncedb: {err}");
                ExitCode::FAILURE
            }
        },
        Command::Verify(args) => verify::run(&args),
    }
}
