//! A proptest state machine: random operations against a plain model of the semantics.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use std::sync::Arc;

use oncedb::io::MemStorage;
use oncedb::{Db, Durability, Lease, ManualClock, Options, Reservation, Scope};
use oncedb_testkit::model::{Ending, LeaseAnswer, Model, Reserve, State};
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
    Reserve {
        key: u8,
        request: u8,
        scope: bool,
    },
    Complete {
        lease: usize,
        response: u8,
    },
    Fail {
        lease: usize,
        response: u8,
    },
    Release {
        lease: usize,
    },
    DropLease {
        lease: usize,
    },
    Get {
        key: u8,
        scope: bool,
    },
    Advance(u64),
    StepBack(u64),
    /// Finishes enough fresh records in a scope of their own to bring the records memory
    /// holds past a small budget's threshold: the next look seals every settled record,
    /// the model's among them.
    Bulk,
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

/// Records one `Op::Bulk` finishes: a look at the budget comes every 4,096 calls.
const BULK_RECORDS: u32 = 4_100;

/// Where the engine keeps its data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    InMemory,
    /// `Sync` on a storage in memory, where a record settles (response and key in the
    /// log) before its completion returns.
    Durable,
    /// The same under a small memory budget, where settled records are sealed into
    /// record runs on disk (`Op::Bulk` brings them there).
    Sealing,
}

struct Harness {
    clock: ManualClock,
    mode: Mode,
    /// The filler records `Op::Bulk` finished so far.
    bulk: u32,
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
    fn new(mode: Mode) -> Self {
        let start_ms = 1_700_000_000_000;
        let clock = ManualClock::new(UNIX_EPOCH + Duration::from_millis(start_ms));
        let durable = || {
            Options::new("/db")
                .storage(Arc::new(MemStorage::new()))
                .durability(Durability::Sync)
        };
        let options = match mode {
            Mode::InMemory => Options::in_memory(),
            Mode::Durable => durable(),
            Mode::Sealing => durable().memory_budget(1 << 16),
        };
        let db = Db::open(
            options
                .window(Duration::from_millis(BUCKET_MS * SPAN_BUCKETS))
                .bucket_width(Duration::from_millis(BUCKET_MS))
                .shards(4)
                .clock(clock.clone()),
        )
        .unwrap();
        Harness {
            clock,
            mode,
            bulk: 0,
            now_ms: start_ms,
            db,
            model: Model::new(start_ms / BUCKET_MS, SPAN_BUCKETS),
            leases: Vec::new(),
        }
    }

    fn set_time(&mut self, ms: u64) {
        self.now_ms = ms;
        self.clock
            .set(SystemTime::UNIX_EPOCH + Duration::from_millis(ms));
        self.model.advance_to(ms / BUCKET_MS);
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
                assert_eq!(self.db.contains(&[key]).unwrap(), self.model.key_live(key));
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
                            State::InFlight { .. } => None,
                            State::Completed(r) | State::Failed(r) => Some(r.clone()),
                        };
                        assert_eq!(record.response().map(<[u8]>::to_vec), response);
                    }
                    (got, expected) => panic!("get: {got:?} vs model {expected:?}"),
                }
            }
            Op::Advance(ms) => self.set_time(self.now_ms + ms),
            Op::StepBack(ms) => self.set_time(self.now_ms.saturating_sub(ms)),
            Op::Bulk => self.bulk(),
        }
    }

    fn bulk(&mut self) {
        let filler = Scope::new("filler", "op");
        for n in self.bulk..self.bulk + BULK_RECORDS {
            let Reservation::Acquired(lease) =
                self.db.reserve(&filler, &n.to_le_bytes(), b"r").unwrap()
            else {
                panic!("filler record {n} is new");
            };
            lease.complete(&n.to_le_bytes()).unwrap();
        }
        self.bulk += BULK_RECORDS;
        // Waits for the seal under way.
        self.db.flush().unwrap();
    }

    fn reserve(&mut self, key: u8, request: u8, which: bool) {
        let id = (which, key);
        let got = self.db.reserve(&scope(which), &[key], &[request]).unwrap();
        match (got, self.model.reserve(id, request, self.now_ms)) {
            (Reservation::Acquired(lease), Reserve::Acquired(lease_id)) => {
                self.leases.push((lease, id, lease_id));
            }
            (Reservation::Mismatch, Reserve::Mismatch)
            | (Reservation::InFlight { .. }, Reserve::InFlight { .. }) => {}
            (Reservation::Completed(record), Reserve::Completed(response))
            | (Reservation::Failed(record), Reserve::Failed(response)) => {
                assert_eq!(record.response(), Some(&response[..]), "{id:?}");
            }
            (got, expected) => panic!("reserve {id:?}: {got:?} vs model {expected:?}"),
        }
    }

    fn finish(&mut self, index: usize, outcome: Option<(bool, u8)>) {
        let Some((lease, id, lease_id)) = self.take_lease(index) else {
            return;
        };
        let (result, ending) = match outcome {
            Some((true, response)) => (
                lease.complete(&[response]),
                Ending::Complete(vec![response]),
            ),
            Some((false, response)) => (lease.fail(&[response]), Ending::Fail(vec![response])),
            None => (lease.release(), Ending::Release),
        };
        let result = result.map_err(oncedb::Error::from);
        match self.model.end(id, lease_id, ending, self.now_ms) {
            LeaseAnswer::Done => result.unwrap(),
            // No take-overs here: a lease that does not own its record lost it.
            LeaseAnswer::Lost | LeaseAnswer::Fenced => assert!(
                matches!(result, Err(oncedb::Error::LeaseLost)),
                "{result:?}"
            ),
        }
    }

    fn check_stats(&self) {
        let stats = self.db.stats();
        if self.mode == Mode::Sealing {
            // Records in runs are counted apart, and a run counts its records until it
            // leaves whole with its newest bucket: the model's count is not the store's.
            assert_eq!(stats.live_keys, self.model.live_keys());
            return;
        }
        assert_eq!(stats.live_keys, self.model.live_keys());
        assert_eq!(stats.live_records, self.model.live_records());
    }
}

/// `cases` runs, failures kept beside this file, in `model.proptest-regressions`. The
/// default (`SourceParallel`) would look in `tests/proptest-regressions/model.txt`, since
/// this binary's directory holds a `main.rs`.
fn config(cases: u32) -> ProptestConfig {
    ProptestConfig {
        cases,
        failure_persistence: Some(Box::new(FileFailurePersistence::WithSource(
            "proptest-regressions",
        ))),
        ..ProptestConfig::default()
    }
}

proptest! {
    #![proptest_config(config(256))]

    #[test]
    fn engine_matches_the_model(ops in prop::collection::vec(op(), 1..200)) {
        let mut harness = Harness::new(Mode::InMemory);
        for op in ops {
            harness.run(op);
            harness.check_stats();
        }
    }

    /// The same on disk, where finished records leave the map for the dense tier.
    #[test]
    fn a_durable_engine_matches_the_model(ops in prop::collection::vec(op(), 1..200)) {
        let mut harness = Harness::new(Mode::Durable);
        for op in ops {
            harness.run(op);
            harness.check_stats();
        }
    }
}

proptest! {
    #![proptest_config(config(10))]

    /// The same under a memory budget, with a burst of filler records after each of three
    /// runs of operations: each burst brings the records memory holds to a seal, which
    /// takes the model's settled records into record runs, and they must answer as the
    /// model says (replays, mismatches, expiry, lost leases) from there.
    #[test]
    fn a_sealing_engine_matches_the_model(
        runs in prop::collection::vec(prop::collection::vec(op(), 1..40), 3)
    ) {
        let mut harness = Harness::new(Mode::Sealing);
        for (round, ops) in runs.into_iter().enumerate() {
            if round > 0 {
                harness.run(Op::Bulk);
            }
            for op in ops {
                harness.run(op);
                harness.check_stats();
            }
        }
        let stats = harness.db.stats();
        prop_assert!(stats.sealed_record_runs > 0 || stats.runs_expired > 0, "{stats:?}");
    }
}
