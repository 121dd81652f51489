//! The public surface: `Db`, `Options`, `Scope`, `Reservation`, `Lease`, `Record`,
//! `Stats`. It validates input, hands plain values to the engine, and turns the
//! engine's answers into public types.

#[cfg(feature = "async")]
mod committed;
mod db;
mod observe;
mod once;
mod options;
mod record;
mod renewer;
mod stats;

pub use crate::base::{Advance, Record, RecordStatus};
#[cfg(feature = "replicate")]
pub use db::Standby;
pub use db::{BucketInfo, Db, is_archive, verify, verify_with};
pub use once::{LeaseWatch, Lost, OnError, Once, RunOnce};
#[cfg(feature = "async")]
pub(crate) use once::{Renewals, cut_to, too_large_note, unfinished_note};
pub use options::Options;
pub use record::{InFlight, Lease, LeaseError, Reservation, Scope};
pub use stats::Stats;
