//! Asks the CPU to start loading cache lines that a loop is about to read.
//!
//! Applying a BlockStored event probes two tables per block (the group's
//! source table and the block table), each at random, so nearly every probe
//! misses the cache. Announcing all of an event's lines before the first
//! probe lets the misses overlap instead of following one another.

/// Starts loading the cache lines of `items` (a hint: nothing is read, and
/// on targets without a prefetch instruction it does nothing).
pub(super) fn prefetch<T>(items: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        const LINE: usize = 64;
        let start = items.as_ptr().cast::<i8>();
        let bytes = std::mem::size_of_val(items);
        // The first line, every line after it, and the last (a bucket need
        // not start on a line boundary).
        let hint = |offset: usize| {
            // SAFETY: SSE is part of every x86_64 target, and a prefetch
            // neither reads nor faults, whatever the address.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(start.wrapping_add(offset)) }
        };
        let mut offset = 0;
        while offset < bytes {
            hint(offset);
            offset += LINE;
        }
        if bytes > 0 {
            hint(bytes - 1);
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = items;
}
