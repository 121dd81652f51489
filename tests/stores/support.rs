//! What the modules of this binary share: real PostgreSQL, Redis and NATS servers, and
//! the examples' paths, from `oncedb_testkit::servers`.

pub use oncedb_testkit::servers;
