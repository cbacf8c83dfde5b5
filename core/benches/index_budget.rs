//! What the index keeps under its byte budget: the issue-10 fleet (1,000 pods
//! × 19,208 blocks at 70 %, as 32-block chains, no block shared: the worst
//! case for an inverted index) reported precisely, at the default budget and
//! at smaller ones. Prints, per budget, the bytes held, the share of
//! (block, pod) entries still routable (a sample of chains looked up, matched
//! length over chain length), and false matches (chains nobody holds that
//! match anything).
//!
//! Run: `cargo bench -p kvroute-core --bench index_budget`

// A benchmark, not shipped code: a failed setup should stop it loudly.
#![allow(clippy::expect_used)]

use kvroute_core::config::DEFAULT_INDEX_BUDGET_BYTES;
use kvroute_core::hash::{splitmix64, BlockHash};
use kvroute_core::index::{BlockIndex, MatchRules, PodId, PodMatch, Tier};
use std::time::Instant;

const PODS: usize = 1000;
const CHAIN: usize = 32;
/// 70 % of 19,208 blocks, in whole chains.
const CHAINS_PER_POD: usize = 19_208 * 7 / 10 / CHAIN;
const SAMPLES: usize = 20_000;

/// Chain `c` of pod `p` (or of nobody, for `p` ≥ PODS).
fn chain(p: usize, c: usize) -> Vec<BlockHash> {
    let seed = splitmix64(((p as u64) << 32) | c as u64);
    (0..CHAIN as u64)
        .map(|i| BlockHash::new(splitmix64(seed ^ i)))
        .collect()
}

fn main() {
    let rules = MatchRules {
        trust_precise: true,
        cpu_credit: 0.5,
        disk_credit: 0.25,
    };
    for budget in [
        DEFAULT_INDEX_BUDGET_BYTES,
        DEFAULT_INDEX_BUDGET_BYTES / 2,
        DEFAULT_INDEX_BUDGET_BYTES / 4,
    ] {
        let mut index = BlockIndex::new(budget, 600);
        let pods: Vec<PodId> = (0..PODS)
            .map(|_| index.add_pod().expect("pod id"))
            .collect();
        let start = Instant::now();
        // Chains arrive interleaved across pods, as a fleet fills.
        for c in 0..CHAINS_PER_POD {
            for (p, &pod) in pods.iter().enumerate() {
                index.touch_chain(pod, &chain(p, c), Tier::Gpu, 0);
            }
        }
        let fill_s = start.elapsed().as_secs_f64();
        let entries = PODS * CHAINS_PER_POD * CHAIN;
        let stats = index.stats();
        assert!(stats.bytes <= budget, "{stats:?}");
        let mut out: Vec<PodMatch> = Vec::new();
        let (mut matched, mut whole) = (0usize, 0usize);
        for s in 0..SAMPLES {
            let p = splitmix64(s as u64) as usize % PODS;
            let c = splitmix64(!(s as u64)) as usize % CHAINS_PER_POD;
            index.match_lengths(&chain(p, c), 1, &rules, &mut out);
            let blocks = out
                .iter()
                .find(|m| m.pod == pods[p])
                .map_or(0, |m| m.blocks);
            matched += blocks;
            whole += usize::from(blocks == CHAIN);
        }
        let false_matches = (0..SAMPLES)
            .filter(|&s| {
                index.match_lengths(&chain(PODS + s, 0), 1, &rules, &mut out);
                !out.is_empty()
            })
            .count();
        println!(
            "budget {} MiB: {entries} entries offered in {fill_s:.1} s; held {} blocks in {} bytes ({:.1} B/block), {} evicted; routable {:.2} % of sampled blocks, {:.2} % of chains whole; false matches {false_matches}/{SAMPLES}",
            budget >> 20,
            stats.blocks,
            stats.bytes,
            stats.bytes as f64 / stats.blocks as f64,
            stats.evicted,
            100.0 * matched as f64 / (SAMPLES * CHAIN) as f64,
            100.0 * whole as f64 / SAMPLES as f64,
        );
    }
}
