//! The in-memory index: hash-sharded tables of fingerprints and records, time-bucketed.

pub(crate) mod records;
pub(crate) mod shard;
pub(crate) mod table;
pub(crate) mod window;
