//! What the indexer benches share: a seeded random source for synthetic
//! block hashes and token ids.

/// Xorshift64: reproducible streams, no dependency.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// `blocks` blocks of `block_size` random token ids of a 151k vocabulary.
    pub fn tokens(&mut self, blocks: usize, block_size: usize) -> Vec<u32> {
        (0..blocks * block_size)
            .map(|_| (self.next() % 151_000) as u32)
            .collect()
    }
}
