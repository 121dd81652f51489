//! Many threads racing every lifecycle call on a handful of keys while one of them moves
//! the clock across bucket and window edges. Each call is recorded with the logical time
//! and clock bucket before and after it; a checker then verifies the history against the
//! semantics: one live lease per key, replays carry the winning lease's exact bytes,
//! mismatches only for other requests, one admission per key and window incarnation.
//! Operation counts are bounded and nothing sleeps or measures time.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Barrier, Mutex};
use std::time::{Duration, UNIX_EPOCH};

use oncedb::io::SplitMix64;
use oncedb::{Db, Error, ManualClock, Options, RecordStatus, Reservation, Scope};

const THREADS: usize = 8;
const KEYS: u8 = 8;
const OPS_PER_THREAD: usize = 6_000;
const BUCKET_MS: u64 = 1_000;
/// Buckets in the window: an entry admitted in bucket b lives through bucket b + SPAN.
const SPAN: u64 = 4;
/// The clock thread moves time after this many of its own operations.
const ADVANCE_EVERY: usize = 6;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FinishKind {
    Complete,
    Fail,
    Release,
}

#[derive(Debug, Clone)]
enum Outcome {
    /// `insert_if_absent` or one answer of `insert_many`.
    Admitted(bool),
    Acquired {
        token: u64,
    },
    InFlight,
    Completed(Vec<u8>),
    Failed(Vec<u8>),
    Mismatch,
    /// A lease ended: `lost` if the engine answered `LeaseLost`.
    Finished {
        token: u64,
        kind: FinishKind,
        response: Vec<u8>,
        lost: bool,
    },
    /// An acquisition found other leases of the key still held by their threads.
    Overlap {
        token: u64,
        others: Vec<u64>,
    },
}

/// One call: logical times and clock buckets taken just before and just after it.
#[derive(Debug, Clone)]
struct Event {
    key: u8,
    request: u8,
    start: u64,
    end: u64,
    bucket_before: u64,
    bucket_after: u64,
    outcome: Outcome,
}

/// What the threads share.
struct World {
    db: Db,
    clock: ManualClock,
    scope: Scope,
    /// Logical time: every call takes a tick before and after.
    ticks: AtomicU64,
    /// Leases held per key: incremented right after `Acquired`, decremented right before
    /// the lease is completed, failed or released.
    holders: Vec<AtomicUsize>,
    /// The tokens of those leases, each with the tick its acquisition returned at.
    holder_tokens: Vec<Mutex<Vec<(u64, u64)>>>,
    max_holders: AtomicUsize,
}

impl World {
    fn bucket(&self) -> u64 {
        self.clock
            .now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_millis() as u64
            / BUCKET_MS
    }

    /// Runs `call`, stamping its event with ticks and buckets around it.
    fn record<T>(&self, key: u8, request: u8, call: impl FnOnce() -> T) -> (T, Event) {
        let bucket_before = self.bucket();
        let start = self.ticks.fetch_add(1, Ordering::SeqCst);
        let result = call();
        let end = self.ticks.fetch_add(1, Ordering::SeqCst);
        let bucket_after = self.bucket();
        let event = Event {
            key,
            request,
            start,
            end,
            bucket_before,
            bucket_after,
            outcome: Outcome::Admitted(false),
        };
        (result, event)
    }
}

struct Held {
    lease: oncedb::Lease,
    key: u8,
    request: u8,
    token: u64,
}

/// Leases one thread may hold at once.
const MAX_HELD: usize = 2;

fn worker(world: &World, thread: usize) -> Vec<Event> {
    let mut rng = SplitMix64::new(thread as u64 + 1);
    let mut events = Vec::new();
    let mut held: Vec<Held> = Vec::new();
    let mut serial = 0u64;
    for op in 0..OPS_PER_THREAD {
        if thread == 0 && op % ADVANCE_EVERY == ADVANCE_EVERY - 1 {
            advance_clock(world, &mut rng);
        }
        let key = rng.below(u64::from(KEYS)) as u8;
        // Most retries repeat the first request of a key; some send another one.
        let request = u8::from(rng.below(5) == 0);
        match rng.below(10) {
            0..=3 if held.len() < MAX_HELD => {
                // A holder sometimes retries its own key before finishing it.
                let (key, request) = match held.first() {
                    Some(h) if rng.below(3) == 0 => (h.key, h.request),
                    _ => (key, request),
                };
                serial += 1;
                let token = (thread as u64) << 32 | serial;
                if let Some(h) = reserve(world, key, request, token, &mut events) {
                    held.push(h);
                }
            }
            0..=6 => {
                if !held.is_empty() {
                    let h = held.swap_remove(rng.below(held.len() as u64) as usize);
                    let kind = match rng.below(6) {
                        0..=2 => FinishKind::Complete,
                        3..=4 => FinishKind::Fail,
                        _ => FinishKind::Release,
                    };
                    finish(world, h, kind, rng.below(7) as usize, &mut events);
                }
            }
            7..=8 => {
                let (admitted, mut event) =
                    world.record(key, 0, || world.db.insert_if_absent(&[key]).unwrap());
                event.outcome = Outcome::Admitted(admitted);
                events.push(event);
            }
            _ => {
                let batch = [[key], [(key + 1) % KEYS], [key]];
                let (admitted, event) =
                    world.record(key, 0, || world.db.insert_many(&batch).unwrap());
                for (&[key], admitted) in batch.iter().zip(admitted) {
                    events.push(Event {
                        key,
                        outcome: Outcome::Admitted(admitted),
                        ..event.clone()
                    });
                }
            }
        }
    }
    for h in held {
        finish(world, h, FinishKind::Complete, 0, &mut events);
    }
    events
}

fn advance_clock(world: &World, rng: &mut SplitMix64) {
    let now = world
        .clock
        .now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_millis() as u64;
    let to_edge = BUCKET_MS - now % BUCKET_MS;
    let by = match rng.below(8) {
        0 => 1,
        1 => to_edge - 1,
        2 | 3 => to_edge,
        4 => BUCKET_MS,
        5 => SPAN * BUCKET_MS,
        6 => (SPAN + 1) * BUCKET_MS,
        _ => rng.below(3 * BUCKET_MS),
    };
    world.clock.forward(Duration::from_millis(by));
}

/// Reserves `key`; returns the lease, named `token`, if acquired.
fn reserve(
    world: &World,
    key: u8,
    request: u8,
    token: u64,
    events: &mut Vec<Event>,
) -> Option<Held> {
    let (reservation, mut event) = world.record(key, request, || {
        world.db.reserve(&world.scope, &[key], &[request]).unwrap()
    });
    let mut held = None;
    event.outcome = match reservation {
        Reservation::Acquired(lease) => {
            let before = world.holders[key as usize].fetch_add(1, Ordering::SeqCst);
            world.max_holders.fetch_max(before + 1, Ordering::SeqCst);
            let mut tokens = world.holder_tokens[key as usize].lock().unwrap();
            // Only holders whose acquisition returned before this call started are
            // certainly earlier. One that was acquired while this call ran may have come
            // after it in the store (this record expired under a clock jump and was
            // acquired again), only to be registered here first.
            let earlier: Vec<u64> = tokens
                .iter()
                .filter(|&&(_, acquired_end)| acquired_end < event.start)
                .map(|&(other, _)| other)
                .collect();
            if !earlier.is_empty() {
                events.push(Event {
                    outcome: Outcome::Overlap {
                        token,
                        others: earlier,
                    },
                    ..event.clone()
                });
            }
            tokens.push((token, event.end));
            drop(tokens);
            held = Some(Held {
                lease,
                key,
                request,
                token,
            });
            Outcome::Acquired { token }
        }
        Reservation::InFlight { .. } => Outcome::InFlight,
        Reservation::Expired(_) => panic!("no response retention: nothing ages out"),
        Reservation::Completed(record) => {
            assert_eq!(record.status(), RecordStatus::Completed);
            assert!(record.finished_at().unwrap() >= record.created_at());
            Outcome::Completed(record.response().unwrap().to_vec())
        }
        Reservation::Failed(record) => {
            assert_eq!(record.status(), RecordStatus::Failed);
            assert!(record.finished_at().unwrap() >= record.created_at());
            Outcome::Failed(record.response().unwrap().to_vec())
        }
        Reservation::Mismatch => Outcome::Mismatch,
    };
    events.push(event);
    held
}

fn finish(world: &World, held: Held, kind: FinishKind, padding: usize, events: &mut Vec<Event>) {
    let Held {
        lease,
        key,
        request,
        token,
    } = held;
    // Unique per lease, so a replay names the lease that stored it.
    let mut response = format!("{token:x}:{kind:?}").into_bytes();
    response.resize(response.len() + padding, b'.');
    {
        let mut tokens = world.holder_tokens[key as usize].lock().unwrap();
        tokens.retain(|&(t, _)| t != token);
    }
    world.holders[key as usize].fetch_sub(1, Ordering::SeqCst);
    let (result, mut event) = world.record(key, request, || {
        match kind {
            FinishKind::Complete => lease.complete(&response),
            FinishKind::Fail => lease.fail(&response),
            FinishKind::Release => lease.release(),
        }
        .map_err(Error::from)
    });
    let lost = match result {
        Ok(()) => false,
        Err(Error::LeaseLost) => true,
        Err(other) => panic!("finishing lease {token:x}: {other}"),
    };
    if kind == FinishKind::Release {
        response.clear();
    }
    event.outcome = Outcome::Finished {
        token,
        kind,
        response,
        lost,
    };
    events.push(event);
}

/// The history, indexed for the checks.
struct History<'a> {
    events: &'a [Event],
    /// Acquisitions by token.
    acquired: HashMap<u64, &'a Event>,
    /// Lease endings by token.
    finished: HashMap<u64, &'a Event>,
    /// Stored responses (complete or fail) by their bytes.
    stored: HashMap<&'a [u8], &'a Event>,
}

impl<'a> History<'a> {
    fn new(events: &'a [Event]) -> Self {
        let mut history = History {
            events,
            acquired: HashMap::new(),
            finished: HashMap::new(),
            stored: HashMap::new(),
        };
        for event in events {
            match &event.outcome {
                Outcome::Acquired { token } => {
                    assert!(history.acquired.insert(*token, event).is_none());
                }
                Outcome::Finished {
                    token,
                    kind,
                    response,
                    lost,
                } => {
                    assert!(history.finished.insert(*token, event).is_none());
                    if !lost && *kind != FinishKind::Release {
                        assert!(history.stored.insert(response, event).is_none());
                    }
                }
                _ => {}
            }
        }
        history
    }

    fn acquisition(&self, token: u64) -> &'a Event {
        self.acquired[&token]
    }

    /// Whether the record of acquisition `acq` may still have been live during `event`:
    /// it was acquired before `event` ended, was not released before `event` started,
    /// and had not left the window.
    fn may_be_live_during(&self, acq: &Event, token: u64, event: &Event) -> bool {
        let released_before = self.finished.get(&token).is_some_and(|f| {
            matches!(
                f.outcome,
                Outcome::Finished {
                    kind: FinishKind::Release,
                    lost: false,
                    ..
                }
            ) && f.end < event.start
        });
        acq.start < event.end && !released_before && event.bucket_before <= acq.bucket_after + SPAN
    }

    fn acquisitions_of(&self, key: u8) -> impl Iterator<Item = (u64, &'a Event)> + '_ {
        self.acquired
            .iter()
            .filter(move |(_, e)| e.key == key)
            .map(|(&t, &e)| (t, e))
    }

    fn check(&self) {
        for event in self.events {
            match &event.outcome {
                Outcome::Acquired { token } => self.check_acquired(*token, event),
                Outcome::Finished {
                    token, kind, lost, ..
                } => self.check_finished(*token, *kind, *lost, event),
                Outcome::Completed(bytes) => self.check_replay(bytes, FinishKind::Complete, event),
                Outcome::Failed(bytes) => self.check_replay(bytes, FinishKind::Fail, event),
                Outcome::Mismatch => {
                    let justified = self.acquisitions_of(event.key).any(|(token, acq)| {
                        acq.request != event.request && self.may_be_live_during(acq, token, event)
                    });
                    assert!(
                        justified,
                        "mismatch with no live record of another request: {event:?}"
                    );
                }
                Outcome::InFlight => {
                    let justified = self.acquisitions_of(event.key).any(|(token, acq)| {
                        acq.request == event.request
                            && self.may_be_live_during(acq, token, event)
                            && self.finished.get(&token).is_none_or(|f| {
                                f.end > event.start
                                    || matches!(f.outcome, Outcome::Finished { lost: true, .. })
                            })
                    });
                    assert!(
                        justified,
                        "in flight with no live lease of this request: {event:?}"
                    );
                }
                Outcome::Overlap { token, others } => {
                    // Two holders of one key: every earlier one must have lost its record
                    // to expiry, which its finish reports.
                    for other in others {
                        let finish = self.finished[other];
                        assert!(
                            matches!(finish.outcome, Outcome::Finished { lost: true, .. }),
                            "lease {token:x} acquired while lease {other:x} was live: {event:?} / {finish:?}"
                        );
                    }
                }
                Outcome::Admitted(_) => {}
            }
        }
        self.check_admissions();
    }

    /// A new lease only when every earlier record of the key was released or expired.
    fn check_acquired(&self, token: u64, event: &Event) {
        for (other, earlier) in self.acquisitions_of(event.key) {
            if other == token || earlier.end > event.start {
                continue;
            }
            let released = self.finished.get(&other).is_some_and(|f| {
                matches!(
                    f.outcome,
                    Outcome::Finished {
                        kind: FinishKind::Release,
                        lost: false,
                        ..
                    }
                ) && f.start < event.end
            });
            let expired = event.bucket_after > earlier.bucket_before + SPAN;
            assert!(
                released || expired,
                "lease {token:x} granted while the record of lease {other:x} was live: {event:?} after {earlier:?}"
            );
        }
    }

    /// A lease is lost only after its record left the window, and kept until then.
    fn check_finished(&self, token: u64, _kind: FinishKind, lost: bool, event: &Event) {
        let acq = self.acquisition(token);
        if lost {
            assert!(
                event.bucket_after > acq.bucket_before + SPAN,
                "lease {token:x} lost before its window ended: {acq:?} -> {event:?}"
            );
        } else {
            assert!(
                event.bucket_before <= acq.bucket_after + SPAN,
                "lease {token:x} finished after its record left the window: {acq:?} -> {event:?}"
            );
        }
    }

    /// A replay carries exactly what the one lease of that incarnation stored, for the
    /// same key and request, while that record is inside the window.
    fn check_replay(&self, bytes: &[u8], kind: FinishKind, event: &Event) {
        let Some(stored) = self.stored.get(bytes) else {
            panic!(
                "replayed bytes {:?} were never stored by a lease: {event:?}",
                String::from_utf8_lossy(bytes)
            );
        };
        let Outcome::Finished {
            token,
            kind: stored_kind,
            ..
        } = stored.outcome
        else {
            unreachable!("only finishes are indexed");
        };
        let acq = self.acquisition(token);
        assert_eq!(stored_kind, kind, "replayed as the wrong status: {event:?}");
        assert_eq!(
            stored.key, event.key,
            "replayed another key's response: {event:?}"
        );
        assert_eq!(
            acq.request, event.request,
            "replayed to another request instead of Mismatch: {event:?}"
        );
        assert!(stored.start < event.end, "replayed before it was stored");
        assert!(
            event.bucket_before <= acq.bucket_after + SPAN,
            "replayed after the record left the window: {acq:?} -> {event:?}"
        );
    }

    /// Each key is admitted at most once per window incarnation, and duplicates only
    /// while an admission is inside the window.
    fn check_admissions(&self) {
        for key in 0..KEYS {
            let admitted: Vec<&Event> = self
                .events
                .iter()
                .filter(|e| e.key == key && matches!(e.outcome, Outcome::Admitted(true)))
                .collect();
            for (i, a) in admitted.iter().enumerate() {
                for b in &admitted[i + 1..] {
                    let apart = b.bucket_after > a.bucket_before + SPAN
                        || a.bucket_after > b.bucket_before + SPAN;
                    assert!(
                        apart,
                        "key {key} admitted twice in one window: {a:?} / {b:?}"
                    );
                }
            }
            for dup in self
                .events
                .iter()
                .filter(|e| e.key == key && matches!(e.outcome, Outcome::Admitted(false)))
            {
                let justified = admitted
                    .iter()
                    .any(|a| a.start < dup.end && dup.bucket_before <= a.bucket_after + SPAN);
                assert!(
                    justified,
                    "key {key} reported duplicate with no live admission: {dup:?}"
                );
            }
        }
    }
}

#[test]
fn racing_lifecycles_keep_every_invariant() {
    let start = UNIX_EPOCH + Duration::from_millis(1_700_000_000_000);
    let clock = ManualClock::new(start);
    let db = Db::open(
        Options::in_memory()
            .window(Duration::from_millis(SPAN * BUCKET_MS))
            .bucket_width(Duration::from_millis(BUCKET_MS))
            .shards(2)
            .clock(clock.clone()),
    )
    .unwrap();
    let world = World {
        db,
        clock,
        scope: Scope::new("tenant", "charge"),
        ticks: AtomicU64::new(0),
        holders: (0..KEYS).map(|_| AtomicUsize::new(0)).collect(),
        holder_tokens: (0..KEYS).map(|_| Mutex::new(Vec::new())).collect(),
        max_holders: AtomicUsize::new(0),
    };
    let barrier = Barrier::new(THREADS);
    let events: Vec<Event> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..THREADS)
            .map(|thread| {
                let (world, barrier) = (&world, &barrier);
                s.spawn(move || {
                    barrier.wait();
                    worker(world, thread)
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });

    let history = History::new(&events);
    history.check();

    let count = |f: fn(&Outcome) -> bool| events.iter().filter(|e| f(&e.outcome)).count();
    let acquired = count(|o| matches!(o, Outcome::Acquired { .. }));
    let replays = count(|o| matches!(o, Outcome::Completed(_) | Outcome::Failed(_)));
    let lost = count(|o| matches!(o, Outcome::Finished { lost: true, .. }));
    let admitted = count(|o| matches!(o, Outcome::Admitted(true)));
    let buckets =
        world.bucket() - start.duration_since(UNIX_EPOCH).unwrap().as_millis() as u64 / BUCKET_MS;
    eprintln!(
        "{} events: {acquired} leases ({lost} lost to expiry), {replays} replays, {} mismatches, \
         {admitted} admissions over {buckets} buckets, max holders {}",
        events.len(),
        count(|o| matches!(o, Outcome::Mismatch)),
        world.max_holders.load(Ordering::SeqCst),
    );
    // The run must have exercised what it checks.
    assert!(
        acquired > 100 && replays > 100 && admitted > 50,
        "too little happened"
    );
    assert!(buckets > 3 * SPAN, "the clock must cross several windows");
    assert_eq!(
        world
            .holders
            .iter()
            .map(|h| h.load(Ordering::SeqCst))
            .sum::<usize>(),
        0
    );
    let stats = world.db.stats();
    assert_eq!(stats.acquired, acquired as u64);
    assert_eq!(stats.admitted, admitted as u64);
    assert_eq!(stats.leases_lost, lost as u64);
}
