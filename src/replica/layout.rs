//! Names and headers of a replica's stream (`docs/format.md`, "Replica").

use std::time::Duration;

/// Header: the byte offset in its segment of a chunk's first byte (decimal).
pub(super) const OFFSET_HEADER: &str = "Oncedb-Offset";
/// Header: the token of the store that published a message (16 hex digits).
pub(super) const OWNER_HEADER: &str = "Oncedb-Owner";
/// Header: the whole length of the run a chunk belongs to (decimal).
pub(super) const LENGTH_HEADER: &str = "Oncedb-Length";
/// Largest chunk of a segment in one message: below NATS's default 1 MiB payload limit.
pub(super) const CHUNK_BYTES: u64 = 512 << 10;
/// Chunks a restore's consumer asks for in one pull: 32 of at most 512 KiB is 16 MiB in
/// flight, well below the 64 MiB a NATS server buffers for a client before it drops the
/// client as a slow consumer (which a consumer reading large chunks into files would
/// otherwise become, with the client's default of 500 a pull).
pub(super) const PULL_BATCH: i64 = 32;
/// How long JetStream drops a re-sent message with the same `Nats-Msg-Id`.
pub(super) const DUPLICATE_WINDOW: Duration = Duration::from_secs(120);

pub(super) fn stream_name(name: &str) -> String {
    format!("ONCEDB_{name}")
}

pub(super) fn all_subjects(name: &str) -> String {
    format!("oncedb.{name}.>")
}

pub(super) fn segments_filter(name: &str) -> String {
    format!("oncedb.{name}.seg.>")
}

pub(super) fn segment_subject(name: &str, (bucket, seq): (u64, u32)) -> String {
    format!("oncedb.{name}.seg.{bucket:020}.{seq:010}")
}

pub(super) fn runs_filter(name: &str) -> String {
    format!("oncedb.{name}.run.>")
}

pub(super) fn run_subject(name: &str, run_id: u64) -> String {
    format!("oncedb.{name}.run.{run_id:020}")
}

/// The run a subject of replica `name` carries, if it is a run subject.
pub(super) fn parse_run_subject(name: &str, subject: &str) -> Option<u64> {
    let digits = subject.strip_prefix(&format!("oncedb.{name}.run."))?;
    (digits.len() == 20 && digits.bytes().all(|b| b.is_ascii_digit()))
        .then(|| digits.parse().ok())
        .flatten()
}

pub(super) fn manifest_subject(name: &str) -> String {
    format!("oncedb.{name}.manifest")
}

pub(super) fn owner_subject(name: &str) -> String {
    format!("oncedb.{name}.owner")
}

/// The segment a subject of replica `name` carries, if it is a segment subject.
pub(super) fn parse_segment_subject(name: &str, subject: &str) -> Option<(u64, u32)> {
    let rest = subject.strip_prefix(&format!("oncedb.{name}.seg."))?;
    let (bucket, seq) = rest.split_once('.')?;
    let digits =
        |text: &str, len: usize| text.len() == len && text.bytes().all(|b| b.is_ascii_digit());
    if !digits(bucket, 20) || !digits(seq, 10) {
        return None;
    }
    Some((bucket.parse().ok()?, seq.parse().ok()?))
}

pub(super) fn token_text(token: u64) -> String {
    format!("{token:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segment_subjects_round_trip_and_refuse_strangers() {
        let subject = segment_subject("p-1", (28_333_334, 7));
        assert_eq!(
            parse_segment_subject("p-1", &subject),
            Some((28_333_334, 7))
        );
        assert_eq!(parse_segment_subject("p-2", &subject), None);
        assert_eq!(parse_segment_subject("p-1", "oncedb.p-1.seg.1.2"), None);
        assert_eq!(parse_segment_subject("p-1", &manifest_subject("p-1")), None);
        assert_eq!(parse_run_subject("p-1", &run_subject("p-1", 42)), Some(42));
        assert_eq!(parse_run_subject("p-1", &subject), None);
        assert_eq!(parse_run_subject("p-1", "oncedb.p-1.run.42"), None);
    }
}
