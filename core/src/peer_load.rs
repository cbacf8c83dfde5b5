//! Each worker VM's own requests in flight, per pod, shared with the other
//! workers of its proxy through shared data. Every worker writes its own key
//! (at most every [`LOAD_SHARE_MS`] while its load changes, and at every
//! duty tick while it has any) and, when it decides, reads its serving
//! peers' keys (at most every [`LOAD_SHARE_MS`]).
//!
//! Why not queue messages: one message per batch of routing events to every
//! peer cost each worker W − 1 enqueues and woke W − 1 VMs: O(W²) work per
//! proxy, 43 µs per request at `--concurrency` 8 (wasm time, 30 KiB
//! requests). Keys cost one write per busy worker and W − 1 reads per
//! deciding worker, and wake nobody.
//!
//! A snapshot holds absolute counts, so a late one is corrected by the
//! next; one older than [`STALE_AFTER_MS`] (its VM stopped or is gone)
//! counts as empty.
//!
//! ```text
//! snapshot := u64 written_ms, u32 n, n × (str pod, u32 requests, u64 pending_blocks, u64 active_blocks)
//! str      := u16 len, UTF-8
//! ```

use crate::codec::{self, Reader};
use crate::wire::{self, WireError};
use std::collections::HashMap;

/// How often a worker at most publishes its load, and reads its peers'.
pub const LOAD_SHARE_MS: u64 = 10;
/// A snapshot older than this counts as empty: its VM has stopped
/// publishing (a busy one rewrites it at least every duty tick).
pub const STALE_AFTER_MS: u64 = 1_000;

/// The shared-data key of the worker whose queue is `queue_name`.
pub fn key_of(queue_name: &str) -> String {
    format!("kvroute/load/{queue_name}")
}

/// Requests one VM has in flight on one pod.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PodLoad {
    pub requests: u32,
    /// Uncached prompt blocks of requests whose answer has not started.
    pub pending_blocks: u64,
    /// Uncached prompt blocks of requests not finished.
    pub active_blocks: u64,
}

impl PodLoad {
    pub fn is_zero(&self) -> bool {
        *self == PodLoad::default()
    }

    pub fn plus(self, other: PodLoad) -> PodLoad {
        PodLoad {
            requests: self.requests.saturating_add(other.requests),
            pending_blocks: self.pending_blocks.saturating_add(other.pending_blocks),
            active_blocks: self.active_blocks.saturating_add(other.active_blocks),
        }
    }
}

/// One VM's load as it wrote it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadSnapshot {
    pub written_ms: u64,
    pub pods: Vec<(String, PodLoad)>,
}

/// Bytes of a snapshot entry besides its pod's address.
const ENTRY_BYTES: usize = 2 + 4 + 8 + 8;

impl LoadSnapshot {
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        let mut out = Vec::with_capacity(12 + self.pods.len() * (ENTRY_BYTES + 16));
        codec::put_u64(&mut out, self.written_ms);
        codec::put_u32(
            &mut out,
            u32::try_from(self.pods.len()).map_err(|_| WireError::TooLong)?,
        );
        for (pod, load) in &self.pods {
            wire::put_str(&mut out, pod)?;
            codec::put_u32(&mut out, load.requests);
            codec::put_u64(&mut out, load.pending_blocks);
            codec::put_u64(&mut out, load.active_blocks);
        }
        Ok(out)
    }

    pub fn decode(bytes: &[u8]) -> Result<LoadSnapshot, WireError> {
        let mut r = Reader::new(bytes);
        let written_ms = r.u64("written_ms")?;
        let n = r.u32("pods")?;
        let n = r.checked_count(u64::from(n), ENTRY_BYTES, "pods")?;
        let mut pods = Vec::with_capacity(n);
        for _ in 0..n {
            let pod = wire::pod(&mut r)?;
            let load = PodLoad {
                requests: r.u32("requests")?,
                pending_blocks: r.u64("pending_blocks")?,
                active_blocks: r.u64("active_blocks")?,
            };
            pods.push((pod, load));
        }
        if !r.is_empty() {
            return Err(WireError::TrailingBytes);
        }
        Ok(LoadSnapshot { written_ms, pods })
    }

    /// Whether this snapshot still counts at `now_ms`.
    pub fn is_fresh(&self, now_ms: u64) -> bool {
        now_ms.saturating_sub(self.written_ms) <= STALE_AFTER_MS
    }
}

/// The peers' load per pod: the sum of their fresh snapshots.
pub fn sum_fresh<'a>(
    snapshots: impl IntoIterator<Item = &'a LoadSnapshot>,
    now_ms: u64,
) -> HashMap<String, PodLoad> {
    let mut sums: HashMap<String, PodLoad> = HashMap::new();
    for snapshot in snapshots.into_iter().filter(|s| s.is_fresh(now_ms)) {
        for (pod, load) in &snapshot.pods {
            let sum = sums.entry(pod.clone()).or_default();
            *sum = sum.plus(*load);
        }
    }
    sums
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(requests: u32, pending_blocks: u64, active_blocks: u64) -> PodLoad {
        PodLoad {
            requests,
            pending_blocks,
            active_blocks,
        }
    }

    fn snapshot(written_ms: u64, pods: &[(&str, PodLoad)]) -> LoadSnapshot {
        LoadSnapshot {
            written_ms,
            pods: pods.iter().map(|(p, l)| (p.to_string(), *l)).collect(),
        }
    }

    #[test]
    fn a_snapshot_reads_back_as_written() {
        let written = snapshot(
            1_700_000_000_123,
            &[("10.0.0.1:8000", load(3, 120, 400)), ("b:1", load(0, 0, 7))],
        );
        let bytes = written.encode().unwrap();
        assert_eq!(LoadSnapshot::decode(&bytes).unwrap(), written);
        let empty = snapshot(5, &[]);
        assert_eq!(
            LoadSnapshot::decode(&empty.encode().unwrap()).unwrap(),
            empty
        );
    }

    #[test]
    fn damaged_snapshots_are_errors_not_panics() {
        let bytes = snapshot(9, &[("a:1", load(1, 2, 3))]).encode().unwrap();
        for cut in 0..bytes.len() {
            assert!(LoadSnapshot::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut trailing = bytes.clone();
        trailing.push(0);
        assert_eq!(
            LoadSnapshot::decode(&trailing),
            Err(WireError::TrailingBytes)
        );
        let mut huge = bytes;
        huge[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(LoadSnapshot::decode(&huge).is_err());
    }

    #[test]
    fn fresh_snapshots_add_up_and_stale_ones_count_as_empty() {
        let a = snapshot(1_000, &[("p:1", load(2, 10, 30)), ("p:2", load(1, 0, 5))]);
        let b = snapshot(1_900, &[("p:1", load(1, 4, 4))]);
        let gone = snapshot(100, &[("p:2", load(50, 500, 500))]);
        let sums = sum_fresh([&a, &b, &gone], 2_000);
        assert_eq!(sums.get("p:1"), Some(&load(3, 14, 34)));
        assert_eq!(
            sums.get("p:2"),
            Some(&load(1, 0, 5)),
            "the stale snapshot adds nothing"
        );
        assert!(sum_fresh([&a], 1_000 + STALE_AFTER_MS + 1).is_empty());
        assert_eq!(key_of("kvroute/q/00ff"), "kvroute/load/kvroute/q/00ff");
    }
}
