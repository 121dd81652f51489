//! `oncedb`: command-line tools for oncedb. `oncedb bench` measures throughput, latency,
//! memory per key and fsync batching on this machine.
#![forbid(unsafe_code)]

mod cli;

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
    Bench(cli::bench::BenchArgs),
}

fn main() {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Bench(args) => cli::bench::run(&args),
    };
    if let Err(err) = result {
        eprintln!("oncedb: {err}");
        std::process::exit(1);
    }
}
