//! vLLM KV-event payloads and sequence frames: the decoder must return, never
//! panic, and be deterministic.
#![no_main]

use kvroute_indexer::vllm_wire::{decode_batch, decode_seq, fold_hash_bytes, parse_topic};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // Debug text, not ==: a NaN timestamp is a valid decode and NaN != NaN.
    let first = format!("{:?}", decode_batch(data));
    assert_eq!(first, format!("{:?}", decode_batch(data)));
    let _ = decode_seq(data);
    let _ = fold_hash_bytes(data);
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = parse_topic(s);
    }
});
