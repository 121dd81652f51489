//! The property test of "once": seeded schedules of callers of `run_once` on one store,
//! with renewal failures injected by a store wrapper ([`Flaky`]), operations that outlive
//! the lease timeout, cancellations and panics. The checker
//! (`oncedb_testkit::schedule::Effects`) holds the promises: a side effect made twice only
//! where an operation was told its lease was lost; every caller answered or given a typed
//! error; no key in flight past its lease timeout without a note.

use std::sync::Arc;
use std::time::{Duration, Instant};

use oncedb::{
    Advance, Error, InFlight, LeaseWatch, OnError, Once, Record, Reservation, RunOnce, Scope,
    Store, StoreLease,
};
use oncedb_testkit::schedule::{Answer, Effects, Report, Schedule};
use std::sync::Mutex;

/// Renewals refused (`Unavailable`) until a deadline the schedule sets: a lock wait, a
/// pool wait, an unreachable server.
#[derive(Debug, Default)]
pub struct Faults {
    renewals_fail_until: Mutex<Option<Instant>>,
}

impl Faults {
    fn fail_renewals_for(&self, outage: Duration) {
        *self.renewals_fail_until.lock().unwrap() = Some(Instant::now() + outage);
    }

    fn renewal_refused(&self) -> bool {
        self.renewals_fail_until
            .lock()
            .unwrap()
            .is_some_and(|until| Instant::now() < until)
    }
}

/// A store whose leases' renewals fail as [`Faults`] says; everything else passes through.
#[derive(Clone)]
pub struct Flaky<S> {
    inner: S,
    faults: Arc<Faults>,
}

/// A lease of [`Flaky`].
pub struct FlakyLease<L> {
    inner: L,
    faults: Arc<Faults>,
}

impl<S: Store + Clone> Store for Flaky<S> {
    type Lease = FlakyLease<S::Lease>;

    async fn insert_if_absent(&self, key: &[u8]) -> oncedb::Result<bool> {
        self.inner.insert_if_absent(key).await
    }

    async fn insert_many(&self, keys: Vec<Vec<u8>>) -> oncedb::Result<Vec<bool>> {
        self.inner.insert_many(keys).await
    }

    async fn reserve(
        &self,
        scope: &Scope,
        key: &[u8],
        request: &[u8],
    ) -> oncedb::Result<Reservation<Self::Lease>> {
        let faults = Arc::clone(&self.faults);
        let reserved = self.inner.reserve(scope, key, request).await?;
        Ok(reserved.map_lease(|inner| FlakyLease { inner, faults }))
    }

    async fn get(&self, scope: &Scope, key: &[u8]) -> oncedb::Result<Option<Record>> {
        self.inner.get(scope, key).await
    }

    async fn in_flight(&self, older_than: Duration) -> oncedb::Result<Vec<InFlight>> {
        self.inner.in_flight(older_than).await
    }

    async fn take_over(&self, scope: &Scope, key: &[u8]) -> oncedb::Result<Option<Self::Lease>> {
        let faults = Arc::clone(&self.faults);
        let taken = self.inner.take_over(scope, key).await?;
        Ok(taken.map(|inner| FlakyLease { inner, faults }))
    }

    async fn resume(&self, scope: &Scope, key: &[u8], epoch: u64) -> oncedb::Result<Self::Lease> {
        let faults = Arc::clone(&self.faults);
        let inner = self.inner.resume(scope, key, epoch).await?;
        Ok(FlakyLease { inner, faults })
    }

    fn max_response_bytes(&self) -> usize {
        self.inner.max_response_bytes()
    }

    async fn advance(
        &self,
        scope: &Scope,
        aggregate_id: &[u8],
        version: u64,
    ) -> oncedb::Result<Advance> {
        self.inner.advance(scope, aggregate_id, version).await
    }

    async fn wait_finished(
        &self,
        scope: &Scope,
        key: &[u8],
        timeout: Duration,
    ) -> oncedb::Result<Option<Record>> {
        self.inner.wait_finished(scope, key, timeout).await
    }

    fn lease_timeout(&self) -> Option<Duration> {
        self.inner.lease_timeout()
    }
}

impl<L: StoreLease> StoreLease for FlakyLease<L> {
    fn epoch(&self) -> u64 {
        self.inner.epoch()
    }

    async fn complete(self, response: &[u8]) -> oncedb::Result<()> {
        self.inner.complete(response).await
    }

    async fn fail(self, response: &[u8]) -> oncedb::Result<()> {
        self.inner.fail(response).await
    }

    async fn release(self) -> oncedb::Result<()> {
        self.inner.release().await
    }

    async fn note(&self, note: &[u8]) -> oncedb::Result<()> {
        self.inner.note(note).await
    }

    async fn keep_alive(&self) -> oncedb::Result<()> {
        if self.faults.renewal_refused() {
            return Err(Error::Unavailable {
                engine: "flaky",
                message: "renewal refused by the schedule".to_owned(),
            });
        }
        self.inner.keep_alive().await
    }
}

/// What one caller does, drawn from the schedule.
#[derive(Debug, Clone, Copy)]
struct Plan {
    /// Work before the side effect, and after it.
    before: Duration,
    after: Duration,
    /// Dropped this long after it starts.
    cancel_after: Option<Duration>,
    panics: bool,
    errs: bool,
}

fn draw_plan(schedule: &mut Schedule, timeout: Duration) -> Plan {
    let span = timeout.as_millis() as u64;
    Plan {
        before: Duration::from_millis(schedule.below(span)),
        // Up to three lease timeouts: the lease must be renewed to hold.
        after: Duration::from_millis(schedule.below(3 * span)),
        cancel_after: (schedule.below(6) == 0)
            .then(|| Duration::from_millis(schedule.below(2 * span))),
        panics: schedule.below(16) == 0,
        errs: schedule.below(8) == 0,
    }
}

/// Runs `batches` batches of four keys with one to four callers each on `store` (whose
/// lease timeout must be set), injecting renewal outages, and checks what happened.
/// Every caller's `run_once` waits up to three lease timeouts for an attempt in flight.
pub async fn property<S: Store + Clone>(
    store: S,
    scope: &Scope,
    seed: u64,
    batches: u64,
) -> Report {
    let timeout = store.lease_timeout().expect("a lease timeout");
    let faults = Arc::new(Faults::default());
    let store = Flaky {
        inner: store,
        faults: Arc::clone(&faults),
    };
    let effects = Arc::new(Effects::new());
    let mut schedule = Schedule::new(seed);
    let mut caller = 0;
    for batch in 0..batches {
        let mut callers = tokio::task::JoinSet::new();
        for key in batch * 4..batch * 4 + 4 {
            for _ in 0..schedule.within(1..5) {
                let plan = draw_plan(&mut schedule, timeout);
                effects.called(caller, key);
                let (store, scope, effects) = (store.clone(), scope.clone(), Arc::clone(&effects));
                callers.spawn(call(store, scope, effects, (caller, key), plan, timeout));
                caller += 1;
            }
        }
        // An outage of renewals now and then: shorter than the lease timeout (the lease
        // must hold through it), or longer (the lease is lost, and its operation told).
        match schedule.below(4) {
            0 => {
                let outage = timeout / 2;
                effects.fault(format!("batch {batch}: renewals refused for {outage:?}"));
                faults.fail_renewals_for(outage);
            }
            1 => {
                let outage = timeout * 2;
                effects.fault(format!("batch {batch}: renewals refused for {outage:?}"));
                faults.fail_renewals_for(outage);
            }
            _ => {}
        }
        while let Some(joined) = callers.join_next().await {
            let ((caller, _), answer, what) = match joined {
                Ok(answered) => answered,
                // The panic left with the task: the caller recorded nothing more.
                Err(err) if err.is_panic() => continue,
                Err(err) => panic!("a caller task failed: {err}"),
            };
            effects.answered(caller, answer, &what);
        }
    }
    // A lease timeout after every caller ended, no record may still be in flight unless
    // it is noted (an unfinished operation's mark).
    tokio::time::sleep(timeout + timeout / 2).await;
    let stuck: Vec<u64> = store
        .in_flight(timeout)
        .await
        .unwrap()
        .into_iter()
        .filter(|record| record.scope == *scope && record.note.is_none())
        .map(|record| {
            let key = String::from_utf8_lossy(&record.key).into_owned();
            key.trim_start_matches('k').parse().unwrap()
        })
        .collect();
    effects.check(&stuck)
}

/// One caller: `run_once` with the operation `plan` says, dropped or panicking as drawn.
async fn call<S: Store + Clone>(
    store: Flaky<S>,
    scope: Scope,
    effects: Arc<Effects>,
    (caller, key): (u64, u64),
    plan: Plan,
    timeout: Duration,
) -> ((u64, u64), Answer, String) {
    let name = format!("k{key}");
    let how = RunOnce::new().wait(timeout * 3).on_error(OnError::Fail);
    // The operation's watch, kept here too: a caller dropped mid-operation asks it
    // whether the lease was lost while the operation ran.
    let kept = Arc::new(Mutex::new(None::<LeaseWatch>));
    let operation = |watch: LeaseWatch| {
        let effects = Arc::clone(&effects);
        *kept.lock().unwrap() = Some(watch.clone());
        async move {
            tokio::time::sleep(plan.before).await;
            if watch.is_lost() {
                effects.told_lost(caller);
                return Err("the lease was lost before the side effect".to_owned());
            }
            effects.acted(caller, key);
            if plan.panics {
                if watch.is_lost() {
                    effects.told_lost(caller);
                }
                effects.answered(caller, Answer::Panicked, "panicked");
                panic!("caller {caller} panics after its side effect");
            }
            tokio::time::sleep(plan.after).await;
            if watch.is_lost() {
                effects.told_lost(caller);
            }
            if plan.errs {
                return Err("declined".to_owned());
            }
            Ok(format!("done by {caller}").into_bytes())
        }
    };
    let run = store.run_once(&scope, (name.as_bytes(), b"req"), how, operation);
    // Nothing the schedule draws lasts this long: a call still unanswered hangs.
    let limit = timeout * 30;
    let answered = match plan.cancel_after {
        Some(after) => match tokio::time::timeout(after, run).await {
            Ok(answered) => Some(answered),
            Err(_) => {
                if kept
                    .lock()
                    .unwrap()
                    .as_ref()
                    .is_some_and(LeaseWatch::is_lost)
                {
                    effects.told_lost(caller);
                }
                return ((caller, key), Answer::Cancelled, "cancelled".to_owned());
            }
        },
        None => tokio::time::timeout(limit, run).await.ok(),
    };
    let (answer, what) = match answered {
        Some(Ok(Once::Ran(_))) => (Answer::Typed, "ran".to_owned()),
        Some(Ok(Once::Replayed(record))) => {
            (Answer::Typed, format!("replayed {:?}", record.status()))
        }
        Some(Ok(Once::Errored(err))) => (Answer::Typed, format!("errored: {err}")),
        Some(Ok(other)) => (
            Answer::Untyped,
            format!("an answer unknown here: {other:?}"),
        ),
        Some(Err(err)) => (Answer::Typed, format!("error: {err}")),
        None => (Answer::Untyped, format!("no answer in {limit:?}")),
    };
    ((caller, key), answer, what)
}
