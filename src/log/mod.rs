//! The log: the on-disk format (segment names, headers, frames, entries, the manifest),
//! the journal that appends to it, and the scan that reads it back for recovery and
//! `verify`.
//!
//! Below the engine, above `base` and `io`: it knows fingerprints, buckets and lease
//! endings, and nothing of the index or the API.

pub(crate) mod entry;
pub(crate) mod format;
pub(crate) mod journal;
pub(crate) mod manifest;
pub(crate) mod names;
pub(crate) mod report;
pub(crate) mod scan;
pub(crate) mod verify;
