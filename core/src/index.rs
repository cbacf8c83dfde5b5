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
//! (what publications rewrote).

use crate::hash::IndexKey;
use bucket::{
    bucket_of, key_of, probe_slots, slot_key, slot_of, slot_set, Bucket, BUCKET_OVERHEAD, EMPTY,
    EVICT_BATCH, FULL_BUCKET_BYTES, MIN_BUCKET_SLOTS, REF_MASK, SLOT_BYTES,
};
use changes::{ChangeLog, Changed};
use member::{generation_of, is_precise, EPOCHS_PER_TTL};
use pod_sets::PodSets;
use working_set::WorkingSet;

mod bucket;
mod chain_match;
pub mod changes;
mod member;
mod pod_sets;
pub mod published;
mod working_set;

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

/// A cached set change of one writer: (old set, new set), holding a
/// reference to each (see [`BlockIndex::touch_block`]).
type Transition = Option<(Option<u32>, u32)>;

/// Why a write to the index was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    /// The block's bucket had no free slot.
    BucketFull,
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

    /// Marks bucket `b` as changed since the last publication.
    fn touched(&mut self, b: usize) {
        if let Some(flag) = self.bucket_dirty.get_mut(b) {
            if !*flag {
                *flag = true;
                self.dirty_buckets.push(b as u32);
            }
        }
    }

    /// Records `hashes` (block hashes or index keys) as held by `pod` in
    /// `tier`. A learned entry never downgrades a precise one (it refreshes
    /// the slot's age).
    pub fn touch_chain<K: Copy + Into<IndexKey>>(
        &mut self,
        pod: PodId,
        hashes: &[K],
        tier: Tier,
        now_s: u32,
    ) {
        let epoch = self.epoch(now_s);
        self.latest_epoch = epoch;
        let Some(member) = self.member_of(pod, tier, epoch) else {
            return;
        };
        // Consecutive blocks of a chain usually share their old set, so the
        // new one is computed once per run.
        let mut last = None;
        for &hash in hashes {
            self.touch_block(key_of(hash.into()), member, epoch, &mut last);
        }
        self.forget_transition(&mut last);
    }

    /// The member `pod` gets for an entry in `tier` written at `epoch`;
    /// `None` for a pod the index does not know.
    fn member_of(&self, pod: PodId, tier: Tier, epoch: u16) -> Option<Member> {
        let state = self.pods.get(pod.slot())?;
        Some(Member::new(
            pod,
            generation_of(state, tier),
            tier,
            if is_precise(tier) { 0 } else { epoch },
        ))
    }

    /// Records one block (its slot key) as held by `member`'s pod. `last`
    /// caches the last set change made for this member (old set → new set)
    /// while it holds a reference to both, so neither id can be freed and
    /// reused meanwhile: a block whose old set is the cached one takes the
    /// new set without merging or interning. The caller lets it go with
    /// [`BlockIndex::forget_transition`].
    fn touch_block(&mut self, key: u64, member: Member, epoch: u16, last: &mut Transition) {
        let b = self.bucket_of(key);
        self.load(b);
        let found = self.buckets[b].find(key);
        let old = found.ok().map(|i| slot_set(self.buckets[b].slots[i]));
        let to = match *last {
            Some((from, to)) if from == old => to,
            _ => {
                let members = old.map_or(&[][..], |id| self.sets.get(id));
                let merged = self.with_member(members, member, epoch);
                let to = match old.filter(|&id| self.sets.get(id) == merged.as_slice()) {
                    Some(id) => {
                        self.sets.retain(id);
                        id
                    }
                    None => match self.sets.intern(&merged) {
                        Some(id) => id,
                        None => {
                            self.dropped += 1;
                            self.forget_transition(last);
                            return;
                        }
                    },
                };
                if let Some(from) = old {
                    self.sets.retain(from);
                }
                self.forget_transition(last);
                *last = Some((old, to));
                to
            }
        };
        let age = epoch as u8;
        match (found, old) {
            (Ok(i), Some(old)) => {
                // The published bucket carries ages (a write-through
                // writer's eviction order): a new age is a change.
                if std::mem::replace(&mut self.buckets[b].ages[i], age) != age {
                    self.touched(b);
                }
                if old != to {
                    self.sets.retain(to);
                    self.buckets[b].slots[i] = slot_of(key, to);
                    self.sets.release(old);
                    self.touched(b);
                }
            }
            (found, _) => {
                self.sets.retain(to);
                // Absent: the find ended at the empty slot it goes to. A
                // refused insert released its reference.
                let _ = self.insert(b, key, to, epoch, found.err().flatten());
            }
        }
    }

    /// Drops the references a cached set change holds.
    fn forget_transition(&mut self, last: &mut Transition) {
        if let Some((from, to)) = last.take() {
            if let Some(from) = from {
                self.sets.release(from);
            }
            self.sets.release(to);
        }
    }

    /// Applies a feed answer's operations bucket by bucket: each block's
    /// operations keep their order (and no block moves across a
    /// `Cleared`), but a page of a snapshot, which touches nearly every
    /// bucket, loads each bucket of a write-through index once instead of
    /// once per operation.
    pub fn apply_ops(&mut self, ops: &[IndexOp<'_>], now_s: u32) {
        let mut blocks: Vec<u64> = Vec::new();
        let mut start = 0;
        for (end, op) in ops.iter().enumerate() {
            if let IndexOp::Cleared(pod) = *op {
                self.apply_in_bucket_order(&ops[start..end], &mut blocks, now_s);
                self.clear(pod);
                start = end + 1;
            }
        }
        self.apply_in_bucket_order(&ops[start..], &mut blocks, now_s);
    }

    /// `ops` (no `Cleared` among them) block by block, in bucket order.
    /// `blocks` is scratch space: 8 bytes per block.
    fn apply_in_bucket_order(&mut self, ops: &[IndexOp<'_>], blocks: &mut Vec<u64>, now_s: u32) {
        // A block is carried with its operation's number (see
        // [`block_of`]): more operations (never a feed answer's) are taken
        // in parts.
        if ops.len() > MAX_OPS {
            let (first, rest) = ops.split_at(MAX_OPS);
            self.apply_in_bucket_order(first, blocks, now_s);
            self.apply_in_bucket_order(rest, blocks, now_s);
            return;
        }
        let runs = self.sort_by_bucket(ops, blocks);
        let epoch = self.epoch(now_s);
        if ops.iter().any(|op| matches!(op, IndexOp::Stored(..))) {
            self.latest_epoch = epoch;
        }
        // Per stored operation: its member and its last set change (a
        // snapshot page's blocks of one pod mostly go from no set to that
        // pod's own, computed once per page instead of once per block).
        let members: Vec<Option<Member>> = ops
            .iter()
            .map(|op| match *op {
                IndexOp::Stored(pod, tier, _) => self.member_of(pod, tier, epoch),
                _ => None,
            })
            .collect();
        let mut transitions: Vec<Transition> = vec![None; ops.len()];
        let mut new_keys: Vec<u64> = Vec::new();
        let mut seen: Vec<u64> = Vec::new();
        let mut start = 0;
        // One bucket's blocks at a time.
        for (b, end) in runs {
            let run = &blocks[start..end];
            start = end;
            // Only stores with a member (a known pod) may add keys.
            new_keys.clear();
            new_keys.extend(
                run.iter()
                    .filter(|&&block| members[op_of(block)].is_some())
                    .map(|&block| slot_key(block)),
            );
            self.reserve(b, &new_keys, &mut seen);
            for &block in run {
                let (o, key) = (op_of(block), slot_key(block));
                match ops[o] {
                    IndexOp::Stored(..) => {
                        if let Some(member) = members[o] {
                            self.touch_block(key, member, epoch, &mut transitions[o]);
                        }
                    }
                    IndexOp::Removed(pod, _) => self.remove_key(pod, key, |_| true),
                    IndexOp::Cleared(_) => {}
                }
            }
        }
        for last in &mut transitions {
            self.forget_transition(last);
        }
    }

    /// Fills `blocks` with the blocks of `ops` (at most [`MAX_OPS`]), each
    /// as [`block_of`] (slot key, operation), ordered by bucket, a
    /// bucket's blocks in the operations' order so a block's operations
    /// stay in order. Returns each bucket with blocks and where they end in
    /// `blocks`, in order. A snapshot page's blocks fill a narrow run of
    /// buckets (pages are key ranges): a counting sort over that run takes
    /// two passes instead of a comparison sort's log n. The key travels
    /// with the block so the apply reads `blocks` in order instead of
    /// gathering each key from its operation.
    fn sort_by_bucket(&self, ops: &[IndexOp<'_>], blocks: &mut Vec<u64>) -> Vec<(usize, usize)> {
        let numbered = || {
            ops.iter()
                .enumerate()
                .flat_map(|(o, op)| op.keys().iter().map(move |&key| block_of(key_of(key), o)))
        };
        let bucket_at = |block: u64| self.bucket_of(slot_key(block));
        let (total, lo, hi) = numbered().fold((0, usize::MAX, 0), |(n, lo, hi), block| {
            let b = bucket_at(block);
            (n + 1, lo.min(b), hi.max(b))
        });
        let span = hi.saturating_add(1).saturating_sub(lo);
        blocks.clear();
        if total < span {
            // Few blocks over many buckets (a delta of the feed): sorted
            // by bucket, then operation (a block's operations in order).
            blocks.extend(numbered());
            blocks.sort_unstable_by_key(|&block| (bucket_at(block), op_of(block)));
            let mut runs: Vec<(usize, usize)> = Vec::new();
            for (at, &block) in blocks.iter().enumerate() {
                let bucket = bucket_at(block);
                match runs.last_mut() {
                    Some((b, end)) if *b == bucket => *end = at + 1,
                    _ => runs.push((bucket, at + 1)),
                }
            }
            return runs;
        }
        // Where each bucket's blocks start, then the next free place in it
        // (once placed, where they end).
        let mut next = vec![0usize; span + 1];
        for block in numbered() {
            next[bucket_at(block) - lo + 1] += 1;
        }
        for i in 1..next.len() {
            next[i] += next[i - 1];
        }
        blocks.resize(total, 0);
        for block in numbered() {
            let at = &mut next[bucket_at(block) - lo];
            blocks[*at] = block;
            *at += 1;
        }
        let mut start = 0;
        next[..span]
            .iter()
            .enumerate()
            .filter_map(|(b, &end)| {
                let held = end > start;
                start = end;
                held.then_some((lo + b, end))
            })
            .collect()
    }

    /// `members` with `member` in place of its pod's current entry, without
    /// members that no longer count.
    fn with_member(&self, members: &[Member], member: Member, epoch: u16) -> Vec<Member> {
        let mut out = Vec::with_capacity(members.len() + 1);
        let mut placed = false;
        for &m in members {
            if !self.is_current(m, epoch) {
                continue;
            }
            if m.pod() == member.pod() {
                // Learned never replaces precise; the pod's report stays.
                out.push(if is_precise(m.tier()) && !is_precise(member.tier()) {
                    m
                } else {
                    member
                });
                placed = true;
            } else {
                if !placed && m.pod() > member.pod() {
                    out.push(member);
                    placed = true;
                }
                out.push(m);
            }
        }
        if !placed {
            out.push(member);
        }
        out
    }

    /// Forgets blocks of `pod` (vLLM evicted them), any tier.
    pub fn remove<K: Copy + Into<IndexKey>>(&mut self, pod: PodId, hashes: &[K]) {
        self.remove_where(pod, hashes, |_| true);
    }

    /// Forgets the learned entries of `pod` among `hashes` (a request the pod
    /// refused taught them); its precise entries stay.
    pub fn remove_learned<K: Copy + Into<IndexKey>>(&mut self, pod: PodId, hashes: &[K]) {
        self.remove_where(pod, hashes, |tier| !is_precise(tier));
    }

    fn remove_where<K: Copy + Into<IndexKey>>(
        &mut self,
        pod: PodId,
        hashes: &[K],
        applies: impl Fn(Tier) -> bool,
    ) {
        for &hash in hashes {
            self.remove_key(pod, key_of(hash.into()), &applies);
        }
    }

    /// Forgets `pod`'s entry under slot key `key` if its tier `applies`.
    fn remove_key(&mut self, pod: PodId, key: u64, applies: impl Fn(Tier) -> bool) {
        // Removals carry no clock: members expired by the newest write go too.
        let epoch = self.latest_epoch;
        let b = self.bucket_of(key);
        self.load(b);
        let Ok(i) = self.buckets[b].find(key) else {
            return;
        };
        let old = slot_set(self.buckets[b].slots[i]);
        let members = self.sets.get(old);
        if !members.iter().any(|m| m.pod() == pod && applies(m.tier())) {
            return;
        }
        let rest: Vec<Member> = members
            .iter()
            .copied()
            .filter(|&m| m.pod() != pod && self.is_current(m, epoch))
            .collect();
        self.touched(b);
        if rest.is_empty() {
            self.buckets[b].delete_at(i);
            self.blocks -= 1;
            self.sets.release(old);
            return;
        }
        match self.sets.intern(&rest) {
            Some(new) => {
                let bucket = &mut self.buckets[b];
                bucket.slots[i] = slot_of(key, new);
                self.sets.release(old);
            }
            // No room for the smaller set: forget the block for every pod
            // rather than keep claiming it for this one.
            None => {
                self.buckets[b].delete_at(i);
                self.blocks -= 1;
                self.sets.release(old);
                self.dropped += 1;
            }
        }
    }

    /// Places `key` (absent) in bucket `b` pointing at `set` (one reference
    /// already taken for it); evicts or grows when the bucket is full.
    /// `free`: the empty slot a find of `key` just returned, where it goes
    /// unless the bucket must make room first.
    fn insert(
        &mut self,
        b: usize,
        key: u64,
        set: u32,
        epoch: u16,
        free: Option<usize>,
    ) -> Result<(), Refused> {
        let free = if self.buckets[b].is_full() || self.buckets[b].slots.is_empty() {
            self.make_room(b, epoch);
            None
        } else {
            free
        };
        let bucket = &mut self.buckets[b];
        if bucket.is_full() {
            self.sets.release(set);
            return Err(Refused::BucketFull);
        }
        let slot = slot_of(key, set);
        match free {
            Some(i) => bucket.place_at(i, slot, epoch as u8),
            None => bucket.place(slot, epoch as u8),
        }
        self.blocks += 1;
        self.touched(b);
        Ok(())
    }

    /// Grows bucket `b` once to the size that takes `keys` (the keys about
    /// to be stored in it, duplicates allowed) without filling up, instead
    /// of doubling as they come: a snapshot page fills each of its buckets
    /// from empty in one run, and every doubling re-seats the bucket (bench
    /// snapshot_load times it). Only distinct keys it does not hold count,
    /// so no bucket grows past what its entries need. `seen` is scratch.
    fn reserve(&mut self, b: usize, keys: &[u64], seen: &mut Vec<u64>) {
        self.load(b);
        let bucket = &self.buckets[b];
        let fits = |entries: usize, slots: usize| entries * 8 <= slots * 7;
        // At its full size a bucket makes room by evicting (`make_room`).
        if bucket.slots.len() >= BUCKET_SLOTS || fits(bucket.len + keys.len(), bucket.slots.len()) {
            return;
        }
        // The keys it does not hold, as slots of a set at most half full.
        seen.clear();
        seen.resize((keys.len() * 2).next_power_of_two(), EMPTY);
        let mut new = 0;
        for &key in keys {
            if bucket.find(key).is_ok() {
                continue;
            }
            if let Err(Some(i)) = probe_slots(seen.len(), key, |i| seen[i]) {
                seen[i] = slot_of(key, 0);
                new += 1;
            }
        }
        let mut size = bucket.slots.len().max(MIN_BUCKET_SLOTS);
        while size < BUCKET_SLOTS && !fits(bucket.len + new, size) {
            size *= 2;
        }
        if size > bucket.slots.len() {
            self.touched(b);
            self.grow_bucket(b, size);
        }
    }

    /// Re-seats bucket `b` in `size` slots, counting them in the budget and
    /// the writer's working set.
    fn grow_bucket(&mut self, b: usize, size: usize) {
        let before = self.buckets[b].slots.len();
        self.buckets[b].grow(size);
        self.bucket_bytes += (size - before) * SLOT_BYTES;
        if let Some(ws) = &mut self.working_set {
            ws.resident_slots += size - before;
            if ws.resident_slots > ws.max_slots {
                self.shrink_working_set(Some(b));
            }
        }
    }

    /// Grows bucket `b` (up to [`BUCKET_SLOTS`]) or, at its full size, evicts
    /// its worst sixteenth: learned entries past their TTL, then learned ones,
    /// then the rest; oldest first within each.
    fn make_room(&mut self, b: usize, epoch: u16) {
        self.touched(b);
        let size = self.buckets[b].slots.len();
        if size < BUCKET_SLOTS {
            self.grow_bucket(b, (size * 2).max(MIN_BUCKET_SLOTS));
            return;
        }
        // Ranks come from the slot's age and a flag per set, not the sets'
        // members: a sweep reads the bucket and one small array.
        let ttl_epochs = self.ttl_epochs();
        let now_age = epoch as u8;
        let bucket = &self.buckets[b];
        let mut ranked: Vec<(u16, u16)> = Vec::with_capacity(bucket.len);
        for (i, (&slot, &age)) in bucket.slots.iter().zip(&bucket.ages).enumerate() {
            if slot == EMPTY {
                continue;
            }
            let old = u16::from(now_age.wrapping_sub(age));
            let class: u16 = if self.sets.has_precise(slot_set(slot)) {
                0
            } else if old > ttl_epochs {
                2
            } else {
                1
            };
            ranked.push((class << 8 | old, i as u16));
        }
        let batch = EVICT_BATCH.min(ranked.len());
        if batch == 0 {
            return;
        }
        ranked.select_nth_unstable_by(batch - 1, |a, b| b.0.cmp(&a.0));
        // A slot empty before the deletions: no probe chain crosses it, so
        // re-seating may start there (the load is at most 7/8).
        let Some(start) = bucket.slots.iter().position(|&s| s == EMPTY) else {
            return;
        };
        for &(_, i) in &ranked[..batch] {
            let slot = std::mem::replace(&mut self.buckets[b].slots[usize::from(i)], EMPTY);
            self.sets.release(slot_set(slot));
        }
        let bucket = &mut self.buckets[b];
        bucket.len -= batch;
        bucket.reseat_from(start);
        self.blocks -= batch;
        self.evicted += batch as u64;
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

/// Operations one bucket-ordered apply takes: a block carries its
/// operation's number where a slot carries its set reference.
const MAX_OPS: usize = REF_MASK as usize + 1;

/// A block of an operation list as one number: its slot key and its
/// operation's number, laid out as a slot ([`slot_key`] reads the key).
fn block_of(key: u64, op: usize) -> u64 {
    slot_of(key, op as u32)
}

fn op_of(block: u64) -> usize {
    slot_set(block) as usize
}

#[cfg(test)]
mod tests;
