//! What the indexer feed costs the proxy's VMs at 1,000 pods while the pod
//! list does not change, per operation:
//! - the singleton, at every poll (`indexer.poll_ms`, 100 ms by default): an
//!   idle answer (41 bytes) taken by the feed client, and a delta of 64
//!   block operations applied to the index (they name pods by their place in
//!   the list the client keeps; the answer repeats no list);
//!   The singleton also takes a change of every pod's load (the indexer
//!   scrapes the pods once a second) and applies it to its pods;
//! - each worker VM, per message the singleton forwards
//!   (`kvroute_core::feed_forward`): the whole list with its load (what a
//!   load change cost before the load went alone), the load alone, and the
//!   word that the feed is alive.
//!
//! Every figure is checked to be what it claims: the client keeps 1,000 pods
//! and repeats none, the delta's blocks land on the pods it names, the
//! worker holds 1,000 pods after each message, and after the load changes
//! the singleton and the worker both pick the one pod the last load left
//! with an empty queue.
//!
//! Run: `cargo bench -p kvroute-core --bench feed_steady`

// A benchmark, not shipped code: a failed setup should stop it loudly.
#![allow(clippy::expect_used)]

use kvroute_core::config::Config;
use kvroute_core::feed::{self, BlockOp, FeedKind, FeedMessage, Lists, PodInfo, PodLoad, Tier};
use kvroute_core::feed_client::{FeedClient, FeedResponse};
use kvroute_core::hash::{splitmix64, Domain, IndexKey};
use kvroute_core::router::{Cluster, HashedPrompt};
use std::collections::HashSet;
use std::hint::black_box;
use std::time::Instant;

const PODS: usize = 1000;
const ROUNDS: usize = 9;

fn fleet() -> Vec<PodInfo> {
    (0..PODS)
        .map(|i| PodInfo {
            address: format!("10.0.{}.{}:8000", i / 256, i % 256),
            models: vec!["Qwen/Qwen3-32B".to_string()],
            capacity_blocks: 19_208,
            speed: 1.0,
            waiting: (i % 7) as u32,
            running: (i % 5) as u32,
            kv_usage: 0.5,
        })
        .collect()
}

/// Every pod's load, with an empty queue on pod `idle` only.
fn loads(idle: usize) -> Vec<PodLoad> {
    (0..PODS)
        .map(|i| PodLoad {
            waiting: if i == idle { 0 } else { 5 },
            running: 3,
            kv_usage: 0.5,
        })
        .collect()
}

/// The pod `cluster` picks for a prompt no pod holds, and the queue it saw there.
fn least_loaded(cluster: &Cluster) -> (String, u32) {
    // A queue weight, so that the empty queue decides.
    let config =
        Config::from_json(br#"{"endpoints":[{"address":"configured:1"}],"weights":{"queue":1}}"#)
            .expect("the benchmark's config");
    let prompt = HashedPrompt {
        serving_model: "Qwen/Qwen3-32B".to_string(),
        domain: Domain::Tokens,
        blocks: 0,
        hashes: Vec::new(),
    };
    let decision = cluster.decide(&config, &prompt, 2, 0).expect("a pod");
    (decision.pod.clone(), decision.signals.waiting)
}

fn message(pods: &[PodInfo], kind: FeedKind, list: bool, ops: Vec<BlockOp>) -> Vec<u8> {
    feed::encode_message(&FeedMessage {
        epoch: 7,
        cursor: 50,
        pods_version: feed::pods_version(pods),
        load_version: feed::load_version(pods),
        kind,
        pods: list.then(|| pods.to_vec()),
        load: None,
        ops,
    })
}

/// Median over [`ROUNDS`] of the µs per call of `f`, `calls` calls a round.
fn per_call_us(calls: usize, mut f: impl FnMut(usize)) -> f64 {
    let mut rounds: Vec<f64> = (0..ROUNDS)
        .map(|round| {
            let start = Instant::now();
            for i in 0..calls {
                f(round * calls + i);
            }
            start.elapsed().as_secs_f64() * 1e6 / calls as f64
        })
        .collect();
    rounds.sort_by(f64::total_cmp);
    rounds[ROUNDS / 2]
}

fn main() {
    let pods = fleet();
    let delta = FeedKind::Delta { more: false };

    // The singleton: a client and an index that took the snapshot's first page.
    let mut client = FeedClient::new(100);
    client.on_tick(0);
    let first = message(
        &pods,
        FeedKind::Page {
            number: 0,
            next: None,
        },
        true,
        Vec::new(),
    );
    let update = client
        .on_response(1, FeedResponse::Body(&first))
        .expect("first page")
        .update;
    let mut writer = Cluster::default();
    writer.apply_feed(&update, 1, 0);
    assert_eq!(writer.len(), PODS);

    let idle = message(&pods, delta, false, Vec::new());
    let idle_us = per_call_us(2_000, |_| {
        let got = client
            .on_response(100, FeedResponse::Body(&idle))
            .expect("idle answer");
        assert!(got.update.pods_unchanged && got.update.pods.is_empty());
        black_box(got);
    });
    assert_eq!(client.pods().len(), PODS);

    // 64 operations of 16 blocks each, on pods spread over the list; keys
    // unique in their 40 bits, so every block is a new entry.
    let mut seen = HashSet::new();
    let mut counter = 0u64;
    let mut unique_key = || loop {
        counter += 1;
        let key = IndexKey::new(splitmix64(counter));
        if seen.insert(key) {
            return key;
        }
    };
    let deltas: Vec<Vec<u8>> = (0..ROUNDS * 200)
        .map(|n| {
            let ops = (0..64)
                .map(|k| BlockOp::Stored {
                    pod: ((n * 64 + k) * 7 % PODS) as u32,
                    tier: Tier::Gpu,
                    hashes: (0..16).map(|_| unique_key()).collect(),
                })
                .collect();
            message(&pods, delta, false, ops)
        })
        .collect();
    let held = |w: &Cluster| {
        w.index()
            .map(|i| i.stats())
            .map_or(0, |s| s.blocks as u64 + s.evicted + s.dropped)
    };
    let blocks_before = held(&writer);
    let delta_us = per_call_us(200, |n| {
        let got = client
            .on_response(100, FeedResponse::Body(&deltas[n]))
            .expect("delta");
        writer.apply_feed(&got.update, 1, 0);
    });
    // Held, or evicted by a full bucket: none dropped for naming no pod.
    let blocks_added = held(&writer) - blocks_before;
    assert_eq!(
        blocks_added,
        (ROUNDS * 200 * 64 * 16) as u64,
        "every delta's blocks landed"
    );

    // A load change: every pod's load, one pod's queue emptied per call.
    let version = feed::pods_version(&pods);
    let load_calls = ROUNDS * 200;
    let load_answers: Vec<Vec<u8>> = (0..load_calls)
        .map(|n| {
            feed::encode_message(&FeedMessage {
                epoch: 7,
                cursor: 50,
                pods_version: version,
                load_version: n as u64 + 1,
                kind: delta,
                load: Some(loads(n * 7 % PODS)),
                ..FeedMessage::default()
            })
        })
        .collect();
    let load_us = per_call_us(200, |n| {
        let got = client
            .on_response(100, FeedResponse::Body(&load_answers[n]))
            .expect("load answer");
        assert!(got.update.pods.is_empty() && got.update.load.is_some());
        writer.apply_feed(&got.update, 1, 5);
    });
    let last_idle = (load_calls - 1) * 7 % PODS;
    assert_eq!(least_loaded(&writer), (pods[last_idle].address.clone(), 0));

    // A worker VM: the forwarded list, the load alone, the word alone.
    let list = feed::encode_forward(7, 50, false, version, Lists::Pods(&pods));
    let forwarded_loads: Vec<Vec<u8>> = (0..load_calls)
        .map(|n| feed::encode_forward(7, 50, false, version, Lists::Load(&loads(n * 7 % PODS))))
        .collect();
    let word = feed::encode_forward(7, 50, false, version, Lists::None);
    let mut worker = Cluster::load_only();
    let forwarded = |bytes: &[u8], worker: &mut Cluster| {
        let update = feed::decode(bytes).expect("forwarded");
        worker.apply_feed(&update, 1, 5);
        assert_eq!(worker.len(), PODS);
    };
    forwarded(&list, &mut worker);
    let list_us = per_call_us(200, |_| forwarded(&list, &mut worker));
    let worker_load_us = per_call_us(200, |n| forwarded(&forwarded_loads[n], &mut worker));
    assert_eq!(least_loaded(&worker), (pods[last_idle].address.clone(), 0));
    let word_us = per_call_us(2_000, |_| forwarded(&word, &mut worker));

    println!(
        "feed at {PODS} pods, the list unchanged (median of {ROUNDS} rounds, µs per call, native):"
    );
    println!("| who | what | bytes | µs |");
    println!("|---|---|---:|---:|");
    println!(
        "| singleton | idle answer, taken by the feed client | {} | {idle_us:.2} |",
        idle.len()
    );
    println!(
        "| singleton | delta of 64 ops × 16 blocks, taken and applied to the index | {} | {delta_us:.1} |",
        deltas[0].len()
    );
    println!(
        "| singleton | every pod's load changed, taken by the feed client and applied | {} | {load_us:.1} |",
        load_answers[0].len()
    );
    println!(
        "| worker | forwarded pod list with load, decoded and applied | {} | {list_us:.1} |",
        list.len()
    );
    println!(
        "| worker | forwarded load alone, decoded and applied | {} | {worker_load_us:.1} |",
        forwarded_loads[0].len()
    );
    println!(
        "| worker | forwarded word that the feed is alive | {} | {word_us:.2} |",
        word.len()
    );
}
