//! Reading a segment back: every frame that verifies, every byte range that does not, and
//! the durable length its marks vouch for. Recovery and `verify` share this, so both
//! draw the line between a torn tail and corruption in the same place.

use super::entry::{DecodedEntry, decode_entry};
use super::format::{Frame, FrameError, SEGMENT_HEADER_LEN, SegmentHeader, decode_frame};

/// A byte range of a segment in which no frame verifies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Damage {
    pub(crate) start: u64,
    /// Where the next valid frame starts, or the file's end.
    pub(crate) end: u64,
    pub(crate) reason: &'static str,
}

/// Everything a segment's bytes say.
#[derive(Debug)]
pub(crate) struct Scan<'a> {
    pub(crate) header: Result<SegmentHeader, &'static str>,
    /// Every frame that verifies, in file order, including those after damage.
    pub(crate) frames: Vec<(Frame<'a>, DecodedEntry<'a>)>,
    pub(crate) damage: Vec<Damage>,
    /// The highest segment offset a valid mark vouches for as fsynced.
    pub(crate) durable: u64,
    /// A valid seal closes the segment: every byte before it was fsynced.
    pub(crate) sealed: bool,
    /// The segment's last frame is a seal ending at the end of the file.
    pub(crate) ends_sealed: bool,
    pub(crate) len: u64,
}

/// What the damage in a scanned segment means.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Verdict {
    Clean,
    /// The segment ends in bytes no fsync ever covered, cut short by a crash (or damaged
    /// in a way that cannot be told apart from that: the last commit group only).
    TornTail {
        offset: u64,
        frames_dropped: u64,
    },
    /// Bytes that were durable do not verify.
    Corrupted {
        offset: u64,
        reason: &'static str,
    },
}

/// Scans `bytes` as a segment whose frames are keyed with `seed`.
pub(crate) fn scan(bytes: &[u8], seed: u64) -> Scan<'_> {
    let mut scan = Scan {
        header: SegmentHeader::decode(bytes),
        frames: Vec::new(),
        damage: Vec::new(),
        durable: SEGMENT_HEADER_LEN as u64,
        sealed: false,
        ends_sealed: false,
        len: bytes.len() as u64,
    };
    let mut offset = SEGMENT_HEADER_LEN;
    while offset < bytes.len() {
        match decode_frame(bytes, offset, seed) {
            Ok(frame) => {
                match decode_entry(frame.kind, frame.payload, frame.start as u64) {
                    Ok(entry) => scan.take(frame, entry),
                    Err(reason) => scan.damage.push(Damage {
                        start: frame.start as u64,
                        end: frame.end as u64,
                        reason,
                    }),
                }
                offset = frame.end;
            }
            Err(err) => {
                let next = resync(bytes, offset + 1, seed);
                scan.damage.push(Damage {
                    start: offset as u64,
                    end: next as u64,
                    reason: match err {
                        FrameError::Truncated => "record is truncated",
                        FrameError::Invalid(reason) => reason,
                    },
                });
                offset = next;
            }
        }
    }
    scan.ends_sealed = scan.damage.is_empty()
        && scan.frames.last().is_some_and(|(frame, entry)| {
            matches!(entry, DecodedEntry::Mark { seal: true, .. }) && frame.end == bytes.len()
        });
    scan
}

/// The first offset at or after `from` where a frame verifies, or the end of `bytes`.
/// A frame records its own offset and is keyed with the database's seed, so a false
/// match inside damaged or client-supplied bytes is not a practical concern.
fn resync(bytes: &[u8], from: usize, seed: u64) -> usize {
    (from..bytes.len())
        .find(|&offset| decode_frame(bytes, offset, seed).is_ok())
        .unwrap_or(bytes.len())
}

impl<'a> Scan<'a> {
    fn take(&mut self, frame: Frame<'a>, entry: DecodedEntry<'a>) {
        if let DecodedEntry::Mark { durable, seal } = entry {
            self.durable = self.durable.max(durable);
            self.sealed |= seal && durable == frame.start as u64;
        }
        self.frames.push((frame, entry));
    }

    /// The meaning of the first damage. Every segment but the newest was fsynced whole
    /// and sealed before the next was created, so damage there, or a missing seal, is
    /// corruption. In the newest, damage below the durable length is corruption; at or
    /// past it, a torn tail.
    pub(crate) fn verdict(&self, newest: bool) -> Verdict {
        let Some(first) = self.damage.first() else {
            if !newest && !self.ends_sealed {
                // Every segment but the newest was sealed before the next was created.
                return Verdict::Corrupted {
                    offset: self.len,
                    reason: "segment does not end with its seal: it was cut short",
                };
            }
            return Verdict::Clean;
        };
        if !newest || first.start < self.durable {
            return Verdict::Corrupted {
                offset: first.start,
                reason: first.reason,
            };
        }
        let frames_dropped = self
            .frames
            .iter()
            .filter(|(frame, entry)| {
                frame.start as u64 >= first.start && !matches!(entry, DecodedEntry::Mark { .. })
            })
            .count() as u64;
        Verdict::TornTail {
            offset: first.start,
            frames_dropped,
        }
    }
}
