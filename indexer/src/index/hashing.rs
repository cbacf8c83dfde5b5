//! Hashing for keys that are already hashes, and the map type built on it.

use std::collections::HashMap;
use std::hash::{BuildHasher, Hash, Hasher};

/// Hasher for keys that are already hashes: one multiply-xorshift.
#[derive(Default, Clone, Copy)]
pub struct MixHasher(pub(super) u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        let y = self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        y ^ (y >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 ^= v;
    }
}

/// Builds [`MixHasher`]s.
#[derive(Default, Clone, Copy)]
pub struct BuildMix;

impl BuildHasher for BuildMix {
    type Hasher = MixHasher;
    fn build_hasher(&self) -> MixHasher {
        MixHasher(0)
    }
}

/// [`MixHasher`] of one hash (a u64 or one of the [`super::keys`] newtypes:
/// both write one u64).
pub(super) fn mix(h: impl Hash) -> u64 {
    BuildMix.hash_one(h)
}

/// A map keyed by a hash or a pod key.
pub(super) type Map<K, V> = HashMap<K, V, BuildMix>;

/// Bytes a hashbrown table holds for `capacity` entries of `entry` bytes
/// (a control byte per bucket, buckets a power of two at most 7/8 full).
pub(super) fn table_bytes(capacity: usize, entry: usize) -> usize {
    let buckets = if capacity == 0 {
        0
    } else {
        (capacity * 8 / 7).next_power_of_two()
    };
    buckets * (entry + 1)
}

/// Bytes a [`Map`] holds.
pub(super) fn map_bytes<K, V>(m: &Map<K, V>) -> usize {
    table_bytes(m.capacity(), std::mem::size_of::<(K, V)>())
}
