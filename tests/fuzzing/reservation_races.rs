//! Fuzz harness: the input bytes drive a few logical clients through interleaved,
//! multi-step lifecycles (reserve now, complete, fail, release or abandon later) plus
//! dedup inserts, clock moves across bucket and window edges, flushes, crashes and
//! reopens of a durable store on a simulated disk, all checked against a plain model after
//! every step.
//!
//! Shared by the fuzz target `fuzz/fuzz_targets/reservation_races.rs` and the corpus replay
//! test `tests/durability/fuzz_corpus.rs`. `run` panics on any disagreement with the model.

#![expect(
    clippy::cast_possible_truncation,
    reason = "test code: values are small and chosen by the test"
)]
#![expect(clippy::expect_used, reason = "test code: a panic is the test failing")]
#![expect(
    clippy::indexing_slicing,
    reason = "test code: a panic is the test failing"
)]
#![expect(clippy::unwrap_used, reason = "test code: a panic is the test failing")]

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, UNIX_EPOCH};

use oncedb::io::MemStorage;
use oncedb::{
    Db, Durability, Error, Lease, ManualClock, Options, RecordStatus, Reservation, Scope,
};
use oncedb_testkit::model::{self, LeaseAnswer, Model, RecordId, Reserve, State};

const BUCKET_MS: u64 = 1_000;
/// Buckets in the window: an entry admitted in bucket b is live through bucket b + SPAN.
const SPAN: u64 = 4;
/// Dedup keys and record keys are single bytes below this.
const KEYS: u8 = 6;
const CLIENTS: usize = 4;
/// Leases one client may hold at once.
const MAX_HELD: usize = 3;
/// Steps run from one input at most, whatever its length.
const MAX_STEPS: usize = 400;
/// Starts a little before a bucket edge.
const START_MS: u64 = 1_700_000_000_700;

/// Reads the input front to back; every read fails once it is used up.
struct Input<'a>(&'a [u8]);

impl<'a> Input<'a> {
    fn byte(&mut self) -> Option<u8> {
        let (&first, rest) = self.0.split_first()?;
        self.0 = rest;
        Some(first)
    }

    fn bytes(&mut self, len: usize) -> Option<&'a [u8]> {
        if self.0.len() < len {
            return None;
        }
        let (head, rest) = self.0.split_at(len);
        self.0 = rest;
        Some(head)
    }
}

/// How a client ends one of its leases.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Ending {
    Complete(Vec<u8>),
    Fail(Vec<u8>),
    Release,
    /// The client gives up without a word: the record stays in flight.
    Abandon,
}

#[derive(Debug, Clone)]
enum Step {
    Insert(u8),
    InsertMany(Vec<u8>),
    Reserve {
        client: usize,
        scope: bool,
        key: u8,
        request: u8,
    },
    /// A client takes over a record (a reconciliation worker).
    TakeOver {
        client: usize,
        scope: bool,
        key: u8,
    },
    /// A client retries the key of one of its own leases with the same request.
    Retry {
        client: usize,
        slot: usize,
    },
    End {
        client: usize,
        slot: usize,
        ending: Ending,
    },
    Advance(Advance),
    Flush,
    /// The process dies; with `power` the disk also loses what was never synced.
    Crash {
        power: bool,
    },
    /// A clean close and open.
    Reopen,
    /// A second open of the directory while the first handle lives.
    SecondOpen,
}

/// Clock moves, chosen to land on and around bucket and window edges.
#[derive(Debug, Clone, Copy)]
enum Advance {
    Millis(u64),
    ToEdge,
    JustBeforeEdge,
}

/// Opcodes of the input encoding (the low four bits of a step's first byte).
mod code {
    pub const INSERT: u8 = 0;
    pub const INSERT_MANY: u8 = 1;
    pub const RESERVE: u8 = 2;
    pub const RESERVE_TOO: u8 = 3;
    pub const RETRY: u8 = 4;
    pub const COMPLETE: u8 = 5;
    pub const TAKE_OVER: u8 = 6;
    pub const FAIL: u8 = 7;
    pub const RELEASE: u8 = 8;
    pub const ABANDON: u8 = 9;
    pub const ADVANCE: u8 = 10;
    pub const ADVANCE_TOO: u8 = 11;
    pub const FLUSH: u8 = 12;
    pub const CRASH: u8 = 13;
    pub const REOPEN: u8 = 14;
    pub const SECOND_OPEN: u8 = 15;
}

impl Step {
    /// Decodes the next step; `None` when the input runs out.
    fn parse(input: &mut Input<'_>) -> Option<Step> {
        let first = input.byte()?;
        // The high four bits pick a client, a key or a variant.
        let high = first >> 4;
        let client = usize::from(high) % CLIENTS;
        Some(match first & 0x0f {
            code::INSERT => Step::Insert(high % KEYS),
            code::INSERT_MANY => {
                let len = usize::from(high % 5);
                let keys = input.bytes(len)?.iter().map(|k| k % KEYS).collect();
                Step::InsertMany(keys)
            }
            code::RESERVE | code::RESERVE_TOO => {
                let arg = input.byte()?;
                Step::Reserve {
                    client,
                    scope: high & 0x08 != 0,
                    key: arg % KEYS,
                    request: (arg / KEYS) % 3,
                }
            }
            code::RETRY => Step::Retry {
                client,
                slot: usize::from(high >> 2),
            },
            code::TAKE_OVER => {
                let arg = input.byte()?;
                Step::TakeOver {
                    client,
                    scope: high & 0x08 != 0,
                    key: arg % KEYS,
                }
            }
            code::COMPLETE | code::FAIL => {
                let len = input.byte()?;
                let response = input.bytes(usize::from(len % 9))?.to_vec();
                let ending = if first & 0x0f == code::FAIL {
                    Ending::Fail(response)
                } else {
                    Ending::Complete(response)
                };
                Step::End {
                    client,
                    slot: usize::from(len / 9),
                    ending,
                }
            }
            code::RELEASE | code::ABANDON => Step::End {
                client,
                slot: usize::from(high >> 2),
                ending: if first & 0x0f == code::RELEASE {
                    Ending::Release
                } else {
                    Ending::Abandon
                },
            },
            code::ADVANCE | code::ADVANCE_TOO => Step::Advance(match high % 8 {
                0 => Advance::Millis(1),
                1 => Advance::JustBeforeEdge,
                2 => Advance::ToEdge,
                3 => Advance::Millis(BUCKET_MS),
                4 => Advance::Millis(SPAN * BUCKET_MS),
                5 => Advance::Millis((SPAN + 1) * BUCKET_MS),
                6 => Advance::Millis(BUCKET_MS / 2 - 1),
                _ => {
                    let amount = input.bytes(2)?;
                    let ms = u64::from(u16::from_le_bytes([amount[0], amount[1]]));
                    Advance::Millis(ms % (3 * (SPAN + 1) * BUCKET_MS))
                }
            }),
            code::FLUSH => Step::Flush,
            code::CRASH => Step::Crash {
                power: high & 1 == 0,
            },
            code::REOPEN => Step::Reopen,
            _ => Step::SecondOpen,
        })
    }
}

/// A lease held by a client, with the model's name for it.
struct Held {
    lease: Lease,
    id: RecordId,
    request: u8,
    lease_id: u64,
}

struct Harness {
    disk: MemStorage,
    clock: ManualClock,
    now_ms: u64,
    db: Option<Db>,
    model: Model,
    clients: Vec<Vec<Held>>,
    /// Handles and leases of processes that crashed. A dead process runs no more code,
    /// so they are only dropped when the run is over (dropping earlier would run the
    /// handle's clean-close path against the disk the next process owns).
    dead: Vec<(Db, Vec<Held>)>,
}

fn scope(which: bool) -> Scope {
    if which {
        Scope::new("tenant-a", "charge")
    } else {
        Scope::new("tenant-b", "charge")
    }
}

impl Harness {
    fn new() -> Self {
        let clock = ManualClock::new(UNIX_EPOCH + Duration::from_millis(START_MS));
        let mut harness = Harness {
            disk: MemStorage::new(),
            clock,
            now_ms: START_MS,
            db: None,
            model: Model::new(START_MS / BUCKET_MS, SPAN),
            clients: (0..CLIENTS).map(|_| Vec::new()).collect(),
            dead: Vec::new(),
        };
        harness.db = Some(harness.open().expect("open a fresh store"));
        harness
    }

    fn options(&self) -> Options {
        Options::new(Path::new("/db"))
            .window(Duration::from_millis(SPAN * BUCKET_MS))
            .bucket_width(Duration::from_millis(BUCKET_MS))
            .durability(Durability::Sync)
            .shards(2)
            .segment_max_bytes(4096)
            .clock(self.clock.clone())
            .storage(Arc::new(self.disk.clone()))
    }

    fn open(&self) -> oncedb::Result<Db> {
        Db::open(self.options())
    }

    fn db(&self) -> &Db {
        self.db.as_ref().expect("a handle is open between steps")
    }

    fn apply(&mut self, step: Step) {
        match step {
            Step::Insert(key) => {
                let got = self.db().insert_if_absent(&[key]).unwrap();
                assert_eq!(got, self.model.insert(key), "insert_if_absent({key})");
            }
            Step::InsertMany(keys) => {
                let batch: Vec<[u8; 1]> = keys.iter().map(|&k| [k]).collect();
                let got = self.db().insert_many(&batch).unwrap();
                let expected: Vec<bool> = keys.iter().map(|&k| self.model.insert(k)).collect();
                assert_eq!(got, expected, "insert_many({keys:?})");
            }
            Step::Reserve {
                client,
                scope,
                key,
                request,
            } => self.reserve(client, (scope, key), request),
            Step::TakeOver { client, scope, key } => self.take_over(client, (scope, key)),
            Step::Retry { client, slot } => {
                let held = &self.clients[client];
                if !held.is_empty() {
                    let held = &held[slot % held.len()];
                    let (id, request) = (held.id, held.request);
                    self.reserve(client, id, request);
                }
            }
            Step::End {
                client,
                slot,
                ending,
            } => self.end(client, slot, ending),
            Step::Advance(advance) => {
                let to_edge = BUCKET_MS - self.now_ms % BUCKET_MS;
                let by = match advance {
                    Advance::Millis(ms) => ms,
                    Advance::ToEdge => to_edge,
                    Advance::JustBeforeEdge => to_edge - 1,
                };
                self.clock.forward(Duration::from_millis(by));
                self.now_ms += by;
                self.model.advance_to(self.now_ms / BUCKET_MS);
            }
            Step::Flush => self.db().flush().unwrap(),
            Step::Crash { power } => self.crash(power),
            Step::Reopen => {
                // Leases die with the handle they came from; their records stay in flight.
                for held in &mut self.clients {
                    held.clear();
                }
                self.db = None;
                self.db = Some(self.open().expect("reopen after a clean close"));
            }
            Step::SecondOpen => match self.open() {
                Err(Error::Locked(_)) => {}
                Err(other) => panic!("a second open must be Locked, got {other}"),
                Ok(_) => panic!("a second handle opened a locked directory"),
            },
        }
    }

    fn crash(&mut self, power: bool) {
        let leases = self.clients.iter_mut().flat_map(std::mem::take).collect();
        let db = self.db.take().expect("a handle is open");
        self.dead.push((db, leases));
        if power {
            self.disk.power_loss();
        } else {
            self.disk.process_crash();
        }
        let db = self
            .open()
            .unwrap_or_else(|err| panic!("reopen after a crash (power loss {power}): {err}"));
        self.db = Some(db);
    }

    /// A take-over succeeds exactly when the model's record is live and in flight; the
    /// new lease fences every older lease of the record.
    fn take_over(&mut self, client: usize, id: RecordId) {
        let got = self.db().take_over(&scope(id.0), &[id.1]).unwrap();
        // The model numbers leases its own way (the engine's ids restart above the
        // highest one replayed); within one process both only grow.
        match (got, self.model.take_over(id)) {
            (None, None) => {}
            (Some(lease), Some(lease_id)) => {
                let request = self.model.record(id).expect("in flight above").request;
                self.hold(
                    client,
                    Held {
                        lease,
                        id,
                        request,
                        lease_id,
                    },
                );
            }
            (got, expected) => {
                panic!("take over {id:?}: engine {got:?}, model {expected:?}")
            }
        }
    }

    /// A client takes a lease; one that holds too much gives up on its oldest.
    fn hold(&mut self, client: usize, held: Held) {
        let holder = &mut self.clients[client];
        holder.push(held);
        if holder.len() > MAX_HELD {
            drop(holder.remove(0));
        }
    }

    fn reserve(&mut self, client: usize, id: RecordId, request: u8) {
        let got = self
            .db()
            .reserve(&scope(id.0), &[id.1], &[request])
            .unwrap();
        match (got, self.model.reserve(id, request, self.now_ms)) {
            (Reservation::Acquired(lease), Reserve::Acquired(lease_id)) => {
                self.hold(
                    client,
                    Held {
                        lease,
                        id,
                        request,
                        lease_id,
                    },
                );
            }
            (Reservation::Mismatch, Reserve::Mismatch) => {}
            (Reservation::InFlight { since, .. }, Reserve::InFlight { created_ms }) => {
                assert_eq!(
                    since,
                    UNIX_EPOCH + Duration::from_millis(created_ms),
                    "{id:?}"
                );
            }
            (Reservation::Completed(record), Reserve::Completed(response)) => {
                assert_eq!(record.status(), RecordStatus::Completed);
                assert_eq!(record.response(), Some(&response[..]), "{id:?}");
            }
            (Reservation::Failed(record), Reserve::Failed(response)) => {
                assert_eq!(record.status(), RecordStatus::Failed);
                assert_eq!(record.response(), Some(&response[..]), "{id:?}");
            }
            (got, expected) => panic!("reserve {id:?}: engine {got:?}, model {expected:?}"),
        }
    }

    fn end(&mut self, client: usize, slot: usize, ending: Ending) {
        let holder = &mut self.clients[client];
        if holder.is_empty() {
            return;
        }
        let Held {
            lease,
            id,
            lease_id,
            ..
        } = holder.remove(slot % holder.len());
        let (result, ending) = match ending {
            Ending::Complete(response) => {
                (lease.complete(&response), model::Ending::Complete(response))
            }
            Ending::Fail(response) => (lease.fail(&response), model::Ending::Fail(response)),
            Ending::Release => (lease.release(), model::Ending::Release),
            Ending::Abandon => {
                drop(lease);
                return;
            }
        };
        let result = result.map_err(Error::from);
        let expected = self.model.end(id, lease_id, ending, self.now_ms);
        match (expected, &result) {
            (LeaseAnswer::Done, Ok(()))
            | (LeaseAnswer::Fenced, Err(Error::Fenced))
            | (LeaseAnswer::Lost, Err(Error::LeaseLost)) => {}
            (expected, got) => panic!("{id:?}: lease {lease_id} must be {expected:?}, got {got:?}"),
        }
    }

    /// Everything the engine reports agrees with the model.
    fn check(&self) {
        let db = self.db();
        for key in 0..KEYS {
            assert_eq!(
                db.contains(&[key]).unwrap(),
                self.model.key_live(key),
                "contains({key}) at bucket {}",
                self.model.bucket
            );
        }
        for which in [false, true] {
            for key in 0..KEYS {
                let id = (which, key);
                let got = db.get(&scope(which), &[key]).unwrap();
                match (got, self.model.record(id)) {
                    (None, None) => {}
                    (Some(record), Some(model)) => {
                        let (status, response) = match &model.state {
                            State::InFlight { .. } => (RecordStatus::InFlight, None),
                            State::Completed(r) => (RecordStatus::Completed, Some(&r[..])),
                            State::Failed(r) => (RecordStatus::Failed, Some(&r[..])),
                        };
                        assert_eq!(record.status(), status, "{id:?}");
                        assert_eq!(record.response(), response, "{id:?}");
                        assert_eq!(
                            record.created_at(),
                            UNIX_EPOCH + Duration::from_millis(model.created_ms),
                            "{id:?}"
                        );
                        assert_eq!(
                            record.finished_at(),
                            model
                                .finished_ms
                                .map(|ms| UNIX_EPOCH + Duration::from_millis(ms)),
                            "{id:?}"
                        );
                    }
                    (got, expected) => {
                        panic!(
                            "get {id:?} at bucket {}: engine {got:?}, model {expected:?}",
                            self.model.bucket
                        )
                    }
                }
            }
        }
        // At most one client holds a lease that still owns its record.
        let mut owners: HashMap<RecordId, usize> = HashMap::new();
        for held in self.clients.iter().flatten() {
            if self.model.owns(held.id, held.lease_id) {
                *owners.entry(held.id).or_default() += 1;
            }
        }
        assert!(owners.values().all(|&n| n <= 1), "{owners:?}");
        let stats = db.stats();
        assert_eq!(stats.live_keys, self.model.live_keys(), "live keys");
        assert_eq!(
            stats.live_records,
            self.model.live_records(),
            "live records"
        );
    }

    /// A last clean reopen: everything acknowledged is still there.
    fn finish(mut self) {
        self.apply(Step::Reopen);
        self.check();
        self.db = None;
        // Only now may the crashed handles run their drop code.
        self.dead.clear();
    }
}

/// Runs one input: at most `MAX_STEPS` steps, each checked against the model.
pub fn run(data: &[u8]) {
    let mut input = Input(data);
    let mut harness = Harness::new();
    for _ in 0..MAX_STEPS {
        let Some(step) = Step::parse(&mut input) else {
            break;
        };
        harness.apply(step);
        harness.check();
    }
    harness.finish();
}

/// Encodes steps the way `Step::parse` reads them, for hand-written seed inputs.
#[allow(
    dead_code,
    reason = "used to write the seed corpus, not by the fuzz target"
)]
pub mod encode {
    use super::{BUCKET_MS, code};

    pub fn insert(key: u8) -> Vec<u8> {
        vec![key << 4 | code::INSERT]
    }

    pub fn insert_many(keys: &[u8]) -> Vec<u8> {
        let mut out = vec![(keys.len() as u8) << 4 | code::INSERT_MANY];
        out.extend_from_slice(keys);
        out
    }

    /// `scope` is 0 or 1, `request` 0..3.
    pub fn reserve(client: u8, scope: u8, key: u8, request: u8) -> Vec<u8> {
        vec![
            (scope << 3 | client) << 4 | code::RESERVE,
            request * 6 + key,
        ]
    }

    pub fn retry(client: u8, slot: u8) -> Vec<u8> {
        vec![(slot << 2 | client) << 4 | code::RETRY]
    }

    pub fn complete(client: u8, slot: u8, response: &[u8]) -> Vec<u8> {
        finish(code::COMPLETE, client, slot, response)
    }

    pub fn fail(client: u8, slot: u8, response: &[u8]) -> Vec<u8> {
        finish(code::FAIL, client, slot, response)
    }

    fn finish(op: u8, client: u8, slot: u8, response: &[u8]) -> Vec<u8> {
        assert!(response.len() < 9);
        let mut out = vec![client << 4 | op, slot * 9 + response.len() as u8];
        out.extend_from_slice(response);
        out
    }

    pub fn take_over(client: u8, scope: u8, key: u8) -> Vec<u8> {
        vec![(scope << 3 | client) << 4 | code::TAKE_OVER, key]
    }

    pub fn release(client: u8, slot: u8) -> Vec<u8> {
        vec![(slot << 2 | client) << 4 | code::RELEASE]
    }

    pub fn abandon(client: u8, slot: u8) -> Vec<u8> {
        vec![(slot << 2 | client) << 4 | code::ABANDON]
    }

    pub fn advance_ms(ms: u16) -> Vec<u8> {
        assert!(u64::from(ms) < 15 * BUCKET_MS);
        let [low, high] = ms.to_le_bytes();
        vec![7 << 4 | code::ADVANCE, low, high]
    }

    pub fn advance_bucket() -> Vec<u8> {
        vec![3 << 4 | code::ADVANCE]
    }

    pub fn advance_to_edge() -> Vec<u8> {
        vec![2 << 4 | code::ADVANCE]
    }

    pub fn advance_just_before_edge() -> Vec<u8> {
        vec![1 << 4 | code::ADVANCE]
    }

    pub fn advance_window() -> Vec<u8> {
        vec![4 << 4 | code::ADVANCE]
    }

    pub fn advance_past_window() -> Vec<u8> {
        vec![5 << 4 | code::ADVANCE]
    }

    pub fn flush() -> Vec<u8> {
        vec![code::FLUSH]
    }

    pub fn power_loss() -> Vec<u8> {
        vec![code::CRASH]
    }

    pub fn process_crash() -> Vec<u8> {
        vec![1 << 4 | code::CRASH]
    }

    pub fn reopen() -> Vec<u8> {
        vec![code::REOPEN]
    }

    pub fn second_open() -> Vec<u8> {
        vec![code::SECOND_OPEN]
    }
}

/// Inputs for the seed corpus: each names a scenario the fuzzer should start from.
#[allow(
    dead_code,
    reason = "used to write the seed corpus, not by the fuzz target"
)]
pub fn seeds() -> Vec<(String, Vec<u8>)> {
    use encode::*;
    let script = |name: &str, steps: Vec<Vec<u8>>| (name.to_string(), steps.concat());
    let mut seeds = vec![
        script(
            "complete-replay-mismatch",
            vec![
                reserve(0, 0, 0, 0),
                complete(0, 0, b"paid"),
                reserve(1, 0, 0, 0),
                reserve(1, 0, 0, 1),
                reserve(2, 1, 0, 1),
            ],
        ),
        script(
            "fail-replay",
            vec![
                reserve(0, 0, 1, 2),
                fail(0, 0, b"declined"),
                reserve(3, 0, 1, 2),
            ],
        ),
        script(
            "release-then-acquire",
            vec![
                reserve(0, 0, 2, 0),
                reserve(1, 0, 2, 0),
                release(0, 0),
                reserve(1, 0, 2, 1),
                complete(1, 0, b""),
            ],
        ),
        script(
            "interleaved-clients",
            vec![
                reserve(0, 0, 3, 0),
                reserve(1, 0, 3, 0),
                reserve(2, 0, 3, 2),
                reserve(1, 1, 3, 0),
                complete(1, 0, b"other"),
                retry(0, 0),
                complete(0, 0, b"first"),
                retry(1, 0),
                reserve(3, 0, 3, 0),
            ],
        ),
        script(
            "abandoned-until-expiry",
            vec![
                reserve(0, 0, 4, 0),
                abandon(0, 0),
                reserve(1, 0, 4, 0),
                advance_window(),
                reserve(1, 0, 4, 0),
                advance_bucket(),
                reserve(1, 0, 4, 0),
                complete(1, 0, b"late"),
            ],
        ),
        script(
            "take-over-fences-across-crashes",
            vec![
                reserve(0, 0, 5, 1),
                take_over(1, 0, 5),
                complete(0, 0, b"old"),
                take_over(2, 0, 5),
                complete(1, 0, b"mid"),
                power_loss(),
                reserve(3, 0, 5, 1),
                take_over(3, 0, 5),
                complete(3, 0, b"new"),
                take_over(0, 0, 5),
                reserve(0, 0, 5, 1),
            ],
        ),
        script(
            "lease-lost-to-expiry",
            vec![
                reserve(0, 0, 5, 1),
                advance_past_window(),
                reserve(1, 0, 5, 1),
                complete(0, 0, b"lost"),
                complete(1, 0, b"won"),
                reserve(2, 0, 5, 1),
            ],
        ),
        script(
            "window-edges-for-keys",
            vec![
                insert(0),
                advance_just_before_edge(),
                insert(0),
                advance_ms(1),
                insert(1),
                advance_bucket(),
                advance_bucket(),
                advance_bucket(),
                insert(0),
                advance_bucket(),
                insert(0),
                insert(1),
                advance_to_edge(),
                insert(1),
            ],
        ),
        script(
            "window-edges-for-records",
            vec![
                reserve(0, 0, 0, 0),
                complete(0, 0, b"x"),
                advance_window(),
                advance_just_before_edge(),
                reserve(1, 0, 0, 0),
                advance_ms(1),
                reserve(1, 0, 0, 1),
            ],
        ),
        script(
            "batches",
            vec![
                insert_many(&[0, 1, 1, 2]),
                insert_many(&[2, 3]),
                insert_many(&[]),
                advance_past_window(),
                insert_many(&[3, 3, 4, 5]),
            ],
        ),
        script(
            "power-loss-keeps-acknowledged",
            vec![
                insert(0),
                insert_many(&[1, 2]),
                reserve(0, 0, 0, 0),
                complete(0, 0, b"kept"),
                reserve(1, 1, 1, 1),
                reserve(2, 0, 2, 2),
                fail(2, 0, b"no"),
                power_loss(),
                insert(0),
                reserve(3, 0, 0, 0),
                reserve(3, 1, 1, 1),
                reserve(3, 0, 2, 2),
                complete(1, 0, b"dead"),
            ],
        ),
        script(
            "process-crash-keeps-acknowledged",
            vec![
                reserve(0, 0, 3, 0),
                complete(0, 0, b"kept"),
                reserve(1, 0, 4, 0),
                process_crash(),
                reserve(2, 0, 4, 0),
                reserve(2, 0, 3, 0),
                advance_past_window(),
                reserve(2, 0, 4, 0),
            ],
        ),
        script(
            "clean-reopen-kills-leases",
            vec![
                reserve(0, 0, 1, 0),
                insert(4),
                reopen(),
                reserve(1, 0, 1, 0),
                release(0, 0),
                second_open(),
            ],
        ),
        script(
            "crash-across-buckets",
            vec![
                insert(0),
                reserve(0, 0, 0, 0),
                advance_bucket(),
                complete(0, 0, b"later"),
                insert(1),
                advance_bucket(),
                reserve(1, 1, 0, 0),
                release(1, 0),
                power_loss(),
                reserve(2, 1, 0, 0),
                advance_ms(2500),
                power_loss(),
                insert(0),
                insert(1),
                advance_bucket(),
                insert(0),
            ],
        ),
        script(
            "flush-and-second-open",
            vec![
                insert(2),
                flush(),
                second_open(),
                power_loss(),
                second_open(),
                insert(2),
            ],
        ),
    ];
    // Enough log records in one bucket to roll segments over at 4 KiB, then crashes.
    let mut rollover = Vec::new();
    for round in 0..40u8 {
        rollover.push(reserve(round % 4, round % 2, round % 6, round % 3));
        if round % 3 == 0 {
            rollover.push(complete(round % 4, 0, &[round; 8]));
        } else {
            rollover.push(release(round % 4, 0));
        }
        rollover.push(insert_many(&[round % 6, (round + 1) % 6]));
        if round % 13 == 12 {
            rollover.push(power_loss());
            rollover.push(advance_bucket());
        }
    }
    seeds.push(script("segment-rollover-and-crashes", rollover));
    // Pseudo-random step streams.
    for seed in 1..=4u64 {
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let bytes = (0..240)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 24) as u8
            })
            .collect();
        seeds.push((format!("random-{seed}"), bytes));
    }
    seeds
}
