//! The reference model: oncedb's semantics written as plainly as possible, with maps and
//! no concurrency, time buckets, files or hashing. The proptest state machine
//! (`tests/engine/model.rs`) and the `reservation_races` fuzz harness
//! (`tests/fuzzing/reservation_races.rs`) both drive the engine and this model with the
//! same operations and require the same answers.
//!
//! Keys are single bytes and records are named by `(scope, key)` with two scopes, which
//! is all the harnesses need to reach every interleaving.

use std::collections::HashMap;

/// A record's name: which of two scopes, and the key.
pub type RecordId = (bool, u8);

/// Where a record is in its lifecycle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum State {
    /// Held by lease `lease` (the model's number for it).
    InFlight {
        /// The lease that holds it.
        lease: u64,
    },
    /// Completed with this response.
    Completed(Vec<u8>),
    /// Failed with this response.
    Failed(Vec<u8>),
}

/// One record.
#[derive(Debug, Clone)]
pub struct ModelRecord {
    /// The request byte it is bound to.
    pub request: u8,
    /// The bucket it was reserved in: it expires with it.
    pub bucket: u64,
    /// When it was reserved.
    pub created_ms: u64,
    /// When it was completed or failed.
    pub finished_ms: Option<u64>,
    /// The leases take-overs replaced: exactly the leases fenced on it.
    pub taken_over: Vec<u64>,
    /// Its state.
    pub state: State,
}

/// What a reserve answers.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Reserve {
    /// A new record, under this lease.
    Acquired(u64),
    /// The key is bound to another request.
    Mismatch,
    /// Another lease holds it; reserved at this time.
    InFlight {
        /// When the record was reserved.
        created_ms: u64,
    },
    /// Replay this response.
    Completed(Vec<u8>),
    /// Replay this failure.
    Failed(Vec<u8>),
}

/// How a lease ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ending {
    /// Stores the response.
    Complete(Vec<u8>),
    /// Stores the failure.
    Fail(Vec<u8>),
    /// Deletes the record.
    Release,
}

/// What a lease call answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseAnswer {
    /// The lease held the record; the ending applied.
    Done,
    /// A take-over replaced the lease (`Error::Fenced`).
    Fenced,
    /// The lease holds nothing: its record ended, expired or was released
    /// (`Error::LeaseLost`).
    Lost,
}

/// The whole specification's state.
#[derive(Debug, Clone, Default)]
pub struct Model {
    /// The highest bucket seen: a clock that steps back never moves the window back.
    pub bucket: u64,
    /// Buckets a key lives after the one it was admitted in.
    pub span: u64,
    /// Admission bucket of every dedup key ever admitted.
    pub keys: HashMap<u8, u64>,
    /// Every record ever reserved (expired ones included, until replaced).
    pub records: HashMap<RecordId, ModelRecord>,
    /// The last lease number handed out.
    pub next_lease: u64,
}

impl Model {
    /// An empty store at `bucket` whose keys live `span` buckets after their own.
    pub fn new(bucket: u64, span: u64) -> Model {
        Model {
            bucket,
            span,
            ..Model::default()
        }
    }

    /// The clock moved to `bucket` (never back).
    pub fn advance_to(&mut self, bucket: u64) {
        self.bucket = self.bucket.max(bucket);
    }

    /// Whether an entry admitted in bucket `admitted` is still remembered.
    pub fn live(&self, admitted: u64) -> bool {
        self.bucket - admitted <= self.span
    }

    /// Whether dedup key `key` is remembered.
    pub fn key_live(&self, key: u8) -> bool {
        self.keys.get(&key).is_some_and(|&b| self.live(b))
    }

    /// `insert_if_absent`.
    pub fn insert(&mut self, key: u8) -> bool {
        if self.key_live(key) {
            return false;
        }
        self.keys.insert(key, self.bucket);
        true
    }

    /// The live record `id`, if any.
    pub fn record(&self, id: RecordId) -> Option<&ModelRecord> {
        self.records.get(&id).filter(|r| self.live(r.bucket))
    }

    /// Whether lease `lease` holds record `id` in flight.
    pub fn owns(&self, id: RecordId, lease: u64) -> bool {
        self.record(id)
            .is_some_and(|r| r.state == State::InFlight { lease })
    }

    /// `reserve` at `now_ms`; a new record is stored.
    pub fn reserve(&mut self, id: RecordId, request: u8, now_ms: u64) -> Reserve {
        let Some(record) = self.record(id) else {
            self.next_lease += 1;
            let lease = self.next_lease;
            let record = ModelRecord {
                request,
                bucket: self.bucket,
                created_ms: now_ms,
                finished_ms: None,
                taken_over: Vec::new(),
                state: State::InFlight { lease },
            };
            self.records.insert(id, record);
            return Reserve::Acquired(lease);
        };
        if record.request != request {
            return Reserve::Mismatch;
        }
        match &record.state {
            State::InFlight { .. } => Reserve::InFlight {
                created_ms: record.created_ms,
            },
            State::Completed(response) => Reserve::Completed(response.clone()),
            State::Failed(response) => Reserve::Failed(response.clone()),
        }
    }

    /// `take_over`: a new lease if the record is live and in flight.
    pub fn take_over(&mut self, id: RecordId) -> Option<u64> {
        let live = self.record(id).is_some();
        let record = self.records.get_mut(&id).filter(|_| live)?;
        let State::InFlight { lease } = record.state else {
            return None;
        };
        self.next_lease += 1;
        record.taken_over.push(lease);
        record.state = State::InFlight {
            lease: self.next_lease,
        };
        Some(self.next_lease)
    }

    /// Lease `lease` of record `id` ends with `ending` at `now_ms`.
    pub fn end(&mut self, id: RecordId, lease: u64, ending: Ending, now_ms: u64) -> LeaseAnswer {
        if !self.owns(id, lease) {
            let fenced = self
                .record(id)
                .is_some_and(|r| r.taken_over.contains(&lease));
            return if fenced {
                LeaseAnswer::Fenced
            } else {
                LeaseAnswer::Lost
            };
        }
        let Some(record) = self.records.get_mut(&id) else {
            return LeaseAnswer::Lost;
        };
        match ending {
            Ending::Complete(response) => {
                record.state = State::Completed(response);
                record.finished_ms = Some(now_ms);
            }
            Ending::Fail(response) => {
                record.state = State::Failed(response);
                record.finished_ms = Some(now_ms);
            }
            Ending::Release => {
                self.records.remove(&id);
            }
        }
        LeaseAnswer::Done
    }

    /// Dedup keys inside the window.
    pub fn live_keys(&self) -> u64 {
        self.keys.values().filter(|&&b| self.live(b)).count() as u64
    }

    /// Records inside the window.
    pub fn live_records(&self) -> u64 {
        self.records
            .values()
            .filter(|r| self.live(r.bucket))
            .count() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_model_follows_the_lifecycle() {
        let mut model = Model::new(10, 2);
        assert!(model.insert(1) && !model.insert(1));
        let Reserve::Acquired(first) = model.reserve((true, 1), 7, 100) else {
            panic!("acquires");
        };
        assert_eq!(model.reserve((true, 1), 8, 101), Reserve::Mismatch);
        let second = model.take_over((true, 1)).unwrap();
        assert_eq!(
            model.end((true, 1), first, Ending::Release, 102),
            LeaseAnswer::Fenced
        );
        assert_eq!(
            model.end((true, 1), second, Ending::Complete(vec![1]), 103),
            LeaseAnswer::Done
        );
        assert_eq!(
            model.reserve((true, 1), 7, 104),
            Reserve::Completed(vec![1])
        );
        model.advance_to(13);
        assert!(model.record((true, 1)).is_none() && !model.key_live(1));
        assert_eq!(
            model.end((true, 1), second, Ending::Release, 105),
            LeaseAnswer::Lost
        );
    }
}
