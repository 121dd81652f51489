//! Seeded fault schedules and their checker: what the bad-day tests share (the replica's
//! fault schedule, and the property test of "once" on the same machinery).
//!
//! - [`Schedule`]: the faults and pauses of one run, drawn from a seed that the test prints,
//!   so that a failing run is replayed with `ONCEDB_FAULT_SEED`.
//! - [`History`]: what every writer was told about every key, in the order the test saw
//!   it, and the faults between: a writer reports each answer as it gets it.
//! - [`History::check`]: the promises, held against the history and against what the
//!   store that owns the data at the end remembers.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use oncedb::io::SplitMix64;
use parking_lot::{Condvar, Mutex};

/// The environment variable that fixes the random seed of a fault test.
pub const SEED_VARIABLE: &str = "ONCEDB_FAULT_SEED";

/// The environment variable that sets how long each schedule of a fault test runs, in
/// seconds.
pub const SECONDS_VARIABLE: &str = "ONCEDB_FAULT_SECONDS";

/// The random seed of a run: [`SEED_VARIABLE`] if set, else one drawn from the clock and
/// the process id. The caller prints it.
pub fn random_seed() -> u64 {
    if let Some(seed) = std::env::var(SEED_VARIABLE)
        .ok()
        .and_then(|text| text.parse().ok())
    {
        return seed;
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_nanos());
    let folded = now.to_le_bytes();
    let (low, high) = folded.split_at(8);
    let word = |half: &[u8]| u64::from_le_bytes(half.try_into().unwrap_or([0; 8]));
    SplitMix64::new(word(low) ^ word(high) ^ u64::from(std::process::id())).next_u64()
}

/// How long each schedule runs: [`SECONDS_VARIABLE`] if set, else `default`.
pub fn duration_or(default: Duration) -> Duration {
    std::env::var(SECONDS_VARIABLE)
        .ok()
        .and_then(|text| text.parse().ok())
        .map_or(default, Duration::from_secs)
}

/// The seeded choices of one run.
pub struct Schedule {
    seed: u64,
    rng: SplitMix64,
}

impl Schedule {
    /// A schedule drawn from `seed`.
    pub fn new(seed: u64) -> Schedule {
        Schedule {
            seed,
            rng: SplitMix64::new(seed),
        }
    }

    /// The seed it was drawn from.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// A number in `0..n` (0 if `n` is 0).
    pub fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.rng.below(n) }
    }

    /// One of `choices`; `None` if there are none.
    pub fn pick<T: Copy>(&mut self, choices: &[T]) -> Option<T> {
        let index = usize::try_from(self.below(choices.len() as u64)).unwrap_or(0);
        choices.get(index).copied()
    }

    /// A number in `range`.
    pub fn within(&mut self, range: std::ops::Range<u64>) -> u64 {
        range.start + self.below(range.end.saturating_sub(range.start))
    }
}

/// What a writer was told about one call on a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Told {
    /// The key was admitted: this writer's call is the one that counts.
    Admitted,
    /// The key was seen already.
    Seen,
    /// The outcome is unknown (`Unavailable`): the caller may not count it either way.
    Unknown,
    /// The store refused the call and changed nothing it acknowledged (`NotOwner`).
    Refused,
}

impl Told {
    /// The one-letter form a child process reports: `A`, `S`, `U`, `F` (and [`ASKED`]
    /// for a call made).
    pub fn letter(self) -> char {
        match self {
            Told::Admitted => 'A',
            Told::Seen => 'S',
            Told::Unknown => 'U',
            Told::Refused => 'F',
        }
    }

    /// The answer a letter stands for.
    pub fn from_letter(letter: char) -> Option<Told> {
        match letter {
            'A' => Some(Told::Admitted),
            'S' => Some(Told::Seen),
            'U' => Some(Told::Unknown),
            'F' => Some(Told::Refused),
            _ => None,
        }
    }
}

/// The letter a child process reports a call with, before its answer.
pub const ASKED: char = 'Q';

#[derive(Debug, Clone)]
enum Event {
    Asked { writer: u32, key: u64 },
    Told { writer: u32, key: u64, told: Told },
    Fault { what: String },
    Ended { writer: u32, what: String },
}

/// What every writer was told, and the faults between, in the order the test saw them.
#[derive(Default)]
pub struct History {
    events: Mutex<Vec<Event>>,
    answered: Condvar,
}

impl History {
    /// An empty history.
    pub fn new() -> History {
        History::default()
    }

    /// Writer `writer` was told `told` about `key`.
    pub fn told(&self, writer: u32, key: u64, told: Told) {
        self.events.lock().push(Event::Told { writer, key, told });
        self.answered.notify_all();
    }

    /// Writer `writer` calls the store about `key` (its answer follows, unless it ends
    /// first).
    pub fn asked(&self, writer: u32, key: u64) {
        self.events.lock().push(Event::Asked { writer, key });
    }

    /// A fault was injected that ends no writer (a node paused or killed).
    pub fn fault(&self, what: impl Into<String>) {
        self.events.lock().push(Event::Fault { what: what.into() });
    }

    /// Writer `writer` ended (SIGKILLed, or fenced by a restore). A call it had made and
    /// not been answered definitely (no answer, or an unknown outcome) may have reached
    /// the store: its key may be found although no writer was told it was admitted
    /// (`docs/guarantees.md`, "What an answer rests on").
    pub fn ended(&self, writer: u32, what: impl Into<String>) {
        self.events.lock().push(Event::Ended {
            writer,
            what: what.into(),
        });
    }

    /// How many answers were reported so far.
    pub fn answers(&self) -> usize {
        self.events
            .lock()
            .iter()
            .filter(|event| matches!(event, Event::Told { .. }))
            .count()
    }

    /// Waits until `count` more answers than `since` were reported, at most `limit`;
    /// whether they were.
    pub fn wait_for_answers(&self, since: usize, count: usize, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        let mut events = self.events.lock();
        loop {
            let answers = events
                .iter()
                .filter(|event| matches!(event, Event::Told { .. }))
                .count();
            if answers >= since + count {
                return true;
            }
            if self.answered.wait_until(&mut events, deadline).timed_out() {
                return false;
            }
        }
    }

    /// The highest key any writer was told about, plus one.
    pub fn keys_below(&self) -> u64 {
        self.events
            .lock()
            .iter()
            .filter_map(|event| match event {
                Event::Told { key, .. } | Event::Asked { key, .. } => Some(key + 1),
                Event::Fault { .. } | Event::Ended { .. } => None,
            })
            .max()
            .unwrap_or(0)
    }

    /// Checks the promises against the history and `remembered`, the answer of the store
    /// that owns the data at the end (whether it holds a key):
    /// - every key a writer was told was admitted is remembered;
    /// - no key is admitted twice (two writers told "admitted", the window not passed);
    /// - no key is answered "seen" unless some writer was told it was admitted, except a
    ///   key a writer that ended had called about without a definite answer (a failed
    ///   write is never turned into "seen" while its writer lives on).
    pub fn check(&self, remembered: impl Fn(u64) -> bool) -> Report {
        let events = self.events.lock().clone();
        let mut keys: BTreeMap<u64, KeyState> = BTreeMap::new();
        let mut report = Report::default();
        for event in &events {
            match event {
                Event::Fault { .. } => report.faults += 1,
                Event::Ended { writer, .. } => {
                    report.faults += 1;
                    for state in keys.values_mut() {
                        state.excused |= state.open.remove(writer);
                    }
                }
                Event::Asked { writer, key } => {
                    keys.entry(*key).or_default().open.insert(*writer);
                }
                Event::Told { writer, key, told } => {
                    let state = keys.entry(*key).or_default();
                    report.count(*told);
                    state.answer(*writer, *key, *told, &mut report.shortfalls);
                }
            }
        }
        for (&key, state) in &keys {
            report.keys += 1;
            if state.admitted_by.is_some() && !remembered(key) {
                report.shortfalls.push(format!(
                    "key {key} was admitted to writer {} and the final owner lost it",
                    state.admitted_by.unwrap_or_default()
                ));
            }
        }
        report.fault_list = events
            .iter()
            .filter_map(|event| match event {
                Event::Fault { what } | Event::Ended { what, .. } => Some(what.clone()),
                Event::Told { .. } | Event::Asked { .. } => None,
            })
            .collect();
        report
    }
}

#[derive(Debug, Default)]
struct KeyState {
    admitted_by: Option<u32>,
    /// The writers with a call about it not answered definitely yet (no answer, or an
    /// unknown outcome).
    open: std::collections::BTreeSet<u32>,
    /// A writer ended with such a call open: the key may be found with no writer told.
    excused: bool,
}

impl KeyState {
    fn answer(&mut self, writer: u32, key: u64, told: Told, shortfalls: &mut Vec<String>) {
        if matches!(told, Told::Admitted | Told::Seen) {
            self.open.remove(&writer);
        } else {
            self.open.insert(writer);
        }
        match told {
            Told::Admitted => {
                if let Some(first) = self.admitted_by {
                    shortfalls.push(format!(
                        "key {key} was admitted twice: to writer {first}, then to writer {writer}"
                    ));
                }
                self.admitted_by = Some(writer);
            }
            Told::Seen if self.admitted_by.is_none() && !self.excused => {
                shortfalls.push(format!(
                    "key {key} was answered seen to writer {writer}, but no writer was told it \
                     was admitted and no writer ended with a call about it open"
                ));
            }
            Told::Seen | Told::Unknown | Told::Refused => {}
        }
    }
}

/// What a check found.
#[derive(Debug, Default)]
pub struct Report {
    /// Distinct keys checked.
    pub keys: u64,
    /// Answers "admitted".
    pub admitted: u64,
    /// Answers "seen".
    pub seen: u64,
    /// Answers of unknown outcome.
    pub unknown: u64,
    /// Answers refused (fenced).
    pub refused: u64,
    /// Faults injected.
    pub faults: u64,
    /// What they were, in order.
    pub fault_list: Vec<String>,
    /// Every broken promise, one line each.
    pub shortfalls: Vec<String>,
}

impl Report {
    fn count(&mut self, told: Told) {
        match told {
            Told::Admitted => self.admitted += 1,
            Told::Seen => self.seen += 1,
            Told::Unknown => self.unknown += 1,
            Told::Refused => self.refused += 1,
        }
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} faults, {} keys checked ({} admitted, {} seen, {} unknown, {} refused), {} shortfalls",
            self.faults,
            self.keys,
            self.admitted,
            self.seen,
            self.unknown,
            self.refused,
            self.shortfalls.len()
        )
    }
}

/// What the callers of a property test of "once" did and were told, per key: every side
/// effect an operation made, whether its lease was reported lost to it while it ran,
/// and every caller's answer.
#[derive(Debug, Default)]
pub struct Effects {
    inner: Mutex<EffectsSeen>,
}

#[derive(Debug, Default)]
struct EffectsSeen {
    /// Per key, the callers whose operation made its side effect.
    acts: BTreeMap<u64, Vec<u64>>,
    /// Callers whose operation was told its lease was lost.
    told_lost: std::collections::BTreeSet<u64>,
    /// Per caller: its key and its answer, once it has one.
    callers: BTreeMap<u64, (u64, Option<String>)>,
    faults: Vec<String>,
}

/// What a caller of a property test of "once" was answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// An answer of the store: ran, replayed, errored, or a typed error.
    Typed,
    /// The caller's future was dropped (a cancellation the schedule drew).
    Cancelled,
    /// The caller's operation panicked (the schedule drew it).
    Panicked,
    /// Anything else: the call hung, or failed with an untyped error.
    Untyped,
}

impl Effects {
    /// An empty record of a run.
    pub fn new() -> Effects {
        Effects::default()
    }

    /// Caller `caller` calls about `key`.
    pub fn called(&self, caller: u64, key: u64) {
        self.inner.lock().callers.insert(caller, (key, None));
    }

    /// `caller`'s operation made its side effect for `key`.
    pub fn acted(&self, caller: u64, key: u64) {
        self.inner.lock().acts.entry(key).or_default().push(caller);
    }

    /// `caller`'s operation was told its lease was lost.
    pub fn told_lost(&self, caller: u64) {
        self.inner.lock().told_lost.insert(caller);
    }

    /// `caller` got `answer`, described as `what`.
    pub fn answered(&self, caller: u64, answer: Answer, what: &str) {
        let mut seen = self.inner.lock();
        if let Some(entry) = seen.callers.get_mut(&caller) {
            entry.1 = Some(match answer {
                Answer::Untyped => format!("untyped: {what}"),
                _ => what.to_owned(),
            });
        }
    }

    /// A fault the schedule injected.
    pub fn fault(&self, what: impl Into<String>) {
        self.inner.lock().faults.push(what.into());
    }

    /// The promises of "once", held against what was recorded and against `stuck`: the
    /// keys the store still holds in flight, unnoted, a lease timeout after every
    /// caller ended.
    /// - every side effect beyond a key's first is excused only by an operation (the
    ///   first's, or its own) that was told its lease was lost;
    /// - every caller got an answer of the store or a typed error (or was cancelled,
    ///   or panicked, as the schedule drew);
    /// - no key stays in flight past its lease timeout unless it is noted.
    pub fn check(&self, stuck: &[u64]) -> Report {
        let seen = self.inner.lock();
        let mut report = Report {
            faults: seen.faults.len() as u64,
            fault_list: seen.faults.clone(),
            ..Report::default()
        };
        for (key, callers) in &seen.acts {
            report.keys += 1;
            report.admitted += 1;
            let told = callers
                .iter()
                .filter(|c| seen.told_lost.contains(c))
                .count();
            if callers.len() > 1 + told {
                let answers: Vec<String> = callers
                    .iter()
                    .map(|c| {
                        let answer = seen.callers.get(c).and_then(|(_, a)| a.clone());
                        format!("{c}: {}", answer.unwrap_or_else(|| "no answer".to_owned()))
                    })
                    .collect();
                report.shortfalls.push(format!(
                    "key {key}: its side effect made {} times (callers {callers:?}), only {told} \
                     of them told their lease was lost ({})",
                    callers.len(),
                    answers.join("; ")
                ));
            }
        }
        for (caller, (key, answer)) in &seen.callers {
            match answer {
                None => report
                    .shortfalls
                    .push(format!("caller {caller} (key {key}) got no answer")),
                Some(what) if what.starts_with("untyped") => report
                    .shortfalls
                    .push(format!("caller {caller} (key {key}) got {what}")),
                Some(_) => report.seen += 1,
            }
        }
        for key in stuck {
            report.shortfalls.push(format!(
                "key {key} stays in flight past its lease timeout without a note"
            ));
        }
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_checker_finds_each_broken_promise() {
        let history = History::new();
        history.told(0, 1, Told::Admitted);
        history.told(0, 2, Told::Unknown);
        history.told(0, 2, Told::Seen); // a failed write turned into "seen"
        history.told(1, 3, Told::Admitted);
        history.told(1, 3, Told::Admitted); // admitted twice
        history.told(0, 4, Told::Unknown);
        history.asked(1, 5);
        history.fault("node paused"); // ends no writer: no excuse
        history.told(1, 4, Told::Seen); // writer 0 lives: a failed write turned into "seen"
        history.ended(0, "writer 0 killed");
        history.told(1, 4, Told::Seen); // excused: writer 0 ended with its call open
        history.ended(1, "writer 1 killed");
        history.told(2, 5, Told::Seen); // excused: writer 1 ended before its answer
        let report = history.check(|key| key != 1); // key 1 lost
        let found = |key: &str, what: &str| {
            report
                .shortfalls
                .iter()
                .any(|line| line.contains(key) && line.contains(what))
        };
        assert_eq!(report.shortfalls.len(), 4, "{:?}", report.shortfalls);
        assert!(found("key 1 ", "lost"));
        assert!(found("key 2 ", "answered seen"));
        assert!(found("key 3 ", "twice"));
        assert!(found("key 4 ", "answered seen"));
        assert_eq!(report.faults, 3);
        assert_eq!(history.keys_below(), 6);
    }

    #[test]
    fn the_once_checker_finds_each_broken_promise() {
        let effects = Effects::new();
        for caller in 0..6 {
            effects.called(caller, caller / 2);
        }
        effects.acted(0, 0);
        effects.acted(1, 0); // twice, nobody told
        effects.acted(2, 1);
        effects.told_lost(2);
        effects.acted(3, 1); // twice, the first told: excused
        effects.answered(0, Answer::Typed, "ran");
        effects.answered(1, Answer::Typed, "ran");
        effects.answered(2, Answer::Typed, "fenced");
        effects.answered(3, Answer::Typed, "ran");
        effects.answered(4, Answer::Untyped, "hung");
        // Caller 5 got nothing.
        let report = effects.check(&[2]);
        let found = |what: &str| report.shortfalls.iter().any(|line| line.contains(what));
        assert_eq!(report.shortfalls.len(), 4, "{:?}", report.shortfalls);
        assert!(found("key 0: its side effect made 2 times"));
        assert!(found("caller 4 (key 2) got untyped: hung"));
        assert!(found("caller 5 (key 2) got no answer"));
        assert!(found("key 2 stays in flight"));
    }

    #[test]
    fn a_schedule_is_its_seed() {
        let draw = |seed| {
            let mut schedule = Schedule::new(seed);
            (0..16).map(|_| schedule.within(10..20)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        assert!(draw(9).iter().all(|n| (10..20).contains(n)));
    }
}
