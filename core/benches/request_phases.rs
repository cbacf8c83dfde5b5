//! Where a routed request's CPU goes in the filter, phase by phase: the
//! request body parsed (chat messages rendered for the byte fallback), the
//! tokenizer call's body, the tokenizer's answer parsed, the prompt hashed,
//! and the lookup and scoring, for 30 KB and 128 KB chat bodies (the scale
//! benchmark's sizes) and 8k / 32k-token answers. Native figures: the filter
//! runs them in wasm, a few times slower. Each phase's result is checked
//! (rendered bytes, ids read, blocks hashed and matched).
//!
//! Run: `cargo bench -p kvroute-core --bench request_phases`

// A benchmark, not shipped code: a failed setup should stop it loudly.
#![allow(clippy::expect_used, clippy::panic)]

mod common;
use common::fleet_config;
use kvroute_core::request::{
    parse_request, parse_tokenize_response, tokenize_call_body, Prompt, PromptRequest,
};
use kvroute_core::router::{hash_prompt, Cluster};
use std::hint::black_box;
use std::time::Instant;

/// A chat body of about `size` bytes shaped as the scale benchmark's: a long
/// system prompt of short words and a question.
fn chat_body(size: usize) -> Vec<u8> {
    let mut filler = String::from("variant 0: ");
    let mut i = 0usize;
    while filler.len() < size.saturating_sub(200) {
        filler.push_str(&format!("w{} ", (i * 131) % 9973));
        i += 1;
    }
    format!(
        r#"{{"model":"Qwen/Qwen3-32B","max_tokens":1,"messages":[{{"role":"system","content":"{filler}"}},{{"role":"user","content":"question 0"}}]}}"#
    )
    .into_bytes()
}

/// A vLLM `/tokenize` answer of `tokens` ids of a 150k vocabulary.
fn tokenize_answer(tokens: usize) -> Vec<u8> {
    let ids: Vec<String> = (0..tokens as u32)
        .map(|t| (t.wrapping_mul(2_654_435_761) % 150_000).to_string())
        .collect();
    format!(
        r#"{{"count":{tokens},"max_model_len":40960,"tokens":[{}],"token_strs":null}}"#,
        ids.join(",")
    )
    .into_bytes()
}

/// p50 and p99 of `f` over enough runs for a stable median, in µs.
fn time<T>(mut f: impl FnMut() -> T) -> (f64, f64) {
    for _ in 0..20 {
        black_box(f());
    }
    let mut samples: Vec<f64> = (0..2000)
        .map(|_| {
            let start = Instant::now();
            black_box(f());
            start.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    samples.sort_by(f64::total_cmp);
    (
        samples[samples.len() / 2],
        samples[samples.len() * 99 / 100],
    )
}

fn report(phase: &str, (p50, p99): (f64, f64)) {
    println!("  {phase:<44} p50 {p50:>8.1} µs   p99 {p99:>8.1} µs");
}

fn main() {
    const PODS: usize = 1000;
    let config = fleet_config(PODS);
    let mut cluster = Cluster::default();
    cluster.set_configured(&config, 0);
    for (kb, tokens) in [(30usize, 8_000usize), (128, 32_000)] {
        let body = chat_body(kb * 1024);
        let answer = tokenize_answer(tokens);
        println!(
            "{kb} KB chat body ({} bytes), {tokens}-token answer ({} bytes):",
            body.len(),
            answer.len()
        );

        let request = parse_request(&body).expect("parse");
        let Prompt::Text(text) = &request.prompt else {
            panic!("a chat body renders to text")
        };
        assert!(text.len() > body.len() - 300, "rendered {}", text.len());
        report("parse + render messages", time(|| parse_request(&body)));

        let call = tokenize_call_body(&body).expect("call body");
        assert!(call.len() > body.len() - 100);
        report("tokenizer call body", time(|| tokenize_call_body(&body)));

        let ids = parse_tokenize_response(&answer).expect("answer");
        assert_eq!(ids.len(), tokens);
        report(
            "tokenizer answer parsed",
            time(|| parse_tokenize_response(&answer)),
        );

        let bytes = hash_prompt(&config, &request);
        assert_eq!(
            bytes.hashes.len(),
            (text.len() / config.chunk_bytes).min(config.max_blocks)
        );
        report(
            "hash rendered bytes (approximate)",
            time(|| hash_prompt(&config, &request)),
        );

        let tokenized = PromptRequest {
            prompt: Prompt::Tokens(ids),
            ..request.clone()
        };
        let blocks = hash_prompt(&config, &tokenized);
        assert_eq!(blocks.hashes.len(), tokens / config.block_size);
        report(
            "hash token blocks (precise)",
            time(|| hash_prompt(&config, &tokenized)),
        );

        // Both prompts cached on one pod of 1,000: the lookup walks every block.
        let pod = "10.0.0.3:8000";
        for hashed in [&bytes, &blocks] {
            cluster.record_routed(pod, 0, &hashed.hashes, 1);
            let d = cluster.decide(&config, hashed, 1, 42).expect("decide");
            assert_eq!((d.pod.as_str(), d.matched_blocks), (pod, d.total_blocks));
        }
        report(
            &format!("lookup + score, {PODS} pods, bytes"),
            time(|| cluster.decide(&config, &bytes, 1, 42)),
        );
        report(
            &format!("lookup + score, {PODS} pods, tokens"),
            time(|| cluster.decide(&config, &blocks, 1, 42)),
        );
    }
}
