//! Interop with kvroute's own decoder (indexer/src/vllm_wire/decode.rs), which the indexer uses on real vLLM pods.

use super::*;
use kvroute_indexer::vllm_wire as core_ev;

#[test]
fn kvroute_core_decodes_what_we_publish() {
    let toks: Vec<u32> = (0..48).collect();
    let digests = crate::hash::chain(&toks, 16);
    let hashes: Vec<u64> = digests.iter().map(|h| event_hash(*h)).collect();
    let batch = encode_batch(
        1.25,
        &[
            KvEvent::stored(
                digests[1..].to_vec(),
                Some(digests[0]),
                toks[16..].to_vec(),
                16,
            ),
            KvEvent::removed(vec![digests[2]]),
            KvEvent::AllBlocksCleared,
        ],
        0,
    );
    let got = core_ev::decode_batch(&batch).unwrap().batch;
    assert_eq!(got.ts, 1.25);
    assert_eq!(got.data_parallel_rank, Some(0));
    assert_eq!(got.events.len(), 3);
    match &got.events[0] {
        core_ev::KvEvent::BlockStored(s) => {
            assert_eq!(s.block_hashes, hashes[1..].to_vec());
            assert_eq!(s.parent_block_hash, Some(hashes[0]));
            assert_eq!(s.token_ids, toks[16..].to_vec());
            assert_eq!(s.block_size, 16);
            assert_eq!(s.lora_name, None);
            assert_eq!(s.group_idx, Some(0));
        }
        other => panic!("expected BlockStored, got {other:?}"),
    }
    match &got.events[1] {
        core_ev::KvEvent::BlockRemoved(r) => assert_eq!(r.block_hashes, vec![hashes[2]]),
        other => panic!("expected BlockRemoved, got {other:?}"),
    }
    assert_eq!(got.events[2], core_ev::KvEvent::AllBlocksCleared);
    assert_eq!(core_ev::decode_seq(&7u64.to_be_bytes()).unwrap(), 7);
    let id = core_ev::parse_topic("kv@127.0.0.1:18001@Qwen/Qwen3-32B").unwrap();
    assert_eq!(
        (id.address, id.model),
        ("127.0.0.1:18001", "Qwen/Qwen3-32B")
    );
}

#[test]
fn our_block_hash_is_not_kvroutes() {
    // Consumers must re-hash token_ids; nothing may line up by accident.
    let toks: Vec<u32> = (0..64).collect();
    let ours: Vec<u64> = crate::hash::chain(&toks, 16)
        .into_iter()
        .map(crate::hash::event_hash)
        .collect();
    let root =
        kvroute_core::hash::root_hash(kvroute_core::hash::Domain::Tokens, "Qwen/Qwen3-32B", None);
    let theirs = kvroute_core::hash::token_block_hashes(root, &toks, 16, 64);
    assert_eq!(theirs.len(), ours.len());
    assert!(ours.iter().all(|h| theirs.iter().all(|t| t.get() != *h)));
}
