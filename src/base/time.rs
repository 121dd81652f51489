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

    /// The bucket of `width_ms` the current time falls in: `now_ms() / width_ms` for a
    /// reading taken during the call. A clock may answer it more cheaply than a reading
    /// (the system clock does), but never otherwise.
    fn now_bucket(&self, width_ms: u64) -> u64 {
        self.now_ms() / width_ms.max(1)
    }
}

/// The operating system's wall clock.
#[derive(Debug, Clone, Copy, Default)]
pub struct SystemClock;

impl Clock for SystemClock {
    /// On Linux through rustix's direct vDSO call (about 40 ns here, where
    /// `SystemTime::now()` through the C library takes about 60); elsewhere `SystemTime`.
    fn now_ms(&self) -> u64 {
        #[cfg(target_os = "linux")]
        {
            let now = rustix::time::clock_gettime(rustix::time::ClockId::Realtime);
            // Before the epoch counts as 0, as `system_time_to_ms` has it.
            u64::try_from(now.tv_sec).map_or(0, |secs| {
                secs.saturating_mul(1_000)
                    .saturating_add(u64::try_from(now.tv_nsec / 1_000_000).unwrap_or(0))
            })
        }
        #[cfg(not(target_os = "linux"))]
        system_time_to_ms(SystemTime::now())
    }

    /// From the coarse clock where that is certain to give the precise clock's bucket
    /// (`coarse_bucket`), else from a precise reading.
    fn now_bucket(&self, width_ms: u64) -> u64 {
        coarse_bucket(width_ms).unwrap_or_else(|| self.now_ms() / width_ms.max(1))
    }
}

/// The bucket of `width_ms` the precise wall clock is in, read from the coarse one
/// (`CLOCK_REALTIME_COARSE`: the time at the kernel's last tick, a few nanoseconds to
/// read where the precise clock takes tens), when the coarse reading lies far enough
/// inside its bucket that the precise time must lie in the same one: the precise clock
/// is ahead of the coarse one by less than a tick, and `COARSE_MARGIN_TICKS` ticks plus
/// a millisecond are kept clear on both sides of each edge. `None` near an edge (about
/// 2 × 9 ms in every bucket with a 4 ms tick: 0.002% of a 15-minute bucket), for buckets
/// too narrow, or where there is no coarse clock.
#[cfg(target_os = "linux")]
pub(crate) fn coarse_bucket(width_ms: u64) -> Option<u64> {
    use rustix::time::{ClockId, Timespec, clock_getres, clock_gettime};
    static MARGIN_NS: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    let nanos = |time: Timespec| {
        u64::try_from(time.tv_sec)
            .ok()?
            .checked_mul(1_000_000_000)?
            .checked_add(u64::try_from(time.tv_nsec).ok()?)
    };
    let margin_ns = (*MARGIN_NS.get_or_init(|| {
        let tick_ns = nanos(clock_getres(ClockId::RealtimeCoarse))?;
        // A tick longer than this is no coarse clock worth the name.
        (tick_ns <= 100_000_000).then(|| COARSE_MARGIN_TICKS * tick_ns + 1_000_000)
    }))?;
    let width_ns = width_ms.checked_mul(1_000_000)?;
    let now_ns = nanos(clock_gettime(ClockId::RealtimeCoarse))?;
    let into_ns = now_ns % width_ns;
    (into_ns >= margin_ns && into_ns + margin_ns < width_ns).then_some(now_ns / width_ns)
}

/// Elsewhere: no coarse clock; every bucket comes from a precise reading.
#[cfg(not(target_os = "linux"))]
pub(crate) fn coarse_bucket(_width_ms: u64) -> Option<u64> {
    None
}

/// Ticks of the coarse clock kept clear of a bucket's edges: the precise clock is less
/// than one ahead; two leave room for a tick handled late.
const COARSE_MARGIN_TICKS: u64 = 2;

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

    /// The system clock reads what `SystemTime` reads.
    #[test]
    fn the_system_clock_reads_the_wall_clock() {
        let before = system_time_to_ms(SystemTime::now());
        let now = SystemClock.now_ms();
        let after = system_time_to_ms(SystemTime::now());
        assert!(
            (before..=after).contains(&now),
            "{before} <= {now} <= {after}"
        );
    }

    /// The system clock's bucket is always the bucket of a precise reading taken during
    /// the call, between one taken before and one after, at every bucket width and
    /// however close to an edge; 50 ms buckets put an edge every few thousand calls.
    #[test]
    fn the_system_clocks_bucket_is_a_precise_readings() {
        let started = std::time::Instant::now();
        let mut edges = 0;
        while started.elapsed() < Duration::from_millis(300) {
            for width_ms in [1, 10, 50, 1_000, 900_000] {
                let before = SystemClock.now_ms() / width_ms;
                let bucket = SystemClock.now_bucket(width_ms);
                let after = SystemClock.now_ms() / width_ms;
                assert!(
                    (before..=after).contains(&bucket),
                    "{width_ms} ms buckets: {before} <= {bucket} <= {after}"
                );
                edges += usize::from(before != after);
            }
        }
        assert!(edges > 0, "no bucket edge was crossed");
    }

    /// Away from the edges of a wide bucket, the coarse clock answers (where there is
    /// one): the saving is real, not a path never taken.
    #[test]
    #[cfg(target_os = "linux")]
    fn a_wide_bucket_is_read_from_the_coarse_clock() {
        let answered = (0..100)
            .filter(|_| coarse_bucket(900_000).is_some())
            .count();
        assert!(answered >= 99, "{answered} of 100");
        assert_eq!(coarse_bucket(1), None, "1 ms buckets are all edge");
    }

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
