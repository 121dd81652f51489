//! `oncedb verify --dir D`: a summary of every segment, and one line naming the first
//! damaged file and byte.

use std::path::PathBuf;
use std::process::ExitCode;

/// Arguments of `oncedb verify`.
#[derive(clap::Args, Debug)]
pub struct VerifyArgs {
    /// The store's directory.
    #[arg(long)]
    dir: PathBuf,
}

/// Exit code for a store with damage.
const DAMAGED: u8 = 1;
/// Exit code for a directory that cannot be checked.
const UNUSABLE: u8 = 2;

/// Runs the check and prints the report.
pub fn run(args: &VerifyArgs) -> ExitCode {
    let report = match oncedb::verify(&args.dir) {
        Ok(report) => report,
        Err(err) => {
            eprintln!("oncedb verify: {}: {err}", args.dir.display());
            return ExitCode::from(UNUSABLE);
        }
    };
    print!("{report}");
    match report.first_damage() {
        None => {
            println!(
                "{}: clean ({} segments)",
                args.dir.display(),
                report.segments.len()
            );
            ExitCode::SUCCESS
        }
        Some((path, offset, reason)) => {
            println!("DAMAGED: {} at byte {offset}: {reason}", path.display());
            ExitCode::from(DAMAGED)
        }
    }
}
