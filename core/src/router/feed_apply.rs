//! The indexer feed applied to a cluster: the pods it names, the load they
//! report, its block operations.

use super::Cluster;
use super::{PodSpec, ReportedLoad};
use crate::feed::{BlockOp, FeedUpdate, PodInfo, PodLoad};
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
            self.record_reported_load(update.pods.iter().map(PodInfo::load));
        } else if let Some(load) = &update.load {
            // Load for another list (one this VM missed) waits for the next
            // list, at most `feed_forward::FULL_LIST_EVERY_MS` away.
            if update.pods_version != 0
                && update.pods_version == self.feed_list_version
                && load.len() == self.feed_places.len()
            {
                self.record_reported_load(load.iter().copied());
            }
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
    /// destination header may carry: a block operation or a load of such a
    /// pod then finds no pod and is dropped.
    fn adopt_pods(&mut self, update: &FeedUpdate) {
        self.discovered = true;
        // The list again (the singleton sends it every 10 s): it is compared
        // where it lies, not copied into specs first.
        if !self.holds(&update.pods) {
            let specs = usable(&update.pods).map(|p| PodSpec {
                address: p.address.clone(),
                models: p.models.clone(),
                capacity_blocks: self.capacity_of(p),
                speed: self.speed_of(p),
            });
            self.set_pods(specs.collect());
        }
        self.feed_places = self.places_of(&update.pods);
        self.feed_list_version = update.pods_version;
    }

    /// The position among the pods of each of `pods`: counted along the
    /// usable ones when the pods are exactly those in their order (always,
    /// but for a repeated address or a list beyond [`crate::index::MAX_PODS`]),
    /// else looked up by address.
    fn places_of(&self, pods: &[PodInfo]) -> Vec<Option<usize>> {
        let mut usable_count = 0;
        let counted: Vec<Option<usize>> = pods
            .iter()
            .map(|p| {
                p.has_pod_address().then(|| {
                    usable_count += 1;
                    usable_count - 1
                })
            })
            .collect();
        if usable_count == self.pods.len() {
            return counted;
        }
        pods.iter()
            .zip(counted)
            .map(|(p, usable)| usable.and_then(|_| self.by_address.get(&p.address).copied()))
            .collect()
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

    /// The load each place of the feed's last list reports.
    fn record_reported_load(&mut self, loads: impl Iterator<Item = PodLoad>) {
        for (place, load) in loads.enumerate() {
            let Some(&Some(i)) = self.feed_places.get(place) else {
                continue;
            };
            let reported = ReportedLoad {
                waiting: load.waiting,
                running: load.running,
                kv_usage: load.kv_usage,
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
            let place = (*self.feed_places.get(op.pod() as usize)?)?;
            let id = self.pods.get(place)?.id;
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
