//! A gate that holds fsyncs until the test lets them go, for tests that need a thread
//! stuck inside an fsync at a known point (a group commit's leader, a sealing thread)
//! instead of hoping a timing lines up.

use std::sync::Arc;

use oncedb::io::MemStorage;
use parking_lot::{Condvar, Mutex};

use crate::watched::WatchedStorage;

/// Which syncing threads a gate may hold, by thread name (`None`: an unnamed thread).
type Watched = Box<dyn Fn(Option<&str>) -> bool + Send + Sync>;

/// Holds the next fsyncs of the threads it watches, each until released in turn.
pub struct SyncGate {
    watched: Watched,
    state: Mutex<GateState>,
    changed: Condvar,
}

#[derive(Default)]
struct GateState {
    /// Fsyncs still to hold.
    to_hold: u32,
    /// Fsyncs held so far.
    held: u32,
    /// Fsyncs let go so far.
    released: u32,
}

impl SyncGate {
    /// A gate watching the threads `watched` accepts by name.
    pub fn new(watched: impl Fn(Option<&str>) -> bool + Send + Sync + 'static) -> Arc<SyncGate> {
        Arc::new(SyncGate {
            watched: Box::new(watched),
            state: Mutex::new(GateState::default()),
            changed: Condvar::new(),
        })
    }

    /// A gate watching every thread but the segment worker (writers, group-commit
    /// leaders, the committer).
    pub fn writers() -> Arc<SyncGate> {
        SyncGate::new(|name| name != Some("oncedb-segments"))
    }

    /// A gate watching the thread named `thread` alone.
    pub fn thread(thread: &'static str) -> Arc<SyncGate> {
        SyncGate::new(move |name| name == Some(thread))
    }

    /// Storage on `disk` whose syncs pass through this gate.
    pub fn storage(self: &Arc<Self>, disk: MemStorage) -> WatchedStorage {
        let gate = Arc::clone(self);
        WatchedStorage::new(disk, move || gate.on_sync())
    }

    /// Holds the next `n` fsyncs of the watched threads (on top of any still to hold).
    pub fn hold(&self, n: u32) {
        self.state.lock().to_hold += n;
    }

    /// Waits until `n` fsyncs have been held since the gate was made.
    pub fn await_held(&self, n: u32) {
        let mut state = self.state.lock();
        while state.held < n {
            self.changed.wait(&mut state);
        }
    }

    /// Waits until `n` fsyncs have been held, or `limit` has passed: whether they were.
    /// For a test that fails, rather than hangs, when the fsync never comes.
    pub fn await_held_within(&self, n: u32, limit: std::time::Duration) -> bool {
        let deadline = std::time::Instant::now() + limit;
        let mut state = self.state.lock();
        while state.held < n {
            if self.changed.wait_until(&mut state, deadline).timed_out() {
                return state.held >= n;
            }
        }
        true
    }

    /// Lets the oldest held fsync go.
    pub fn release_one(&self) {
        self.state.lock().released += 1;
        self.changed.notify_all();
    }

    /// Lets every held fsync go, and holds no more.
    pub fn release_all(&self) {
        let mut state = self.state.lock();
        state.to_hold = 0;
        state.released = u32::MAX;
        self.changed.notify_all();
    }

    /// A guard that lets every held fsync go when dropped, so that a failing test
    /// unwinds instead of waiting for a thread stuck at the gate.
    pub fn release_on_drop(self: &Arc<Self>) -> ReleaseOnDrop {
        ReleaseOnDrop(Arc::clone(self))
    }

    /// Runs after each sync: holds it if it is to be held.
    fn on_sync(&self) {
        if !(self.watched)(std::thread::current().name()) {
            return;
        }
        let mut state = self.state.lock();
        if state.to_hold == 0 {
            return;
        }
        state.to_hold -= 1;
        let me = state.held;
        state.held += 1;
        self.changed.notify_all();
        while state.released <= me {
            self.changed.wait(&mut state);
        }
    }
}

/// Lets every fsync held at its gate go when dropped ([`SyncGate::release_on_drop`]).
pub struct ReleaseOnDrop(Arc<SyncGate>);

impl Drop for ReleaseOnDrop {
    fn drop(&mut self) {
        self.0.release_all();
    }
}
