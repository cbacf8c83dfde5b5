//! The block → pod map, inverted: each kvroute hash is stored once, as a
//! 12-byte record in the block table (`block_table.rs`), with the interned set of the pods holding it
//! (per pod, reference counts by tier). A block held by k pods costs one
//! record, and the pods' sources refer to it by a 4-byte id. A change of a
//! hash's best tier on a pod becomes a feed op.

use std::ops::Range;

use hashbrown::HashMap;
use kvroute_core::feed::Tier;

use super::block_table::{BlockId, BlockTable, Record, SetId, EMPTY_SET, FREE};
use super::buckets::Buckets;
use super::feed_log::Sink;
use super::hashing::table_bytes;
use super::key_ranges::{KeyRanges, GROUPED_IDS};
use super::keys::{BlockHash, PodKey};

/// Records a snapshot page announces ahead of the one it reads.
const READ_AHEAD: usize = 16;

/// Per-tier reference counts of one kvroute hash on one pod.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub(super) struct TierCounts([u16; 4]);

impl TierCounts {
    pub(super) fn best(&self) -> Option<Tier> {
        const TIERS: [Tier; 4] = [Tier::Gpu, Tier::Cpu, Tier::Disk, Tier::Learned];
        self.0.iter().position(|&c| c > 0).map(|i| TIERS[i])
    }

    /// The tier when exactly one tier counts, and counts once.
    fn single_tier(&self) -> Option<Tier> {
        let best = self.best()?;
        let once = self.0.iter().map(|&c| u32::from(c)).sum::<u32>() == 1;
        once.then_some(best)
    }
}

pub(super) fn tier_bit(t: Tier) -> u8 {
    1 << t.code()
}

/// A pod's (kvroute hash, pod) entries, by best tier.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct Held([usize; 4]);

impl Held {
    pub(super) fn total(&self) -> usize {
        self.0.iter().sum()
    }

    pub(super) fn by_tier(&self, t: Tier) -> usize {
        self.0[t.code() as usize]
    }

    fn moved(&mut self, before: Option<Tier>, after: Option<Tier>) {
        if let Some(t) = before {
            let n = &mut self.0[t.code() as usize];
            *n = n.saturating_sub(1);
        }
        if let Some(t) = after {
            let n = &mut self.0[t.code() as usize];
            *n = n.saturating_add(1);
        }
    }
}

/// One pod's hold on a block.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Holder {
    pod: PodKey,
    counts: TierCounts,
}

/// A [`SetId`] with this bit is not interned: it carries one pod key and the
/// one tier that pod counts once (most blocks are held so; no lookup for
/// them). Others are interned.
const SINGLE: SetId = 1 << 31;
/// Pod keys a [`SINGLE`] id carries (below 2^29, and never [`FREE`]'s bits).
const SINGLE_PODS: u64 = (1 << 29) - 1;

fn single(pod: PodKey, tier: Tier) -> Option<SetId> {
    let pod = pod.get();
    (pod < SINGLE_PODS).then(|| SINGLE | (pod as SetId) << 2 | SetId::from(tier.code()))
}

/// The (pod, tier) of a [`SINGLE`] id.
fn single_parts(set: SetId) -> Option<(PodKey, Tier)> {
    if set & SINGLE == 0 || set == FREE {
        return None;
    }
    let tier = Tier::from_code((set & 3) as u8)?;
    Some((PodKey::new(u64::from((set & !SINGLE) >> 2)), tier))
}

fn single_holder(pod: PodKey, tier: Tier) -> Holder {
    let mut counts = TierCounts::default();
    counts.0[tier.code() as usize] = 1;
    Holder { pod, counts }
}

/// Interned holder sets, reference counted by the records that use them.
struct PodSets {
    /// Set id → its holders, sorted by pod, and how many records use it.
    slots: Vec<(Box<[Holder]>, u32)>,
    ids: HashMap<Box<[Holder]>, SetId>,
    free: Vec<SetId>,
    /// The set being built (kept to reuse its allocation).
    scratch: Vec<Holder>,
}

impl PodSets {
    fn new() -> PodSets {
        PodSets {
            slots: vec![(Box::default(), 0)],
            ids: HashMap::new(),
            free: Vec::new(),
            scratch: Vec::new(),
        }
    }

    /// The holders of a set: a [`SINGLE`] one, or an interned slice.
    fn holders(&self, set: SetId) -> impl Iterator<Item = Holder> + '_ {
        let single = single_parts(set).map(|(pod, tier)| single_holder(pod, tier));
        single.into_iter().chain(self.interned(set).iter().copied())
    }

    /// The holders of an interned set (none for a [`SINGLE`] id).
    fn interned(&self, set: SetId) -> &[Holder] {
        match single_parts(set) {
            Some(_) => &[],
            None => self.slots.get(set as usize).map_or(&[][..], |s| &s.0),
        }
    }

    /// The id of `scratch`'s set, with one more reference.
    fn intern_scratch(&mut self) -> SetId {
        match self.scratch[..] {
            [] => return EMPTY_SET,
            [Holder { pod, counts }] => {
                if let Some(id) = counts.single_tier().and_then(|t| single(pod, t)) {
                    return id;
                }
            }
            _ => {}
        }
        if let Some(&id) = self.ids.get(&self.scratch[..]) {
            if let Some(slot) = self.slots.get_mut(id as usize) {
                slot.1 = slot.1.saturating_add(1);
            }
            return id;
        }
        let holders: Box<[Holder]> = self.scratch.as_slice().into();
        let id = match self.free.pop() {
            Some(id) => {
                if let Some(slot) = self.slots.get_mut(id as usize) {
                    *slot = (holders.clone(), 1);
                }
                id
            }
            None => {
                self.slots.push((holders.clone(), 1));
                (self.slots.len() - 1) as SetId
            }
        };
        self.ids.insert(holders, id);
        id
    }

    fn release(&mut self, id: SetId) {
        if id == EMPTY_SET || id & SINGLE != 0 {
            return;
        }
        let Some(slot) = self.slots.get_mut(id as usize) else {
            return;
        };
        slot.1 = slot.1.saturating_sub(1);
        if slot.1 == 0 {
            let holders = std::mem::take(&mut slot.0);
            self.ids.remove(&holders);
            self.free.push(id);
        }
    }

    fn memory_bytes(&self) -> usize {
        let holders: usize = self.slots.iter().map(|s| s.0.len()).sum();
        self.slots.capacity() * std::mem::size_of::<(Box<[Holder]>, u32)>()
            + table_bytes(
                self.ids.capacity(),
                std::mem::size_of::<(Box<[Holder]>, SetId)>(),
            )
            // each set's holders are held twice: by its slot and as its key
            + 2 * holders * std::mem::size_of::<Holder>()
            + self.free.capacity() * 4
    }
}

/// Every block some pod holds, with its holders.
pub(super) struct Blocks {
    /// Records by index key; a record's id is stable until the table grows.
    records: BlockTable,
    sets: PodSets,
    /// The records' ids by key range for snapshot pages, with the stamp
    /// (log cursor) they were taken at; dropped when the table grows.
    by_key_range: Option<(u64, KeyRanges)>,
    /// Ids a grouping holds, about ([`GROUPED_IDS`]; tests make it small).
    grouped_ids: usize,
}

impl Default for Blocks {
    fn default() -> Self {
        Blocks {
            records: BlockTable::default(),
            sets: PodSets::new(),
            by_key_range: None,
            grouped_ids: GROUPED_IDS,
        }
    }
}

impl Blocks {
    /// Distinct kvroute hashes held by some pod.
    pub(super) fn len(&self) -> usize {
        self.records.len()
    }

    /// The kvroute hash of a record.
    pub(super) fn kv(&self, id: BlockId) -> BlockHash {
        self.records.get(id).map_or(BlockHash::default(), |r| r.kv)
    }

    /// Grows the block table when it is full enough (at once to room for
    /// `expected()` records when that is more), which renumbers the records:
    /// returns each old id's new id ([`BlockId::MAX`] for none), for the
    /// caller to rewrite every id it holds before the next call here.
    pub(super) fn grow_if_full(
        &mut self,
        expected: impl FnOnce() -> usize,
    ) -> Option<Vec<BlockId>> {
        if !self.records.needs_growth() {
            return None;
        }
        self.by_key_range = None;
        Some(self.records.grow(expected()))
    }

    /// The record of `kv`. Blocks are keyed by their index key, as routing
    /// compares them and the feed carries them: hashes that agree on those
    /// bits are one block here too. The record keeps the first full hash
    /// (the parent of the chain's next block).
    pub(super) fn find(&self, kv: BlockHash) -> Option<BlockId> {
        self.records.find(kv.index_key())
    }

    /// Starts loading the buckets where `kv`'s record is or would go (see
    /// [`super::prefetch`]).
    pub(super) fn prefetch(&self, kv: BlockHash) {
        self.records.prefetch(kv.index_key());
    }

    /// The record of `kv`, added with no holder when absent (the caller adds
    /// one at once); `None` when the map holds
    /// [`MAX_BLOCKS`](super::block_table::MAX_BLOCKS) already.
    pub(super) fn acquire(&mut self, kv: BlockHash) -> Option<BlockId> {
        self.records.find_or_insert(kv)
    }

    /// Adds (`up`) or drops one count of `tier` of block `id` on `pod`,
    /// emitting an op when the pod's best tier of the hash changes. A block
    /// left with no holder leaves the map.
    pub(super) fn adjust(
        &mut self,
        sink: &mut Sink,
        held: &mut Held,
        pod: PodKey,
        id: BlockId,
        tier: Tier,
        up: bool,
    ) {
        let Some(&Record { kv, set }) = self.records.get(id) else {
            return;
        };
        let fast = match (set, up) {
            (EMPTY_SET, true) => single(pod, tier).map(|s| (None, Some(tier), s)),
            (s, false) if single_parts(s) == Some((pod, tier)) => {
                Some((Some(tier), None, EMPTY_SET))
            }
            _ => None,
        };
        let (before, after, new_set) = match fast {
            Some(t) => t,
            None if set == FREE => return,
            None => self.adjust_set(set, pod, tier, up),
        };
        if new_set == EMPTY_SET {
            self.records.remove(id);
        } else if let Some(rec) = self.records.get_mut(id) {
            rec.set = new_set;
        }
        if before != after {
            held.moved(before, after);
            match after {
                Some(t) => sink.stored(pod, t, kv),
                None => sink.removed(pod, kv),
            }
        }
    }

    /// The general case of [`Blocks::adjust`]: the set with `pod`'s count
    /// changed, interned; returns `pod`'s best tier before and after, and the
    /// new set (the old one released).
    fn adjust_set(
        &mut self,
        set: SetId,
        pod: PodKey,
        tier: Tier,
        up: bool,
    ) -> (Option<Tier>, Option<Tier>, SetId) {
        let t = tier.code() as usize;
        let mut scratch = std::mem::take(&mut self.sets.scratch);
        scratch.clear();
        scratch.extend(self.sets.holders(set));
        let (before, after) = match scratch.binary_search_by_key(&pod, |h| h.pod) {
            Ok(i) => {
                let counts = &mut scratch[i].counts;
                let before = counts.best();
                let c = &mut counts.0[t];
                *c = if up {
                    c.saturating_add(1)
                } else {
                    c.saturating_sub(1)
                };
                let after = counts.best();
                if after.is_none() {
                    scratch.remove(i);
                }
                (before, after)
            }
            Err(i) if up => {
                scratch.insert(i, single_holder(pod, tier));
                (None, Some(tier))
            }
            Err(_) => (None, None),
        };
        self.sets.scratch = scratch;
        let new_set = self.sets.intern_scratch();
        self.sets.release(set);
        (before, after, new_set)
    }

    /// [`Blocks::adjust`] by hash; a hash to drop that no pod holds is ignored.
    pub(super) fn adjust_kv(
        &mut self,
        sink: &mut Sink,
        held: &mut Held,
        pod: PodKey,
        kv: BlockHash,
        tier: Tier,
        up: bool,
    ) {
        let id = if up { self.acquire(kv) } else { self.find(kv) };
        if let Some(id) = id {
            self.adjust(sink, held, pod, id, tier, up);
        }
    }

    /// The best tier of `kv` on each pod holding it.
    pub(super) fn holders(&self, kv: BlockHash) -> impl Iterator<Item = (PodKey, Tier)> + '_ {
        self.set_holders(self.set_of(kv))
    }

    /// The interned set of pods holding `kv` (equal ids: equal holders and tiers).
    pub(super) fn set_of(&self, kv: BlockHash) -> SetId {
        self.find(kv)
            .and_then(|id| self.records.get(id))
            .map_or(EMPTY_SET, |r| r.set)
    }

    /// The best tier of each pod in `set`.
    pub(super) fn set_holders(&self, set: SetId) -> impl Iterator<Item = (PodKey, Tier)> + '_ {
        // A single holder's tier is in its id: no counts to build and read
        // back (a snapshot page asks this of every block it sends).
        let interned = self.sets.interned(set).iter();
        single_parts(set)
            .into_iter()
            .chain(interned.filter_map(|h| Some((h.pod, h.counts.best()?))))
    }

    /// Every block whose index key lies in `keys`, with its holder set (a
    /// snapshot page's range). Reads the records through their ids grouped
    /// by key range, taken at stamp `now` unless a grouping taken at
    /// `taken_since` or later that covers `keys` is kept; so every block held
    /// at `taken_since` and still held is found, and blocks stored since may
    /// be. Pages asked in ascending order share a grouping until one passes
    /// its window.
    pub(super) fn in_key_range(
        &mut self,
        keys: Range<u64>,
        taken_since: u64,
        now: u64,
    ) -> Vec<(u64, SetId)> {
        let ranges = match self.by_key_range.take() {
            Some((stamp, ranges)) if stamp >= taken_since && ranges.covers(&keys) => {
                (stamp, ranges)
            }
            _ => {
                let table = &self.records;
                let live = || {
                    table
                        .ids_and_records()
                        .filter(|(_, r)| r.set != EMPTY_SET)
                        .map(|(id, r)| (id, { r.kv }.index_key().get()))
                };
                let total = table.len();
                (
                    now,
                    KeyRanges::take(keys.clone(), total, self.grouped_ids, live),
                )
            }
        };
        // The ids of a range are spread over the whole table, and a page
        // spans ~37 ranges: read in that order, nearly every record is on a
        // page of memory of its own. In table order, a page's records share
        // pages and cache lines; the reads ahead are announced as well.
        let ids = in_table_order(ranges.1.ids_in(keys.clone()), self.records.id_end());
        let mut found = Vec::with_capacity(ids.len());
        for (i, &id) in ids.iter().enumerate() {
            if let Some(&ahead) = ids.get(i + READ_AHEAD) {
                self.records.prefetch_record(ahead);
            }
            if let Some(&Record { kv, set }) = self.records.get(id) {
                let key = kv.index_key().get();
                if keys.contains(&key) && set != EMPTY_SET {
                    found.push((key, set));
                }
            }
        }
        self.by_key_range = Some(ranges);
        found
    }

    /// Drops the grouping of ids by key range (a snapshot's last page went out).
    pub(super) fn forget_key_ranges(&mut self) {
        self.by_key_range = None;
    }

    /// Bytes held: the block table, the interned sets and the ids by key range.
    pub(super) fn memory_bytes(&self) -> usize {
        let ranges = self
            .by_key_range
            .as_ref()
            .map_or(0, |(_, r)| r.memory_bytes());
        self.records.memory_bytes() + self.sets.memory_bytes() + ranges
    }
}

/// Adds (`up`) or drops one count of `tier` for every part of a block: its
/// head parts (a vLLM block of several kvroute blocks) and its last one.
#[allow(clippy::too_many_arguments)]
pub(super) fn adjust_block(
    blocks: &mut Blocks,
    sink: &mut Sink,
    held: &mut Held,
    pod: PodKey,
    id: BlockId,
    head: Option<&[BlockId]>,
    tier: Tier,
    up: bool,
) {
    for &part in head.unwrap_or_default() {
        blocks.adjust(sink, held, pod, part, tier, up);
    }
    blocks.adjust(sink, held, pod, id, tier, up);
}

/// Regions of the block table a page's ids are grouped by.
const REGION_BITS: u32 = 12;

/// `ids` (all below `id_end`) grouped by region of the table, on their
/// high bits: a region is 4,096 records (48 KB) at 1,000 pods, so reading
/// them region by region walks the table once.
fn in_table_order(ids: &[BlockId], id_end: usize) -> Vec<BlockId> {
    let span_bits = usize::BITS - id_end.max(1).leading_zeros();
    let shift = span_bits.saturating_sub(REGION_BITS);
    let by_region = || ids.iter().map(|&id| ((id as usize) >> shift, id));
    Buckets::sort(1 << REGION_BITS, by_region).ids
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::index::block_table::MAX_BLOCKS;
    use crate::index::keys::KEY_END;

    /// A page's ids come back all of them, once each, region by region, for
    /// tables whose ids span fewer or more bits than the regions.
    #[test]
    fn a_pages_ids_are_read_in_table_order() {
        for id_end in [1usize, 3_000, 15_800_000, MAX_BLOCKS] {
            let mut x = 0x2545_f491_4f6c_dd1d_u64;
            let mut ids: Vec<BlockId> = (0..5_000)
                .map(|_| {
                    x = x.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
                    ((x >> 33) % id_end as u64) as BlockId
                })
                .collect();
            ids.push((id_end - 1) as BlockId);
            let grouped = in_table_order(&ids, id_end);
            let region_bits = usize::BITS - id_end.leading_zeros();
            let shift = region_bits.saturating_sub(REGION_BITS);
            assert!(
                grouped.windows(2).all(|w| w[0] >> shift <= w[1] >> shift),
                "regions out of order for {id_end} ids"
            );
            let (mut want, mut got) = (ids, grouped);
            want.sort_unstable();
            got.sort_unstable();
            assert_eq!(got, want, "ids lost or repeated for {id_end} ids");
        }
    }

    /// Pages through the key space as a snapshot does, with groupings of
    /// about 64 ids: every block comes once, and no grouping holds much more
    /// than its share, however many blocks there are.
    #[test]
    fn pages_through_small_groupings_find_every_block_once() {
        let mut blocks = Blocks {
            grouped_ids: 64,
            ..Blocks::default()
        };
        let (mut sink, mut held) = (Sink::default(), Held::default());
        let pod = PodKey::new(1);
        let mut all: Vec<u64> = (1..=2_000u64)
            .map(|i| {
                let kv = BlockHash::new(i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
                blocks.adjust_kv(&mut sink, &mut held, pod, kv, Tier::Gpu, true);
                kv.index_key().get()
            })
            .collect();
        all.sort_unstable();
        let page = KEY_END / 100; // ~20 blocks a page
        let mut seen = Vec::new();
        let mut start = 0;
        while start < KEY_END {
            let end = (start + page).min(KEY_END);
            seen.extend(
                blocks
                    .in_key_range(start..end, 0, 0)
                    .into_iter()
                    .map(|(k, _)| k),
            );
            let held_ids = blocks
                .by_key_range
                .as_ref()
                .map_or(0, |(_, r)| r.memory_bytes() / 4);
            assert!(
                held_ids <= 4_097 + 128,
                "{held_ids} ids and row starts held"
            );
            start = end;
        }
        seen.sort_unstable();
        assert_eq!(seen, all);
    }

    #[test]
    fn a_block_leaves_with_its_last_holder() {
        let mut blocks = Blocks::default();
        let mut sink = Sink::default();
        let (mut first, mut second) = (Held::default(), Held::default());
        let (one, two) = (PodKey::new(1), PodKey::new(2));
        let (seven, nine) = (BlockHash::new(7), BlockHash::new(9));
        let id = blocks.acquire(seven).unwrap();
        blocks.adjust(&mut sink, &mut first, one, id, Tier::Gpu, true);
        blocks.adjust(&mut sink, &mut second, two, id, Tier::Cpu, true);
        blocks.adjust(&mut sink, &mut first, one, id, Tier::Gpu, true);
        let holders: Vec<_> = blocks.holders(seven).collect();
        assert_eq!(holders, [(one, Tier::Gpu), (two, Tier::Cpu)]);
        assert_eq!(
            (blocks.len(), first.total(), second.by_tier(Tier::Cpu)),
            (1, 1, 1)
        );

        blocks.adjust(&mut sink, &mut second, two, id, Tier::Cpu, false);
        blocks.adjust(&mut sink, &mut first, one, id, Tier::Gpu, false);
        // One pod counting once: back to a set id that needs no interning.
        assert!(blocks.sets.ids.is_empty());
        assert_eq!(
            blocks.holders(seven).collect::<Vec<_>>(),
            [(one, Tier::Gpu)]
        );

        blocks.adjust(&mut sink, &mut first, one, id, Tier::Gpu, false);
        assert_eq!((blocks.len(), first.total(), second.total()), (0, 0, 0));
        assert_eq!(blocks.find(seven), None);
        let id = blocks.acquire(nine).unwrap();
        assert_eq!((blocks.kv(id), blocks.len()), (nine, 1));
    }

    #[test]
    fn single_set_ids_carry_their_pod_and_tier_and_larger_pod_keys_are_interned() {
        for pod in [0, 1, SINGLE_PODS - 1].map(PodKey::new) {
            for tier in [Tier::Gpu, Tier::Cpu, Tier::Disk, Tier::Learned] {
                let set = single(pod, tier).unwrap();
                assert_ne!(set, FREE);
                assert_eq!(single_parts(set), Some((pod, tier)));
            }
        }
        assert_eq!(single(PodKey::new(SINGLE_PODS), Tier::Gpu), None);

        let mut blocks = Blocks::default();
        let mut sink = Sink::default();
        let mut held = Held::default();
        let pod = PodKey::new(1 << 40);
        let three = BlockHash::new(3);
        blocks.adjust_kv(&mut sink, &mut held, pod, three, Tier::Disk, true);
        assert_eq!(
            blocks.holders(three).collect::<Vec<_>>(),
            [(pod, Tier::Disk)]
        );
        assert_eq!(blocks.sets.ids.len(), 1);
        blocks.adjust_kv(&mut sink, &mut held, pod, three, Tier::Disk, false);
        assert!(blocks.sets.ids.is_empty());
        assert_eq!(blocks.len(), 0);
    }
}
