//! The `oncedb` command line: `oncedb bench`.

pub mod bench;
pub mod workload;
