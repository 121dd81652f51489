//! Outcomes reported to the `metrics` facade (feature `metrics`) and as `tracing` events
//! (feature `tracing`). Without either feature every function here is empty.
//!
//! Metrics, all prefixed `oncedb_`:
//!
//! | name | kind | labels |
//! |---|---|---|
//! | `keys_total` | counter | `result`: `admitted`, `duplicate` |
//! | `reservations_total` | counter | `operation`, `outcome`: `acquired`, `in_flight`, `replayed`, `mismatch` |
//! | `lease_endings_total` | counter | `operation`, `ending`: `completed`, `failed`, `released`, `noted`, `fenced`, `lost` |
//! | `take_overs_total` | counter | `operation` |
//! | `versions_total` | counter | `operation`, `answer`: `applied`, `duplicate`, `stale`, `gap` |
//! | `fsync_seconds` | histogram | none |
//! | `live_keys`, `live_records`, `stuck_records`, `bytes_on_disk` | gauge | none, set by `Db::stats` |
//!
//! Cardinality: `operation` is the scope's operation name, which an application picks
//! from a fixed set in code (an endpoint or message type); the tenant, which grows with
//! the customer base, is never a label. Tracing events carry the tenant, the operation
//! and `key_hash`, the XXH3-64 (seed 0) of the key in hex, never the key itself.

use super::record::{Reservation, Scope};
use super::stats::Stats;
use crate::base::Advance;

/// The outcome of a reserve.
pub(crate) fn reservation(scope: &Scope, key: &[u8], answer: &Reservation) {
    let _ = (scope, key);
    let outcome = match answer {
        Reservation::Acquired(_) => "acquired",
        Reservation::InFlight { .. } => "in_flight",
        Reservation::Completed(_) | Reservation::Failed(_) => "replayed",
        Reservation::Expired(_) => "expired",
        Reservation::Mismatch => "mismatch",
    };
    #[cfg(feature = "metrics")]
    metrics::counter!("oncedb_reservations_total", "operation" => operation(scope), "outcome" => outcome)
        .increment(1);
    #[cfg(feature = "tracing")]
    match answer {
        Reservation::Completed(_) | Reservation::Failed(_) => tracing::info!(
            event = "idempotency_replay",
            tenant = %lossy(scope.tenant()),
            operation = %lossy(scope.operation()),
            key_hash = %key_hash(key),
            status = if matches!(answer, Reservation::Completed(_)) { "completed" } else { "failed" },
            "replaying a stored response"
        ),
        Reservation::Mismatch => tracing::warn!(
            event = "idempotency_mismatch",
            tenant = %lossy(scope.tenant()),
            operation = %lossy(scope.operation()),
            key_hash = %key_hash(key),
            "key reused with a different request"
        ),
        Reservation::InFlight { .. } => tracing::info!(
            event = "idempotency_in_flight",
            tenant = %lossy(scope.tenant()),
            operation = %lossy(scope.operation()),
            key_hash = %key_hash(key),
            status = "in_flight",
            "an earlier attempt is still in flight"
        ),
        Reservation::Expired(_) => tracing::info!(
            event = "idempotency_response_expired",
            tenant = %lossy(scope.tenant()),
            operation = %lossy(scope.operation()),
            key_hash = %key_hash(key),
            "the operation finished, and its response aged out"
        ),
        Reservation::Acquired(_) => {}
    }
    let _ = outcome;
}

/// How a lease call ended: `completed`, `failed`, `released`, `noted`, `fenced` or `lost`.
pub(crate) fn lease_ending(scope: &Scope, key_hash: u64, ending: &'static str) {
    let _ = (scope, key_hash, ending);
    #[cfg(feature = "metrics")]
    metrics::counter!("oncedb_lease_endings_total", "operation" => operation(scope), "ending" => ending)
        .increment(1);
    #[cfg(feature = "tracing")]
    if ending == "fenced" {
        tracing::warn!(
            event = "idempotency_fenced",
            tenant = %lossy(scope.tenant()),
            operation = %lossy(scope.operation()),
            key_hash = %format!("{key_hash:016x}"),
            "a lease that was taken over tried to change its record"
        );
    }
}

/// A lease renewed (`keep_alive`).
pub(crate) fn renewal(scope: &Scope) {
    let _ = scope;
    #[cfg(feature = "metrics")]
    metrics::counter!("oncedb_lease_renewals_total", "operation" => operation(scope)).increment(1);
}

/// A take-over.
pub(crate) fn take_over(scope: &Scope, key: &[u8], epoch: u64) {
    let _ = (scope, key, epoch);
    #[cfg(feature = "metrics")]
    metrics::counter!("oncedb_take_overs_total", "operation" => operation(scope)).increment(1);
    #[cfg(feature = "tracing")]
    tracing::warn!(
        event = "idempotency_take_over",
        tenant = %lossy(scope.tenant()),
        operation = %lossy(scope.operation()),
        key_hash = %key_hash(key),
        epoch,
        status = "in_flight",
        "a record in flight was taken over"
    );
}

/// An ordering-guard answer.
pub(crate) fn version(scope: &Scope, answer: Advance) {
    let _ = (scope, answer);
    #[cfg(feature = "metrics")]
    {
        let answer = match answer {
            Advance::Applied => "applied",
            Advance::Duplicate => "duplicate",
            Advance::Stale { .. } => "stale",
            Advance::Gap { .. } => "gap",
        };
        metrics::counter!("oncedb_versions_total", "operation" => operation(scope), "answer" => answer)
            .increment(1);
    }
}

/// Keys answered by `insert_if_absent` or `insert_many` (`true`: admitted).
pub(crate) fn keys(admitted: &[bool]) {
    let _ = admitted;
    #[cfg(feature = "metrics")]
    {
        let new = admitted.iter().filter(|&&yes| yes).count() as u64;
        metrics::counter!("oncedb_keys_total", "result" => "admitted").increment(new);
        metrics::counter!("oncedb_keys_total", "result" => "duplicate")
            .increment(admitted.len() as u64 - new);
    }
}

/// Gauges from a stats snapshot.
/// A standby's lag, as `Standby::lag` found it.
#[cfg(feature = "replicate")]
pub(crate) fn standby(lag: &crate::base::Result<crate::engine::StandbyLag>) {
    #[cfg(feature = "metrics")]
    {
        let following = if lag.is_ok() { 1.0 } else { 0.0 };
        metrics::gauge!("oncedb_standby_following").set(following);
        if let Ok(lag) = lag {
            // Gauges are f64; counts this large lose precision only past 2^53.
            metrics::gauge!("oncedb_standby_pending_messages").set(lag.pending_messages as f64);
        }
    }
    #[cfg(not(feature = "metrics"))]
    let _ = lag;
}

pub(crate) fn gauges(stats: &Stats) {
    let _ = stats;
    #[cfg(feature = "metrics")]
    {
        // Gauges are f64; counts this large lose precision only past 2^53.
        let gauge = |value: u64| value as f64;
        metrics::gauge!("oncedb_live_keys").set(gauge(stats.live_keys));
        metrics::gauge!("oncedb_live_records").set(gauge(stats.live_records));
        metrics::gauge!("oncedb_stuck_records").set(gauge(stats.stuck_records));
        metrics::gauge!("oncedb_bytes_on_disk").set(gauge(stats.bytes_on_disk));
        metrics::gauge!("oncedb_replication_lag_bytes").set(gauge(stats.replication_lag_bytes));
        metrics::gauge!("oncedb_replication_runs_unshipped")
            .set(gauge(stats.replication_runs_unshipped));
        metrics::gauge!("oncedb_replication_runs_awaiting_log")
            .set(gauge(stats.replication_runs_awaiting_log));
    }
}

/// The stable, non-secret hash that events carry instead of a key; computed only when
/// events are compiled in.
pub(crate) fn key_hash_of(key: &[u8]) -> u64 {
    if cfg!(feature = "tracing") {
        xxhash_rust::xxh3::xxh3_64(key)
    } else {
        0
    }
}

#[cfg(feature = "tracing")]
fn key_hash(key: &[u8]) -> String {
    format!("{:016x}", key_hash_of(key))
}

#[cfg(feature = "tracing")]
fn lossy(bytes: &[u8]) -> std::borrow::Cow<'_, str> {
    String::from_utf8_lossy(bytes)
}

#[cfg(feature = "metrics")]
fn operation(scope: &Scope) -> String {
    String::from_utf8_lossy(scope.operation()).into_owned()
}
