//! The public counters, filled from the engine's report.

use crate::engine::EngineStats;

/// A snapshot of the database's counters, from [`Db::stats`](crate::Db::stats).
/// Event counts are since open; live counts are as of the call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Stats {
    /// Dedup keys inside the window.
    pub live_keys: u64,
    /// Idempotency records inside the window (in flight, completed or failed).
    pub live_records: u64,
    /// Keys admitted by `insert_if_absent` / `insert_many` (answered `true`).
    pub admitted: u64,
    /// Keys answered as duplicates (`false`).
    pub duplicates: u64,
    /// Reservations that acquired a lease.
    pub acquired: u64,
    /// Reservations answered `InFlight`.
    pub in_flight_hits: u64,
    /// Reservations answered `Completed` or `Failed` (a stored result replayed).
    pub replays: u64,
    /// Reservations answered `Mismatch`.
    pub mismatches: u64,
    /// Leases completed.
    pub completed: u64,
    /// Leases failed.
    pub failed: u64,
    /// Leases released.
    pub released: u64,
    /// Lease endings refused because the record had expired or the lease had ended.
    pub leases_lost: u64,
    /// Lease calls refused with `Error::Fenced` (the record was taken over).
    pub fenced: u64,
    /// Records taken over by `Db::take_over`.
    pub take_overs: u64,
    /// Records in flight at least `Options::stuck_after` (as of the call).
    pub stuck_records: u64,
    /// Callers waiting now for a record in flight to end (`wait_finished`, `run_once`).
    pub outcome_waiters: u64,
    /// Ordering guard: versions applied.
    pub versions_applied: u64,
    /// Ordering guard: versions answered `Duplicate`.
    pub versions_duplicate: u64,
    /// Ordering guard: versions answered `Stale`.
    pub versions_stale: u64,
    /// Ordering guard: versions answered `Gap`.
    pub versions_gap: u64,
    /// Ordering guard: aggregates with a version inside the window.
    pub live_aggregates: u64,
    /// Writes refused with `Error::Full`.
    pub full_rejections: u64,
    /// Buckets dropped early (per shard) by `FullPolicy::EvictOldest`.
    pub buckets_evicted: u64,
    /// Keys and records dropped early by `FullPolicy::EvictOldest`.
    pub keys_evicted: u64,
    /// Buckets currently holding at least one live key or record.
    pub buckets_live: u64,
    /// Buckets that have left the window since open (dropped whole).
    pub buckets_dropped: u64,
    /// Clock readings too far ahead of the store's time to adopt
    /// ([`Options::max_clock_step`](crate::Options::max_clock_step)), since open.
    pub clock_readings_held_back: u64,
    /// Table slots occupied, live or expired and not yet swept.
    pub table_slots_used: u64,
    /// Table slots inspected by lookups since open (probe length = probes / lookups).
    pub table_probes: u64,
    /// Approximate heap bytes held by the index.
    pub index_bytes: u64,
    /// Durable stores: fsync calls made since open.
    pub fsyncs: u64,
    /// Durable stores: times a call slept until a group commit covered its entries
    /// (one a waiting call when each waiter is woken only by the group that covers it).
    pub commit_waits: u64,
    /// Durable stores: sleepers that the end of a group commit woke: those it covered,
    /// and one to lead the next group.
    pub commit_wakeups: u64,
    /// Durable stores: log entries appended since open.
    pub log_records: u64,
    /// Durable stores: bytes appended to segment files since open.
    pub log_bytes: u64,
    /// Durable stores: log entries replayed by the last open.
    pub recovered_records: u64,
    /// Durable stores: bytes of torn tail cut off the newest segment by the last open.
    pub recovered_truncated_bytes: u64,
    /// Durable stores: frames that verified but lay in a torn tail the last open cut
    /// (never acknowledged as durable).
    pub recovered_dropped_frames: u64,
    /// Durable stores: byte ranges `RecoveryMode::Salvage` skipped at the last open.
    pub recovery_skipped_ranges: u64,
    /// Durable stores: segment files of expired buckets deleted since open.
    pub segments_deleted: u64,
    /// Durable stores: segment files on disk.
    pub segments: u64,
    /// Replicating stores (`Options::replicate`): log bytes fsynced here and not yet
    /// acknowledged by the replica. In async mode, what a node's loss would lose now.
    pub replication_lag_bytes: u64,
    /// Replicating stores: sealed key runs (`memory_budget`) the replica does not hold
    /// whole yet. A restore leaves out a run held in part, and every later one; their
    /// keys are replayed from the log instead, which is slower but loses nothing.
    pub replication_runs_unshipped: u64,
    /// Replicating stores: of those, the runs held back until the log their cover names
    /// is on the replica (a restore refuses a run whose log it lacks). Under `Interval`, a
    /// run waits for the fsync that ships that log.
    pub replication_runs_awaiting_log: u64,
    /// Durable stores: bytes on disk (segment files and the manifest).
    pub bytes_on_disk: u64,
    /// Durable stores: fsync latency percentiles since open, in microseconds, as the
    /// upper bound of a power-of-two bucket (so within a factor of two): median.
    pub fsync_p50_us: u64,
    /// 99th percentile of fsync latency (see `fsync_p50_us`).
    pub fsync_p99_us: u64,
    /// Slowest fsync since open (bucket upper bound, see `fsync_p50_us`).
    pub fsync_max_us: u64,
    /// With `Options::memory_budget`: sealed key runs live on disk.
    pub sealed_runs: u64,
    /// Dedup keys in the live sealed runs (not counted in `live_keys`, which counts
    /// keys in memory).
    pub sealed_keys: u64,
    /// With `Options::memory_budget`: record runs live on disk (settled idempotency
    /// records sealed out of memory, `docs/design.md`, "Record runs").
    pub sealed_record_runs: u64,
    /// Idempotency records in the live record runs (not counted in `live_records`, which
    /// counts records in memory).
    pub sealed_records: u64,
    /// Memory the live runs' fences and filters take, key runs and record runs
    /// (included in `index_bytes`).
    pub sealed_filter_bytes: u64,
    /// Runs written since open, key runs and record runs.
    pub runs_sealed: u64,
    /// Runs removed (or archived) since open, their newest bucket out of the window.
    pub runs_expired: u64,
    /// Merges since open: each wrote one run from the newest few of one level and
    /// removed them (`docs/design.md`, "Sealed key runs").
    pub runs_merged: u64,
    /// Memory of the dedup tables frozen for the seal under way (included in
    /// `index_bytes`): dropped once its run is published.
    pub frozen_table_bytes: u64,
    /// Times since open a writer waited for the seal or merge under way because the
    /// dedup tables had reached the budget's bound (`docs/design.md`, "Sealed key runs").
    pub budget_waits: u64,
    /// Writers waiting now for the seal or merge under way, the dedup tables at the
    /// budget's bound.
    pub budget_waiters: u64,
    /// Working memory of the seal or merge under way, estimated: about 41 bytes per key
    /// of the one section it writes at a time (`docs/design.md`, "Working memory of a
    /// seal and a merge"). Not in `index_bytes`; a merge is made only while this stays
    /// within a quarter of the budget.
    pub seal_work_bytes: u64,
    /// Merges of merged runs abandoned since open because writers waited at the
    /// budget's bound (`docs/design.md`, "Sealed key runs"): each is made again later.
    pub merges_yielded: u64,
}

/// The upper bound, in µs, of the histogram bucket holding the quantile `per_mille` /
/// 1000 of `buckets` (`buckets[i]` counts values below `2^i` and at least `2^(i-1)`).
pub(crate) fn quantile_us(buckets: &[u64], per_mille: u64) -> u64 {
    let total: u64 = buckets.iter().sum();
    if total == 0 {
        return 0;
    }
    let rank = total
        .saturating_mul(per_mille)
        .div_ceil(1000)
        .clamp(1, total);
    let mut seen = 0;
    for (i, &count) in buckets.iter().enumerate() {
        seen += count;
        if seen >= rank {
            return u32::try_from(i)
                .ok()
                .and_then(|i| 1u64.checked_shl(i))
                .unwrap_or(u64::MAX);
        }
    }
    u64::MAX
}

impl Stats {
    pub(crate) fn from_engine(
        engine: &EngineStats,
        recovery: Option<&crate::engine::RecoveryReport>,
    ) -> Stats {
        let index = &engine.index;
        let counters = &index.counters;
        let mut stats = Stats {
            live_keys: index.live_keys,
            live_records: index.live_records,
            admitted: counters.admitted,
            duplicates: counters.duplicates,
            acquired: counters.acquired,
            in_flight_hits: counters.in_flight_hits,
            replays: counters.replays,
            mismatches: counters.mismatches,
            completed: counters.completed,
            failed: counters.failed,
            released: counters.released,
            leases_lost: counters.leases_lost,
            fenced: counters.fenced,
            take_overs: counters.take_overs,
            stuck_records: engine.stuck_records,
            outcome_waiters: engine.outcome_waiters,
            versions_applied: counters.advance_applied,
            versions_duplicate: counters.advance_duplicates,
            versions_stale: counters.advance_stale,
            versions_gap: counters.advance_gaps,
            live_aggregates: index.live_marks,
            full_rejections: counters.full_rejections,
            buckets_evicted: counters.buckets_evicted,
            keys_evicted: counters.keys_evicted,
            buckets_live: index.buckets_live,
            buckets_dropped: engine.buckets_dropped,
            table_slots_used: index.table_slots_used,
            table_probes: index.table_probes,
            index_bytes: index.heap_bytes + engine.sealing.filter_bytes,
            sealed_runs: engine.sealing.runs,
            sealed_keys: engine.sealing.sealed_keys,
            sealed_record_runs: engine.sealing.record_runs,
            sealed_records: engine.sealing.sealed_records,
            sealed_filter_bytes: engine.sealing.filter_bytes,
            runs_sealed: engine.sealing.runs_written,
            replication_runs_unshipped: engine.replica_runs_unshipped,
            replication_runs_awaiting_log: engine.replica_runs_awaiting_log,
            runs_expired: engine.sealing.runs_expired,
            runs_merged: engine.sealing.runs_merged,
            frozen_table_bytes: index.frozen_bytes,
            budget_waits: engine.sealing.budget_waits,
            budget_waiters: engine.sealing.budget_waiters,
            seal_work_bytes: engine.sealing.work_bytes,
            merges_yielded: engine.sealing.merges_yielded,
            bytes_on_disk: engine.bytes_on_disk,
            clock_readings_held_back: engine.clock_held_back,
            ..Stats::default()
        };
        if let Some(journal) = &engine.journal {
            stats.fsyncs = journal.fsyncs;
            stats.commit_waits = journal.commit_waits;
            stats.commit_wakeups = journal.commit_wakeups;
            stats.log_records = journal.log_records;
            stats.log_bytes = journal.log_bytes;
            stats.segments_deleted = journal.segments_deleted;
            stats.segments = journal.segment_count;
            stats.replication_lag_bytes = journal.replica_lag_bytes;
            stats.fsync_p50_us = quantile_us(&journal.fsync_micros, 500);
            stats.fsync_p99_us = quantile_us(&journal.fsync_micros, 990);
            stats.fsync_max_us = quantile_us(&journal.fsync_micros, 1000);
        }
        if let Some(report) = recovery {
            stats.recovered_records = report.entries_replayed;
            stats.recovered_truncated_bytes = report.torn_tails.iter().map(|t| t.bytes).sum();
            stats.recovered_dropped_frames =
                report.torn_tails.iter().map(|t| t.frames_dropped).sum();
            stats.recovery_skipped_ranges = report.skipped.len() as u64;
        }
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::quantile_us;

    #[test]
    fn quantiles_are_bucket_upper_bounds() {
        assert_eq!(quantile_us(&[0; 8], 500), 0);
        // 90 syncs under 16 µs (bucket 4), 9 under 1024 µs (bucket 10), 1 under 2^20.
        let mut buckets = [0u64; 32];
        buckets[4] = 90;
        buckets[10] = 9;
        buckets[20] = 1;
        assert_eq!(quantile_us(&buckets, 500), 16);
        assert_eq!(quantile_us(&buckets, 990), 1024);
        assert_eq!(quantile_us(&buckets, 1000), 1 << 20);
    }
}
