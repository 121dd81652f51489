//! Counters kept per shard (no shared cache line on the hot path) and summed on demand.

/// Event counts of one shard.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Counters {
    pub(crate) admitted: u64,
    pub(crate) duplicates: u64,
    pub(crate) acquired: u64,
    pub(crate) in_flight_hits: u64,
    pub(crate) replays: u64,
    pub(crate) mismatches: u64,
    pub(crate) completed: u64,
    pub(crate) failed: u64,
    pub(crate) released: u64,
    pub(crate) leases_lost: u64,
    pub(crate) full_rejections: u64,
    pub(crate) buckets_evicted: u64,
    pub(crate) keys_evicted: u64,
}

impl Counters {
    /// Copies the event counts into `stats`.
    pub(crate) fn report(&self, stats: &mut Stats) {
        stats.admitted = self.admitted;
        stats.duplicates = self.duplicates;
        stats.acquired = self.acquired;
        stats.in_flight_hits = self.in_flight_hits;
        stats.replays = self.replays;
        stats.mismatches = self.mismatches;
        stats.completed = self.completed;
        stats.failed = self.failed;
        stats.released = self.released;
        stats.leases_lost = self.leases_lost;
        stats.full_rejections = self.full_rejections;
        stats.buckets_evicted = self.buckets_evicted;
        stats.keys_evicted = self.keys_evicted;
    }

    pub(crate) fn add(&mut self, other: &Counters) {
        self.admitted += other.admitted;
        self.duplicates += other.duplicates;
        self.acquired += other.acquired;
        self.in_flight_hits += other.in_flight_hits;
        self.replays += other.replays;
        self.mismatches += other.mismatches;
        self.completed += other.completed;
        self.failed += other.failed;
        self.released += other.released;
        self.leases_lost += other.leases_lost;
        self.full_rejections += other.full_rejections;
        self.buckets_evicted += other.buckets_evicted;
        self.keys_evicted += other.keys_evicted;
    }
}

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
    /// Lease endings refused because the record had expired.
    pub leases_lost: u64,
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
    /// Table slots occupied, live or expired and not yet swept.
    pub table_slots_used: u64,
    /// Table slots inspected by lookups since open (probe length = probes / lookups).
    pub table_probes: u64,
    /// Approximate heap bytes held by the index.
    pub index_bytes: u64,
    /// Durable stores: fsync calls made since open.
    pub fsyncs: u64,
    /// Durable stores: log records appended since open.
    pub log_records: u64,
    /// Durable stores: bytes appended to segment files since open.
    pub log_bytes: u64,
    /// Durable stores: log records replayed by the last open.
    pub recovered_records: u64,
    /// Durable stores: bytes of torn tail cut off the newest segment by the last open.
    pub recovered_truncated_bytes: u64,
    /// Durable stores: segment files of expired buckets deleted since open.
    pub segments_deleted: u64,
}
