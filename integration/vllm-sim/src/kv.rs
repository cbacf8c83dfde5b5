//! Paged KV cache with prefix caching, as vLLM V1's `BlockPool`.
//!
//! - N blocks of `block_size` tokens; a request holds a block table.
//! - Full blocks get a chained hash and enter the prefix cache
//!   (`hash -> blocks`); blocks are reference counted, so requests sharing a
//!   prefix share blocks.
//! - A block whose count drops to 0 stays cached and goes to the tail of the
//!   free queue; new blocks are taken from the head (least recently freed
//!   first), evicting the cached hash there (BlockRemoved). A request frees its
//!   blocks tail-first, so its last blocks are evicted before its first ones.
//! - A cache hit on a free block takes it out of the free queue (touch).
//!
//! The free queue is a FIFO of `(block, stamp)` with lazy deletion: touching a
//! free block bumps its stamp, making its queue entry stale. O(1) amortised.

use std::collections::{HashMap, VecDeque};

use crate::events::{Group, KvEvent, Medium};
use crate::hash::BlockHash;

#[derive(Debug, Clone, Default)]
struct Block {
    hash: Option<BlockHash>,
    ref_cnt: u32,
    /// Stamp of the block's live entry in the free queue (0 = not free).
    free_stamp: u64,
    /// Sliding-window groups (bit g-1 for group g) that still hold this block's hash.
    sliding_held: u32,
}

#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    free: VecDeque<(u32, u64)>,
    num_free: usize,
    next_stamp: u64,
    cached: HashMap<BlockHash, Vec<u32>>,
    events: Vec<KvEvent>,
    /// KV-cache groups of the model: group 0 full attention, then sliding-window groups.
    groups: Vec<Group>,
}

impl BlockPool {
    /// A pool of `num_blocks` blocks for a model whose KV-cache groups are `groups`
    /// (`[Group::PLAIN]` for a plain model).
    pub fn new(num_blocks: usize, groups: Vec<Group>) -> Self {
        let mut pool = Self {
            blocks: vec![Block::default(); num_blocks],
            free: VecDeque::with_capacity(num_blocks),
            num_free: 0,
            next_stamp: 1,
            cached: HashMap::new(),
            events: Vec::new(),
            groups,
        };
        for id in 0..num_blocks as u32 {
            pool.push_free(id);
        }
        pool
    }

    fn push_free(&mut self, id: u32) {
        let stamp = self.next_stamp;
        self.next_stamp += 1;
        if let Some(b) = self.blocks.get_mut(id as usize) {
            b.free_stamp = stamp;
            self.free.push_back((id, stamp));
            self.num_free += 1;
        }
        // Keep stale entries bounded.
        if self.free.len() > 2 * self.blocks.len() + 64 {
            let blocks = &self.blocks;
            self.free
                .retain(|(id, s)| blocks.get(*id as usize).is_some_and(|b| b.free_stamp == *s));
        }
    }

    pub fn num_free(&self) -> usize {
        self.num_free
    }

    #[cfg(test)]
    pub fn num_cached(&self) -> usize {
        self.cached.len()
    }

    /// vLLM's KV usage: fraction of blocks not in the free queue.
    pub fn usage(&self) -> f64 {
        if self.blocks.is_empty() {
            return 0.0;
        }
        1.0 - self.num_free as f64 / self.blocks.len() as f64
    }

    /// Longest cached prefix of `hashes`: the block ids of the hit blocks.
    pub fn cached_prefix(&self, hashes: &[BlockHash]) -> Vec<u32> {
        let mut out = Vec::new();
        for h in hashes {
            match self.cached.get(h).and_then(|v| v.first()) {
                Some(id) => out.push(*id),
                None => break,
            }
        }
        out
    }

    /// How many of `ids` are currently free (and would be taken out of the free queue by `touch`).
    pub fn count_free(&self, ids: &[u32]) -> usize {
        ids.iter()
            .filter(|id| {
                self.blocks
                    .get(**id as usize)
                    .is_some_and(|b| b.ref_cnt == 0)
            })
            .count()
    }

    /// Takes a reference on hit blocks.
    pub fn touch(&mut self, ids: &[u32]) {
        for id in ids {
            if let Some(b) = self.blocks.get_mut(*id as usize) {
                if b.ref_cnt == 0 {
                    b.free_stamp = 0;
                    self.num_free -= 1;
                }
                b.ref_cnt += 1;
            }
        }
    }

    /// Allocates `n` fresh blocks from the head of the free queue, evicting their cached hashes.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        while out.len() < n {
            let (id, stamp) = self.free.pop_front()?;
            let live = self
                .blocks
                .get(id as usize)
                .is_some_and(|b| b.free_stamp == stamp && b.ref_cnt == 0);
            if !live {
                continue;
            }
            self.num_free -= 1;
            self.evict(id);
            if let Some(b) = self.blocks.get_mut(id as usize) {
                b.free_stamp = 0;
                b.ref_cnt = 1;
            }
            out.push(id);
        }
        Some(out)
    }

    fn evict(&mut self, id: u32) {
        let Some(h) = self.blocks.get_mut(id as usize).and_then(|b| b.hash.take()) else {
            return;
        };
        if let Some(ids) = self.cached.get_mut(&h) {
            ids.retain(|x| *x != id);
            if ids.is_empty() {
                self.cached.remove(&h);
            }
        }
        let held = self
            .blocks
            .get_mut(id as usize)
            .map_or(0, |b| std::mem::take(&mut b.sliding_held));
        for g in &self.groups {
            if g.idx == 0 || held & Self::sliding_bit(g.idx) != 0 {
                self.events.push(KvEvent::BlockRemoved {
                    block_hashes: vec![h],
                    medium: Medium::Gpu,
                    group: Some(*g),
                });
            }
        }
    }

    fn sliding_bit(group_idx: u32) -> u32 {
        1u32.checked_shl(group_idx.saturating_sub(1)).unwrap_or(0)
    }

    /// The model's KV-cache groups (group 0 first).
    pub fn groups(&self) -> &[Group] {
        &self.groups
    }

    /// A sliding-window group no longer needs block `id` (it left the window): vLLM frees it
    /// from that group, whose copy of the hash goes (BlockRemoved for that group). Once only.
    pub fn leave_window(&mut self, id: u32, group_idx: u32) {
        let bit = Self::sliding_bit(group_idx);
        let Some(b) = self.blocks.get_mut(id as usize) else {
            return;
        };
        let (Some(h), true) = (b.hash, b.sliding_held & bit != 0) else {
            return;
        };
        b.sliding_held &= !bit;
        if let Some(g) = self.groups.iter().find(|g| g.idx == group_idx) {
            self.events.push(KvEvent::BlockRemoved {
                block_hashes: vec![h],
                medium: Medium::Gpu,
                group: Some(*g),
            });
        }
    }

    /// Releases a request's blocks; vLLM frees them tail-first so the tail is evicted first.
    pub fn free_blocks(&mut self, ids: &[u32]) {
        for id in ids.iter().rev() {
            let now_free = match self.blocks.get_mut(*id as usize) {
                Some(b) if b.ref_cnt > 0 => {
                    b.ref_cnt -= 1;
                    b.ref_cnt == 0
                }
                _ => false,
            };
            if now_free {
                self.push_free(*id);
            }
        }
    }

    /// Registers a full block under `hash` in every group (the caller emits BlockStored).
    /// Like vLLM, an identical block already cached is not deduplicated: both stay cached.
    pub fn cache_block(&mut self, id: u32, hash: BlockHash) {
        let sliding_all = self.groups.iter().fold(0, |m, g| {
            m | if g.idx == 0 {
                0
            } else {
                Self::sliding_bit(g.idx)
            }
        });
        if let Some(b) = self.blocks.get_mut(id as usize) {
            if b.hash.is_some() {
                return;
            }
            b.hash = Some(hash);
            b.sliding_held = sliding_all;
            self.cached.entry(hash).or_default().push(id);
        }
    }

    pub fn push_event(&mut self, ev: KvEvent) {
        self.events.push(ev);
    }

    pub fn take_events(&mut self) -> Vec<KvEvent> {
        std::mem::take(&mut self.events)
    }

    /// Drops the whole prefix cache (vLLM's reset_prefix_cache): AllBlocksCleared.
    /// Blocks held by running requests stay allocated; they just lose their hash.
    pub fn reset_prefix_cache(&mut self) {
        for b in &mut self.blocks {
            b.hash = None;
            b.sliding_held = 0;
        }
        self.cached.clear();
        self.events.push(KvEvent::AllBlocksCleared);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::chain;

    fn removed(evs: &[KvEvent]) -> Vec<BlockHash> {
        evs.iter()
            .filter_map(|e| match e {
                KvEvent::BlockRemoved { block_hashes, .. } => Some(block_hashes[0]),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn hits_misses_and_refcounts() {
        let mut p = BlockPool::new(8, vec![Group::PLAIN]);
        let toks: Vec<u32> = (0..48).collect();
        let hs = chain(&toks, 16);
        assert!(p.cached_prefix(&hs).is_empty());
        let ids = p.allocate(3).unwrap();
        for (id, h) in ids.iter().zip(&hs) {
            p.cache_block(*id, *h);
        }
        assert_eq!(p.cached_prefix(&hs), ids);
        // A different second block: hit only the first.
        let mut other = toks.clone();
        other[20] = 7;
        assert_eq!(p.cached_prefix(&chain(&other, 16)), vec![ids[0]]);
        // Shared blocks: touch, free by both owners, still cached.
        p.touch(&ids[..2]);
        assert_eq!(p.num_free(), 5);
        p.free_blocks(&ids);
        assert_eq!(p.num_free(), 6);
        p.free_blocks(&ids[..2]);
        assert_eq!(p.num_free(), 8);
        assert_eq!(p.cached_prefix(&hs), ids);
        assert_eq!(p.usage(), 0.0);
        // Touching a free cached block removes it from the free queue.
        p.touch(&ids[..1]);
        assert_eq!(p.num_free(), 7);
        assert!((p.usage() - 0.125).abs() < 1e-9);
        assert!(p.allocate(8).is_none());
    }

    #[test]
    fn eviction_is_lru_and_tail_first() {
        let mut p = BlockPool::new(4, vec![Group::PLAIN]);
        let a: Vec<u32> = (0..32).collect();
        let b: Vec<u32> = (100..132).collect();
        let ha = chain(&a, 16);
        let hb = chain(&b, 16);
        let ia = p.allocate(2).unwrap();
        ia.iter().zip(&ha).for_each(|(i, h)| p.cache_block(*i, *h));
        let ib = p.allocate(2).unwrap();
        ib.iter().zip(&hb).for_each(|(i, h)| p.cache_block(*i, *h));
        p.take_events();
        // Free A first (tail first), then B: free order a1, a0, b1, b0.
        p.free_blocks(&ia);
        p.free_blocks(&ib);
        // Need one block: evicts A's tail block first.
        let x = p.allocate(1).unwrap();
        assert_eq!(x, vec![ia[1]]);
        assert_eq!(removed(&p.take_events()), vec![ha[1]]);
        assert_eq!(p.cached_prefix(&ha), vec![ia[0]]);
        // Touch B (a hit) then free it again: it moves to the MRU end.
        p.touch(&ib);
        p.free_blocks(&ib);
        let y = p.allocate(2).unwrap();
        assert_eq!(y, vec![ia[0], ib[1]]);
        assert_eq!(removed(&p.take_events()), vec![ha[0], hb[1]]);
        assert_eq!(p.cached_prefix(&hb), vec![ib[0]]);
        assert_eq!(p.num_cached(), 1);
    }

    #[test]
    fn reset_clears_everything_and_emits_event() {
        let mut p = BlockPool::new(4, vec![Group::PLAIN]);
        let hs = chain(&(0..32).collect::<Vec<u32>>(), 16);
        let ids = p.allocate(2).unwrap();
        ids.iter().zip(&hs).for_each(|(i, h)| p.cache_block(*i, *h));
        p.free_blocks(&ids);
        p.reset_prefix_cache();
        assert!(p.cached_prefix(&hs).is_empty());
        assert_eq!(p.take_events(), vec![KvEvent::AllBlocksCleared]);
        // Evicting a cleared block emits nothing.
        p.allocate(4).unwrap();
        assert!(p.take_events().is_empty());
    }

    #[test]
    fn stale_queue_entries_stay_bounded() {
        let mut p = BlockPool::new(4, vec![Group::PLAIN]);
        for _ in 0..1000 {
            let ids = p.allocate(4).unwrap();
            p.free_blocks(&ids);
            p.touch(&ids);
            p.free_blocks(&ids);
        }
        assert!(p.free.len() <= 2 * 4 + 64 + 1);
        assert_eq!(p.num_free(), 4);
    }
}
