//! Per-pod block tables: which chained block hashes a pod holds.
//!
//! One open-addressing table per pod, sized once from the pod's KV capacity
//! (wasm memory never shrinks, so nothing grows after start): 8-byte key and
//! 4-byte stamp per slot at a load factor of at most 0.8, i.e. 15 bytes per
//! block. Stamps order entries for LRU eviction; within one routed prompt the
//! tail gets the oldest stamp, so the tail is evicted first and the cached
//! set stays prefix-closed the way vLLM's is. Full tables evict their oldest
//! sixteenth in one sweep, which keeps the per-insert cost constant.

use crate::hash::index_key;
use std::collections::VecDeque;

pub use crate::feed::Tier;

fn tier_bits(tier: Tier) -> u32 {
    u32::from(tier.code())
}

fn tier_from_bits(bits: u32) -> Tier {
    Tier::from_code((bits & 3) as u8).unwrap_or(Tier::Learned)
}

/// Precise tiers are facts reported by the pod; only `Learned` ages by TTL.
fn is_precise(tier: Tier) -> bool {
    tier != Tier::Learned
}

const EMPTY: u64 = 0;
const STAMP_BITS: u32 = 30;
const STAMP_MASK: u32 = (1 << STAMP_BITS) - 1;
/// Time checkpoints kept for TTL; at one per active second this covers more
/// than an hour, beyond any sensible TTL.
const MAX_MARKS: usize = 4096;

/// What a lookup may trust.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MatchRules {
    /// Learned entries stamped before this are expired (see [`PodTable::learned_cutoff`]).
    pub learned_cutoff: u32,
    /// False while the indexer feed is stale: precise entries are then ignored.
    pub trust_precise: bool,
    /// Credit of a CPU-tier block relative to GPU.
    pub cpu_credit: f64,
    /// Credit of a disk-tier block relative to GPU.
    pub disk_credit: f64,
}

/// Result of a longest-prefix lookup on one pod.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PrefixMatch {
    /// Leading blocks held in any trusted tier.
    pub blocks: usize,
    /// Blocks weighted by tier credit (== `blocks` when all are GPU or learned).
    pub credit: f64,
}

/// The block table of one pod.
#[derive(Debug, Clone)]
pub struct PodTable {
    keys: Vec<u64>,
    /// Tier in the top two bits, stamp in the rest.
    meta: Vec<u32>,
    len: usize,
    capacity: usize,
    clock: u32,
    /// (first stamp issued in a second, that second): maps TTL to stamps.
    marks: VecDeque<(u32, u32)>,
    lower_tier_entries: usize,
}

impl PodTable {
    /// A table holding at most `capacity` blocks.
    pub fn new(capacity: usize) -> PodTable {
        let capacity = capacity.max(1);
        let slots = capacity + capacity / 4 + 1;
        PodTable {
            keys: vec![EMPTY; slots],
            meta: vec![0; slots],
            len: 0,
            capacity,
            clock: 0,
            marks: VecDeque::new(),
            lower_tier_entries: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes held by the table's arrays (what sizing guides quote).
    pub fn memory_bytes(&self) -> usize {
        self.keys.len() * (std::mem::size_of::<u64>() + std::mem::size_of::<u32>())
    }

    /// Records `hashes` (a chain from block 0) as held in `tier`, most
    /// recently used first. A learned entry never downgrades a precise one.
    pub fn touch_chain(&mut self, hashes: &[u64], tier: Tier, now_s: u32) {
        let hashes = &hashes[..hashes.len().min(self.capacity)];
        if hashes.is_empty() {
            return;
        }
        self.reserve_stamps(hashes.len() as u32);
        if self.marks.back().is_none_or(|&(_, second)| second != now_s) {
            if self.marks.len() == MAX_MARKS {
                self.marks.pop_front();
            }
            self.marks.push_back((self.clock, now_s));
        }
        let newest = self.clock + hashes.len() as u32 - 1;
        self.clock += hashes.len() as u32;
        for (i, &hash) in hashes.iter().enumerate() {
            self.upsert(key_of(hash), tier, newest - i as u32);
        }
    }

    /// Forgets blocks (vLLM evicted them).
    pub fn remove(&mut self, hashes: &[u64]) {
        for &hash in hashes {
            if let Some(slot) = self.find(key_of(hash)) {
                self.delete_at(slot);
            }
        }
    }

    /// Forgets the learned entries among `hashes`; precise entries are the
    /// pod's own report and stay.
    pub fn remove_learned(&mut self, hashes: &[u64]) {
        for &hash in hashes {
            if let Some(slot) = self.find(key_of(hash)) {
                if !is_precise(tier_from_bits(self.meta[slot] >> STAMP_BITS)) {
                    self.delete_at(slot);
                }
            }
        }
    }

    /// Forgets every learned entry (the pod failed: what the proxy guessed
    /// about its cache can no longer be trusted).
    pub fn clear_learned(&mut self) {
        let learned: Vec<u64> = self
            .keys
            .iter()
            .zip(&self.meta)
            .filter(|(&k, &m)| k != EMPTY && !is_precise(tier_from_bits(m >> STAMP_BITS)))
            .map(|(&k, _)| k)
            .collect();
        for key in learned {
            if let Some(slot) = self.find(key) {
                self.delete_at(slot);
            }
        }
    }

    /// Forgets every block (pod restarted or cleared its cache).
    pub fn clear(&mut self) {
        self.keys.fill(EMPTY);
        self.meta.fill(0);
        self.len = 0;
        self.lower_tier_entries = 0;
    }

    /// The stamp before which learned entries are older than `ttl_s`.
    /// Marks are in increasing seconds: a binary search, so the cost per
    /// decision does not grow with how long the table has been learning.
    pub fn learned_cutoff(&self, now_s: u32, ttl_s: u32) -> u32 {
        let horizon = now_s.saturating_sub(ttl_s);
        let first_live = self.marks.partition_point(|&(_, second)| second <= horizon);
        self.marks
            .get(first_live)
            .map_or(self.clock, |&(stamp, _)| stamp)
    }

    /// Longest cached prefix of `hashes` on this pod. Relies on the chain
    /// property (block i cached ⇒ blocks 0..i cached) to gallop and bisect:
    /// O(log n) probes per pod instead of one per block.
    pub fn prefix_match(&self, hashes: &[u64], rules: &MatchRules) -> PrefixMatch {
        let tier_at = |i: usize| -> Option<Tier> {
            let slot = self.find(key_of(hashes[i]))?;
            let meta = self.meta[slot];
            let tier = tier_from_bits(meta >> STAMP_BITS);
            let live = if is_precise(tier) {
                rules.trust_precise
            } else {
                (meta & STAMP_MASK) >= rules.learned_cutoff
            };
            live.then_some(tier)
        };
        let full = prefix_len(hashes.len(), |i| {
            matches!(tier_at(i), Some(Tier::Gpu | Tier::Learned))
        });
        if self.lower_tier_entries == 0 || !rules.trust_precise {
            return PrefixMatch {
                blocks: full,
                credit: full as f64,
            };
        }
        let cpu = prefix_len(hashes.len(), |i| {
            matches!(tier_at(i), Some(Tier::Gpu | Tier::Learned | Tier::Cpu))
        });
        let any = prefix_len(hashes.len(), |i| tier_at(i).is_some());
        let cpu = cpu.max(full);
        let any = any.max(cpu);
        PrefixMatch {
            blocks: any,
            credit: full as f64
                + (cpu - full) as f64 * rules.cpu_credit
                + (any - cpu) as f64 * rules.disk_credit,
        }
    }

    /// The same entries in a table of another capacity, in LRU order (the
    /// oldest go first if they no longer fit). Learned entries restart their TTL.
    pub fn resized(&self, capacity: usize, now_s: u32) -> PodTable {
        let mut table = PodTable::new(capacity);
        for (hash, tier) in self.entries_oldest_first() {
            table.touch_chain(&[hash], tier, now_s);
        }
        table
    }

    /// Live entries as (hash, tier), oldest first: what a snapshot carries.
    pub fn entries_oldest_first(&self) -> Vec<(u64, Tier)> {
        let mut entries: Vec<(u32, u64, Tier)> = self
            .keys
            .iter()
            .zip(&self.meta)
            .filter(|(&k, _)| k != EMPTY)
            .map(|(&k, &m)| (m & STAMP_MASK, k, tier_from_bits(m >> STAMP_BITS)))
            .collect();
        entries.sort_unstable_by_key(|&(stamp, _, _)| stamp);
        entries.into_iter().map(|(_, k, t)| (k, t)).collect()
    }

    fn home(&self, key: u64) -> usize {
        // Keys are index keys, uniform in their low 40 bits: multiply-shift of
        // the low 32 maps them onto any table size (< 2^32 slots) without a
        // modulo or a 128-bit product, which wasm32 would emulate. (The top 32
        // bits of an index key hold only 8 bits: 256 home slots, probe chains
        // as long as the table.)
        ((u64::from(key as u32) * self.keys.len() as u64) >> 32) as usize
    }

    fn next(&self, slot: usize) -> usize {
        if slot + 1 == self.keys.len() {
            0
        } else {
            slot + 1
        }
    }

    fn find(&self, key: u64) -> Option<usize> {
        let mut slot = self.home(key);
        loop {
            match self.keys[slot] {
                EMPTY => return None,
                k if k == key => return Some(slot),
                _ => slot = self.next(slot),
            }
        }
    }

    fn upsert(&mut self, key: u64, tier: Tier, stamp: u32) {
        if let Some(slot) = self.find(key) {
            let old = tier_from_bits(self.meta[slot] >> STAMP_BITS);
            let tier = if is_precise(old) && !is_precise(tier) {
                old
            } else {
                tier
            };
            self.count_tier(old, false);
            self.count_tier(tier, true);
            self.meta[slot] = (tier_bits(tier) << STAMP_BITS) | stamp;
            return;
        }
        if self.len >= self.capacity {
            self.evict_oldest((self.capacity / 16).max(1));
        }
        self.place(key, (tier_bits(tier) << STAMP_BITS) | stamp);
        self.len += 1;
        self.count_tier(tier, true);
    }

    fn place(&mut self, key: u64, meta: u32) {
        let mut slot = self.home(key);
        while self.keys[slot] != EMPTY {
            slot = self.next(slot);
        }
        self.keys[slot] = key;
        self.meta[slot] = meta;
    }

    fn count_tier(&mut self, tier: Tier, add: bool) {
        if matches!(tier, Tier::Cpu | Tier::Disk) {
            if add {
                self.lower_tier_entries += 1;
            } else {
                self.lower_tier_entries = self.lower_tier_entries.saturating_sub(1);
            }
        }
    }

    /// Backward-shift deletion keeps probe chains intact without tombstones.
    fn delete_at(&mut self, mut hole: usize) {
        self.count_tier(tier_from_bits(self.meta[hole] >> STAMP_BITS), false);
        self.keys[hole] = EMPTY;
        self.len -= 1;
        let mut slot = hole;
        loop {
            slot = self.next(slot);
            let key = self.keys[slot];
            if key == EMPTY {
                return;
            }
            let home = self.home(key);
            let stays = if hole <= slot {
                hole < home && home <= slot
            } else {
                hole < home || home <= slot
            };
            if !stays {
                self.keys[hole] = key;
                self.meta[hole] = self.meta[slot];
                self.keys[slot] = EMPTY;
                hole = slot;
            }
        }
    }

    /// The stamp of the least recently used entry (the clock when empty).
    fn oldest_stamp(&self) -> u32 {
        self.keys
            .iter()
            .zip(&self.meta)
            .filter(|(&k, _)| k != EMPTY)
            .map(|(_, &m)| m & STAMP_MASK)
            .min()
            .unwrap_or(self.clock)
    }

    /// Evicts about `count` of the oldest entries: a histogram of stamps finds
    /// the cut, one pass empties the slots, one pass re-seats the survivors.
    fn evict_oldest(&mut self, count: usize) {
        const BUCKETS: usize = 256;
        let oldest = self.oldest_stamp();
        let span = (self.clock - oldest).max(1) as u64;
        let bucket_of = |stamp: u32| {
            (((stamp - oldest) as u64 * BUCKETS as u64) / span).min(BUCKETS as u64 - 1) as usize
        };
        let mut histogram = [0usize; BUCKETS];
        for (&k, &m) in self.keys.iter().zip(&self.meta) {
            if k != EMPTY {
                histogram[bucket_of(m & STAMP_MASK)] += 1;
            }
        }
        let mut cut_bucket = 0;
        let mut seen = 0;
        for (bucket, &n) in histogram.iter().enumerate() {
            seen += n;
            cut_bucket = bucket;
            if seen >= count {
                break;
            }
        }
        // A slot empty before the deletions: no probe chain crosses it, so
        // re-seating may start there.
        let Some(start) = self.keys.iter().position(|&k| k == EMPTY) else {
            return;
        };
        for slot in 0..self.keys.len() {
            if self.keys[slot] != EMPTY && bucket_of(self.meta[slot] & STAMP_MASK) <= cut_bucket {
                self.count_tier(tier_from_bits(self.meta[slot] >> STAMP_BITS), false);
                self.keys[slot] = EMPTY;
                self.len -= 1;
            }
        }
        self.reseat_all(start);
    }

    /// After bulk deletion, re-inserts every entry in probe order starting
    /// just past `start`, a slot that was empty before the deletions (so no
    /// probe chain crosses it). Each entry moves only towards its home and
    /// every hole is re-seated before the entries behind it: one pass
    /// restores every probe chain.
    fn reseat_all(&mut self, start: usize) {
        let mut slot = start;
        for _ in 0..self.keys.len() {
            slot = self.next(slot);
            let key = self.keys[slot];
            if key != EMPTY {
                let meta = self.meta[slot];
                self.keys[slot] = EMPTY;
                self.place(key, meta);
            }
        }
    }

    /// Keeps stamps within 30 bits: when the clock would overflow, shift every
    /// stamp down by the oldest live one (rare: once per ~10^9 blocks).
    fn reserve_stamps(&mut self, n: u32) {
        if self.clock as u64 + n as u64 <= STAMP_MASK as u64 {
            return;
        }
        let oldest = self.oldest_stamp();
        for (k, m) in self.keys.iter().zip(self.meta.iter_mut()) {
            if *k != EMPTY {
                *m = (*m & !STAMP_MASK) | ((*m & STAMP_MASK) - oldest);
            }
        }
        for mark in self.marks.iter_mut() {
            mark.0 = mark.0.saturating_sub(oldest);
        }
        self.clock -= oldest;
    }
}

/// Hash 0 marks an empty slot; fold it onto 1 (one in 2^64 collides).
/// The slot key of a block hash: its index key (see [`index_key`]), with
/// the empty marker moved aside.
fn key_of(hash: u64) -> u64 {
    match index_key(hash) {
        EMPTY => 1,
        key => key,
    }
}

/// Length of the longest prefix of 0..n for which `hit` holds, assuming hits
/// form a prefix: gallop 1, 2, 4, … then bisect.
fn prefix_len(n: usize, hit: impl Fn(usize) -> bool) -> usize {
    if n == 0 || !hit(0) {
        return 0;
    }
    let mut known_hit = 0;
    let mut step = 1;
    let mut first_miss = n;
    while known_hit + step < n {
        if hit(known_hit + step) {
            known_hit += step;
            step *= 2;
        } else {
            first_miss = known_hit + step;
            break;
        }
    }
    while first_miss - known_hit > 1 {
        let mid = known_hit + (first_miss - known_hit) / 2;
        if hit(mid) {
            known_hit = mid;
        } else {
            first_miss = mid;
        }
    }
    known_hit + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    const TRUST_ALL: MatchRules = MatchRules {
        learned_cutoff: 0,
        trust_precise: true,
        cpu_credit: 0.5,
        disk_credit: 0.25,
    };

    fn chain(seed: u64, n: usize) -> Vec<u64> {
        (0..n as u64)
            .map(|i| {
                seed.wrapping_mul(0x9e37_79b9_7f4a_7c15)
                    ^ (i + 1).wrapping_mul(0xbf58_476d_1ce4_e5b9)
            })
            .collect()
    }

    #[test]
    fn learned_cutoff_is_the_first_stamp_of_the_ttl_window() {
        let mut t = PodTable::new(1 << 14);
        // Learning in some seconds and not others, past the number of marks kept.
        let seconds: Vec<u32> = (0..6000).filter(|s| s % 3 != 1).collect();
        for &second in &seconds {
            t.touch_chain(&chain(u64::from(second), 2), Tier::Learned, second);
        }
        let linear = |now: u32, ttl: u32| {
            let horizon = now.saturating_sub(ttl);
            t.marks
                .iter()
                .find(|&&(_, second)| second > horizon)
                .map_or(t.clock, |&(stamp, _)| stamp)
        };
        for now in [0, 1, 2500, 5998, 5999, 7000, 20_000] {
            for ttl in [0, 1, 2, 60, 600, 3600, 100_000] {
                assert_eq!(
                    t.learned_cutoff(now, ttl),
                    linear(now, ttl),
                    "now {now} ttl {ttl}"
                );
            }
        }
    }

    #[test]
    fn only_the_index_key_bits_of_a_hash_are_compared() {
        let mut t = PodTable::new(100);
        let full = chain(3, 4);
        // What a feed carrying index keys delivers for the same chain.
        let keys: Vec<u64> = full.iter().map(|&h| index_key(h)).collect();
        assert_ne!(full, keys);
        t.touch_chain(&keys, Tier::Gpu, 1);
        assert_eq!(t.prefix_match(&full, &TRUST_ALL).blocks, 4);
        t.remove(&full[2..]);
        assert_eq!(t.prefix_match(&keys, &TRUST_ALL).blocks, 2);
    }

    /// Index keys spread over the whole table: 10,000 of them in 40,000
    /// slots find thousands of home slots, not the 256 the top 32 bits of a
    /// 40-bit key would give (every probe then walks a cluster).
    #[test]
    fn index_keys_spread_over_the_table() {
        let t = PodTable::new(20_000);
        let homes: std::collections::HashSet<usize> = chain(9, 10_000)
            .iter()
            .map(|&h| t.home(key_of(h)))
            .collect();
        assert!(homes.len() > 5_000, "{} home slots", homes.len());
    }

    #[test]
    fn forgetting_learned_entries_keeps_the_pods_own_report() {
        let mut t = PodTable::new(100);
        let precise = chain(1, 4);
        let learned = chain(2, 6);
        t.touch_chain(&precise, Tier::Gpu, 1);
        t.touch_chain(&learned, Tier::Learned, 1);
        // A learned touch of a precise block keeps it precise.
        t.touch_chain(&precise[..2], Tier::Learned, 1);
        t.remove_learned(&[precise[0], learned[5]]);
        assert_eq!(t.prefix_match(&precise, &TRUST_ALL).blocks, 4);
        assert_eq!(t.prefix_match(&learned, &TRUST_ALL).blocks, 5);
        t.clear_learned();
        assert_eq!(t.len(), 4);
        assert_eq!(t.prefix_match(&learned, &TRUST_ALL).blocks, 0);
        assert_eq!(t.prefix_match(&precise, &TRUST_ALL).blocks, 4);
    }

    #[test]
    fn prefix_len_finds_every_boundary() {
        for n in 0..70 {
            for cached in 0..=n {
                assert_eq!(
                    prefix_len(n, |i| i < cached),
                    cached,
                    "n={n} cached={cached}"
                );
            }
        }
    }

    #[test]
    fn longest_prefix_match() {
        let mut t = PodTable::new(1000);
        let a = chain(1, 40);
        t.touch_chain(&a[..25], Tier::Learned, 0);
        assert_eq!(t.prefix_match(&a, &TRUST_ALL).blocks, 25);
        assert_eq!(t.prefix_match(&a[..10], &TRUST_ALL).blocks, 10);
        assert_eq!(t.prefix_match(&chain(2, 40), &TRUST_ALL).blocks, 0);
        assert_eq!(t.len(), 25);
    }

    #[test]
    fn capacity_bounds_entries_and_evicts_oldest_tail_first() {
        let mut t = PodTable::new(100);
        let old = chain(1, 60);
        let new = chain(2, 60);
        t.touch_chain(&old, Tier::Learned, 0);
        t.touch_chain(&new, Tier::Learned, 1);
        assert!(t.len() <= 100);
        assert_eq!(
            t.prefix_match(&new, &TRUST_ALL).blocks,
            60,
            "the newest prompt survives whole"
        );
        let kept = t.prefix_match(&old, &TRUST_ALL).blocks;
        assert!(
            kept < 60 && kept > 0,
            "the old prompt loses its tail first, kept {kept}"
        );
        // Every surviving block of the old prompt is a prefix: nothing after a hole.
        let present: Vec<bool> = old.iter().map(|&h| t.find(key_of(h)).is_some()).collect();
        assert!(
            present.windows(2).all(|w| w[0] || !w[1]),
            "cached set stays prefix-closed"
        );
    }

    #[test]
    fn reuse_refreshes_lru_order() {
        let mut t = PodTable::new(100);
        let a = chain(1, 50);
        let b = chain(2, 40);
        t.touch_chain(&a, Tier::Learned, 0);
        t.touch_chain(&b, Tier::Learned, 0);
        t.touch_chain(&a, Tier::Learned, 0); // a is hot again
        t.touch_chain(&chain(3, 30), Tier::Learned, 0);
        assert_eq!(t.prefix_match(&a, &TRUST_ALL).blocks, 50);
        assert!(t.prefix_match(&b, &TRUST_ALL).blocks < 40);
    }

    #[test]
    fn churn_keeps_lookups_exact() {
        let mut t = PodTable::new(500);
        for round in 0..200u64 {
            let c = chain(round, 37);
            t.touch_chain(&c, Tier::Learned, round as u32);
            assert_eq!(t.prefix_match(&c, &TRUST_ALL).blocks, 37);
            assert!(t.len() <= 500);
        }
        // Every stored key is findable (probe chains intact after sweeps).
        for slot in 0..t.keys.len() {
            if t.keys[slot] != EMPTY {
                assert_eq!(t.find(t.keys[slot]), Some(slot));
            }
        }
    }

    #[test]
    fn ttl_hides_learned_but_not_precise_entries() {
        let mut t = PodTable::new(100);
        let learned = chain(1, 10);
        let precise = chain(2, 10);
        t.touch_chain(&learned, Tier::Learned, 100);
        t.touch_chain(&precise, Tier::Gpu, 100);
        let rules = |now| MatchRules {
            learned_cutoff: t.learned_cutoff(now, 60),
            ..TRUST_ALL
        };
        assert_eq!(t.prefix_match(&learned, &rules(150)).blocks, 10);
        assert_eq!(t.prefix_match(&learned, &rules(161)).blocks, 0);
        assert_eq!(t.prefix_match(&precise, &rules(10_000)).blocks, 10);
        let untrusted = MatchRules {
            trust_precise: false,
            ..rules(150)
        };
        assert_eq!(t.prefix_match(&precise, &untrusted).blocks, 0);
    }

    #[test]
    fn lower_tiers_earn_discounted_credit() {
        let mut t = PodTable::new(100);
        let c = chain(1, 12);
        t.touch_chain(&c[..8], Tier::Disk, 0);
        t.touch_chain(&c[..6], Tier::Cpu, 0);
        t.touch_chain(&c[..4], Tier::Gpu, 0);
        let m = t.prefix_match(&c, &TRUST_ALL);
        assert_eq!(m.blocks, 8);
        assert!((m.credit - (4.0 + 2.0 * 0.5 + 2.0 * 0.25)).abs() < 1e-9);
    }

    #[test]
    fn learned_never_downgrades_precise() {
        let mut t = PodTable::new(10);
        let c = chain(1, 3);
        t.touch_chain(&c, Tier::Cpu, 0);
        t.touch_chain(&c, Tier::Learned, 0);
        assert!(t
            .entries_oldest_first()
            .iter()
            .all(|&(_, tier)| tier == Tier::Cpu));
    }

    #[test]
    fn resizing_keeps_the_newest_entries() {
        let mut t = PodTable::new(100);
        let old = chain(1, 30);
        let new = chain(2, 30);
        t.touch_chain(&old, Tier::Learned, 0);
        t.touch_chain(&new, Tier::Gpu, 0);
        let bigger = t.resized(1000, 5);
        assert_eq!(bigger.len(), 60);
        assert_eq!(bigger.prefix_match(&new, &TRUST_ALL).blocks, 30);
        let smaller = t.resized(40, 5);
        assert_eq!(smaller.prefix_match(&new, &TRUST_ALL).blocks, 30);
        assert!(smaller.prefix_match(&old, &TRUST_ALL).blocks < 30);
        assert!(smaller.len() <= 40);
    }

    #[test]
    fn remove_and_clear() {
        let mut t = PodTable::new(100);
        let c = chain(1, 20);
        t.touch_chain(&c, Tier::Gpu, 0);
        t.remove(&c[10..]);
        assert_eq!(t.prefix_match(&c, &TRUST_ALL).blocks, 10);
        assert_eq!(t.len(), 10);
        t.remove(&[12345]);
        t.clear();
        assert!(t.is_empty());
        assert_eq!(t.prefix_match(&c, &TRUST_ALL).blocks, 0);
    }

    #[test]
    fn stamps_rebase_before_overflow() {
        let mut t = PodTable::new(10);
        t.clock = STAMP_MASK - 5;
        let c = chain(1, 8);
        t.touch_chain(&c, Tier::Learned, 0);
        t.touch_chain(&chain(2, 8), Tier::Learned, 0);
        assert!(t.clock < 100);
        assert_eq!(t.prefix_match(&chain(2, 8), &TRUST_ALL).blocks, 8);
    }

    #[test]
    fn zero_hash_and_oversized_chain() {
        let mut t = PodTable::new(4);
        t.touch_chain(&[0, 1, 2, 3, 4, 5], Tier::Learned, 0);
        assert_eq!(t.len(), 3, "0 folds onto 1; the chain is cut at capacity");
        assert_eq!(t.prefix_match(&[0, 1, 2, 3], &TRUST_ALL).blocks, 4);
    }

    #[test]
    fn memory_is_at_most_16_bytes_per_block() {
        let t = PodTable::new(19208);
        assert!(t.memory_bytes() as f64 / 19208.0 <= 16.0);
    }
}
