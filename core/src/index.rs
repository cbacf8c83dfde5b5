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
mod tests {
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
                let keep_precise =
                    entry.0 != Tier::Learned && tier == Tier::Learned && self.ttl > 0;
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
                .filter(|(&(_, k), &(t, at))| {
                    k == key_of(hash.index_key()) && self.live(t, at, now_s)
                })
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
                    if !self.live(tier, at, now_s)
                        || (tier != Tier::Learned && !rules.trust_precise)
                    {
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
        let (same, (reads_after_heartbeat, reused)) =
            shared.lookup_in(&mut view, &c, 1, &TRUST_ALL);
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
        let (answer, (reads_behind, reused_behind)) =
            shared.lookup_in(&mut behind, &c, 1, &TRUST_ALL);
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
        let is_loaded = |index: &BlockIndex, b: usize| {
            index.working_set.as_ref().is_some_and(|ws| ws.is_loaded[b])
        };
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
}
