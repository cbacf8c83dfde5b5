//! `POST /v1/lookup` cost at the indexer: decode the request, walk the
//! prompt's chain over its holders, take the least-loaded pods from the
//! index's load order, encode the candidates (numbers in
//! docs/results/…-sidecar-lookup-*/README.md and indexer/README.md):
//!
//! `cargo bench -p kvroute-indexer --bench lookup`
//!
//! An 8k-token prompt (512 blocks) against 8, 1,000 and 5,000 pods filled
//! through KV events (`LOOKUP_BENCH_BLOCKS_PER_POD` blocks each, default
//! 13,446 at 8 pods = 70 % of 19,208 and 2,000 beyond), the prompt held
//! whole by one pod and half by others: by one other pod, then by 55 % of the
//! fleet (the design spike's 551 of 1,000). Every timed lookup asserts the
//! holder leads the answer with all 512 blocks; the first also that the pods
//! added as least loaded are the least loaded of the pods that hold none
//! (checked against every pod's load).

// A benchmark, not shipped code: a failed setup should stop it loudly.
#![allow(clippy::expect_used, clippy::unwrap_used, clippy::panic)]

use std::time::Instant;

mod synthetic;
use synthetic::Rng;

use kvroute_core::hash::{root_hash, token_block_hashes, Domain};
use kvroute_indexer::index::{origin, Incoming, Index, IndexConfig, Load};
use kvroute_indexer::lookup::{lookup, parse_request, LEAST_LOADED};
use kvroute_indexer::metrics::Metrics;
use kvroute_indexer::vllm_wire::{encode_batch, BlockStored, Encoding, EventBatch, HashForm};
use kvroute_indexer::vllm_wire::{KvEvent, Medium};

const MODEL: &str = "Qwen/Qwen3-32B";
const BLOCK: usize = 16;
const PROMPT_BLOCKS: usize = 512;
const EVENT_BLOCKS: usize = 64;
const RUNS: usize = 2_000;

fn pod(i: usize) -> String {
    format!("10.{}.{}.{}:8000", i / 62_500, (i / 250) % 250, i % 250 + 1)
}

/// One BlockStored event of `tokens` (whole blocks) after `parent`.
fn event(
    pod: &str,
    seq: u64,
    vllm_hashes: Vec<u64>,
    parent: Option<u64>,
    tokens: &[u32],
) -> Incoming {
    let batch = EventBatch {
        ts: 0.0,
        events: vec![KvEvent::BlockStored(BlockStored {
            block_hashes: vllm_hashes,
            parent_block_hash: parent,
            token_ids: tokens.to_vec(),
            block_size: BLOCK as u32,
            medium: Some(Medium::Gpu),
            ..BlockStored::default()
        })],
        data_parallel_rank: Some(0),
    };
    Incoming {
        topic: format!("kv@{pod}@{MODEL}").into_bytes(),
        seq: seq.to_be_bytes().to_vec(),
        payload: encode_batch(&batch, Encoding::Map, HashForm::Uint),
        identity: None,
        received_ms: 0,
    }
}

/// `pod` stores the first `blocks` blocks of `prompt` (token ids) as a chain.
fn store_chain(
    ix: &mut Index,
    rng: &mut Rng,
    pod: &str,
    seq: &mut u64,
    prompt: &[u32],
    blocks: usize,
) {
    let mut parent = None;
    for start in (0..blocks).step_by(EVENT_BLOCKS) {
        let n = EVENT_BLOCKS.min(blocks - start);
        let hashes: Vec<u64> = (0..n).map(|_| rng.next()).collect();
        let tokens = &prompt[start * BLOCK..(start + n) * BLOCK];
        ix.handle(&event(pod, *seq, hashes.clone(), parent, tokens), 0);
        parent = hashes.last().copied();
        *seq += 1;
    }
}

/// An index of `pods` pods holding `filler` random blocks each, the prompt
/// whole on pod 0 and its first half on pods 1..=`half_holders`.
fn fleet(pods: usize, filler: usize, half_holders: usize, prompt: &[u32], rng: &mut Rng) -> Index {
    let cfg = IndexConfig {
        max_blocks_per_pod: 1 << 22,
        max_pods: pods + 1,
        feed_log_hashes: 1 << 16,
        ..IndexConfig::default()
    };
    let mut ix = Index::new(cfg, Metrics::new(), 1);
    for p in 0..pods {
        let address = pod(p);
        ix.add_pod(&address, Some(MODEL), origin::STATIC, 0);
        let load = Load {
            capacity_blocks: 19_208,
            waiting: (p % 3) as u32,
            running: (p % 7) as u32,
            kv_usage: 0.7,
        };
        ix.set_load(&address, load, 0);
        let mut seq = 0;
        let mut filled = 0;
        while filled < filler {
            let n = (filler - filled).min(1024);
            let chain = rng.tokens(n, BLOCK);
            store_chain(&mut ix, rng, &address, &mut seq, &chain, n);
            filled += n;
        }
        if p == 0 {
            store_chain(&mut ix, rng, &address, &mut seq, prompt, PROMPT_BLOCKS);
        } else if p <= half_holders {
            store_chain(&mut ix, rng, &address, &mut seq, prompt, PROMPT_BLOCKS / 2);
        }
    }
    ix
}

/// The candidates that hold nothing are the least loaded (waiting + running,
/// then KV usage) of the pods that hold nothing of the prompt (pods
/// 0..=`holders`), as a scan of every pod finds them.
fn check_least_loaded(ix: &Index, answer: &kvroute_core::lookup::LookupAnswer, holders: usize) {
    let busy = |waiting: u32, running: u32, kv: f32| (waiting + running, kv.to_bits());
    let holding: std::collections::HashSet<String> = (0..=holders).map(pod).collect();
    let mut scanned: Vec<(u32, u32)> = ix
        .debug_pods(0)
        .iter()
        .filter(|p| !holding.contains(&p.address))
        .map(|p| busy(p.waiting, p.running, p.kv_usage))
        .collect();
    scanned.sort_unstable();
    scanned.truncate(LEAST_LOADED);
    let answered: Vec<(u32, u32)> = answer
        .candidates
        .iter()
        .filter(|c| c.held.blocks == 0)
        .map(|c| busy(c.waiting, c.running, c.kv_usage))
        .collect();
    assert_eq!(answered, scanned, "the least-loaded pods that hold none");
}

fn blocks_per_pod(pods: usize) -> usize {
    std::env::var("LOOKUP_BENCH_BLOCKS_PER_POD")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(if pods <= 8 { 13_446 } else { 2_000 })
}

fn main() {
    let mut rng = Rng(0x10c0_c0de_5eed_0001);
    let prompt = rng.tokens(PROMPT_BLOCKS, BLOCK);
    let hashes = token_block_hashes(
        root_hash(Domain::Tokens, MODEL, None),
        &prompt,
        BLOCK,
        usize::MAX,
    );
    let body = serde_json::to_vec(&kvroute_indexer::lookup::request(MODEL, &hashes)).unwrap();
    println!(
        "prompt: {PROMPT_BLOCKS} blocks, request body {} bytes (JSON)",
        body.len()
    );
    for (pods, half_holders) in [(8, 1), (1_000, 1), (1_000, 550), (5_000, 1)] {
        let filler = blocks_per_pod(pods);
        let built = Instant::now();
        let ix = fleet(pods, filler, half_holders, &prompt, &mut rng);
        let build_s = built.elapsed().as_secs_f64();
        assert_eq!(
            ix.pod_blocks(),
            pods * filler + PROMPT_BLOCKS + half_holders * PROMPT_BLOCKS / 2
        );
        check_least_loaded(
            &ix,
            &lookup(&ix, &parse_request(&body).unwrap()),
            half_holders,
        );
        let mut times = Vec::with_capacity(RUNS);
        let mut answer_bytes = 0;
        let mut candidates = 0;
        for _ in 0..RUNS {
            let t = Instant::now();
            let request = parse_request(&body).unwrap();
            let answer = lookup(&ix, &request);
            let encoded = serde_json::to_vec(&answer).unwrap();
            times.push(t.elapsed().as_secs_f64() * 1e6);
            let best = &answer.candidates[0];
            assert!(best.address == pod(0) && best.held.blocks as usize == PROMPT_BLOCKS);
            let halves = answer
                .candidates
                .iter()
                .filter(|c| c.held.blocks as usize == PROMPT_BLOCKS / 2)
                .count();
            assert_eq!(
                halves,
                half_holders.min(kvroute_indexer::lookup::MAX_HOLDERS - 1)
            );
            answer_bytes = encoded.len();
            candidates = answer.candidates.len();
        }
        times.sort_by(f64::total_cmp);
        let pct = |q: f64| times[((times.len() - 1) as f64 * q) as usize];
        println!(
            "{pods:>5} pods x {filler} blocks, prompt held whole by 1 pod and half by {half_holders}: \
             lookup p50 {:.1} us, p99 {:.1} us ({RUNS} runs; {candidates} candidates, answer {answer_bytes} bytes; fill {build_s:.1} s)",
            pct(0.5),
            pct(0.99)
        );
    }
}
