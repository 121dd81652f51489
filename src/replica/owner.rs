//! The file `REPLICA`: the token under which this store claimed its replica (32 bytes).
//!
//! | offset | size | field |
//! |---:|---:|---|
//! | 0 | 8 | magic `ONCEREP\0` |
//! | 8 | 4 | version (1) |
//! | 12 | 4 | flags (0) |
//! | 16 | 8 | token: the claim's random id, as the stream's owner message carries it |
//! | 24 | 8 | XXH3-64 of bytes 0..24 |
//!
//! Written as `REPLICA.tmp`, fsynced, renamed, and the directory fsynced.

use std::path::Path;

use xxhash_rust::xxh3::xxh3_64;

use crate::base::{Error, Result};
use crate::io::Storage;

const NAME: &str = "REPLICA";
const TEMP_NAME: &str = "REPLICA.tmp";
const MAGIC: &[u8; 8] = b"ONCEREP\0";
const VERSION: u32 = 1;
const LEN: usize = 32;

/// Whether `path` is a claim file (or the temporary one a claim writes first).
pub(super) fn is_claim_file(path: &Path) -> bool {
    path.file_name()
        .is_some_and(|name| name == NAME || name == TEMP_NAME)
}

fn encode(token: u64) -> [u8; LEN] {
    let mut bytes = [0u8; LEN];
    let mut put = |offset: usize, field: &[u8]| {
        if let Some(slot) = bytes.get_mut(offset..offset + field.len()) {
            slot.copy_from_slice(field);
        }
    };
    put(0, MAGIC);
    put(8, &VERSION.to_le_bytes());
    put(12, &0u32.to_le_bytes());
    put(16, &token.to_le_bytes());
    let checksum = xxh3_64(bytes.get(..24).unwrap_or_default());
    if let Some(slot) = bytes.get_mut(24..32) {
        slot.copy_from_slice(&checksum.to_le_bytes());
    }
    bytes
}

fn decode(bytes: &[u8]) -> std::result::Result<u64, &'static str> {
    let field = |range: std::ops::Range<usize>| bytes.get(range).unwrap_or_default();
    let word = |range: std::ops::Range<usize>| {
        let mut out = [0u8; 8];
        out.copy_from_slice(field(range).get(..8).unwrap_or(&[0; 8]));
        u64::from_le_bytes(out)
    };
    if bytes.len() != LEN || field(0..8) != MAGIC {
        return Err("not a replica claim file");
    }
    if word(24..32) != xxh3_64(field(0..24)) {
        return Err("replica claim checksum mismatch");
    }
    if field(8..12) != VERSION.to_le_bytes() || field(12..16) != [0; 4] {
        return Err("unsupported replica claim version or flags");
    }
    Ok(word(16..24))
}

/// The token this store claimed its replica under, if it ever did.
pub(super) fn load(storage: &dyn Storage, dir: &Path) -> Result<Option<u64>> {
    let path = dir.join(NAME);
    match storage.read(&path, LEN as u64) {
        Ok(bytes) => decode(&bytes).map(Some).map_err(|reason| Error::Corrupted {
            path,
            offset: 0,
            reason: reason.to_owned(),
        }),
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(err) if err.kind() == std::io::ErrorKind::InvalidData => Err(Error::Corrupted {
            path,
            offset: 0,
            reason: "replica claim file is too long".to_owned(),
        }),
        Err(err) => Err(err.into()),
    }
}

/// Records the claim durably.
pub(super) fn store(storage: &dyn Storage, dir: &Path, token: u64) -> Result<()> {
    crate::wal::store_small_file(storage, dir, (NAME, TEMP_NAME), &encode(token))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_claim_round_trips_and_damage_is_refused() {
        let bytes = encode(0xfeed_beef);
        assert_eq!(decode(&bytes), Ok(0xfeed_beef));
        for offset in 0..LEN {
            let mut damaged = bytes;
            damaged[offset] ^= 1;
            assert!(decode(&damaged).is_err(), "byte {offset}");
        }
        assert!(decode(&bytes[..LEN - 1]).is_err());
    }
}
