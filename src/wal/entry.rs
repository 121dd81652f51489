//! Log entries: the payloads carried by record frames. `docs/format.md` gives the bytes.
//!
//! Encoding asserts every length that decoding checks, so a frame this build writes
//! always decodes, and decoding bounds every length by its own limit, not only by the
//! frame's.

use super::format::{FRAME_HEADER_LEN, encode_frame, get_u32, get_u64, get_u128};
use crate::base::{
    Fingerprint, Finish, LEASE_ID_LIMIT, MAX_BATCH_KEYS, MAX_NOTE_BYTES, MAX_RESPONSE_BYTES_LIMIT,
    MAX_SCOPED_KEY_BYTES,
};

pub(crate) const KIND_KEYS: u8 = 1;
pub(crate) const KIND_RESERVE: u8 = 2;
pub(crate) const KIND_COMPLETE: u8 = 3;
pub(crate) const KIND_FAIL: u8 = 4;
pub(crate) const KIND_RELEASE: u8 = 5;
pub(crate) const KIND_MARK: u8 = 6;
pub(crate) const KIND_SEAL: u8 = 7;
pub(crate) const KIND_NOTE: u8 = 8;
pub(crate) const KIND_TAKE_OVER: u8 = 9;
pub(crate) const KIND_ADVANCE: u8 = 10;

/// Fixed part of a keys payload: bucket u64, count u32.
const KEYS_FIXED: usize = 8 + 4;
/// Fixed part of a reserve payload: fingerprint, lease id, request hash, created_ms,
/// bucket, key length.
const RESERVE_FIXED: usize = 16 + 8 + 16 + 8 + 8 + 4;
/// Fixed part of a finish payload: fingerprint, lease id, at_ms, response length.
const FINISH_FIXED: usize = 16 + 8 + 8 + 4;
/// Fixed part of a note payload: fingerprint, lease id, note length.
const NOTE_FIXED: usize = 16 + 8 + 4;
/// A take-over payload: fingerprint, old lease id, new lease id, at_ms.
const TAKE_OVER_LEN: usize = 16 + 8 + 8 + 8;
/// Payload bytes of a mark or seal frame: the durable length.
const MARK_LEN: usize = 8;
/// Fixed part of an advance payload: fingerprint, version, bucket, key length.
const ADVANCE_FIXED: usize = 16 + 8 + 8 + 4;

/// An entry to append, borrowing the writer's values.
pub(crate) type LogEntry<'a> = Entry<'a, &'a [Fingerprint], &'a Finish<'a>>;

/// One entry of the log, generic over how its variable parts are held: the writer's
/// values when appended ([`LogEntry`]), the frame's bytes when read back
/// ([`DecodedEntry`]). One enum, so the two sides cannot drift apart.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Entry<'a, Keys, Ending> {
    /// Dedup keys admitted with one bucket stamp (one call, or the part of a batch that
    /// got that stamp).
    Keys { bucket: u64, fingerprints: Keys },
    /// A record reserved in flight, stamped with `bucket`.
    Reserve {
        fingerprint: Fingerprint,
        lease_id: u64,
        request_hash: u128,
        created_ms: u64,
        bucket: u64,
        scoped_key: &'a [u8],
    },
    /// A lease ended.
    Finish {
        fingerprint: Fingerprint,
        lease_id: u64,
        at_ms: u64,
        finish: Ending,
    },
    /// Bytes `0..durable` of the segment were fsynced before this frame was written;
    /// `seal` closes the segment.
    Mark { durable: u64, seal: bool },
    /// A lease attached a note to its record.
    Note {
        fingerprint: Fingerprint,
        lease_id: u64,
        note: &'a [u8],
    },
    /// A record in flight under lease `old` was taken over by lease `new`.
    TakeOver {
        fingerprint: Fingerprint,
        old: u64,
        new: u64,
        at_ms: u64,
    },
    /// The ordering guard applied `version` to an aggregate, stamped with `bucket`.
    Advance {
        fingerprint: Fingerprint,
        version: u64,
        bucket: u64,
        scoped_key: &'a [u8],
    },
}

impl LogEntry<'_> {
    /// Bytes the entry's frame takes, header included.
    pub(crate) fn encoded_len(&self) -> usize {
        FRAME_HEADER_LEN
            + match self {
                LogEntry::Keys { fingerprints, .. } => KEYS_FIXED + 16 * fingerprints.len(),
                LogEntry::Reserve { scoped_key, .. } => RESERVE_FIXED + scoped_key.len(),
                LogEntry::Finish { finish, .. } => FINISH_FIXED + finish.response().len(),
                LogEntry::Note { note, .. } => NOTE_FIXED + note.len(),
                LogEntry::TakeOver { .. } => TAKE_OVER_LEN,
                LogEntry::Mark { .. } => MARK_LEN,
                LogEntry::Advance { scoped_key, .. } => ADVANCE_FIXED + scoped_key.len(),
            }
    }

    /// Appends the entry as one frame at segment offset `position`.
    pub(crate) fn encode(&self, out: &mut Vec<u8>, seed: u64, position: u64) {
        match self {
            LogEntry::Keys {
                bucket,
                fingerprints,
            } => {
                assert!(
                    fingerprints.len() <= MAX_BATCH_KEYS,
                    "keys entry over the limit"
                );
                encode_frame(out, seed, position, KIND_KEYS, |out| {
                    out.extend_from_slice(&bucket.to_le_bytes());
                    out.extend_from_slice(&len_u32(fingerprints.len()).to_le_bytes());
                    for fp in *fingerprints {
                        out.extend_from_slice(&fp.0.to_le_bytes());
                    }
                });
            }
            LogEntry::Reserve {
                fingerprint,
                lease_id,
                request_hash,
                created_ms,
                bucket,
                scoped_key,
            } => {
                assert!(
                    scoped_key.len() <= MAX_SCOPED_KEY_BYTES,
                    "scoped key over the limit"
                );
                assert!(*lease_id < LEASE_ID_LIMIT, "lease id over the limit");
                encode_frame(out, seed, position, KIND_RESERVE, |out| {
                    out.extend_from_slice(&fingerprint.0.to_le_bytes());
                    out.extend_from_slice(&lease_id.to_le_bytes());
                    out.extend_from_slice(&request_hash.to_le_bytes());
                    out.extend_from_slice(&created_ms.to_le_bytes());
                    out.extend_from_slice(&bucket.to_le_bytes());
                    put_length_prefixed(out, scoped_key);
                });
            }
            LogEntry::Finish {
                fingerprint,
                lease_id,
                at_ms,
                finish,
            } => {
                let kind = match finish {
                    Finish::Complete(_) => KIND_COMPLETE,
                    Finish::Fail(_) => KIND_FAIL,
                    Finish::Release => KIND_RELEASE,
                };
                let response = finish.response();
                assert!(
                    response.len() <= MAX_RESPONSE_BYTES_LIMIT,
                    "response over the limit"
                );
                encode_frame(out, seed, position, kind, |out| {
                    out.extend_from_slice(&fingerprint.0.to_le_bytes());
                    out.extend_from_slice(&lease_id.to_le_bytes());
                    out.extend_from_slice(&at_ms.to_le_bytes());
                    put_length_prefixed(out, response);
                });
            }
            LogEntry::Note {
                fingerprint,
                lease_id,
                note,
            } => {
                assert!(note.len() <= MAX_NOTE_BYTES, "note over the limit");
                assert!(*lease_id < LEASE_ID_LIMIT, "lease id over the limit");
                encode_frame(out, seed, position, KIND_NOTE, |out| {
                    out.extend_from_slice(&fingerprint.0.to_le_bytes());
                    out.extend_from_slice(&lease_id.to_le_bytes());
                    put_length_prefixed(out, note);
                });
            }
            LogEntry::TakeOver {
                fingerprint,
                old,
                new,
                at_ms,
            } => {
                assert!(
                    old <= new && *new < LEASE_ID_LIMIT,
                    "a take-over raises the lease, a renewal keeps it"
                );
                encode_frame(out, seed, position, KIND_TAKE_OVER, |out| {
                    out.extend_from_slice(&fingerprint.0.to_le_bytes());
                    out.extend_from_slice(&old.to_le_bytes());
                    out.extend_from_slice(&new.to_le_bytes());
                    out.extend_from_slice(&at_ms.to_le_bytes());
                });
            }
            LogEntry::Advance {
                fingerprint,
                version,
                bucket,
                scoped_key,
            } => {
                assert!(
                    scoped_key.len() <= MAX_SCOPED_KEY_BYTES,
                    "scoped key over the limit"
                );
                encode_frame(out, seed, position, KIND_ADVANCE, |out| {
                    out.extend_from_slice(&fingerprint.0.to_le_bytes());
                    out.extend_from_slice(&version.to_le_bytes());
                    out.extend_from_slice(&bucket.to_le_bytes());
                    put_length_prefixed(out, scoped_key);
                });
            }
            LogEntry::Mark { durable, seal } => encode_mark(out, seed, position, *durable, *seal),
        }
    }
}

/// Appends a durability mark (or, with `seal`, the seal of a closed segment) at
/// `position`, saying that bytes `0..durable` of the segment were fsynced before it was
/// written.
pub(crate) fn encode_mark(out: &mut Vec<u8>, seed: u64, position: u64, durable: u64, seal: bool) {
    assert!(
        durable <= position,
        "a mark cannot vouch for bytes after itself"
    );
    let kind = if seal { KIND_SEAL } else { KIND_MARK };
    encode_frame(out, seed, position, kind, |out| {
        out.extend_from_slice(&durable.to_le_bytes());
    });
}

/// Appends `bytes` after its length as a u32; [`length_prefixed`] reads it back.
fn put_length_prefixed(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&len_u32(bytes.len()).to_le_bytes());
    out.extend_from_slice(bytes);
}

/// A length already checked against a limit far below `u32::MAX`.
#[expect(
    clippy::expect_used,
    reason = "every caller checked the length against a limit below u32::MAX"
)]
fn len_u32(len: usize) -> u32 {
    u32::try_from(len).expect("lengths are checked against limits below u32::MAX")
}

/// How a decoded lease ending ends; every kind on disk maps to exactly one.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum DecodedFinish<'a> {
    Complete(&'a [u8]),
    Fail(&'a [u8]),
    Release,
}

impl<Keys, Ending> Entry<'_, Keys, Ending> {
    /// The bucket the entry is stamped with, for the entries that carry one.
    pub(crate) fn stamp(&self) -> Option<u64> {
        match self {
            Entry::Keys { bucket, .. }
            | Entry::Reserve { bucket, .. }
            | Entry::Advance { bucket, .. } => Some(*bucket),
            Entry::Finish { .. }
            | Entry::Mark { .. }
            | Entry::Note { .. }
            | Entry::TakeOver { .. } => None,
        }
    }

    /// What is wrong with the entry in a segment of bucket `segment_bucket`: the one rule
    /// recovery and `verify` share. The writer stamps an entry with a bucket no later than
    /// the segment it appends to, so a later stamp cannot come from it.
    pub(crate) fn placement_problem(&self, segment_bucket: u64) -> Option<&'static str> {
        self.stamp()
            .filter(|&stamp| stamp > segment_bucket)
            .map(|_| "entry is stamped later than its segment's bucket")
    }
}

/// An entry read back from a frame, borrowing the frame's bytes.
pub(crate) type DecodedEntry<'a> = Entry<'a, FingerprintList<'a>, DecodedFinish<'a>>;

/// The fingerprints of a `Keys` entry, decoded lazily.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct FingerprintList<'a>(&'a [u8]);

impl FingerprintList<'_> {
    pub(crate) fn iter(&self) -> impl Iterator<Item = Fingerprint> + '_ {
        self.0
            .chunks_exact(16)
            .filter_map(|chunk| get_u128(chunk, 0))
            .map(Fingerprint)
    }

    pub(crate) fn len(&self) -> usize {
        self.0.len() / 16
    }
}

/// Decodes the payload of a frame of `kind` found at `position`, checking every length
/// against the payload and against its own limit.
pub(crate) fn decode_entry(
    kind: u8,
    payload: &[u8],
    position: u64,
) -> Result<DecodedEntry<'_>, &'static str> {
    match kind {
        KIND_KEYS => decode_keys(payload),
        KIND_RESERVE => decode_reserve(payload),
        KIND_COMPLETE | KIND_FAIL | KIND_RELEASE => decode_finish(kind, payload),
        KIND_NOTE => decode_note(payload),
        KIND_TAKE_OVER => decode_take_over(payload),
        KIND_ADVANCE => decode_advance(payload),
        KIND_MARK | KIND_SEAL => {
            if payload.len() != 8 {
                return Err("mark entry has the wrong length");
            }
            let durable = get_u64(payload, 0).ok_or("mark entry is too short")?;
            if durable > position {
                return Err("mark vouches for bytes after itself");
            }
            Ok(DecodedEntry::Mark {
                durable,
                seal: kind == KIND_SEAL,
            })
        }
        _ => Err("unknown entry kind"),
    }
}

fn decode_keys(payload: &[u8]) -> Result<DecodedEntry<'_>, &'static str> {
    const SHORT: &str = "keys entry is too short";
    let bucket = get_u64(payload, 0).ok_or(SHORT)?;
    let count = get_u32(payload, 8).ok_or(SHORT)? as usize;
    if count > MAX_BATCH_KEYS {
        return Err("keys entry holds more keys than a batch may");
    }
    let fingerprints = payload.get(KEYS_FIXED..).ok_or(SHORT)?;
    if fingerprints.len() != count * 16 {
        return Err("keys entry count does not match its length");
    }
    Ok(DecodedEntry::Keys {
        bucket,
        fingerprints: FingerprintList(fingerprints),
    })
}

/// The variable part of an entry: its length is the `u32` that ends the fixed part of
/// `fixed` bytes, at most `limit`, and the bytes after the fixed part are exactly that
/// long. `errors` names a short payload, a length over the limit and a mismatch.
fn length_prefixed<'a>(
    payload: &'a [u8],
    fixed: usize,
    limit: usize,
    [short, over, mismatch]: [&'static str; 3],
) -> Result<&'a [u8], &'static str> {
    let len = usize::try_from(get_u32(payload, fixed - 4).ok_or(short)?).map_err(|_| over)?;
    if len > limit {
        return Err(over);
    }
    let tail = payload.get(fixed..).ok_or(short)?;
    if tail.len() != len {
        return Err(mismatch);
    }
    Ok(tail)
}

/// A lease id at `offset`, below [`LEASE_ID_LIMIT`].
fn lease_at(
    payload: &[u8],
    offset: usize,
    [short, over]: [&'static str; 2],
) -> Result<u64, &'static str> {
    let lease_id = get_u64(payload, offset).ok_or(short)?;
    if lease_id >= LEASE_ID_LIMIT {
        return Err(over);
    }
    Ok(lease_id)
}

fn decode_reserve(payload: &[u8]) -> Result<DecodedEntry<'_>, &'static str> {
    const SHORT: &str = "reserve entry is too short";
    let scoped_key = length_prefixed(
        payload,
        RESERVE_FIXED,
        MAX_SCOPED_KEY_BYTES,
        [
            SHORT,
            "reserve entry key exceeds the key limit",
            "reserve entry key length does not match",
        ],
    )?;
    let lease_id = lease_at(
        payload,
        16,
        [SHORT, "reserve entry lease id exceeds the limit"],
    )?;
    Ok(DecodedEntry::Reserve {
        fingerprint: Fingerprint(get_u128(payload, 0).ok_or(SHORT)?),
        lease_id,
        request_hash: get_u128(payload, 24).ok_or(SHORT)?,
        created_ms: get_u64(payload, 40).ok_or(SHORT)?,
        bucket: get_u64(payload, 48).ok_or(SHORT)?,
        scoped_key,
    })
}

fn decode_finish(kind: u8, payload: &[u8]) -> Result<DecodedEntry<'_>, &'static str> {
    const SHORT: &str = "finish entry is too short";
    let response = length_prefixed(
        payload,
        FINISH_FIXED,
        MAX_RESPONSE_BYTES_LIMIT,
        [
            SHORT,
            "finish entry response exceeds the response limit",
            "finish entry response length does not match",
        ],
    )?;
    let finish = match kind {
        KIND_COMPLETE => DecodedFinish::Complete(response),
        KIND_FAIL => DecodedFinish::Fail(response),
        KIND_RELEASE if response.is_empty() => DecodedFinish::Release,
        KIND_RELEASE => return Err("release entry carries a response"),
        _ => return Err("unknown finish kind"),
    };
    Ok(DecodedEntry::Finish {
        fingerprint: Fingerprint(get_u128(payload, 0).ok_or(SHORT)?),
        lease_id: get_u64(payload, 16).ok_or(SHORT)?,
        at_ms: get_u64(payload, 24).ok_or(SHORT)?,
        finish,
    })
}

fn decode_note(payload: &[u8]) -> Result<DecodedEntry<'_>, &'static str> {
    const SHORT: &str = "note entry is too short";
    let note = length_prefixed(
        payload,
        NOTE_FIXED,
        MAX_NOTE_BYTES,
        [
            SHORT,
            "note entry exceeds the note limit",
            "note entry length does not match",
        ],
    )?;
    let lease_id = lease_at(
        payload,
        16,
        [SHORT, "note entry lease id exceeds the limit"],
    )?;
    Ok(DecodedEntry::Note {
        fingerprint: Fingerprint(get_u128(payload, 0).ok_or(SHORT)?),
        lease_id,
        note,
    })
}

fn decode_take_over(payload: &[u8]) -> Result<DecodedEntry<'_>, &'static str> {
    const SHORT: &str = "take-over entry is too short";
    if payload.len() != TAKE_OVER_LEN {
        return Err("take-over entry has the wrong length");
    }
    let old = get_u64(payload, 16).ok_or(SHORT)?;
    let new = get_u64(payload, 24).ok_or(SHORT)?;
    // `old == new` is a renewal (`Lease::keep_alive`): the lease's timeout counts
    // from `at_ms`.
    if old > new || new >= LEASE_ID_LIMIT {
        return Err("take-over entry lowers the lease");
    }
    Ok(DecodedEntry::TakeOver {
        fingerprint: Fingerprint(get_u128(payload, 0).ok_or(SHORT)?),
        old,
        new,
        at_ms: get_u64(payload, 32).ok_or(SHORT)?,
    })
}

fn decode_advance(payload: &[u8]) -> Result<DecodedEntry<'_>, &'static str> {
    const SHORT: &str = "advance entry is too short";
    let scoped_key = length_prefixed(
        payload,
        ADVANCE_FIXED,
        MAX_SCOPED_KEY_BYTES,
        [
            SHORT,
            "advance entry key exceeds the key limit",
            "advance entry key length does not match",
        ],
    )?;
    Ok(DecodedEntry::Advance {
        fingerprint: Fingerprint(get_u128(payload, 0).ok_or(SHORT)?),
        version: get_u64(payload, 16).ok_or(SHORT)?,
        bucket: get_u64(payload, 24).ok_or(SHORT)?,
        scoped_key,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::wal::format::{decode_frame, frame_seed};

    const SEED: u64 = 0x5eed;

    fn decoded(entry: &LogEntry<'_>, check: impl FnOnce(DecodedEntry<'_>)) {
        let mut buf = Vec::new();
        entry.encode(&mut buf, SEED, 0);
        assert_eq!(buf.len(), entry.encoded_len());
        let frame = decode_frame(&buf, 0, SEED).unwrap();
        check(decode_entry(frame.kind, frame.payload, 0).unwrap());
    }

    #[test]
    fn keys_round_trip() {
        let fps = [Fingerprint(1), Fingerprint(u128::MAX - 5)];
        decoded(
            &LogEntry::Keys {
                bucket: 42,
                fingerprints: &fps,
            },
            |entry| {
                let DecodedEntry::Keys {
                    bucket,
                    fingerprints,
                } = entry
                else {
                    panic!("wrong kind");
                };
                assert_eq!(bucket, 42);
                assert_eq!(fingerprints.iter().collect::<Vec<_>>(), fps);
            },
        );
    }

    #[test]
    fn reserve_and_finish_round_trip() {
        decoded(
            &LogEntry::Reserve {
                fingerprint: Fingerprint(9),
                lease_id: 4,
                request_hash: 77,
                created_ms: 1234,
                bucket: 5,
                scoped_key: b"scope-key",
            },
            |entry| {
                assert_eq!(
                    entry,
                    DecodedEntry::Reserve {
                        fingerprint: Fingerprint(9),
                        lease_id: 4,
                        request_hash: 77,
                        created_ms: 1234,
                        bucket: 5,
                        scoped_key: b"scope-key",
                    }
                );
            },
        );
        let finish = Finish::Complete(b"ok");
        decoded(
            &LogEntry::Finish {
                fingerprint: Fingerprint(9),
                lease_id: 4,
                at_ms: 99,
                finish: &finish,
            },
            |entry| {
                assert_eq!(
                    entry,
                    DecodedEntry::Finish {
                        fingerprint: Fingerprint(9),
                        lease_id: 4,
                        at_ms: 99,
                        finish: DecodedFinish::Complete(b"ok"),
                    }
                );
            },
        );
    }

    #[test]
    fn note_take_over_and_advance_round_trip() {
        decoded(
            &LogEntry::Note {
                fingerprint: Fingerprint(3),
                lease_id: 9,
                note: b"provider_outcome_unknown",
            },
            |entry| {
                assert_eq!(
                    entry,
                    DecodedEntry::Note {
                        fingerprint: Fingerprint(3),
                        lease_id: 9,
                        note: b"provider_outcome_unknown",
                    }
                );
            },
        );
        decoded(
            &LogEntry::TakeOver {
                fingerprint: Fingerprint(3),
                old: 9,
                new: 12,
                at_ms: 77,
            },
            |entry| {
                assert_eq!(
                    entry,
                    DecodedEntry::TakeOver {
                        fingerprint: Fingerprint(3),
                        old: 9,
                        new: 12,
                        at_ms: 77,
                    }
                );
            },
        );
        decoded(
            &LogEntry::Advance {
                fingerprint: Fingerprint(4),
                version: 41,
                bucket: 6,
                scoped_key: b"agg",
            },
            |entry| {
                assert_eq!(
                    entry,
                    DecodedEntry::Advance {
                        fingerprint: Fingerprint(4),
                        version: 41,
                        bucket: 6,
                        scoped_key: b"agg",
                    }
                );
            },
        );
        // A renewal keeps the lease; an entry that lowers it is damage.
        let mut renewal = vec![0u8; TAKE_OVER_LEN];
        renewal[16..24].copy_from_slice(&5u64.to_le_bytes());
        renewal[24..32].copy_from_slice(&5u64.to_le_bytes());
        assert!(decode_entry(KIND_TAKE_OVER, &renewal, 0).is_ok());
        let mut lowering = renewal.clone();
        lowering[16..24].copy_from_slice(&6u64.to_le_bytes());
        assert!(decode_entry(KIND_TAKE_OVER, &lowering, 0).is_err());
    }

    #[test]
    fn inconsistent_lengths_and_kinds_are_rejected() {
        assert!(decode_entry(KIND_KEYS, &[0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 1], 0).is_err());
        assert!(decode_entry(KIND_RESERVE, &[0; 10], 0).is_err());
        assert!(decode_entry(KIND_RELEASE, &[0; FINISH_FIXED + 1], 0).is_err());
        assert!(decode_entry(99, &[], 0).is_err());
        assert!(decode_entry(0, &[0; FINISH_FIXED], 0).is_err());
    }

    #[test]
    fn lengths_are_bounded_by_their_own_limits() {
        let mut keys = vec![0u8; KEYS_FIXED];
        keys[8..12].copy_from_slice(&(u32::try_from(MAX_BATCH_KEYS + 1).unwrap()).to_le_bytes());
        assert_eq!(
            decode_entry(KIND_KEYS, &keys, 0),
            Err("keys entry holds more keys than a batch may")
        );
        let mut reserve = vec![0u8; RESERVE_FIXED];
        reserve[RESERVE_FIXED - 4..]
            .copy_from_slice(&(u32::try_from(MAX_SCOPED_KEY_BYTES + 1).unwrap()).to_le_bytes());
        assert_eq!(
            decode_entry(KIND_RESERVE, &reserve, 0),
            Err("reserve entry key exceeds the key limit")
        );
        let mut reserve = vec![0u8; RESERVE_FIXED];
        reserve[16..24].copy_from_slice(&LEASE_ID_LIMIT.to_le_bytes());
        assert!(decode_entry(KIND_RESERVE, &reserve, 0).is_err());
        let mut finish = vec![0u8; FINISH_FIXED];
        finish[FINISH_FIXED - 4..]
            .copy_from_slice(&(u32::try_from(MAX_RESPONSE_BYTES_LIMIT + 1).unwrap()).to_le_bytes());
        assert_eq!(
            decode_entry(KIND_COMPLETE, &finish, 0),
            Err("finish entry response exceeds the response limit")
        );
    }

    #[test]
    fn marks_cannot_vouch_for_later_bytes() {
        let seed = frame_seed(1);
        let mut buf = vec![0u8; 100];
        encode_mark(&mut buf, seed, 100, 60, false);
        let frame = decode_frame(&buf, 100, seed).unwrap();
        assert_eq!(
            decode_entry(frame.kind, frame.payload, 100),
            Ok(DecodedEntry::Mark {
                durable: 60,
                seal: false
            })
        );
        assert!(decode_entry(KIND_MARK, &200u64.to_le_bytes(), 100).is_err());
    }
}
