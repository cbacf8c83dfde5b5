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

use crate::events::KvEvent;
use crate::hash::BlockHash;

#[derive(Debug, Clone, Default)]
struct Block {
    hash: Option<BlockHash>,
    ref_cnt: u32,
    /// Stamp of the block's live entry in the free queue (0 = not free).
    free_stamp: u64,
}

#[derive(Debug)]
pub struct BlockPool {
    blocks: Vec<Block>,
    free: VecDeque<(u32, u64)>,
    num_free: usize,
    next_stamp: u64,
    cached: HashMap<BlockHash, Vec<u32>>,
    events: Vec<KvEvent>,
}

impl BlockPool {
    pub fn new(num_blocks: usize) -> Self {
        let mut pool = Self {
            blocks: vec![Block::default(); num_blocks],
            free: VecDeque::with_capacity(num_blocks),
            num_free: 0,
            next_stamp: 1,
            cached: HashMap::new(),
            events: Vec::new(),
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
        self.events.push(KvEvent::BlockRemoved {
            block_hashes: vec![h],
        });
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

    /// Registers a block that just became full under `hash` (the caller emits BlockStored).
    pub fn cache_block(&mut self, id: u32, hash: BlockHash) {
        if let Some(b) = self.blocks.get_mut(id as usize) {
            if b.hash.is_some() {
                return;
            }
            b.hash = Some(hash);
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
                KvEvent::BlockRemoved { block_hashes } => Some(block_hashes[0]),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn hits_misses_and_refcounts() {
        let mut p = BlockPool::new(8);
        let toks: Vec<u32> = (0..48).collect();
        let hs = chain(&toks, 16, None);
        assert!(p.cached_prefix(&hs).is_empty());
        let ids = p.allocate(3).unwrap();
        for (id, h) in ids.iter().zip(&hs) {
            p.cache_block(*id, *h);
        }
        assert_eq!(p.cached_prefix(&hs), ids);
        // A different second block: hit only the first.
        let mut other = toks.clone();
        other[20] = 7;
        assert_eq!(p.cached_prefix(&chain(&other, 16, None)), vec![ids[0]]);
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
        let mut p = BlockPool::new(4);
        let a: Vec<u32> = (0..32).collect();
        let b: Vec<u32> = (100..132).collect();
        let ha = chain(&a, 16, None);
        let hb = chain(&b, 16, None);
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
        let mut p = BlockPool::new(4);
        let hs = chain(&(0..32).collect::<Vec<u32>>(), 16, None);
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
        let mut p = BlockPool::new(4);
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
