//! The indexer fed arbitrary vLLM event messages from a few publishers:
//! whatever the payloads, sequence numbers and replays, it never panics,
//! and every feed answer it gives then (a snapshot page by page, or a
//! delta) is one the filter's feed client takes.
//!
//! Input: records of a 4-byte header (publisher, sequence number, payload
//! length as u16 LE) and the payload. A header's high bits also say whether
//! a replay the message asks for succeeds empty or fails, and whether the
//! proxy polls the feed after it. Seeds (fuzz/seeds/events_apply): the
//! golden vLLM captures of testdata/vllm-golden/frames as such records, in
//! sequence from one publisher, and interleaved from two with a gap.
#![no_main]

use kvroute_core::feed::encode_message;
use kvroute_core::feed_client::{FeedClient, FeedResponse};
use kvroute_indexer::index::{Incoming, Index, IndexConfig};
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
