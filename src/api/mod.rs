//! The public surface: `Db`, `Options`, `Scope`, `Reservation`, `Lease`, `Record`,
//! `Stats`. It validates input, hands plain values to the engine, and turns the
//! engine's answers into public types.

pub(crate) mod db;
pub(crate) mod observe;
pub(crate) mod options;
pub(crate) mod record;
pub(crate) mod stats;
