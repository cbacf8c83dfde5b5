//! This VM's load on each pod (prefill pending, requests in flight), published
//! for its peers, and the peers' load read back.

use super::Worker;
use crate::host;
use kvroute_core::peer_load::{self, LoadSnapshot, LoadSum, PodLoad, LOAD_SHARE_MS};
use proxy_wasm::types::LogLevel;
use std::collections::HashMap;

/// Own load publications kept: the singleton's sum counts one at most a
/// few share periods old.
const OWN_PUBLICATIONS_KEPT: usize = 8;

impl Worker {
    /// A request routed here got its first response bytes: its prompt's
    /// blocks stop counting as the pod's pending prefill.
    pub fn prefill_done(&mut self, pod: &str, prompt_blocks: u32) {
        self.cluster.record_prefill_done(pod, prompt_blocks);
        self.note_load_change();
    }

    /// A request routed here ended: `prompt_blocks` of its prefill were still
    /// pending, `routed_blocks` uncached blocks held KV on the pod.
    pub fn finished(&mut self, pod: &str, prompt_blocks: u32, routed_blocks: u32) {
        self.cluster.record_finished(pod, prompt_blocks);
        self.cluster.record_released(pod, routed_blocks);
        self.note_load_change();
    }

    /// This VM's load changed: it is published within [`LOAD_SHARE_MS`]
    /// when there are serving peers to read it, else at the next duty tick.
    pub(super) fn note_load_change(&mut self) {
        self.load_changed = true;
        if self.peers.serving_count() > 0 {
            let period = self.ticker.period_ms().min(LOAD_SHARE_MS);
            self.ticker.set_period(period);
        }
    }

    /// Writes this VM's load to its key (see [`kvroute_core::peer_load`]).
    pub(super) fn publish_load(&mut self, now_ms: u64) {
        self.load_changed = false;
        let Some(key) = self.peers.own_load_key() else {
            return;
        };
        // Strictly increasing: the singleton's sum names a snapshot by it.
        let written_ms = self
            .own_published
            .last()
            .map_or(now_ms, |last| now_ms.max(last.written_ms + 1));
        let snapshot = LoadSnapshot {
            written_ms,
            pods: self.cluster.own_load(),
        };
        self.load_published = !snapshot.pods.is_empty();
        match snapshot.encode() {
            Ok(bytes) => {
                if !host::shared_set(key, &bytes, 0) {
                    self.metrics.peer_errors.inc();
                }
            }
            Err(e) => host::log(LogLevel::Warn, &format!("kvroute: load not published: {e}")),
        }
        if self.own_published.len() == OWN_PUBLICATIONS_KEPT {
            self.own_published.remove(0);
        }
        self.own_published.push(snapshot);
    }

    /// The serving peers' load as they last published it, read at most
    /// every [`LOAD_SHARE_MS`].
    pub(super) fn read_peer_load(&mut self, now_ms: u64) {
        if now_ms.saturating_sub(self.peer_load_read_ms) < LOAD_SHARE_MS {
            return;
        }
        self.peer_load_read_ms = now_ms;
        if self.peers.serving_count() == 0 {
            self.cluster.set_peer_load(&HashMap::new());
            return;
        }
        if let Some(others) = self.summed_peer_load(now_ms) {
            self.metrics.peer_sum_reads.inc();
            self.cluster.set_peer_load(&others);
            return;
        }
        let mut snapshots = Vec::new();
        for key in self.peers.serving_load_keys() {
            let Some((bytes, _)) = host::shared_get(key) else {
                continue;
            };
            match LoadSnapshot::decode(&bytes) {
                Ok(snapshot) => snapshots.push(snapshot),
                Err(_) => self.metrics.peer_errors.inc(),
            }
        }
        self.cluster
            .set_peer_load(&peer_load::sum_fresh(&snapshots, now_ms));
    }

    /// The peers' load from the singleton's sum (one read instead of one
    /// per peer), if it is fresh and counted this VM's load as kept.
    fn summed_peer_load(&self, now_ms: u64) -> Option<HashMap<String, PodLoad>> {
        // Its serving peers and itself.
        if !peer_load::is_summed(self.peers.serving_count() + 1) {
            return None;
        }
        let own_key = self.peers.own_load_key()?;
        let (bytes, _) = host::shared_get(peer_load::SUM_KEY)?;
        let Ok(sum) = LoadSum::decode(&bytes) else {
            self.metrics.peer_errors.inc();
            return None;
        };
        sum.without(own_key, &self.own_published, now_ms)
    }
}
