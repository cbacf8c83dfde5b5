use super::bucket::{key_of, slot_of, MIN_BUCKET_SLOTS};
use super::*;
use crate::hash::{splitmix64, BlockHash};
use published::KeyStore;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

const TRUST_ALL: MatchRules = MatchRules {
    trust_precise: true,
    cpu_credit: 0.5,
    disk_credit: 0.25,
};

/// A deterministic stream of hash-like numbers (SplitMix64).
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    splitmix64(*state)
}

fn chain(seed: u64, n: usize) -> Vec<BlockHash> {
    let mut state = seed.wrapping_mul(0x2545_f491_4f6c_dd1d);
    (0..n).map(|_| BlockHash::new(next(&mut state))).collect()
}

impl BlockIndex {
    /// The (pod, tier) pairs that count for `hash` at `now_s`.
    fn current_members(&self, hash: BlockHash, now_s: u32) -> Vec<(PodId, Tier)> {
        let epoch = self.epoch(now_s);
        self.set_of(key_of(hash.index_key()))
            .map(|id| self.sets.get(id))
            .unwrap_or(&[])
            .iter()
            .filter(|&&m| self.is_current(m, epoch))
            .map(|m| (m.pod(), m.tier()))
            .collect()
    }
}

/// The two bucket stores the write path runs over.
#[derive(Debug, Clone, Copy)]
enum Store {
    Resident,
    /// Over a shared map, with a working set of `WORKING_SET` bytes
    /// (chains span far more: they are stored back early).
    WriteThrough,
}

const STORES: [Store; 2] = [Store::Resident, Store::WriteThrough];
/// Three buckets of the smallest size.
const WORKING_SET: usize = 3 * MIN_BUCKET_SLOTS * SLOT_BYTES;

/// The working set's count of slots is right, and within its bound
/// (which the bucket written last may exceed).
fn assert_working_set_within(index: &BlockIndex, max_bytes: usize) {
    let Some(ws) = &index.working_set else {
        return;
    };
    let slots: Vec<usize> = ws
        .loaded
        .iter()
        .map(|&b| index.buckets[b as usize].slots.len())
        .collect();
    assert_eq!(slots.iter().sum::<usize>(), ws.resident_slots);
    let largest = slots.iter().copied().max().unwrap_or(0);
    assert!(
        index.stats().resident_bytes <= max_bytes + largest * SLOT_BYTES,
        "{:?}",
        index.stats()
    );
}

/// An index under test in one store, and the map it writes through.
struct Under {
    index: BlockIndex,
    shared: Rc<SharedMap>,
}

impl Under {
    fn new(store: Store, budget: usize, ttl: u32) -> Under {
        let shared = Rc::new(SharedMap::default());
        let index = BlockIndex::new(budget, ttl);
        let index = match store {
            Store::Resident => index,
            Store::WriteThrough => index.write_through(shared.clone(), WORKING_SET),
        };
        Under { index, shared }
    }

    /// A publication, stored (a write-through index then reads back
    /// every bucket it writes next).
    fn flush(&mut self) {
        self.shared.flush(&mut self.index, usize::MAX);
    }
}

/// The exact model: (pod, block) → (tier, second taught).
#[derive(Default)]
struct Model {
    entries: HashMap<(PodId, u64), (Tier, u32)>,
    ttl: u32,
}

impl Model {
    /// The documented lifetime: the TTL rounded up to the next epoch of
    /// `ceil(ttl / 16)` seconds.
    fn live(&self, tier: Tier, taught_s: u32, now_s: u32) -> bool {
        let epoch = self.ttl.div_ceil(16).max(1);
        tier != Tier::Learned || now_s / epoch - taught_s / epoch <= self.ttl.div_ceil(epoch)
    }

    fn touch<K: Copy + Into<IndexKey>>(
        &mut self,
        pod: PodId,
        hashes: &[K],
        tier: Tier,
        now_s: u32,
    ) {
        for &h in hashes {
            let entry = self
                .entries
                .entry((pod, key_of(h.into())))
                .or_insert((tier, now_s));
            let keep_precise = entry.0 != Tier::Learned && tier == Tier::Learned && self.ttl > 0;
            if !keep_precise {
                *entry = (tier, now_s);
            }
        }
    }

    fn remove<K: Copy + Into<IndexKey>>(&mut self, pod: PodId, hashes: &[K]) {
        for &h in hashes {
            self.entries.remove(&(pod, key_of(h.into())));
        }
    }

    fn remove_learned(&mut self, pod: PodId, hashes: &[BlockHash]) {
        for &h in hashes {
            let key = (pod, key_of(h.index_key()));
            if self.entries.get(&key).map(|e| e.0) == Some(Tier::Learned) {
                self.entries.remove(&key);
            }
        }
    }

    fn clear_learned(&mut self, pod: PodId) {
        self.entries
            .retain(|&(p, _), &mut (t, _)| p != pod || t != Tier::Learned);
    }

    fn clear(&mut self, pod: PodId) {
        self.entries.retain(|&(p, _), _| p != pod);
    }

    fn members(&self, hash: BlockHash, now_s: u32) -> Vec<(PodId, Tier)> {
        let mut out: Vec<(PodId, Tier)> = self
            .entries
            .iter()
            .filter(|(&(_, k), &(t, at))| k == key_of(hash.index_key()) && self.live(t, at, now_s))
            .map(|(&(p, _), &(t, _))| (p, t))
            .collect();
        out.sort_unstable();
        out
    }

    /// Each pod's longest usable prefix of `hashes`, walked block by block.
    fn matches(&self, hashes: &[BlockHash], now_s: u32, rules: &MatchRules) -> Vec<PodMatch> {
        let mut pods: Vec<PodId> = self.entries.keys().map(|&(p, _)| p).collect();
        pods.sort_unstable();
        pods.dedup();
        let mut out = Vec::new();
        let epoch = self.ttl.div_ceil(16).max(1);
        for pod in pods {
            let (mut blocks, mut credit, mut taught_this_epoch) = (0, 0.0, 0);
            for &h in hashes {
                let Some(&(tier, at)) = self.entries.get(&(pod, key_of(h.index_key()))) else {
                    break;
                };
                if !self.live(tier, at, now_s) || (tier != Tier::Learned && !rules.trust_precise) {
                    break;
                }
                if taught_this_epoch == blocks
                    && tier == Tier::Learned
                    && at / epoch == now_s / epoch
                {
                    taught_this_epoch += 1;
                }
                blocks += 1;
                credit += match tier {
                    Tier::Gpu | Tier::Learned => 1.0,
                    Tier::Cpu => rules.cpu_credit,
                    Tier::Disk => rules.disk_credit,
                };
            }
            if blocks > 0 {
                out.push(PodMatch {
                    pod,
                    blocks,
                    credit,
                    taught_this_epoch,
                });
            }
        }
        out
    }
}

fn tier_of(n: u64) -> Tier {
    Tier::from_code((n % 4) as u8).unwrap_or(Tier::Learned)
}

/// Any sequence of writes, removals and clears: every block's pods and
/// tiers are the model's, as long as the budget is not reached.
#[test]
fn storage_matches_an_exact_model_on_random_operations() {
    for (seed, store) in (0..8u64).flat_map(|seed| STORES.map(|store| (seed, store))) {
        let ttl = 20;
        let mut under = Under::new(store, 1 << 20, ttl);
        let index = &mut under.index;
        let mut model = Model {
            ttl,
            ..Model::default()
        };
        let pods: Vec<PodId> = (0..6).filter_map(|_| index.add_pod()).collect();
        let universe = chain(seed, 64);
        let mut rng = seed;
        let mut now = 0;
        for step in 0..600 {
            let index = &mut under.index;
            now += (next(&mut rng) % 3) as u32;
            let pod = pods[(next(&mut rng) % pods.len() as u64) as usize];
            let picked: Vec<BlockHash> = universe
                .iter()
                .copied()
                .filter(|_| next(&mut rng) % 4 == 0)
                .collect();
            match next(&mut rng) % 10 {
                0..=4 => {
                    let tier = tier_of(next(&mut rng));
                    index.touch_chain(pod, &picked, tier, now);
                    model.touch(pod, &picked, tier, now);
                }
                5 | 6 => {
                    index.remove(pod, &picked);
                    model.remove(pod, &picked);
                }
                7 => {
                    index.remove_learned(pod, &picked);
                    model.remove_learned(pod, &picked);
                }
                8 => {
                    index.clear_learned(pod);
                    model.clear_learned(pod);
                }
                _ => {
                    index.clear(pod);
                    model.clear(pod);
                }
            }
            if step % 3 == 0 {
                under.flush();
            }
            let index = &under.index;
            assert_working_set_within(index, WORKING_SET);
            for &h in &universe {
                let mut got = index.current_members(h, now);
                got.sort_unstable();
                assert_eq!(
                    got,
                    model.members(h, now),
                    "{store:?} seed {seed} at {now}s"
                );
            }
        }
        let stats = under.index.stats();
        assert_eq!(stats.evicted + stats.dropped + stats.unloadable, 0);
    }
}

/// Chains taught and evicted the way vLLM does (prefixes stored, tails
/// removed), on pods that each report one tier: every pod's match length
/// and credit are the model's block-by-block walk.
#[test]
fn lookups_match_the_model_walk_on_random_chains() {
    for (seed, store) in (0..8u64).flat_map(|seed| STORES.map(|store| (seed, store))) {
        let ttl = 30;
        let mut under = Under::new(store, 1 << 20, ttl);
        let index = &mut under.index;
        let mut model = Model {
            ttl,
            ..Model::default()
        };
        let pods: Vec<(PodId, Tier)> = (0..8)
            .filter_map(|i| Some((index.add_pod()?, tier_of(i))))
            .collect();
        let chains: Vec<Vec<BlockHash>> = (0..4).map(|c| chain(seed * 16 + c, 100)).collect();
        let mut rng = seed;
        let mut now = 0;
        let mut out = Vec::new();
        for step in 0..400 {
            if step % 2 == 0 {
                under.flush();
            }
            let index = &mut under.index;
            now += (next(&mut rng) % 4) as u32;
            let (pod, tier) = pods[(next(&mut rng) % pods.len() as u64) as usize];
            let c = &chains[(next(&mut rng) % chains.len() as u64) as usize];
            let cut = (next(&mut rng) % (c.len() as u64 + 1)) as usize;
            match next(&mut rng) % 8 {
                0..=4 => {
                    index.touch_chain(pod, &c[..cut], tier, now);
                    model.touch(pod, &c[..cut], tier, now);
                }
                5 => {
                    index.remove(pod, &c[cut..]);
                    model.remove(pod, &c[cut..]);
                }
                6 => {
                    index.clear_learned(pod);
                    model.clear_learned(pod);
                }
                _ => {
                    index.clear(pod);
                    model.clear(pod);
                }
            }
            for rules in [
                TRUST_ALL,
                MatchRules {
                    trust_precise: false,
                    ..TRUST_ALL
                },
            ] {
                for c in &chains {
                    index.match_lengths(c, now, &rules, &mut out);
                    assert_eq!(
                        out,
                        model.matches(c, now, &rules),
                        "{store:?} seed {seed} at {now}s"
                    );
                }
            }
        }
    }
}

/// The spike's shape: 512 blocks on one pod, the first 256 on 50 more,
/// the first 64 on 500 more: 551 pods found in a few dozen probes.
#[test]
fn a_lookup_probes_only_where_pod_sets_change() {
    let mut index = BlockIndex::new(8 << 20, 600);
    let pods: Vec<PodId> = (0..1000).filter_map(|_| index.add_pod()).collect();
    let hot = chain(7, 512);
    index.touch_chain(pods[3], &hot, Tier::Gpu, 5);
    for &pod in &pods[10..60] {
        index.touch_chain(pod, &hot[..256], Tier::Gpu, 5);
    }
    for &pod in &pods[100..600] {
        index.touch_chain(pod, &hot[..64], Tier::Learned, 5);
    }
    let mut out = Vec::new();
    let cost = index.match_lengths(&hot, 10, &TRUST_ALL, &mut out);
    assert_eq!(out.len(), 551);
    for m in &out {
        let expected = match m.pod.slot() {
            3 => 512,
            10..60 => 256,
            _ => 64,
        };
        assert_eq!(m.blocks, expected, "{m:?}");
    }
    assert_eq!(cost.runs, 3);
    assert!(cost.probes <= 2 + 2 * 9, "{cost:?}");
    // A prompt nobody holds costs one probe.
    assert_eq!(
        index
            .match_lengths(&chain(8, 512), 10, &TRUST_ALL, &mut out)
            .probes,
        1
    );
    assert!(out.is_empty());
}

/// Shared data as a map: what a flush wrote, read back by key.
#[derive(Default)]
struct SharedMap(RefCell<HashMap<String, Vec<u8>>>);

/// What one publication wrote.
struct Written {
    keys: Vec<String>,
    deferred: usize,
}

impl published::KeyReader for SharedMap {
    fn read(&self, key: &str) -> Option<Vec<u8>> {
        self.0.borrow().get(key).cloned()
    }
}

impl KeyStore for SharedMap {
    fn write(&self, key: &str, value: &[u8]) -> bool {
        self.0.borrow_mut().insert(key.into(), value.into());
        true
    }
}

impl SharedMap {
    /// Applies one flush of at most `max` writes; returns what it deferred.
    fn flush(&self, index: &mut BlockIndex, max: usize) -> usize {
        self.flush_as(7, index, max)
    }

    /// [`SharedMap::flush`] by the writer `writer`.
    fn flush_as(&self, writer: u64, index: &mut BlockIndex, max: usize) -> usize {
        self.publish(writer, index, max, 1_000).deferred
    }

    /// One publication by `writer` with heartbeat `heartbeat_ms`, stored;
    /// the keys it wrote.
    fn publish(
        &self,
        writer: u64,
        index: &mut BlockIndex,
        max: usize,
        heartbeat_ms: u64,
    ) -> Written {
        let publication = index.publish(max, writer, heartbeat_ms, &|id| {
            Some(format!("pod-{}", id.slot()))
        });
        let keys = publication.writes.iter().map(|(k, _)| k.clone()).collect();
        self.0.borrow_mut().extend(publication.writes);
        Written {
            keys,
            deferred: publication.deferred,
        }
    }

    fn lookup(&self, hashes: &[BlockHash], now_s: u32, rules: &MatchRules) -> Vec<PodMatch> {
        self.lookup_in(
            &mut published::PublishedView::default(),
            hashes,
            now_s,
            rules,
        )
        .0
    }

    /// A lookup through `view` (refreshed first), and its reads: from
    /// the store, and answered by the view's copies.
    fn lookup_in(
        &self,
        view: &mut published::PublishedView,
        hashes: &[BlockHash],
        now_s: u32,
        rules: &MatchRules,
    ) -> (Vec<PodMatch>, (u64, u64)) {
        view.refresh(self, 1_000, 5_000).unwrap();
        let source = view.source(self).unwrap();
        let mut out = Vec::new();
        match_lengths(&source, hashes, now_s, rules, &mut out);
        assert_eq!(source.unreadable(), 0);
        (out, source.reads())
    }
}

/// The published copy answers every lookup as the writer's own index
/// does, after any operations and a flush, through a new reader or one
/// that kept what it read before the flush; a flush bounded per tick
/// catches up within a few ticks.
#[test]
fn the_published_index_answers_as_the_writer_does() {
    for (seed, store) in (0..4u64).flat_map(|seed| STORES.map(|store| (seed, store))) {
        let Under { mut index, shared } = Under::new(store, 1 << 20, 30);
        let mut kept = published::PublishedView::default();
        let pods: Vec<PodId> = (0..8).filter_map(|_| index.add_pod()).collect();
        let chains: Vec<Vec<BlockHash>> = (0..4).map(|c| chain(seed * 16 + c, 100)).collect();
        let mut rng = seed;
        let mut now = 0;
        for step in 0..200 {
            now += (next(&mut rng) % 4) as u32;
            let pod = pods[(next(&mut rng) % pods.len() as u64) as usize];
            let c = &chains[(next(&mut rng) % chains.len() as u64) as usize];
            let cut = (next(&mut rng) % (c.len() as u64 + 1)) as usize;
            match next(&mut rng) % 6 {
                0..=2 => index.touch_chain(pod, &c[..cut], tier_of(next(&mut rng)), now),
                3 => index.remove(pod, &c[cut..]),
                4 => index.clear_learned(pod),
                _ => index.clear(pod),
            }
            // Every tenth step the flush is bounded to 3 writes and catches up.
            let max = if step % 10 == 0 { 3 } else { usize::MAX };
            let mut ticks = 0;
            while shared.flush(&mut index, max) > 0 {
                ticks += 1;
                assert!(ticks < 200, "the flush never caught up");
            }
            for c in &chains {
                let mut own = Vec::new();
                index.match_lengths(c, now, &TRUST_ALL, &mut own);
                assert_eq!(
                    shared.lookup(c, now, &TRUST_ALL),
                    own,
                    "{store:?} seed {seed} step {step}"
                );
                assert_eq!(
                    shared.lookup_in(&mut kept, c, now, &TRUST_ALL).0,
                    own,
                    "{store:?} seed {seed} step {step}, kept reader"
                );
            }
        }
    }
}

/// A reader keeps the buckets and chunks it read until the next
/// publication: the same lookup again reads nothing from the store.
#[test]
fn a_reader_reuses_what_it_read_until_the_next_publication() {
    let shared = SharedMap::default();
    let mut index = BlockIndex::new(1 << 20, 60);
    let (a, b) = (index.add_pod().unwrap(), index.add_pod().unwrap());
    let c = chain(3, 40);
    index.touch_chain(a, &c, Tier::Gpu, 1);
    while shared.flush(&mut index, usize::MAX) > 0 {}
    let mut view = published::PublishedView::default();
    let (first, (reads, reused)) = shared.lookup_in(&mut view, &c, 1, &TRUST_ALL);
    assert_eq!(first.len(), 1);
    assert!(reads >= 3, "two probes and a set: {reads}");
    assert_eq!(reused, 0);
    let (again, (reads_again, reused_again)) = shared.lookup_in(&mut view, &c, 1, &TRUST_ALL);
    assert_eq!(again, first);
    assert_eq!((reads_again, reused_again), (0, reads));
    // The same heartbeat, but a new publication: read again, and seen.
    index.touch_chain(b, &c[..20], Tier::Gpu, 1);
    while shared.flush(&mut index, usize::MAX) > 0 {}
    let (after, (reads_after, _)) = shared.lookup_in(&mut view, &c, 1, &TRUST_ALL);
    assert_eq!(after.len(), 2);
    assert!(reads_after > 0);
    // Keys stored before their head (a writer storing back early): a set
    // the kept chunk lacks is read again, not taken for a miss.
    let d = chain(4, 10);
    index.touch_chain(a, &d, Tier::Cpu, 1);
    let early = index.publish(usize::MAX, 7, 1_000, &|id| {
        Some(format!("pod-{}", id.slot()))
    });
    for (key, value) in early.writes {
        if key != published::HEAD_KEY {
            shared.write(&key, &value);
        }
    }
    let mut own = Vec::new();
    index.match_lengths(&d, 1, &TRUST_ALL, &mut own);
    assert_eq!(shared.lookup_in(&mut view, &d, 1, &TRUST_ALL).0, own);
    assert_eq!(own.len(), 1);
}

/// A reader drops only what later publications rewrote (the writer's
/// change log says which keys): a flush that rewrites nothing costs it no
/// read, one that rewrites another chain's buckets costs it only those,
/// and a reader further behind than the log reaches reads everything again.
#[test]
fn a_reader_keeps_what_no_later_publication_rewrote() {
    let shared = SharedMap::default();
    let mut index = BlockIndex::new(1 << 20, 60);
    let (a, b) = (index.add_pod().unwrap(), index.add_pod().unwrap());
    let (c, d) = (chain(11, 40), chain(12, 40));
    index.touch_chain(a, &c, Tier::Gpu, 1);
    while shared.flush(&mut index, usize::MAX) > 0 {}
    let mut view = published::PublishedView::default();
    let (first, (reads, _)) = shared.lookup_in(&mut view, &c, 1, &TRUST_ALL);
    assert_eq!(first.len(), 1);
    // A heartbeat: a new head, nothing rewritten, and no change log for
    // the readers to read.
    let heartbeat = shared.publish(7, &mut index, usize::MAX, 1_001);
    assert_eq!(heartbeat.keys, [published::HEAD_KEY]);
    let (same, (reads_after_heartbeat, reused)) = shared.lookup_in(&mut view, &c, 1, &TRUST_ALL);
    assert_eq!(
        (same, reads_after_heartbeat, reused),
        (first.clone(), 0, reads)
    );
    // Another chain's blocks on b: c's reads again are no more than the
    // buckets the two chains share.
    index.touch_chain(b, &d, Tier::Gpu, 1);
    let rewritten = index.dirty_buckets.clone();
    while shared.flush(&mut index, usize::MAX) > 0 {}
    let (same, (reads_after_other, _)) = shared.lookup_in(&mut view, &c, 1, &TRUST_ALL);
    assert_eq!(same, first);
    let shared_buckets = c
        .iter()
        .map(|h| index.bucket_of(key_of(h.index_key())) as u32)
        .filter(|b| rewritten.contains(b))
        .count() as u64;
    assert!(
        reads_after_other <= shared_buckets,
        "{reads_after_other} > {shared_buckets}"
    );
    // c's own blocks on b: its buckets are rewritten, and the reader sees b.
    index.touch_chain(b, &c, Tier::Gpu, 1);
    while shared.flush(&mut index, usize::MAX) > 0 {}
    let (both, (reads_after_own, _)) = shared.lookup_in(&mut view, &c, 1, &TRUST_ALL);
    assert_eq!(both.len(), 2);
    assert!(reads_after_own > 0);
    // Far behind: a reader that last looked thousands of rewritten keys
    // ago forgets all it kept, and still answers as the writer.
    let mut behind = published::PublishedView::default();
    shared.lookup_in(&mut behind, &c, 1, &TRUST_ALL);
    for i in 0..200 {
        index.touch_chain(a, &chain(100 + i, 64), Tier::Gpu, 1);
        while shared.flush(&mut index, usize::MAX) > 0 {}
    }
    let mut own = Vec::new();
    index.match_lengths(&c, 1, &TRUST_ALL, &mut own);
    let (answer, (reads_behind, reused_behind)) = shared.lookup_in(&mut behind, &c, 1, &TRUST_ALL);
    assert_eq!(answer, own);
    assert_eq!((reads_behind > 0, reused_behind), (true, 0));
}

/// A writer that starts over (a new singleton) rewrites every bucket and
/// its pod table: readers see nothing of the old writer's entries, even
/// where the new index holds nothing, and re-read the pods although the
/// new table's version number is the old one's.
#[test]
fn a_new_writer_leaves_nothing_of_the_old_one() {
    let shared = SharedMap::default();
    let mut old = BlockIndex::new(1 << 20, 60);
    let (a, b) = (old.add_pod().unwrap(), old.add_pod().unwrap());
    let c = chain(9, 30);
    old.touch_chain(b, &c, Tier::Gpu, 1);
    while shared.flush_as(1, &mut old, 16) > 0 {}
    let mut view = published::PublishedView::default();
    view.refresh(&shared, 1_000, 5_000).unwrap();
    assert_eq!(view.pods().addresses().count(), 2);
    let mut new = BlockIndex::new(1 << 20, 60);
    assert_eq!(new.add_pod(), Some(a));
    let mut flushes = 0;
    while shared.flush_as(2, &mut new, 16) > 0 {
        flushes += 1;
    }
    assert!(flushes > 0, "every bucket is written, a few per flush");
    view.refresh(&shared, 1_000, 5_000).unwrap();
    assert_eq!(
        view.pods().addresses().collect::<Vec<_>>(),
        vec![(a, "pod-0")]
    );
    assert!(shared.lookup(&c, 1, &TRUST_ALL).is_empty());
}

/// Readers of a stale or absent head route on load only; bytes that are
/// not a bucket, a chunk or a head are misses, counted, never a panic.
#[test]
fn a_reader_refuses_absent_stale_and_garbled_keys() {
    let mut view = published::PublishedView::default();
    let shared = SharedMap::default();
    assert_eq!(
        view.refresh(&shared, 0, 5_000),
        Err(published::Unpublished::Absent)
    );
    let mut index = BlockIndex::new(1 << 20, 60);
    let pod = index.add_pod().unwrap();
    let c = chain(5, 20);
    index.touch_chain(pod, &c, Tier::Gpu, 1);
    shared.flush(&mut index, usize::MAX);
    assert_eq!(
        view.refresh(&shared, 7_000, 5_000),
        Err(published::Unpublished::Stale)
    );
    assert_eq!(view.refresh(&shared, 2_000, 5_000), Ok(()));
    assert_eq!(
        view.pods().addresses().collect::<Vec<_>>(),
        vec![(pod, "pod-0")]
    );
    let keys: Vec<String> = shared.0.borrow().keys().cloned().collect();
    for key in keys
        .iter()
        .filter(|k| k.contains("/b/") || k.contains("/s/"))
    {
        shared.0.borrow_mut().insert(key.clone(), vec![0xff; 11]);
    }
    let source = view.source(&shared).unwrap();
    let mut out = Vec::new();
    match_lengths(&source, &c, 1, &TRUST_ALL, &mut out);
    assert!(out.is_empty());
    assert!(source.unreadable() > 0);
    shared
        .0
        .borrow_mut()
        .insert(published::HEAD_KEY.into(), vec![1, 2, 3]);
    assert_eq!(
        view.refresh(&shared, 2_000, 5_000),
        Err(published::Unpublished::Unreadable)
    );
}

#[test]
fn learned_entries_live_the_ttl_rounded_up_to_an_epoch() {
    let mut index = BlockIndex::new(1 << 20, 600);
    let pod = index.add_pod().unwrap();
    let c = chain(1, 10);
    index.touch_chain(pod, &c, Tier::Learned, 1000);
    let mut out = Vec::new();
    let blocks = |index: &BlockIndex, now, out: &mut Vec<PodMatch>| {
        index.match_lengths(&c, now, &TRUST_ALL, out);
        out.first().map_or(0, |m| m.blocks)
    };
    assert_eq!(blocks(&index, 1600, &mut out), 10);
    // Epochs are ceil(600 / 16) = 38 s: gone by ttl + 38 s.
    assert_eq!(blocks(&index, 1638, &mut out), 0);
    // Precise entries do not age.
    index.touch_chain(pod, &c, Tier::Gpu, 1000);
    assert_eq!(blocks(&index, 100_000, &mut out), 10);
}

#[test]
fn learned_never_downgrades_precise_and_refusals_take_back_only_learned() {
    let mut index = BlockIndex::new(1 << 20, 600);
    let pod = index.add_pod().unwrap();
    let precise = chain(1, 4);
    let learned = chain(2, 6);
    index.touch_chain(pod, &precise, Tier::Cpu, 1);
    index.touch_chain(pod, &learned, Tier::Learned, 1);
    index.touch_chain(pod, &precise[..2], Tier::Learned, 1);
    assert_eq!(index.current_members(precise[0], 1), vec![(pod, Tier::Cpu)]);
    index.remove_learned(pod, &[precise[0], learned[5]]);
    let mut out = Vec::new();
    index.match_lengths(&precise, 1, &TRUST_ALL, &mut out);
    assert_eq!((out[0].blocks, out[0].credit), (4, 2.0));
    index.match_lengths(&learned, 1, &TRUST_ALL, &mut out);
    assert_eq!(out[0].blocks, 5);
    index.clear_learned(pod);
    index.match_lengths(&learned, 1, &TRUST_ALL, &mut out);
    assert!(out.is_empty());
    index.match_lengths(&precise, 1, &TRUST_ALL, &mut out);
    assert_eq!(out[0].blocks, 4);
}

/// A small budget under a long stream of learning: the bytes never pass
/// it, precise entries outlive learned ones, and the newest chain is whole.
#[test]
fn the_budget_holds_and_learned_entries_go_before_precise_ones() {
    let budget = 64 << 10;
    let mut index = BlockIndex::new(budget, 600);
    let reporter = index.add_pod().unwrap();
    let learner = index.add_pod().unwrap();
    let precise = chain(1, 1500);
    index.touch_chain(reporter, &precise, Tier::Gpu, 0);
    let mut newest = Vec::new();
    for round in 0..400u64 {
        newest = chain(100 + round, 50);
        index.touch_chain(learner, &newest, Tier::Learned, round as u32);
        assert!(
            index.memory_bytes() <= budget,
            "round {round}: {:?}",
            index.stats()
        );
    }
    let stats = index.stats();
    assert!(stats.evicted > 0, "{stats:?}");
    let mut out = Vec::new();
    index.match_lengths(&precise, 400, &TRUST_ALL, &mut out);
    assert_eq!(out.first().map(|m| m.blocks), Some(1500), "{stats:?}");
    let held = newest
        .iter()
        .filter(|&&h| !index.current_members(h, 400).is_empty())
        .count();
    assert!(held >= 45, "newest chain kept {held}/50");
}

/// Feed operations applied bucket by bucket leave every block as the
/// same operations applied one after the other do, `Cleared` included;
/// a write-through index then loads each bucket once per answer. The
/// larger budget has more buckets than the operations have blocks (the
/// comparison sort, as for a delta of the feed), the smaller fewer
/// (the counting sort, as for a snapshot page).
#[test]
fn operations_applied_in_bucket_order_match_the_model() {
    for (seed, budget) in (0..8u64).zip([1 << 20, 256 << 20].repeat(4)) {
        let ttl = 60;
        let mut model = Model {
            ttl,
            ..Model::default()
        };
        let mut under = Under::new(Store::WriteThrough, budget, ttl);
        let pods: Vec<PodId> = (0..4).filter_map(|_| under.index.add_pod()).collect();
        let universe = chain(seed, 300);
        let mut rng = seed;
        // What a feed delivers: index keys.
        let mut kept: Vec<(u64, PodId, Vec<IndexKey>)> = Vec::new();
        for _ in 0..12 {
            let pod = pods[(next(&mut rng) % pods.len() as u64) as usize];
            let picked: Vec<IndexKey> = universe
                .iter()
                .map(|h| h.index_key())
                .filter(|_| next(&mut rng) % 3 == 0)
                .collect();
            kept.push((next(&mut rng) % 8, pod, picked));
        }
        let ops: Vec<IndexOp> = kept
            .iter()
            .map(|(kind, pod, hashes)| match kind {
                0..=4 => IndexOp::Stored(*pod, tier_of(*kind), hashes),
                5 | 6 => IndexOp::Removed(*pod, hashes),
                _ => IndexOp::Cleared(*pod),
            })
            .collect();
        for op in &ops {
            match *op {
                IndexOp::Stored(pod, tier, hashes) => model.touch(pod, hashes, tier, 5),
                IndexOp::Removed(pod, keys) => model.remove(pod, keys),
                IndexOp::Cleared(pod) => model.clear(pod),
            }
        }
        under.index.apply_ops(&ops, 5);
        let touched = universe
            .iter()
            .map(|&h| under.index.bucket_of(key_of(h.index_key())))
            .collect::<std::collections::HashSet<_>>()
            .len();
        let stats = under.index.stats();
        let segments = 1 + ops
            .iter()
            .filter(|op| matches!(op, IndexOp::Cleared(_)))
            .count();
        assert!(
            stats.written_back_early as usize <= touched * segments,
            "{stats:?}: {touched} buckets, {segments} segments"
        );
        for &h in &universe {
            let mut got = under.index.current_members(h, 5);
            got.sort_unstable();
            assert_eq!(got, model.members(h, 5), "seed {seed}");
        }
    }
}

/// A run of stores grows its bucket to what the keys it does not hold
/// yet need: keys stored by several pods, or held already, do not make
/// it larger.
#[test]
fn a_bucket_grows_to_what_its_new_keys_need() {
    let mut index = BlockIndex::new(BlockIndex::min_budget_bytes(), 60);
    assert_eq!(index.buckets.len(), 1, "every key in one bucket");
    let pods: Vec<PodId> = (0..3).filter_map(|_| index.add_pod()).collect();
    let hashes = chain(7, 100);
    let keys: Vec<IndexKey> = hashes.iter().map(|h| h.index_key()).collect();
    index.apply_ops(&[IndexOp::Stored(pods[0], Tier::Gpu, &keys[..40])], 1);
    // 40 entries fill 7/8 of 64 slots at most.
    assert_eq!(index.buckets[0].slots.len(), 64);
    let ops: Vec<IndexOp> = pods
        .iter()
        .map(|&pod| IndexOp::Stored(pod, Tier::Gpu, &keys))
        .collect();
    index.apply_ops(&ops, 1);
    assert_eq!(
        (index.stats().blocks, index.buckets[0].slots.len()),
        (100, 128)
    );
    for &hash in &hashes {
        assert_eq!(index.current_members(hash, 1).len(), 3);
    }
}

/// Under a budget that evicts, a write-through index keeps at most its
/// working set and evicts exactly what the resident one does: the
/// buckets it reads back carry the slots' ages.
#[test]
fn a_write_through_index_evicts_as_the_resident_one_does() {
    let budget = 64 << 10;
    let [mut resident, mut through] = STORES.map(|store| Under::new(store, budget, 160));
    let pods: Vec<PodId> = (0..4)
        .filter_map(|_| {
            let pod = resident.index.add_pod();
            assert_eq!(through.index.add_pod(), pod);
            pod
        })
        .collect();
    let precise = chain(1, 1500);
    let mut rng = 3;
    for round in 0..300u32 {
        let pod = pods[(next(&mut rng) % pods.len() as u64) as usize];
        let c = chain(100 + u64::from(round % 80), 60);
        for under in [&mut resident, &mut through] {
            if round % 50 == 0 {
                under.index.touch_chain(pods[0], &precise, Tier::Gpu, round);
            }
            under.index.touch_chain(pod, &c, Tier::Learned, round);
            if round % 7 == 0 {
                under.index.remove(pod, &c[30..]);
            }
            if round % 5 == 0 {
                under.flush();
            }
        }
        assert_working_set_within(&through.index, WORKING_SET);
        assert_eq!(
            through.index.entries_oldest_first(),
            resident.index.entries_oldest_first(),
            "round {round}"
        );
    }
    let (a, b) = (resident.index.stats(), through.index.stats());
    assert!(a.evicted > 0, "{a:?}");
    assert_eq!(
        (a.evicted, a.blocks, a.bytes),
        (b.evicted, b.blocks, b.bytes)
    );
    assert!(b.written_back_early > 0 && b.unloadable == 0, "{b:?}");
    through.flush();
    assert_working_set_within(&through.index, WORKING_SET);
    let mut out = Vec::new();
    through
        .index
        .match_lengths(&precise, 300, &TRUST_ALL, &mut out);
    assert_eq!(out.first().map(|m| m.blocks), Some(1500));
    let published = through.shared.lookup(&precise, 300, &TRUST_ALL);
    assert_eq!(published.first().map(|m| m.blocks), Some(1500));
}

/// Clean buckets stay in the working set across publications, up to its
/// bound: a prefix taught again costs no read from the store until other
/// writes push its buckets out (least recently used first).
#[test]
fn a_write_through_index_keeps_clean_buckets_across_flushes() {
    let shared = Rc::new(SharedMap::default());
    let bound = 64 * MIN_BUCKET_SLOTS * SLOT_BYTES;
    let mut index = BlockIndex::new(1 << 20, 600).write_through(shared.clone(), bound);
    let pod = index.add_pod().unwrap();
    let prefix = chain(6, 20);
    for now in [1, 2, 300] {
        index.touch_chain(pod, &prefix, Tier::Learned, now);
        shared.flush(&mut index, usize::MAX);
    }
    assert_eq!(index.stats().read_back, 0, "{:?}", index.stats());
    // 300 more blocks: the working set is shrunk, the prefix's buckets go.
    index.touch_chain(pod, &chain(7, 300), Tier::Learned, 301);
    shared.flush(&mut index, usize::MAX);
    let before = index.stats();
    assert_working_set_within(&index, bound);
    assert!(before.read_back > 0, "{before:?}");
    index.touch_chain(pod, &prefix, Tier::Learned, 302);
    let after = index.stats();
    assert!(after.read_back > before.read_back, "{after:?}");
    assert_eq!(after.unloadable, 0);
    shared.flush(&mut index, usize::MAX);
    let found = shared.lookup(&prefix, 302, &TRUST_ALL);
    assert_eq!(found.first().map(|m| m.blocks), Some(20));
}

/// The bound counts bytes: an index of few blocks per bucket stays in
/// memory whole, over far more buckets than full ones would fill, and
/// teaching it again reads nothing back.
#[test]
fn a_small_write_through_index_stays_in_memory_whole() {
    let shared = Rc::new(SharedMap::default());
    let bound = 8 * BUCKET_SLOTS * SLOT_BYTES;
    let mut index = BlockIndex::new(1 << 20, 600).write_through(shared.clone(), bound);
    let pod = index.add_pod().unwrap();
    let chains: Vec<_> = (0..4).map(|c| chain(10 + c, 100)).collect();
    for now in [1, 2, 3] {
        for c in &chains {
            index.touch_chain(pod, c, Tier::Learned, now);
        }
        shared.flush(&mut index, usize::MAX);
    }
    let stats = index.stats();
    assert!(stats.resident_buckets > 8, "{stats:?}");
    assert_eq!(
        (stats.read_back, stats.written_back_early),
        (0, 0),
        "{stats:?}"
    );
    assert_working_set_within(&index, bound);
}

/// A write-through writer that starts over reads back only what it
/// wrote: the previous writer's buckets under the same keys are
/// overwritten, never taken for its own.
#[test]
fn a_write_through_index_reads_back_only_buckets_it_wrote() {
    let shared = Rc::new(SharedMap::default());
    let mut old = BlockIndex::new(1 << 20, 60);
    let pod = old.add_pod().unwrap();
    let held = chain(2, 200);
    old.touch_chain(pod, &held, Tier::Gpu, 1);
    shared.flush_as(1, &mut old, usize::MAX);
    let mut new = BlockIndex::new(1 << 20, 60).write_through(shared.clone(), WORKING_SET);
    assert_eq!(new.add_pod(), Some(pod));
    // Blocks in the old writer's buckets, written before any flush.
    let taught = chain(3, 50);
    new.touch_chain(pod, &taught, Tier::Gpu, 2);
    shared.flush_as(2, &mut new, usize::MAX);
    let mut out = Vec::new();
    new.match_lengths(&held, 2, &TRUST_ALL, &mut out);
    assert!(out.is_empty(), "{out:?}");
    new.match_lengths(&taught, 2, &TRUST_ALL, &mut out);
    assert_eq!(out.first().map(|m| m.blocks), Some(50));
    assert!(shared.lookup(&held, 2, &TRUST_ALL).is_empty());
    assert_eq!(new.stats().unloadable, 0);
}

/// A stored bucket this writer could not have written (garbled, or
/// naming sets it does not hold) is counted and starts empty: the
/// writer never adopts references it cannot account for.
#[test]
fn a_write_through_index_refuses_buckets_it_could_not_have_written() {
    let shared = Rc::new(SharedMap::default());
    // Room for `c`'s buckets while they are read back and written again.
    let bound = 16 * MIN_BUCKET_SLOTS * SLOT_BYTES;
    let mut index = BlockIndex::new(1 << 20, 60).write_through(shared.clone(), bound);
    let pod = index.add_pod().unwrap();
    let c = chain(4, 3);
    index.touch_chain(pod, &c, Tier::Gpu, 1);
    shared.flush(&mut index, usize::MAX);
    // Other buckets' writes push `c`'s out of the working set: they are
    // read back from the store on their next write.
    let mut c_buckets: Vec<usize> = c
        .iter()
        .map(|&h| index.bucket_of(key_of(h.index_key())))
        .collect();
    c_buckets.sort_unstable();
    c_buckets.dedup();
    let others: Vec<BlockHash> = chain(5, 64)
        .into_iter()
        .filter(|&h| !c_buckets.contains(&index.bucket_of(key_of(h.index_key()))))
        .collect();
    index.touch_chain(pod, &others, Tier::Gpu, 1);
    shared.flush(&mut index, usize::MAX);
    let is_loaded =
        |index: &BlockIndex, b: usize| index.working_set.as_ref().is_some_and(|ws| ws.is_loaded[b]);
    assert!(!c_buckets.iter().any(|&b| is_loaded(&index, b)));
    let keys: Vec<String> = c_buckets
        .iter()
        .map(|&b| published::bucket_key(b))
        .collect();
    let mut forged = 0;
    for key in &keys {
        let mut bytes = published::KeyReader::read(&*shared, key).unwrap();
        let len = usize::from(u16::from_le_bytes([bytes[0], bytes[1]]));
        // Every slot names set 999, which this writer never interned.
        for i in 0..len {
            let at = 2 + i * 8;
            let slot = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap());
            if slot != EMPTY {
                let slot = slot_of(slot_key(slot), 999);
                bytes[at..at + 8].copy_from_slice(&slot.to_le_bytes());
            }
        }
        if len > 0 {
            forged += 1;
            shared.write(key, &bytes);
        }
    }
    index.remove(pod, &c);
    index.touch_chain(pod, &c, Tier::Cpu, 2);
    let stats = index.stats();
    assert!(forged > 0);
    assert_eq!(stats.unloadable, forged, "{stats:?}");
    let mut out = Vec::new();
    index.match_lengths(&c, 2, &TRUST_ALL, &mut out);
    assert_eq!(out.first().map(|m| m.blocks), Some(3));
}

#[test]
fn a_pod_that_leaves_takes_its_entries_and_its_id_is_reused_clean() {
    let mut index = BlockIndex::new(1 << 20, 600);
    let a = index.add_pod().unwrap();
    let c = chain(1, 8);
    index.touch_chain(a, &c, Tier::Gpu, 1);
    index.remove_pod(a);
    let b = index.add_pod().unwrap();
    assert_eq!(a, b);
    let mut out = Vec::new();
    index.match_lengths(&c, 1, &TRUST_ALL, &mut out);
    assert!(out.is_empty());
}

/// A chain taught at the first second of the current epoch is reported
/// taught in it; one taught a second earlier is not (it ages by then).
#[test]
fn taught_this_epoch_starts_at_the_epoch_boundary() {
    let ttl = 600;
    let now = 1000;
    let start = epoch_start_s(ttl, now);
    assert!(start <= now && now - start < ttl.div_ceil(16));
    let mut index = BlockIndex::new(1 << 20, ttl);
    let (fresh, older) = (index.add_pod().unwrap(), index.add_pod().unwrap());
    let c = chain(8, 30);
    index.touch_chain(older, &c, Tier::Learned, start - 1);
    index.touch_chain(fresh, &c, Tier::Learned, start);
    let mut out = Vec::new();
    index.match_lengths(&c, now, &TRUST_ALL, &mut out);
    let taught: Vec<(PodId, usize, usize)> = out
        .iter()
        .map(|m| (m.pod, m.blocks, m.taught_this_epoch))
        .collect();
    assert_eq!(taught, vec![(fresh, 30, 30), (older, 30, 0)]);
}

#[test]
fn reconfiguring_keeps_entries_and_only_index_keys_are_compared() {
    let mut index = BlockIndex::new(1 << 20, 600);
    let pod = index.add_pod().unwrap();
    let full = chain(3, 40);
    // What a feed carrying index keys delivers for the same chain.
    let keys: Vec<IndexKey> = full.iter().map(|h| h.index_key()).collect();
    index.touch_chain(pod, &keys, Tier::Gpu, 1);
    let index = index.reconfigured(4 << 20, 60, 2);
    let mut out = Vec::new();
    index.match_lengths(&full, 2, &TRUST_ALL, &mut out);
    assert_eq!(
        out,
        vec![PodMatch {
            pod,
            blocks: 40,
            credit: 40.0,
            taught_this_epoch: 0,
        }]
    );
}
