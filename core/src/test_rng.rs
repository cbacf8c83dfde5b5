//! Deterministic pseudo-random numbers for tests that generate many cases
//! (xorshift64: fast, and the same cases on every run).

/// Successive xorshift64 outputs from `seed` (any but 0).
pub(crate) fn xorshift(seed: u64) -> impl FnMut() -> u64 {
    let mut x = seed;
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}
