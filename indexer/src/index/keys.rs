//! The kinds of u64 the index keeps apart: a pod's key, a block hash as vLLM
//! reports it, and kvroute's own chained block hash (kvroute_core's
//! [`BlockHash`], with its [`IndexKey`](kvroute_core::hash::IndexKey)). Each
//! is a transparent newtype, so that the compiler refuses mixing them and a
//! table entry is no larger than the bare u64 (the derived `Hash` writes the
//! one u64, which is what [`super::MixHasher`] mixes).
//!
//! Conversions happen at the edges only: where a decoded event or a core
//! feed type (which carries u64 on the wire) enters or leaves the index.

/// One past the largest index key: the key space snapshot pages cut into
/// ranges.
pub(super) const KEY_END: u64 = 1 << kvroute_core::hash::INDEX_KEY_BITS;

/// The index's key of a pod: assigned when the pod becomes known, stable
/// while it stays known, never reused within a run. Pod keys order the feed's
/// snapshot pages and break ties in the least-loaded order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct PodKey(u64);

impl PodKey {
    /// The first key handed out.
    pub(crate) const FIRST: PodKey = PodKey(1);

    pub(crate) const fn new(key: u64) -> PodKey {
        PodKey(key)
    }

    pub const fn get(self) -> u64 {
        self.0
    }

    /// The key handed out after this one.
    pub(crate) const fn next(self) -> PodKey {
        PodKey(self.0 + 1)
    }
}

/// A block hash as a vLLM pod reports it (`block_hashes`, `parent_block_hash`):
/// an opaque id of a block on that publisher, used only to find the block
/// again (as its children's parent, in its removal). Never a [`BlockHash`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(transparent)]
pub struct VllmHash(u64);

impl VllmHash {
    pub(crate) const fn new(hash: u64) -> VllmHash {
        VllmHash(hash)
    }
}

/// kvroute's chained block hash: core's type, which the indexer computes
/// from an event's tokens and the feed, lookups and learned posts carry.
pub use kvroute_core::hash::BlockHash;
