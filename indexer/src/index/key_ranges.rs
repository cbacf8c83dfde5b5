//! The block records' ids grouped by range of index key, so that a snapshot
//! page visits the records of its own key range instead of passing over the
//! whole block table again (28 passes over ~160 MB of records at 1,000 pods).
//!
//! A grouping covers a window of the key space sized to hold about a fixed
//! number of ids (64 MB of them), so its memory is bounded whatever the
//! fleet. Taking one passes over the table twice (to count each range, then
//! to place the ids): a snapshot of 13.4 M blocks takes one grouping, one of
//! 50 M blocks four, where pages passed over the table once each (28 and 102).
//!
//! The grouping is a picture of the table at one moment. A page that reads
//! through it still reads each record's live state; what it misses are the
//! blocks stored after the picture was taken, and the consumer gets those
//! from the delta log as long as its snapshot began no later than the picture
//! (see `feed.rs`). Ids are void once the table grows, which renumbers them.

use std::ops::Range;

use kvroute_core::hash::INDEX_KEY_BITS;

use super::block_table::BlockId;
use super::buckets::Buckets;
use super::keys::KEY_END;

/// Ids a grouping holds, about (the window's width is a power of two).
pub(super) const GROUPED_IDS: usize = 1 << 24;

/// Ranges per window: a page of the 1,000-pod snapshot spans ~37 of them,
/// so the ids outside a page's range that it reads are about 3 %. Fewer rows
/// make the grouping cheaper to take, since its writes go to fewer places
/// (the first page at 1,000 pods: 0.27-0.28 s with 1,024 rows, 0.33-0.34 s
/// with 4,096).
const RANGE_BITS: u32 = 10;
const RANGES: usize = 1 << RANGE_BITS;

/// Record ids by range of their index key within a window of keys, in id
/// order within a range (compressed rows: `ids[starts[r]..starts[r + 1]]`).
pub(super) struct KeyRanges {
    window: Range<u64>,
    /// A range is `1 << shift` keys wide.
    shift: u32,
    starts: Vec<u32>,
    ids: Vec<BlockId>,
}

/// The range of `key` in a window that begins at `start`, ranges
/// `1 << shift` keys wide.
fn range_at(start: u64, shift: u32, key: u64) -> Option<usize> {
    let r = key.checked_sub(start)? >> shift;
    usize::try_from(r).ok().filter(|&r| r < RANGES)
}

impl KeyRanges {
    /// Groups the records whose keys lie in a window that begins at
    /// `keys.start`, holds all of `keys`, and is as wide as holds about
    /// `max_ids` of the table's `total` records (keys are hashes: records
    /// spread evenly over them). `records` yields (id, index key) of every
    /// live record; it is passed over twice, to count each range, then to
    /// place the ids.
    pub(super) fn take<I>(
        keys: Range<u64>,
        total: usize,
        max_ids: usize,
        records: impl Fn() -> I,
    ) -> KeyRanges
    where
        I: Iterator<Item = (BlockId, u64)>,
    {
        // Halve the window while it would hold more than `max_ids`, never
        // below the width of `keys` nor that of RANGES single keys.
        let mut width_bits = INDEX_KEY_BITS;
        let needed = keys.end.saturating_sub(keys.start).max(1);
        while width_bits > RANGE_BITS
            && (total >> (INDEX_KEY_BITS - width_bits)) > max_ids
            && 1u64 << (width_bits - 1) >= needed
        {
            width_bits -= 1;
        }
        let start = keys.start.min(KEY_END);
        let shift = width_bits - RANGE_BITS;
        let Buckets { starts, ids } = Buckets::sort(RANGES, || {
            records().filter_map(|(id, key)| Some((range_at(start, shift, key)?, id)))
        });
        KeyRanges {
            window: start..start.saturating_add(1 << width_bits).min(KEY_END),
            shift,
            starts,
            ids,
        }
    }

    fn range_of(&self, key: u64) -> Option<usize> {
        range_at(self.window.start, self.shift, key)
    }

    /// True when every key of `keys` lies in the window.
    pub(super) fn covers(&self, keys: &Range<u64>) -> bool {
        keys.is_empty() || (self.window.start <= keys.start && keys.end <= self.window.end)
    }

    /// The ids of the ranges `keys` overlaps, for `keys` the window covers:
    /// every record whose key lay in `keys` when they were taken, and some
    /// beside it (the caller checks each record's key).
    pub(super) fn ids_in(&self, keys: Range<u64>) -> &[BlockId] {
        if keys.is_empty() {
            return &[];
        }
        let (Some(first), Some(last)) = (self.range_of(keys.start), self.range_of(keys.end - 1))
        else {
            return &[];
        };
        let from = self.starts[first] as usize;
        let to = self.starts[last + 1] as usize;
        self.ids.get(from..to).unwrap_or_default()
    }

    pub(super) fn memory_bytes(&self) -> usize {
        (self.starts.capacity() + self.ids.capacity()) * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 20,000 records spread over the key space; ids are their positions.
    fn keys() -> Vec<u64> {
        (0..20_000u64)
            .map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15) % KEY_END)
            .collect()
    }

    /// The ids `grouping` yields for `start..end` whose keys lie in it, in id order.
    fn found(grouping: &KeyRanges, keys: &[u64], start: u64, end: u64) -> Vec<BlockId> {
        let mut got: Vec<BlockId> = grouping
            .ids_in(start..end)
            .iter()
            .copied()
            .filter(|&id| (start..end).contains(&keys[id as usize]))
            .collect();
        got.sort_unstable(); // by range, then id: to id order
        got
    }

    fn wanted(keys: &[u64], start: u64, end: u64) -> Vec<BlockId> {
        (0..)
            .zip(keys)
            .filter(|(_, k)| (start..end).contains(*k))
            .map(|(id, _)| id)
            .collect()
    }

    #[test]
    fn a_key_range_yields_the_ids_of_its_keys_and_few_others() {
        let keys = keys();
        let records = || (0..).zip(keys.iter().copied());
        let grouping = KeyRanges::take(0..1, keys.len(), GROUPED_IDS, records);
        assert!(
            grouping.covers(&(0..KEY_END)),
            "room for every id: one window"
        );
        assert_eq!(grouping.ids_in(0..KEY_END).len(), keys.len());
        assert!(grouping.ids_in(5..5).is_empty());
        for (start, end) in [
            (0, KEY_END / 7),
            (KEY_END / 3, KEY_END / 2),
            (KEY_END - 9, KEY_END),
        ] {
            let want = wanted(&keys, start, end);
            assert_eq!(
                found(&grouping, &keys, start, end),
                want,
                "range {start}..{end}"
            );
            // At most one range's worth of strays at each end (~5 ids each).
            let read = grouping.ids_in(start..end).len();
            assert!(read <= want.len() + 40, "{read} for {}", want.len());
        }
    }

    #[test]
    fn a_grouping_holds_a_window_of_about_its_share_of_ids() {
        let keys = keys();
        let records = || (0..).zip(keys.iter().copied());
        // Room for 1,000 of 20,000 ids: a window of 1/32 of the keys (~625 ids).
        let from = KEY_END / 3;
        let grouping = KeyRanges::take(from..from + 10, keys.len(), 1_000, records);
        let window = KEY_END / 32;
        assert!(grouping.covers(&(from..from + window)));
        assert!(!grouping.covers(&(from..from + window + 1)));
        assert!(!grouping.covers(&(from - 1..from + 10)));
        assert!(grouping.ids.len() <= 1_000, "{} ids", grouping.ids.len());
        let want = wanted(&keys, from, from + window);
        assert!(want.len() > 400, "{} keys in the window", want.len());
        assert_eq!(found(&grouping, &keys, from, from + window), want);
        // A window is never narrower than the keys asked for.
        let wide = KeyRanges::take(from..from + KEY_END / 4, keys.len(), 1_000, records);
        assert!(wide.covers(&(from..from + KEY_END / 4)));
        // Nor wider than the key space.
        let last = KeyRanges::take(KEY_END - 5..KEY_END, keys.len(), 1_000, records);
        assert!(last.covers(&(KEY_END - 5..KEY_END)));
        assert_eq!(
            found(&last, &keys, KEY_END - 5, KEY_END),
            wanted(&keys, KEY_END - 5, KEY_END)
        );
    }
}
