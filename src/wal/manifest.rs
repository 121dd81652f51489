//! The manifest: the database's secret and the window it was created with.

use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64;

use super::format::{check_block, get_u64, put};
use super::names::MANIFEST_TEMP_NAME;
use crate::base::{Error, Result};
use crate::io::Storage;

/// File name of the manifest inside the database directory.
pub(crate) const MANIFEST_NAME: &str = "MANIFEST";
const MANIFEST_MAGIC: [u8; 8] = *b"ONCEMAN\0";
const MANIFEST_VERSION: u32 = 1;

// magic | version u32 | flags u32 | secret u64 | window_ms u64 | bucket_width_ms u64 |
// checksum u64 (xxh3-64 of bytes 0..CHECKSUM_OFFSET).
const MAN_MAGIC_OFFSET: usize = 0;
const MAN_VERSION_OFFSET: usize = MAN_MAGIC_OFFSET + 8;
const MAN_FLAGS_OFFSET: usize = MAN_VERSION_OFFSET + 4;
const MAN_SECRET_OFFSET: usize = MAN_FLAGS_OFFSET + 4;
const MAN_WINDOW_OFFSET: usize = MAN_SECRET_OFFSET + 8;
const MAN_BUCKET_WIDTH_OFFSET: usize = MAN_WINDOW_OFFSET + 8;
const MAN_CHECKSUM_OFFSET: usize = MAN_BUCKET_WIDTH_OFFSET + 8;
/// Length of the manifest file.
pub(crate) const MANIFEST_LEN: usize = MAN_CHECKSUM_OFFSET + 8;
const _: () = assert!(MANIFEST_LEN == 48);

/// What the manifest records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Manifest {
    pub(crate) secret: u64,
    pub(crate) window_ms: u64,
    pub(crate) bucket_width_ms: u64,
}

impl Manifest {
    /// Identifies the database in every segment header without revealing the secret.
    pub(crate) fn database_id(&self) -> u64 {
        xxh3_64(&self.secret.to_le_bytes())
    }

    pub(crate) fn encode(&self) -> [u8; MANIFEST_LEN] {
        let mut out = [0u8; MANIFEST_LEN];
        put(&mut out, MAN_MAGIC_OFFSET, &MANIFEST_MAGIC);
        put(
            &mut out,
            MAN_VERSION_OFFSET,
            &MANIFEST_VERSION.to_le_bytes(),
        );
        put(&mut out, MAN_FLAGS_OFFSET, &0u32.to_le_bytes());
        put(&mut out, MAN_SECRET_OFFSET, &self.secret.to_le_bytes());
        put(&mut out, MAN_WINDOW_OFFSET, &self.window_ms.to_le_bytes());
        put(
            &mut out,
            MAN_BUCKET_WIDTH_OFFSET,
            &self.bucket_width_ms.to_le_bytes(),
        );
        let checksum = xxh3_64(&out[..MAN_CHECKSUM_OFFSET]);
        put(&mut out, MAN_CHECKSUM_OFFSET, &checksum.to_le_bytes());
        out
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Manifest, &'static str> {
        if bytes.len() != MANIFEST_LEN {
            return Err("manifest has the wrong length");
        }
        check_block(
            bytes,
            &MANIFEST_MAGIC,
            [MAN_VERSION_OFFSET, MAN_CHECKSUM_OFFSET],
            MANIFEST_VERSION,
            [
                "bad manifest magic",
                "manifest checksum mismatch",
                "unsupported manifest version",
            ],
        )?;
        let field = |offset| get_u64(bytes, offset).ok_or("manifest has the wrong length");
        Ok(Manifest {
            secret: field(MAN_SECRET_OFFSET)?,
            window_ms: field(MAN_WINDOW_OFFSET)?,
            bucket_width_ms: field(MAN_BUCKET_WIDTH_OFFSET)?,
        })
    }

    /// Reads the manifest of `dir`; `None` if the directory has none yet.
    pub(crate) fn load(storage: &dyn Storage, dir: &Path) -> Result<Option<Manifest>> {
        let path = dir.join(MANIFEST_NAME);
        let bytes = match storage.read(&path, MANIFEST_LEN as u64) {
            Ok(bytes) => bytes,
            Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(err) if err.kind() == std::io::ErrorKind::InvalidData => {
                return Err(corrupted(path, "manifest is too long"));
            }
            Err(err) => return Err(err.into()),
        };
        Manifest::decode(&bytes)
            .map(Some)
            .map_err(|reason| corrupted(path, reason))
    }

    /// Writes the manifest atomically: temp file, fsync, rename, fsync directory.
    pub(crate) fn store(&self, storage: &dyn Storage, dir: &Path) -> Result<()> {
        let temp = dir.join(MANIFEST_TEMP_NAME);
        if storage.list(dir)?.contains(&temp) {
            storage.remove(&temp)?;
        }
        let mut file = storage.open_append(&temp, true)?;
        file.append(&self.encode())?;
        file.sync()?;
        drop(file);
        storage.rename(&temp, &dir.join(MANIFEST_NAME))?;
        storage.sync_dir(dir)?;
        Ok(())
    }
}

fn corrupted(path: PathBuf, reason: &str) -> Error {
    Error::Corrupted {
        path,
        offset: 0,
        reason: reason.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_damage() {
        let manifest = Manifest {
            secret: 42,
            window_ms: 60_000,
            bucket_width_ms: 1_000,
        };
        let mut bytes = manifest.encode();
        assert_eq!(Manifest::decode(&bytes), Ok(manifest));
        bytes[MAN_WINDOW_OFFSET] ^= 4;
        assert!(Manifest::decode(&bytes).is_err());
    }
}
