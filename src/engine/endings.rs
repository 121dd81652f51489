//! Waiting for a record in flight to end: a waiter registers on the record's
//! fingerprint, then looks at the record, then sleeps until a lease ending on that
//! fingerprint wakes it (or its deadline passes). The ending signals only after its entry
//! is committed as the store's durability says, so a woken waiter that reads the record
//! finished reads an ending that survives what the store promises to survive.
//!
//! Nothing polls: a waiter is woken by the ending of its record, or of another record
//! sharing its fingerprint (it then looks again and sleeps again). Waiters
//! are rare next to writes, so an ending with no waiter anywhere costs one atomic load.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::task::Waker;
use std::time::Instant;

use parking_lot::{Condvar, Mutex};

/// One waiter's signal: set once, by the first ending of its fingerprint after it was
/// registered.
#[derive(Default)]
pub(crate) struct Ending {
    fired: AtomicBool,
    /// A task to wake, for a waiter that awaits.
    waker: Mutex<Option<Waker>>,
    /// For a waiter that blocks.
    lock: Mutex<()>,
    woken: Condvar,
}

impl Ending {
    fn fire(&self) {
        self.fired.store(true, Ordering::Release);
        if let Some(waker) = self.waker.lock().take() {
            waker.wake();
        }
        let _held = self.lock.lock();
        self.woken.notify_all();
    }

    /// Whether the ending came.
    pub(crate) fn fired(&self) -> bool {
        self.fired.load(Ordering::Acquire)
    }

    /// Blocks until the ending comes or `deadline` passes; whether it came.
    pub(crate) fn wait_until(&self, deadline: Instant) -> bool {
        let mut held = self.lock.lock();
        while !self.fired() {
            if self.woken.wait_until(&mut held, deadline).timed_out() {
                return self.fired();
            }
        }
        true
    }

    #[cfg(feature = "async")]
    /// Polls for the ending, registering `cx`'s waker to be woken by it.
    pub(crate) fn poll_fired(&self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        if self.fired() {
            return std::task::Poll::Ready(());
        }
        *self.waker.lock() = Some(cx.waker().clone());
        // Fired between the first look and the waker's registration: it took no waker.
        if self.fired() {
            return std::task::Poll::Ready(());
        }
        std::task::Poll::Pending
    }
}

/// The waiters of every record, by fingerprint.
#[derive(Default)]
pub(crate) struct Endings {
    waiting: Mutex<HashMap<u128, Vec<Arc<Ending>>>>,
    /// How many waiters are registered: an ending with none skips the lock.
    count: AtomicUsize,
}

impl Endings {
    /// Registers a waiter on fingerprint `key`; it must be taken back with
    /// [`Endings::forget`] if it returns before the ending fires.
    pub(crate) fn register(&self, key: u128) -> Arc<Ending> {
        let ending = Arc::new(Ending::default());
        let mut waiting = self.waiting.lock();
        waiting.entry(key).or_default().push(Arc::clone(&ending));
        // Counted under the lock that `ended` and `forget` take: no count goes below
        // the registrations it covers.
        self.count.fetch_add(1, Ordering::AcqRel);
        drop(waiting);
        ending
    }

    /// Takes back a waiter that gave up before its ending.
    pub(crate) fn forget(&self, key: u128, ending: &Arc<Ending>) {
        let mut waiting = self.waiting.lock();
        if let Some(list) = waiting.get_mut(&key) {
            let before = list.len();
            list.retain(|other| !Arc::ptr_eq(other, ending));
            if list.len() < before {
                self.count.fetch_sub(1, Ordering::AcqRel);
            }
            if list.is_empty() {
                waiting.remove(&key);
            }
        }
    }

    /// How many waiters are registered.
    pub(crate) fn waiters(&self) -> u64 {
        self.count.load(Ordering::Acquire) as u64
    }

    /// Wakes every waiter on fingerprint `key`: a lease on it ended, durably.
    pub(crate) fn ended(&self, key: u128) {
        if self.count.load(Ordering::Acquire) == 0 {
            return;
        }
        let woken = self.waiting.lock().remove(&key);
        for ending in woken.into_iter().flatten() {
            self.count.fetch_sub(1, Ordering::AcqRel);
            ending.fire();
        }
    }
}
