//! One renewal timer for the leases of [`Store::run_once`](super::Store::run_once) and the
//! HTTP layer: an operation registers its lease's first renewal, due a third of the
//! lease timeout after it asked, and takes it back when it ends. Most operations end long
//! before that, so they cost a registration and a cancellation, with no task of their
//! own. A lease whose first renewal comes due gets its renewal task then, spawned on its
//! runtime: from that point on it is renewed by a task beside the operation.
//!
//! The timer holds its registrations in a slab, linked in due order per lease timeout
//! (a registration is always the latest due among those of its timeout, so appending
//! keeps each list sorted): registering, cancelling and firing are O(1), and the slab
//! holds the live registrations only.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use parking_lot::{Condvar, Mutex, MutexGuard};

/// What a registration does when it comes due (on the timer's thread, with no lock held).
pub(crate) type Due = Box<dyn FnOnce() + Send>;

/// No slot: the end of a list.
const NONE: u32 = u32::MAX;

/// A registration to cancel: its slot and the slot's generation when it was taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Registration {
    slot: u32,
    generation: u32,
}

struct Slot {
    generation: u32,
    entry: Option<Entry>,
}

struct Entry {
    at: Instant,
    list: usize,
    prev: u32,
    next: u32,
    due: Due,
}

/// The registrations of one lease timeout, oldest first.
struct List {
    timeout: Duration,
    head: u32,
    tail: u32,
}

#[derive(Default)]
struct Slab {
    slots: Vec<Slot>,
    free: Vec<u32>,
    lists: Vec<List>,
    /// What the timer's thread waits for, as it last went to sleep.
    sleep: Sleep,
    /// When the latest registration made since the thread last found none was due. It
    /// sleeps until then when it finds none, rather than until woken: the registrations
    /// of a steady stream of short operations, each due later than the one before, then
    /// never wake it (each would cost a futex wake and a switch to its thread).
    latest_due: Option<Instant>,
}

/// What the timer's thread waits for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
enum Sleep {
    /// It is awake, or woken: it looks at the registrations before it sleeps again.
    #[default]
    Awake,
    /// It sleeps until then: a registration due earlier wakes it.
    Until(Instant),
    /// It sleeps until woken: any registration wakes it.
    Forever,
}

/// The process's renewal timer: a thread of its own, so that no operation that blocks
/// a runtime thread can hold it back (its registrations' renewal tasks are spawned onto
/// their own runtimes from outside, through their handles, into queues any worker
/// takes).
pub(crate) struct Timer {
    slab: Mutex<Slab>,
    /// Wakes the thread when a registration is due before what it sleeps until.
    wake: Condvar,
}

impl Slab {
    fn list_of(&mut self, timeout: Duration) -> usize {
        if let Some(index) = self.lists.iter().position(|list| list.timeout == timeout) {
            return index;
        }
        self.lists.push(List {
            timeout,
            head: NONE,
            tail: NONE,
        });
        self.lists.len() - 1
    }

    /// Appends a registration due at `at` to the list of `timeout`; whether the timer's
    /// thread must be woken for it (it sleeps past `at`).
    fn push(&mut self, timeout: Duration, at: Instant, due: Due) -> (Registration, bool) {
        let list = self.list_of(timeout);
        let tail = self.lists.get(list).map_or(NONE, |list| list.tail);
        let entry = Entry {
            at,
            list,
            prev: tail,
            next: NONE,
            due,
        };
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                self.slots.push(Slot {
                    generation: 0,
                    entry: None,
                });
                u32::try_from(self.slots.len() - 1).unwrap_or(NONE)
            }
        };
        let generation = match self.slot_mut(slot) {
            Some(held) => {
                held.entry = Some(entry);
                held.generation
            }
            None => 0,
        };
        match self.entry_mut(tail) {
            Some(previous) => previous.next = slot,
            None => {
                if let Some(list) = self.lists.get_mut(list) {
                    list.head = slot;
                }
            }
        }
        if let Some(list) = self.lists.get_mut(list) {
            list.tail = slot;
        }
        self.latest_due = Some(self.latest_due.map_or(at, |latest| latest.max(at)));
        let wake = match self.sleep {
            Sleep::Awake => false,
            Sleep::Until(until) => at < until,
            Sleep::Forever => true,
        };
        if wake {
            self.sleep = Sleep::Awake;
        }
        (Registration { slot, generation }, wake)
    }

    /// What the thread sleeps until, having found nothing due at `now`: the earliest
    /// registration; with none, when the latest one made lately was due (once, if that
    /// is still to come), or until woken.
    fn sleep_from(&mut self, now: Instant) -> Sleep {
        self.sleep = match self.earliest() {
            Some(at) => Sleep::Until(at),
            None => match self.latest_due.take() {
                Some(latest) if latest > now => Sleep::Until(latest),
                _ => Sleep::Forever,
            },
        };
        self.sleep
    }

    /// Takes registration `registration` out, if it is still there.
    fn cancel(&mut self, registration: Registration) -> Option<Due> {
        let held = self.slot_mut(registration.slot)?;
        if held.generation != registration.generation {
            return None;
        }
        let entry = held.entry.take()?;
        held.generation = held.generation.wrapping_add(1);
        self.free.push(registration.slot);
        match self.entry_mut(entry.prev) {
            Some(previous) => previous.next = entry.next,
            None => {
                if let Some(list) = self.lists.get_mut(entry.list) {
                    list.head = entry.next;
                }
            }
        }
        match self.entry_mut(entry.next) {
            Some(next) => next.prev = entry.prev,
            None => {
                if let Some(list) = self.lists.get_mut(entry.list) {
                    list.tail = entry.prev;
                }
            }
        }
        Some(entry.due)
    }

    /// Takes out every registration due by `now`.
    fn take_due(&mut self, now: Instant, due: &mut Vec<Due>) {
        for list in 0..self.lists.len() {
            loop {
                let head = self.lists.get(list).map_or(NONE, |list| list.head);
                let Some(at) = self.entry(head).map(|entry| entry.at) else {
                    break;
                };
                if at > now {
                    break;
                }
                let generation = self.slot_mut(head).map_or(0, |slot| slot.generation);
                if let Some(fire) = self.cancel(Registration {
                    slot: head,
                    generation,
                }) {
                    due.push(fire);
                }
            }
        }
    }

    /// When the earliest registration is due.
    fn earliest(&self) -> Option<Instant> {
        self.lists
            .iter()
            .filter_map(|list| self.entry(list.head).map(|entry| entry.at))
            .min()
    }

    fn slot_mut(&mut self, slot: u32) -> Option<&mut Slot> {
        self.slots.get_mut(usize::try_from(slot).ok()?)
    }

    fn entry(&self, slot: u32) -> Option<&Entry> {
        self.slots.get(usize::try_from(slot).ok()?)?.entry.as_ref()
    }

    fn entry_mut(&mut self, slot: u32) -> Option<&mut Entry> {
        self.slot_mut(slot)?.entry.as_mut()
    }
}

impl Timer {
    /// The process's timer, its thread started on first use.
    pub(crate) fn get() -> &'static Timer {
        static TIMER: OnceLock<&'static Timer> = OnceLock::new();
        TIMER.get_or_init(|| {
            let timer: &'static Timer = Box::leak(Box::new(Timer {
                slab: Mutex::new(Slab::default()),
                wake: Condvar::new(),
            }));
            let started = std::thread::Builder::new()
                .name("oncedb-lease-timer".to_owned())
                .spawn(move || timer.run());
            if let Err(err) = started {
                log::error!("oncedb: the lease renewal timer did not start: {err}");
            }
            timer
        })
    }

    /// Registers `due` to run at `at`, for a lease of `timeout` (every registration of
    /// one timeout comes due in the order made).
    pub(crate) fn register(&self, timeout: Duration, at: Instant, due: Due) -> Registration {
        let (registration, wake) = self.slab.lock().push(timeout, at, due);
        if wake {
            self.wake.notify_one();
        }
        registration
    }

    /// Takes `registration` back, unless it came due already (its `due` ran or runs).
    pub(crate) fn cancel(&self, registration: Registration) {
        let cancelled = self.slab.lock().cancel(registration);
        // Dropped outside the lock: it holds the lease's state.
        drop(cancelled);
    }

    fn run(&self) {
        let mut due = Vec::new();
        let mut slab = self.slab.lock();
        loop {
            let now = Instant::now();
            slab.take_due(now, &mut due);
            if !due.is_empty() {
                slab.sleep = Sleep::Awake;
                MutexGuard::unlocked(&mut slab, || {
                    for fire in due.drain(..) {
                        fire();
                    }
                });
                continue;
            }
            match slab.sleep_from(now) {
                Sleep::Until(until) => {
                    self.wake.wait_until(&mut slab, until);
                }
                Sleep::Forever | Sleep::Awake => self.wake.wait(&mut slab),
            }
            slab.sleep = Sleep::Awake;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    fn counting(fired: &Arc<Mutex<Vec<u32>>>, n: u32) -> Due {
        let fired = Arc::clone(fired);
        Box::new(move || fired.lock().push(n))
    }

    #[test]
    fn registrations_come_due_in_order_and_cancelled_ones_never() {
        let mut slab = Slab::default();
        let fired = Arc::new(Mutex::new(Vec::new()));
        let start = Instant::now();
        let timeout = Duration::from_secs(30);
        let at = |ms| start + Duration::from_millis(ms);
        let (first, _) = slab.push(timeout, at(10), counting(&fired, 1));
        let (second, _) = slab.push(timeout, at(20), counting(&fired, 2));
        let (_third, _) = slab.push(timeout, at(30), counting(&fired, 3));
        assert!(slab.cancel(second).is_some());
        assert!(slab.cancel(second).is_none(), "cancelled twice");
        let mut due = Vec::new();
        slab.take_due(at(25), &mut due);
        due.drain(..).for_each(|fire| fire());
        assert_eq!(*fired.lock(), vec![1]);
        assert!(slab.cancel(first).is_none(), "came due already");
        // A freed slot is taken again under a new generation: the old registration
        // cannot cancel the new one.
        let (reused, _) = slab.push(timeout, at(40), counting(&fired, 4));
        assert!(slab.cancel(first).is_none());
        slab.take_due(at(100), &mut due);
        due.drain(..).for_each(|fire| fire());
        assert_eq!(*fired.lock(), vec![1, 3, 4]);
        assert!(slab.cancel(reused).is_none());
        assert_eq!(slab.earliest(), None);
        assert_eq!(slab.slots.len(), 3, "slots are reused");
    }

    /// The thread is woken only for a registration due before it wakes anyway: after it
    /// found none, it sleeps until the latest recent one was due, so a steady stream of short
    /// operations (each registering, then cancelling) does not wake it at every call.
    #[test]
    fn the_thread_is_woken_only_for_a_registration_due_before_it_wakes() {
        let mut slab = Slab::default();
        let fired = Arc::new(Mutex::new(Vec::new()));
        let timeout = Duration::from_secs(30);
        let start = Instant::now();
        let at = |s| start + Duration::from_secs(s);
        // Awake: it looks before it sleeps.
        let (first, wake) = slab.push(timeout, at(10), counting(&fired, 1));
        assert!(!wake);
        assert_eq!(slab.sleep_from(start), Sleep::Until(at(10)));
        // Due after what it sleeps until: no wake; due before: woken (once).
        let (second, wake) = slab.push(timeout, at(11), counting(&fired, 2));
        assert!(!wake);
        let (third, wake) = slab.push(timeout, at(9), counting(&fired, 3));
        assert!(wake);
        let (fourth, wake) = slab.push(timeout, at(8), counting(&fired, 4));
        assert!(!wake, "woken already");
        // Every registration cancelled: it sleeps until the latest one made lately was
        // due, once, then until woken.
        for registration in [first, second, third, fourth] {
            assert!(slab.cancel(registration).is_some());
        }
        assert_eq!(slab.sleep_from(at(1)), Sleep::Until(at(11)));
        assert_eq!(slab.sleep_from(at(12)), Sleep::Forever);
        let (_, wake) = slab.push(timeout, at(300), counting(&fired, 5));
        assert!(wake);
    }

    #[test]
    fn lists_of_several_timeouts_each_stay_in_order() {
        let mut slab = Slab::default();
        let fired = Arc::new(Mutex::new(Vec::new()));
        let start = Instant::now();
        let at = |ms| start + Duration::from_millis(ms);
        slab.push(Duration::from_secs(30), at(300), counting(&fired, 1));
        slab.push(Duration::from_secs(3), at(30), counting(&fired, 2));
        assert_eq!(
            slab.earliest(),
            Some(at(30)),
            "due before the other list's head"
        );
        let mut due = Vec::new();
        slab.take_due(at(100), &mut due);
        due.drain(..).for_each(|fire| fire());
        assert_eq!(*fired.lock(), vec![2]);
        assert_eq!(slab.earliest(), Some(at(300)));
    }
}
