//! The slot memory of a dedup table: a heap allocation, or, for tables of
//! [`HUGE_PAGE_MIN_BYTES`] and more on Linux, an anonymous mapping advised for
//! transparent huge pages (`madvise(MADV_HUGEPAGE)` through `memmap2`).
//!
//! Every probe of a large table misses the cache; with 4 KiB pages it usually misses the
//! TLB too, and in a virtual machine each TLB miss is a two-dimensional page walk. One
//! 2 MiB page covers what 512 small ones do. Measured in `docs/performance.md`: tables
//! sized up front (`Options::expected_keys`) insert 36% faster in batches and 22% faster
//! one key at a time with huge pages, so tables made at open (and cleared ones) are
//! mapped where the OS offers it; tables rebuilt while growing stay on the heap, where
//! mapping measured slower. A mapping spans whole huge pages (the table takes the slots
//! up to its end), which Linux 6.7 and later align to 2 MiB.

use std::ops::{Deref, DerefMut};

/// One slot: tag low word, tag high word, bucket.
pub(crate) type Slot = [u32; 3];

/// The empty slot: all zero bits, which is what a fresh mapping and `calloc` hand out.
pub(crate) const EMPTY: Slot = [0; 3];

/// Tables from this size up are mapped and advised; a smaller table fits in a few small
/// pages.
pub(crate) const HUGE_PAGE_MIN_BYTES: usize = HUGE_PAGE_BYTES;

/// A transparent huge page on x86_64 and on aarch64 with 4 KiB base pages.
const HUGE_PAGE_BYTES: usize = 2 << 20;

/// A table's slots, empty when created: as many as asked for, or for a mapped table up
/// to the end of its last huge page.
#[derive(Debug)]
pub(crate) struct SlotMemory(Inner);

#[derive(Debug)]
enum Inner {
    Heap(Vec<Slot>),
    #[cfg(target_os = "linux")]
    /// The mapping and the slots it holds (its last few bytes may be left over).
    Mapped(memmap2::MmapMut, usize),
}

impl SlotMemory {
    /// `len` empty slots, lazily zeroed by the OS (a mapping, or `calloc`).
    pub(crate) fn zeroed(len: usize, huge_pages: bool) -> SlotMemory {
        match Self::mapped(len, huge_pages) {
            Some(memory) => memory,
            None => SlotMemory(Inner::Heap(vec![EMPTY; len])),
        }
    }

    /// `len` empty slots for a table about to be filled at random (a rebuild), on the
    /// heap and all written up front, so that the fill does not fault pages in at random.
    /// Never mapped: a growing table rebuilt into fresh mappings ran 26% slower in
    /// batches (every rebuild faulted in and zeroed new huge pages, where the allocator
    /// reuses the memory the previous rebuild freed).
    pub(crate) fn written(len: usize) -> SlotMemory {
        let mut slots = Vec::with_capacity(len);
        slots.resize(len, EMPTY);
        SlotMemory(Inner::Heap(slots))
    }

    /// `len` empty slots, failing without aborting if they cannot be allocated. The heap
    /// fallback writes every slot at once, so the pages are in place before the first
    /// insert.
    pub(crate) fn try_zeroed(
        len: usize,
        huge_pages: bool,
    ) -> Result<SlotMemory, std::collections::TryReserveError> {
        if let Some(memory) = Self::mapped(len, huge_pages) {
            return Ok(memory.faulted_in());
        }
        let mut slots = Vec::new();
        slots.try_reserve_exact(len)?;
        slots.resize(len, EMPTY);
        Ok(SlotMemory(Inner::Heap(slots)))
    }

    /// Writes one slot per 4 KiB so that every page is in place before the first insert:
    /// a huge page's first touch zeroes 2 MiB (and may wait for the kernel to compact
    /// memory), which is better paid when the table is made than inside a later call.
    fn faulted_in(mut self) -> SlotMemory {
        const STRIDE: usize = 4096 / size_of::<Slot>();
        for slot in self.iter_mut().step_by(STRIDE) {
            *slot = EMPTY;
        }
        self
    }

    /// Whether the slots live in a mapping advised for huge pages.
    pub(crate) fn is_mapped(&self) -> bool {
        !matches!(self.0, Inner::Heap(_))
    }

    /// A mapping for `len` slots if huge pages are wanted, the table is large enough and
    /// the OS maps and advises it; `None` sends the caller to the heap (an OS without
    /// transparent huge pages refuses the advice, and the mapping is dropped again).
    #[cfg(target_os = "linux")]
    fn mapped(len: usize, huge_pages: bool) -> Option<SlotMemory> {
        let bytes = len.checked_mul(size_of::<Slot>())?;
        if !huge_pages || bytes < HUGE_PAGE_MIN_BYTES {
            return None;
        }
        // Whole huge pages: the table takes the slots up to the next 2 MiB (a lower load,
        // not waste), and the kernel aligns a mapping of whole huge pages to 2 MiB.
        let mapped_bytes = bytes.div_ceil(HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES;
        let map = memmap2::MmapMut::map_anon(mapped_bytes).ok()?;
        map.advise(memmap2::Advice::HugePage).ok()?;
        let slots = mapped_bytes / size_of::<Slot>();
        Some(SlotMemory(Inner::Mapped(map, slots)))
    }

    #[cfg(not(target_os = "linux"))]
    fn mapped(_len: usize, _huge_pages: bool) -> Option<SlotMemory> {
        None
    }
}

impl Deref for SlotMemory {
    type Target = [Slot];

    #[inline]
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn deref(&self) -> &[Slot] {
        match &self.0 {
            Inner::Heap(slots) => slots,
            // A mapping is page-aligned and holds `slots * 12` bytes, so the cast's
            // alignment and length checks always pass.
            #[cfg(target_os = "linux")]
            Inner::Mapped(map, slots) => bytemuck::cast_slice(&map[..slots * size_of::<Slot>()]),
        }
    }
}

impl DerefMut for SlotMemory {
    #[inline]
    #[expect(
        clippy::indexing_slicing,
        reason = "every index is below a length fixed at construction (shard count, table capacity, batch size)"
    )]
    fn deref_mut(&mut self) -> &mut [Slot] {
        match &mut self.0 {
            Inner::Heap(slots) => slots,
            #[cfg(target_os = "linux")]
            Inner::Mapped(map, slots) => {
                bytemuck::cast_slice_mut(&mut map[..*slots * size_of::<Slot>()])
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_tables_stay_on_the_heap_and_large_ones_read_as_empty_slots() {
        let small = SlotMemory::zeroed(16, true);
        assert!(!small.is_mapped());
        assert_eq!(small.len(), 16);
        let len = HUGE_PAGE_MIN_BYTES / size_of::<Slot>() + 5;
        let unadvised = SlotMemory::written(len);
        assert!(!unadvised.is_mapped());
        assert!(unadvised.iter().all(|slot| *slot == EMPTY));
        let mut large = SlotMemory::try_zeroed(len, true).unwrap();
        assert!(large.len() >= len);
        let len = large.len();
        assert!(large.iter().all(|slot| *slot == EMPTY));
        large[len - 1] = [1, 2, 3];
        assert_eq!(large[len - 1], [1, 2, 3]);
        #[cfg(target_os = "linux")]
        {
            // MADV_HUGEPAGE is accepted wherever the kernel has transparent huge pages.
            if std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled").exists() {
                assert!(large.is_mapped());
            }
        }
    }
}
