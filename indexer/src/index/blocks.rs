//! The block → pod map: per pod, each kvroute hash's reference counts by
//! tier; a change of a hash's best tier on a pod becomes a feed op.

use std::collections::hash_map::Entry;

use kvroute_core::feed::Tier;

use super::feed_log::Sink;
use super::hashing::Map;

/// Per-tier reference counts of one kvroute hash on one pod.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct TierCounts([u16; 4]);

impl TierCounts {
    pub(super) fn best(&self) -> Option<Tier> {
        const TIERS: [Tier; 4] = [Tier::Gpu, Tier::Cpu, Tier::Disk, Tier::Learned];
        self.0.iter().position(|&c| c > 0).map(|i| TIERS[i])
    }
}

pub(super) fn tier_bit(t: Tier) -> u8 {
    1 << t.code()
}

/// Adds (`up`) or drops one count of `tier` for every kvroute hash of a block.
#[allow(clippy::too_many_arguments)]
pub(super) fn adjust_block(
    blocks: &mut Map<TierCounts>,
    sink: &mut Sink,
    pod: u64,
    kv: u64,
    head: Option<&[u64]>,
    tier: Tier,
    up: bool,
) {
    for &part in head.unwrap_or_default() {
        adjust(blocks, sink, pod, part, tier, up);
    }
    adjust(blocks, sink, pod, kv, tier, up);
}

/// Adds `delta` (±1) to `tier` of `kv` on a pod, emitting an op when the
/// best tier of the hash changes.
pub(super) fn adjust(
    blocks: &mut Map<TierCounts>,
    sink: &mut Sink,
    pod: u64,
    kv: u64,
    tier: Tier,
    up: bool,
) {
    let i = tier.code() as usize;
    match blocks.entry(kv) {
        Entry::Occupied(mut e) => {
            let before = e.get().best();
            let c = &mut e.get_mut().0[i];
            *c = if up {
                c.saturating_add(1)
            } else {
                c.saturating_sub(1)
            };
            let after = e.get().best();
            if after.is_none() {
                e.remove();
            }
            if before != after {
                match after {
                    Some(t) => sink.stored(pod, t, kv),
                    None => sink.removed(pod, kv),
                }
            }
        }
        Entry::Vacant(e) => {
            if up {
                let mut c = TierCounts::default();
                c.0[i] = 1;
                e.insert(c);
                sink.stored(pod, tier, kv);
            }
        }
    }
}
