//! Writes to the index: chains stored (one block at a time or a feed
//! answer's operations in bucket order), slots placed, buckets grown, and
//! a full bucket's worst sixteenth evicted.

use super::bucket::{
    key_of, probe_slots, slot_key, slot_of, slot_set, BUCKET_SLOTS, EMPTY, EVICT_BATCH,
    MIN_BUCKET_SLOTS, REF_MASK, SLOT_BYTES,
};
use super::member::{generation_of, is_precise};
use super::{BlockIndex, IndexOp, Member, PodId, Tier};
use crate::hash::IndexKey;

/// A cached set change of one writer: (old set, new set), holding a
/// reference to each (see [`BlockIndex::touch_block`]).
type Transition = Option<(Option<u32>, u32)>;

/// Why a write to the index was not applied.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refused {
    /// The block's bucket had no free slot.
    BucketFull,
}

impl BlockIndex {
    /// Marks bucket `b` as changed since the last publication.
    pub(super) fn touched(&mut self, b: usize) {
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
