//! Log entries: the payloads carried by record frames.

use super::format::{encode_frame, get_u32, get_u64};
use crate::fingerprint::Fingerprint;
use crate::record::Finish;

pub(crate) const KIND_KEYS: u8 = 1;
pub(crate) const KIND_RESERVE: u8 = 2;
pub(crate) const KIND_COMPLETE: u8 = 3;
pub(crate) const KIND_FAIL: u8 = 4;
pub(crate) const KIND_RELEASE: u8 = 5;

/// An entry to append.
#[derive(Debug)]
pub(crate) enum LogEntry<'a> {
    /// Dedup keys admitted (one batch).
    Keys(&'a [Fingerprint]),
    /// A record reserved in flight.
    Reserve {
        fingerprint: Fingerprint,
        lease_id: u64,
        request_hash: u128,
        created_ms: u64,
        scoped_key: &'a [u8],
    },
    /// A lease ended.
    Finish {
        fingerprint: Fingerprint,
        lease_id: u64,
        at_ms: u64,
        finish: &'a Finish,
    },
}

impl LogEntry<'_> {
    /// Appends the entry as one frame.
    pub(crate) fn encode(&self, out: &mut Vec<u8>) {
        match self {
            LogEntry::Keys(fingerprints) => encode_frame(out, KIND_KEYS, |out| {
                out.extend_from_slice(&(fingerprints.len() as u32).to_le_bytes());
                for fp in *fingerprints {
                    out.extend_from_slice(&fp.0.to_le_bytes());
                }
            }),
            LogEntry::Reserve {
                fingerprint,
                lease_id,
                request_hash,
                created_ms,
                scoped_key,
            } => encode_frame(out, KIND_RESERVE, |out| {
                out.extend_from_slice(&fingerprint.0.to_le_bytes());
                out.extend_from_slice(&lease_id.to_le_bytes());
                out.extend_from_slice(&request_hash.to_le_bytes());
                out.extend_from_slice(&created_ms.to_le_bytes());
                out.extend_from_slice(&(scoped_key.len() as u32).to_le_bytes());
                out.extend_from_slice(scoped_key);
            }),
            LogEntry::Finish {
                fingerprint,
                lease_id,
                at_ms,
                finish,
            } => {
                let (kind, response): (u8, &[u8]) = match finish {
                    Finish::Complete(response) => (KIND_COMPLETE, response),
                    Finish::Fail(response) => (KIND_FAIL, response),
                    Finish::Release => (KIND_RELEASE, &[]),
                };
                encode_frame(out, kind, |out| {
                    out.extend_from_slice(&fingerprint.0.to_le_bytes());
                    out.extend_from_slice(&lease_id.to_le_bytes());
                    out.extend_from_slice(&at_ms.to_le_bytes());
                    out.extend_from_slice(&(response.len() as u32).to_le_bytes());
                    out.extend_from_slice(response);
                });
            }
        }
    }
}

/// An entry read back from a frame, borrowing the frame's bytes.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum DecodedEntry<'a> {
    Keys(FingerprintList<'a>),
    Reserve {
        fingerprint: Fingerprint,
        lease_id: u64,
        request_hash: u128,
        created_ms: u64,
        scoped_key: &'a [u8],
    },
    Finish {
        kind: u8,
        fingerprint: Fingerprint,
        lease_id: u64,
        at_ms: u64,
        response: &'a [u8],
    },
}

/// The fingerprints of a `Keys` entry, decoded lazily.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct FingerprintList<'a>(&'a [u8]);

impl FingerprintList<'_> {
    pub(crate) fn iter(&self) -> impl Iterator<Item = Fingerprint> + '_ {
        self.0.chunks_exact(16).map(|chunk| {
            let mut word = [0u8; 16];
            word.copy_from_slice(chunk);
            Fingerprint(u128::from_le_bytes(word))
        })
    }
}

fn get_u128(bytes: &[u8], offset: usize) -> u128 {
    u128::from(get_u64(bytes, offset)) | (u128::from(get_u64(bytes, offset + 8)) << 64)
}

/// Decodes the payload of a frame of `kind`, checking every length against the payload.
pub(crate) fn decode_entry(kind: u8, payload: &[u8]) -> Result<DecodedEntry<'_>, &'static str> {
    match kind {
        KIND_KEYS => {
            if payload.len() < 4 {
                return Err("keys entry is too short");
            }
            let count = get_u32(payload, 0) as usize;
            if payload.len() - 4 != count.saturating_mul(16) {
                return Err("keys entry count does not match its length");
            }
            Ok(DecodedEntry::Keys(FingerprintList(&payload[4..])))
        }
        KIND_RESERVE => {
            const FIXED: usize = 16 + 8 + 16 + 8 + 4;
            if payload.len() < FIXED {
                return Err("reserve entry is too short");
            }
            let key_len = get_u32(payload, FIXED - 4) as usize;
            if payload.len() - FIXED != key_len {
                return Err("reserve entry key length does not match");
            }
            Ok(DecodedEntry::Reserve {
                fingerprint: Fingerprint(get_u128(payload, 0)),
                lease_id: get_u64(payload, 16),
                request_hash: get_u128(payload, 24),
                created_ms: get_u64(payload, 40),
                scoped_key: &payload[FIXED..],
            })
        }
        KIND_COMPLETE | KIND_FAIL | KIND_RELEASE => {
            const FIXED: usize = 16 + 8 + 8 + 4;
            if payload.len() < FIXED {
                return Err("finish entry is too short");
            }
            let response_len = get_u32(payload, FIXED - 4) as usize;
            if payload.len() - FIXED != response_len {
                return Err("finish entry response length does not match");
            }
            if kind == KIND_RELEASE && response_len != 0 {
                return Err("release entry carries a response");
            }
            Ok(DecodedEntry::Finish {
                kind,
                fingerprint: Fingerprint(get_u128(payload, 0)),
                lease_id: get_u64(payload, 16),
                at_ms: get_u64(payload, 24),
                response: &payload[FIXED..],
            })
        }
        _ => Err("unknown entry kind"),
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::segment::format::decode_frame;

    fn round_trip(entry: &LogEntry<'_>) -> Vec<u8> {
        let mut buf = Vec::new();
        entry.encode(&mut buf);
        buf
    }

    #[test]
    fn keys_round_trip() {
        let fps = [Fingerprint(1), Fingerprint(u128::MAX - 5)];
        let buf = round_trip(&LogEntry::Keys(&fps));
        let frame = decode_frame(&buf, 0).unwrap();
        let DecodedEntry::Keys(list) = decode_entry(frame.kind, frame.payload).unwrap() else {
            panic!("wrong kind");
        };
        assert_eq!(list.iter().collect::<Vec<_>>(), fps);
    }

    #[test]
    fn reserve_and_finish_round_trip() {
        let buf = round_trip(&LogEntry::Reserve {
            fingerprint: Fingerprint(9),
            lease_id: 4,
            request_hash: 77,
            created_ms: 1234,
            scoped_key: b"scope-key",
        });
        let frame = decode_frame(&buf, 0).unwrap();
        assert_eq!(
            decode_entry(frame.kind, frame.payload).unwrap(),
            DecodedEntry::Reserve {
                fingerprint: Fingerprint(9),
                lease_id: 4,
                request_hash: 77,
                created_ms: 1234,
                scoped_key: b"scope-key",
            }
        );
        let finish = Finish::Complete(Arc::from(&b"ok"[..]));
        let buf = round_trip(&LogEntry::Finish {
            fingerprint: Fingerprint(9),
            lease_id: 4,
            at_ms: 99,
            finish: &finish,
        });
        let frame = decode_frame(&buf, 0).unwrap();
        assert_eq!(
            decode_entry(frame.kind, frame.payload).unwrap(),
            DecodedEntry::Finish {
                kind: KIND_COMPLETE,
                fingerprint: Fingerprint(9),
                lease_id: 4,
                at_ms: 99,
                response: b"ok",
            }
        );
    }

    #[test]
    fn inconsistent_lengths_are_rejected() {
        assert!(decode_entry(KIND_KEYS, &[2, 0, 0, 0, 1]).is_err());
        assert!(decode_entry(KIND_RESERVE, &[0; 10]).is_err());
        assert!(decode_entry(KIND_RELEASE, &[0; 36 + 1]).is_err());
        assert!(decode_entry(99, &[]).is_err());
    }
}
