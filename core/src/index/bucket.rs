//! One bucket of the index: open-addressed slots of (40-bit key, 24-bit
//! pod-set reference) and their ages, and the key arithmetic around them.

use crate::hash::IndexKey;

/// Slots of a bucket at its full size (4 KiB of keys and references).
pub const BUCKET_SLOTS: usize = 512;
/// Bytes a slot costs: key and reference, and its age.
pub(super) const SLOT_BYTES: usize = 9;
/// A bucket's fixed cost besides its slots (two vector headers and its length).
pub(super) const BUCKET_OVERHEAD: usize =
    2 * std::mem::size_of::<Vec<u8>>() + std::mem::size_of::<usize>();
/// Bytes of one bucket at its full size.
pub(super) const FULL_BUCKET_BYTES: usize = BUCKET_SLOTS * SLOT_BYTES + BUCKET_OVERHEAD;
pub(super) const MIN_BUCKET_SLOTS: usize = 8;
/// Slots one sweep of a full bucket frees.
pub(super) const EVICT_BATCH: usize = BUCKET_SLOTS / 16;

const REF_BITS: u32 = 24;
pub(super) const REF_MASK: u64 = (1 << REF_BITS) - 1;
pub(super) const EMPTY: u64 = 0;

/// Probes open-addressed slots (`len` a power of two) for `key`: `Ok(slot)`
/// holding it, or `Err(empty slot)` where it would go; `Err(None)` when
/// there are no slots or none is empty (a bucket read from shared data may
/// be anything: the walk is bounded by its length).
pub(super) fn probe_slots(
    len: usize,
    key: u64,
    slot_at: impl Fn(usize) -> u64,
) -> Result<usize, Option<usize>> {
    if len == 0 || !len.is_power_of_two() {
        return Err(None);
    }
    let mask = len - 1;
    let mut i = key as usize & mask;
    for _ in 0..len {
        let slot = slot_at(i);
        if slot == EMPTY {
            return Err(Some(i));
        }
        if slot_key(slot) == key {
            return Ok(i);
        }
        i = (i + 1) & mask;
    }
    Err(None)
}

/// One bucket: open addressing over `slots` (key << 24 | set reference).
#[derive(Debug, Clone, Default)]
pub(super) struct Bucket {
    pub(super) slots: Vec<u64>,
    pub(super) ages: Vec<u8>,
    pub(super) len: usize,
}

/// The slot holding `key` and a reference to `set`.
pub(super) fn slot_of(key: u64, set: u32) -> u64 {
    (key << REF_BITS) | u64::from(set)
}

pub(super) fn slot_key(slot: u64) -> u64 {
    slot >> REF_BITS
}

pub(super) fn slot_set(slot: u64) -> u32 {
    (slot & REF_MASK) as u32
}

impl Bucket {
    fn home(&self, key: u64) -> usize {
        key as usize & (self.slots.len() - 1)
    }

    /// `Ok(slot)` holding `key`, or `Err(empty slot)` where it would go;
    /// `Err(None)` when the bucket has no slots yet.
    pub(super) fn find(&self, key: u64) -> Result<usize, Option<usize>> {
        probe_slots(self.slots.len(), key, |i| self.slots[i])
    }

    pub(super) fn is_full(&self) -> bool {
        (self.len + 1) * 8 > self.slots.len() * 7
    }

    pub(super) fn place(&mut self, slot: u64, age: u8) {
        let mask = self.slots.len() - 1;
        let mut i = self.home(slot_key(slot));
        while self.slots[i] != EMPTY {
            i = (i + 1) & mask;
        }
        self.place_at(i, slot, age);
    }

    /// Fills empty slot `i`, the one a probe for the slot's key ended at.
    pub(super) fn place_at(&mut self, i: usize, slot: u64, age: u8) {
        self.slots[i] = slot;
        self.ages[i] = age;
        self.len += 1;
    }

    /// Re-seats every entry in `size` slots.
    pub(super) fn grow(&mut self, size: usize) {
        let slots = std::mem::replace(&mut self.slots, vec![EMPTY; size]);
        let ages = std::mem::replace(&mut self.ages, vec![0; size]);
        self.len = 0;
        for (slot, age) in slots.into_iter().zip(ages) {
            if slot != EMPTY {
                self.place(slot, age);
            }
        }
    }

    /// After deletions, re-inserts every entry in probe order from just past
    /// `start`, a slot that was empty before them (so no probe chain crosses
    /// it): each entry moves only towards its home, one pass restores every
    /// probe chain.
    pub(super) fn reseat_from(&mut self, start: usize) {
        let mask = self.slots.len() - 1;
        let mut i = start;
        for _ in 0..self.slots.len() {
            i = (i + 1) & mask;
            let slot = self.slots[i];
            if slot != EMPTY {
                self.slots[i] = EMPTY;
                self.len -= 1;
                self.place(slot, self.ages[i]);
            }
        }
    }

    /// Backward-shift deletion keeps probe chains intact without tombstones.
    pub(super) fn delete_at(&mut self, mut hole: usize) {
        let mask = self.slots.len() - 1;
        self.slots[hole] = EMPTY;
        self.len -= 1;
        let mut i = hole;
        loop {
            i = (i + 1) & mask;
            let slot = self.slots[i];
            if slot == EMPTY {
                return;
            }
            let home = self.home(slot_key(slot));
            let stays = if hole <= i {
                hole < home && home <= i
            } else {
                hole < home || home <= i
            };
            if !stays {
                self.slots[hole] = slot;
                self.ages[hole] = self.ages[i];
                self.slots[i] = EMPTY;
                hole = i;
            }
        }
    }
}

/// The bucket of slot key `key` among `buckets`: a multiply-shift of the
/// key's top 32 bits (of 40), no modulo, no 128-bit product (wasm32 would
/// emulate either).
pub(super) fn bucket_of(key: u64, buckets: usize) -> usize {
    ((((key >> 8) & 0xffff_ffff) * buckets as u64) >> 32) as usize
}

/// The slot key of an index key: the key, with the empty marker moved aside.
pub(super) fn key_of(key: IndexKey) -> u64 {
    match key.get() {
        0 => 1,
        key => key,
    }
}
