//! The lookup: every pod's longest cached prefix of a prompt, found by
//! walking the prompt's chain once (see the index module's documentation).

use super::bucket::key_of;
use super::member::{is_precise, Clock, Member, PodId, PodState};
use crate::feed::Tier;
use crate::hash::IndexKey;

/// What a lookup may trust.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MatchRules {
    /// False while the indexer feed is stale: precise entries are then ignored.
    pub trust_precise: bool,
    /// Credit of a CPU-tier block relative to GPU.
    pub cpu_credit: f64,
    /// Credit of a disk-tier block relative to GPU.
    pub disk_credit: f64,
}

/// One pod's longest cached prefix of a prompt.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PodMatch {
    pub pod: PodId,
    /// Leading blocks held in any trusted tier.
    pub blocks: usize,
    /// Those blocks weighted by tier credit (== `blocks` when all are GPU or learned).
    pub credit: f64,
    /// Leading blocks the pod was taught (learned) in the current epoch:
    /// teaching them again would change nothing (same pod set, same age),
    /// so a routed prompt need not send them to the writer.
    pub taught_this_epoch: usize,
}

/// What one lookup did, for benchmarks and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct LookupCost {
    /// Blocks probed (slot searches).
    pub probes: usize,
    /// Runs of equal pod set found along the chain.
    pub runs: usize,
}

/// Where a lookup reads the index: the writer's own buckets, or the copy
/// the singleton publishes in shared data ([`super::published`]). One lookup
/// ([`match_lengths`]) runs over either.
pub trait IndexSource {
    /// The set reference of the slot holding `key`, if the block is indexed.
    fn set_of(&self, key: u64) -> Option<u32>;
    /// The members of set `id`, sorted by pod (empty when unknown).
    fn members(&self, id: u32) -> std::borrow::Cow<'_, [Member]>;
    /// The generations of `pod`; `None` for a pod the index does not know.
    fn pod_state(&self, pod: PodId) -> Option<PodState>;
    fn clock(&self) -> Clock;
}

/// Every pod's longest cached prefix of `hashes` (pods with none left out,
/// in pod order) into `out`, and what the lookup cost, read from `source`.
pub fn match_lengths<S: IndexSource + ?Sized, K: Copy + Into<IndexKey>>(
    source: &S,
    hashes: &[K],
    now_s: u32,
    rules: &MatchRules,
    out: &mut Vec<PodMatch>,
) -> LookupCost {
    out.clear();
    let mut cost = LookupCost::default();
    let n = hashes.len();
    if n == 0 {
        return cost;
    }
    let mut probe = |i: usize| {
        cost.probes += 1;
        source.set_of(key_of(hashes[i].into()))
    };
    let first = probe(0);
    if first.is_none() {
        return cost;
    }
    let last = probe(n - 1);
    // Runs of blocks with one set, as (last block of the run, its set):
    // bisect only where the sets at two probes differ.
    let mut runs: Vec<(usize, Option<u32>)> = Vec::new();
    let mut pending = vec![(0usize, first, n - 1, last)];
    while let Some((lo, s_lo, hi, s_hi)) = pending.pop() {
        if s_lo == s_hi {
            continue;
        }
        if hi - lo == 1 {
            runs.push((lo, s_lo));
            continue;
        }
        let mid = lo + (hi - lo) / 2;
        let s_mid = probe(mid);
        pending.push((mid, s_mid, hi, s_hi));
        pending.push((lo, s_lo, mid, s_mid));
    }
    runs.push((n - 1, last));
    runs.sort_unstable_by_key(|&(end, _)| end);
    cost.runs = runs.len();

    let clock = source.clock();
    let epoch = clock.epoch(now_s);
    let usable = |m: &Member| {
        clock.is_current(source.pod_state(m.pod()), *m, epoch)
            && (rules.trust_precise || !is_precise(m.tier()))
    };
    let credit_of = |tier: Tier| match tier {
        Tier::Gpu | Tier::Learned => 1.0,
        Tier::Cpu => rules.cpu_credit,
        Tier::Disk => rules.disk_credit,
    };
    let taught_now = |m: &Member| m.tier() == Tier::Learned && m.epoch() == epoch;
    // Pods still matching at the current run, in pod order.
    let mut active: Vec<PodMatch> = Vec::new();
    let mut next: Vec<PodMatch> = Vec::new();
    let mut start = 0;
    for (k, &(end, set)) in runs.iter().enumerate() {
        let len = (end + 1 - start) as f64;
        let set_members = set.map(|id| source.members(id));
        let mut members = set_members
            .as_deref()
            .unwrap_or(&[])
            .iter()
            .filter(|m| usable(m))
            .peekable();
        if k == 0 {
            next.extend(members.map(|m| PodMatch {
                pod: m.pod(),
                blocks: end + 1,
                credit: len * credit_of(m.tier()),
                taught_this_epoch: if taught_now(m) { end + 1 } else { 0 },
            }));
        } else {
            for matched in active.drain(..) {
                while members.next_if(|m| m.pod() < matched.pod).is_some() {}
                match members.peek() {
                    Some(m) if m.pod() == matched.pod => next.push(PodMatch {
                        blocks: end + 1,
                        credit: matched.credit + len * credit_of(m.tier()),
                        taught_this_epoch: if matched.taught_this_epoch == start && taught_now(m) {
                            end + 1
                        } else {
                            matched.taught_this_epoch
                        },
                        ..matched
                    }),
                    _ => out.push(matched),
                }
            }
        }
        std::mem::swap(&mut active, &mut next);
        next.clear();
        start = end + 1;
        if active.is_empty() {
            break;
        }
    }
    out.extend(active);
    out.sort_unstable_by_key(|m| m.pod);
    cost
}
