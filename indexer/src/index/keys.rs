//! The kinds of u64 the index keeps apart: a pod's key, a block hash as vLLM
//! reports it, and kvroute's own chained block hash. Each is a transparent
//! newtype, so that the compiler refuses mixing them and a table entry is no
//! larger than the bare u64 (the derived `Hash` writes the one u64, which is
//! what [`super::MixHasher`] mixes).
//!
//! Conversions happen at the edges only: where a decoded event, a core feed
//! or lookup type (which carry u64 on the wire) enters or leaves the index.

use kvroute_core::hash::index_key;

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

/// kvroute's chained block hash (`kvroute_core::hash`): what the indexer
/// computes from an event's tokens, and what the feed, lookups and learned
/// posts carry.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct BlockHash(u64);

impl BlockHash {
    pub(crate) const fn new(hash: u64) -> BlockHash {
        BlockHash(hash)
    }

    pub const fn get(self) -> u64 {
        self.0
    }

    /// The bits the routing index compares (`kvroute_core::hash::index_key`).
    pub fn index_key(self) -> u64 {
        index_key(self.0)
    }
}
