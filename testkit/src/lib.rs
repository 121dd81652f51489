//! What oncedb's tests, benches and tools share, so that none keeps a copy of its own:
//! - [`fixtures`]: the test window, a manual clock at a fixed start, stores on it;
//! - [`model`]: the reference model of the semantics that the proptest state machine and
//!   the fuzz harness both check the engine against;
//! - [`servers`]: real PostgreSQL, Redis (single and cluster) and NATS servers, started on
//!   free loopback ports in temp dirs and stopped when dropped;
//! - [`gate`]: holds chosen threads' fsyncs until the test lets them go;
//! - [`watched`]: storage that calls a hook after every sync (who syncs, and when);
//! - [`workload`]: the deterministic key streams of `oncedb bench` and the criterion
//!   benches;
//! - [`schedule`]: seeded fault schedules, the history of what each writer was told, and
//!   the checker of the bad-day tests.
//!
//! The one seeded generator is [`oncedb::io::SplitMix64`]: the engine's simulated power
//! loss uses it too.

pub mod fixtures;
pub mod gate;
pub mod model;
pub mod schedule;
pub mod servers;
pub mod watched;
pub mod workload;
