//! Cache prefetch hints: the one module of the crate allowed `unsafe`.
//!
//! A batch insert knows every home slot it will probe before it probes the first one.
//! Issuing a prefetch for each lets the memory system fetch all their cache lines at
//! once, where plain loads would stall the core on the first miss (measured in
//! docs/performance.md). A prefetch is only a hint: it never faults, never changes memory
//! and has no effect the program can observe except timing.

#![expect(
    unsafe_code,
    reason = "prefetch instructions are exposed as unsafe intrinsics or inline assembly"
)]

/// Asks the CPU to bring the cache line holding `value` into L1, without waiting for it.
/// A no-op on targets other than x86_64 and aarch64.
#[inline(always)]
pub(crate) fn prefetch_read<T>(value: &T) {
    prefetch_address(std::ptr::from_ref(value).addr());
}

/// Asks the CPU to bring the cache line at `address` into L1. The address may be stale
/// or point nowhere: a prefetch never faults and never reads on the program's behalf, so
/// this needs no valid pointer (it is used for slots located without the shard lock).
#[inline(always)]
pub(crate) fn prefetch_address(address: usize) {
    let pointer = std::ptr::without_provenance::<i8>(address);
    #[cfg(target_arch = "x86_64")]
    {
        use core::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        // SAFETY: `prefetcht0` is a hint: it never faults, even on an unmapped address,
        // and neither reads nor writes memory the program can observe.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(pointer) };
    }
    #[cfg(target_arch = "aarch64")]
    {
        // SAFETY: `prfm` is a hint that never faults, even on an unmapped address, and
        // writes nothing (`readonly`, `nostack`, no flags touched).
        unsafe {
            core::arch::asm!(
                "prfm pldl1keep, [{address}]",
                address = in(reg) pointer,
                options(nostack, readonly, preserves_flags)
            );
        }
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = pointer;
}

#[cfg(test)]
mod tests {
    use super::prefetch_read;

    #[test]
    fn a_prefetch_changes_nothing() {
        let values = vec![7u64; 1024];
        for value in &values {
            prefetch_read(value);
        }
        assert!(values.iter().all(|&v| v == 7));
    }

    #[test]
    fn a_prefetch_of_an_unmapped_address_does_not_fault() {
        for address in [0, 8, usize::MAX - 63, 0x10_0000_0000] {
            super::prefetch_address(address);
        }
    }
}
