//! The routing index: block → pod set, each block held once whatever the
//! number of pods that cache it, bounded by a byte budget.
//!
//! Layout (docs/fleet-scale-design.md, "B inside A"):
//! - A block is keyed by its 40-bit [`IndexKey`]. The key's high bits pick
//!   one of a fixed number of buckets; inside a bucket, slots are open
//!   addressed by the key's low bits. A slot is 8 bytes (key and a 24-bit
//!   pod-set reference) plus a 1-byte age (the epoch of its last write).
//!   Two blocks whose index keys agree share a slot: an absent block matches
//!   with probability about n / 2⁴⁰ per probe.
//! - Pod sets are interned and reference counted: a chain learned on one pod,
//!   or a system prompt on 500, stores its set once. A member is (pod, the
//!   pod's generation, tier, epoch learned), so tiers and learned ages are
//!   per (block, pod), and clearing a pod bumps its generation instead of
//!   scanning the index (stale members are dropped when their slot is next
//!   written or evicted).
//! - Memory: the bucket count is fixed from `index.budget_bytes` so that every
//!   bucket at its full size fits; buckets grow on demand (8 → 512 slots), so a
//!   small fleet holds little. Interned sets get a sixteenth of the budget; a
//!   write that would need a new set beyond it is dropped (counted).
//! - A full bucket evicts its worst sixteenth in one sweep: first learned
//!   entries past their TTL, then learned entries, oldest first, then entries
//!   some pod reported (precise), oldest first. The sweep ranks by the slot's
//!   age and a flag per set, without reading members: a cleared pod's
//!   entries go when their slot is next written or by age.
//!
//! Where the buckets live: a resident index keeps every bucket in memory
//! (native tests, benchmarks); a write-through index
//! ([`BlockIndex::write_through`], the singleton) keeps only its working set.
//! It reads a bucket from the published copy when a write needs one it does
//! not hold (the copy carries the slots' ages, the eviction order) and stores
//! it back at the next publication. Written buckets stay in the working set,
//! clean, after the publication: a repeated prefix is not read again. When
//! the working set reaches its bound, its least recently used half goes
//! (those changed since the last publication are stored back early). Both
//! run the same write path; only
//! `BlockIndex::load` and the publication differ. The interned sets and
//! the pod table stay in memory in both.
//!
//! Learned entries live `index.ttl_seconds` rounded up to the next epoch
//! (a sixteenth of the TTL): from `ttl` to `ttl × 17/16` seconds. A lookup
//! reports per pod the leading blocks it was taught in the current epoch
//! ([`PodMatch::taught_this_epoch`]): teaching them again would change
//! nothing (same set, same age), so a routed prompt does not send them to
//! the writer. Prompts teach their chain from its first block, so learned
//! epochs never rise along a chain and the lookup finds that prefix exactly.
//!
//! The lookup walks a prompt's chain once: probe its first and last block,
//! and bisect only between probes whose pod sets differ. Pod sets only shrink
//! along a chain (block i cached ⇒ blocks 0..i cached), so every point where
//! a pod drops out or changes tier is found in O(changes × log n) probes,
//! whatever the number of pods. Where a pod's tier or age along a chain goes
//! back to an earlier value (GPU, then CPU, then GPU again), the middle can be
//! missed and its credit counted at the outer tier.
//!
//! Compared with the per-pod tables this replaces: a pod's entries are no
//! longer bounded by its capacity (one budget for all, a request still teaches
//! at most `index.max_learn_share` of a pod's capacity); ages are per slot and
//! per epoch, so a full bucket may evict a prompt's middle block before its
//! tail (the lookup then counts the prefix up to the probes it made).
//!
//! Submodules: `member` (pods, set members, generations, the learned-age
//! clock), `bucket` (slots and their probing), `pod_sets` (interning),
//! `chain_match` (the lookup), [`published`] (the shared-data copy),
//! `working_set` (a write-through index's buckets in memory), [`changes`]
//! (what publications rewrote), `write` (stores, placement, growth and
//! eviction), `remove` (removals).

use crate::hash::IndexKey;
use bucket::{
    bucket_of, slot_key, slot_set, Bucket, BUCKET_OVERHEAD, EMPTY, FULL_BUCKET_BYTES, SLOT_BYTES,
};
use changes::{ChangeLog, Changed};
use member::EPOCHS_PER_TTL;
use pod_sets::PodSets;
use working_set::WorkingSet;

mod bucket;
mod chain_match;
pub mod changes;
mod member;
mod pod_sets;
pub mod published;
mod remove;
mod working_set;
mod write;

pub use crate::feed::Tier;
pub use bucket::BUCKET_SLOTS;
pub use chain_match::{match_lengths, IndexSource, LookupCost, MatchRules, PodMatch};
pub use member::{epoch_start_s, Clock, Member, PodId, PodState, MAX_PODS};

/// The interned pod sets may take this fraction of the budget.
const SET_BUDGET_DIVISOR: usize = 16;

/// Counters of what the budget refused or pushed out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IndexStats {
    /// Occupied slots (blocks held).
    pub blocks: usize,
    /// Bytes held by buckets and interned sets (never above the budget).
    pub bytes: usize,
    /// Distinct pod sets interned.
    pub sets: usize,
    /// Slots evicted by full buckets.
    pub evicted: u64,
    /// Writes dropped because the interned sets were at their budget.
    pub dropped: u64,
    /// Write-through: buckets in memory now (the working set).
    pub resident_buckets: usize,
    /// Write-through: bytes of those buckets' slots (bounded).
    pub resident_bytes: usize,
    /// Write-through: buckets stored back before a publication because the
    /// working set reached its bound.
    pub written_back_early: u64,
    /// Write-through: buckets read back from the store (a write to a bucket
    /// not in the working set).
    pub read_back: u64,
    /// Write-through: buckets that could not be read back (absent or not a
    /// bucket) and started empty: their entries are lost.
    pub unloadable: u64,
}

/// One operation of a feed answer on the index.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum IndexOp<'a> {
    /// See [`BlockIndex::touch_chain`].
    Stored(PodId, Tier, &'a [IndexKey]),
    /// See [`BlockIndex::remove`].
    Removed(PodId, &'a [IndexKey]),
    /// See [`BlockIndex::clear`].
    Cleared(PodId),
}

impl<'a> IndexOp<'a> {
    /// The keys the operation names (none for `Cleared`).
    fn keys(&self) -> &'a [IndexKey] {
        match *self {
            IndexOp::Stored(_, _, keys) | IndexOp::Removed(_, keys) => keys,
            IndexOp::Cleared(_) => &[],
        }
    }
}

/// The block → pod-set index of one routing state.
#[derive(Debug, Clone)]
pub struct BlockIndex {
    /// Every bucket (resident), or the working set's and empty placeholders
    /// (write-through).
    buckets: Vec<Bucket>,
    /// `None`: every bucket is resident.
    working_set: Option<WorkingSet>,
    /// Bytes of every bucket at its size, in memory or not.
    bucket_bytes: usize,
    sets: PodSets,
    pods: Vec<PodState>,
    /// Ids of pods that left, reusable (their generations were bumped).
    free_pods: Vec<u32>,
    live_pods: usize,
    budget_bytes: usize,
    ttl_seconds: u32,
    epoch_seconds: u32,
    blocks: usize,
    evicted: u64,
    dropped: u64,
    /// The epoch of the newest write.
    latest_epoch: u16,
    /// Buckets whose slots changed since the last publication, and a flag per bucket.
    dirty_buckets: Vec<u32>,
    bucket_dirty: Vec<bool>,
    /// Buckets this index has not published yet. Each is written once (an
    /// empty one in two bytes) after the changed ones, so that no key an
    /// earlier writer or bucket layout left behind lingers, and new routing
    /// does not wait behind that backlog.
    unpublished: Vec<u32>,
    published: Vec<bool>,
    /// A pod was added, removed or cleared since the last publication.
    pods_dirty: bool,
    /// Publications of the pod table so far.
    pods_version: u64,
    /// Publications that rewrote a key so far (each head names the last).
    publications: u64,
    /// What the last publications rewrote, published for the readers.
    changes: ChangeLog,
    /// Keys a write-through index stored back before the next publication,
    /// which lists them with its own.
    written_early: Changed,
}

impl BlockIndex {
    /// An empty index within `budget_bytes` whose learned entries live
    /// `ttl_seconds` (see the module documentation for the rounding).
    pub fn new(budget_bytes: usize, ttl_seconds: u32) -> BlockIndex {
        let set_budget = budget_bytes / SET_BUDGET_DIVISOR;
        let buckets = ((budget_bytes - set_budget) / FULL_BUCKET_BYTES).max(1);
        BlockIndex {
            buckets: vec![Bucket::default(); buckets],
            working_set: None,
            bucket_bytes: buckets * BUCKET_OVERHEAD,
            sets: PodSets::with_budget(set_budget),
            pods: Vec::new(),
            free_pods: Vec::new(),
            live_pods: 0,
            budget_bytes,
            ttl_seconds: ttl_seconds.max(1),
            epoch_seconds: ttl_seconds.div_ceil(EPOCHS_PER_TTL).max(1),
            blocks: 0,
            evicted: 0,
            dropped: 0,
            latest_epoch: 0,
            dirty_buckets: Vec::new(),
            bucket_dirty: vec![false; buckets],
            unpublished: (0..buckets as u32).rev().collect(),
            published: vec![false; buckets],
            pods_dirty: true,
            pods_version: 0,
            publications: 0,
            changes: ChangeLog::starting_at(1),
            written_early: Changed::default(),
        }
    }

    /// The smallest budget that holds at least one bucket and its sets.
    pub fn min_budget_bytes() -> usize {
        FULL_BUCKET_BYTES * 2
    }

    pub fn budget_bytes(&self) -> usize {
        self.budget_bytes
    }

    pub fn ttl_seconds(&self) -> u32 {
        self.ttl_seconds
    }

    /// A handle for a new pod; `None` when [`MAX_PODS`] are indexed.
    pub fn add_pod(&mut self) -> Option<PodId> {
        self.pods_dirty = true;
        if let Some(id) = self.free_pods.pop() {
            self.live_pods += 1;
            return Some(PodId(id));
        }
        if self.pods.len() >= MAX_PODS {
            return None;
        }
        self.pods.push(PodState::default());
        self.live_pods += 1;
        Some(PodId((self.pods.len() - 1) as u32))
    }

    /// The pod left: its entries stop counting now and its id may be reused.
    pub fn remove_pod(&mut self, pod: PodId) {
        if pod.slot() < self.pods.len() && !self.free_pods.contains(&pod.0) {
            self.clear(pod);
            self.free_pods.push(pod.0);
            self.live_pods -= 1;
        }
    }

    /// Forgets every block of `pod` (it restarted or cleared its cache).
    pub fn clear(&mut self, pod: PodId) {
        self.pods_dirty = true;
        if let Some(state) = self.pods.get_mut(pod.slot()) {
            state.clear();
        }
    }

    /// Forgets every learned entry of `pod` (it failed: what the proxy guessed
    /// about its cache can no longer be trusted); its own reports stay.
    pub fn clear_learned(&mut self, pod: PodId) {
        self.pods_dirty = true;
        if let Some(state) = self.pods.get_mut(pod.slot()) {
            state.clear_learned();
        }
    }

    fn epoch(&self, now_s: u32) -> u16 {
        self.clock().epoch(now_s)
    }

    fn ttl_epochs(&self) -> u16 {
        self.ttl_seconds
            .div_ceil(self.epoch_seconds)
            .min(u32::from(u16::MAX)) as u16
    }

    /// True when `member` still says something about its pod: its pod's
    /// generation is current and, if learned, it has not expired.
    fn is_current(&self, member: Member, epoch: u16) -> bool {
        let state = self.pods.get(member.pod().slot()).copied();
        self.clock().is_current(state, member, epoch)
    }

    fn bucket_of(&self, key: u64) -> usize {
        bucket_of(key, self.buckets.len())
    }

    /// The learned-age clock readers of this index use.
    pub fn clock(&self) -> Clock {
        Clock {
            epoch_seconds: self.epoch_seconds,
            ttl_epochs: self.ttl_epochs(),
        }
    }

    /// Every pod's longest cached prefix of `hashes` (see [`match_lengths`]).
    pub fn match_lengths<K: Copy + Into<IndexKey>>(
        &self,
        hashes: &[K],
        now_s: u32,
        rules: &MatchRules,
        out: &mut Vec<PodMatch>,
    ) -> LookupCost {
        match_lengths(self, hashes, now_s, rules, out)
    }

    /// Every entry that still counts, as (pod, index key, tier), oldest
    /// first: what a snapshot carries.
    pub fn entries_oldest_first(&self) -> Vec<(PodId, IndexKey, Tier)> {
        let epoch = self.latest_epoch;
        let now_age = epoch as u8;
        let mut entries: Vec<(u8, PodId, IndexKey, Tier)> = Vec::new();
        for b in 0..self.buckets.len() {
            let bucket = self.bucket(b);
            for (&slot, &age) in bucket.slots.iter().zip(&bucket.ages) {
                if slot == EMPTY {
                    continue;
                }
                for &m in self.sets.get(slot_set(slot)) {
                    if self.is_current(m, epoch) {
                        entries.push((
                            now_age.wrapping_sub(age),
                            m.pod(),
                            IndexKey::new(slot_key(slot)),
                            m.tier(),
                        ));
                    }
                }
            }
        }
        entries.sort_unstable_by_key(|e| std::cmp::Reverse(e.0));
        entries
            .into_iter()
            .map(|(_, pod, key, tier)| (pod, key, tier))
            .collect()
    }

    /// The same pods and entries under another budget or TTL (the oldest go
    /// first if they no longer fit). Learned entries restart their TTL.
    pub fn reconfigured(&self, budget_bytes: usize, ttl_seconds: u32, now_s: u32) -> BlockIndex {
        let mut index = BlockIndex::new(budget_bytes, ttl_seconds);
        if let Some(ws) = &self.working_set {
            index = index.write_through(ws.store.clone(), ws.max_slots * SLOT_BYTES);
        }
        index.pods = self.pods.clone();
        index.pods_version = self.pods_version;
        index.publications = self.publications;
        index.changes = ChangeLog::starting_at(self.publications + 1);
        index.free_pods = self.free_pods.clone();
        index.live_pods = self.live_pods;
        for (pod, key, tier) in self.entries_oldest_first() {
            index.touch_chain(pod, &[key], tier, now_s);
        }
        index
    }

    /// Blocks held, bytes, sets, and what the budget cost.
    pub fn stats(&self) -> IndexStats {
        IndexStats {
            blocks: self.blocks,
            bytes: self.memory_bytes(),
            sets: self.sets.len(),
            evicted: self.evicted,
            dropped: self.dropped,
            resident_buckets: self
                .working_set
                .as_ref()
                .map_or(self.buckets.len(), |ws| ws.loaded.len()),
            resident_bytes: SLOT_BYTES
                * self.working_set.as_ref().map_or_else(
                    || self.buckets.iter().map(|b| b.slots.len()).sum(),
                    |ws| ws.resident_slots,
                ),
            written_back_early: self
                .working_set
                .as_ref()
                .map_or(0, |ws| ws.written_back_early),
            read_back: self.working_set.as_ref().map_or(0, |ws| ws.read_back),
            unloadable: self.working_set.as_ref().map_or(0, |ws| ws.unloadable),
        }
    }

    /// Bytes of the buckets (in memory or, write-through, stored) and the
    /// interned sets: never above the budget.
    pub fn memory_bytes(&self) -> usize {
        self.bucket_bytes + self.sets.memory_bytes()
    }
}

impl IndexSource for BlockIndex {
    fn set_of(&self, key: u64) -> Option<u32> {
        let bucket = self.bucket(self.bucket_of(key));
        bucket.find(key).ok().map(|i| slot_set(bucket.slots[i]))
    }

    fn members(&self, id: u32) -> std::borrow::Cow<'_, [Member]> {
        std::borrow::Cow::Borrowed(self.sets.get(id))
    }

    fn pod_state(&self, pod: PodId) -> Option<PodState> {
        self.pods.get(pod.slot()).copied()
    }

    fn clock(&self) -> Clock {
        BlockIndex::clock(self)
    }
}

#[cfg(test)]
mod tests;
