//! `oncedb verify --dir D`: a summary of every segment, and one line naming the first
//! damaged file and byte.

use crate::output::Failure;
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

/// Runs the check and prints the report. A closed stdout does not change the exit
/// code: it says what the check found.
pub fn run(args: &VerifyArgs) -> ExitCode {
    let report = match oncedb::verify(&args.dir) {
        Ok(report) => report,
        Err(err) => {
            noteln!("oncedb verify: {}: {err}", args.dir.display());
            return ExitCode::from(UNUSABLE);
        }
    };
    let damage = report.first_damage();
    let printed = print(args, &report, damage.as_ref());
    if let Err(Failure::Message(err)) = printed {
        noteln!("oncedb verify: {err}");
        return ExitCode::from(UNUSABLE);
    }
    match damage {
        None => ExitCode::SUCCESS,
        Some(_) => ExitCode::from(DAMAGED),
    }
}

fn print(
    args: &VerifyArgs,
    report: &oncedb::VerifyReport,
    damage: Option<&(std::path::PathBuf, u64, String)>,
) -> Result<(), Failure> {
    out!("{report}")?;
    match damage {
        None => outln!(
            "{}: clean ({} segments)",
            args.dir.display(),
            report.segments.len()
        ),
        Some((path, offset, reason)) => {
            outln!("DAMAGED: {} at byte {offset}: {reason}", path.display())
        }
    }
}
