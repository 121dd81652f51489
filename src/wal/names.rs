//! Segment file names.

use std::path::{Path, PathBuf};

/// Name of the lock file inside the database directory.
pub(crate) const LOCK_NAME: &str = "LOCK";
/// Name of the manifest's temporary file while it is being written.
pub(crate) const MANIFEST_TEMP_NAME: &str = "MANIFEST.tmp";

/// File name of segment `seq` of `bucket`: the bucket is readable in the name, and names
/// sort in replay order. Both fields are padded to the width of their type's maximum
/// (`u64` buckets fit 20 digits, `u32` sequence numbers 10), so every name has one length.
pub(crate) fn segment_file_name(bucket: u64, seq: u32) -> String {
    format!("seg-{bucket:020}-{seq:010}.log")
}

/// The bucket and sequence number in a segment file name, or `None` for other files.
pub(crate) fn parse_segment_name(path: &Path) -> Option<(u64, u32)> {
    let name = path.file_name()?.to_str()?;
    let rest = name.strip_prefix("seg-")?.strip_suffix(".log")?;
    let (bucket, seq) = rest.split_once('-')?;
    let digits =
        |field: &str, len: usize| field.len() == len && field.bytes().all(|b| b.is_ascii_digit());
    if !digits(bucket, 20) || !digits(seq, 10) {
        return None;
    }
    Some((bucket.parse().ok()?, seq.parse().ok()?))
}

/// File name of segment `seq` of `bucket` while it is prepared ahead of need: created,
/// its header written and fsynced, but not yet part of the log. A roll-over renames it to
/// [`segment_file_name`]; recovery removes any left over.
pub(crate) fn prepared_file_name(bucket: u64, seq: u32) -> String {
    format!("prep-{bucket:020}-{seq:010}.log")
}

/// Whether `path` names a prepared segment (see [`prepared_file_name`]).
pub(crate) fn is_prepared_name(path: &Path) -> bool {
    path.file_name()
        .and_then(|name| name.to_str())
        .and_then(|name| name.strip_prefix("prep-"))
        .and_then(|rest| parse_segment_name(Path::new(&format!("seg-{rest}"))))
        .is_some()
}

/// Path of a prepared segment inside `dir`.
pub(crate) fn prepared_path(dir: &Path, bucket: u64, seq: u32) -> PathBuf {
    dir.join(prepared_file_name(bucket, seq))
}

/// Path of a segment inside `dir`.
pub(crate) fn segment_path(dir: &Path, bucket: u64, seq: u32) -> PathBuf {
    dir.join(segment_file_name(bucket, seq))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        let path = segment_path(Path::new("/db"), 1_966_432, 7);
        assert_eq!(parse_segment_name(&path), Some((1_966_432, 7)));
        assert_eq!(parse_segment_name(Path::new("/db/MANIFEST")), None);
        assert_eq!(parse_segment_name(Path::new("/db/seg-1-2.log")), None);
        for stray in [
            "/db/seg-+0000000000000000001-0000000000.log",
            "/db/seg-00000000000000000001-+000000000.log",
            "/db/seg-0000000000000000000 -0000000000.log",
        ] {
            assert_eq!(parse_segment_name(Path::new(stray)), None, "{stray}");
        }
        for (bucket, seq) in [(0, 999_999), (0, 1_000_000), (u64::MAX, u32::MAX)] {
            let path = segment_path(Path::new("/db"), bucket, seq);
            assert_eq!(parse_segment_name(&path), Some((bucket, seq)));
            assert!(!is_prepared_name(&path));
            let prepared = prepared_path(Path::new("/db"), bucket, seq);
            assert!(is_prepared_name(&prepared));
            assert_eq!(parse_segment_name(&prepared), None);
        }
        assert!(!is_prepared_name(Path::new("/db/prep-1-2.log")));
    }
}
