//! Pods: how they become known and go, their load, their liveness, and
//! their debug view.

use std::collections::BTreeMap;

use kvroute_core::feed::Tier;

use super::blocks::{Blocks, Held};
use super::feed_log::Sink;
use super::hashing::{map_bytes, Map};
use super::keys::{BlockHash, PodKey};
use super::least_loaded::{Load, LoadRank};
use super::origin;
use super::sequence::Source;
use super::sources::Group;
use super::{Index, PodDebug, SourceDebug};

pub(super) struct Pod {
    pub(super) address: String,
    pub(super) models: Vec<String>,
    pub(super) origins: u8,
    pub(super) replay_endpoint: Option<String>,
    pub(super) load: Load,
    /// Relative speed as its source states it; 0: not stated.
    pub(super) speed: f32,
    pub(super) last_seen_ms: u64,
    pub(super) sources: BTreeMap<i64, Source>,
    /// The pod's (kvroute hash, pod) entries in the block map, by best tier.
    pub(super) held: Held,
    /// Learned kvroute hash → expiry (ms).
    pub(super) learned: Map<BlockHash, u64>,
    pub(super) source_blocks: usize,
}

impl Pod {
    pub(super) fn new(address: String, origins: u8, now_ms: u64) -> Pod {
        Pod {
            address,
            models: Vec::new(),
            origins,
            replay_endpoint: None,
            load: Load::default(),
            speed: 0.0,
            last_seen_ms: now_ms,
            sources: BTreeMap::new(),
            held: Held::default(),
            learned: Map::default(),
            source_blocks: 0,
        }
    }

    pub(super) fn memory_bytes(&self) -> usize {
        map_bytes(&self.learned)
            + self
                .sources
                .values()
                .flat_map(|s| s.groups.values())
                .map(Group::memory_bytes)
                .sum::<usize>()
    }

    /// Takes everything the pod holds out of the block map: its sources'
    /// blocks and its learned entries. Their ops are moot (the caller records
    /// one `Cleared`). Returns how many learned entries went.
    pub(super) fn release_blocks(&mut self, blocks: &mut Blocks, key: PodKey) -> usize {
        let mut moot = Sink::default();
        for source in self.sources.values_mut() {
            for group in source.groups.values_mut() {
                group.drain_into(blocks, &mut moot, &mut self.held, key);
            }
        }
        self.source_blocks = 0;
        let learned = std::mem::take(&mut self.learned);
        for h in learned.keys() {
            blocks.adjust_kv(&mut moot, &mut self.held, key, *h, Tier::Learned, false);
        }
        learned.len()
    }
}

impl Index {
    /// Adds (or refreshes) a pod known from configuration or DNS.
    pub fn add_pod(&mut self, address: &str, model: Option<&str>, origin: u8, now_ms: u64) {
        let key = match self.by_address.get(address) {
            Some(&k) => k,
            None => {
                if self.pods.len() >= self.cfg.max_pods {
                    self.metrics.rejected("max_pods");
                    return;
                }
                let k = self.next_pod_key;
                self.next_pod_key = k.next();
                let pod = Pod::new(address.to_owned(), 0, now_ms);
                self.least_loaded
                    .insert(&pod.models, LoadRank::new(&pod.load, k));
                self.pods.insert(k, pod);
                self.by_address.insert(address.to_owned(), k);
                k
            }
        };
        if let Some(pod) = self.pods.get_mut(&key) {
            pod.origins |= origin;
        }
        if let Some(m) = model {
            self.add_model(key, m);
        }
        self.update_gauges();
    }

    /// Adds a served model to a pod (none: it serves every model).
    pub(super) fn add_model(&mut self, key: PodKey, model: &str) {
        let known = self
            .pods
            .get(&key)
            .is_none_or(|p| p.models.iter().any(|m| m == model));
        if !model.is_empty() && !known {
            self.reranked(key, |pod| pod.models.push(model.to_owned()));
        }
    }

    /// Applies `change` to a pod's load or models, keeping its place in the
    /// least-loaded order.
    fn reranked(&mut self, key: PodKey, change: impl FnOnce(&mut Pod)) {
        if let Some(pod) = self.pods.get_mut(&key) {
            self.least_loaded
                .remove(&pod.models, LoadRank::new(&pod.load, key));
            change(pod);
            self.least_loaded
                .insert(&pod.models, LoadRank::new(&pod.load, key));
        }
    }

    /// Sets the relative speed of a known pod (sent with the pod list).
    pub fn set_speed(&mut self, address: &str, speed: f32) {
        if let Some(pod) = self
            .by_address
            .get(address)
            .and_then(|k| self.pods.get_mut(k))
        {
            pod.speed = speed;
        }
    }

    /// Sets an explicit replay endpoint of a pod (rank 0; rank r uses port + r).
    pub fn set_replay_endpoint(&mut self, address: &str, endpoint: &str) {
        if let Some(pod) = self
            .by_address
            .get(address)
            .and_then(|k| self.pods.get_mut(k))
        {
            pod.replay_endpoint = Some(endpoint.to_owned());
        }
    }

    /// Withdraws an origin (e.g. the pod left DNS); a pod left with no origin
    /// is dropped with its entries.
    pub fn remove_origin(&mut self, address: &str, origin: u8) {
        let Some(&key) = self.by_address.get(address) else {
            return;
        };
        let gone = match self.pods.get_mut(&key) {
            Some(pod) => {
                pod.origins &= !origin;
                pod.origins == 0
            }
            None => false,
        };
        if gone {
            self.drop_pod(key);
        }
    }

    /// Addresses of the pods, with their origins.
    pub fn pod_addresses(&self) -> Vec<(String, u8)> {
        self.pods
            .values()
            .map(|p| (p.address.clone(), p.origins))
            .collect()
    }

    fn drop_pod(&mut self, key: PodKey) {
        let mut sink = Sink::default();
        if let Some(mut pod) = self.pods.remove(&key) {
            self.least_loaded
                .remove(&pod.models, LoadRank::new(&pod.load, key));
            self.by_address.remove(&pod.address);
            let learned = pod.release_blocks(&mut self.blocks, key);
            self.learned_total = self.learned_total.saturating_sub(learned);
            sink.cleared(key);
        }
        self.commit(sink);
    }

    /// Records a pod's load (a successful scrape also counts as a sign of life).
    pub fn set_load(&mut self, address: &str, load: Load, now_ms: u64) {
        if let Some(&key) = self.by_address.get(address) {
            self.reranked(key, |pod| {
                pod.load = load;
                pod.last_seen_ms = now_ms;
            });
        }
    }

    /// Expires learned entries and drops silent pods.
    pub fn expire(&mut self, now_ms: u64) {
        let mut sink = Sink::default();
        self.evict_learned(&mut sink, now_ms, 0);
        self.commit(sink);
        if self.cfg.pod_timeout_ms > 0 {
            let silent: Vec<(PodKey, u8)> = self
                .pods
                .iter()
                .filter(|(_, p)| now_ms.saturating_sub(p.last_seen_ms) > self.cfg.pod_timeout_ms)
                .filter(|(_, p)| {
                    p.origins == origin::EVENTS || p.held.total() > 0 || !p.sources.is_empty()
                })
                .map(|(k, p)| (*k, p.origins))
                .collect();
            for (key, origins) in silent {
                self.metrics.pods_expired.inc();
                if origins == origin::EVENTS {
                    self.drop_pod(key);
                } else {
                    self.reset_pod(key);
                }
            }
        }
        self.update_gauges();
    }

    /// Drops a pod's entries and sequence state but keeps it listed.
    fn reset_pod(&mut self, key: PodKey) {
        let mut sink = Sink::default();
        if let Some(pod) = self.pods.get_mut(&key) {
            let learned = pod.release_blocks(&mut self.blocks, key);
            self.learned_total = self.learned_total.saturating_sub(learned);
            pod.learned = Map::default();
            pod.sources.clear();
            sink.cleared(key);
        }
        self.commit(sink);
    }

    /// Pods for `GET /v1/debug/pods`.
    pub fn debug_pods(&self, now_ms: u64) -> Vec<PodDebug> {
        self.pods
            .values()
            .map(|p| {
                let mut by_tier = BTreeMap::new();
                for (tier, name) in [
                    (Tier::Gpu, "gpu"),
                    (Tier::Cpu, "cpu"),
                    (Tier::Disk, "disk"),
                    (Tier::Learned, "learned"),
                ] {
                    let n = p.held.by_tier(tier);
                    if n > 0 {
                        by_tier.insert(name, n);
                    }
                }
                let mut origins = Vec::new();
                for (bit, name) in [
                    (origin::STATIC, "static"),
                    (origin::DNS, "dns"),
                    (origin::EVENTS, "events"),
                    (origin::CONNECT, "connect"),
                ] {
                    if p.origins & bit != 0 {
                        origins.push(name);
                    }
                }
                PodDebug {
                    address: p.address.clone(),
                    models: p.models.clone(),
                    origins,
                    blocks: p.held.total(),
                    blocks_by_tier: by_tier,
                    learned: p.learned.len(),
                    sources: p
                        .sources
                        .iter()
                        .map(|(r, s)| SourceDebug {
                            rank: *r,
                            next_seq: s.next_seq,
                            blocks: s.groups.values().map(|g| g.blocks.len()).sum(),
                            replay_pending: s.replay.is_some(),
                        })
                        .collect(),
                    capacity_blocks: p.load.capacity_blocks,
                    speed: (p.speed > 0.0).then_some(p.speed),
                    waiting: p.load.waiting,
                    running: p.load.running,
                    kv_usage: p.load.kv_usage,
                    silent_ms: now_ms.saturating_sub(p.last_seen_ms),
                }
            })
            .collect()
    }
}
