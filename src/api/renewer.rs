//! The thread that renews the leases of `Db::run_once` operations while they run: one
//! for the process, started at the first operation run under a lease timeout, so that a
//! call pays a registration (a lock and a heap push), not a thread of its own.
//!
//! Renewals are due every third of their lease timeout ([`Renewals`]); the thread sleeps
//! until the earliest one, sends it, and schedules the next. A lease whose renewals
//! stop (refused as lost, or lapsed) is marked lost on its [`LeaseWatch`]. Renewals of
//! one thread go one after another: a renewal that waits on an fsync (`Sync`) delays
//! the next by that fsync, well within the two thirds of a timeout each lease has left.

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex};

use super::once::{LeaseWatch, Renewals};
use super::record::Lease;

/// The process's renewal thread and the leases it renews.
struct Renewer {
    state: Mutex<State>,
    changed: Condvar,
}

#[derive(Default)]
struct State {
    /// When each lease's next renewal is due, earliest first.
    due: BinaryHeap<Reverse<(Instant, u64)>>,
    leases: HashMap<u64, Renewing>,
    next_id: u64,
}

struct Renewing {
    lease: Lease,
    watch: LeaseWatch,
    renewals: Renewals,
    timeout: Duration,
}

static RENEWER: OnceLock<Renewer> = OnceLock::new();

fn renewer() -> &'static Renewer {
    RENEWER.get_or_init(|| {
        // Started once; if the thread cannot start, leases registered are not renewed
        // (and their watches say lost once a timeout passes).
        let spawned = std::thread::Builder::new()
            .name("oncedb-renewals".into())
            .spawn(|| renewer().run());
        if let Err(err) = spawned {
            log::error!("oncedb: the lease renewal thread did not start: {err}");
        }
        Renewer {
            state: Mutex::new(State::default()),
            changed: Condvar::new(),
        }
    })
}

/// A lease being renewed; the renewals stop when this is dropped.
pub(crate) struct Registration {
    id: u64,
}

/// Renews `lease` (asked for at `asked`, under `timeout`) until the registration is
/// dropped or the lease is lost, which `watch` then says.
pub(crate) fn register(
    lease: &Lease,
    watch: &LeaseWatch,
    (timeout, asked): (Duration, Instant),
) -> Registration {
    let renewer = renewer();
    let renewals = Renewals::new(timeout, asked);
    let first = Instant::now() + renewals.first();
    let mut state = renewer.state.lock();
    let id = state.next_id;
    state.next_id += 1;
    state.leases.insert(
        id,
        Renewing {
            lease: lease.handle(),
            watch: watch.clone(),
            renewals,
            timeout,
        },
    );
    let earliest = state.due.peek().is_none_or(|Reverse((at, _))| first < *at);
    state.due.push(Reverse((first, id)));
    drop(state);
    if earliest {
        renewer.changed.notify_one();
    }
    Registration { id }
}

impl Drop for Registration {
    fn drop(&mut self) {
        if let Some(renewer) = RENEWER.get() {
            // Its heap entry is skipped when it comes due.
            renewer.state.lock().leases.remove(&self.id);
        }
    }
}

impl Renewer {
    fn run(&self) {
        let mut state = self.state.lock();
        loop {
            let Some(&Reverse((at, id))) = state.due.peek() else {
                self.changed.wait(&mut state);
                continue;
            };
            let now = Instant::now();
            if at > now {
                self.changed.wait_for(&mut state, at - now);
                continue;
            }
            state.due.pop();
            let Some(lease) = state.leases.get(&id).map(|entry| entry.lease.handle()) else {
                continue;
            };
            drop(state);
            let sent = Instant::now();
            let answer = lease.keep_alive();
            state = self.state.lock();
            let Some(entry) = state.leases.get_mut(&id) else {
                continue;
            };
            if answer.is_ok() {
                entry.watch.renewed(sent, entry.timeout);
            }
            match entry.renewals.after(sent, &answer) {
                Some(wait) => state.due.push(Reverse((Instant::now() + wait, id))),
                None => {
                    entry.watch.mark_lost();
                    state.leases.remove(&id);
                }
            }
        }
    }
}
