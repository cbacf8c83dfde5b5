//! What each pod holds of one prompt's chain, and the pods serving a model
//! in load order: the read side of `POST /v1/lookup` (see `crate::lookup`).

use kvroute_core::feed::Tier;
use kvroute_core::lookup::HeldPrefix;

use super::block_table::SetId;
use super::hashing::Map;
use super::keys::{BlockHash, PodKey};
use super::pods::Pod;
use super::{Index, Load};

/// What a lookup answer says of a pod.
#[derive(Debug, Clone, Copy)]
pub struct PodView<'a> {
    /// The pod's key in the index (stable while it is known).
    pub key: PodKey,
    pub address: &'a str,
    pub load: &'a Load,
    /// As its source states it; 0: not stated.
    pub speed: f32,
}

fn view(key: PodKey, pod: &Pod) -> PodView<'_> {
    PodView {
        key,
        address: &pod.address,
        load: &pod.load,
        speed: pod.speed,
    }
}

impl Index {
    /// The pods serving `model` that hold a prefix of `hashes` (what the feed
    /// would serve: precise tiers and learned entries), with that prefix; a
    /// pod that names no model serves every model.
    ///
    /// The chain is cut into runs of blocks with the same interned pod set by
    /// bisection (equal sets at both ends of a span: the span is one run, as
    /// pods hold prefixes of a chain), then each run's holders are extended
    /// by its length: the cost is the runs' holders, not pods × blocks.
    pub fn held_prefixes(
        &self,
        model: &str,
        hashes: &[BlockHash],
    ) -> Vec<(PodView<'_>, HeldPrefix)> {
        let mut walking: Map<PodKey, HeldPrefix> = Map::default();
        let mut held: Map<PodKey, HeldPrefix> = Map::default();
        for (i, (set, len)) in self.set_runs(hashes).into_iter().enumerate() {
            let tiers: Map<PodKey, Tier> = self.blocks.set_holders(set).collect();
            if i == 0 {
                walking.extend(tiers.keys().map(|&pod| (pod, HeldPrefix::default())));
            }
            walking.retain(|pod, prefix| {
                let extended = prefix.extend_by(tiers.get(pod).copied(), len);
                if !extended {
                    held.insert(*pod, *prefix);
                }
                extended
            });
            if walking.is_empty() {
                break;
            }
        }
        held.extend(walking);
        held.into_iter()
            .filter(|(_, prefix)| prefix.blocks > 0)
            .filter_map(|(key, prefix)| {
                let pod = self.pods.get(&key)?;
                let serves = pod.models.is_empty() || pod.models.iter().any(|m| m == model);
                serves.then(|| (view(key, pod), prefix))
            })
            .collect()
    }

    /// The pods serving `model`, least loaded (waiting + running, then KV
    /// usage) first: the cost is the pods taken, not the fleet.
    pub fn serving_by_load<'a>(&'a self, model: &str) -> impl Iterator<Item = PodView<'a>> + 'a {
        self.least_loaded
            .serving(model)
            .filter_map(|key| self.pod_view(key))
    }

    fn pod_view(&self, key: PodKey) -> Option<PodView<'_>> {
        self.pods.get(&key).map(|pod| view(key, pod))
    }

    /// The chain as runs (pod set, blocks) in order, found by bisection.
    fn set_runs(&self, hashes: &[BlockHash]) -> Vec<(SetId, u32)> {
        let set_at = |i: usize| self.blocks.set_of(hashes[i]);
        let mut runs: Vec<(SetId, u32)> = Vec::new();
        let mut push = |set: SetId, len: usize| match runs.last_mut() {
            Some((last, n)) if *last == set => *n = n.saturating_add(len as u32),
            _ => runs.push((set, len as u32)),
        };
        // Spans [lo, hi] with their end sets known, leftmost first.
        let Some(last) = hashes.len().checked_sub(1) else {
            return runs;
        };
        let mut spans = vec![(0, set_at(0), last, set_at(last))];
        while let Some((lo, lo_set, hi, hi_set)) = spans.pop() {
            if lo_set == hi_set {
                push(lo_set, hi - lo + 1);
            } else if hi == lo + 1 {
                push(lo_set, 1);
                push(hi_set, 1);
            } else {
                let mid = lo + (hi - lo) / 2;
                // Right half first: the stack pops the left one next.
                spans.push((mid + 1, set_at(mid + 1), hi, hi_set));
                spans.push((lo, lo_set, mid, set_at(mid)));
            }
        }
        runs
    }
}
