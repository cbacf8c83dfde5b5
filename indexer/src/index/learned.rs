//! Learned entries: kvroute hashes the proxies report for a pod, kept for
//! `learned_ttl_ms` under a global cap.

use kvroute_core::feed::{LearnedBatch, Tier};

use super::feed_log::Sink;
use super::keys::BlockHash;
use super::Index;

impl Index {
    /// True when some pod reports `hash` through KV events (any tier but
    /// learned): such a hash is a token-domain block, never a byte chunk.
    pub fn reported_by_a_pod(&self, hash: BlockHash) -> bool {
        self.blocks
            .holders(hash)
            .any(|(_, best)| best != Tier::Learned)
    }

    /// Applies a proxy's learned batch; hashes of unknown pods are rejected.
    pub fn apply_learned(&mut self, batch: &LearnedBatch, now_ms: u64) -> (usize, usize) {
        let (mut accepted, mut rejected) = (0, 0);
        let mut sink = Sink::default();
        let expiry = now_ms.saturating_add(self.cfg.learned_ttl_ms);
        for (address, hashes) in &batch.entries {
            self.make_block_room();
            let Some(&key) = self.by_address.get(address) else {
                rejected += hashes.len();
                continue;
            };
            for &h in hashes {
                if self.cfg.learned_max_entries == 0 {
                    rejected += 1;
                    continue;
                }
                let present = self
                    .pods
                    .get(&key)
                    .is_some_and(|p| p.learned.contains_key(&h));
                if !present && self.learned_total >= self.cfg.learned_max_entries {
                    self.evict_learned(&mut sink, now_ms, 1);
                }
                let Some(pod) = self.pods.get_mut(&key) else {
                    break;
                };
                if pod.learned.insert(h, expiry).is_none() {
                    self.learned_total += 1;
                    let held = &mut pod.held;
                    self.blocks
                        .adjust_kv(&mut sink, held, key, h, Tier::Learned, true);
                }
                self.learned_fifo.push_back((expiry, key, h));
                accepted += 1;
            }
        }
        self.metrics.learned_accepted.inc_by(accepted as u64);
        self.metrics.learned_rejected.inc_by(rejected as u64);
        if self.learned_fifo.len() > 4 * self.cfg.learned_max_entries.max(1024) {
            let pods = &self.pods;
            self.learned_fifo
                .retain(|(exp, k, h)| pods.get(k).and_then(|p| p.learned.get(h)) == Some(exp));
        }
        self.commit(sink);
        self.update_gauges();
        (accepted, rejected)
    }

    /// Pops learned records due by `now_ms` (or `force` live ones regardless).
    pub(super) fn evict_learned(&mut self, sink: &mut Sink, now_ms: u64, mut force: usize) {
        while let Some(&(exp, key, h)) = self.learned_fifo.front() {
            if exp > now_ms && force == 0 {
                break;
            }
            self.learned_fifo.pop_front();
            let Some(pod) = self.pods.get_mut(&key) else {
                continue;
            };
            if pod.learned.get(&h) != Some(&exp) {
                continue; // refreshed or already gone
            }
            pod.learned.remove(&h);
            self.learned_total = self.learned_total.saturating_sub(1);
            self.blocks
                .adjust_kv(sink, &mut pod.held, key, h, Tier::Learned, false);
            if exp > now_ms {
                self.metrics.learned_evicted.inc();
                force = force.saturating_sub(1);
            }
        }
    }
}
