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
//! W − 1 reads per deciding worker are still O(W²) per proxy. So while
//! [`SUM_MIN_WORKERS`] or more workers serve, the singleton sums their fresh
//! snapshots every [`LOAD_SHARE_MS`] into one key, [`SUM_KEY`] ([`LoadSum`]),
//! naming when each counted snapshot was written ([`SumSchedule`]: less
//! often when no worker has load); a worker reads that one key and takes
//! its own counted snapshot out. Without a fresh sum with load (fewer
//! workers, no singleton, it stalled, or the proxy was idle) a worker reads
//! its peers' keys.
//! Measured on 30 KiB requests: at `--concurrency` 8 the workers' reads fall
//! from 6.9 to 4.0 µs of wasm time per request and the singleton's summing
//! adds a few µs (0–17 µs less Envoy CPU per request in all); at 32 the sum
//! saves 21–33 µs of Envoy CPU per request.
//!
//! ```text
//! snapshot := u64 written_ms, pods
//! sum      := u64 written_ms, u32 n, n × (str key, u64 snapshot_written_ms), pods
//! pods     := u32 n, n × (str pod, u32 requests, u64 pending_blocks, u64 active_blocks)
//! str      := u16 len, UTF-8
//! ```

use crate::codec::{self, Reader};
use crate::wire::{self, WireError};
use std::collections::HashMap;

/// How often a worker at most publishes its load, and reads its peers'.
/// 20 ms, not 10: at `--concurrency` 8 the sharing (the workers' writes
/// and reads, the singleton's sum) took 15.5 µs less wasm time per 30 KiB
/// request, and all callbacks 32 µs less (241 → 209 µs), for peers that
/// see a worker's load up to ~60 ms late through the sum (~40 ms without),
/// where a prompt's prefill takes hundreds of ms.
pub const LOAD_SHARE_MS: u64 = 20;
/// A snapshot older than this counts as empty: its VM has stopped
/// publishing (a busy one rewrites it at least every duty tick).
pub const STALE_AFTER_MS: u64 = 1_000;
/// The shared-data key of the singleton's [`LoadSum`].
pub const SUM_KEY: &str = "kvroute/load/sum";
/// The singleton rewrites an unchanged sum this often: its age tells the
/// workers that it still sums.
pub const SUM_REWRITE_MS: u64 = 200;
/// A sum older than this counts as stale and the workers read their peers'
/// keys: its singleton missed two rewrites (stalled or gone), and a sum
/// frozen for [`STALE_AFTER_MS`] would hide every peer's changes that long.
pub const SUM_STALE_AFTER_MS: u64 = 2 * SUM_REWRITE_MS;
/// Serving workers from which the singleton sums their load. Below it the
/// peers' own keys cost no more: with 3 workers, 6 reads per share period
/// against the sum's 3 + 1 write + 3.
pub const SUM_MIN_WORKERS: usize = 4;

/// Whether the singleton sums the load of `serving` workers.
pub fn is_summed(serving: usize) -> bool {
    serving >= SUM_MIN_WORKERS
}

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

    pub fn minus(self, other: PodLoad) -> PodLoad {
        PodLoad {
            requests: self.requests.saturating_sub(other.requests),
            pending_blocks: self.pending_blocks.saturating_sub(other.pending_blocks),
            active_blocks: self.active_blocks.saturating_sub(other.active_blocks),
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

fn put_pods(out: &mut Vec<u8>, pods: &[(String, PodLoad)]) -> Result<(), WireError> {
    codec::put_u32(
        out,
        u32::try_from(pods.len()).map_err(|_| WireError::TooLong)?,
    );
    for (pod, load) in pods {
        wire::put_str(out, pod)?;
        codec::put_u32(out, load.requests);
        codec::put_u64(out, load.pending_blocks);
        codec::put_u64(out, load.active_blocks);
    }
    Ok(())
}

/// The pods' loads, and nothing after them.
fn read_pods(r: &mut Reader<'_>) -> Result<Vec<(String, PodLoad)>, WireError> {
    let n = r.u32("pods")?;
    let n = r.checked_count(u64::from(n), ENTRY_BYTES, "pods")?;
    let mut pods = Vec::with_capacity(n);
    for _ in 0..n {
        let pod = wire::pod(r)?;
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
    Ok(pods)
}

impl LoadSnapshot {
    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        let mut out = Vec::with_capacity(12 + self.pods.len() * (ENTRY_BYTES + 16));
        codec::put_u64(&mut out, self.written_ms);
        put_pods(&mut out, &self.pods)?;
        Ok(out)
    }

    pub fn decode(bytes: &[u8]) -> Result<LoadSnapshot, WireError> {
        let mut r = Reader::new(bytes);
        let written_ms = r.u64("written_ms")?;
        let pods = read_pods(&mut r)?;
        Ok(LoadSnapshot { written_ms, pods })
    }

    /// Whether this snapshot still counts at `now_ms`.
    pub fn is_fresh(&self, now_ms: u64) -> bool {
        now_ms.saturating_sub(self.written_ms) <= STALE_AFTER_MS
    }
}

/// The workers' fresh snapshots as the singleton summed them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadSum {
    pub written_ms: u64,
    /// Each counted snapshot: its worker's key and when it was written.
    pub counted: Vec<(String, u64)>,
    /// Per pod, in address order (an unchanged sum encodes alike).
    pub pods: Vec<(String, PodLoad)>,
}

/// Bytes of a counted entry besides its key.
const COUNTED_BYTES: usize = 2 + 8;

impl LoadSum {
    /// The sum of the fresh ones of `snapshots` (each with its worker's key).
    pub fn of<'a>(
        snapshots: impl IntoIterator<Item = (&'a str, &'a LoadSnapshot)>,
        now_ms: u64,
    ) -> LoadSum {
        let fresh: Vec<(&str, &LoadSnapshot)> = snapshots
            .into_iter()
            .filter(|(_, s)| s.is_fresh(now_ms))
            .collect();
        let mut pods: Vec<(String, PodLoad)> = sum_fresh(fresh.iter().map(|&(_, s)| s), now_ms)
            .into_iter()
            .collect();
        pods.sort_unstable_by(|a, b| a.0.cmp(&b.0));
        LoadSum {
            written_ms: now_ms,
            counted: fresh
                .iter()
                .map(|&(key, s)| (key.to_string(), s.written_ms))
                .collect(),
            pods,
        }
    }

    /// Whether the workers may use this sum at `now_ms`: it is fresh and
    /// has load. After writing a sum without load the singleton sums only
    /// at its duty ticks ([`SumSchedule`]), so that sum would hide a peer's
    /// first load after a quiet spell for up to a duty tick (100 ms by
    /// default), where its key shows it within a share period.
    pub fn is_current(&self, now_ms: u64) -> bool {
        !self.pods.is_empty() && now_ms.saturating_sub(self.written_ms) <= SUM_STALE_AFTER_MS
    }

    /// Every other worker's load: the sum less the snapshot of `own_key`
    /// it counted, found among `own_published` (that worker's last
    /// publications). `None` when the sum is not current (stale or without
    /// load) or counted a snapshot of `own_key` no longer among them: the
    /// worker then reads its peers.
    pub fn without(
        &self,
        own_key: &str,
        own_published: &[LoadSnapshot],
        now_ms: u64,
    ) -> Option<HashMap<String, PodLoad>> {
        if !self.is_current(now_ms) {
            return None;
        }
        let mut others: HashMap<String, PodLoad> = self.pods.iter().cloned().collect();
        let Some(&(_, counted_ms)) = self.counted.iter().find(|(key, _)| key == own_key) else {
            return Some(others);
        };
        let own = own_published.iter().find(|s| s.written_ms == counted_ms)?;
        for (pod, load) in &own.pods {
            if let Some(sum) = others.get_mut(pod) {
                *sum = sum.minus(*load);
            }
        }
        others.retain(|_, load| !load.is_zero());
        Some(others)
    }

    pub fn encode(&self) -> Result<Vec<u8>, WireError> {
        let mut out = Vec::with_capacity(
            16 + self.counted.len() * (COUNTED_BYTES + 40) + self.pods.len() * (ENTRY_BYTES + 16),
        );
        codec::put_u64(&mut out, self.written_ms);
        codec::put_u32(
            &mut out,
            u32::try_from(self.counted.len()).map_err(|_| WireError::TooLong)?,
        );
        for (key, written_ms) in &self.counted {
            wire::put_str(&mut out, key)?;
            codec::put_u64(&mut out, *written_ms);
        }
        put_pods(&mut out, &self.pods)?;
        Ok(out)
    }

    pub fn decode(bytes: &[u8]) -> Result<LoadSum, WireError> {
        let mut r = Reader::new(bytes);
        let written_ms = r.u64("written_ms")?;
        let n = r.u32("counted")?;
        let n = r.checked_count(u64::from(n), COUNTED_BYTES, "counted")?;
        let mut counted = Vec::with_capacity(n);
        for _ in 0..n {
            let len = r.u16("key")?;
            let key = r.str(usize::from(len), "key")?;
            counted.push((key, r.u64("snapshot_written_ms")?));
        }
        let pods = read_pods(&mut r)?;
        Ok(LoadSum {
            written_ms,
            counted,
            pods,
        })
    }
}

/// When the singleton writes its sum, and how often it sums.
///
/// A sum with load is rewritten unchanged every [`SUM_REWRITE_MS`] (its age
/// tells the workers it still sums), and the singleton sums every
/// [`LOAD_SHARE_MS`]. Once it has written a sum with no load on any pod (an
/// idle proxy), it sums only at its duty ticks and does not rewrite that
/// sum: the workers do not use a sum without load ([`LoadSum::is_current`])
/// and read their peers' keys until the first load after the quiet spell
/// reaches the sum, within a duty tick. Summing 50 times a second woke an
/// idle singleton for nothing, and took about 5 ms/s of its thread at
/// `--concurrency` 8 (docs/results/2026-12-06-idle-sum).
#[derive(Debug, Default)]
pub struct SumSchedule {
    /// The sum last written, and when.
    last: Option<LoadSum>,
    written_ms: u64,
}

impl SumSchedule {
    /// How often the singleton sums the load of `serving` workers:
    /// [`LOAD_SHARE_MS`] while enough serve and the last sum had load; else
    /// `None` (at its duty ticks, or not at all).
    pub fn period_ms(&self, serving: usize) -> Option<u64> {
        let idle = self.last.as_ref().is_some_and(|sum| sum.pods.is_empty());
        (is_summed(serving) && !idle).then_some(LOAD_SHARE_MS)
    }

    /// Whether `sum`, just summed, is to be written at `now_ms`: when it
    /// differs from the last, or has load and the last is
    /// [`SUM_REWRITE_MS`] old.
    pub fn due(&self, sum: &LoadSum, now_ms: u64) -> bool {
        let Some(last) = &self.last else {
            return true;
        };
        let unchanged = last.counted == sum.counted && last.pods == sum.pods;
        !unchanged
            || (!sum.pods.is_empty() && now_ms.saturating_sub(self.written_ms) >= SUM_REWRITE_MS)
    }

    /// `sum` was written at `now_ms`.
    pub fn written(&mut self, sum: LoadSum, now_ms: u64) {
        self.written_ms = now_ms;
        self.last = Some(sum);
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

    #[test]
    fn a_sum_counts_fresh_snapshots_and_reads_back_as_written() {
        let a = snapshot(1_000, &[("p:2", load(1, 0, 5)), ("p:1", load(2, 10, 30))]);
        let b = snapshot(1_900, &[("p:1", load(1, 4, 4))]);
        let gone = snapshot(100, &[("p:2", load(50, 500, 500))]);
        let sum = LoadSum::of([("ka", &a), ("kb", &b), ("kgone", &gone)], 2_000);
        assert_eq!(sum.written_ms, 2_000);
        assert_eq!(
            sum.counted,
            vec![("ka".to_string(), 1_000), ("kb".to_string(), 1_900)]
        );
        assert_eq!(
            sum.pods,
            vec![
                ("p:1".to_string(), load(3, 14, 34)),
                ("p:2".to_string(), load(1, 0, 5))
            ],
            "in address order"
        );
        let bytes = sum.encode().unwrap();
        assert_eq!(LoadSum::decode(&bytes).unwrap(), sum);
        for cut in 0..bytes.len() {
            assert!(LoadSum::decode(&bytes[..cut]).is_err(), "cut at {cut}");
        }
        let mut trailing = bytes;
        trailing.push(0);
        assert_eq!(LoadSum::decode(&trailing), Err(WireError::TrailingBytes));
        assert!(LoadSum::decode(&[0xff; 40]).is_err());
    }

    #[test]
    fn an_idle_sum_is_summed_at_duty_ticks_and_left_to_go_stale() {
        let busy = snapshot(1_000, &[("p:1", load(2, 10, 30))]);
        let done = snapshot(1_300, &[]);
        let again = snapshot(3_500, &[("p:2", load(1, 4, 4))]);
        let mut schedule = SumSchedule::default();
        assert_eq!(
            schedule.period_ms(SUM_MIN_WORKERS - 1),
            None,
            "too few workers"
        );
        assert_eq!(schedule.period_ms(SUM_MIN_WORKERS), Some(LOAD_SHARE_MS));
        // (snapshot, now ms, written, share period after, why)
        let steps = [
            (&busy, 1_010, true, true, "the first sum"),
            (&busy, 1_030, false, true, "unchanged"),
            (
                &busy,
                1_209,
                false,
                true,
                "unchanged, under a rewrite period old",
            ),
            (
                &busy,
                1_210,
                true,
                true,
                "unchanged with load: rewritten to stay fresh",
            ),
            (
                &done,
                1_310,
                true,
                false,
                "the load ended: written, then duty ticks",
            ),
            (
                &done,
                1_410,
                false,
                false,
                "unchanged and empty: not rewritten",
            ),
            (
                &done,
                2_290,
                false,
                false,
                "still not rewritten: the workers read their peers",
            ),
            (
                &done,
                2_410,
                true,
                false,
                "the empty snapshot went stale: counted changed",
            ),
            (&done, 3_410, false, false, "nothing changed"),
            (
                &again,
                3_510,
                true,
                true,
                "load again: written, share period",
            ),
        ];
        for (snapshot, now_ms, written, sharing, why) in steps {
            let sum = LoadSum::of([("w", snapshot)], now_ms);
            assert_eq!(schedule.due(&sum, now_ms), written, "{why}");
            if written {
                schedule.written(sum, now_ms);
            }
            let period = schedule.period_ms(SUM_MIN_WORKERS);
            assert_eq!(period == Some(LOAD_SHARE_MS), sharing, "{why}");
        }
    }

    #[test]
    fn a_worker_takes_its_own_counted_snapshot_out_of_the_sum() {
        let older = snapshot(900, &[("p:1", load(5, 50, 50))]);
        let mine = snapshot(1_000, &[("p:1", load(2, 10, 30)), ("p:3", load(1, 1, 1))]);
        let theirs = snapshot(1_500, &[("p:1", load(1, 4, 4)), ("p:2", load(3, 0, 9))]);
        let sum = LoadSum::of([("me", &mine), ("them", &theirs)], 2_000);
        let others = sum
            .without("me", &[older.clone(), mine.clone()], 2_050)
            .unwrap();
        assert_eq!(others.get("p:1"), Some(&load(1, 4, 4)));
        assert_eq!(others.get("p:2"), Some(&load(3, 0, 9)));
        assert_eq!(others.get("p:3"), None, "only mine: nothing left");
        // A sum that did not count this worker is all the others' load.
        let without_me = LoadSum::of([("them", &theirs)], 2_000);
        assert_eq!(
            without_me.without("me", &[], 2_050).unwrap(),
            sum_fresh([&theirs], 2_050)
        );
        // A counted snapshot no longer kept, a stale sum, or one without load
        // (the singleton then sums only at its duty ticks): read the peers instead.
        assert_eq!(sum.without("me", &[older], 2_050), None);
        let idle = LoadSum::of([("them", &snapshot(1_900, &[]))], 2_000);
        assert_eq!(idle.without("me", &[], 2_050), None);
        assert!(sum
            .without(
                "me",
                std::slice::from_ref(&mine),
                2_000 + SUM_STALE_AFTER_MS
            )
            .is_some());
        assert_eq!(
            sum.without("me", &[mine], 2_000 + SUM_STALE_AFTER_MS + 1),
            None
        );
    }
}
