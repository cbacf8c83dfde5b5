//! Decision cost: parse + hash + longest-prefix lookup + score, for chat
//! bodies of 1k, 8k and 32k tokens, against an index holding 150k blocks over
//! 8 pods (the 73-capacity working set: 150 groups × ~1,000 blocks).
//!
//! Run: `cargo bench -p kvroute-core --bench decision`

// A benchmark, not shipped code: a failed setup should stop it loudly.
#![allow(clippy::expect_used)]

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use kvroute_core::config::Config;
use kvroute_core::request::parse_request;
use kvroute_core::router::{hash_prompt, Cluster};

const PODS: usize = 8;
const INDEX_BLOCKS: usize = 150_000;
/// ~4 bytes of English text per token: the byte fallback's 64-byte chunk ≈ 16 tokens.
const BYTES_PER_TOKEN: usize = 4;

fn config() -> Config {
    let endpoints: Vec<String> = (0..PODS)
        .map(|i| format!(r#"{{"address":"10.0.0.{i}:8000"}}"#))
        .collect();
    let json = format!(
        r#"{{"default_capacity_blocks":19208,"max_blocks":4096,"endpoints":[{}]}}"#,
        endpoints.join(",")
    );
    Config::from_json(json.as_bytes()).expect("bench config")
}

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

/// Fills the index to INDEX_BLOCKS with other prompts' chains, then stores
/// the benchmarked prompts on pod 3 so their lookups find a full match.
fn populated(config: &Config, hot: &[Vec<u8>]) -> Cluster {
    let mut cluster = Cluster::default();
    cluster.set_configured(config, 0);
    let mut stored = 0;
    let mut seed = 1000;
    while stored < INDEX_BLOCKS {
        let hashed = hash_prompt(
            config,
            &parse_request(&chat_body(4000, seed)).expect("filler"),
        );
        let pod = format!("10.0.0.{}:8000", seed % PODS);
        cluster.record_routed(&pod, 0, &hashed.hashes, 0);
        stored += hashed.hashes.len();
        seed += 1;
    }
    for body in hot {
        let hashed = hash_prompt(config, &parse_request(body).expect("hot"));
        cluster.record_routed("10.0.0.3:8000", 0, &hashed.hashes, 0);
    }
    cluster
}

fn decision(c: &mut Criterion) {
    let config = config();
    let sizes = [1_000usize, 8_000, 32_000];
    let chats: Vec<Vec<u8>> = sizes.iter().map(|&n| chat_body(n, n)).collect();
    let tokens: Vec<Vec<u8>> = sizes.iter().map(|&n| token_body(n, n as u32)).collect();
    let hot: Vec<Vec<u8>> = chats.iter().chain(&tokens).cloned().collect();
    let cluster = populated(&config, &hot);
    let (blocks, bytes) = cluster.index_size();
    println!("index: {blocks} blocks over {PODS} pods, {bytes} bytes of tables ({:.1} B/block at this fill)", bytes as f64 / blocks as f64);

    let mut group = c.benchmark_group("decide");
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
                        let decision = cluster.decide(&config, &hashed, 0, 42).expect("decide");
                        black_box(decision.matched_blocks)
                    })
                },
            );
        }
    }
    group.finish();
}

criterion_group!(benches, decision);
criterion_main!(benches);
