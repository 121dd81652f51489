//! The one seeded generator of the crate and its tests: torn writes in [`MemStorage`]
//! (crate::io::MemStorage), key streams in the benches, kill schedules in the crash tests.

/// SplitMix64: a small, fast, deterministic generator. The same seed gives the same
/// sequence on every platform, so a failing seed reproduces.
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    /// A generator whose sequence is fixed by `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// A value in `0..bound` (multiply-shift, no modulo bias worth naming); 0 when `bound`
    /// is 0.
    pub fn below(&mut self, bound: u64) -> u64 {
        let wide = (u128::from(self.next_u64()) * u128::from(bound)) >> 64;
        u64::try_from(wide).unwrap_or(u64::MAX)
    }

    /// A value in `0..=max`.
    pub fn upto(&mut self, max: usize) -> usize {
        let bound = u64::try_from(max).unwrap_or(u64::MAX).saturating_add(1);
        usize::try_from(self.below(bound)).unwrap_or(max)
    }
}

#[cfg(test)]
mod tests {
    use super::SplitMix64;

    #[test]
    fn a_seed_fixes_the_sequence_and_bounds_hold() {
        let mut a = SplitMix64::new(7);
        let mut b = SplitMix64::new(7);
        assert_eq!(a.next_u64(), b.next_u64());
        assert_ne!(a.next_u64(), SplitMix64::new(8).next_u64());
        for max in [0, 1, 5, 4096] {
            assert!((0..100).all(|_| a.upto(max) <= max));
        }
        assert_eq!(a.below(0), 0);
    }
}
