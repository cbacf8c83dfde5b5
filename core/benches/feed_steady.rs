//! What the indexer feed costs the proxy's VMs at 1,000 pods while the pod
//! list does not change, per operation:
//! - the singleton, at every poll (`indexer.poll_ms`, 100 ms by default): an
//!   idle answer (41 bytes) taken by the feed client, and a delta of 64
//!   block operations applied to the index (they name pods by their place in
//!   the list the client keeps; the answer repeats no list);
//! - each worker VM, per message the singleton forwards
//!   (`kvroute_core::feed_forward`): the whole list with its load, and the
//!   word that the feed is alive.
//!
//! Every figure is checked to be what it claims: the client keeps 1,000 pods
//! and repeats none, the delta's blocks land on the pods it names, the
//! worker holds 1,000 pods after each message.
//!
//! Run: `cargo bench -p kvroute-core --bench feed_steady`

// A benchmark, not shipped code: a failed setup should stop it loudly.
#![allow(clippy::expect_used)]

use kvroute_core::feed::{self, BlockOp, FeedKind, FeedMessage, PodInfo, Tier};
use kvroute_core::feed_client::{FeedClient, FeedResponse};
use kvroute_core::hash::{splitmix64, IndexKey};
use kvroute_core::router::Cluster;
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

    // A worker VM: the forwarded list, then the word alone.
    let list = feed::encode_pods(7, 50, false, Some(&pods));
    let word = feed::encode_pods(7, 50, false, None);
    let mut worker = Cluster::load_only();
    let forwarded = |bytes: &[u8], worker: &mut Cluster| {
        let update = feed::decode(bytes).expect("forwarded");
        worker.apply_feed(&update, 1, 5);
        assert_eq!(worker.len(), PODS);
    };
    forwarded(&list, &mut worker);
    let list_us = per_call_us(200, |_| forwarded(&list, &mut worker));
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
        "| worker | forwarded pod list with load, decoded and applied | {} | {list_us:.1} |",
        list.len()
    );
    println!(
        "| worker | forwarded word that the feed is alive | {} | {word_us:.2} |",
        word.len()
    );
}
