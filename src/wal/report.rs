//! What recovery and `verify` report: public, plain data.

use std::fmt;
use std::path::PathBuf;

use crate::base::RecoveryMode;

/// The end of the newest segment that `Db::open` cut off: bytes no fsync had covered,
/// left by a crash (or damaged inside the last commit group, which looks the same).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TornTail {
    /// The segment file.
    pub path: PathBuf,
    /// Where the cut was made; the file's new length.
    pub offset: u64,
    /// Bytes removed.
    pub bytes: u64,
    /// Frames that verified but lay after the cut (never acknowledged as durable).
    pub frames_dropped: u64,
}

/// A byte range `Salvage` recovery skipped because no frame in it verifies.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SkippedRange {
    /// The segment file.
    pub path: PathBuf,
    /// First byte skipped.
    pub start: u64,
    /// One past the last byte skipped: the next frame that verified, or the file's end.
    pub end: u64,
    /// Why the first frame of the range did not verify.
    pub reason: String,
}

/// What the last `Db::open` of a durable store found and did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct RecoveryReport {
    /// The mode recovery ran in.
    pub mode: RecoveryMode,
    /// Log entries replayed.
    pub entries_replayed: u64,
    /// Segments of expired buckets deleted before replay.
    pub segments_deleted: u64,
    /// Torn tails cut (at most one: only the newest segment can have one), or a newest
    /// segment removed because even its header was torn (offset 0).
    pub torn_tails: Vec<TornTail>,
    /// `Salvage` only: damaged ranges skipped, in file order. Empty under `Strict`.
    pub skipped: Vec<SkippedRange>,
}

/// The state of one segment as `verify` found it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum SegmentState {
    /// Every byte verifies.
    Clean,
    /// The newest segment ends in bytes no fsync covered; `Db::open` will cut them.
    TornTail {
        /// Where the cut will be made.
        offset: u64,
    },
    /// Bytes that were durable do not verify: `Db::open` in `Strict` mode refuses.
    Corrupted {
        /// The first damaged byte.
        offset: u64,
        /// What is wrong there.
        reason: String,
    },
}

/// One segment file as `verify` read it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct SegmentReport {
    /// The file.
    pub path: PathBuf,
    /// Its bucket (from its name).
    pub bucket: u64,
    /// Its sequence number within the bucket.
    pub seq: u32,
    /// Its length.
    pub bytes: u64,
    /// Frames that verify, marks included.
    pub frames: u64,
    /// Dedup keys logged.
    pub keys: u64,
    /// Records reserved.
    pub records: u64,
    /// Lease endings (complete, fail, release).
    pub finishes: u64,
    /// Versions applied by the ordering guard.
    pub versions: u64,
    /// Lowest and highest bucket stamp of its entries, if it holds any.
    pub stamps: Option<(u64, u64)>,
    /// Closed cleanly with a seal.
    pub sealed: bool,
    /// The verdict.
    pub state: SegmentState,
}

/// What `oncedb::verify` found in a directory.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct VerifyReport {
    /// The manifest's problem, if it is missing or damaged (segments are then not
    /// checked: their checksums are keyed by the manifest's secret).
    pub manifest_problem: Option<String>,
    /// Every segment, in replay order.
    pub segments: Vec<SegmentReport>,
    /// Files that are not part of a store (ignored by `Db::open`).
    pub stray_files: Vec<PathBuf>,
    /// Every sealed run, of keys or of records (`Options::memory_budget`), in id order.
    pub runs: Vec<RunReport>,
}

/// What `verify` found in one sealed run: its footer's summary, and the first damage
/// (footer, section table, fences, filters, and every data page checked).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RunReport {
    /// The run file.
    pub path: PathBuf,
    /// Dedup keys in a key run (0 for a record run, or if its footer is damaged).
    pub keys: u64,
    /// Idempotency records in a record run (0 for a key run, or if its footer is damaged).
    pub records: u64,
    /// Oldest and newest bucket its keys may have (`None` if its footer is damaged).
    pub buckets: Option<(u64, u64)>,
    /// Bytes of memory its fences and filters take once open.
    pub filter_bytes: u64,
    /// The first damage: byte offset and reason.
    pub damage: Option<(u64, String)>,
}

impl VerifyReport {
    /// No damage that `Db::open` in `Strict` mode would refuse (a torn tail is not
    /// damage: it is what a crash leaves).
    pub fn is_clean(&self) -> bool {
        self.first_damage().is_none()
    }

    /// The first damaged file, byte offset and reason.
    pub fn first_damage(&self) -> Option<(PathBuf, u64, String)> {
        if let Some(problem) = &self.manifest_problem {
            return Some((PathBuf::from("MANIFEST"), 0, problem.clone()));
        }
        self.segments
            .iter()
            .find_map(|segment| match &segment.state {
                SegmentState::Corrupted { offset, reason } => {
                    Some((segment.path.clone(), *offset, reason.clone()))
                }
                SegmentState::Clean | SegmentState::TornTail { .. } => None,
            })
            .or_else(|| {
                self.runs.iter().find_map(|run| {
                    let (offset, reason) = run.damage.clone()?;
                    Some((run.path.clone(), offset, reason))
                })
            })
    }
}

impl fmt::Display for VerifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(problem) = &self.manifest_problem {
            writeln!(f, "MANIFEST: {problem}")?;
        }
        for segment in &self.segments {
            let name = segment.path.file_name().map_or_else(
                || segment.path.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            write!(
                f,
                "{name}: {} bytes, {} frames, {} keys, {} records, {} finishes{}",
                segment.bytes,
                segment.frames,
                segment.keys,
                segment.records,
                segment.finishes,
                if segment.sealed { ", sealed" } else { "" }
            )?;
            match &segment.state {
                SegmentState::Clean => writeln!(f, ": ok")?,
                SegmentState::TornTail { offset } => {
                    writeln!(f, ": torn tail at byte {offset} (cut at the next open)")?
                }
                SegmentState::Corrupted { offset, reason } => {
                    writeln!(f, ": CORRUPTED at byte {offset}: {reason}")?
                }
            }
        }
        for run in &self.runs {
            let name = run.path.file_name().map_or_else(
                || run.path.display().to_string(),
                |n| n.to_string_lossy().into_owned(),
            );
            if run.records > 0 {
                write!(f, "{name}: record run, {} records", run.records)?;
            } else {
                write!(f, "{name}: sealed run, {} keys", run.keys)?;
            }
            if let Some((oldest, newest)) = run.buckets {
                write!(
                    f,
                    ", buckets {oldest}..={newest}, {} filter bytes",
                    run.filter_bytes
                )?;
            }
            match &run.damage {
                None => writeln!(f, ": ok")?,
                Some((offset, reason)) => writeln!(f, ": CORRUPTED at byte {offset}: {reason}")?,
            }
        }
        for stray in &self.stray_files {
            writeln!(f, "{}: not an oncedb file (ignored)", stray.display())?;
        }
        Ok(())
    }
}
