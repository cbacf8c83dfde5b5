//! The block records, keyed by the kvroute hash's index key, in one array of
//! buckets of 8 records that is itself the hash table: a record's id is its
//! slot. Each key has two buckets; a new record goes to the emptier of them,
//! and when both are full to an overflow slab with its own hashbrown index
//! (ids past the array). Records never move while the array keeps its size,
//! so the pods' source entries can hold their ids. The array grows when 9 in
//! 10 slots are used or more than 1 in 16 records overflowed (two choices
//! without moving records fill buckets of 8 to ~85 %): by an eighth, or at
//! once to the record count the caller expects (the pods' reported capacity)
//! when that is more. Growing renumbers every record: the caller rewrites the
//! ids it holds with the map [`BlockTable::grow`] returns.
//!
//! Why: a 12-byte record in a slab plus a 4-byte id in a hashbrown index cost
//! 12 + 5 / load bytes per distinct block, and hashbrown's load was 59 % at the
//! benchmark's working set and 75 % at 50M blocks (20.5 and 18.7 bytes); here
//! about 12 / load, 13.3–15 bytes (an overflow record costs ~20). The cost is
//! in growing: each growth re-places every record and rewrites every source
//! entry, about 9 times per record when a table is filled by eighths, which
//! growing once to the expected count avoids.

use hashbrown::HashTable;

use super::hashing::{mix, table_bytes};
use super::keys::BlockHash;
use super::prefetch::prefetch;
use kvroute_core::hash::IndexKey;

/// Id of a block record (stable while some pod holds the block).
pub(super) type BlockId = u32;

/// Records the map can hold: ids fit in 29 bits, so that a source entry
/// keeps its tier bits beside one (536 M blocks, 6.4 GB of records).
pub(super) const MAX_BLOCKS: usize = 1 << 29;

/// Id of the set of pods holding a block (interned by the block map,
/// `blocks.rs`). 0 is the empty set.
pub(super) type SetId = u32;
pub(super) const EMPTY_SET: SetId = 0;

/// Marks a free record, whose `kv` then links the next free one.
pub(super) const FREE: SetId = SetId::MAX;

/// A block: its kvroute hash and who holds it (packed: 12 bytes).
#[derive(Debug, Clone, Copy)]
#[repr(C, packed(4))]
pub(super) struct Record {
    pub(super) kv: BlockHash,
    pub(super) set: SetId,
}

// The memory estimate and the README count 12 bytes a record.
const _: () = assert!(std::mem::size_of::<Record>() == 12);

const NO_FREE: BlockId = BlockId::MAX;

impl Record {
    /// A free record: its `kv` field holds the id of the next free one (in
    /// the overflow slab; 0 in the array).
    fn free(next: BlockId) -> Record {
        Record {
            kv: BlockHash::new(u64::from(next)),
            set: FREE,
        }
    }

    fn is_free(&self) -> bool {
        let set = self.set;
        set == FREE
    }

    /// The next free record after this free one.
    fn next_free(&self) -> BlockId {
        let link = self.kv;
        link.get() as BlockId
    }
}

/// Records per slot bucket.
const BUCKET: usize = 8;
/// Most live records per array slot before the array grows (9 in 10).
const MAX_LOAD: (usize, usize) = (9, 10);
/// Load of an array sized for an expected record count: the expected
/// records fit without overflowing (two choices fill buckets of 8 to ~85 %).
const RESERVE_LOAD: (usize, usize) = (17, 20);

/// The two buckets of an index key in an array of `buckets`.
fn homes(key: IndexKey, buckets: usize) -> [usize; 2] {
    let h = mix(key);
    let scaled = |x: u64| ((x * buckets as u64) >> 32) as usize;
    [scaled(h >> 32), scaled(h & 0xffff_ffff)]
}

/// Records per overflow slab chunk.
const CHUNK: usize = 1024;

/// Overflow records in chunks, with a free list threaded through freed ones.
#[derive(Default)]
struct Slab {
    chunks: Vec<Box<[Record]>>,
    /// Records handed out so far (free or live).
    allocated: usize,
    free_head: Option<BlockId>,
    live: usize,
}

impl Slab {
    fn get(&self, id: BlockId) -> Option<&Record> {
        self.chunks
            .get(id as usize / CHUNK)?
            .get(id as usize % CHUNK)
    }

    fn get_mut(&mut self, id: BlockId) -> Option<&mut Record> {
        self.chunks
            .get_mut(id as usize / CHUNK)?
            .get_mut(id as usize % CHUNK)
    }

    fn kv(&self, id: BlockId) -> BlockHash {
        self.get(id).map_or(BlockHash::default(), |r| r.kv)
    }

    /// A new record of `kv` with no holder.
    fn alloc(&mut self, kv: BlockHash) -> Option<BlockId> {
        let id = match self.free_head {
            Some(id) => {
                let next = self.get(id).map_or(NO_FREE, Record::next_free);
                self.free_head = (next != NO_FREE).then_some(next);
                id
            }
            None => {
                let id = BlockId::try_from(self.allocated).ok()?;
                if self.allocated == self.chunks.len() * CHUNK {
                    let free = Record::free(NO_FREE);
                    self.chunks.push(vec![free; CHUNK].into_boxed_slice());
                }
                self.allocated += 1;
                id
            }
        };
        *self.get_mut(id)? = Record { kv, set: EMPTY_SET };
        self.live += 1;
        Some(id)
    }

    fn free(&mut self, id: BlockId) {
        let next = self.free_head.unwrap_or(NO_FREE);
        if let Some(rec) = self.get_mut(id) {
            *rec = Record::free(next);
            self.free_head = Some(id);
            self.live = self.live.saturating_sub(1);
        }
    }

    /// Every record handed out, with its id (free ones too).
    fn records(&self) -> impl Iterator<Item = (BlockId, &Record)> + '_ {
        (0..).zip(
            self.chunks
                .iter()
                .flat_map(|c| c.iter())
                .take(self.allocated),
        )
    }
}

/// The block records, by index key.
#[derive(Default)]
pub(super) struct BlockTable {
    /// `BUCKET` records per bucket; a record's id is its slot.
    slots: Vec<Record>,
    /// Live records in `slots`.
    live: usize,
    /// Records whose two buckets were full: id = `slots.len()` + slab id.
    overflow: Slab,
    /// Index key → overflow slab id.
    overflow_index: HashTable<BlockId>,
}

impl BlockTable {
    /// Live records.
    pub(super) fn len(&self) -> usize {
        self.live + self.overflow.live
    }

    /// One past the highest id a record can have (array slots, then the
    /// overflow slab's records).
    pub(super) fn id_end(&self) -> usize {
        self.slots.len() + self.overflow.allocated
    }

    fn buckets(&self) -> usize {
        self.slots.len() / BUCKET
    }

    /// The slot of record `id`, free or not: in the array, else the overflow.
    fn slot(&self, id: BlockId) -> Option<&Record> {
        match (id as usize).checked_sub(self.slots.len()) {
            None => self.slots.get(id as usize),
            Some(o) => self.overflow.get(BlockId::try_from(o).ok()?),
        }
    }

    pub(super) fn get(&self, id: BlockId) -> Option<&Record> {
        self.slot(id).filter(|r| !r.is_free())
    }

    pub(super) fn get_mut(&mut self, id: BlockId) -> Option<&mut Record> {
        match (id as usize).checked_sub(self.slots.len()) {
            None => self.slots.get_mut(id as usize),
            Some(o) => self.overflow.get_mut(BlockId::try_from(o).ok()?),
        }
        .filter(|r| !r.is_free())
    }

    fn bucket(&self, b: usize) -> &[Record] {
        self.slots
            .get(b * BUCKET..(b + 1) * BUCKET)
            .unwrap_or_default()
    }

    /// Starts loading the record `id` (see [`super::prefetch`]).
    pub(super) fn prefetch_record(&self, id: BlockId) {
        // The slot's address only: reading it (as `get` does) would wait for it.
        prefetch(self.slot(id).map(std::slice::from_ref).unwrap_or_default());
    }

    /// Starts loading the buckets of `key` (see [`super::prefetch`]).
    pub(super) fn prefetch(&self, key: IndexKey) {
        for b in homes(key, self.buckets()) {
            prefetch(self.bucket(b));
        }
    }

    /// The live record of index key `key`.
    pub(super) fn find(&self, key: IndexKey) -> Option<BlockId> {
        let is = |r: &Record| !r.is_free() && { r.kv }.index_key() == key;
        let in_array = homes(key, self.buckets()).into_iter().find_map(|b| {
            let i = self.bucket(b).iter().position(is)?;
            BlockId::try_from(b * BUCKET + i).ok()
        });
        in_array.or_else(|| self.find_overflow(key))
    }

    fn find_overflow(&self, key: IndexKey) -> Option<BlockId> {
        if self.overflow.live == 0 {
            return None;
        }
        let overflow = &self.overflow;
        let o = *self
            .overflow_index
            .find(mix(key), |&o| overflow.kv(o).index_key() == key)?;
        BlockId::try_from(self.slots.len() + o as usize).ok()
    }

    /// The live record of `kv`'s index key, or a new one of `kv` with no
    /// holder; `None` when absent at [`MAX_BLOCKS`]. One pass over the two
    /// buckets both looks the key up and finds the emptier one's free slot.
    pub(super) fn find_or_insert(&mut self, kv: BlockHash) -> Option<BlockId> {
        let key = kv.index_key();
        // Per bucket: free slots, the first of them.
        let mut room = [(0usize, None::<usize>); 2];
        let homes = homes(key, self.buckets());
        for (h, &b) in homes.iter().enumerate() {
            for (i, r) in self.bucket(b).iter().enumerate() {
                if r.is_free() {
                    room[h].0 += 1;
                    room[h].1 = room[h].1.or(Some(b * BUCKET + i));
                } else if { r.kv }.index_key() == key {
                    return BlockId::try_from(b * BUCKET + i).ok();
                }
            }
        }
        if let Some(id) = self.find_overflow(key) {
            return Some(id);
        }
        if self.len() >= MAX_BLOCKS {
            return None;
        }
        let [(free_a, slot_a), (free_b, slot_b)] = room;
        if let Some(slot) = if free_a >= free_b { slot_a } else { slot_b } {
            self.slots[slot] = Record { kv, set: EMPTY_SET };
            self.live += 1;
            return BlockId::try_from(slot).ok();
        }
        self.insert_overflow(kv)
    }

    /// A new record of `kv` (whose index key is absent) with no holder;
    /// `None` at [`MAX_BLOCKS`].
    fn insert(&mut self, kv: BlockHash) -> Option<BlockId> {
        debug_assert!(self.find(kv.index_key()).is_none());
        self.find_or_insert(kv)
    }

    /// A new record of `kv` in the overflow slab (its two buckets are full).
    fn insert_overflow(&mut self, kv: BlockHash) -> Option<BlockId> {
        let key = kv.index_key();
        if self.slots.len() + self.overflow.allocated >= MAX_BLOCKS {
            return None;
        }
        let o = self.overflow.alloc(kv)?;
        let overflow = &self.overflow;
        self.overflow_index
            .insert_unique(mix(key), o, |&o| mix(overflow.kv(o).index_key()));
        BlockId::try_from(self.slots.len() + o as usize).ok()
    }

    /// Frees a record.
    pub(super) fn remove(&mut self, id: BlockId) {
        if self.get(id).is_none() {
            return;
        }
        match (id as usize).checked_sub(self.slots.len()) {
            None => {
                self.slots[id as usize] = Record::free(0);
                self.live -= 1;
            }
            Some(o) => {
                let Ok(o) = BlockId::try_from(o) else {
                    return;
                };
                let key = self.overflow.kv(o).index_key();
                if let Ok(e) = self.overflow_index.find_entry(mix(key), |&i| i == o) {
                    e.remove();
                }
                self.overflow.free(o);
            }
        }
    }

    /// Every live record with its id: the array, then the overflow (the
    /// pass a snapshot takes over all blocks).
    pub(super) fn ids_and_records(&self) -> impl Iterator<Item = (BlockId, &Record)> + '_ {
        let base = self.slots.len() as BlockId;
        (0..)
            .zip(self.slots.iter())
            .chain(self.overflow.records().map(move |(o, r)| (base + o, r)))
            .filter(|(_, r)| !r.is_free())
    }

    /// True when the array should grow before more records come: over 9 in
    /// 10 slots used, or an overflow of more than 1 in 16 records.
    pub(super) fn needs_growth(&self) -> bool {
        self.len() * MAX_LOAD.1 >= self.slots.len() * MAX_LOAD.0
            || self.overflow.live * 16 > self.len()
    }

    /// Grows the array by an eighth of its buckets (doubling would leave it
    /// 45–90 % full), or at once to room for `expected` records at
    /// [`RESERVE_LOAD`] when that is more, and re-places every record, the
    /// overflow's too. Returns each old id's new id (indexed by old id; free
    /// ones: [`BlockId::MAX`]), for the caller to rewrite the ids it holds.
    pub(super) fn grow(&mut self, expected: usize) -> Vec<BlockId> {
        let old_len = self.slots.len();
        let buckets = self.buckets();
        let eighth = (buckets + buckets / 8).max(buckets + 16);
        let reserved = expected.min(MAX_BLOCKS) * RESERVE_LOAD.1 / RESERVE_LOAD.0 / BUCKET + 1;
        let bigger = eighth.max(reserved).min(MAX_BLOCKS / BUCKET).max(buckets);
        let old = std::mem::replace(&mut self.slots, vec![Record::free(0); bigger * BUCKET]);
        let overflow = std::mem::take(&mut self.overflow);
        self.overflow_index = HashTable::new();
        self.live = 0;
        let mut new_ids = vec![BlockId::MAX; old_len + overflow.allocated];
        let old_records = (0..)
            .zip(old.iter())
            .chain(overflow.records().map(|(o, r)| (old_len as BlockId + o, r)));
        // Each record to its first bucket while that has room (counted
        // aside; the array is at most 80 % full after growing), the rest by
        // `insert`.
        let mut filled = vec![0u8; bigger];
        let mut rest = Vec::new();
        for (old_id, r) in old_records.filter(|(_, r)| !r.is_free()) {
            let [a, _] = homes({ r.kv }.index_key(), bigger);
            match filled.get_mut(a) {
                Some(n) if usize::from(*n) < BUCKET => {
                    let slot = a * BUCKET + usize::from(*n);
                    self.slots[slot] = *r;
                    self.live += 1;
                    *n += 1;
                    if let Some(new) = new_ids.get_mut(old_id as usize) {
                        *new = slot as BlockId;
                    }
                }
                _ => rest.push((old_id, *r)),
            }
        }
        for (old_id, r) in rest {
            if let Some(id) = self.insert(r.kv) {
                if let Some(rec) = self.get_mut(id) {
                    rec.set = r.set;
                }
                if let Some(new) = new_ids.get_mut(old_id as usize) {
                    *new = id;
                }
            }
        }
        new_ids
    }

    /// Bytes held: the array, the overflow slab and its index.
    pub(super) fn memory_bytes(&self) -> usize {
        let record = std::mem::size_of::<Record>();
        self.slots.capacity() * record
            + self.overflow.chunks.len() * CHUNK * record
            + self.overflow.chunks.capacity() * std::mem::size_of::<Box<[Record]>>()
            + table_bytes(
                self.overflow_index.capacity(),
                std::mem::size_of::<BlockId>(),
            )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    /// Random inserts, updates, removals and growths against a HashMap
    /// model, the model's ids rewritten at each growth as a caller does; also
    /// with keys crowded into few buckets (an overflow).
    #[test]
    fn randomized_against_a_hashmap_model() {
        for (seed, keys) in [(1u64, u64::MAX), (2, 5000), (3, 300)] {
            let mut x = 0x2545_f491_4f6c_dd1d ^ seed;
            let mut rng = move || {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x
            };
            let mut table = BlockTable::default();
            // index key → (id, kv, set)
            let mut model: HashMap<IndexKey, (BlockId, BlockHash, SetId)> = HashMap::new();
            let mut grown = 0;
            for step in 0..30_000u32 {
                if table.needs_growth() {
                    // With distinct keys, the first growth makes room for an
                    // expected count at once.
                    let expected = if grown == 0 && keys == u64::MAX {
                        5_000
                    } else {
                        0
                    };
                    let new_ids = table.grow(expected);
                    for (id, _, _) in model.values_mut() {
                        *id = new_ids[*id as usize];
                    }
                    grown += 1;
                }
                // Full 64-bit hashes whose index keys repeat when `keys` is small.
                let kv = (rng() % keys.saturating_add(1).max(1)) | (rng() << 40);
                let kv = BlockHash::new(if keys == u64::MAX { rng() } else { kv });
                let key = kv.index_key();
                match (table.find(key), model.get(&key).copied()) {
                    (None, None) if rng() % 10 < 6 => {
                        let id = table.insert(kv).unwrap();
                        let set = step + 1;
                        table.get_mut(id).unwrap().set = set;
                        model.insert(key, (id, kv, set));
                    }
                    (Some(id), Some((want, _, _))) if rng() % 10 < 5 => {
                        assert_eq!(id, want);
                        table.remove(id);
                        model.remove(&key);
                        assert!(table.get(id).is_none());
                    }
                    (found, expected) => assert_eq!(found, expected.map(|e| e.0)),
                }
                if step % 1000 == 0 {
                    check(&table, &model);
                }
            }
            check(&table, &model);
            assert!(grown >= 2, "{grown} growths");
        }
    }

    fn check(table: &BlockTable, model: &HashMap<IndexKey, (BlockId, BlockHash, SetId)>) {
        assert_eq!(table.len(), model.len());
        assert_eq!(table.ids_and_records().count(), model.len());
        for (&key, &(id, kv, set)) in model {
            assert_eq!(table.find(key), Some(id));
            let r = table.get(id).unwrap();
            assert_eq!(({ r.kv }, { r.set }), (kv, set));
        }
        for (id, r) in table.ids_and_records() {
            assert_eq!(model[&{ r.kv }.index_key()].0, id);
        }
    }

    #[test]
    fn an_overflowing_key_is_found_and_freed_and_growth_takes_it_in() {
        let mut table = BlockTable::default();
        let _ = table.grow(0);
        // Fill one key's two buckets with other keys of the same buckets.
        let n = table.buckets();
        let [a, b] = homes(IndexKey::new(7), n);
        let want = if a == b { BUCKET } else { 2 * BUCKET };
        let same: Vec<u64> = (8u64..)
            .filter(|&k| {
                let h = homes(IndexKey::new(k), n);
                h.contains(&a) && h.contains(&b)
            })
            .take(want)
            .collect();
        for k in same {
            assert!(table.insert(BlockHash::new(k)).is_some());
        }
        let over = table.insert(BlockHash::new(7)).unwrap();
        assert!(over as usize >= table.slots.len());
        assert_eq!(table.find(IndexKey::new(7)), Some(over));
        assert_eq!(table.len(), want + 1);
        let new_ids = table.grow(0);
        let moved = new_ids[over as usize];
        assert_eq!(table.find(IndexKey::new(7)), Some(moved));
        assert!((moved as usize) < table.slots.len());
        table.remove(moved);
        assert_eq!((table.find(IndexKey::new(7)), table.len()), (None, want));
    }
}
