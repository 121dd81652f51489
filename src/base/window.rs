//! Time buckets: which bucket a time falls in and whether a bucket is still in the window.

#![expect(
    clippy::cast_possible_truncation,
    reason = "slots store buckets as 32 bits compared with wrapping arithmetic; the sweep keeps ages below 2^31"
)]

/// The window measured in buckets.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Window {
    /// Width of one bucket in milliseconds.
    pub(crate) width_ms: u64,
    /// Number of whole buckets in the window (`window_ms / width_ms`).
    pub(crate) span: u64,
}

impl Window {
    pub(crate) fn new(window_ms: u64, width_ms: u64) -> Self {
        Window {
            width_ms,
            span: window_ms / width_ms,
        }
    }

    /// The bucket holding time `ms`.
    pub(crate) fn bucket_of(&self, ms: u64) -> u64 {
        ms / self.width_ms
    }

    /// Whether an entry admitted in bucket `entry` is still remembered in bucket
    /// `current`. An entry admitted at time t in bucket b lives through bucket b + span,
    /// which ends at (b + span + 1) * width > t + window: it never expires early.
    pub(crate) fn is_live(&self, entry: u64, current: u64) -> bool {
        current.saturating_sub(entry) <= self.span
    }

    /// Number of buckets that can hold live entries at once.
    pub(crate) fn live_buckets(&self) -> u64 {
        self.span + 1
    }

    /// The liveness test in the 32-bit form stored in table slots.
    pub(crate) fn liveness(&self, current: u64) -> Liveness {
        Liveness {
            current: current as u32,
            span: self.span as u32,
        }
    }
}

/// Liveness on truncated 32-bit bucket numbers. Exact while no stored entry is more than
/// 2^31 buckets old, which the shard sweep guarantees.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Liveness {
    current: u32,
    span: u32,
}

impl Liveness {
    #[inline]
    pub(crate) fn is_live(self, bucket: u32) -> bool {
        self.current.wrapping_sub(bucket) <= self.span
    }

    #[cfg(test)]
    pub(crate) fn current(self) -> u32 {
        self.current
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn live_through_span_then_dead() {
        let window = Window::new(60_000, 15_000);
        assert_eq!(window.span, 4);
        assert!(window.is_live(10, 10));
        assert!(window.is_live(10, 14));
        assert!(!window.is_live(10, 15));
        let live = window.liveness(14);
        assert!(live.is_live(10));
        assert!(!window.liveness(15).is_live(10));
    }

    #[test]
    fn truncated_buckets_wrap() {
        let window = Window::new(4, 1);
        let before_wrap = u32::MAX as u64;
        assert!(window.liveness(before_wrap + 3).is_live(before_wrap as u32));
        assert!(!window.liveness(before_wrap + 5).is_live(before_wrap as u32));
    }
}
