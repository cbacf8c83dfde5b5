//! What each pod holds of one prompt's chain: the read side of
//! `POST /v1/lookup` (see `crate::lookup`).

use kvroute_core::feed::Tier;
use kvroute_core::lookup::HeldPrefix;

use super::hashing::Map;
use super::{Index, Load};

impl Index {
    /// Calls `visit` with the address, load and held prefix of `hashes` (what
    /// the feed would serve: precise tiers and learned entries) of every pod
    /// serving `model`; a pod that names no model serves every model.
    ///
    /// Walks the chain once through the block map: the pods holding block i
    /// are among those holding block i − 1, so the walk stops at the first
    /// block nobody still walking holds, and its cost is the holders of the
    /// matched blocks, not the number of pods.
    pub fn visit_held_prefixes<'a>(
        &'a self,
        model: &str,
        hashes: &[u64],
        mut visit: impl FnMut(&'a str, &'a Load, HeldPrefix),
    ) {
        let mut walking: Map<HeldPrefix> = Map::default();
        let mut held: Map<HeldPrefix> = Map::default();
        for (i, &hash) in hashes.iter().enumerate() {
            let tiers: Map<Tier> = self.blocks.holders(hash).collect();
            if i == 0 {
                walking.extend(tiers.keys().map(|&pod| (pod, HeldPrefix::default())));
            }
            walking.retain(|pod, prefix| {
                let extended = prefix.extend(tiers.get(pod).copied());
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
        for (key, pod) in &self.pods {
            if pod.models.is_empty() || pod.models.iter().any(|m| m == model) {
                visit(
                    &pod.address,
                    &pod.load,
                    held.get(key).copied().unwrap_or_default(),
                );
            }
        }
    }
}
