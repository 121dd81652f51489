//! A proptest state machine: random operations against a plain model of the semantics.

use std::collections::HashMap;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use oncedb::{Db, Lease, ManualClock, Options, Reservation, Scope};
use proptest::prelude::*;
use proptest::test_runner::FileFailurePersistence;

const BUCKET_MS: u64 = 1_000;
const SPAN_BUCKETS: u64 = 4;
const KEYS: u8 = 12;

#[derive(Debug, Clone)]
enum Op {
    Insert(u8),
    InsertMany(Vec<u8>),
    Contains(u8),
    Reserve { key: u8, request: u8, scope: bool },
    Complete { lease: usize, response: u8 },
    Fail { lease: usize, response: u8 },
    Release { lease: usize },
    DropLease { lease: usize },
    Get { key: u8, scope: bool },
    Advance(u64),
    StepBack(u64),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..KEYS).prop_map(Op::Insert),
        2 => prop::collection::vec(0..KEYS, 0..6).prop_map(Op::InsertMany),
        1 => (0..KEYS).prop_map(Op::Contains),
        4 => (0..KEYS, 0..2u8, any::<bool>()).prop_map(|(key, request, scope)| Op::Reserve { key, request, scope }),
        2 => (0..4usize, any::<u8>()).prop_map(|(lease, response)| Op::Complete { lease, response }),
        1 => (0..4usize, any::<u8>()).prop_map(|(lease, response)| Op::Fail { lease, response }),
        1 => (0..4usize).prop_map(|lease| Op::Release { lease }),
        1 => (0..4usize).prop_map(|lease| Op::DropLease { lease }),
        1 => (0..KEYS, any::<bool>()).prop_map(|(key, scope)| Op::Get { key, scope }),
        2 => prop_oneof![Just(1u64), Just(499), Just(BUCKET_MS), 0..3 * BUCKET_MS].prop_map(Op::Advance),
        1 => (0..10 * BUCKET_MS).prop_map(Op::StepBack),
    ]
}

#[derive(Debug, Clone, PartialEq)]
enum ModelState {
    InFlight(u64),
    Completed(Vec<u8>),
    Failed(Vec<u8>),
}

#[derive(Debug, Clone)]
struct ModelRecord {
    request: u8,
    bucket: u64,
    state: ModelState,
}

/// The specification, written as plainly as possible.
#[derive(Default)]
struct Model {
    /// Highest bucket seen: the clock never moves the window backwards.
    bucket: u64,
    keys: HashMap<u8, u64>,
    records: HashMap<(bool, u8), ModelRecord>,
    next_lease: u64,
}

impl Model {
    fn live(&self, admitted: u64) -> bool {
        self.bucket - admitted <= SPAN_BUCKETS
    }

    fn insert(&mut self, key: u8) -> bool {
        match self.keys.get(&key) {
            Some(&bucket) if self.live(bucket) => false,
            _ => {
                self.keys.insert(key, self.bucket);
                true
            }
        }
    }

    fn record(&self, id: (bool, u8)) -> Option<&ModelRecord> {
        self.records.get(&id).filter(|r| self.live(r.bucket))
    }
}

struct Harness {
    clock: ManualClock,
    now_ms: u64,
    db: Db,
    model: Model,
    leases: Vec<(Lease, (bool, u8), u64)>,
}

fn scope(which: bool) -> Scope {
    if which {
        Scope::new("tenant-a", "op")
    } else {
        Scope::new("tenant-b", "op")
    }
}

impl Harness {
    fn new() -> Self {
        let start_ms = 1_700_000_000_000;
        let clock = ManualClock::new(UNIX_EPOCH + Duration::from_millis(start_ms));
        let db = Db::open(
            Options::in_memory()
                .window(Duration::from_millis(BUCKET_MS * SPAN_BUCKETS))
                .bucket_width(Duration::from_millis(BUCKET_MS))
                .shards(4)
                .clock(clock.clone()),
        )
        .unwrap();
        Harness {
            clock,
            now_ms: start_ms,
            db,
            model: Model {
                bucket: start_ms / BUCKET_MS,
                ..Model::default()
            },
            leases: Vec::new(),
        }
    }

    fn set_time(&mut self, ms: u64) {
        self.now_ms = ms;
        self.clock
            .set(SystemTime::UNIX_EPOCH + Duration::from_millis(ms));
        self.model.bucket = self.model.bucket.max(ms / BUCKET_MS);
    }

    fn take_lease(&mut self, index: usize) -> Option<(Lease, (bool, u8), u64)> {
        if self.leases.is_empty() {
            return None;
        }
        let index = index % self.leases.len();
        Some(self.leases.swap_remove(index))
    }

    fn run(&mut self, op: Op) {
        match op {
            Op::Insert(key) => {
                assert_eq!(
                    self.db.insert_if_absent(&[key]).unwrap(),
                    self.model.insert(key),
                    "insert {key}"
                );
            }
            Op::InsertMany(keys) => {
                let batch: Vec<[u8; 1]> = keys.iter().map(|&k| [k]).collect();
                let expected: Vec<bool> = keys.iter().map(|&k| self.model.insert(k)).collect();
                assert_eq!(self.db.insert_many(&batch).unwrap(), expected);
            }
            Op::Contains(key) => {
                let expected = self
                    .model
                    .keys
                    .get(&key)
                    .is_some_and(|&b| self.model.live(b));
                assert_eq!(self.db.contains(&[key]).unwrap(), expected);
            }
            Op::Reserve {
                key,
                request,
                scope: which,
            } => self.reserve(key, request, which),
            Op::Complete { lease, response } => self.finish(lease, Some((true, response))),
            Op::Fail { lease, response } => self.finish(lease, Some((false, response))),
            Op::Release { lease } => self.finish(lease, None),
            Op::DropLease { lease } => drop(self.take_lease(lease)),
            Op::Get { key, scope: which } => {
                let got = self.db.get(&scope(which), &[key]).unwrap();
                let expected = self.model.record((which, key)).cloned();
                match (got, expected) {
                    (None, None) => {}
                    (Some(record), Some(model)) => {
                        let response = match &model.state {
                            ModelState::InFlight(_) => None,
                            ModelState::Completed(r) | ModelState::Failed(r) => Some(r.clone()),
                        };
                        assert_eq!(record.response().map(<[u8]>::to_vec), response);
                    }
                    (got, expected) => panic!("get: {got:?} vs model {expected:?}"),
                }
            }
            Op::Advance(ms) => self.set_time(self.now_ms + ms),
            Op::StepBack(ms) => self.set_time(self.now_ms.saturating_sub(ms)),
        }
    }

    fn reserve(&mut self, key: u8, request: u8, which: bool) {
        let id = (which, key);
        let got = self.db.reserve(&scope(which), &[key], &[request]).unwrap();
        let expected = self.model.record(id).cloned();
        match (got, expected) {
            (Reservation::Acquired(lease), None) => {
                self.model.next_lease += 1;
                let lease_id = self.model.next_lease;
                self.model.records.insert(
                    id,
                    ModelRecord {
                        request,
                        bucket: self.model.bucket,
                        state: ModelState::InFlight(lease_id),
                    },
                );
                self.leases.push((lease, id, lease_id));
            }
            (Reservation::Mismatch, Some(model)) => assert_ne!(model.request, request),
            (Reservation::InFlight { .. }, Some(model)) => {
                assert_eq!(model.request, request);
                assert!(matches!(model.state, ModelState::InFlight(_)));
            }
            (Reservation::Completed(record), Some(model)) => {
                assert_eq!(model.request, request);
                assert_eq!(
                    ModelState::Completed(record.response().unwrap().to_vec()),
                    model.state
                );
            }
            (Reservation::Failed(record), Some(model)) => {
                assert_eq!(model.request, request);
                assert_eq!(
                    ModelState::Failed(record.response().unwrap().to_vec()),
                    model.state
                );
            }
            (got, expected) => panic!("reserve {id:?}: {got:?} vs model {expected:?}"),
        }
    }

    fn finish(&mut self, index: usize, outcome: Option<(bool, u8)>) {
        let Some((lease, id, lease_id)) = self.take_lease(index) else {
            return;
        };
        let owns = self
            .model
            .record(id)
            .is_some_and(|r| r.state == ModelState::InFlight(lease_id));
        let result = match outcome {
            Some((true, response)) => lease.complete(&[response]),
            Some((false, response)) => lease.fail(&[response]),
            None => lease.release(),
        }
        .map_err(oncedb::Error::from);
        if !owns {
            assert!(
                matches!(result, Err(oncedb::Error::LeaseLost)),
                "{result:?}"
            );
            return;
        }
        result.unwrap();
        match outcome {
            Some((true, response)) => {
                self.model.records.get_mut(&id).unwrap().state =
                    ModelState::Completed(vec![response]);
            }
            Some((false, response)) => {
                self.model.records.get_mut(&id).unwrap().state = ModelState::Failed(vec![response]);
            }
            None => {
                self.model.records.remove(&id);
            }
        }
    }

    fn check_stats(&self) {
        let stats = self.db.stats();
        let live_keys = self
            .model
            .keys
            .values()
            .filter(|&&b| self.model.live(b))
            .count();
        let live_records = self
            .model
            .records
            .values()
            .filter(|r| self.model.live(r.bucket))
            .count();
        assert_eq!(stats.live_keys, live_keys as u64);
        assert_eq!(stats.live_records, live_records as u64);
    }
}

proptest! {
    // Failures are kept beside this file, in `model.proptest-regressions`. The default
    // (`SourceParallel`) would look in `tests/proptest-regressions/model.txt`, since this
    // binary's directory holds a `main.rs`.
    #![proptest_config(ProptestConfig {
        cases: 256,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..ProptestConfig::default()
    })]

    #[test]
    fn engine_matches_the_model(ops in prop::collection::vec(op(), 1..200)) {
        let mut harness = Harness::new();
        for op in ops {
            harness.run(op);
            harness.check_stats();
        }
    }
}
