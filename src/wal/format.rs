//! Byte layouts of segment headers and record frames. `docs/format.md` is the spec; the
//! offsets below mirror it and are checked at compile time.
//!
//! Decoding never indexes or slices unchecked: every read goes through `get` and a length
//! check first, so any bytes at all decode to a value or an error.

use xxhash_rust::xxh3::{xxh3_64, xxh3_64_with_seed};

use crate::base::{MAX_BATCH_KEYS, MAX_RESPONSE_BYTES_LIMIT, MAX_SCOPED_KEY_BYTES};

/// Magic bytes opening every segment file.
pub(crate) const SEGMENT_MAGIC: [u8; 8] = *b"ONCESEG\0";
/// Version of the segment layout written by this build. Version 2 added the frame's own
/// offset, keyed frame checksums, stamped entries and durability marks.
pub(crate) const SEGMENT_VERSION: u32 = 2;

// Segment header: magic | version u32 | flags u32 | bucket u64 | seq u32 | reserved u32 |
// database_id u64 | checksum u64 (xxh3-64 of bytes 0..CHECKSUM_OFFSET).
pub(crate) const SEG_MAGIC_OFFSET: usize = 0;
pub(crate) const SEG_VERSION_OFFSET: usize = SEG_MAGIC_OFFSET + 8;
pub(crate) const SEG_FLAGS_OFFSET: usize = SEG_VERSION_OFFSET + 4;
pub(crate) const SEG_BUCKET_OFFSET: usize = SEG_FLAGS_OFFSET + 4;
pub(crate) const SEG_SEQ_OFFSET: usize = SEG_BUCKET_OFFSET + 8;
pub(crate) const SEG_RESERVED_OFFSET: usize = SEG_SEQ_OFFSET + 4;
pub(crate) const SEG_DATABASE_ID_OFFSET: usize = SEG_RESERVED_OFFSET + 4;
pub(crate) const SEG_CHECKSUM_OFFSET: usize = SEG_DATABASE_ID_OFFSET + 8;
/// Length of a segment header.
pub(crate) const SEGMENT_HEADER_LEN: usize = SEG_CHECKSUM_OFFSET + 8;
const _: () = assert!(SEGMENT_HEADER_LEN == 48);

// Record frame: payload_len u32 | kind u8 | reserved u8 | header_check u16 |
// frame_offset u32 | checksum u64 | payload.
// header_check is the low 16 bits of the keyed xxh3-64 of bytes 0..6 ++ 8..12; checksum
// is the keyed xxh3-64 of bytes 0..12 followed by the payload.
pub(crate) const FRAME_LEN_OFFSET: usize = 0;
pub(crate) const FRAME_KIND_OFFSET: usize = FRAME_LEN_OFFSET + 4;
pub(crate) const FRAME_RESERVED_OFFSET: usize = FRAME_KIND_OFFSET + 1;
pub(crate) const FRAME_HEADER_CHECK_OFFSET: usize = FRAME_RESERVED_OFFSET + 1;
pub(crate) const FRAME_POSITION_OFFSET: usize = FRAME_HEADER_CHECK_OFFSET + 2;
pub(crate) const FRAME_CHECKSUM_OFFSET: usize = FRAME_POSITION_OFFSET + 4;
/// Length of a frame header; the payload follows.
pub(crate) const FRAME_HEADER_LEN: usize = FRAME_CHECKSUM_OFFSET + 8;
const _: () = assert!(FRAME_HEADER_LEN == 20);

/// Largest payload a frame may declare: a full response plus its fixed fields, a full
/// batch of fingerprints, or a full scoped key. Checked before anything is allocated or
/// sliced.
pub(crate) const MAX_PAYLOAD_LEN: usize = MAX_RESPONSE_BYTES_LIMIT + 64;
const _: () = assert!(MAX_PAYLOAD_LEN >= 12 + 16 * MAX_BATCH_KEYS);
const _: () = assert!(MAX_PAYLOAD_LEN >= 64 + MAX_SCOPED_KEY_BYTES);
/// Most bytes one append may add to a segment (one or more frames).
pub(crate) const MAX_APPEND_BYTES: usize = FRAME_HEADER_LEN + MAX_PAYLOAD_LEN;
/// Length of a durability mark or seal frame (an 8-byte payload).
pub(crate) const MARK_FRAME_LEN: usize = FRAME_HEADER_LEN + 8;
/// Largest segment file recovery reads: the roll-over size, one append that crossed it,
/// and the mark and seal frames around it.
pub(crate) const MAX_SEGMENT_FILE_BYTES: u64 = crate::base::MAX_SEGMENT_BYTES_LIMIT
    + SEGMENT_HEADER_LEN as u64
    + MAX_APPEND_BYTES as u64
    + 2 * MARK_FRAME_LEN as u64;
const _: () = assert!(MAX_SEGMENT_FILE_BYTES < u32::MAX as u64);

/// The fixed fields of a segment header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SegmentHeader {
    pub(crate) bucket: u64,
    pub(crate) seq: u32,
    pub(crate) database_id: u64,
}

impl SegmentHeader {
    pub(crate) fn encode(&self) -> [u8; SEGMENT_HEADER_LEN] {
        let mut out = [0u8; SEGMENT_HEADER_LEN];
        put(&mut out, SEG_MAGIC_OFFSET, &SEGMENT_MAGIC);
        put(&mut out, SEG_VERSION_OFFSET, &SEGMENT_VERSION.to_le_bytes());
        put(&mut out, SEG_FLAGS_OFFSET, &0u32.to_le_bytes());
        put(&mut out, SEG_BUCKET_OFFSET, &self.bucket.to_le_bytes());
        put(&mut out, SEG_SEQ_OFFSET, &self.seq.to_le_bytes());
        put(&mut out, SEG_RESERVED_OFFSET, &0u32.to_le_bytes());
        put(
            &mut out,
            SEG_DATABASE_ID_OFFSET,
            &self.database_id.to_le_bytes(),
        );
        let checksum = xxh3_64(&out[..SEG_CHECKSUM_OFFSET]);
        put(&mut out, SEG_CHECKSUM_OFFSET, &checksum.to_le_bytes());
        out
    }

    /// Parses a header, or says what is wrong with it.
    pub(crate) fn decode(bytes: &[u8]) -> Result<SegmentHeader, &'static str> {
        let Some(header) = bytes.get(..SEGMENT_HEADER_LEN) else {
            return Err("segment header is truncated");
        };
        check_block(
            header,
            &SEGMENT_MAGIC,
            [SEG_VERSION_OFFSET, SEG_CHECKSUM_OFFSET],
            SEGMENT_VERSION,
            [
                "bad segment magic",
                "segment header checksum mismatch",
                "unsupported segment version",
            ],
        )?;
        let field = |offset| get_u64(header, offset).ok_or("segment header is truncated");
        Ok(SegmentHeader {
            bucket: field(SEG_BUCKET_OFFSET)?,
            seq: get_u32(header, SEG_SEQ_OFFSET).ok_or("segment header is truncated")?,
            database_id: field(SEG_DATABASE_ID_OFFSET)?,
        })
    }
}

/// The key of every frame checksum of a database, derived from its secret: bytes a
/// client supplied (a key, a response) can never be mistaken for a frame, even by a
/// reader scanning for frames after damage.
pub(crate) fn frame_seed(secret: u64) -> u64 {
    xxh3_64_with_seed(b"oncedb frame checksum", secret)
}

/// Appends one frame of `kind` at segment offset `position`, with the payload that
/// `write_payload` appends to `out`.
#[expect(
    clippy::expect_used,
    reason = "a segment is below MAX_SEGMENT_FILE_BYTES < 4 GiB and the payload was checked above"
)]
pub(crate) fn encode_frame(
    out: &mut Vec<u8>,
    seed: u64,
    position: u64,
    kind: u8,
    write_payload: impl FnOnce(&mut Vec<u8>),
) {
    let start = out.len();
    out.resize(start + FRAME_HEADER_LEN, 0);
    write_payload(out);
    let payload_len = out.len() - start - FRAME_HEADER_LEN;
    assert!(
        payload_len <= MAX_PAYLOAD_LEN,
        "frame payload over the limit"
    );
    let position = u32::try_from(position).expect("segments are smaller than 4 GiB");
    let payload_len = u32::try_from(payload_len).expect("checked against MAX_PAYLOAD_LEN above");
    let (_, frame) = out.split_at_mut(start);
    put(frame, FRAME_LEN_OFFSET, &payload_len.to_le_bytes());
    put(frame, FRAME_KIND_OFFSET, &[kind, 0]);
    put(frame, FRAME_POSITION_OFFSET, &position.to_le_bytes());
    let (head, payload) = frame.split_at_mut(FRAME_HEADER_LEN);
    let (covered, _) = head.split_at_mut(FRAME_CHECKSUM_OFFSET);
    let check = header_check(seed, covered);
    put(covered, FRAME_HEADER_CHECK_OFFSET, &check.to_le_bytes());
    let checksum = frame_checksum(seed, covered, payload);
    put(head, FRAME_CHECKSUM_OFFSET, &checksum.to_le_bytes());
}

/// Low 16 bits of the keyed hash of the header's length, kind, reserved byte and
/// position (`head` is bytes 0..12; the check's own two bytes are skipped).
fn header_check(seed: u64, head: &[u8]) -> u16 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::with_seed(seed);
    hasher.update(head.get(..FRAME_HEADER_CHECK_OFFSET).unwrap_or_default());
    hasher.update(head.get(FRAME_POSITION_OFFSET..).unwrap_or_default());
    let [low, high, ..] = hasher.digest().to_le_bytes();
    u16::from_le_bytes([low, high])
}

fn frame_checksum(seed: u64, head: &[u8], payload: &[u8]) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3::with_seed(seed);
    hasher.update(head);
    hasher.update(payload);
    hasher.digest()
}

/// One valid frame found in a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Frame<'a> {
    pub(crate) kind: u8,
    pub(crate) payload: &'a [u8],
    /// Offset of the frame.
    pub(crate) start: usize,
    /// Offset just past the frame.
    pub(crate) end: usize,
}

/// Why no valid frame starts at an offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameError {
    /// The buffer ends inside the frame's header or payload.
    Truncated,
    /// The bytes are not a frame this database wrote at this offset.
    Invalid(&'static str),
}

/// Parses the frame starting at `offset` of `bytes`, checked with `seed`.
pub(crate) fn decode_frame(
    bytes: &[u8],
    offset: usize,
    seed: u64,
) -> Result<Frame<'_>, FrameError> {
    decode_frame_at(bytes.get(offset..).unwrap_or_default(), offset, seed)
}

/// Parses a frame read on its own: `rest` holds the segment's bytes from `offset`.
pub(crate) fn decode_frame_at(
    rest: &[u8],
    offset: usize,
    seed: u64,
) -> Result<Frame<'_>, FrameError> {
    let Some(head) = rest.get(..FRAME_HEADER_LEN) else {
        return Err(FrameError::Truncated);
    };
    let position = get_u32(head, FRAME_POSITION_OFFSET).map(u64::from);
    if position != Some(offset as u64) {
        return Err(FrameError::Invalid(
            "frame position does not match its offset",
        ));
    }
    let check = header_check(seed, head.get(..FRAME_CHECKSUM_OFFSET).unwrap_or_default());
    if get_u16(head, FRAME_HEADER_CHECK_OFFSET) != Some(check) {
        return Err(FrameError::Invalid("frame header check mismatch"));
    }
    if head.get(FRAME_RESERVED_OFFSET) != Some(&0) {
        return Err(FrameError::Invalid("frame reserved byte is not zero"));
    }
    let payload_len = get_u32(head, FRAME_LEN_OFFSET).unwrap_or_default() as usize;
    if payload_len > MAX_PAYLOAD_LEN {
        return Err(FrameError::Invalid("frame length exceeds the limit"));
    }
    let Some(payload) = rest.get(FRAME_HEADER_LEN..FRAME_HEADER_LEN + payload_len) else {
        return Err(FrameError::Truncated);
    };
    let covered = head.get(..FRAME_CHECKSUM_OFFSET).unwrap_or_default();
    if get_u64(head, FRAME_CHECKSUM_OFFSET) != Some(frame_checksum(seed, covered, payload)) {
        return Err(FrameError::Invalid("frame checksum mismatch"));
    }
    Ok(Frame {
        kind: head.get(FRAME_KIND_OFFSET).copied().unwrap_or_default(),
        payload,
        start: offset,
        end: offset + FRAME_HEADER_LEN + payload_len,
    })
}

/// Checks a self-describing block (a segment header, the manifest): `magic` at offset
/// 0, then the version (`u32`) at `version_offset`, and at `checksum_offset` the XXH3-64
/// of every byte before it. The checksum is checked before the version, so a flipped
/// version byte reads as damage, not as a format from the future. `errors` names a bad
/// magic, a checksum mismatch and an unknown version.
pub(crate) fn check_block(
    block: &[u8],
    magic: &[u8],
    [version_offset, checksum_offset]: [usize; 2],
    version: u32,
    [bad_magic, bad_checksum, bad_version]: [&'static str; 3],
) -> Result<(), &'static str> {
    if block.get(..magic.len()) != Some(magic) {
        return Err(bad_magic);
    }
    let covered = block.get(..checksum_offset).unwrap_or_default();
    if get_u64(block, checksum_offset) != Some(xxh3_64(covered)) {
        return Err(bad_checksum);
    }
    if get_u32(block, version_offset) != Some(version) {
        return Err(bad_version);
    }
    Ok(())
}

/// Writes `value` at `offset` of `out`; the caller's layout guarantees the room.
pub(crate) fn put(out: &mut [u8], offset: usize, value: &[u8]) {
    match out.get_mut(offset..offset + value.len()) {
        Some(target) => target.copy_from_slice(value),
        None => unreachable!("layouts are sized at compile time"),
    }
}

fn array<const N: usize>(bytes: &[u8], offset: usize) -> Option<[u8; N]> {
    bytes.get(offset..offset.checked_add(N)?)?.try_into().ok()
}

/// Reads a little-endian u16 at `offset`, if the bytes are there.
pub(crate) fn get_u16(bytes: &[u8], offset: usize) -> Option<u16> {
    array(bytes, offset).map(u16::from_le_bytes)
}

/// Reads a little-endian u32 at `offset`, if the bytes are there.
pub(crate) fn get_u32(bytes: &[u8], offset: usize) -> Option<u32> {
    array(bytes, offset).map(u32::from_le_bytes)
}

/// Reads a little-endian u64 at `offset`, if the bytes are there.
pub(crate) fn get_u64(bytes: &[u8], offset: usize) -> Option<u64> {
    array(bytes, offset).map(u64::from_le_bytes)
}

/// Reads a little-endian u128 at `offset`, if the bytes are there.
pub(crate) fn get_u128(bytes: &[u8], offset: usize) -> Option<u128> {
    array(bytes, offset).map(u128::from_le_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trips_and_detects_damage() {
        let header = SegmentHeader {
            bucket: 1_966_432,
            seq: 3,
            database_id: 0xdead_beef,
        };
        let mut bytes = header.encode();
        assert_eq!(SegmentHeader::decode(&bytes), Ok(header));
        bytes[SEG_BUCKET_OFFSET] ^= 1;
        assert!(SegmentHeader::decode(&bytes).is_err());
        assert!(SegmentHeader::decode(&bytes[..10]).is_err());
    }

    #[test]
    fn frames_round_trip_and_report_tears() {
        let seed = frame_seed(7);
        let mut buf = Vec::new();
        encode_frame(&mut buf, seed, 0, 7, |out| out.extend_from_slice(b"hello"));
        let second_at = buf.len() as u64;
        encode_frame(&mut buf, seed, second_at, 8, |out| {
            out.extend_from_slice(b"")
        });
        let first = decode_frame(&buf, 0, seed).unwrap();
        assert_eq!((first.kind, first.payload), (7, &b"hello"[..]));
        let second = decode_frame(&buf, first.end, seed).unwrap();
        assert_eq!((second.kind, second.end), (8, buf.len()));
        assert_eq!(
            decode_frame(&buf, buf.len(), seed),
            Err(FrameError::Truncated)
        );
        assert_eq!(
            decode_frame(&buf[..first.end - 1], 0, seed),
            Err(FrameError::Truncated)
        );
        let mut flipped = buf.clone();
        flipped[FRAME_HEADER_LEN + 1] ^= 0x40;
        assert!(matches!(
            decode_frame(&flipped, 0, seed),
            Err(FrameError::Invalid(_))
        ));
    }

    #[test]
    fn a_frame_only_verifies_at_its_own_offset_and_under_its_seed() {
        let seed = frame_seed(7);
        let mut buf = vec![0u8; 3];
        encode_frame(&mut buf, seed, 3, 1, |out| out.extend_from_slice(b"x"));
        assert!(decode_frame(&buf, 3, seed).is_ok());
        assert!(decode_frame(&buf, 3, frame_seed(8)).is_err());
        let shifted = buf[3..].to_vec();
        assert!(matches!(
            decode_frame(&shifted, 0, seed),
            Err(FrameError::Invalid(_))
        ));
    }
}
