//! The idempotency records of one shard, keyed by fingerprint, with full keys compared.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use crate::base::{Error, LogSpan, Record, RecordStatus, Result, Window};

/// Where a finished record's response is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Response {
    /// In memory: an in-memory store, or a durable one whose log has not yet been
    /// written past the finish entry.
    Held(Arc<[u8]>),
    /// In the log only, in the finish entry's frame: read back on replay.
    Logged(LogSpan),
    /// Aged out (`Options::response_retention`): the record says the operation
    /// happened, with nothing left to replay.
    Gone,
}

/// Where a stored record stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum State {
    InFlight,
    Completed { response: Response, at_ms: u64 },
    Failed { response: Response, at_ms: u64 },
}

impl State {
    /// The response of a finished record.
    fn response_mut(&mut self) -> Option<&mut Response> {
        match self {
            State::InFlight => None,
            State::Completed { response, .. } | State::Failed { response, .. } => Some(response),
        }
    }
}

/// One record as kept in memory.
#[derive(Debug, Clone)]
pub(crate) struct StoredRecord {
    pub(crate) scoped_key: Box<[u8]>,
    pub(crate) request_hash: u128,
    pub(crate) bucket: u64,
    pub(crate) created_ms: u64,
    /// When the current lease was granted (the reserve, or the last take-over): a lease
    /// timeout counts from here.
    pub(crate) leased_ms: u64,
    /// The lease the record was created under; kept after it ends, so that replay can
    /// tell an older reserve from a newer one.
    pub(crate) lease_id: u64,
    /// The leases take-overs replaced, oldest first: exactly the leases that are fenced
    /// on this record. Lease ids come from one counter for the whole store, so a range
    /// of ids would also hold other records' leases. `None` until the first take-over.
    pub(crate) taken_over: Option<Box<[u64]>>,
    pub(crate) state: State,
    /// A short note a lease holder attached while in flight.
    pub(crate) note: Option<Arc<[u8]>>,
}

impl StoredRecord {
    /// The record as the API sees it; a finished record's response is left out once it
    /// aged out: dropped already, or its bucket past `retention` (when there is one). A
    /// response in the log is named by `logged`, for the engine to read.
    pub(crate) fn snapshot(&self, retention: Option<Window>, current: u64) -> Record {
        let kept = retention.is_none_or(|retention| retention.is_live(self.bucket, current));
        let (status, response, finished_ms) = match &self.state {
            State::InFlight => (RecordStatus::InFlight, None, None),
            State::Completed { response, at_ms } => {
                (RecordStatus::Completed, Some(response), Some(*at_ms))
            }
            State::Failed { response, at_ms } => {
                (RecordStatus::Failed, Some(response), Some(*at_ms))
            }
        };
        let (response, logged) = match response.filter(|_| kept) {
            Some(Response::Held(bytes)) => (Some(bytes.clone()), None),
            Some(Response::Logged(span)) => (None, Some((*span, self.lease_id))),
            Some(Response::Gone) | None => (None, None),
        };
        Record {
            status,
            response,
            logged,
            created_ms: self.created_ms,
            finished_ms,
        }
    }

    /// Moves a held response to the log at `span`, if the record still holds the one
    /// lease `lease_id` ended it with.
    pub(crate) fn log_response(&mut self, lease_id: u64, span: LogSpan) {
        if self.lease_id != lease_id {
            return;
        }
        if let Some(response @ Response::Held(_)) = self.state.response_mut() {
            *response = Response::Logged(span);
        }
    }

    /// Whether `lease_id` was taken over on this record (rather than belonging to an
    /// earlier record of the same key, or being the current lease).
    pub(crate) fn fences(&self, lease_id: u64) -> bool {
        self.taken_over
            .as_deref()
            .is_some_and(|earlier| earlier.contains(&lease_id))
    }

    /// Hands the record from its current lease to `new` (a take-over at `at_ms`), fencing
    /// the old.
    pub(crate) fn hand_over(&mut self, new: u64, at_ms: u64) {
        self.leased_ms = at_ms;
        let mut earlier = self.taken_over.take().map(Vec::from).unwrap_or_default();
        earlier.push(self.lease_id);
        self.taken_over = Some(earlier.into_boxed_slice());
        self.lease_id = new;
    }

    /// Whether the record is in flight under `lease_id`.
    pub(crate) fn in_flight_under(&self, lease_id: u64) -> bool {
        self.state == State::InFlight && self.lease_id == lease_id
    }
}

/// Fingerprints are already uniform: hash a map key by taking its high 64 bits.
///
/// Not the low 64: their top bits pick the shard, so within one shard they are nearly
/// constant, and hashbrown takes its 7-bit control tag from the top of the hash. With
/// the low half, every key of a shard shares one or two tags, and the SIMD tag filter
/// lets most probes through to a full key comparison.
#[derive(Default)]
pub(crate) struct FingerprintHasher(u64);

impl Hasher for FingerprintHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &byte in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(byte);
        }
    }

    fn write_u128(&mut self, value: u128) {
        self.0 = (value >> 64) as u64;
    }
}

pub(crate) type FingerprintMap<V> = HashMap<u128, V, BuildHasherDefault<FingerprintHasher>>;

/// The live entry of `fingerprint` in `map` (one stamped with a bucket still in the
/// window), removing an expired one; with `scoped_key`, the entry must belong to it.
pub(crate) fn live_entry<'a, V>(
    map: &'a mut FingerprintMap<V>,
    fingerprint: u128,
    scoped_key: Option<&[u8]>,
    window: Window,
    current: u64,
    stamp_and_key: impl Fn(&V) -> (u64, &[u8]),
) -> Result<Option<&'a mut V>> {
    let expired = match map.get(&fingerprint) {
        None => return Ok(None),
        Some(entry) => !window.is_live(stamp_and_key(entry).0, current),
    };
    if expired {
        map.remove(&fingerprint);
        return Ok(None);
    }
    match map.get_mut(&fingerprint) {
        Some(entry) if scoped_key.is_some_and(|key| stamp_and_key(entry).1 != key) => {
            Err(Error::FingerprintCollision)
        }
        other => Ok(other),
    }
}

/// Drains up to `budget` entries of an expiry `queue` (in stamping order) whose bucket has
/// left the window, removing each key from `map` only if it still carries that bucket: a
/// key released and stored again, or re-stamped, lives on.
pub(crate) fn expire_queue<V>(
    map: &mut FingerprintMap<V>,
    queue: &mut VecDeque<(u64, u128)>,
    budget: usize,
    window: Window,
    current: u64,
    bucket_of: impl Fn(&V) -> u64,
) {
    for _ in 0..budget {
        let Some(&(bucket, fingerprint)) = queue.front() else {
            return;
        };
        if window.is_live(bucket, current) {
            return;
        }
        queue.pop_front();
        if map
            .get(&fingerprint)
            .is_some_and(|v| bucket_of(v) == bucket)
        {
            map.remove(&fingerprint);
        }
    }
}

/// Records plus an expiry queue in admission order (buckets never decrease within a
/// shard), drained a few entries per operation.
#[derive(Debug, Default)]
pub(crate) struct RecordMap {
    map: FingerprintMap<StoredRecord>,
    expiry: VecDeque<(u64, u128)>,
    /// With a response retention: the records in admission order again, drained as
    /// their responses age out (so their bytes leave memory before the record does).
    aging: Option<VecDeque<(u64, u128)>>,
}

impl RecordMap {
    /// The live record of `fingerprint`, checking that it belongs to `scoped_key`.
    /// An expired record is removed and reported absent.
    pub(crate) fn live_mut(
        &mut self,
        fingerprint: u128,
        scoped_key: Option<&[u8]>,
        window: Window,
        current: u64,
    ) -> Result<Option<&mut StoredRecord>> {
        live_entry(
            &mut self.map,
            fingerprint,
            scoped_key,
            window,
            current,
            |r| (r.bucket, &r.scoped_key),
        )
    }

    /// A map whose responses age out (`retains`), or are kept for the whole window.
    pub(crate) fn new(retains: bool) -> RecordMap {
        RecordMap {
            aging: retains.then(VecDeque::new),
            ..RecordMap::default()
        }
    }

    /// Stores `record`, replacing any record with the same fingerprint.
    pub(crate) fn insert(
        &mut self,
        fingerprint: u128,
        record: StoredRecord,
    ) -> Option<StoredRecord> {
        self.expiry.push_back((record.bucket, fingerprint));
        if let Some(aging) = &mut self.aging {
            aging.push_back((record.bucket, fingerprint));
        }
        self.map.insert(fingerprint, record)
    }

    pub(crate) fn remove(&mut self, fingerprint: u128) -> Option<StoredRecord> {
        self.map.remove(&fingerprint)
    }

    /// Live records in flight that were reserved at or before `before_ms`.
    pub(crate) fn in_flight(
        &self,
        before_ms: u64,
        window: Window,
        current: u64,
    ) -> Vec<super::shard::InFlightRecord> {
        self.map
            .values()
            .filter(|r| r.state == State::InFlight && r.created_ms <= before_ms)
            .filter(|r| window.is_live(r.bucket, current))
            .map(|r| super::shard::InFlightRecord {
                scoped_key: r.scoped_key.clone(),
                since_ms: r.created_ms,
                lease_id: r.lease_id,
                note: r.note.clone(),
            })
            .collect()
    }

    /// Removes up to `budget` records whose bucket has left the window.
    pub(crate) fn expire(&mut self, budget: usize, window: Window, current: u64) {
        expire_queue(
            &mut self.map,
            &mut self.expiry,
            budget,
            window,
            current,
            |r| r.bucket,
        );
    }

    /// Drops the responses of up to `budget` records whose bucket has left `retention`
    /// (keeping the records, which say the operation happened, to the window's end).
    pub(crate) fn age(&mut self, budget: usize, retention: Window, current: u64) {
        let Some(aging) = &mut self.aging else {
            return;
        };
        for _ in 0..budget {
            let Some(&(bucket, fingerprint)) = aging.front() else {
                return;
            };
            if retention.is_live(bucket, current) {
                return;
            }
            aging.pop_front();
            if let Some(record) = self.map.get_mut(&fingerprint)
                && record.bucket == bucket
                && let Some(response) = record.state.response_mut()
            {
                *response = Response::Gone;
            }
        }
    }

    /// Records held in memory, live or expired but not yet removed.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len()
    }

    /// Approximate heap bytes held.
    pub(crate) fn heap_bytes(&self) -> usize {
        let per_entry = size_of::<(u128, StoredRecord)>() + 1;
        let payload: usize = self
            .map
            .values()
            .map(|r| {
                r.scoped_key.len()
                    + match &r.state {
                        State::Completed {
                            response: Response::Held(bytes),
                            ..
                        }
                        | State::Failed {
                            response: Response::Held(bytes),
                            ..
                        } => bytes.len(),
                        _ => 0,
                    }
                    + r.note.as_ref().map_or(0, |note| note.len())
            })
            .sum();
        let queues = self.expiry.capacity() + self.aging.as_ref().map_or(0, VecDeque::capacity);
        self.map.capacity() * per_entry + queues * 24 + payload
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::Fingerprint;

    #[test]
    fn the_map_hash_spreads_the_control_tags_within_one_shard() {
        // Fingerprints of one shard among 64 agree on the top 6 bits of their low half;
        // hashbrown's control tag is the top 7 bits of the hash, which must still vary.
        let mut tags = std::collections::BTreeSet::new();
        let mut found = 0;
        for i in 0u64.. {
            let value = xxhash_rust::xxh3::xxh3_128(&i.to_le_bytes());
            if Fingerprint(value).shard(6) != 0 {
                continue;
            }
            let mut hasher = FingerprintHasher::default();
            hasher.write_u128(value);
            tags.insert(hasher.finish() >> 57);
            found += 1;
            if found == 2_000 {
                break;
            }
        }
        assert!(tags.len() > 100, "{} distinct control tags", tags.len());
    }

    fn record(bucket: u64, key: &[u8]) -> StoredRecord {
        StoredRecord {
            scoped_key: key.into(),
            request_hash: 1,
            bucket,
            created_ms: bucket,
            leased_ms: bucket,
            lease_id: 1,
            taken_over: None,
            state: State::InFlight,
            note: None,
        }
    }

    #[test]
    fn aged_responses_leave_memory_and_the_record_stays() {
        let (window, retention) = (Window::new(4, 1), Window::new(2, 1));
        let mut map = RecordMap::new(true);
        let mut done = record(0, b"a");
        done.state = State::Completed {
            response: Response::Held(vec![7u8; 4096].into()),
            at_ms: 0,
        };
        map.insert(1, done);
        map.insert(2, record(1, b"b"));
        let before = map.heap_bytes();
        map.age(10, retention, 2);
        assert_eq!(map.heap_bytes(), before, "inside the retention: kept");
        map.age(10, retention, 3);
        assert!(
            map.heap_bytes() + 4096 <= before,
            "the response's bytes are gone"
        );
        let kept = map.live_mut(1, Some(b"a"), window, 3).unwrap().unwrap();
        assert_eq!(kept.snapshot(None, 3).status, RecordStatus::Completed);
        assert_eq!(kept.snapshot(None, 3).response, None);
    }

    #[test]
    fn expired_records_are_absent_and_drained() {
        let window = Window::new(2, 1);
        let mut map = RecordMap::default();
        map.insert(1, record(0, b"a"));
        map.insert(2, record(1, b"b"));
        assert!(map.live_mut(1, Some(b"a"), window, 2).unwrap().is_some());
        map.expire(10, window, 3);
        assert_eq!(map.len(), 1);
        assert!(map.live_mut(1, Some(b"a"), window, 3).unwrap().is_none());
        assert!(map.live_mut(2, Some(b"b"), window, 3).unwrap().is_some());
        assert!(map.live_mut(2, Some(b"b"), window, 4).unwrap().is_none());
        assert_eq!(map.len(), 0);
    }

    #[test]
    fn reinserted_key_survives_old_expiry_entry() {
        let window = Window::new(2, 1);
        let mut map = RecordMap::default();
        map.insert(1, record(0, b"a"));
        map.remove(1);
        map.insert(1, record(5, b"a"));
        map.expire(10, window, 5);
        assert!(map.live_mut(1, Some(b"a"), window, 5).unwrap().is_some());
    }

    #[test]
    fn different_key_same_fingerprint_is_refused() {
        let window = Window::new(2, 1);
        let mut map = RecordMap::default();
        map.insert(1, record(0, b"a"));
        assert!(matches!(
            map.live_mut(1, Some(b"z"), window, 0),
            Err(Error::FingerprintCollision)
        ));
    }
}
