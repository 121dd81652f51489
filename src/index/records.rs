//! The idempotency records of one shard, keyed by fingerprint, with full keys compared.

use std::collections::{HashMap, VecDeque};
use std::hash::{BuildHasherDefault, Hasher};
use std::sync::Arc;

use super::SealedRecords;
use super::dense::DenseRecords;
use crate::base::{
    Error, Fingerprint, LogSpan, Record, RecordStatus, ResponseBytes, Result, SettledRecord, Window,
};

/// How a lease ends a record: with response bytes that memory keeps (a call), or with a
/// response already in the log, in the finish entry's frame (recovery).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Ending<'a> {
    Held(&'a [u8]),
    Logged(LogSpan),
}

/// One record as kept in memory: fixed-size fields, and a body that holds at most one
/// heap buffer (the scoped key, then the response while memory keeps it) or, once the
/// response and the key are both in the log, their spans alone.
#[derive(Debug, Clone)]
pub(crate) struct StoredRecord {
    pub(crate) request_hash: u128,
    pub(crate) bucket: u64,
    pub(crate) created_ms: u64,
    /// The lease the record is (or was last) held under; kept after it ends, so that
    /// replay can tell an older reserve from a newer one.
    pub(crate) lease_id: u64,
    /// What few records carry: the leases take-overs replaced and a note. `None` for
    /// most (a thin box: one word in every record, a heap block in the rare other).
    extra: Option<Box<Extra>>,
    body: Body,
}

/// The rare parts of a record.
#[derive(Debug, Clone, Default)]
struct Extra {
    /// The leases take-overs replaced, oldest first: exactly the leases that are fenced
    /// on this record. Lease ids come from one counter for the whole store, so a range
    /// of ids would also hold other records' leases.
    taken_over: Vec<u64>,
    /// A short note a lease holder attached while in flight (dropped when it finishes).
    note: Option<Arc<[u8]>>,
}

/// A record's state and where its bytes are. Laid out to keep a map slot at 128 bytes:
/// the variants share the space of the largest (`a_record_in_the_log_is_a_fixed_size_slot`).
#[derive(Debug, Clone)]
enum Body {
    /// A lease holds it.
    InFlight {
        scoped_key: Box<[u8]>,
        /// The reserve entry's frame (a durable store): where the key is read back from
        /// once the record keeps only spans.
        key_at: Option<LogSpan>,
        /// When the current lease was granted (the reserve, or the last take-over): a
        /// lease timeout counts from here.
        leased_ms: u64,
    },
    /// Finished, its key in memory: the response follows the key in one buffer (an
    /// in-memory store, or a durable one whose log is not yet written past the finish
    /// entry), or has aged out (`gone`, and the buffer is the key alone).
    Finished {
        /// The scoped key, then the response.
        bytes: Arc<[u8]>,
        key_len: u32,
        /// `Completed` or `Failed`, never `InFlight`.
        status: RecordStatus,
        /// Aged out (`Options::response_retention`): nothing is left to replay.
        gone: bool,
        at_ms: u64,
        key_at: Option<LogSpan>,
    },
    /// Finished with its response in the log and its key only in memory: a record
    /// whose reserve frame was never located (no path of a durable store leaves one).
    KeyHeld {
        scoped_key: Box<[u8]>,
        status: RecordStatus,
        gone: bool,
        at_ms: u64,
        response: LogSpan,
    },
    /// Finished with both its response and its scoped key in the log: no heap bytes.
    Logged {
        status: RecordStatus,
        gone: bool,
        at_ms: u64,
        /// The finish entry's frame, which holds the response.
        response: LogSpan,
        /// The reserve entry's frame, which holds the scoped key.
        key: LogSpan,
    },
}

impl StoredRecord {
    /// A new record in flight under `lease_id`, its key's reserve entry at `key_at`
    /// when the store has a log.
    pub(crate) fn in_flight(
        scoped_key: &[u8],
        key_at: Option<LogSpan>,
        (request_hash, lease_id): (u128, u64),
        (bucket, created_ms): (u64, u64),
    ) -> StoredRecord {
        StoredRecord {
            request_hash,
            bucket,
            created_ms,
            lease_id,
            extra: None,
            body: Body::InFlight {
                scoped_key: scoped_key.into(),
                key_at,
                leased_ms: created_ms,
            },
        }
    }

    /// The record as the API sees it; a finished record's response is left out once it
    /// aged out: dropped already, or its bucket past `retention` (when there is one). A
    /// response in the log is named by `logged`, and a key in the log by `key_logged`,
    /// for the engine to read.
    pub(crate) fn snapshot(&self, retention: Option<Window>, current: u64) -> Record {
        let kept = retention.is_none_or(|retention| retention.is_live(self.bucket, current));
        let mut record = Record {
            status: RecordStatus::InFlight,
            response: None,
            logged: None,
            key_logged: None,
            created_ms: self.created_ms,
            finished_ms: None,
        };
        match &self.body {
            Body::InFlight { .. } => {}
            Body::Finished {
                bytes,
                key_len,
                status,
                gone,
                at_ms,
                ..
            } => {
                record.status = *status;
                record.finished_ms = Some(*at_ms);
                record.response =
                    (kept && !gone).then(|| ResponseBytes::after(bytes.clone(), *key_len as usize));
            }
            Body::KeyHeld {
                status,
                gone,
                at_ms,
                response,
                ..
            }
            | Body::Logged {
                status,
                gone,
                at_ms,
                response,
                ..
            } => {
                record.status = *status;
                record.finished_ms = Some(*at_ms);
                record.logged = (kept && !gone).then_some((*response, self.lease_id));
                record.key_logged = self.key_logged();
            }
        }
        record
    }

    /// The record as a settled one: finished, its response and key both in the log, and
    /// no take-over to remember (`None` for any other form).
    fn settled(&self) -> Option<SettledRecord> {
        match &self.body {
            Body::Logged {
                status,
                at_ms,
                response,
                key,
                ..
            } if self.extra.is_none() => Some(SettledRecord {
                request_hash: self.request_hash,
                bucket: self.bucket,
                created_ms: self.created_ms,
                lease_id: self.lease_id,
                status: *status,
                finished_ms: *at_ms,
                response: *response,
                key: *key,
            }),
            _ => None,
        }
    }

    /// For a finished record that is not settled and has no take-over to remember (so
    /// that a replay of its ending settles it): the earliest frame its ending may lie
    /// in. Its finish frame once located; before that, its reserve frame, which the
    /// finish follows; the log's start if neither is known. `None` for any other record.
    fn unsettled_ending(&self) -> Option<LogSpan> {
        let start = LogSpan {
            bucket: 0,
            seq: 0,
            start: 0,
            len: 0,
        };
        match &self.body {
            _ if self.extra.is_some() => None,
            Body::Finished { key_at, .. } => Some(key_at.unwrap_or(start)),
            Body::KeyHeld { response, .. } => Some(*response),
            Body::InFlight { .. } | Body::Logged { .. } => None,
        }
    }

    /// The frame that holds the scoped key, once memory holds only spans.
    pub(crate) fn key_logged(&self) -> Option<LogSpan> {
        match &self.body {
            Body::Logged { key, .. } => Some(*key),
            _ => None,
        }
    }

    /// The scoped key, while memory holds it (`None` once it is only in the log).
    fn scoped_key(&self) -> Option<&[u8]> {
        match &self.body {
            Body::InFlight { scoped_key, .. } | Body::KeyHeld { scoped_key, .. } => {
                Some(scoped_key)
            }
            Body::Finished { bytes, key_len, .. } => bytes.get(..*key_len as usize),
            Body::Logged { .. } => None,
        }
    }

    /// Whether a lease holds the record in flight.
    pub(crate) fn is_in_flight(&self) -> bool {
        matches!(self.body, Body::InFlight { .. })
    }

    /// When the current lease was granted, while the record is in flight.
    pub(crate) fn leased_ms(&self) -> Option<u64> {
        match &self.body {
            Body::InFlight { leased_ms, .. } => Some(*leased_ms),
            _ => None,
        }
    }

    /// Whether a lease holder attached a note.
    pub(crate) fn has_note(&self) -> bool {
        self.extra
            .as_ref()
            .is_some_and(|extra| extra.note.is_some())
    }

    /// The note a lease holder attached (only records in flight keep one).
    pub(crate) fn note(&self) -> Option<Arc<[u8]>> {
        self.extra.as_ref().and_then(|extra| extra.note.clone())
    }

    /// Attaches `note` (the caller checked that the record is in flight).
    pub(crate) fn set_note(&mut self, note: Arc<[u8]>) {
        if self.is_in_flight() {
            self.extra.get_or_insert_default().note = Some(note);
        }
    }

    /// The reserve entry of the record's current lease is at `span` in the log.
    pub(crate) fn locate_key(&mut self, lease_id: u64, span: LogSpan) {
        if self.lease_id == lease_id
            && let Body::InFlight { key_at, .. } = &mut self.body
        {
            *key_at = Some(span);
        }
    }

    /// Ends the record (the caller checked that it is in flight) as `status` with the
    /// response of `ending` at `at_ms`. A response held in memory is copied after the
    /// key into one new buffer, which replaces the key's.
    pub(crate) fn finish(&mut self, status: RecordStatus, ending: Ending<'_>, at_ms: u64) {
        let Body::InFlight {
            scoped_key, key_at, ..
        } = &self.body
        else {
            return;
        };
        let status = match status {
            RecordStatus::Failed => RecordStatus::Failed,
            RecordStatus::Completed | RecordStatus::InFlight => RecordStatus::Completed,
        };
        self.body = match (ending, *key_at) {
            (Ending::Held(response), key_at) => Body::Finished {
                bytes: joined(scoped_key, response),
                key_len: key_len(scoped_key),
                status,
                gone: false,
                at_ms,
                key_at,
            },
            (Ending::Logged(response), Some(key)) => Body::Logged {
                status,
                gone: false,
                at_ms,
                response,
                key,
            },
            (Ending::Logged(response), None) => Body::KeyHeld {
                scoped_key: scoped_key.clone(),
                status,
                gone: false,
                at_ms,
                response,
            },
        };
        // A note only speaks for a record in flight: it goes, and the box with it
        // unless take-overs are remembered.
        self.extra = self.extra.take().and_then(|mut extra| {
            extra.note = None;
            (!extra.taken_over.is_empty()).then_some(extra)
        });
    }

    /// Moves a held response to the log at `span`, if the record still holds the one
    /// lease `lease_id` ended it with: memory keeps only spans from then on (or the key
    /// as well, if its frame was never located).
    pub(crate) fn log_response(&mut self, lease_id: u64, span: LogSpan) {
        if self.lease_id != lease_id {
            return;
        }
        // A response that aged out before its frame was located moves too: the record
        // then settles (a record run keeps it, answering it expired), where one left
        // unsettled would pin every later run's cover.
        let Body::Finished {
            bytes,
            key_len,
            status,
            gone,
            at_ms,
            key_at,
        } = &self.body
        else {
            return;
        };
        let (status, gone, at_ms) = (*status, *gone, *at_ms);
        self.body = match key_at {
            Some(key) => Body::Logged {
                status,
                gone,
                at_ms,
                response: span,
                key: *key,
            },
            None => Body::KeyHeld {
                scoped_key: bytes.get(..*key_len as usize).unwrap_or_default().into(),
                status,
                gone,
                at_ms,
                response: span,
            },
        };
    }

    /// Lets go of the response: it aged out. A held one leaves memory (the buffer is
    /// cut back to the key).
    pub(crate) fn drop_response(&mut self) {
        match &mut self.body {
            Body::InFlight { .. } => {}
            Body::Finished {
                bytes,
                key_len,
                gone,
                ..
            } => {
                if !*gone {
                    *bytes = Arc::from(bytes.get(..*key_len as usize).unwrap_or_default());
                    *gone = true;
                }
            }
            Body::KeyHeld { gone, .. } | Body::Logged { gone, .. } => *gone = true,
        }
    }

    /// Whether `lease_id` was taken over on this record (rather than belonging to an
    /// earlier record of the same key, or being the current lease).
    pub(crate) fn fences(&self, lease_id: u64) -> bool {
        self.extra
            .as_deref()
            .is_some_and(|extra| extra.taken_over.contains(&lease_id))
    }

    /// Hands the record from its current lease to `new` (a take-over at `at_ms`), fencing
    /// the old.
    pub(crate) fn hand_over(&mut self, new: u64, at_ms: u64) {
        if let Body::InFlight { leased_ms, .. } = &mut self.body {
            *leased_ms = at_ms;
        }
        self.extra
            .get_or_insert_default()
            .taken_over
            .push(self.lease_id);
        self.lease_id = new;
    }

    /// Renews the current lease: a lease timeout counts from `at_ms` now.
    pub(crate) fn renew(&mut self, at_ms: u64) {
        if let Body::InFlight { leased_ms, .. } = &mut self.body {
            *leased_ms = (*leased_ms).max(at_ms);
        }
    }

    /// Whether the record is in flight under `lease_id`.
    pub(crate) fn in_flight_under(&self, lease_id: u64) -> bool {
        self.is_in_flight() && self.lease_id == lease_id
    }

    /// The record in flight as `in_flight` lists it.
    fn listed(&self) -> Option<super::shard::InFlightRecord> {
        match &self.body {
            Body::InFlight { scoped_key, .. } => Some(super::shard::InFlightRecord {
                scoped_key: scoped_key.clone(),
                since_ms: self.created_ms,
                lease_id: self.lease_id,
                note: self.note(),
            }),
            _ => None,
        }
    }

    /// Heap bytes the record holds beyond its slot.
    fn heap_bytes(&self) -> usize {
        let extra = self.extra.as_deref().map_or(0, |extra| {
            size_of::<Extra>()
                + 8 * extra.taken_over.capacity()
                + extra.note.as_ref().map_or(0, |note| note.len())
        });
        let body = match &self.body {
            Body::InFlight { scoped_key, .. } | Body::KeyHeld { scoped_key, .. } => {
                scoped_key.len()
            }
            // The buffer and its two reference counts.
            Body::Finished { bytes, .. } => bytes.len() + 16,
            Body::Logged { .. } => 0,
        };
        extra + body
    }
}

impl From<SettledRecord> for StoredRecord {
    /// A settled record in its map form. Its response counts as kept: a settled record's
    /// bucket tells whether it aged out (`snapshot` checks it), since an aged-out record
    /// is one whose bucket left the retention.
    fn from(record: SettledRecord) -> StoredRecord {
        StoredRecord {
            request_hash: record.request_hash,
            bucket: record.bucket,
            created_ms: record.created_ms,
            lease_id: record.lease_id,
            extra: None,
            body: Body::Logged {
                status: record.status,
                gone: false,
                at_ms: record.finished_ms,
                response: record.response,
                key: record.key,
            },
        }
    }
}

/// Above this many bytes, a record's key and response are joined through a vector of
/// their own: one allocation more, next to a copy that costs far more.
const JOIN_SCRATCH_BYTES: usize = 64 * 1024;

thread_local! {
    /// Where `joined` lays key and response side by side, kept across calls.
    static JOIN_SCRATCH: std::cell::Cell<Vec<u8>> = const { std::cell::Cell::new(Vec::new()) };
}

/// `key` followed by `response` in one new shared buffer: a single allocation (copied
/// from a per-thread scratch vector, where `Arc::from` an iterator would copy byte by
/// byte and `Arc::from` a vector would allocate twice).
fn joined(key: &[u8], response: &[u8]) -> Arc<[u8]> {
    if key.len() + response.len() > JOIN_SCRATCH_BYTES {
        return [key, response].concat().into();
    }
    JOIN_SCRATCH.with(|scratch| {
        let mut buffer = scratch.take();
        buffer.clear();
        buffer.extend_from_slice(key);
        buffer.extend_from_slice(response);
        let bytes = Arc::from(&buffer[..]);
        scratch.set(buffer);
        bytes
    })
}

/// A scoped key's length as a record keeps it: keys are bounded far below `u32::MAX`
/// (`MAX_KEY_BYTES_LIMIT` plus two scope parts).
fn key_len(scoped_key: &[u8]) -> u32 {
    u32::try_from(scoped_key.len()).unwrap_or(u32::MAX)
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
/// window), removing an expired one; with `scoped_key`, the entry must belong to it when
/// memory holds the entry's key (`stamp_and_key` gives `None` for one kept only in the
/// log, which the caller compares).
pub(crate) fn live_entry<'a, V>(
    map: &'a mut FingerprintMap<V>,
    fingerprint: u128,
    scoped_key: Option<&[u8]>,
    window: Window,
    current: u64,
    stamp_and_key: impl Fn(&V) -> (u64, Option<&[u8]>),
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
        Some(entry)
            if scoped_key
                .zip(stamp_and_key(entry).1)
                .is_some_and(|(key, held)| held != key) =>
        {
            Err(Error::FingerprintCollision)
        }
        other => Ok(other),
    }
}

/// Drains up to `budget` entries of an expiry `queue` (in stamping order) whose bucket has
/// left the window, removing each key from `map` only if it still carries that bucket: a
/// key released and stored again, or re-stamped, lives on. True if it stopped with
/// nothing due (the queue empty, or its front live at `current`), false if the budget
/// ran out first.
pub(crate) fn expire_queue<V>(
    map: &mut FingerprintMap<V>,
    queue: &mut VecDeque<(u64, u128)>,
    budget: usize,
    window: Window,
    current: u64,
    bucket_of: impl Fn(&V) -> u64,
) -> bool {
    for _ in 0..budget {
        let Some(&(bucket, fingerprint)) = queue.front() else {
            return true;
        };
        if window.is_live(bucket, current) {
            return true;
        }
        queue.pop_front();
        if map
            .get(&fingerprint)
            .is_some_and(|v| bucket_of(v) == bucket)
        {
            map.remove(&fingerprint);
        }
    }
    false
}

/// Records in two tiers: the settled ones (finished, response and key in the log, no
/// take-over to remember: nearly every record of a durable store) packed in
/// `DenseRecords`, and every other form in a map with an expiry queue in admission order
/// (buckets never decrease within a shard), drained a few entries per operation.
///
/// A record is in one tier at a time. It enters the map, in flight, and moves to the
/// dense tier when it settles (`settle`), never back: a settled record does not change.
/// Its queue entries stay behind, as no-ops, until the queues are compacted (when they
/// hold more than twice the map's records).
#[derive(Debug, Default)]
pub(crate) struct RecordMap {
    map: FingerprintMap<StoredRecord>,
    expiry: VecDeque<(u64, u128)>,
    /// With a response retention: the records in admission order again, drained as
    /// their responses age out (so their bytes leave memory before the record does).
    aging: Option<VecDeque<(u64, u128)>>,
    dense: DenseRecords,
    /// The last settled record a lookup found, in map form: `live_mut` lends it out.
    thawed: Option<StoredRecord>,
}

/// What a record seal takes from one shard's records ([`RecordMap::sealable`]).
pub(crate) struct Sealable {
    /// Every live settled record, with its fingerprint, in no order.
    pub(crate) records: Vec<(u128, SettledRecord)>,
    /// Which of the records memory holds these are, to drop once a run holds them.
    pub(crate) mark: SealMark,
    /// The earliest frame that may end a finished record left out.
    pub(crate) unsettled_from: Option<LogSpan>,
}

/// The records a seal took from one shard: the dense tier's up to a position, and the
/// map's by fingerprint and lease.
#[derive(Debug, Default)]
pub(crate) struct SealMark {
    dense_end: u32,
    in_map: Vec<(u128, u64)>,
}

/// The queues are compacted when they hold this many entries more than twice the map's
/// records (so compaction costs a constant amortized over the records that settled).
const QUEUE_SLACK: usize = 64;

impl RecordMap {
    /// The live record of `fingerprint`, checking that it belongs to `scoped_key` if
    /// memory holds the record's key (a record kept in compact form has its key in the
    /// log: `Record::key_logged` names it, and the engine compares it).
    /// An expired record is removed and reported absent.
    ///
    /// A settled record is lent out as a copy in map form. That is sound because no
    /// mutator changes a settled record: `finish`, `set_note`, `locate_key`, `hand_over`
    /// and `renew` act on a record in flight, `log_response` on one holding its
    /// response, and `drop_response` only marks what the record's bucket already says.
    ///
    /// With `sealed`, a record memory does not hold is looked for in the record runs,
    /// and lent out the same way: a record run holds settled records only.
    pub(crate) fn live_mut(
        &mut self,
        fingerprint: u128,
        scoped_key: Option<&[u8]>,
        (window, current): (Window, u64),
        sealed: Option<&dyn SealedRecords>,
    ) -> Result<Option<&mut StoredRecord>> {
        // A record is in one tier at a time: one in the map, expired or not, means the
        // dense tier holds none of this key that is live.
        let Some(held) = self.map.get(&fingerprint) else {
            let settled = match self.dense.get(fingerprint, window, current) {
                Some(settled) => Some(settled),
                None => match sealed {
                    Some(sealed) => sealed.find(Fingerprint(fingerprint), window, current)?,
                    None => None,
                },
            };
            return Ok(settled.map(|settled| &mut *self.thawed.insert(StoredRecord::from(settled))));
        };
        if !window.is_live(held.bucket, current) {
            self.map.remove(&fingerprint);
            return Ok(None);
        }
        if scoped_key
            .zip(held.scoped_key())
            .is_some_and(|(key, held)| held != key)
        {
            return Err(Error::FingerprintCollision);
        }
        Ok(self.map.get_mut(&fingerprint))
    }

    /// What a record seal takes from these records: every live settled record (the dense
    /// tier's, and the few settled in the map that did not pack), where they end, and
    /// the earliest frame that may end a finished record not taken (its response or its
    /// key not yet located in the log): a seal's cover must not reach past it.
    pub(crate) fn sealable(&self, window: Window, current: u64) -> Sealable {
        let (mut records, dense_end) = self.dense.live_records(window, current);
        let mut in_map = Vec::new();
        let mut unsettled_from: Option<LogSpan> = None;
        for (&fingerprint, record) in &self.map {
            if !window.is_live(record.bucket, current) {
                continue;
            }
            if let Some(settled) = record.settled() {
                records.push((fingerprint, settled));
                in_map.push((fingerprint, record.lease_id));
            } else if let Some(from) = record.unsettled_ending() {
                let earlier = unsettled_from.is_none_or(|earliest| {
                    (from.bucket, from.seq, from.start)
                        < (earliest.bucket, earliest.seq, earliest.start)
                });
                if earlier {
                    unsettled_from = Some(from);
                }
            }
        }
        Sealable {
            records,
            mark: SealMark { dense_end, in_map },
            unsettled_from,
        }
    }

    /// Drops the records a record run now holds (`mark`, from [`RecordMap::sealable`]),
    /// handing each one's bucket to `dropped`; a record of the map that changed since
    /// (expired and reserved again) stays.
    pub(crate) fn drop_sealed(
        &mut self,
        mark: &SealMark,
        window: Window,
        mut dropped: impl FnMut(u64),
    ) {
        self.dense.drop_before(mark.dense_end, window, &mut dropped);
        for &(fingerprint, lease_id) in &mark.in_map {
            let same = self
                .map
                .get(&fingerprint)
                .is_some_and(|record| record.lease_id == lease_id && record.settled().is_some());
            if same && let Some(record) = self.map.remove(&fingerprint) {
                dropped(record.bucket);
            }
        }
    }

    /// Drops the record of `fingerprint` if it is settled; returns its bucket. For replay
    /// only (see `DenseRecords::remove_reclaiming`).
    pub(crate) fn drop_settled(&mut self, fingerprint: u128, window: Window) -> Option<u64> {
        match self.map.get(&fingerprint) {
            Some(record) if record.settled().is_some() => {
                self.map.remove(&fingerprint).map(|record| record.bucket)
            }
            Some(_) => None,
            None => self
                .dense
                .remove_reclaiming(fingerprint, window)
                .map(|record| record.bucket),
        }
    }

    /// Moves the record of `fingerprint` to the dense tier if it has settled.
    pub(crate) fn settle(&mut self, fingerprint: u128, window: Window) {
        if let Some(settled) = self.map.get(&fingerprint).and_then(StoredRecord::settled) {
            self.move_to_dense(fingerprint, settled, window);
        }
    }

    /// Moves a held response of lease `lease_id` on the record of `fingerprint` to the
    /// log at `span` (`StoredRecord::log_response`), and the record to the dense tier if
    /// that settles it: one probe of the map, and one more to remove it. A record not in
    /// the map holds no response (a settled one, or one gone).
    pub(crate) fn log_response(
        &mut self,
        fingerprint: u128,
        (lease_id, span): (u64, LogSpan),
        window: Window,
    ) {
        let Some(record) = self.map.get_mut(&fingerprint) else {
            return;
        };
        record.log_response(lease_id, span);
        if let Some(settled) = record.settled() {
            self.move_to_dense(fingerprint, settled, window);
        }
    }

    /// Moves the settled record of `fingerprint`, `settled`, from the map to the dense
    /// tier (unless it does not pack: it stays in the map).
    fn move_to_dense(&mut self, fingerprint: u128, settled: SettledRecord, window: Window) {
        if self.dense.add(fingerprint, settled, window).is_err() {
            return;
        }
        self.map.remove(&fingerprint);
        if self.expiry.len() > 2 * self.map.len() + QUEUE_SLACK {
            self.compact_queues();
        }
    }

    /// Drops the queue entries of records that left the map (or were stored again), and
    /// gives back the map's memory once it holds under a quarter of its capacity: a map
    /// grown for many records in flight would otherwise keep its peak for good, weighed
    /// by the memory budget with the records gone.
    fn compact_queues(&mut self) {
        if self.map.len() * 4 < self.map.capacity() {
            self.map.shrink_to(2 * self.map.len());
        }
        let map = &self.map;
        let needed = |&mut (bucket, fingerprint): &mut (u64, u128)| {
            map.get(&fingerprint).is_some_and(|r| r.bucket == bucket)
        };
        self.expiry.retain_mut(needed);
        self.expiry.shrink_to(2 * self.expiry.len() + QUEUE_SLACK);
        if let Some(aging) = &mut self.aging {
            aging.retain_mut(needed);
            aging.shrink_to(2 * aging.len() + QUEUE_SLACK);
        }
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
        window: Window,
    ) -> Option<StoredRecord> {
        self.expiry.push_back((record.bucket, fingerprint));
        if let Some(aging) = &mut self.aging {
            aging.push_back((record.bucket, fingerprint));
        }
        self.map.insert(fingerprint, record).or_else(|| {
            self.dense
                .remove(fingerprint, window)
                .map(StoredRecord::from)
        })
    }

    pub(crate) fn remove(&mut self, fingerprint: u128, window: Window) -> Option<StoredRecord> {
        self.map.remove(&fingerprint).or_else(|| {
            self.dense
                .remove(fingerprint, window)
                .map(StoredRecord::from)
        })
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
            .filter(|r| r.created_ms <= before_ms && window.is_live(r.bucket, current))
            .filter_map(StoredRecord::listed)
            .collect()
    }

    /// Removes up to `budget` records of each tier whose bucket has left the window.
    /// True if nothing more was due at `current` ([`expire_queue`]).
    pub(crate) fn expire(&mut self, budget: usize, window: Window, current: u64) -> bool {
        let map_idle = expire_queue(
            &mut self.map,
            &mut self.expiry,
            budget,
            window,
            current,
            |r| r.bucket,
        );
        self.dense.expire(budget, window, current) && map_idle
    }

    /// Drops the responses of up to `budget` records whose bucket has left `retention`
    /// (keeping the records, which say the operation happened, to the window's end).
    /// True if nothing more was due at `current`, as [`RecordMap::expire`].
    pub(crate) fn age(&mut self, budget: usize, retention: Window, current: u64) -> bool {
        let Some(aging) = &mut self.aging else {
            return true;
        };
        for _ in 0..budget {
            let Some(&(bucket, fingerprint)) = aging.front() else {
                return true;
            };
            if retention.is_live(bucket, current) {
                return true;
            }
            aging.pop_front();
            if let Some(record) = self.map.get_mut(&fingerprint)
                && record.bucket == bucket
            {
                record.drop_response();
            }
        }
        false
    }

    /// Records held in memory, live or expired but not yet removed.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.map.len() + self.dense.len()
    }

    /// Approximate heap bytes held, and of those the bytes a record seal would take out
    /// of memory: the settled records', counted by record. Records in flight cannot be
    /// sealed, and capacity left behind by records that left is not sealable either: a
    /// seal decided on the whole would find nothing to take, again and again.
    pub(crate) fn heap_bytes(&self) -> (usize, usize) {
        let per_entry = size_of::<(u128, StoredRecord)>() + 1;
        let (mut payload, mut sealable) = (0, 0);
        for record in self.map.values() {
            let bytes = record.heap_bytes();
            payload += bytes;
            if record.settled().is_some() {
                sealable += per_entry + bytes;
            }
        }
        let queues = self.expiry.capacity() + self.aging.as_ref().map_or(0, VecDeque::capacity);
        let held = self.map.capacity() * per_entry
            + queues * size_of::<(u64, u128)>()
            + payload
            + self.dense.heap_bytes();
        (held, sealable + self.dense.record_bytes())
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
        StoredRecord::in_flight(key, None, (1, 1), (bucket, bucket))
    }

    /// A finished record in compact form is its map slot alone: no heap bytes, and a
    /// slot of at most 128 bytes with its fingerprint.
    #[test]
    fn a_record_in_the_log_is_a_fixed_size_slot() {
        assert!(
            size_of::<(u128, StoredRecord)>() <= 128,
            "{} bytes a slot",
            size_of::<(u128, StoredRecord)>()
        );
        let span = |start| LogSpan {
            bucket: 0,
            seq: 0,
            start,
            len: 64,
        };
        let mut done = StoredRecord::in_flight(&[9; 600], Some(span(48)), (1, 1), (0, 0));
        done.set_note(Arc::from(&b"charged"[..]));
        done.finish(RecordStatus::Completed, Ending::Held(&[7; 4096]), 0);
        assert!(
            done.heap_bytes() > 4096 + 600,
            "held while the log is unwritten"
        );
        done.log_response(1, span(200));
        assert_eq!(done.heap_bytes(), 0, "{done:?}");
        let record = done.snapshot(None, 0);
        assert_eq!(record.key_logged, Some(span(48)));
        assert_eq!(record.logged, Some((span(200), 1)));
        done.drop_response();
        assert_eq!(done.snapshot(None, 0).logged, None, "aged out");
    }

    /// A record whose response aged out before its finish frame was located still
    /// settles once it is: it never pins a record run's cover.
    #[test]
    fn a_record_past_its_retention_settles_once_its_frame_is_located() {
        let span = |start| LogSpan {
            bucket: 0,
            seq: 0,
            start,
            len: 64,
        };
        let mut done = StoredRecord::in_flight(b"key", Some(span(48)), (1, 1), (0, 0));
        done.finish(RecordStatus::Completed, Ending::Held(&[7; 64]), 0);
        done.drop_response();
        assert!(done.settled().is_none());
        done.log_response(1, span(200));
        let settled = done.settled().expect("settled");
        assert_eq!((settled.response, settled.key), (span(200), span(48)));
        assert_eq!(done.snapshot(None, 0).logged, None, "still aged out");
    }

    /// Settled records (finished, response and key in the log) take the dense tier's
    /// 76-byte slots and a 4-byte index position each, not a 128-byte map slot and a
    /// queue entry: at most 96 bytes a record with the containers' spare capacity.
    #[test]
    fn settled_records_take_at_most_96_bytes_each() {
        const RECORDS: u32 = 100_000;
        let window = Window::new(4_000, 1_000);
        let span = |bucket, start| LogSpan {
            bucket,
            seq: 0,
            start,
            len: 300,
        };
        let mut map = RecordMap::new(false);
        for i in 0..RECORDS {
            let fingerprint = u128::from(i).wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
            let bucket = u64::from(i * 4 / RECORDS);
            let at_ms = bucket * 1_000 + u64::from(i % 1_000);
            let key_at = Some(span(bucket, 64 + i));
            map.insert(
                fingerprint,
                StoredRecord::in_flight(&[b'k'; 60], key_at, (7, at_ms), (bucket, at_ms)),
                window,
            );
            let record = map
                .live_mut(fingerprint, None, (window, bucket), None)
                .unwrap()
                .unwrap();
            record.finish(
                RecordStatus::Completed,
                Ending::Logged(span(bucket, 9_000)),
                at_ms + 5,
            );
            map.settle(fingerprint, window);
        }
        let per_record = map.heap_bytes().0 / RECORDS as usize;
        assert!(per_record <= 96, "{per_record} bytes a record");
        assert_eq!(map.len(), RECORDS as usize);
        let fingerprint = 77u128.wrapping_mul(0x9e37_79b9_7f4a_7c15_f39c_c060_5ced_c835);
        let record = map
            .live_mut(fingerprint, Some(b"other"), (window, 3), None)
            .unwrap()
            .unwrap();
        let snapshot = record.snapshot(None, 3);
        assert_eq!(snapshot.status, RecordStatus::Completed);
        assert_eq!(snapshot.logged, Some((span(0, 9_000), 77)));
        assert_eq!(snapshot.key_logged, Some(span(0, 64 + 77)));
        assert_eq!(snapshot.finished_ms, Some(82));
    }

    #[test]
    fn aged_responses_leave_memory_and_the_record_stays() {
        let (window, retention) = (Window::new(4, 1), Window::new(2, 1));
        let mut map = RecordMap::new(true);
        let mut done = record(0, b"a");
        done.finish(RecordStatus::Completed, Ending::Held(&[7; 4096]), 0);
        map.insert(1, done, window);
        map.insert(2, record(1, b"b"), window);
        let before = map.heap_bytes().0;
        map.age(10, retention, 2);
        assert_eq!(map.heap_bytes().0, before, "inside the retention: kept");
        map.age(10, retention, 3);
        assert!(
            map.heap_bytes().0 + 4096 <= before,
            "the response's bytes are gone"
        );
        let kept = map
            .live_mut(1, Some(b"a"), (window, 3), None)
            .unwrap()
            .unwrap();
        assert_eq!(kept.snapshot(None, 3).status, RecordStatus::Completed);
        assert_eq!(kept.snapshot(None, 3).response, None);
    }

    #[test]
    fn expired_records_are_absent_and_drained() {
        let window = Window::new(2, 1);
        let mut map = RecordMap::default();
        map.insert(1, record(0, b"a"), window);
        map.insert(2, record(1, b"b"), window);
        assert!(
            map.live_mut(1, Some(b"a"), (window, 2), None)
                .unwrap()
                .is_some()
        );
        map.expire(10, window, 3);
        assert_eq!(map.len(), 1);
        assert!(
            map.live_mut(1, Some(b"a"), (window, 3), None)
                .unwrap()
                .is_none()
        );
        assert!(
            map.live_mut(2, Some(b"b"), (window, 3), None)
                .unwrap()
                .is_some()
        );
        assert!(
            map.live_mut(2, Some(b"b"), (window, 4), None)
                .unwrap()
                .is_none()
        );
        assert_eq!(map.len(), 0);
    }

    #[test]
    fn reinserted_key_survives_old_expiry_entry() {
        let window = Window::new(2, 1);
        let mut map = RecordMap::default();
        map.insert(1, record(0, b"a"), window);
        map.remove(1, window);
        map.insert(1, record(5, b"a"), window);
        map.expire(10, window, 5);
        assert!(
            map.live_mut(1, Some(b"a"), (window, 5), None)
                .unwrap()
                .is_some()
        );
    }

    #[test]
    fn different_key_same_fingerprint_is_refused() {
        let window = Window::new(2, 1);
        let mut map = RecordMap::default();
        map.insert(1, record(0, b"a"), window);
        assert!(matches!(
            map.live_mut(1, Some(b"z"), (window, 0), None),
            Err(Error::FingerprintCollision)
        ));
    }
}
