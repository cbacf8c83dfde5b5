//! A counting sort of block ids into numbered buckets, keeping their order
//! within a bucket. The key-range grouping (`key_ranges.rs`) and a snapshot
//! page's reads in table order (`blocks.rs`) both place ids this way.

use super::block_table::BlockId;

/// Ids by bucket, in compressed rows: bucket `b` is
/// `ids[starts[b]..starts[b + 1]]`.
pub(super) struct Buckets {
    pub(super) starts: Vec<u32>,
    pub(super) ids: Vec<BlockId>,
}

impl Buckets {
    /// Places the ids `items` yields, each with its bucket, into `count`
    /// buckets; an id whose bucket is `count` or more is left out. `items`
    /// is passed over twice: to count each bucket, then to place the ids.
    pub(super) fn sort<I>(count: usize, items: impl Fn() -> I) -> Buckets
    where
        I: Iterator<Item = (usize, BlockId)>,
    {
        let mut starts = vec![0u32; count + 1];
        for (b, _) in items().filter(|&(b, _)| b < count) {
            starts[b + 1] += 1;
        }
        for b in 1..=count {
            starts[b] += starts[b - 1];
        }
        let mut next = starts.clone();
        let mut ids = vec![0; starts[count] as usize];
        for (b, id) in items().filter(|&(b, _)| b < count) {
            // (Both passes see the same items: each row has room.)
            if let Some(slot) = ids.get_mut(next[b] as usize) {
                *slot = id;
                next[b] += 1;
            }
        }
        Buckets { starts, ids }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_placed_by_bucket_in_their_order_and_out_of_range_ones_left_out() {
        let items = [
            (2, 10),
            (0, 11),
            (2, 12),
            (5, 13),
            (1, 14),
            (0, 15),
            (3, 16),
        ];
        let sorted = Buckets::sort(4, || items.iter().copied());
        assert_eq!(sorted.starts, vec![0, 2, 3, 5, 6]);
        assert_eq!(sorted.ids, vec![11, 15, 14, 10, 12, 16]);
    }
}
