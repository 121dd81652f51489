//! The log: the on-disk format (segment names, headers, frames, entries, the manifest),
//! the journal that appends to it, and the scan that reads it back for recovery and
//! `verify`.
//!
//! Below the engine, above `base` and `io`: it knows fingerprints, buckets and lease
//! endings, and nothing of the index or the API.

mod archive;
mod checkpoint;
mod entry;
mod format;
mod journal;
mod manifest;
mod names;
mod report;
mod response;
mod run;
mod scan;
mod verify;

pub(crate) use archive::prepare as prepare_archive;
pub(crate) use archive::{create_dir_durably, is_archive, retire, retire_files};
pub use checkpoint::Checkpoint;
pub(crate) use checkpoint::{
    copy_prefix, finish as finish_checkpoint, link_or_copy, prepare_dir as prepare_checkpoint_dir,
};
pub(crate) use entry::{DecodedEntry, DecodedFinish, LogEntry, encode_mark};
pub(crate) use format::{MAX_SEGMENT_FILE_BYTES, SEGMENT_HEADER_LEN, frame_seed};
#[cfg(feature = "replicate")]
pub(crate) use journal::{FeedSnapshot, LogFeed, RunsOnReplica};
pub(crate) use journal::{Journal, JournalConfig, JournalStats, ReplicaGate, SealHandle, Ticket};
#[cfg(feature = "replicate")]
pub(crate) use manifest::store_small_file;
pub(crate) use manifest::{MANIFEST_LEN, MANIFEST_NAME, Manifest};
pub(crate) use names::{
    LOCK_NAME, MANIFEST_TEMP_NAME, is_prepared_name, parse_segment_name, segment_path,
};
pub use report::{
    RecoveryReport, RunReport, SegmentReport, SegmentState, SkippedRange, TornTail, VerifyReport,
};
pub use run::LogPosition;
pub(crate) use run::{
    Run, RunKind, RunSummary, RunWriter, is_temp_run_name, open as open_run, parse_run_name,
};
#[cfg(feature = "replicate")]
pub(crate) use run::{read_cover, run_path};
pub(crate) use scan::{Scan, Verdict, scan};
pub(crate) use verify::{header_problem, verify_with};
