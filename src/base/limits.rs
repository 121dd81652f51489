//! Every size limit in one place. Encoders assert these and decoders check them, so the
//! two sides of the disk agree by construction.

/// Most time buckets one window may span (`window / bucket_width`).
pub const MAX_BUCKETS_PER_WINDOW: u64 = 4096;
/// Largest value accepted for `Options::max_key_bytes`.
pub const MAX_KEY_BYTES_LIMIT: usize = 64 * 1024;
/// Largest value accepted for `Options::max_response_bytes`.
pub const MAX_RESPONSE_BYTES_LIMIT: usize = 16 * 1024 * 1024;
/// Most keys one `Db::insert_many` call may carry.
pub const MAX_BATCH_KEYS: usize = 65_536;
/// Longest tenant or operation name of a `Scope`, in bytes.
pub const MAX_SCOPE_PART_BYTES: usize = 1024;
/// Largest value accepted for `Options::segment_max_bytes`.
pub const MAX_SEGMENT_BYTES_LIMIT: u64 = 1 << 30;
/// Most shards a database may have.
pub const MAX_SHARDS: usize = 4096;
/// Largest value accepted for `Options::expected_keys`: tables for more keys than this
/// would not fit any machine's memory.
pub const MAX_EXPECTED_KEYS: u64 = 1 << 34;

/// Smallest value accepted for `Options::segment_max_bytes`: a segment holds at least its
/// header and one full frame of a default-sized key.
pub const MIN_SEGMENT_BYTES: u64 = 4096;

/// Default of `Options::max_key_bytes`.
pub const DEFAULT_MAX_KEY_BYTES: usize = 1024;
/// Default of `Options::max_response_bytes`.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 1024 * 1024;
/// Default of `Options::segment_max_bytes`.
pub const DEFAULT_SEGMENT_MAX_BYTES: u64 = 64 * 1024 * 1024;
/// Default of `Options::shards`.
pub const DEFAULT_SHARDS: usize = 64;

/// Longest note a lease may attach to its record (`Lease::note`).
pub const MAX_NOTE_BYTES: usize = 1024;

/// Longest encoded scoped key: two length-prefixed scope parts and a key.
pub(crate) const MAX_SCOPED_KEY_BYTES: usize =
    2 + MAX_SCOPE_PART_BYTES + 2 + MAX_SCOPE_PART_BYTES + MAX_KEY_BYTES_LIMIT;
/// Lease ids at or above this value are never handed out (nor accepted from disk), so the
/// counter can neither saturate nor wrap: 2^62 leases at a billion per second last 146
/// years.
pub(crate) const LEASE_ID_LIMIT: u64 = 1 << 62;

/// Checks a key against the emptiness rule and the limit in force.
pub(crate) fn check_key(key: &[u8], max: usize) -> crate::base::error::Result<()> {
    use crate::base::error::Error;
    if key.is_empty() {
        return Err(Error::EmptyKey);
    }
    if key.len() > max {
        return Err(Error::KeyTooLong {
            len: key.len(),
            max,
        });
    }
    Ok(())
}
