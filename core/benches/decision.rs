//! Decision cost: parse + hash + index lookup + score, for chat bodies of
//! 1k, 8k and 32k tokens, at 8 and 1,000 pods of 19,208 blocks each, after an
//! hour of simulated churn (twice every pod's capacity learned, so the index
//! is full and evicting, learned entries of every age). Every timed decision
//! fully matches its prompt on one pod, with its first quarter also cached on
//! 50 other pods; the run checks the blocks matched and the pods visited, and
//! prints p50 / p99 of single decisions besides criterion's estimates, and
//! what learning a routed prompt costs.
//!
//! Run: `cargo bench -p kvroute-core --bench decision`

// A benchmark, not shipped code: a failed setup should stop it loudly.
#![allow(clippy::expect_used)]

mod common;
use common::fleet_config;
use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute_core::config::Config;
use kvroute_core::hash::{splitmix64, BlockHash};
use kvroute_core::request::parse_request;
use kvroute_core::router::{hash_prompt, Cluster, LEAST_LOADED_CANDIDATES};
use std::time::Instant;

/// ~4 bytes of English text per token: the byte fallback's 64-byte chunk ≈ 16 tokens.
const BYTES_PER_TOKEN: usize = 4;

fn text(tokens: usize, seed: usize) -> String {
    let words = [
        "route", "the", "prompt", "to", "its", "cache", "pod", "quickly",
    ];
    // The seed leads, so every prompt's chain differs from block 0.
    let mut s = format!("{seed} ");
    s.reserve(tokens * BYTES_PER_TOKEN);
    let mut i = seed;
    while s.len() < tokens * BYTES_PER_TOKEN {
        s.push_str(words[i % words.len()]);
        s.push(' ');
        i = i.wrapping_mul(31).wrapping_add(7);
    }
    s
}

fn chat_body(tokens: usize, seed: usize) -> Vec<u8> {
    let system = text(tokens.saturating_sub(64), seed);
    format!(
        r#"{{"model":"Qwen/Qwen3-32B","stream":true,"max_tokens":1000,"messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{}"}}]}}"#,
        text(64, seed + 1)
    )
    .into_bytes()
}

fn token_body(tokens: usize, seed: u32) -> Vec<u8> {
    let ids: Vec<String> = (0..tokens as u32)
        .map(|t| (t.wrapping_mul(2_654_435_761) ^ seed) % 150_000)
        .map(|t| t.to_string())
        .collect();
    format!(
        r#"{{"model":"Qwen/Qwen3-32B","max_tokens":1000,"prompt":[{}]}}"#,
        ids.join(",")
    )
    .into_bytes()
}

/// A deterministic stream of hash-like numbers (SplitMix64): filler chains.
fn splitmix(state: &mut u64) -> u64 {
    let out = splitmix64(*state);
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    out
}

/// Simulated seconds of learning before the decisions are timed.
const CHURN_SECONDS: u32 = 3600;

/// Pods that also hold the first quarter of every hot prompt.
const SHARING_PODS: usize = 50;

fn address(i: usize) -> String {
    format!("10.0.{}.{}:8000", i / 256, i % 256)
}

/// An index after an hour of churn: every second, prompts of other clients
/// are learned on random pods, twice each pod's capacity over the hour, so
/// the index fills, evicts and holds entries of every age. Then the
/// benchmarked prompts are learned on pod 3 (whole) and on the next
/// `SHARING_PODS` pods of the fleet (their first quarter).
fn populated(config: &Config, pods: usize, hot: &[Vec<u8>]) -> Cluster {
    let mut cluster = Cluster::default();
    cluster.set_configured(config, 0);
    let per_pod = 2 * config.default_capacity_blocks as usize;
    // Short chains: a busy fleet teaches every pod something nearly every
    // second, which is what fills the TTL marks.
    let chain_len = 10;
    let chains_per_second = (pods * per_pod / chain_len).div_ceil(CHURN_SECONDS as usize);
    let mut rng = 42u64;
    let mut chain = vec![BlockHash::default(); chain_len];
    for second in 0..CHURN_SECONDS {
        for _ in 0..chains_per_second {
            chain
                .iter_mut()
                .for_each(|h| *h = BlockHash::new(splitmix(&mut rng)));
            let pod = address((rng >> 8) as usize % pods);
            cluster.record_routed(&pod, 0, &chain, second);
        }
    }
    for body in hot {
        let hashed = hash_prompt(config, &parse_request(body).expect("hot"));
        cluster.record_routed(&address(3), 0, &hashed.hashes, CHURN_SECONDS);
        let quarter = &hashed.hashes[..hashed.hashes.len() / 4];
        for i in (4..pods).take(SHARING_PODS) {
            cluster.record_routed(&address(i), 0, quarter, CHURN_SECONDS);
        }
    }
    cluster
}

/// p50 and p99 of single decisions of `body`, in µs.
fn percentiles(config: &Config, cluster: &Cluster, body: &[u8]) -> (f64, f64) {
    let mut samples: Vec<f64> = (0..5000)
        .map(|_| {
            let start = Instant::now();
            let request = parse_request(black_box(body)).expect("parse");
            let hashed = hash_prompt(config, &request);
            let decision = cluster
                .decide(config, &hashed, CHURN_SECONDS, 42)
                .expect("decide");
            black_box(decision.matched_blocks);
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    (
        samples[samples.len() / 2],
        samples[samples.len() * 99 / 100],
    )
}

/// Mean cost of learning a routed 512-block prompt (an 8k-token chat body's
/// chunks) on a random pod: new prompts, then the same again (a refresh), in µs.
fn learn_cost(cluster: &mut Cluster, pods: usize) -> (f64, f64) {
    const PROMPTS: usize = 2000;
    let mut rng = 7u64;
    let prompts: Vec<(String, Vec<BlockHash>)> = (0..PROMPTS)
        .map(|_| {
            let pod = address((splitmix(&mut rng) >> 8) as usize % pods);
            let hashes = (0..512).map(|_| BlockHash::new(splitmix(&mut rng)));
            (pod, hashes.collect())
        })
        .collect();
    let time = |cluster: &mut Cluster| {
        let start = Instant::now();
        for (pod, hashes) in &prompts {
            cluster.record_routed(pod, 0, hashes, CHURN_SECONDS);
        }
        start.elapsed().as_secs_f64() * 1e6 / PROMPTS as f64
    };
    let new = time(cluster);
    (new, time(cluster))
}

fn decision(c: &mut Criterion) {
    let sizes = [1_000usize, 8_000, 32_000];
    let chats: Vec<Vec<u8>> = sizes.iter().map(|&n| chat_body(n, n)).collect();
    let tokens: Vec<Vec<u8>> = sizes.iter().map(|&n| token_body(n, n as u32)).collect();
    let hot: Vec<Vec<u8>> = chats.iter().chain(&tokens).cloned().collect();
    for pods in [8usize, 1000] {
        let config = fleet_config(pods);
        let mut cluster = populated(&config, pods, &hot);
        let stats = cluster.index().expect("the writer holds the index").stats();
        println!(
            "{pods} pods: after {CHURN_SECONDS} s of churn the index holds {} blocks in {} bytes ({:.1} B/block), {} pod sets; {} evicted, {} dropped",
            stats.blocks,
            stats.bytes,
            stats.bytes as f64 / stats.blocks as f64,
            stats.sets,
            stats.evicted,
            stats.dropped
        );
        // The benchmark must time real work: every hot prompt fully matched on
        // pod 3, visiting only the pods that hold a prefix and the least loaded.
        let sharing = SHARING_PODS.min(pods - 4);
        for body in &hot {
            let hashed = hash_prompt(&config, &parse_request(body).expect("hot"));
            let d = cluster
                .decide(&config, &hashed, CHURN_SECONDS, 42)
                .expect("decide");
            assert_eq!(d.pod, address(3), "{}", d.explain());
            assert_eq!(d.matched_blocks, d.total_blocks, "{}", d.explain());
            assert!(d.total_blocks > 0);
            assert!(
                d.candidates > sharing && d.candidates <= 1 + sharing + LEAST_LOADED_CANDIDATES,
                "{} pods visited: {}",
                d.candidates,
                d.explain()
            );
            println!(
                "  {} blocks matched; {} pods visited; {} probes, {} runs of equal pod set",
                d.matched_blocks, d.candidates, d.lookup.probes, d.lookup.runs
            );
        }
        for (kind, bodies) in [("chat_bytes", &chats), ("pretokenized", &tokens)] {
            for (&n, body) in sizes.iter().zip(bodies) {
                let (p50, p99) = percentiles(&config, &cluster, body);
                println!(
                    "  {pods} pods, {kind} {}k tokens: single decision p50 {p50:.1} µs, p99 {p99:.1} µs",
                    n / 1000
                );
            }
        }
        let mut group = c.benchmark_group(format!("decide_{pods}_pods"));
        for (kind, bodies) in [("chat_bytes", &chats), ("pretokenized", &tokens)] {
            for (&n, body) in sizes.iter().zip(bodies) {
                group.throughput(Throughput::Bytes(body.len() as u64));
                group.bench_with_input(
                    BenchmarkId::new(kind, format!("{}k_tokens", n / 1000)),
                    body,
                    |b, body| {
                        b.iter(|| {
                            let request = parse_request(black_box(body)).expect("parse");
                            let hashed = hash_prompt(&config, &request);
                            let decision = cluster
                                .decide(&config, &hashed, CHURN_SECONDS, 42)
                                .expect("decide");
                            black_box(decision.matched_blocks)
                        })
                    },
                );
            }
        }
        group.finish();
        let (new, again) = learn_cost(&mut cluster, pods);
        println!(
            "  {pods} pods: learning a routed 512-block prompt costs {new:.1} µs (new), {again:.1} µs (again)"
        );
    }
}

criterion_group!(benches, decision);
criterion_main!(benches);
