//! A KV-cache group's vLLM-hash table: 8-byte entries in buckets of 8 (one
//! cache line), no control bytes, grown by a quarter at a time so that it
//! stays 72–90 % full. Each fingerprint has two buckets (bucketized cuckoo
//! hashing): an entry goes to the first with room, and when both are full
//! it takes a slot and moves that slot's entry to its other bucket. A lookup
//! reads two cache lines at most; a removal just empties the slot.
//!
//! Why not hashbrown: its table of the former 12-byte entries (exact vLLM hash +
//! record id) was 59 % full at the benchmark's working set (8 pods × 19,208
//! blocks; buckets are a power of two at most 7/8 full) and added a control byte
//! per bucket: 22 bytes per (block, pod) measured, half of the index's 43.1
//! (docs/results/2026-12-01-indexer-memory-088572a). This table costs 8 / load:
//! 8.9–11 bytes. Filling a table to 19,208 entries costs ~50 ns per insert
//! here, growth included (hashbrown: ~15); a pod's first table is therefore
//! made with room for the pod's reported capacity, and does not grow while
//! the pod fills. Linear probing at that load measured
//! slower: Robin Hood order shifted runs of tens of slots per insert (~150 ns
//! more per stored block in the benchmark), and buckets with overflow counts
//! formed runs of full buckets (161 ns per insert, 2.1 µs per removal + insert;
//! ~55 ns here).
//!
//! The key is lossy: an entry keeps a 32-bit fingerprint of the vLLM hash, not
//! the hash. Two vLLM hashes of one group whose fingerprints agree are one
//! entry: a store of the second replaces the first (as a store of the same hash
//! with other content does), and a removal or a parent lookup of an absent hash
//! can hit a present one. With n entries in a group that happens to a store with
//! probability n / 2³² (2.3 · 10⁻⁴ at the default cap of 2²⁰ blocks per pod);
//! the benchmark counts the entries it loses so.

use super::block_table::BlockId;
use super::hashing::mix;
use super::keys::VllmHash;
use super::prefetch::prefetch;

/// The 32 bits of a vLLM hash a group's table keeps (its key there).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct Fingerprint(u32);

impl Fingerprint {
    pub(super) fn of(vh: VllmHash) -> Fingerprint {
        Fingerprint((mix(vh) >> 32) as u32)
    }

    /// The two buckets where this fingerprint's entry may live in a table of
    /// `buckets` (any number, not only powers of two).
    fn homes(self, buckets: usize) -> [usize; 2] {
        let scaled = |x: u32| ((u64::from(x) * buckets as u64) >> 32) as usize;
        // An odd multiplier permutes the u32s: the second bucket is
        // independent of the first.
        [scaled(self.0), scaled(self.0.wrapping_mul(0x9e37_79b1))]
    }
}

/// Bits of an entry below the fingerprint: the record id, then the tier bits.
const TIERS_SHIFT: u32 = 29;
const BLOCK_MASK: u64 = (1 << TIERS_SHIFT) - 1;
const _: () = assert!(super::block_table::MAX_BLOCKS == 1 << TIERS_SHIFT);

/// A vLLM block held by one publisher's group: its fingerprint (high 32 bits),
/// a bit per tier it is in (GPU, CPU, disk), and the record of its kvroute hash
/// (of its last kvroute-sized part when it spans several: the parent of the
/// next block). A live entry is in some tier, so 0 marks an empty slot.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(transparent)]
pub(super) struct SourceEntry(u64);

const EMPTY: SourceEntry = SourceEntry(0);

impl SourceEntry {
    /// An entry in the tiers of `tiers` (bits of [`super::blocks::tier_bit`]).
    pub(super) fn new(fp: Fingerprint, block: BlockId, tiers: u8) -> SourceEntry {
        SourceEntry(
            u64::from(fp.0) << 32
                | u64::from(tiers & 7) << TIERS_SHIFT
                | u64::from(block) & BLOCK_MASK,
        )
    }

    pub(super) fn fp(self) -> Fingerprint {
        Fingerprint((self.0 >> 32) as u32)
    }

    pub(super) fn block(self) -> BlockId {
        (self.0 & BLOCK_MASK) as BlockId
    }

    /// The same entry on another record (the block table renumbered them).
    fn with_block(self, block: BlockId) -> SourceEntry {
        SourceEntry(self.0 & !BLOCK_MASK | u64::from(block) & BLOCK_MASK)
    }

    fn tiers(self) -> u64 {
        self.0 >> TIERS_SHIFT & 7
    }

    /// True when the block is in the tier of `bit`.
    pub(super) fn has(self, bit: u8) -> bool {
        self.tiers() & u64::from(bit) != 0
    }

    pub(super) fn add(&mut self, bit: u8) {
        self.0 |= u64::from(bit & 7) << TIERS_SHIFT;
    }

    /// Drops a tier; true when the block is in none left (the entry must go).
    pub(super) fn remove(&mut self, bit: u8) -> bool {
        self.0 &= !(u64::from(bit & 7) << TIERS_SHIFT);
        self.tiers() == 0
    }

    fn is_empty(self) -> bool {
        self.tiers() == 0
    }
}

/// Most entries per slot before the table grows (9 in 10).
const MAX_LOAD: (usize, usize) = (9, 10);
/// Slots per bucket: 64 bytes.
const BUCKET: usize = 8;
/// Entries moved to their other bucket for one insert before the table grows
/// instead.
const MAX_MOVES: usize = 64;

/// Entries keyed by their fingerprint.
#[derive(Default)]
pub(super) struct SourceTable {
    /// `BUCKET` slots per bucket.
    slots: Vec<SourceEntry>,
    len: usize,
}

impl SourceTable {
    /// A table with room for `entries` before its first growth (none for 0).
    pub(super) fn with_room_for(entries: usize) -> SourceTable {
        let slots = entries.saturating_mul(MAX_LOAD.1).div_ceil(MAX_LOAD.0);
        SourceTable {
            slots: vec![EMPTY; slots.div_ceil(BUCKET) * BUCKET],
            len: 0,
        }
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    pub(super) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes held.
    pub(super) fn memory_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<SourceEntry>()
    }

    fn buckets(&self) -> usize {
        self.slots.len() / BUCKET
    }

    /// The two buckets where an entry of `fp` may live.
    fn homes(&self, fp: Fingerprint) -> [usize; 2] {
        fp.homes(self.buckets())
    }

    fn bucket(&self, b: usize) -> &[SourceEntry] {
        self.slots
            .get(b * BUCKET..(b + 1) * BUCKET)
            .unwrap_or_default()
    }

    /// The slot of `fp`'s entry. Valid until the next insert or removal.
    pub(super) fn find(&self, fp: Fingerprint) -> Option<usize> {
        if self.len == 0 {
            return None;
        }
        self.homes(fp).into_iter().find_map(|b| {
            let i = self
                .bucket(b)
                .iter()
                .position(|&e| e.fp() == fp && !e.is_empty())?;
            Some(b * BUCKET + i)
        })
    }

    /// Starts loading the buckets of `fp` (see [`super::prefetch`]).
    pub(super) fn prefetch(&self, fp: Fingerprint) {
        for b in self.homes(fp) {
            prefetch(self.bucket(b));
        }
    }

    /// The entry of `fp`.
    pub(super) fn get(&self, fp: Fingerprint) -> Option<SourceEntry> {
        self.find(fp).and_then(|slot| self.at(slot))
    }

    /// The entry in a slot [`SourceTable::find`] returned.
    pub(super) fn at(&self, slot: usize) -> Option<SourceEntry> {
        self.slots.get(slot).copied().filter(|e| !e.is_empty())
    }

    /// Replaces the entry in a slot [`SourceTable::find`] returned with one of
    /// the same fingerprint, in some tier.
    pub(super) fn set(&mut self, slot: usize, entry: SourceEntry) {
        if let Some(s) = self.slots.get_mut(slot) {
            if !s.is_empty() && s.fp() == entry.fp() && !entry.is_empty() {
                *s = entry;
            }
        }
    }

    /// Adds an entry whose fingerprint is absent (the caller checked with
    /// [`SourceTable::find`]), in some tier.
    pub(super) fn insert(&mut self, entry: SourceEntry) {
        if entry.is_empty() {
            return;
        }
        if (self.len + 1) * MAX_LOAD.1 > self.slots.len() * MAX_LOAD.0 {
            self.grow(Vec::new());
        }
        if let Some(homeless) = self.place(entry) {
            self.grow(vec![homeless]);
        }
        self.len += 1;
    }

    /// The first empty slot of bucket `b`.
    fn room(&self, b: usize) -> Option<usize> {
        let i = self.bucket(b).iter().position(|e| e.is_empty())?;
        Some(b * BUCKET + i)
    }

    /// Puts an entry in the first of its buckets with room; when both are
    /// full, in a slot of one of them, whose entry then goes to its other
    /// bucket, and so on (cuckoo hashing). Returns the entry left without a
    /// slot after [`MAX_MOVES`] moves.
    fn place(&mut self, mut entry: SourceEntry) -> Option<SourceEntry> {
        if self.slots.is_empty() {
            return Some(entry);
        }
        // The bucket the moved entry came from (it is full).
        let mut from = None;
        for moves in 0..MAX_MOVES {
            let [a, b] = self.homes(entry.fp());
            if let Some(slot) = self.room(a).or_else(|| self.room(b)) {
                self.slots[slot] = entry;
                return None;
            }
            // Both full: take a slot in the bucket the entry did not come
            // from, varying the slot so that moves do not cycle.
            let b = if from == Some(a) { b } else { a };
            let slot = b * BUCKET + (entry.fp().0 as usize + moves) % BUCKET;
            entry = std::mem::replace(self.slots.get_mut(slot)?, entry);
            from = Some(b);
        }
        Some(entry)
    }

    /// Removes the entry in a slot [`SourceTable::find`] returned.
    pub(super) fn remove_at(&mut self, slot: usize) {
        if self.at(slot).is_some() {
            self.slots[slot] = EMPTY;
            self.len -= 1;
        }
    }

    /// Grows by a quarter of its buckets, re-placing every entry and the
    /// `homeless` ones: the table stays 72–90 % full (a power-of-two doubling:
    /// 45–90 %). Growing by an eighth (80–90 %) cost ~60 ns more per insert.
    /// Each entry goes to its first bucket while that has room, counted
    /// aside (the new table is at most 72 % full: few do not fit), and the
    /// rest by [`SourceTable::place`].
    fn grow(&mut self, mut homeless: Vec<SourceEntry>) {
        loop {
            let buckets = self.buckets();
            let bigger = (buckets + buckets / 4).max(buckets + 1);
            let old = std::mem::replace(&mut self.slots, vec![EMPTY; bigger * BUCKET]);
            let pending = std::mem::take(&mut homeless);
            let mut filled = vec![0u8; bigger];
            let mut rest = Vec::new();
            for entry in old.into_iter().filter(|e| !e.is_empty()).chain(pending) {
                let [a, _] = entry.fp().homes(bigger);
                match filled.get_mut(a) {
                    Some(n) if usize::from(*n) < BUCKET => {
                        self.slots[a * BUCKET + usize::from(*n)] = entry;
                        *n += 1;
                    }
                    _ => rest.push(entry),
                }
            }
            for entry in rest {
                homeless.extend(self.place(entry));
            }
            if homeless.is_empty() {
                return;
            }
        }
    }

    /// Every entry.
    #[cfg(test)]
    fn iter(&self) -> impl Iterator<Item = SourceEntry> + '_ {
        self.slots.iter().copied().filter(|e| !e.is_empty())
    }

    /// Rewrites every entry's record id (the block table renumbered them).
    pub(super) fn remap_blocks(&mut self, new_id: impl Fn(BlockId) -> BlockId) {
        for e in self.slots.iter_mut().filter(|e| !e.is_empty()) {
            *e = e.with_block(new_id(e.block()));
        }
    }

    /// Takes every entry out, leaving the table empty and unallocated.
    pub(super) fn take_all(&mut self) -> impl Iterator<Item = SourceEntry> {
        self.len = 0;
        std::mem::take(&mut self.slots)
            .into_iter()
            .filter(|e| !e.is_empty())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// A small deterministic generator (xorshift).
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// Checks the table against the model: same entries, each found, each
    /// in one of its two buckets, and at most 9 slots in 10 used.
    fn check(table: &SourceTable, model: &HashMap<u32, SourceEntry>) {
        assert_eq!(table.len(), model.len());
        assert_eq!(table.iter().count(), model.len());
        for (&fp, &entry) in model {
            assert_eq!(table.get(Fingerprint(fp)), Some(entry));
        }
        for (slot, e) in table.slots.iter().enumerate() {
            if !e.is_empty() {
                assert!(
                    table.homes(e.fp()).contains(&(slot / BUCKET)),
                    "slot {slot}"
                );
            }
        }
        assert!(table.len * MAX_LOAD.1 <= table.slots.len() * MAX_LOAD.0);
    }

    #[test]
    fn insert_find_update_remove_and_growth_by_a_quarter() {
        let mut table = SourceTable::default();
        assert_eq!(table.get(Fingerprint(7)), None);
        let mut model = HashMap::new();
        for i in 0..1000u32 {
            let fp = i.wrapping_mul(0x9e37_79b9);
            let e = SourceEntry::new(Fingerprint(fp), i, 1);
            table.insert(e);
            model.insert(fp, e);
        }
        check(&table, &model);
        // Grown by quarters: at most 9 in 10 slots used, at least 7 in 10.
        let slots = table.slots.len();
        assert!(
            slots * 9 >= 1000 * 10 && slots * 7 <= 1000 * 10,
            "{slots} slots for 1000"
        );
        assert_eq!(table.memory_bytes(), slots * 8);

        let fp = 5u32.wrapping_mul(0x9e37_79b9);
        let slot = table.find(Fingerprint(fp)).unwrap();
        let mut e = table.at(slot).unwrap();
        assert_eq!((e.block(), e.has(1), e.has(2)), (5, true, false));
        e.add(2);
        table.set(slot, e);
        model.insert(fp, e);
        assert!(table.get(Fingerprint(fp)).unwrap().has(2));
        // A tier dropped while another is left keeps the entry.
        assert!(!e.remove(1));
        assert!(e.remove(2));

        for i in (0..1000u32).step_by(3) {
            let fp = i.wrapping_mul(0x9e37_79b9);
            let slot = table.find(Fingerprint(fp)).unwrap();
            table.remove_at(slot);
            model.remove(&fp);
        }
        check(&table, &model);
        let taken: Vec<_> = table.take_all().collect();
        assert_eq!(
            (taken.len(), table.len(), table.memory_bytes()),
            (666, 0, 0)
        );
    }

    #[test]
    fn a_table_with_room_for_a_pods_capacity_fills_to_it_without_growing() {
        let capacity = 19_208;
        let mut table = SourceTable::with_room_for(capacity);
        let bytes = table.memory_bytes();
        // At most 9 slots in 10 used when full, rounded up to whole buckets.
        assert_eq!(bytes, 21_344 * 8);
        let mut rng = Rng(0x2545_f491_4f6c_dd1d);
        let mut model = HashMap::new();
        while model.len() < capacity {
            let fp = rng.next() as u32;
            if !model.contains_key(&fp) {
                let e = SourceEntry::new(Fingerprint(fp), model.len() as BlockId, 1);
                table.insert(e);
                model.insert(fp, e);
            }
        }
        check(&table, &model);
        assert_eq!(table.memory_bytes(), bytes);
        assert!(SourceTable::with_room_for(0).slots.is_empty());
    }

    #[test]
    fn fingerprint_zero_record_zero_and_the_largest_values_are_entries() {
        let mut table = SourceTable::default();
        let low = SourceEntry::new(Fingerprint(0), 0, 4);
        let high = SourceEntry::new(Fingerprint(u32::MAX), BLOCK_MASK as BlockId, 7);
        table.insert(low);
        table.insert(high);
        assert_eq!(table.get(Fingerprint(0)), Some(low));
        assert_eq!(table.get(Fingerprint(u32::MAX)), Some(high));
        assert_eq!(high.block(), BLOCK_MASK as BlockId);
        // An entry in no tier is refused: it would read as an empty slot.
        table.insert(SourceEntry::new(Fingerprint(9), 1, 0));
        assert_eq!((table.len(), table.get(Fingerprint(9))), (2, None));
    }

    /// Random inserts, updates and removals against a HashMap, with
    /// fingerprints crowded into a narrow range (long clusters, wrap-around at
    /// the table's end) and spread over the whole range.
    #[test]
    fn randomized_against_a_hashmap_model() {
        for (seed, spread) in [(1u64, u32::MAX), (2, 4095), (3, 63), (4, u32::MAX)] {
            let mut rng = Rng(0x2545_f491_4f6c_dd1d ^ seed);
            let mut table = SourceTable::default();
            let mut model: HashMap<u32, SourceEntry> = HashMap::new();
            for step in 0..20_000u32 {
                let fp = {
                    let r = rng.next() as u32 % spread.saturating_add(1).max(1);
                    // Crowd at the top too, where probing wraps to slot 0.
                    if seed == 4 && step % 2 == 0 {
                        u32::MAX - r % 64
                    } else {
                        r
                    }
                };
                let action = rng.next() % 10;
                match (table.find(Fingerprint(fp)), model.get(&fp)) {
                    (None, None) if action < 6 => {
                        let e = SourceEntry::new(Fingerprint(fp), step, 1 << (step % 3));
                        table.insert(e);
                        model.insert(fp, e);
                    }
                    (Some(slot), Some(&e)) if action < 3 => {
                        let moved = SourceEntry::new(e.fp(), step, 2);
                        table.set(slot, moved);
                        model.insert(fp, moved);
                    }
                    (Some(slot), Some(_)) if action < 8 => {
                        table.remove_at(slot);
                        model.remove(&fp);
                    }
                    (found, expected) => {
                        assert_eq!(found.and_then(|s| table.at(s)), expected.copied());
                    }
                }
                if step % 1000 == 0 {
                    check(&table, &model);
                }
            }
            check(&table, &model);
            table.remap_blocks(|b| b + 1);
            for (fp, e) in &model {
                let got = table.get(Fingerprint(*fp)).unwrap();
                assert_eq!((got.block(), got.fp()), (e.block() + 1, e.fp()));
                assert_eq!(got.with_block(e.block()), *e);
            }
        }
    }
}
