//! The manifest: the database's secret, the window it was created with, and two floors:
//! no lease id and no run id at or above them has been handed out, so a reopen (even one
//! that finds every segment and every run expired) starts counting there and never
//! repeats an epoch or a run's name.

use std::path::{Path, PathBuf};

use xxhash_rust::xxh3::xxh3_64;

use super::format::{check_block, get_u64, put};
use super::names::MANIFEST_TEMP_NAME;
use crate::base::{Error, Result};
use crate::io::Storage;

/// File name of the manifest inside the database directory.
pub(crate) const MANIFEST_NAME: &str = "MANIFEST";
const MANIFEST_MAGIC: [u8; 8] = *b"ONCEMAN\0";
const MANIFEST_VERSION: u32 = 3;
/// The second layout: no run floor (read as 0), 56 bytes.
const MANIFEST_VERSION_NO_RUN_FLOOR: u32 = 2;
/// The first layout: no lease floor nor run floor (read as 0), 48 bytes.
const MANIFEST_VERSION_NO_FLOOR: u32 = 1;

// magic | version u32 | flags u32 | secret u64 | window_ms u64 | bucket_width_ms u64 |
// lease_floor u64 | run_floor u64 | checksum u64 (xxh3-64 of bytes 0..CHECKSUM_OFFSET).
// Version 2 has no run_floor: its checksum sits at RUN_FLOOR_OFFSET; version 1 has no
// lease_floor either: its checksum sits at LEASE_FLOOR_OFFSET.
const MAN_MAGIC_OFFSET: usize = 0;
const MAN_VERSION_OFFSET: usize = MAN_MAGIC_OFFSET + 8;
const MAN_FLAGS_OFFSET: usize = MAN_VERSION_OFFSET + 4;
const MAN_SECRET_OFFSET: usize = MAN_FLAGS_OFFSET + 4;
const MAN_WINDOW_OFFSET: usize = MAN_SECRET_OFFSET + 8;
const MAN_BUCKET_WIDTH_OFFSET: usize = MAN_WINDOW_OFFSET + 8;
const MAN_LEASE_FLOOR_OFFSET: usize = MAN_BUCKET_WIDTH_OFFSET + 8;
const MAN_RUN_FLOOR_OFFSET: usize = MAN_LEASE_FLOOR_OFFSET + 8;
const MAN_CHECKSUM_OFFSET: usize = MAN_RUN_FLOOR_OFFSET + 8;
/// Length of the manifest file.
pub(crate) const MANIFEST_LEN: usize = MAN_CHECKSUM_OFFSET + 8;
const _: () = assert!(MANIFEST_LEN == 64);
/// Length of a version-2 manifest.
const MANIFEST_LEN_NO_RUN_FLOOR: usize = MAN_RUN_FLOOR_OFFSET + 8;
/// Length of a version-1 manifest.
const MANIFEST_LEN_NO_FLOOR: usize = MAN_LEASE_FLOOR_OFFSET + 8;

/// What the manifest records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Manifest {
    pub(crate) secret: u64,
    pub(crate) window_ms: u64,
    pub(crate) bucket_width_ms: u64,
    /// Every lease id handed out is below this; raised (durably) before an id reaches it.
    pub(crate) lease_floor: u64,
    /// Every run id handed out is below this; raised (durably) before an id reaches it.
    pub(crate) run_floor: u64,
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
        put(
            &mut out,
            MAN_LEASE_FLOOR_OFFSET,
            &self.lease_floor.to_le_bytes(),
        );
        put(
            &mut out,
            MAN_RUN_FLOOR_OFFSET,
            &self.run_floor.to_le_bytes(),
        );
        let checksum = xxh3_64(&out[..MAN_CHECKSUM_OFFSET]);
        put(&mut out, MAN_CHECKSUM_OFFSET, &checksum.to_le_bytes());
        out
    }

    pub(crate) fn decode(bytes: &[u8]) -> Result<Manifest, &'static str> {
        let (version, checksum_offset) = match bytes.len() {
            MANIFEST_LEN => (MANIFEST_VERSION, MAN_CHECKSUM_OFFSET),
            MANIFEST_LEN_NO_RUN_FLOOR => (MANIFEST_VERSION_NO_RUN_FLOOR, MAN_RUN_FLOOR_OFFSET),
            MANIFEST_LEN_NO_FLOOR => (MANIFEST_VERSION_NO_FLOOR, MAN_LEASE_FLOOR_OFFSET),
            _ => return Err("manifest has the wrong length"),
        };
        check_block(
            bytes,
            &MANIFEST_MAGIC,
            [MAN_VERSION_OFFSET, checksum_offset],
            version,
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
            lease_floor: if version >= MANIFEST_VERSION_NO_RUN_FLOOR {
                field(MAN_LEASE_FLOOR_OFFSET)?
            } else {
                0
            },
            run_floor: if version == MANIFEST_VERSION {
                field(MAN_RUN_FLOOR_OFFSET)?
            } else {
                0
            },
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
        store_small_file(
            storage,
            dir,
            (MANIFEST_NAME, MANIFEST_TEMP_NAME),
            &self.encode(),
        )
    }
}

/// Replaces the small file `names.0` of `dir` with `bytes` atomically: written as
/// `names.1` (a left-over one removed first), fsynced, renamed over it, and the directory
/// fsynced. A crash leaves the old file or the new one, whole.
pub(crate) fn store_small_file(
    storage: &dyn Storage,
    dir: &Path,
    (name, temp_name): (&str, &str),
    bytes: &[u8],
) -> Result<()> {
    let temp = dir.join(temp_name);
    if storage.list(dir)?.contains(&temp) {
        storage.remove(&temp)?;
    }
    let mut file = storage.open_append(&temp, true)?;
    file.append(bytes)?;
    file.sync()?;
    drop(file);
    storage.rename(&temp, &dir.join(name))?;
    storage.sync_dir(dir)?;
    Ok(())
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
            lease_floor: 1 << 24,
            run_floor: 1 << 10,
        };
        let mut bytes = manifest.encode();
        assert_eq!(Manifest::decode(&bytes), Ok(manifest));
        for offset in [
            MAN_WINDOW_OFFSET,
            MAN_LEASE_FLOOR_OFFSET,
            MAN_RUN_FLOOR_OFFSET,
        ] {
            bytes[offset] ^= 4;
            assert!(Manifest::decode(&bytes).is_err());
            bytes[offset] ^= 4;
        }
        assert!(Manifest::decode(&bytes[..MANIFEST_LEN - 1]).is_err());
    }

    /// An older layout, `len` bytes with its checksum recomputed, of a manifest whose
    /// floors are `lease_floor` and `run_floor`.
    fn older_layout(version: u32, len: usize, lease_floor: u64) -> Vec<u8> {
        let mut bytes = Manifest {
            secret: 42,
            window_ms: 60_000,
            bucket_width_ms: 1_000,
            lease_floor,
            run_floor: 99,
        }
        .encode()[..len]
            .to_vec();
        put(&mut bytes, MAN_VERSION_OFFSET, &version.to_le_bytes());
        let checksum = xxh3_64(&bytes[..len - 8]);
        put(&mut bytes, len - 8, &checksum.to_le_bytes());
        bytes
    }

    #[test]
    fn a_first_layout_manifest_reads_with_floors_zero() {
        let bytes = older_layout(1, MANIFEST_LEN_NO_FLOOR, 0);
        let manifest = Manifest::decode(&bytes).unwrap();
        let read = (manifest.window_ms, manifest.lease_floor, manifest.run_floor);
        assert_eq!(read, (60_000, 0, 0));
    }

    #[test]
    fn a_second_layout_manifest_reads_with_run_floor_zero() {
        let bytes = older_layout(2, MANIFEST_LEN_NO_RUN_FLOOR, 1 << 24);
        let manifest = Manifest::decode(&bytes).unwrap();
        assert_eq!((manifest.lease_floor, manifest.run_floor), (1 << 24, 0));
    }
}
