//! Counters kept per shard (no shared cache line on the hot path) and summed on demand.
//! The API copies them into its public `Stats`.

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
    pub(crate) fenced: u64,
    pub(crate) take_overs: u64,
    pub(crate) advance_applied: u64,
    pub(crate) advance_duplicates: u64,
    pub(crate) advance_stale: u64,
    pub(crate) advance_gaps: u64,
}

impl Counters {
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
        self.fenced += other.fenced;
        self.take_overs += other.take_overs;
        self.advance_applied += other.advance_applied;
        self.advance_duplicates += other.advance_duplicates;
        self.advance_stale += other.advance_stale;
        self.advance_gaps += other.advance_gaps;
    }
}
