//! Keyed 128-bit fingerprints: one hash per key decides its shard, its slot and its tag.

#![expect(
    clippy::cast_possible_truncation,
    reason = "a fingerprint's halves and shard index are taken from its bits on purpose"
)]

use xxhash_rust::xxh3::xxh3_128_with_seed;

/// Seeds derived from the database secret, one per hash domain so that a dedup key, a
/// scoped record key and a request body never share a hash function.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Hasher {
    key_seed: u64,
    record_seed: u64,
    request_seed: u64,
    mark_seed: u64,
}

impl Hasher {
    pub(crate) fn new(secret: u64) -> Self {
        Hasher {
            key_seed: secret,
            record_seed: secret.rotate_left(21) ^ 0x9e37_79b9_7f4a_7c15,
            request_seed: secret.rotate_left(42) ^ 0xc2b2_ae3d_27d4_eb4f,
            mark_seed: secret.rotate_left(53) ^ 0x1656_67b1_9e37_79f9,
        }
    }

    /// Fingerprint of a plain dedup key.
    pub(crate) fn key(&self, key: &[u8]) -> Fingerprint {
        Fingerprint(xxh3_128_with_seed(key, self.key_seed))
    }

    /// Fingerprint of an encoded scope + key.
    pub(crate) fn record(&self, scoped_key: &[u8]) -> Fingerprint {
        Fingerprint(xxh3_128_with_seed(scoped_key, self.record_seed))
    }

    /// Fingerprint of an encoded scope + aggregate id (the ordering guard).
    pub(crate) fn mark(&self, scoped_key: &[u8]) -> Fingerprint {
        Fingerprint(xxh3_128_with_seed(scoped_key, self.mark_seed))
    }

    /// Binding hash of a canonical request body.
    pub(crate) fn request(&self, request: &[u8]) -> u128 {
        xxh3_128_with_seed(request, self.request_seed)
    }
}

/// A 128-bit keyed hash. The high half is the slot tag; the top bits of the low half
/// choose the shard, so tag and shard are independent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Fingerprint(pub(crate) u128);

impl Fingerprint {
    /// The 64-bit tag stored in a dedup slot; never 0 (0 marks an empty slot).
    #[inline]
    pub(crate) fn tag(self) -> u64 {
        let tag = (self.0 >> 64) as u64;
        tag.max(1)
    }

    /// Index of the shard owning this fingerprint among `1 << shard_bits` shards.
    #[inline]
    pub(crate) fn shard(self, shard_bits: u32) -> usize {
        let low = self.0 as u64;
        // `checked_shr` covers shard_bits == 0 (a shift by 64).
        low.checked_shr(64 - shard_bits).unwrap_or(0) as usize
    }
}

/// A random per-database secret, from the standard library's randomly keyed SipHash.
pub(crate) fn random_secret() -> u64 {
    use std::hash::{BuildHasher, Hasher as _};
    let mut hasher = std::collections::hash_map::RandomState::new().build_hasher();
    hasher.write_u64(std::process::id() as u64);
    hasher.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn domains_differ() {
        let hasher = Hasher::new(7);
        assert_ne!(hasher.key(b"a"), hasher.record(b"a"));
        assert_ne!(hasher.key(b"a").0, hasher.request(b"a"));
    }

    #[test]
    fn secret_changes_fingerprints() {
        assert_ne!(Hasher::new(1).key(b"k"), Hasher::new(2).key(b"k"));
    }

    #[test]
    fn shard_is_in_range() {
        let hasher = Hasher::new(3);
        for i in 0..1000u32 {
            let fp = hasher.key(&i.to_le_bytes());
            assert_eq!(fp.shard(0), 0);
            assert!(fp.shard(6) < 64);
            assert!(fp.tag() != 0);
        }
    }
}
