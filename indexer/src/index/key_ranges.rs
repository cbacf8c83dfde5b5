//! The block records' ids grouped by range of index key, taken in one pass
//! over the block table, so that each snapshot page visits the records of its
//! own key range instead of passing over the whole table again (28 passes
//! over ~160 MB of records at 1,000 pods).
//!
//! The grouping is a picture of the table at one moment. A page that reads
//! through it still reads each record's live state; what it misses are the
//! blocks stored after the picture was taken, and the consumer gets those
//! from the delta log as long as its snapshot began no later than the picture
//! (see `feed.rs`). Ids are void once the table grows, which renumbers them.

use std::ops::Range;

use kvroute_core::hash::INDEX_KEY_BITS;

use super::blocks::BlockId;

/// Key ranges: a page of the 1,000-pod snapshot spans ~150 of them, so the
/// ids outside a page's range that it reads are a few percent.
const RANGE_BITS: u32 = 12;
const RANGES: usize = 1 << RANGE_BITS;
const SHIFT: u32 = INDEX_KEY_BITS - RANGE_BITS;

fn range_of(key: u64) -> usize {
    usize::try_from(key >> SHIFT).map_or(RANGES - 1, |r| r.min(RANGES - 1))
}

/// Record ids by the top [`RANGE_BITS`] of their index key, in id order
/// within a range (compressed rows: `ids[starts[r]..starts[r + 1]]`).
pub(super) struct KeyRanges {
    starts: Vec<u32>,
    ids: Vec<BlockId>,
}

impl KeyRanges {
    /// Groups `records` ((id, index key) of every live record), passing over
    /// them twice: once to count each range, once to place the ids.
    pub(super) fn take<I>(records: impl Fn() -> I) -> KeyRanges
    where
        I: Iterator<Item = (BlockId, u64)>,
    {
        let mut starts = vec![0u32; RANGES + 1];
        for (_, key) in records() {
            starts[range_of(key) + 1] += 1;
        }
        for r in 1..=RANGES {
            starts[r] += starts[r - 1];
        }
        let mut next = starts.clone();
        let mut ids = vec![0; starts[RANGES] as usize];
        for (id, key) in records() {
            let at = &mut next[range_of(key)];
            // (Both passes see the same records: each row has room.)
            if let Some(slot) = ids.get_mut(*at as usize) {
                *slot = id;
                *at += 1;
            }
        }
        KeyRanges { starts, ids }
    }

    /// The ids of the ranges `keys` overlaps: every record whose key lay in
    /// `keys` when they were taken, and some beside it (the caller checks each
    /// record's key).
    pub(super) fn ids_in(&self, keys: Range<u64>) -> &[BlockId] {
        if keys.is_empty() {
            return &[];
        }
        let first = self.starts[range_of(keys.start)] as usize;
        let last = self.starts[range_of(keys.end - 1) + 1] as usize;
        self.ids.get(first..last).unwrap_or_default()
    }

    pub(super) fn memory_bytes(&self) -> usize {
        (self.starts.capacity() + self.ids.capacity()) * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const KEY_END: u64 = 1 << INDEX_KEY_BITS;

    #[test]
    fn a_key_range_yields_the_ids_of_its_keys_and_few_others() {
        // 20,000 records spread over the key space; ids are their positions.
        let keys: Vec<u64> = (0..20_000u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) % KEY_END)
            .collect();
        let records = || (0..).zip(keys.iter().copied());
        let ranges = KeyRanges::take(records);
        assert_eq!(ranges.ids_in(0..KEY_END).len(), keys.len());
        assert!(ranges.ids_in(5..5).is_empty());
        for (start, end) in [
            (0, KEY_END / 7),
            (KEY_END / 3, KEY_END / 2),
            (KEY_END - 9, KEY_END),
        ] {
            let ids = ranges.ids_in(start..end);
            let wanted: Vec<BlockId> = records()
                .filter(|(_, k)| (start..end).contains(k))
                .map(|(id, _)| id)
                .collect();
            let mut got: Vec<BlockId> = ids
                .iter()
                .copied()
                .filter(|&id| (start..end).contains(&keys[id as usize]))
                .collect();
            got.sort_unstable(); // by range, then id: to id order
            assert_eq!(got, wanted, "range {start}..{end}");
            // At most one range's worth of strays at each end (~5 ids each).
            assert!(
                ids.len() <= wanted.len() + 40,
                "{} for {}",
                ids.len(),
                wanted.len()
            );
        }
    }
}
