//! Time sources and millisecond conversions. A [`Clock`] decides which time bucket an
//! operation falls in.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A source of time in milliseconds since the Unix epoch.
///
/// The default is [`SystemClock`]. Stream processors implement this trait to drive
/// windows by event time. A clock may go backwards: oncedb keeps the highest time it has
/// seen, so a step back never expires a key early.
pub trait Clock: Send + Sync + 'static {
    /// The current time in milliseconds since the Unix epoch.
    fn now_ms(&self) -> u64;
}

/// The operating system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    fn now_ms(&self) -> u64 {
        system_time_to_ms(SystemTime::now())
    }
}

/// A clock that moves only when told to. Clones share one time.
#[derive(Debug, Clone)]
pub struct ManualClock {
    now_ms: Arc<AtomicU64>,
}

impl ManualClock {
    /// A clock standing at `start`.
    pub fn new(start: SystemTime) -> Self {
        ManualClock {
            now_ms: Arc::new(AtomicU64::new(system_time_to_ms(start))),
        }
    }

    /// Moves the clock forward by `by`.
    pub fn forward(&self, by: Duration) {
        let by_ms = duration_to_ms(by);
        self.now_ms.fetch_add(by_ms, Ordering::SeqCst);
    }

    /// Sets the clock to `to`, which may be earlier than the current time.
    pub fn set(&self, to: SystemTime) {
        self.now_ms.store(system_time_to_ms(to), Ordering::SeqCst);
    }

    /// The time the clock stands at.
    pub fn now(&self) -> SystemTime {
        ms_to_system_time(self.now_ms.load(Ordering::SeqCst))
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}

/// Milliseconds since the epoch; times before the epoch count as 0.
pub(crate) fn system_time_to_ms(time: SystemTime) -> u64 {
    time.duration_since(UNIX_EPOCH)
        .map(duration_to_ms)
        .unwrap_or(0)
}

pub(crate) fn duration_to_ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

pub(crate) fn ms_to_system_time(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms)
}

/// The instant `timeout` from now; a year from now for a timeout too long to add (a wait
/// "for ever" stays a wait, never an overflow).
pub(crate) fn deadline_after(timeout: std::time::Duration) -> std::time::Instant {
    let now = std::time::Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + std::time::Duration::from_secs(86_400 * 365))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_clones_share_time() {
        let start = UNIX_EPOCH + Duration::from_secs(1_000);
        let clock = ManualClock::new(start);
        let other = clock.clone();
        other.forward(Duration::from_millis(1_500));
        assert_eq!(clock.now_ms(), 1_001_500);
        clock.set(start);
        assert_eq!(other.now(), start);
    }

    #[test]
    fn times_before_epoch_clamp_to_zero() {
        let before = UNIX_EPOCH - Duration::from_secs(5);
        assert_eq!(system_time_to_ms(before), 0);
    }
}
