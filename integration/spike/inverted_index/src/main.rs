//! Candidate B of the fleet-scale design spike (docs/fleet-scale-design.md), native.
//!
//! A synthetic fleet (`--pods` pods, each holding 70 % of 19,208 blocks as 32-block chains,
//! every chain on `--replicas` pods) is loaded into two structures (a third, `per-pod`, measured
//! the design before the redesign, one table per pod; it left with that design, and its numbers
//! are in results/2026-11-30-9f8e528):
//! - `exact`: an inverted block → pod-set map (hashbrown, full 64-bit keys); pod sets interned.
//! - `fingerprint`: the same map as a fixed-size open-addressing table of 8-byte slots
//!   (40-bit fingerprint, 24-bit pod-set reference), sized from a byte budget.
//!
//! For each it prints heap bytes per (block, pod) entry (counted by a global allocator), the
//! cost of applying one (block, pod) add and one remove, and the lookup of an 8k-token prompt
//! (512 blocks) whose prefixes are cached at three depths: all 512 blocks on one pod, the first
//! 256 on 50 pods, the first 64 on 500 pods. Every lookup's answer is checked (pods matched,
//! blocks per pod) before it is timed. Lookups of the inverted maps walk the chain once,
//! bisecting between points where the pod set changes, so they visit only the pods that match.
//!
//! `--write-amplification` instead counts, for candidate A (the same map split into fixed
//! shared-data buckets), how many buckets an event stream dirties per flush interval, with
//! buckets keyed by block hash or by chain segment (blocks i..i+SEG of a chain in one bucket),
//! and how many entries would not fit their bucket when segments are placed that way.

// A measuring tool: a broken setup should stop it loudly.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use hashbrown::HashMap;
use std::alloc::{GlobalAlloc, Layout, System};
use std::hash::{BuildHasherDefault, Hasher};
use std::hint::black_box;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Instant;

/// Live heap bytes, for memory per entry.
struct Counting;
static LIVE: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let p = System.alloc(layout);
        if !p.is_null() {
            LIVE.fetch_add(layout.size(), Ordering::Relaxed);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        System.dealloc(p, layout);
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }
    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let q = System.realloc(p, layout, new_size);
        if !q.is_null() {
            LIVE.fetch_add(new_size, Ordering::Relaxed);
            LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
        }
        q
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn live() -> usize {
    LIVE.load(Ordering::Relaxed)
}

const CAPACITY_BLOCKS: usize = 19_208;
const FILL: f64 = 0.7;
const CHAIN: usize = 32;
const PROMPT_BLOCKS: usize = 512;

fn splitmix(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

// ---------------------------------------------------------------- pod sets

type Pod = u16;
/// A pod-set reference: a single pod inline (top bit clear), else an interned set.
type SetRef = u32;
const INTERNED: SetRef = 1 << 23;

/// Interned pod sets: each distinct set stored once, reference counted.
#[derive(Default)]
struct PodSets {
    members: Vec<Box<[Pod]>>,
    refs: Vec<u32>,
    by_members: HashMap<Box<[Pod]>, u32>,
    free: Vec<u32>,
}

impl PodSets {
    fn pods(&self, set: SetRef, out: &mut Vec<Pod>) {
        if set & INTERNED == 0 {
            out.push(set as Pod);
        } else {
            out.extend_from_slice(&self.members[(set & !INTERNED) as usize]);
        }
    }

    fn contains(&self, set: SetRef, pod: Pod) -> bool {
        if set & INTERNED == 0 {
            set as Pod == pod
        } else {
            self.members[(set & !INTERNED) as usize]
                .binary_search(&pod)
                .is_ok()
        }
    }

    fn intern(&mut self, pods: Vec<Pod>) -> Option<SetRef> {
        match pods.len() {
            0 => None,
            1 => Some(SetRef::from(pods[0])),
            _ => {
                let pods = pods.into_boxed_slice();
                if let Some(&i) = self.by_members.get(&pods) {
                    self.refs[i as usize] += 1;
                    return Some(i | INTERNED);
                }
                let i = match self.free.pop() {
                    Some(i) => {
                        self.members[i as usize] = pods.clone();
                        self.refs[i as usize] = 1;
                        i
                    }
                    None => {
                        self.members.push(pods.clone());
                        self.refs.push(1);
                        (self.members.len() - 1) as u32
                    }
                };
                assert!(i < INTERNED, "pod-set references exhausted");
                self.by_members.insert(pods, i);
                Some(i | INTERNED)
            }
        }
    }

    fn release(&mut self, set: SetRef) {
        if set & INTERNED == 0 {
            return;
        }
        let i = (set & !INTERNED) as usize;
        self.refs[i] -= 1;
        if self.refs[i] == 0 {
            let members = std::mem::take(&mut self.members[i]);
            self.by_members.remove(&members);
            self.free.push(i as u32);
        }
    }

    /// `set` plus `pod`, interned; the old reference is released.
    fn with(&mut self, set: Option<SetRef>, pod: Pod) -> SetRef {
        let Some(set) = set else {
            return SetRef::from(pod);
        };
        if self.contains(set, pod) {
            return set;
        }
        let mut pods = Vec::new();
        self.pods(set, &mut pods);
        let at = pods.partition_point(|&p| p < pod);
        pods.insert(at, pod);
        self.release(set);
        self.intern(pods).expect("non-empty")
    }

    /// `set` without `pod`, interned; the old reference is released.
    fn without(&mut self, set: SetRef, pod: Pod) -> Option<SetRef> {
        if !self.contains(set, pod) {
            return Some(set);
        }
        let mut pods = Vec::new();
        self.pods(set, &mut pods);
        pods.retain(|&p| p != pod);
        self.release(set);
        self.intern(pods)
    }
}

// ------------------------------------------------------------- block maps

trait BlockMap {
    fn get(&self, block: u64) -> Option<SetRef>;
    /// False when the map is full (the entry is not held).
    fn put(&mut self, block: u64, set: SetRef) -> bool;
    fn delete(&mut self, block: u64);
}

/// Keys are already hashes: hashbrown may use them as they are.
#[derive(Default)]
struct IdentityHasher(u64);
impl Hasher for IdentityHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, _: &[u8]) {
        unreachable!("u64 keys only")
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = n;
    }
}

#[derive(Default)]
struct ExactMap(HashMap<u64, SetRef, BuildHasherDefault<IdentityHasher>>);

impl BlockMap for ExactMap {
    fn get(&self, block: u64) -> Option<SetRef> {
        self.0.get(&block).copied()
    }
    fn put(&mut self, block: u64, set: SetRef) -> bool {
        self.0.insert(block, set);
        true
    }
    fn delete(&mut self, block: u64) {
        self.0.remove(&block);
    }
}

/// Open addressing over 8-byte slots: the block hash's top 40 bits (its fingerprint; the
/// slot is derived from it too, so deletion can find every entry's home) and a 24-bit set
/// reference. Two blocks whose top 40 bits agree share an entry: about n / 2^40 per lookup.
struct FingerprintMap {
    slots: Vec<u64>,
    len: usize,
    max_len: usize,
}

const FP_BITS: u32 = 40;
const REF_MASK: u64 = (1 << 24) - 1;

impl FingerprintMap {
    fn with_budget(bytes: usize) -> FingerprintMap {
        let slots = (bytes / 8).max(16);
        FingerprintMap {
            slots: vec![0; slots],
            len: 0,
            max_len: slots / 100 * 90,
        }
    }
    fn fingerprint(block: u64) -> u64 {
        (block >> (64 - FP_BITS)).max(1)
    }
    fn home(&self, fp: u64) -> usize {
        ((u128::from(fp) * self.slots.len() as u128) >> FP_BITS) as usize
    }
    fn next(&self, slot: usize) -> usize {
        if slot + 1 == self.slots.len() {
            0
        } else {
            slot + 1
        }
    }
    fn find(&self, fp: u64) -> Result<usize, usize> {
        let mut slot = self.home(fp);
        loop {
            let entry = self.slots[slot];
            if entry == 0 {
                return Err(slot);
            }
            if entry >> 24 == fp {
                return Ok(slot);
            }
            slot = self.next(slot);
        }
    }
}

impl BlockMap for FingerprintMap {
    fn get(&self, block: u64) -> Option<SetRef> {
        let slot = self.find(Self::fingerprint(block)).ok()?;
        Some((self.slots[slot] & REF_MASK) as SetRef)
    }
    fn put(&mut self, block: u64, set: SetRef) -> bool {
        let fp = Self::fingerprint(block);
        match self.find(fp) {
            Ok(slot) => self.slots[slot] = (fp << 24) | u64::from(set),
            Err(slot) => {
                if self.len >= self.max_len {
                    return false;
                }
                self.slots[slot] = (fp << 24) | u64::from(set);
                self.len += 1;
            }
        }
        true
    }
    fn delete(&mut self, block: u64) {
        let Ok(mut hole) = self.find(Self::fingerprint(block)) else {
            return;
        };
        // Backward-shift deletion: no tombstones, probe chains stay short.
        self.slots[hole] = 0;
        self.len -= 1;
        let mut slot = hole;
        loop {
            slot = self.next(slot);
            let entry = self.slots[slot];
            if entry == 0 {
                return;
            }
            let home = self.home(entry >> 24);
            let stays = if hole <= slot {
                hole < home && home <= slot
            } else {
                hole < home || home <= slot
            };
            if !stays {
                self.slots[hole] = entry;
                self.slots[slot] = 0;
                hole = slot;
            }
        }
    }
}

/// Block → pod set, each block once.
struct Inverted<M> {
    map: M,
    sets: PodSets,
    dropped: usize,
}

impl<M: BlockMap> Inverted<M> {
    fn new(map: M) -> Self {
        Inverted {
            map,
            sets: PodSets::default(),
            dropped: 0,
        }
    }

    fn add(&mut self, block: u64, pod: Pod) {
        let set = self.sets.with(self.map.get(block), pod);
        if !self.map.put(block, set) {
            self.sets.release(set);
            self.dropped += 1;
        }
    }

    fn remove(&mut self, block: u64, pod: Pod) {
        let Some(set) = self.map.get(block) else {
            return;
        };
        match self.sets.without(set, pod) {
            Some(rest) => {
                self.map.put(block, rest);
            }
            None => self.map.delete(block),
        }
    }

    /// Longest cached prefix per pod (pods with none left out), and the map probes spent.
    /// Sets shrink along a chain (block i cached ⇒ blocks 0..i cached), so bisecting between
    /// two probes with different sets finds every point where pods drop out.
    fn match_lengths(&self, chain: &[u64], out: &mut Vec<(Pod, usize)>) -> usize {
        out.clear();
        let n = chain.len();
        let mut probes = 0;
        let mut probe = |i: usize| {
            probes += 1;
            self.map.get(chain[i])
        };
        if n == 0 {
            return 0;
        }
        let first = probe(0);
        if first.is_none() {
            return probes;
        }
        let last = probe(n - 1);
        // (index, set at index) at each point after which the set changes, then the end.
        let mut drops: Vec<(usize, SetRef)> = Vec::new();
        let mut stack = vec![(0usize, first, n - 1, last)];
        while let Some((lo, s_lo, hi, s_hi)) = stack.pop() {
            if s_lo == s_hi {
                continue;
            }
            if hi - lo == 1 {
                if let Some(s) = s_lo {
                    drops.push((lo, s));
                }
                continue;
            }
            let mid = lo + (hi - lo) / 2;
            let s_mid = probe(mid);
            stack.push((lo, s_lo, mid, s_mid));
            stack.push((mid, s_mid, hi, s_hi));
        }
        if let Some(s) = last {
            drops.push((n - 1, s));
        }
        // A pod's prefix ends at the last point whose set holds it.
        let mut pods = Vec::new();
        for (i, set) in drops {
            pods.clear();
            self.sets.pods(set, &mut pods);
            out.extend(pods.iter().map(|&pod| (pod, i + 1)));
        }
        out.sort_unstable_by(|a, b| a.0.cmp(&b.0).then(b.1.cmp(&a.1)));
        out.dedup_by_key(|e| e.0);
        probes
    }
}

// ------------------------------------------------------------------ fleet

struct Fleet {
    pods: usize,
    replicas: usize,
    seed: u64,
}

impl Fleet {
    fn chains(&self) -> usize {
        let per_pod = (CAPACITY_BLOCKS as f64 * FILL) as usize / CHAIN;
        self.pods * per_pod / self.replicas
    }
    /// Every chain with the pods holding it.
    fn for_each(&self, mut f: impl FnMut(&[u64], &[Pod])) {
        let mut rng = self.seed;
        let mut chain = [0u64; CHAIN];
        let mut holders = vec![0 as Pod; self.replicas];
        for c in 0..self.chains() {
            chain.iter_mut().for_each(|h| *h = splitmix(&mut rng));
            for (j, p) in holders.iter_mut().enumerate() {
                *p = ((c * self.replicas + j) % self.pods) as Pod;
            }
            f(&chain, &holders);
        }
    }
}

/// The timed prompt and who holds how much of it: (pods, blocks held by each).
fn hot_prompt() -> (Vec<u64>, Vec<(std::ops::Range<usize>, usize)>) {
    let mut rng = 7u64;
    let chain: Vec<u64> = (0..PROMPT_BLOCKS).map(|_| splitmix(&mut rng)).collect();
    (chain, vec![(3..4, 512), (10..60, 256), (100..600, 64)])
}

fn expected(holders: &[(std::ops::Range<usize>, usize)]) -> Vec<(Pod, usize)> {
    let mut all: Vec<(Pod, usize)> = holders
        .iter()
        .flat_map(|(pods, n)| pods.clone().map(move |p| (p as Pod, *n)))
        .collect();
    all.sort_unstable();
    all
}

fn percentile(sorted: &[u64], q: f64) -> u64 {
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

fn time_lookups(mut lookup: impl FnMut() -> usize) -> (u64, u64) {
    let mut ns = Vec::with_capacity(2000);
    for _ in 0..2000 {
        let t = Instant::now();
        black_box(lookup());
        ns.push(t.elapsed().as_nanos() as u64);
    }
    ns.sort_unstable();
    (percentile(&ns, 0.5), percentile(&ns, 0.99))
}

/// Adds then removes `ops` (block, pod) entries of fresh chains: ns per add and per remove.
fn time_churn<M: BlockMap>(index: &mut Inverted<M>, pods: usize, ops: usize) -> (f64, f64) {
    let mut rng = 99u64;
    let entries: Vec<(u64, Pod)> = (0..ops)
        .map(|i| (splitmix(&mut rng), ((i / CHAIN) % pods) as Pod))
        .collect();
    let t = Instant::now();
    for &(b, p) in &entries {
        index.add(b, p);
    }
    let add = t.elapsed().as_nanos() as f64 / ops as f64;
    let t = Instant::now();
    for &(b, p) in &entries {
        index.remove(b, p);
    }
    let remove = t.elapsed().as_nanos() as f64 / ops as f64;
    (add, remove)
}

fn run_inverted<M: BlockMap>(name: &str, fleet: &Fleet, map: impl FnOnce() -> M) {
    let before = live();
    let mut index = Inverted::new(map());
    let (chain, holders) = hot_prompt();
    let t = Instant::now();
    let mut entries = 0usize;
    fleet.for_each(|c, pods| {
        for &p in pods {
            for &b in c {
                index.add(b, p);
            }
        }
        entries += c.len() * pods.len();
    });
    for (pods, n) in &holders {
        for p in pods.clone() {
            for &b in &chain[..*n] {
                index.add(b, p as Pod);
            }
            entries += n;
        }
    }
    let build_ns = t.elapsed().as_nanos() as f64 / entries as f64;
    let bytes = live() - before;
    let mut out = Vec::new();
    let probes = index.match_lengths(&chain, &mut out);
    out.sort_unstable();
    assert_eq!(
        out,
        expected(&holders),
        "{name}: lookup must find every holder"
    );
    let (p50, p99) = time_lookups(|| {
        index.match_lengths(black_box(&chain), &mut out);
        out.len()
    });
    let (add_ns, remove_ns) = time_churn(&mut index, fleet.pods, 200_000);
    println!(
        "{name:<12} pods {:>5} replicas {} | {entries:>9} (block, pod) entries, {} dropped | {:>6.1} MB heap, {:>5.2} B/entry | build {build_ns:>5.0} ns/entry, churn add {add_ns:>4.0} ns, remove {remove_ns:>4.0} ns | lookup 512 blocks: {} pods matched, {probes} probes, p50 {:.1} us, p99 {:.1} us | {} interned sets",
        fleet.pods,
        fleet.replicas,
        index.dropped,
        bytes as f64 / 1e6,
        bytes as f64 / entries as f64,
        out.len(),
        p50 as f64 / 1e3,
        p99 as f64 / 1e3,
        index.sets.by_members.len(),
    );
}

/// Candidate A's buckets: how many an event stream dirties per flush, and segment overflow.
/// Events arrive as runs of 32 consecutive blocks of one chain (a request's new blocks, or a
/// chain's evicted tail) at a random depth of a 512-block prompt; a flush rewrites every
/// bucket that changed since the last one.
fn write_amplification(pods: usize, ops_per_pod_s: usize) {
    let entries = (pods as f64 * CAPACITY_BLOCKS as f64 * FILL) as usize;
    let slots = entries * 10 / 8; // 80 % load, as in the fingerprint run
    let ops_per_s = pods * ops_per_pod_s;
    println!("write amplification: {pods} pods, {entries} (block, pod) entries held once each (no sharing), {ops_per_s} ops/s in runs of {CHAIN}");
    for bucket_bytes in [4096usize, 16384] {
        let buckets = slots * 8 / bucket_bytes;
        for layout in [0usize, 16, 64] {
            let name = if layout == 0 {
                "by block".to_string()
            } else {
                format!("by {layout}-block segment")
            };
            // Entries that overflow their bucket when placed by hash (whole segments together).
            let unit = layout.max(1);
            let mut fill = vec![0usize; buckets];
            let mut rng = 5u64;
            for _ in 0..entries / unit {
                fill[(splitmix(&mut rng) % buckets as u64) as usize] += unit;
            }
            let cap = bucket_bytes / 8;
            let over: usize = fill.iter().map(|&f| f.saturating_sub(cap)).sum();
            let overflow = over as f64 / entries as f64;
            for flush_ms in [100usize, 1000] {
                let ops = ops_per_s * flush_ms / 1000;
                let mut dirty = hashbrown::HashSet::with_capacity(ops);
                let mut rng = 11u64;
                for _ in 0..ops / CHAIN {
                    let chain = splitmix(&mut rng);
                    let depth =
                        (splitmix(&mut rng) % (PROMPT_BLOCKS / CHAIN) as u64) as usize * CHAIN;
                    for i in depth..depth + CHAIN {
                        // A bucket per block, or per segment of `unit` blocks.
                        let key = splitmix(&mut (chain ^ (i / unit) as u64));
                        dirty.insert(key % buckets as u64);
                    }
                }
                let per_s = dirty.len() * 1000 / flush_ms;
                println!(
                    "  {bucket_bytes:>5} B buckets ({buckets:>6}), keyed {name:<20} flush {flush_ms:>4} ms: {:>6} bucket rewrites/s ({:.3} per op, {:.0} MB/s rewritten), {:.3} % of entries overflow their bucket",
                    per_s,
                    per_s as f64 / ops_per_s as f64,
                    (per_s * bucket_bytes) as f64 / 1e6,
                    overflow * 100.0
                );
            }
        }
    }
}

fn list(arg: Option<String>, default: &[usize]) -> Vec<usize> {
    arg.map_or_else(
        || default.to_vec(),
        |s| s.split(',').map(|x| x.parse().expect("a number")).collect(),
    )
}

fn main() {
    let mut args = std::env::args().skip(1);
    let (mut pods, mut replicas, mut structures) = (None, None, None);
    while let Some(flag) = args.next() {
        match flag.as_str() {
            "--pods" => pods = args.next(),
            "--replicas" => replicas = args.next(),
            "--structures" => structures = args.next(),
            "--write-amplification" => {
                write_amplification(1000, 400);
                return;
            }
            other => panic!("unknown flag {other}: --pods N,.. --replicas K,.. --structures exact,fingerprint"),
        }
    }
    let structures = structures.unwrap_or_else(|| "exact,fingerprint".into());
    for pods in list(pods, &[1000]) {
        for replicas in list(replicas.clone(), &[1, 4]) {
            let fleet = Fleet {
                pods,
                replicas,
                seed: 1,
            };
            for s in structures.split(',') {
                match s {
                    "exact" => run_inverted("exact", &fleet, ExactMap::default),
                    "fingerprint" => {
                        // Budget: the fleet's distinct blocks at 80 % load, 8 bytes a slot.
                        let blocks = fleet.chains() * CHAIN + PROMPT_BLOCKS;
                        run_inverted("fingerprint", &fleet, || {
                            FingerprintMap::with_budget(blocks * 8 * 10 / 8)
                        })
                    }
                    other => panic!("unknown structure {other}"),
                }
            }
        }
    }
}
