//! `POST /v1/lookup` against an index filled through its own API: KV events
//! (precise tiers) and learned batches, as the feed would serve them.

// Test code: helpers outside #[test] functions may panic too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use kvroute_core::feed::LearnedBatch;
use kvroute_core::hash::{root_hash, token_block_hashes, BlockHash, Domain};
use kvroute_core::lookup::{Candidate, HeldPrefix};
use kvroute_indexer::index::{origin, Incoming, Index, IndexConfig, Load};
use kvroute_indexer::lookup::{lookup, parse_request, request, LEAST_LOADED, MAX_HOLDERS};
use kvroute_indexer::metrics::Metrics;
use kvroute_indexer::vllm_wire::{encode_batch, BlockStored, Encoding, EventBatch, HashForm};
use kvroute_indexer::vllm_wire::{KvEvent, Medium};

const MODEL: &str = "Qwen/Qwen3-32B";

fn pod(i: usize) -> String {
    format!("10.0.{}.{}:8000", i / 200, i % 200 + 1)
}

fn tokens(blocks: usize) -> Vec<u32> {
    (0..16 * blocks as u32).collect()
}

/// The hashes the filter computes for `tokens` (block 0 first).
fn chain(toks: &[u32]) -> Vec<BlockHash> {
    token_block_hashes(root_hash(Domain::Tokens, MODEL, None), toks, 16, usize::MAX)
}

/// `pod` stores the first `blocks` blocks of `tokens(…)` in `medium`, as one event.
fn store(ix: &mut Index, pod: &str, seq: u64, first: usize, blocks: usize, medium: Medium) {
    let toks = tokens(first + blocks);
    let event = KvEvent::BlockStored(BlockStored {
        block_hashes: (first as u64 + 1..=(first + blocks) as u64).collect(),
        parent_block_hash: (first > 0).then_some(first as u64),
        token_ids: toks[16 * first..].to_vec(),
        block_size: 16,
        medium: Some(medium),
        ..BlockStored::default()
    });
    let batch = EventBatch {
        ts: 0.0,
        events: vec![event],
        data_parallel_rank: Some(0),
    };
    let incoming = Incoming {
        topic: format!("kv@{pod}@{MODEL}").into_bytes(),
        seq: seq.to_be_bytes().to_vec(),
        payload: encode_batch(&batch, Encoding::Map, HashForm::Uint),
        identity: None,
        received_ms: 0,
    };
    ix.handle(&incoming, 0);
}

fn index(pods: usize) -> Index {
    let mut ix = Index::new(IndexConfig::default(), Metrics::new(), 7);
    for p in 0..pods {
        ix.add_pod(&pod(p), Some(MODEL), origin::STATIC, 0);
        let load = Load {
            capacity_blocks: 1000,
            waiting: 0,
            running: p as u32,
            kv_usage: 0.1,
        };
        ix.set_load(&pod(p), load, 0);
    }
    ix
}

fn by_address(candidates: &[Candidate], address: &str) -> Option<HeldPrefix> {
    candidates
        .iter()
        .find(|c| c.address == address)
        .map(|c| c.held)
}

#[test]
fn holders_come_first_with_the_prefix_each_holds_by_tier() {
    let mut ix = index(8);
    let hashes = chain(&tokens(12));
    store(&mut ix, &pod(5), 0, 0, 12, Medium::Gpu);
    store(&mut ix, &pod(6), 0, 0, 4, Medium::Gpu);
    store(&mut ix, &pod(6), 1, 4, 4, Medium::Cpu);
    ix.apply_learned(
        &LearnedBatch {
            entries: vec![(pod(7), hashes[..3].to_vec())],
        },
        0,
    );
    let answer = lookup(&ix, &request(MODEL, &hashes));
    let addresses: Vec<&str> = answer
        .candidates
        .iter()
        .map(|c| c.address.as_str())
        .collect();
    // Holders by prefix length, then the least-loaded pods that hold none.
    assert_eq!(
        addresses[..3],
        [pod(5).as_str(), pod(6).as_str(), pod(7).as_str()]
    );
    assert_eq!(addresses[3..], [pod(0), pod(1), pod(2), pod(3)]);
    assert_eq!(answer.candidates.len(), 3 + LEAST_LOADED);
    let full = HeldPrefix {
        gpu_blocks: 12,
        cpu_blocks: 12,
        blocks: 12,
    };
    assert_eq!(by_address(&answer.candidates, &pod(5)), Some(full));
    let split = HeldPrefix {
        gpu_blocks: 4,
        cpu_blocks: 8,
        blocks: 8,
    };
    assert_eq!(by_address(&answer.candidates, &pod(6)), Some(split));
    assert_eq!(
        by_address(&answer.candidates, &pod(7)).unwrap().gpu_blocks,
        3
    );
    let reported = &answer.candidates[0];
    assert_eq!(
        (
            reported.running,
            reported.capacity_blocks,
            reported.kv_usage
        ),
        (5, 1000, 0.1)
    );
}

#[test]
fn only_pods_serving_the_model_and_at_most_the_documented_bound() {
    let mut ix = index(60);
    let hashes = chain(&tokens(4));
    for p in 0..50 {
        store(&mut ix, &pod(p), 0, 0, 1 + p % 4, Medium::Gpu);
    }
    ix.add_pod("10.9.9.9:8000", Some("other-model"), origin::STATIC, 0);
    store(&mut ix, "10.9.9.9:8000", 0, 0, 4, Medium::Gpu);
    let answer = lookup(&ix, &request(MODEL, &hashes));
    assert_eq!(answer.candidates.len(), MAX_HOLDERS + LEAST_LOADED);
    assert!(answer
        .candidates
        .iter()
        .all(|c| c.address != "10.9.9.9:8000"));
    // The 12 pods holding all 4 blocks and the 12 holding 3 lead.
    let lengths: Vec<u32> = answer.candidates[..24]
        .iter()
        .map(|c| c.held.blocks)
        .collect();
    assert_eq!(lengths, [[4; 12], [3; 12]].concat());
    let others = &answer.candidates[MAX_HOLDERS..];
    assert!(others.iter().all(|c| c.held.blocks == 0));
    assert_eq!(
        others.iter().map(|c| c.running).collect::<Vec<_>>(),
        [50, 51, 52, 53]
    );
    let other_model = lookup(&ix, &request("other-model", &chain(&tokens(4))));
    assert_eq!(other_model.candidates.len(), 1);
    assert_eq!(
        other_model.candidates[0].held.blocks, 0,
        "chains are scoped by model"
    );
}

/// Addresses of the candidates that hold nothing, in answer order.
fn least_loaded(ix: &Index, model: &str) -> Vec<String> {
    lookup(ix, &request(model, &chain(&tokens(2))))
        .candidates
        .into_iter()
        .filter(|c| c.held.blocks == 0)
        .map(|c| c.address)
        .collect()
}

#[test]
fn the_least_loaded_follow_load_changes_models_and_departures() {
    // index(): pod p runs p requests, so the order is the pods' order.
    let mut ix = index(8);
    assert_eq!(least_loaded(&ix, MODEL), [pod(0), pod(1), pod(2), pod(3)]);
    // A pod that gets busy moves back; one that idles moves forward;
    // KV usage breaks a tie of requests.
    let set = |ix: &mut Index, p: usize, running: u32, kv_usage: f32| {
        let load = Load {
            capacity_blocks: 1000,
            waiting: 0,
            running,
            kv_usage,
        };
        ix.set_load(&pod(p), load, 0);
    };
    set(&mut ix, 0, 100, 0.1);
    set(&mut ix, 7, 1, 0.05);
    assert_eq!(least_loaded(&ix, MODEL), [pod(7), pod(1), pod(2), pod(3)]);
    // A holder is not listed again as least loaded.
    store(&mut ix, &pod(7), 0, 0, 2, Medium::Gpu);
    assert_eq!(least_loaded(&ix, MODEL), [pod(1), pod(2), pod(3), pod(4)]);
    // A pod that names no model serves every model; one that leaves goes.
    ix.add_pod("10.9.9.9:8000", None, origin::STATIC, 0);
    assert_eq!(
        least_loaded(&ix, MODEL),
        ["10.9.9.9:8000".to_string(), pod(1), pod(2), pod(3)]
    );
    assert_eq!(least_loaded(&ix, "another-model"), ["10.9.9.9:8000"]);
    ix.remove_origin(&pod(1), origin::STATIC);
    ix.remove_origin("10.9.9.9:8000", origin::STATIC);
    assert_eq!(least_loaded(&ix, MODEL), [pod(2), pod(3), pod(4), pod(5)]);
    // A pod that starts serving a model joins that model's order.
    ix.add_pod(&pod(6), Some("another-model"), origin::DNS, 0);
    assert_eq!(least_loaded(&ix, "another-model"), [pod(6)]);
}

#[test]
fn candidates_carry_the_speed_their_source_states() {
    let mut ix = index(3);
    ix.set_speed(&pod(1), 2.5);
    store(&mut ix, &pod(2), 0, 0, 4, Medium::Gpu);
    ix.set_speed(&pod(2), 0.5);
    let hashes = chain(&tokens(4));
    let answer = lookup(&ix, &request(MODEL, &hashes));
    let speed = |address: &str| {
        answer
            .candidates
            .iter()
            .find(|c| c.address == address)
            .map(|c| c.speed)
    };
    assert_eq!(
        (speed(&pod(0)), speed(&pod(1)), speed(&pod(2))),
        (Some(None), Some(Some(2.5)), Some(Some(0.5)))
    );
    // JSON names the speed only where it is stated.
    let json = serde_json::to_string(&answer).unwrap();
    assert_eq!(json.matches("\"speed\"").count(), 2, "{json}");
}

#[test]
fn nothing_held_and_nothing_serving() {
    let ix = index(2);
    let answer = lookup(&ix, &request(MODEL, &chain(&tokens(4))));
    assert!(answer.candidates.iter().all(|c| c.held.blocks == 0));
    assert_eq!(answer.candidates.len(), 2);
    assert!(lookup(&ix, &request("nobody", &chain(&tokens(2))))
        .candidates
        .is_empty());
}

#[test]
fn bad_requests_say_what_is_wrong() {
    for (body, says) in [
        (&b"not json"[..], "bad lookup request"),
        (br#"{"model":"","hashes":[1]}"#, "model is empty"),
        (br#"{"model":"m","hashes":[-1]}"#, "bad lookup request"),
        (br#"{"model":"m"}"#, "missing field `hashes`"),
    ] {
        let e = parse_request(body).unwrap_err();
        assert!(e.contains(says), "{e}");
    }
    let too_many = format!(
        r#"{{"model":"m","hashes":[{}]}}"#,
        vec!["1"; 65_537].join(",")
    );
    assert!(parse_request(too_many.as_bytes())
        .unwrap_err()
        .contains("65537 hashes"));
    // Unknown fields are ignored: proxies and indexers of other versions interoperate.
    assert!(parse_request(br#"{"model":"m","hashes":[],"x":1}"#).is_ok());
    let ok = parse_request(br#"{"model":"m","hashes":[18446744073709551615]}"#).unwrap();
    assert_eq!(ok.hashes.as_ref(), &[BlockHash::new(u64::MAX)]);
}
