//! The indexer feed applied to a cluster: the pods it names, the load they
//! report, its block operations.

use super::Cluster;
use super::{PodSpec, ReportedLoad};
use crate::feed::{BlockOp, FeedUpdate};
use crate::index::IndexOp;

impl Cluster {
    /// Applies an indexer feed update: the pod set and load it states (unless
    /// unchanged), then its block operations. Precise entries are trusted for `trust_for_s`.
    /// A snapshot page is applied as it comes: pages are ranges of the index
    /// key, so each lands on its own run of buckets and applying several in
    /// one pass would save no bucket round trip (core/benches/snapshot_load.rs).
    pub fn apply_feed(&mut self, update: &FeedUpdate, now_s: u32, trust_for_s: u32) {
        if !update.pods_unchanged {
            if !update.pods.is_empty() || self.discovered {
                self.adopt_pods(update);
            }
            self.record_reported_load(update);
        }
        if let Some(mut index) = self.index.take() {
            let mut ops: Vec<IndexOp> = Vec::new();
            self.index_ops(update, &mut ops);
            index.apply_ops(&ops, now_s);
            self.index = Some(index);
        }
        self.precise_until_s = now_s.saturating_add(trust_for_s);
    }

    /// True once the indexer feed has named the pods.
    pub fn is_discovered(&self) -> bool {
        self.discovered
    }

    /// Takes the update's pods as the pod set, but for any whose address no
    /// destination header may carry: a block operation of such a pod then
    /// finds no pod and is dropped.
    fn adopt_pods(&mut self, update: &FeedUpdate) {
        self.discovered = true;
        let default_capacity = self.default_capacity.max(1);
        let speeds = &self.configured_speeds;
        let usable = update.pods.iter().filter(|p| p.has_pod_address());
        let specs = usable.map(|p| PodSpec {
            address: p.address.clone(),
            models: p.models.clone(),
            // 0: the indexer has not scraped the pod's capacity yet.
            capacity_blocks: if p.capacity_blocks == 0 {
                default_capacity
            } else {
                p.capacity_blocks
            },
            // A configured endpoint's speed, else the indexer's, else 1.
            speed: speeds.get(&p.address).copied().unwrap_or(if p.speed > 0.0 {
                f64::from(p.speed)
            } else {
                1.0
            }),
        });
        self.set_pods(specs.collect());
        // Only the index's writer applies block operations.
        if self.index.is_none() {
            return;
        }
        self.feed_pod_ids = update
            .pods
            .iter()
            .map(|p| Some(self.pods[*self.by_address.get(&p.address)?].id))
            .collect();
    }

    fn record_reported_load(&mut self, update: &FeedUpdate) {
        for info in &update.pods {
            if let Some(i) = self.by_address.get(&info.address).copied() {
                let reported = ReportedLoad {
                    waiting: info.waiting,
                    running: info.running,
                    kv_usage: info.kv_usage,
                };
                // An unchanged load is the same report (or one that moved
                // nothing): what this proxy did since still counts.
                if self.pods.get(i).is_some_and(|pod| pod.reported != reported) {
                    self.update_load(i, |pod| {
                        pod.reported = reported;
                        let load = pod.load();
                        pod.inflight_at_report = load.requests;
                        pod.active_at_report = load.active_blocks;
                    });
                }
            }
        }
    }

    /// `update`'s block operations on the index's pod ids, appended to
    /// `ops`: a snapshot's first page clears every pod first.
    fn index_ops<'u>(&self, update: &'u FeedUpdate, ops: &mut Vec<IndexOp<'u>>) {
        if update.snapshot {
            ops.extend(self.pods.iter().map(|pod| IndexOp::Cleared(pod.id)));
        }
        ops.extend(update.ops.iter().filter_map(|op| {
            let id = (*self.feed_pod_ids.get(op.pod() as usize)?)?;
            Some(match op {
                BlockOp::Stored { tier, hashes, .. } => IndexOp::Stored(id, *tier, hashes),
                BlockOp::Removed { hashes, .. } => IndexOp::Removed(id, hashes),
                BlockOp::Cleared { .. } => IndexOp::Cleared(id),
            })
        }));
    }
}
