//! A worker VM's own recent routing decisions, for the flush gap: the
//! singleton publishes what workers learn every `index.flush_ms`, so until
//! then a worker would not see the prefix it just routed. Concurrent
//! requests with one prefix on one worker still stick to one pod; other
//! workers see it after the flush.
//!
//! Bounded by entries and by hashes held; an entry lives two flush periods
//! (by then its flush has landed).
//!
//! Every routed request looks entries up and records one or two. An entry
//! keeps inline what tells it apart and what matches it whole (its pod's
//! key, its first and last hash), so that comparing it reads neither its
//! hash list nor its pod's name: each would be a cache miss, the VM's state
//! being cold by then (docs/results/2026-12-05-c8-phases).

use crate::hash::{shared_prefix, BlockHash};
use std::collections::VecDeque;
use xxhash_rust::xxh3::xxh3_64;

/// Recent decisions kept at most.
pub const RECENT_ENTRIES: usize = 256;
/// Block hashes kept at most over all entries (512 KiB).
pub const RECENT_HASHES: usize = 1 << 16;

#[derive(Debug, Clone)]
struct Recent {
    at_ms: u64,
    /// [`pod_key`] of `pod`.
    pod_key: u64,
    pod: String,
    /// `hashes[0]`: most entries are told apart by it alone.
    first: BlockHash,
    /// The last of `hashes`: a chained hash covers its prefix, so a prompt
    /// with it at the same place holds the whole entry.
    last: BlockHash,
    hashes: Vec<BlockHash>,
}

impl Recent {
    /// How many leading blocks of `hashes` this entry holds (both are
    /// chains: equal hashes at one place mean equal prefixes up to it).
    fn shared_with(&self, hashes: &[BlockHash]) -> usize {
        let n = self.hashes.len();
        if hashes.get(n.wrapping_sub(1)) == Some(&self.last) {
            return n;
        }
        shared_prefix(&self.hashes, hashes)
    }

    fn is_for(&self, key: u64, pod: &str) -> bool {
        self.pod_key == key && self.pod == pod
    }
}

/// A pod's name as a number, compared before the name itself.
fn pod_key(pod: &str) -> u64 {
    xxh3_64(pod.as_bytes())
}

#[derive(Debug, Clone, Default)]
pub struct RecentRoutes {
    entries: VecDeque<Recent>,
    hashes: usize,
    keep_ms: u64,
}

impl RecentRoutes {
    /// Entries are kept `keep_ms` (two flush periods).
    pub fn new(keep_ms: u64) -> RecentRoutes {
        RecentRoutes {
            keep_ms,
            ..RecentRoutes::default()
        }
    }

    pub fn set_keep_ms(&mut self, keep_ms: u64) {
        self.keep_ms = keep_ms;
    }

    /// `pod` was taught `hashes` at `now_ms`.
    pub fn record(&mut self, pod: &str, hashes: &[BlockHash], now_ms: u64) {
        let hashes = &hashes[..hashes.len().min(RECENT_HASHES)];
        let (Some(&first), Some(&last)) = (hashes.first(), hashes.last()) else {
            return;
        };
        let key = pod_key(pod);
        // A prompt sent again to the same pod (the common case under
        // prefix affinity) renews its entry: no copy of its hashes, and
        // lookups compare one entry instead of one per repeat.
        let repeat = self.entries.iter().rposition(|e| {
            e.first == first
                && e.last == last
                && e.hashes.len() == hashes.len()
                && e.is_for(key, pod)
        });
        let entry = match repeat.and_then(|i| self.entries.remove(i)) {
            Some(renewed) => Recent {
                at_ms: now_ms,
                ..renewed
            },
            None => {
                self.hashes += hashes.len();
                Recent {
                    at_ms: now_ms,
                    pod_key: key,
                    pod: pod.to_string(),
                    first,
                    last,
                    hashes: hashes.to_vec(),
                }
            }
        };
        self.entries.push_back(entry);
        while self.entries.len() > RECENT_ENTRIES || self.hashes > RECENT_HASHES {
            self.pop_oldest();
        }
    }

    /// Forgets what was taught `pod` (it refused or failed).
    pub fn forget(&mut self, pod: &str) {
        self.entries.retain(|e| e.pod != pod);
        self.hashes = self.entries.iter().map(|e| e.hashes.len()).sum();
    }

    fn pop_oldest(&mut self) {
        if let Some(old) = self.entries.pop_front() {
            self.hashes -= old.hashes.len();
        }
    }

    /// Each pod's longest prefix of `hashes` among the recent decisions, as
    /// (pod, blocks), after dropping expired entries.
    pub fn matches(&mut self, hashes: &[BlockHash], now_ms: u64) -> Vec<(&str, usize)> {
        while self
            .entries
            .front()
            .is_some_and(|e| now_ms.saturating_sub(e.at_ms) > self.keep_ms)
        {
            self.pop_oldest();
        }
        let Some(&first) = hashes.first() else {
            return Vec::new();
        };
        // Pods told apart by key: one pod's entries share it.
        let mut found: Vec<(u64, &str, usize)> = Vec::new();
        for entry in self.entries.iter().filter(|e| e.first == first) {
            let blocks = entry.shared_with(hashes);
            match found
                .iter_mut()
                .find(|(key, pod, _)| entry.is_for(*key, pod))
            {
                Some(known) => known.2 = known.2.max(blocks),
                None => found.push((entry.pod_key, entry.pod.as_str(), blocks)),
            }
        }
        found
            .into_iter()
            .map(|(_, pod, blocks)| (pod, blocks))
            .collect()
    }

    /// The longest prefix of `hashes` this VM taught `pod` at or after
    /// `since_ms` (among entries not expired at `now_ms`).
    pub fn taught_since(
        &self,
        pod: &str,
        hashes: &[BlockHash],
        since_ms: u64,
        now_ms: u64,
    ) -> usize {
        let Some(&first) = hashes.first() else {
            return 0;
        };
        let key = pod_key(pod);
        self.entries
            .iter()
            .filter(|e| {
                e.first == first
                    && e.at_ms >= since_ms
                    && now_ms.saturating_sub(e.at_ms) <= self.keep_ms
                    && e.is_for(key, pod)
            })
            .map(|e| e.shared_with(hashes))
            .max()
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::hashes;

    #[test]
    fn the_longest_recent_prefix_per_pod_until_it_expires() {
        let mut recent = RecentRoutes::new(200);
        recent.record("a", &hashes(&[1, 2, 3, 4]), 0);
        recent.record("a", &hashes(&[1, 2]), 50);
        recent.record("b", &hashes(&[1, 2, 9]), 100);
        recent.record("c", &hashes(&[7, 8]), 100);
        let mut got = recent.matches(&hashes(&[1, 2, 3, 5]), 150);
        got.sort_unstable();
        assert_eq!(got, vec![("a", 3), ("b", 2)]);
        // The first entry expired (kept 200 ms): only the shorter one is left for a.
        let mut got = recent.matches(&hashes(&[1, 2, 3, 5]), 240);
        got.sort_unstable();
        assert_eq!(got, vec![("a", 2), ("b", 2)]);
        recent.forget("b");
        assert_eq!(recent.matches(&hashes(&[1, 2, 3, 5]), 240), vec![("a", 2)]);
        assert!(recent.matches(&hashes(&[]), 260).is_empty());
    }

    #[test]
    fn an_entry_matches_whole_or_in_part() {
        let mut recent = RecentRoutes::new(200);
        recent.record("a", &hashes(&[1, 2, 3]), 0);
        recent.record("b", &hashes(&[1, 2, 3]), 0);
        recent.record("a", &hashes(&[1, 2]), 0);
        let mut got = recent.matches(&hashes(&[1, 2, 3, 4]), 10);
        got.sort_unstable();
        // Whole entries (their last hash found in place), one line per pod.
        assert_eq!(got, vec![("a", 3), ("b", 3)]);
        // A prompt shorter than an entry, and one that parts inside it.
        let mut got = recent.matches(&hashes(&[1, 2]), 10);
        got.sort_unstable();
        assert_eq!(got, vec![("a", 2), ("b", 2)]);
        assert_eq!(recent.taught_since("b", &hashes(&[1, 2, 9]), 0, 10), 2);
    }

    #[test]
    fn what_was_taught_a_pod_since_a_moment() {
        let mut recent = RecentRoutes::new(200);
        recent.record("a", &hashes(&[1, 2, 3, 4]), 100);
        recent.record("a", &hashes(&[1, 2]), 150);
        recent.record("b", &hashes(&[1, 2, 3, 4, 5]), 150);
        assert_eq!(recent.taught_since("a", &hashes(&[1, 2, 3, 9]), 0, 160), 3);
        assert_eq!(
            recent.taught_since("a", &hashes(&[1, 2, 3, 9]), 120, 160),
            2
        );
        assert_eq!(recent.taught_since("c", &hashes(&[1, 2, 3, 9]), 0, 160), 0);
        // Expired entries (kept 200 ms) no longer count.
        assert_eq!(recent.taught_since("a", &hashes(&[1, 2, 3, 9]), 0, 320), 2);
        assert_eq!(recent.taught_since("a", &hashes(&[1, 2, 3, 9]), 0, 400), 0);
    }

    #[test]
    fn a_repeated_prompt_renews_its_entry() {
        let mut recent = RecentRoutes::new(200);
        recent.record("a", &hashes(&[1, 2, 3]), 0);
        recent.record("b", &hashes(&[1, 2, 3]), 50);
        recent.record("a", &hashes(&[1, 2, 3]), 100);
        recent.record("a", &hashes(&[1, 2]), 100);
        assert_eq!(
            recent.entries.len(),
            3,
            "the repeat renewed the first entry"
        );
        assert_eq!(recent.hashes, 8);
        // Renewed at 100, the entry outlives its first recording (kept 200 ms).
        assert_eq!(recent.matches(&hashes(&[1, 2, 3]), 260), vec![("a", 3)]);
        assert_eq!(recent.taught_since("a", &hashes(&[1, 2, 3]), 80, 260), 3);
        assert!(recent.matches(&hashes(&[1, 2, 3]), 301).is_empty());
    }

    #[test]
    fn entries_and_hashes_stay_bounded() {
        let mut recent = RecentRoutes::new(u64::MAX);
        for i in 0..(RECENT_ENTRIES as u64 + 10) {
            recent.record("a", &hashes(&[i, 1]), 0);
        }
        assert_eq!(recent.entries.len(), RECENT_ENTRIES);
        assert!(
            recent.matches(&hashes(&[0, 1]), 0).is_empty(),
            "the oldest went first"
        );
        let big: Vec<BlockHash> = (0..RECENT_HASHES as u64 / 2 + 1)
            .map(BlockHash::new)
            .collect();
        recent.record("a", &big, 0);
        recent.record("b", &big, 0);
        assert!(recent.hashes <= RECENT_HASHES);
        assert_eq!(recent.matches(&big, 0), vec![("b", big.len())]);
    }
}
