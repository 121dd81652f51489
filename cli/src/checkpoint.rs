//! `oncedb checkpoint`: a consistent copy of a store into a new directory, openable on
//! its own (`Db::checkpoint`). Sealed segments and runs are hard links where the file
//! system allows; the active segment and the manifest are copied and fsynced.

use crate::output::Failure;
use std::path::PathBuf;

use oncedb::{Db, Options};

/// Arguments of `oncedb checkpoint`.
#[derive(clap::Args, Debug)]
pub struct CheckpointArgs {
    /// The store's directory.
    #[arg(long)]
    dir: PathBuf,
    /// Where the copy goes: a new or empty directory.
    #[arg(long)]
    to: PathBuf,
}

/// Opens the store (taking its lock, like any open), copies it, and prints where the
/// copy's log ends and how its files got there.
pub fn run(args: &CheckpointArgs) -> Result<(), Failure> {
    let options = Options::from_dir(&args.dir)?;
    let db = Db::open(options)?;
    let checkpoint = db.checkpoint(&args.to)?;
    let position = checkpoint.position;
    outln!(
        "checkpoint {} -> {}: log up to segment {}-{} byte {}; {} files linked, {} copied ({} bytes)",
        args.dir.display(),
        args.to.display(),
        position.bucket,
        position.seq,
        position.offset,
        checkpoint.files_linked,
        checkpoint.files_copied,
        checkpoint.bytes_copied
    )?;
    Ok(())
}
