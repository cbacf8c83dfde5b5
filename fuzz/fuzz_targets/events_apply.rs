//! The indexer fed arbitrary vLLM event messages from a few publishers:
//! whatever the payloads, sequence numbers and replays, it never panics,
//! and every feed answer it gives then (a snapshot page by page, or a
//! delta) is one the filter's feed client takes.
//!
//! Input: records of a 4-byte header (publisher, sequence number, payload
//! length as u16 LE) and the payload. A header's high bits also say whether
//! a replay the message asks for succeeds empty or fails, and whether the
//! proxy polls the feed after it. A record whose publisher byte has its high
//! bit set is instead a stray feed request (a proxy that restarted, a
//! hostile client): its payload is the request's fields, and the answer to
//! it must still be a well-formed feed message. Otherwise, with bit 0x20 set
//! it is a remote lookup (`POST /v1/lookup`), whose answer must be one the
//! filter's lookup decoder takes (or an empty list when no pod serves the
//! model) and ranks; else, with bit 0x40 set, a learned batch a proxy posts
//! (`POST /v1/learned`). Seeds (fuzz/seeds/events_apply): the
//! golden vLLM captures of testdata/vllm-golden/frames as such records, in
//! sequence from one publisher, and interleaved from two with a gap.
#![no_main]

use kvroute_core::config::Config;
use kvroute_core::feed::{decode_learned, decode_message, encode_message, PageToken};
use kvroute_core::feed_client::{FeedClient, FeedRequest, FeedResponse};
use kvroute_core::hash::Domain;
use kvroute_core::lookup::{decide, decode_answer, InFlight, LookupError};
use kvroute_core::router::HashedPrompt;
use kvroute_indexer::index::{Incoming, Index, IndexConfig};
use kvroute_indexer::lookup::{lookup, parse_request};
use kvroute_indexer::metrics::Metrics;
use libfuzzer_sys::fuzz_target;

/// Polls the feed as the singleton does: a request when one is due, then
/// each page the client asks for; every answer must apply.
fn poll(index: &mut Index, client: &mut FeedClient, now_ms: u64) {
    let mut request = client.on_tick(now_ms);
    // A snapshot of the fuzzer's few blocks takes a page or two; the bound
    // only keeps a client that kept asking from looping.
    for _ in 0..64 {
        let Some(asked) = request else {
            return;
        };
        let body = encode_message(&index.feed(&asked));
        if let Err(fault) = client.on_response(now_ms, FeedResponse::Body(&body)) {
            panic!("the indexer's feed answer does not apply: {fault}");
        }
        request = client.follow_up(now_ms);
    }
    panic!("the feed client kept asking after 64 answers");
}

/// A feed request whose fields are cut from `bytes`; its epoch is the
/// index's when the first byte is even (else any), so that page tokens
/// reach the paging.
fn stray_request(bytes: &[u8], epoch: u64) -> FeedRequest {
    let word = |i: usize| {
        let mut w = [0u8; 8];
        let part = bytes.get(1 + 8 * i..).unwrap_or_default();
        let n = part.len().min(8);
        w[..n].copy_from_slice(&part[..n]);
        u64::from_le_bytes(w)
    };
    let page_number = (word(2) % 4) as u32;
    FeedRequest {
        epoch: if bytes.first().is_some_and(|b| b % 2 == 0) {
            epoch
        } else {
            word(0)
        },
        cursor: word(1),
        pods_version: 0,
        load_version: 0,
        page: (word(2) & 4 != 0).then(|| {
            let after = (word(2) & 8 != 0).then(|| word(4));
            (
                page_number,
                PageToken {
                    start: word(3),
                    after,
                },
            )
        }),
    }
}

/// Answers a lookup request as `POST /v1/lookup` does; the filter must take
/// the answer and rank it.
fn answer_lookup(index: &Index, body: &[u8]) {
    let Ok(request) = parse_request(body) else {
        return;
    };
    let answer = lookup(index, &request);
    let empty = answer.candidates.is_empty();
    let Ok(bytes) = serde_json::to_vec(&answer) else {
        panic!("a lookup answer does not serialize");
    };
    let prompt = HashedPrompt {
        serving_model: request.model.to_string(),
        domain: Domain::Tokens,
        hashes: request.hashes.to_vec(),
        blocks: request.hashes.len(),
    };
    match decode_answer(&bytes, prompt.blocks) {
        Ok(candidates) => {
            let ranked = decide(
                &Config::default(),
                &prompt,
                &candidates,
                &InFlight::default(),
                7,
            );
            assert!(ranked.is_ok(), "an answer the filter took does not rank");
        }
        Err(LookupError::NoCandidates) if empty => {}
        Err(e) => panic!("the filter refuses the indexer's lookup answer: {e}"),
    }
}

fuzz_target!(|data: &[u8]| {
    let config = IndexConfig {
        accept_unknown_publishers: true,
        max_pods: 4,
        max_blocks_per_pod: 4096,
        grow_on_demand: true,
        feed_log_hashes: 4096,
        feed_max_hashes: 256,
        learned_max_entries: 4096,
        replay_buffer: 64,
        ..IndexConfig::default()
    };
    let mut index = Index::new(config, Metrics::new(), 1);
    let mut client = FeedClient::new(100);
    let mut now_ms = 0;
    let mut rest = data;
    while let Some((header, tail)) = rest.split_first_chunk::<4>() {
        let len = usize::from(u16::from_le_bytes([header[2], header[3]])).min(tail.len());
        let (payload, after) = tail.split_at(len);
        rest = after;
        now_ms += 150;
        if header[0] & 0x80 != 0 {
            let request = stray_request(payload, index.epoch());
            let answer = encode_message(&index.feed(&request));
            if let Err(e) = decode_message(&answer) {
                panic!("the answer to {request:?} does not decode: {e}");
            }
            continue;
        }
        if header[0] & 0x20 != 0 {
            answer_lookup(&index, payload);
            continue;
        }
        if header[0] & 0x40 != 0 {
            if let Ok(batch) = decode_learned(payload) {
                index.apply_learned(&batch, now_ms);
            }
            continue;
        }
        let message = Incoming {
            topic: format!("kv@10.0.0.{}:8000@m", header[0] & 3).into_bytes(),
            seq: u64::from(header[1] & 0x3f).to_be_bytes().to_vec(),
            payload: payload.to_vec(),
            identity: None,
            received_ms: now_ms,
        };
        if let Some(replay) = index.handle(&message, now_ms) {
            let result = if header[1] & 0x40 == 0 {
                Ok(Vec::new())
            } else {
                Err("replay failed".to_owned())
            };
            index.finish_replay(&replay, result, now_ms);
        }
        if header[1] & 0x80 != 0 {
            poll(&mut index, &mut client, now_ms);
        }
    }
    poll(&mut index, &mut client, now_ms + 1000);
});
