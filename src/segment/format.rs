//! Byte layouts of segment headers and record frames. `docs/format.md` is the spec; the
//! offsets below mirror it and are checked at compile time.

use xxhash_rust::xxh3::xxh3_64;

/// Magic bytes opening every segment file.
pub(crate) const SEGMENT_MAGIC: [u8; 8] = *b"ONCESEG\0";
/// Version of the segment layout written by this build.
pub(crate) const SEGMENT_VERSION: u32 = 1;

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
// checksum u64 | payload. header_check is the low 16 bits of xxh3-64 of bytes 0..6;
// checksum is xxh3-64 of bytes 0..6 followed by the payload.
pub(crate) const FRAME_LEN_OFFSET: usize = 0;
pub(crate) const FRAME_KIND_OFFSET: usize = FRAME_LEN_OFFSET + 4;
pub(crate) const FRAME_RESERVED_OFFSET: usize = FRAME_KIND_OFFSET + 1;
pub(crate) const FRAME_HEADER_CHECK_OFFSET: usize = FRAME_RESERVED_OFFSET + 1;
pub(crate) const FRAME_CHECKSUM_OFFSET: usize = FRAME_HEADER_CHECK_OFFSET + 2;
/// Length of a frame header; the payload follows.
pub(crate) const FRAME_HEADER_LEN: usize = FRAME_CHECKSUM_OFFSET + 8;
const _: () = assert!(FRAME_HEADER_LEN == 16);

/// Largest payload a frame may declare: a full response plus its fixed fields, or a
/// full batch of fingerprints. Checked before anything is allocated or sliced.
pub(crate) const MAX_PAYLOAD_LEN: usize = crate::options::MAX_RESPONSE_BYTES_LIMIT + 64;
const _: () = assert!(MAX_PAYLOAD_LEN >= 4 + 16 * crate::options::MAX_BATCH_KEYS);

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
        out[SEG_MAGIC_OFFSET..SEG_VERSION_OFFSET].copy_from_slice(&SEGMENT_MAGIC);
        put_u32(&mut out, SEG_VERSION_OFFSET, SEGMENT_VERSION);
        put_u32(&mut out, SEG_FLAGS_OFFSET, 0);
        put_u64(&mut out, SEG_BUCKET_OFFSET, self.bucket);
        put_u32(&mut out, SEG_SEQ_OFFSET, self.seq);
        put_u32(&mut out, SEG_RESERVED_OFFSET, 0);
        put_u64(&mut out, SEG_DATABASE_ID_OFFSET, self.database_id);
        let checksum = xxh3_64(&out[..SEG_CHECKSUM_OFFSET]);
        put_u64(&mut out, SEG_CHECKSUM_OFFSET, checksum);
        out
    }

    /// Parses a header, or says what is wrong with it.
    pub(crate) fn decode(bytes: &[u8]) -> Result<SegmentHeader, &'static str> {
        if bytes.len() < SEGMENT_HEADER_LEN {
            return Err("segment header is truncated");
        }
        if bytes[SEG_MAGIC_OFFSET..SEG_VERSION_OFFSET] != SEGMENT_MAGIC {
            return Err("bad segment magic");
        }
        if get_u64(bytes, SEG_CHECKSUM_OFFSET) != xxh3_64(&bytes[..SEG_CHECKSUM_OFFSET]) {
            return Err("segment header checksum mismatch");
        }
        if get_u32(bytes, SEG_VERSION_OFFSET) != SEGMENT_VERSION {
            return Err("unsupported segment version");
        }
        Ok(SegmentHeader {
            bucket: get_u64(bytes, SEG_BUCKET_OFFSET),
            seq: get_u32(bytes, SEG_SEQ_OFFSET),
            database_id: get_u64(bytes, SEG_DATABASE_ID_OFFSET),
        })
    }
}

/// Appends one frame of `kind` whose payload `write_payload` appends to `out`.
pub(crate) fn encode_frame(out: &mut Vec<u8>, kind: u8, write_payload: impl FnOnce(&mut Vec<u8>)) {
    let start = out.len();
    out.resize(start + FRAME_HEADER_LEN, 0);
    write_payload(out);
    let payload_len = out.len() - start - FRAME_HEADER_LEN;
    debug_assert!(payload_len <= MAX_PAYLOAD_LEN);
    let frame = &mut out[start..];
    put_u32(frame, FRAME_LEN_OFFSET, payload_len as u32);
    frame[FRAME_KIND_OFFSET] = kind;
    frame[FRAME_RESERVED_OFFSET] = 0;
    let header_check = xxh3_64(&frame[..FRAME_HEADER_CHECK_OFFSET]) as u16;
    frame[FRAME_HEADER_CHECK_OFFSET..FRAME_CHECKSUM_OFFSET]
        .copy_from_slice(&header_check.to_le_bytes());
    let checksum = frame_checksum(
        &frame[..FRAME_HEADER_CHECK_OFFSET],
        &frame[FRAME_HEADER_LEN..],
    );
    put_u64(frame, FRAME_CHECKSUM_OFFSET, checksum);
}

fn frame_checksum(head: &[u8], payload: &[u8]) -> u64 {
    let mut hasher = xxhash_rust::xxh3::Xxh3Default::new();
    hasher.update(head);
    hasher.update(payload);
    hasher.digest()
}

/// One valid frame found in a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Frame<'a> {
    pub(crate) kind: u8,
    pub(crate) payload: &'a [u8],
    /// Offset just past the frame.
    pub(crate) end: usize,
}

/// Why no valid frame starts at an offset.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameError {
    /// The buffer ends inside the frame (a torn append).
    Truncated,
    /// The bytes are not a frame this build wrote.
    Invalid(&'static str),
}

/// Parses the frame starting at `offset` of `bytes`.
pub(crate) fn decode_frame(bytes: &[u8], offset: usize) -> Result<Frame<'_>, FrameError> {
    let rest = &bytes[offset.min(bytes.len())..];
    if rest.len() < FRAME_HEADER_LEN {
        return Err(FrameError::Truncated);
    }
    let header_check = u16::from_le_bytes([
        rest[FRAME_HEADER_CHECK_OFFSET],
        rest[FRAME_HEADER_CHECK_OFFSET + 1],
    ]);
    if header_check != xxh3_64(&rest[..FRAME_HEADER_CHECK_OFFSET]) as u16 {
        return Err(FrameError::Invalid("frame header check mismatch"));
    }
    let payload_len = get_u32(rest, FRAME_LEN_OFFSET) as usize;
    if payload_len > MAX_PAYLOAD_LEN {
        return Err(FrameError::Invalid("frame length exceeds the limit"));
    }
    if rest.len() - FRAME_HEADER_LEN < payload_len {
        return Err(FrameError::Truncated);
    }
    let payload = &rest[FRAME_HEADER_LEN..FRAME_HEADER_LEN + payload_len];
    if get_u64(rest, FRAME_CHECKSUM_OFFSET)
        != frame_checksum(&rest[..FRAME_HEADER_CHECK_OFFSET], payload)
    {
        return Err(FrameError::Invalid("frame checksum mismatch"));
    }
    Ok(Frame {
        kind: rest[FRAME_KIND_OFFSET],
        payload,
        end: offset + FRAME_HEADER_LEN + payload_len,
    })
}

pub(crate) fn put_u32(out: &mut [u8], offset: usize, value: u32) {
    out[offset..offset + 4].copy_from_slice(&value.to_le_bytes());
}

pub(crate) fn put_u64(out: &mut [u8], offset: usize, value: u64) {
    out[offset..offset + 8].copy_from_slice(&value.to_le_bytes());
}

/// Reads a little-endian u32; the caller has checked the length.
pub(crate) fn get_u32(bytes: &[u8], offset: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[offset..offset + 4]);
    u32::from_le_bytes(word)
}

/// Reads a little-endian u64; the caller has checked the length.
pub(crate) fn get_u64(bytes: &[u8], offset: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[offset..offset + 8]);
    u64::from_le_bytes(word)
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
        let mut buf = Vec::new();
        encode_frame(&mut buf, 7, |out| out.extend_from_slice(b"hello"));
        encode_frame(&mut buf, 8, |out| out.extend_from_slice(b""));
        let first = decode_frame(&buf, 0).unwrap();
        assert_eq!((first.kind, first.payload), (7, &b"hello"[..]));
        let second = decode_frame(&buf, first.end).unwrap();
        assert_eq!((second.kind, second.end), (8, buf.len()));
        assert_eq!(decode_frame(&buf, buf.len()), Err(FrameError::Truncated));
        assert_eq!(
            decode_frame(&buf[..first.end - 1], 0),
            Err(FrameError::Truncated)
        );
        let mut flipped = buf.clone();
        flipped[FRAME_HEADER_LEN + 1] ^= 0x40;
        assert!(matches!(
            decode_frame(&flipped, 0),
            Err(FrameError::Invalid(_))
        ));
    }
}
