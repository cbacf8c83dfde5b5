//! Where a write-through index keeps its buckets: only its working set in
//! memory, the rest in the published copy it reads back on a write (see
//! the "Where the buckets live" part of the index's documentation).

use super::bucket::{bucket_of, slot_key, slot_set, Bucket, EMPTY, SLOT_BYTES};
use super::published::{self, KeyStore};
use super::BlockIndex;
use std::borrow::Cow;
use std::rc::Rc;

/// Where a write-through index keeps its buckets, and which are in memory:
/// the buckets written since the last publication and, up to the bound,
/// clean ones kept from earlier writes (a repeated prefix is not read again).
///
/// The bound counts slots, not buckets: buckets grow with their entries, so
/// a small index (few blocks per bucket) stays in memory whole, and a full
/// one keeps as many full buckets as the bytes allow.
#[derive(Clone)]
pub(super) struct WorkingSet {
    pub(super) store: Rc<dyn KeyStore>,
    /// Slots in memory at most (one bucket beyond it at most): reaching it
    /// lets go of the least recently used buckets down to half (storing
    /// back those changed since the last publication).
    pub(super) max_slots: usize,
    /// Slots of the buckets in memory.
    pub(super) resident_slots: usize,
    /// Buckets in memory, and a flag per bucket.
    pub(super) loaded: Vec<u32>,
    pub(super) is_loaded: Vec<bool>,
    /// Per bucket, the `uses` count at its last write (the eviction order).
    pub(super) last_use: Vec<u32>,
    pub(super) uses: u32,
    pub(super) written_back_early: u64,
    pub(super) read_back: u64,
    pub(super) unloadable: u64,
}

impl std::fmt::Debug for WorkingSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkingSet")
            .field("max_slots", &self.max_slots)
            .field("resident_slots", &self.resident_slots)
            .field("loaded", &self.loaded.len())
            .finish()
    }
}

impl BlockIndex {
    /// This index, keeping only its working set in memory: a bucket is read
    /// from `store` (where [`BlockIndex::publish`]'s writes go) on its first
    /// write since it was stored, and the working set is stored back when its
    /// slots reach `max_resident_bytes`. Only buckets this index wrote are
    /// read back: another writer's or layout's are overwritten, never loaded.
    pub fn write_through(
        mut self,
        store: Rc<dyn KeyStore>,
        max_resident_bytes: usize,
    ) -> BlockIndex {
        // What is in memory now (written or not yet published) stays loaded.
        let loaded: Vec<u32> = (0..self.buckets.len())
            .filter(|&b| !self.buckets[b].slots.is_empty() || self.bucket_dirty[b])
            .map(|b| b as u32)
            .collect();
        let mut is_loaded = vec![false; self.buckets.len()];
        for &b in &loaded {
            is_loaded[b as usize] = true;
        }
        let resident_slots = loaded
            .iter()
            .map(|&b| self.buckets[b as usize].slots.len())
            .sum();
        self.working_set = Some(WorkingSet {
            store,
            max_slots: (max_resident_bytes / SLOT_BYTES).max(1),
            resident_slots,
            loaded,
            is_loaded,
            last_use: vec![0; self.buckets.len()],
            uses: 0,
            written_back_early: 0,
            read_back: 0,
            unloadable: 0,
        });
        self
    }

    /// Makes bucket `b` writable: a write-through index reads it back from
    /// its store unless it is in the working set (letting go of the least
    /// recently used half first when that is full).
    pub(super) fn load(&mut self, b: usize) {
        let Some(ws) = &mut self.working_set else {
            return;
        };
        ws.uses = ws.uses.wrapping_add(1);
        ws.last_use[b] = ws.uses;
        if ws.is_loaded[b] {
            return;
        }
        if ws.resident_slots >= ws.max_slots {
            self.shrink_working_set(None);
        }
        let Some(ws) = &mut self.working_set else {
            return;
        };
        if self.published[b] {
            ws.read_back += 1;
            let read = ws.store.read(&published::bucket_key(b));
            let sets = &self.sets;
            let buckets = self.buckets.len();
            // Shared data is any VM's to write: only a bucket this writer
            // could have written is taken (its keys, its live sets, its load).
            let ours = |bucket: &Bucket| {
                bucket.len * 8 <= bucket.slots.len() * 7
                    && bucket.slots.iter().all(|&slot| {
                        slot == EMPTY
                            || (bucket_of(slot_key(slot), buckets) == b
                                && sets.is_live(slot_set(slot)))
                    })
            };
            match read.and_then(|bytes| published::decode_bucket(&bytes).ok()) {
                Some(bucket) if ours(&bucket) => self.buckets[b] = bucket,
                _ => {
                    ws.unloadable += 1;
                    self.buckets[b] = Bucket::default();
                }
            }
        }
        ws.is_loaded[b] = true;
        ws.loaded.push(b as u32);
        ws.resident_slots += self.buckets[b].slots.len();
    }

    /// Bucket `b` to read: a write-through index decodes one it does not
    /// hold from its store (a miss when that fails).
    pub(super) fn bucket(&self, b: usize) -> Cow<'_, Bucket> {
        match &self.working_set {
            Some(ws) if !ws.is_loaded[b] && self.published[b] => ws
                .store
                .read(&published::bucket_key(b))
                .and_then(|bytes| published::decode_bucket(&bytes).ok())
                .map_or_else(|| Cow::Owned(Bucket::default()), Cow::Owned),
            _ => Cow::Borrowed(&self.buckets[b]),
        }
    }

    /// Lets go of the least recently used buckets of the working set until
    /// half its bound is left, except `writing` (the bucket being written),
    /// storing back those changed since the last publication (new sets
    /// first, so no stored slot names a set its readers cannot find). A
    /// bucket whose write failed stays in memory, changed, for the next try.
    pub(super) fn shrink_working_set(&mut self, writing: Option<usize>) {
        let Some(store) = self.working_set.as_ref().map(|ws| Rc::clone(&ws.store)) else {
            return;
        };
        let chunks = self.sets.fresh_chunks();
        for (i, &chunk) in chunks.iter().enumerate() {
            let first = chunk * published::SETS_PER_CHUNK;
            if !store.write(&published::set_chunk_key(first), &self.encode_chunk(chunk)) {
                // Re-queued: no bucket goes out before its sets.
                self.sets.requeue_chunks(&chunks[i..]);
                return;
            }
            self.written_early.note_chunk(chunk);
        }
        let Some(ws) = &mut self.working_set else {
            return;
        };
        let last_use = &ws.last_use;
        let uses = ws.uses;
        // Oldest first: ages counted back from now survive the counter's wrap.
        ws.loaded
            .sort_unstable_by_key(|&b| std::cmp::Reverse(uses.wrapping_sub(last_use[b as usize])));
        let oldest_first = std::mem::take(&mut ws.loaded);
        let target = ws.max_slots / 2;
        for (i, &b) in oldest_first.iter().enumerate() {
            if ws.resident_slots <= target {
                ws.loaded.extend_from_slice(&oldest_first[i..]);
                break;
            }
            let b = b as usize;
            if Some(b) == writing {
                ws.loaded.push(b as u32);
                continue;
            }
            if self.bucket_dirty[b] {
                let bytes = published::encode_bucket(&self.buckets[b]);
                if !store.write(&published::bucket_key(b), &bytes) {
                    ws.loaded.push(b as u32);
                    continue;
                }
                self.bucket_dirty[b] = false;
                self.published[b] = true;
                ws.written_back_early += 1;
                self.written_early.note_bucket(b as u32);
            }
            ws.resident_slots -= self.buckets[b].slots.len();
            ws.is_loaded[b] = false;
            self.buckets[b] = Bucket::default();
        }
        let dirty = &self.bucket_dirty;
        self.dirty_buckets.retain(|&b| dirty[b as usize]);
    }
}
