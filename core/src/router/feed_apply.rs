//! The indexer feed applied to a cluster: the pods it names, the load they
//! report, its block operations.

use super::Cluster;
use super::{PodSpec, ReportedLoad};
use crate::feed::{BlockOp, FeedUpdate, PodInfo};
use crate::index::IndexOp;

impl Cluster {
    /// Applies an indexer feed update: the pod set and load it states (unless
    /// unchanged), then its block operations. Precise entries are trusted for `trust_for_s`.
    /// A snapshot page is applied as it comes: pages are ranges of the index
    /// key, so each lands on its own run of buckets and applying several in
    /// one pass would save no bucket round trip (core/benches/snapshot_load.rs).
    pub fn apply_feed(&mut self, update: &FeedUpdate, now_s: u32, trust_for_s: u32) {
        if !update.pods_unchanged {
            let in_order = (!update.pods.is_empty() || self.discovered) && self.adopt_pods(update);
            self.record_reported_load(update, in_order);
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
    /// finds no pod and is dropped. True when the pods are then the
    /// update's usable ones in their order (none was left out for a
    /// repeated address or beyond [`crate::index::MAX_PODS`]).
    fn adopt_pods(&mut self, update: &FeedUpdate) -> bool {
        self.discovered = true;
        // The list again (the singleton sends it with every load change): it
        // is compared where it lies, not copied into specs first.
        let held = self.holds(&update.pods);
        if !held {
            let specs = usable(&update.pods).map(|p| PodSpec {
                address: p.address.clone(),
                models: p.models.clone(),
                capacity_blocks: self.capacity_of(p),
                speed: self.speed_of(p),
            });
            self.set_pods(specs.collect());
        }
        // Only the index's writer applies block operations.
        if self.index.is_some() {
            self.feed_pod_ids = update
                .pods
                .iter()
                .map(|p| Some(self.pods[*self.by_address.get(&p.address)?].id))
                .collect();
        }
        held || self.pods.len() == usable(&update.pods).count()
    }

    /// Whether the pods are those of `pods`, in its order.
    fn holds(&self, pods: &[PodInfo]) -> bool {
        let mut held = self.pods.iter();
        usable(pods).all(|p| {
            held.next().is_some_and(|pod| {
                let spec = &pod.spec;
                spec.address == p.address
                    && spec.models == p.models
                    && spec.capacity_blocks == self.capacity_of(p)
                    && spec.speed == self.speed_of(p)
            })
        }) && held.next().is_none()
    }

    /// 0: the indexer has not scraped the pod's capacity yet.
    fn capacity_of(&self, p: &PodInfo) -> u32 {
        if p.capacity_blocks == 0 {
            self.default_capacity.max(1)
        } else {
            p.capacity_blocks
        }
    }

    /// A configured endpoint's speed, else the indexer's, else 1.
    fn speed_of(&self, p: &PodInfo) -> f64 {
        match self.configured_speeds.get(&p.address) {
            Some(speed) => *speed,
            None if p.speed > 0.0 => f64::from(p.speed),
            None => 1.0,
        }
    }

    /// The reported load of every pod of the update; `in_order`: a pod's
    /// place among the update's usable pods is its place in the cluster.
    fn record_reported_load(&mut self, update: &FeedUpdate, in_order: bool) {
        for (place, info) in usable(&update.pods).enumerate() {
            let i = if in_order {
                place
            } else {
                match self.by_address.get(&info.address) {
                    Some(&i) => i,
                    None => continue,
                }
            };
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

/// The pods of `pods` whose address a destination header can carry.
fn usable(pods: &[PodInfo]) -> impl Iterator<Item = &PodInfo> {
    pods.iter().filter(|p| p.has_pod_address())
}
