//! The CPU tier of an emulated OffloadingConnector.

use std::collections::{HashSet, VecDeque};

use crate::events::{KvEvent, Medium};
use crate::hash::BlockHash;
use crate::kv::BlockPool;

/// The CPU tier of an emulated OffloadingConnector: which hashes it holds, oldest first.
/// It only produces vLLM's events (placeholder stores, CPU removals); requests never load from it.
pub(super) struct CpuTier {
    capacity: usize,
    order: VecDeque<BlockHash>,
    held: HashSet<BlockHash>,
    /// Blocks computed in the last step, offloaded (and published) with the next step.
    pending: Vec<BlockHash>,
}

impl CpuTier {
    pub(super) fn new(capacity: usize) -> CpuTier {
        CpuTier {
            capacity,
            order: VecDeque::new(),
            held: HashSet::new(),
            pending: Vec::new(),
        }
    }

    /// Blocks a step computed: offloaded with the next step.
    pub(super) fn computed(&mut self, hashes: &[BlockHash]) {
        self.pending.extend_from_slice(hashes);
    }

    /// Forgets every block (the prefix cache was reset).
    pub(super) fn clear(&mut self) {
        self.order.clear();
        self.held.clear();
        self.pending.clear();
    }

    pub(super) fn offload(&mut self, pool: &mut BlockPool) {
        let mut stored = Vec::new();
        for h in std::mem::take(&mut self.pending) {
            if !self.held.insert(h) {
                continue;
            }
            if self.order.len() >= self.capacity {
                if let Some(old) = self.order.pop_front() {
                    self.held.remove(&old);
                    pool.push_event(KvEvent::BlockRemoved {
                        block_hashes: vec![old],
                        medium: Medium::Cpu,
                        group: None,
                    });
                }
            }
            self.order.push_back(h);
            stored.push(h);
        }
        if !stored.is_empty() {
            pool.push_event(KvEvent::cpu_placeholder(stored));
        }
    }
}
