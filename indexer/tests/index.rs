//! The index driven directly: sequence tracking, restarts, replay, tiers,
//! learned entries, the delta log against snapshots, bounds.

// Test code: helpers outside #[test] functions may panic too.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::collections::HashMap;

use kvroute_core::feed::{self, BlockOp, FeedKind, FeedMessage, FeedUpdate, LearnedBatch, Tier};
use kvroute_core::feed_client::{FeedClient, FeedRequest, FeedResponse, Received};
use kvroute_core::hash::{
    extra_keys_digest, keyed_token_block_hashes, root_hash, salt_digest, token_block_hashes,
    BlockHash, Domain, ExtraKey, IndexKey,
};
use kvroute_indexer::index::{origin, Incoming, Index, IndexConfig, Load};
use kvroute_indexer::metrics::Metrics;
use kvroute_indexer::vllm_wire::{encode_batch, Encoding, HashForm};
use kvroute_indexer::vllm_wire::{BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};

const POD: &str = "10.0.0.1:8000";
const MODEL: &str = "Qwen/Qwen3-32B";

fn topic(pod: &str) -> Vec<u8> {
    format!("kv@{pod}@{MODEL}").into_bytes()
}

fn msg(pod: &str, seq: u64, batch: &EventBatch) -> Incoming {
    Incoming {
        topic: topic(pod),
        seq: seq.to_be_bytes().to_vec(),
        payload: encode_batch(batch, Encoding::Map, HashForm::Uint),
        identity: None,
        received_ms: 0,
    }
}

fn batch(events: Vec<KvEvent>, rank: i64) -> EventBatch {
    EventBatch {
        ts: 0.0,
        events,
        data_parallel_rank: Some(rank),
    }
}

fn tokens(start: u32, blocks: usize) -> Vec<u32> {
    (start..start + 16 * blocks as u32).collect()
}

/// A batch storing block `i` of one chain: vLLM hash 10 + i, its parent's
/// 10 + i − 1, tokens `toks[16 i .. 16 (i + 1)]`.
fn chain_link(toks: &[u32], i: usize) -> EventBatch {
    let parent = i.checked_sub(1).map(|p| 10 + p as u64);
    batch(
        vec![stored(
            &[10 + i as u64],
            parent,
            toks[16 * i..16 * (i + 1)].to_vec(),
            None,
        )],
        0,
    )
}

fn stored(hashes: &[u64], parent: Option<u64>, toks: Vec<u32>, medium: Option<Medium>) -> KvEvent {
    KvEvent::BlockStored(BlockStored {
        block_hashes: hashes.to_vec(),
        parent_block_hash: parent,
        token_ids: toks,
        block_size: 16,
        medium,
        ..BlockStored::default()
    })
}

fn removed(hashes: &[u64], medium: Option<Medium>) -> KvEvent {
    KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: hashes.to_vec(),
        medium,
        group_idx: None,
    })
}

fn index_with(cfg: IndexConfig) -> Index {
    let mut ix = Index::new(cfg, Metrics::new(), 77);
    ix.add_pod(POD, None, origin::STATIC, 0);
    ix
}

fn index() -> Index {
    index_with(IndexConfig::default())
}

fn kv_chain(toks: &[u32]) -> Vec<BlockHash> {
    let root = root_hash(Domain::Tokens, MODEL, None);
    token_block_hashes(root, toks, 16, usize::MAX)
}

/// A reference consumer: the filter's own feed client, with the entries it
/// applies kept in a map (keys are the feed's 40-bit index keys).
#[derive(Debug)]
struct Consumer {
    client: FeedClient,
    now_ms: u64,
    epoch: u64,
    cursor: u64,
    entries: HashMap<(String, IndexKey), Tier>,
}

impl Default for Consumer {
    fn default() -> Self {
        Consumer {
            client: FeedClient::new(100),
            now_ms: 0,
            epoch: 0,
            cursor: 0,
            entries: HashMap::new(),
        }
    }
}

impl Consumer {
    fn apply(&mut self, u: &FeedUpdate) {
        if u.snapshot {
            self.entries.clear();
        }
        // Ops name pods by their place in the client's list, which an
        // update repeats only when it changed.
        let pods = self.client.pods().to_vec();
        let live: Vec<&str> = pods.iter().map(|p| p.address.as_str()).collect();
        self.entries.retain(|(a, _), _| live.contains(&a.as_str()));
        for op in &u.ops {
            let addr = pods[op.pod() as usize].address.clone();
            match op {
                BlockOp::Stored { tier, hashes, .. } => {
                    for h in hashes {
                        self.entries.insert((addr.clone(), *h), *tier);
                    }
                }
                BlockOp::Removed { hashes, .. } => {
                    for h in hashes {
                        self.entries.remove(&(addr.clone(), *h));
                    }
                }
                BlockOp::Cleared { .. } => self.entries.retain(|(a, _), _| *a != addr),
            }
        }
        self.epoch = u.epoch;
        self.cursor = u.cursor;
    }

    /// One answer through the wire format and the client.
    fn exchange(&mut self, ix: &mut Index, request: FeedRequest) -> Received {
        let body = feed::encode_message(&ix.feed(&request));
        let got = self
            .client
            .on_response(self.now_ms, FeedResponse::Body(&body))
            .expect("the feed answer applies");
        self.apply(&got.update);
        got
    }

    /// One poll; a snapshot is followed page by page to its end, and
    /// returned as one update, with the pod list the client then holds.
    fn poll(&mut self, ix: &mut Index) -> FeedUpdate {
        self.now_ms += 1000;
        let request = self.client.on_tick(self.now_ms).expect("a request is due");
        let mut got = self.exchange(ix, request);
        while got.page.is_some() && !got.snapshot_complete {
            let request = self.client.follow_up(self.now_ms).expect("the next page");
            let page = self.exchange(ix, request);
            got.update.ops.extend(page.update.ops);
            got.page = page.page;
            got.snapshot_complete = page.snapshot_complete;
        }
        got.update.pods = self.client.pods().to_vec();
        got.update
    }

    fn of(&self, pod: &str) -> HashMap<IndexKey, Tier> {
        self.entries
            .iter()
            .filter(|((a, _), _)| a == pod)
            .map(|((_, h), t)| (*h, *t))
            .collect()
    }
}

/// Block hashes of these bits (hand-picked hashes a proxy posts).
fn hashes(bits: &[u64]) -> Vec<BlockHash> {
    bits.iter().map(|&b| BlockHash::new(b)).collect()
}

/// The feed's keys of these hashes.
fn keys(hashes: Vec<BlockHash>) -> Vec<IndexKey> {
    hashes.into_iter().map(|h| h.index_key()).collect()
}

fn is_snapshot(m: &FeedMessage) -> bool {
    matches!(m.kind, FeedKind::Page { number: 0, .. })
}

fn asking(epoch: u64, cursor: u64) -> FeedRequest {
    FeedRequest {
        epoch,
        cursor,
        ..FeedRequest::default()
    }
}

fn fresh(ix: &mut Index) -> Consumer {
    let mut c = Consumer::default();
    let u = c.poll(ix);
    assert!(u.snapshot);
    c
}

#[test]
fn stored_blocks_are_rehashed_with_the_kvroute_chain() {
    let mut ix = index();
    let mut c = fresh(&mut ix);
    let toks = tokens(0, 4);
    ix.handle(
        &msg(
            POD,
            0,
            &batch(vec![stored(&[11, 12], None, toks[..32].to_vec(), None)], 0),
        ),
        1,
    );
    ix.handle(
        &msg(
            POD,
            1,
            &batch(
                vec![stored(&[13, 14], Some(12), toks[32..].to_vec(), None)],
                0,
            ),
        ),
        2,
    );
    let u = c.poll(&mut ix);
    assert!(!u.snapshot);
    let want: HashMap<IndexKey, Tier> = kv_chain(&toks)
        .into_iter()
        .map(|h| (h.index_key(), Tier::Gpu))
        .collect();
    assert_eq!(c.of(POD), want);
    assert_eq!(fresh(&mut ix).of(POD), want);
    assert_eq!(u.pods[0].models, vec![MODEL.to_string()]);

    // Removal by vLLM hash removes the mapped kvroute hash.
    ix.handle(
        &msg(POD, 2, &batch(vec![removed(&[14], Some(Medium::Gpu))], 0)),
        3,
    );
    c.poll(&mut ix);
    assert_eq!(c.of(POD).len(), 3);
    assert!(!c.of(POD).contains_key(&kv_chain(&toks)[3].index_key()));
    assert_eq!(ix.metrics().counter_value("events", "BlockStored"), 2);
    assert_eq!(ix.metrics().counter_value("events", "BlockRemoved"), 1);
}

#[test]
fn lora_name_scopes_the_chain() {
    let mut ix = index();
    let toks = tokens(0, 1);
    let mut e = BlockStored {
        block_hashes: vec![1],
        token_ids: toks.clone(),
        block_size: 16,
        lora_name: Some("sql".into()),
        ..BlockStored::default()
    };
    ix.handle(
        &msg(POD, 0, &batch(vec![KvEvent::BlockStored(e.clone())], 0)),
        0,
    );
    let root = root_hash(Domain::Tokens, MODEL, Some("sql"));
    let c = fresh(&mut ix);
    assert_eq!(
        c.of(POD).keys().copied().collect::<Vec<_>>(),
        keys(token_block_hashes(root, &toks, 16, 1))
    );
    // An adapter known only by its id (older vLLM) never passes for the base model.
    let by_id = BlockStored {
        block_hashes: vec![9],
        token_ids: toks.clone(),
        block_size: 16,
        lora_id: Some(3),
        ..BlockStored::default()
    };
    ix.handle(
        &msg(POD, 0, &batch(vec![KvEvent::BlockStored(by_id)], 1)),
        0,
    );
    let got = fresh(&mut ix).of(POD);
    assert_eq!(got.len(), 2);
    assert!(!got.contains_key(&kv_chain(&toks)[0].index_key()));
    // Block size other than configured: not indexed, counted.
    e.block_size = 8;
    e.block_hashes = vec![2, 3];
    ix.handle(&msg(POD, 1, &batch(vec![KvEvent::BlockStored(e)], 0)), 0);
    assert_eq!(ix.metrics().stored_block_size_mismatch.get(), 1);
    assert_eq!(fresh(&mut ix).of(POD).len(), 2);
}

#[test]
fn restart_drops_stale_entries() {
    let mut ix = index();
    let mut c = fresh(&mut ix);
    for seq in 0..5u64 {
        let t = tokens(seq as u32 * 1000, 1);
        ix.handle(
            &msg(
                POD,
                seq,
                &batch(vec![stored(&[100 + seq], None, t, None)], 0),
            ),
            0,
        );
    }
    c.poll(&mut ix);
    assert_eq!(c.of(POD).len(), 5);
    // The pod restarts: seq back to 0 with a new block.
    let t = tokens(77_000, 1);
    ix.handle(
        &msg(
            POD,
            0,
            &batch(vec![stored(&[900], None, t.clone(), None)], 0),
        ),
        0,
    );
    let u = c.poll(&mut ix);
    assert!(u.ops.iter().any(|o| matches!(o, BlockOp::Cleared { .. })));
    assert_eq!(
        c.of(POD).keys().copied().collect::<Vec<_>>(),
        keys(kv_chain(&t))
    );
    assert_eq!(ix.metrics().restarts.get(), 1);
    assert_eq!(fresh(&mut ix).of(POD), c.of(POD));
}

#[test]
fn all_blocks_cleared_drops_the_pod_entries_and_learned() {
    let mut ix = index();
    let mut c = fresh(&mut ix);
    ix.handle(
        &msg(
            POD,
            0,
            &batch(vec![stored(&[1], None, tokens(0, 1), None)], 0),
        ),
        0,
    );
    ix.apply_learned(
        &LearnedBatch {
            entries: vec![(POD.into(), hashes(&[5, 6]))],
        },
        0,
    );
    c.poll(&mut ix);
    assert_eq!(c.of(POD).len(), 3);
    ix.handle(&msg(POD, 1, &batch(vec![KvEvent::AllBlocksCleared], 0)), 0);
    c.poll(&mut ix);
    assert!(c.of(POD).is_empty());
    assert_eq!(ix.blocks(), 0);
}

#[test]
fn unknown_publishers_are_rejected_unless_enabled() {
    let mut ix = index();
    let b = batch(vec![stored(&[1], None, tokens(0, 1), None)], 0);
    ix.handle(&msg("10.6.6.6:8000", 0, &b), 0);
    assert_eq!(ix.metrics().counter_value("rejected", "unknown_pod"), 1);
    assert_eq!(fresh(&mut ix).entries.len(), 0);
    assert_eq!(ix.pod_addresses().len(), 1);
    // No identity at all (vLLM's default empty topic).
    let mut m = msg(POD, 0, &b);
    m.topic = Vec::new();
    ix.handle(&m, 0);
    assert_eq!(ix.metrics().counter_value("rejected", "no_identity"), 1);
    // Identity from configuration wins over the topic.
    m.identity = Some((POD.into(), MODEL.into()));
    ix.handle(&m, 0);
    assert_eq!(fresh(&mut ix).of(POD).len(), 1);

    let mut open = Index::new(
        IndexConfig {
            accept_unknown_publishers: true,
            ..IndexConfig::default()
        },
        Metrics::new(),
        1,
    );
    open.handle(&msg("10.6.6.6:8000", 0, &b), 0);
    assert_eq!(fresh(&mut open).of("10.6.6.6:8000").len(), 1);
}

#[test]
fn garbage_is_counted_and_the_stream_goes_on() {
    let mut ix = index();
    let b = batch(vec![stored(&[1], None, tokens(0, 1), None)], 0);
    ix.handle(&msg(POD, 0, &b), 0);
    let mut bad = msg(POD, 1, &b);
    bad.payload.truncate(bad.payload.len() / 2);
    ix.handle(&bad, 0);
    let mut bad = msg(POD, 1, &b);
    bad.payload = b"\xc1garbage".to_vec();
    ix.handle(&bad, 0);
    let mut bad = msg(POD, 1, &b);
    bad.seq = vec![1, 2, 3];
    ix.handle(&bad, 0);
    let m = ix.metrics();
    assert_eq!(m.counter_value("decode_errors", "truncated"), 1);
    assert_eq!(m.counter_value("decode_errors", "malformed"), 1);
    assert_eq!(
        ix.metrics().counter_value("decode_errors", "bad_seq_frame"),
        1
    );
    let b2 = batch(vec![stored(&[2], Some(1), tokens(16, 1), None)], 0);
    ix.handle(&msg(POD, 1, &b2), 0);
    assert_eq!(fresh(&mut ix).of(POD).len(), 2);
    assert_eq!(ix.metrics().seq_gaps.get(), 0);
}

#[test]
fn gaps_without_replay_are_counted() {
    let mut ix = index();
    ix.handle(&msg(POD, 0, &batch(vec![], 0)), 0);
    let req = ix.handle(&msg(POD, 5, &batch(vec![], 0)), 0);
    assert!(req.is_none());
    assert_eq!(ix.metrics().seq_gaps.get(), 1);
    assert_eq!(ix.metrics().seq_missed.get(), 4);
    assert_eq!(ix.metrics().seq_gaps_unrecovered.get(), 1);
}

#[test]
fn gaps_are_filled_from_the_replay_socket_in_order() {
    let mut ix = index_with(IndexConfig {
        replay_port: Some(5600),
        ..IndexConfig::default()
    });
    let toks = tokens(0, 4);
    let ev = |i: usize| chain_link(&toks, i);
    assert!(ix.handle(&msg(POD, 0, &ev(0)), 0).is_none());
    // seq 1 and 2 lost; 3 arrives: replay requested, 3 is buffered (its parent is missing).
    let req = ix.handle(&msg(POD, 3, &ev(3)), 0).expect("replay request");
    assert_eq!(req.endpoint, "tcp://10.0.0.1:5600");
    assert_eq!(req.from_seq, 1);
    assert_eq!(fresh(&mut ix).of(POD).len(), 1);
    // The replay returns 1..=3 (3 overlaps the buffered live message).
    let replayed = (1..=3)
        .map(|i| {
            (
                i as u64,
                encode_batch(&ev(i), Encoding::Map, HashForm::Uint),
            )
        })
        .collect();
    ix.finish_replay(&req, Ok(replayed), 0);
    let got = fresh(&mut ix).of(POD);
    let want: HashMap<IndexKey, Tier> = kv_chain(&toks)
        .into_iter()
        .map(|h| (h.index_key(), Tier::Gpu))
        .collect();
    assert_eq!(got, want);
    assert_eq!(ix.metrics().counter_value("replays", "ok"), 1);
    assert_eq!(ix.metrics().replayed_messages.get(), 2);
    assert_eq!(ix.metrics().seq_gaps_unrecovered.get(), 0);
    assert_eq!(ix.metrics().stored_unknown_parent.get(), 0);

    // A failed replay still applies the buffered messages.
    let req = ix
        .handle(&msg(POD, 9, &batch(vec![], 0)), 0)
        .expect("replay");
    assert_eq!(req.from_seq, 4);
    ix.finish_replay(&req, Err("timeout".into()), 0);
    assert_eq!(ix.metrics().counter_value("replays", "failed"), 1);
    // One lost stretch (4..=8) counts once in each counter.
    assert_eq!(ix.metrics().seq_gaps_unrecovered.get(), 1);
    assert_eq!(ix.metrics().seq_gaps.get(), 2);
    assert_eq!(ix.metrics().seq_missed.get(), 2 + 5);
    assert!(ix.handle(&msg(POD, 10, &batch(vec![], 0)), 0).is_none());
    // Data-parallel rank 2 replays from port + 2.
    ix.handle(&msg(POD, 0, &batch(vec![], 2)), 0);
    let req = ix
        .handle(&msg(POD, 2, &batch(vec![], 2)), 0)
        .expect("replay");
    assert_eq!(req.endpoint, "tcp://10.0.0.1:5602");
}

#[test]
fn data_parallel_ranks_count_as_one_server() {
    let mut ix = index();
    let t = tokens(0, 2);
    ix.handle(
        &msg(
            POD,
            0,
            &batch(vec![stored(&[1, 2], None, t.clone(), None)], 0),
        ),
        0,
    );
    ix.handle(
        &msg(
            POD,
            0,
            &batch(vec![stored(&[1, 2], None, t.clone(), None)], 1),
        ),
        0,
    );
    let mut c = fresh(&mut ix);
    assert_eq!(c.of(POD).len(), 2);
    assert_eq!(ix.blocks(), 4);
    // Rank 1 restarts: rank 0 still holds the blocks.
    ix.handle(&msg(POD, 0, &batch(vec![], 1)), 0);
    ix.handle(&msg(POD, 1, &batch(vec![], 1)), 0);
    ix.handle(&msg(POD, 0, &batch(vec![KvEvent::AllBlocksCleared], 1)), 0);
    c.poll(&mut ix);
    assert_eq!(c.of(POD).len(), 2);
    ix.handle(&msg(POD, 1, &batch(vec![removed(&[2], None)], 0)), 0);
    c.poll(&mut ix);
    assert_eq!(c.of(POD).len(), 1);
}

#[test]
fn tiers_follow_the_best_medium() {
    let mut ix = index();
    let mut c = fresh(&mut ix);
    let t = tokens(0, 1);
    let kv = kv_chain(&t)[0];
    ix.handle(
        &msg(
            POD,
            0,
            &batch(vec![stored(&[1], None, t.clone(), Some(Medium::Cpu))], 0),
        ),
        0,
    );
    c.poll(&mut ix);
    assert_eq!(c.of(POD)[&kv.index_key()], Tier::Cpu);
    ix.handle(
        &msg(
            POD,
            1,
            &batch(vec![stored(&[1], None, t.clone(), Some(Medium::Gpu))], 0),
        ),
        0,
    );
    c.poll(&mut ix);
    assert_eq!(c.of(POD)[&kv.index_key()], Tier::Gpu);
    ix.handle(
        &msg(POD, 2, &batch(vec![removed(&[1], Some(Medium::Gpu))], 0)),
        0,
    );
    c.poll(&mut ix);
    assert_eq!(c.of(POD)[&kv.index_key()], Tier::Cpu);
    ix.apply_learned(
        &LearnedBatch {
            entries: vec![(POD.into(), vec![kv])],
        },
        0,
    );
    ix.handle(
        &msg(POD, 3, &batch(vec![removed(&[1], Some(Medium::Cpu))], 0)),
        0,
    );
    c.poll(&mut ix);
    assert_eq!(c.of(POD)[&kv.index_key()], Tier::Learned);
    let disk = Some(Medium::Other("DISK".into()));
    ix.handle(
        &msg(POD, 4, &batch(vec![stored(&[1], None, t, disk)], 0)),
        0,
    );
    c.poll(&mut ix);
    assert_eq!(c.of(POD)[&kv.index_key()], Tier::Disk);
    assert_eq!(fresh(&mut ix).of(POD), c.of(POD));
}

#[test]
fn learned_entries_expire_and_unknown_pods_are_refused() {
    let mut ix = index_with(IndexConfig {
        learned_ttl_ms: 1000,
        learned_max_entries: 3,
        pod_timeout_ms: 0,
        ..IndexConfig::default()
    });
    let mut c = fresh(&mut ix);
    let (ok, bad) = ix.apply_learned(
        &LearnedBatch {
            entries: vec![
                (POD.into(), hashes(&[1, 2])),
                ("10.9.9.9:1".into(), hashes(&[3])),
            ],
        },
        0,
    );
    assert_eq!((ok, bad), (2, 1));
    c.poll(&mut ix);
    assert_eq!(
        c.of(POD),
        HashMap::from([
            (IndexKey::new(1), Tier::Learned),
            (IndexKey::new(2), Tier::Learned)
        ])
    );
    // Refresh 1 at t=500; the cap (3) evicts the oldest live entry (2) for 3 and 4.
    ix.apply_learned(
        &LearnedBatch {
            entries: vec![(POD.into(), hashes(&[1, 3, 4]))],
        },
        500,
    );
    c.poll(&mut ix);
    assert_eq!(c.of(POD).len(), 3);
    assert!(!c.of(POD).contains_key(&IndexKey::new(2)));
    assert_eq!(ix.metrics().learned_evicted.get(), 1);
    ix.expire(1200);
    c.poll(&mut ix);
    assert_eq!(c.of(POD).len(), 3, "refreshed at 500, due at 1500");
    ix.expire(1600);
    c.poll(&mut ix);
    assert!(c.of(POD).is_empty());
}

#[test]
fn hashes_pods_report_are_token_domain_learned_ones_are_not() {
    let other = "10.0.0.2:8000";
    let mut ix = index();
    ix.add_pod(other, None, origin::STATIC, 0);
    let toks = tokens(0, 2);
    let kv = kv_chain(&toks);
    ix.handle(
        &msg(POD, 0, &batch(vec![stored(&[11, 12], None, toks, None)], 0)),
        1,
    );
    assert!(kv.iter().all(|&h| ix.reported_by_a_pod(h)));
    // Routing compares index keys: the key as the feed shows it, or the hash
    // with other high bits, is the same block and cannot pass for a byte chunk.
    assert!(ix.reported_by_a_pod(BlockHash::new(kv[0].index_key().get())));
    assert!(ix.reported_by_a_pod(BlockHash::new(kv[1].get() ^ (0xff << 56))));
    // What proxies post (byte chunks) is not pod-reported, even once learned.
    ix.apply_learned(
        &LearnedBatch {
            entries: vec![(other.into(), hashes(&[999]))],
        },
        1,
    );
    assert!(!ix.reported_by_a_pod(BlockHash::new(999)));
    // Once the pod drops the blocks, their hashes are no longer reported.
    ix.handle(&msg(POD, 1, &batch(vec![removed(&[11, 12], None)], 0)), 2);
    assert!(!kv.iter().any(|&h| ix.reported_by_a_pod(h)));
}

#[test]
fn silent_pods_are_dropped() {
    let mut ix = Index::new(
        IndexConfig {
            accept_unknown_publishers: true,
            pod_timeout_ms: 1000,
            ..IndexConfig::default()
        },
        Metrics::new(),
        3,
    );
    ix.add_pod(POD, Some(MODEL), origin::STATIC, 0);
    let b = batch(vec![stored(&[1], None, tokens(0, 1), None)], 0);
    ix.handle(&msg(POD, 0, &b), 0);
    ix.handle(&msg("10.0.0.2:8000", 0, &b), 0);
    let mut c = fresh(&mut ix);
    assert_eq!(c.entries.len(), 2);
    ix.set_load(
        POD,
        Load {
            capacity_blocks: 100,
            waiting: 2,
            running: 3,
            kv_usage: 0.5,
        },
        900,
    );
    ix.expire(1500);
    let u = c.poll(&mut ix);
    assert_eq!(u.pods.len(), 1, "the events-discovered pod is gone");
    assert_eq!(u.pods[0].waiting, 2);
    assert_eq!(c.entries.len(), 1);
    ix.expire(2000);
    let u = c.poll(&mut ix);
    assert_eq!(u.pods.len(), 1, "a static pod stays listed");
    assert!(c.entries.is_empty(), "but its entries are dropped");
    assert_eq!(ix.metrics().pods_expired.get(), 2);
}

#[test]
fn delta_log_cursor_rules() {
    let mut ix = index_with(IndexConfig {
        feed_log_hashes: 10,
        feed_max_hashes: 4,
        ..IndexConfig::default()
    });
    let mut c = fresh(&mut ix);
    // Wrong epoch → snapshot.
    assert!(is_snapshot(&ix.feed(&asking(ix.epoch() + 1, 0))));
    for seq in 0..3u64 {
        let t = tokens(seq as u32 * 100, 3);
        let hs = [seq * 10, seq * 10 + 1, seq * 10 + 2];
        ix.handle(
            &msg(POD, seq, &batch(vec![stored(&hs, None, t, None)], 0)),
            0,
        );
    }
    // 9 hashes in 3 ops; responses carry at most 4 hashes (but at least one op).
    let u = c.poll(&mut ix);
    assert!(!u.snapshot);
    assert_eq!(u.ops.len(), 1);
    c.poll(&mut ix);
    c.poll(&mut ix);
    assert_eq!(c.cursor, ix.cursor());
    assert_eq!(c.of(POD), fresh(&mut ix).of(POD));
    assert!(c.poll(&mut ix).ops.is_empty());
    // A cursor older than the retained log → snapshot.
    let stale = c.cursor;
    for seq in 3..8u64 {
        let t = tokens(seq as u32 * 100, 3);
        let hs = [seq * 10, seq * 10 + 1, seq * 10 + 2];
        ix.handle(
            &msg(POD, seq, &batch(vec![stored(&hs, None, t, None)], 0)),
            0,
        );
    }
    assert!(is_snapshot(&ix.feed(&asking(ix.epoch(), stale))));
    // A cursor from the future → snapshot.
    assert!(is_snapshot(&ix.feed(&asking(ix.epoch(), ix.cursor() + 1))));
}

/// Stores `n` blocks on `pod` (hashes from `first`), as sequence `seq`.
fn store_blocks(ix: &mut Index, pod: &str, seq: u64, first: u64, n: usize) {
    let hs: Vec<u64> = (first..first + n as u64).collect();
    let t = tokens(first as u32 * 16, n);
    ix.handle(
        &msg(pod, seq, &batch(vec![stored(&hs, None, t, None)], 0)),
        0,
    );
}

#[test]
fn snapshots_come_in_bounded_pages_and_deltas_replay_over_them() {
    let pods = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];
    let mut ix = Index::new(
        IndexConfig {
            feed_max_hashes: 3,
            ..IndexConfig::default()
        },
        Metrics::new(),
        5,
    );
    for (i, p) in pods.iter().enumerate() {
        ix.add_pod(p, Some(MODEL), origin::STATIC, 0);
        // 7, 1 and 4 blocks: the first pod is cut across pages.
        store_blocks(&mut ix, p, 0, 100 * (i as u64 + 1), [7, 1, 4][i]);
    }
    let mut c = Consumer::default();
    let request = c.client.on_tick(1).unwrap();
    let mut got = c.exchange(&mut ix, request);
    assert!(got.update.snapshot);
    let mut pages = 1;
    let mut seq = 1;
    while !got.snapshot_complete {
        let hashes: usize = got.update.ops.iter().map(|o| o.hashes().len()).sum();
        assert!(hashes <= 3, "page {pages} carries {hashes} hashes");
        // The index keeps changing while the consumer pages.
        store_blocks(&mut ix, pods[pages % 3], seq, 1000 + seq * 10, 2);
        ix.handle(
            &msg(pods[0], seq, &batch(vec![removed(&[100 + seq], None)], 0)),
            0,
        );
        seq += 1;
        let request = c.client.follow_up(1).expect("the next page at once");
        assert_eq!(request.page.map(|(n, _)| n as usize), Some(pages));
        got = c.exchange(&mut ix, request);
        assert!(!got.update.snapshot, "later pages extend the state");
        assert!(got.update.pods_unchanged && got.update.pods.is_empty());
        assert_eq!(c.client.pods().len(), 3, "the client keeps the pod list");
        pages += 1;
    }
    assert!(pages >= 4, "12 entries at 3 per page: {pages} pages");
    let metrics = ix.metrics().encode();
    assert!(
        metrics.contains(&format!(
            "kvroute_indexer_feed_requests_total{{kind=\"snapshot_page\"}} {}",
            pages - 1
        )),
        "{metrics}"
    );
    // Deltas from the first page's cursor bring everything up to date.
    while c.cursor < ix.cursor() {
        c.poll(&mut ix);
    }
    assert_eq!(c.entries, fresh(&mut ix).entries);
}

/// Two consumers page through snapshots begun at different moments, pages
/// interleaved, while pods store and remove blocks: a few per page (the
/// second snapshot must not read through the first one's older picture of
/// the table), and many, so that the block table grows under the pages
/// (renumbering the records they are read through). Each consumer ends,
/// after its deltas, with the state a fresh snapshot has.
#[test]
fn interleaved_snapshots_survive_changes_and_table_growth_between_pages() {
    let pods = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];
    for per_page in [5, 60] {
        let mut ix = Index::new(
            IndexConfig {
                feed_max_hashes: 40,
                grow_on_demand: true,
                ..IndexConfig::default()
            },
            Metrics::new(),
            3,
        );
        let mut seqs = [0u64; 3];
        let mut send = |ix: &mut Index, p: usize, event: KvEvent| {
            ix.handle(&msg(pods[p], seqs[p], &batch(vec![event], 0)), 0);
            seqs[p] += 1;
        };
        let store = |first: u64, n: usize| {
            let hs: Vec<u64> = (first..first + n as u64).collect();
            stored(&hs, None, tokens(first as u32 * 16, n), None)
        };
        for (p, pod) in pods.iter().enumerate() {
            ix.add_pod(pod, Some(MODEL), origin::STATIC, 0);
            // Pods 0 and 1 share their 150 blocks.
            send(&mut ix, p, store(if p < 2 { 1 } else { 5_000 }, 150));
        }
        let before = ix.memory_bytes();
        let mut a = Consumer::default();
        let mut b = Consumer::default();
        let first = a.client.on_tick(1).unwrap();
        let mut a_done = a.exchange(&mut ix, first).snapshot_complete;
        let mut b_done: Option<bool> = None; // B begins its snapshot two steps later
        let mut step = 0u64;
        while !a_done || b_done != Some(true) {
            step += 1;
            let p = (step % 3) as usize;
            send(&mut ix, p, store(10_000 + step * 100, per_page));
            if step % 2 == 0 {
                send(&mut ix, p, removed(&[1 + step * 7 % 150], None));
            }
            if !a_done {
                let request = a.client.follow_up(1).expect("A's next page");
                a_done = a.exchange(&mut ix, request).snapshot_complete;
            }
            b_done = match b_done {
                None if step == 2 => {
                    let first = b.client.on_tick(1).unwrap();
                    Some(b.exchange(&mut ix, first).snapshot_complete)
                }
                Some(false) => {
                    let request = b.client.follow_up(1).expect("B's next page");
                    Some(b.exchange(&mut ix, request).snapshot_complete)
                }
                done => done,
            };
        }
        for c in [&mut a, &mut b] {
            while c.cursor < ix.cursor() {
                c.poll(&mut ix);
            }
        }
        let now = fresh(&mut ix).entries;
        assert!(now.len() > 400, "{} entries", now.len());
        assert_eq!(a.entries, now, "A, {per_page} blocks a page");
        assert_eq!(b.entries, now, "B, {per_page} blocks a page");
        if per_page == 60 {
            assert!(
                ix.memory_bytes() > 2 * before,
                "the block table grew while paging"
            );
        }
    }
}

/// Pages are ascending, disjoint ranges of the index key: paged at 7 hashes,
/// a snapshot of four pods sharing blocks (and a learned entry, a CPU copy)
/// rebuilds exactly the state of the same index sent in one page.
#[test]
fn a_snapshot_paged_by_key_range_rebuilds_the_unpaged_one() {
    let pods = [
        "10.0.0.1:8000",
        "10.0.0.2:8000",
        "10.0.0.3:8000",
        "10.0.0.4:8000",
    ];
    let filled = |feed_max_hashes: usize| {
        let mut ix = Index::new(
            IndexConfig {
                feed_max_hashes,
                ..IndexConfig::default()
            },
            Metrics::new(),
            9,
        );
        for (i, p) in pods.iter().enumerate() {
            ix.add_pod(p, Some(MODEL), origin::STATIC, 0);
            // Pods 0–2 share the chain's first 10, 20 and 30 blocks; pod 3 holds its own.
            let (first, n) = if i < 3 { (1, 10 * (i + 1)) } else { (500, 25) };
            store_blocks(&mut ix, p, 0, first as u64, n);
        }
        let t = tokens(16, 3);
        ix.handle(
            &msg(
                pods[3],
                1,
                &batch(vec![stored(&[90, 91, 92], None, t, Some(Medium::Cpu))], 0),
            ),
            0,
        );
        ix.apply_learned(
            &LearnedBatch {
                entries: vec![(pods[3].into(), hashes(&[0xfeed_0000_0001]))],
            },
            0,
        );
        ix
    };
    let whole = fresh(&mut filled(1 << 20));
    let entries = whole.entries.len();
    assert_eq!(entries, 10 + 20 + 30 + 25 + 3 + 1);
    let mut ix = filled(7);
    let mut c = Consumer::default();
    let request = c.client.on_tick(1).unwrap();
    let mut got = c.exchange(&mut ix, request);
    let mut pages = 1;
    let mut below = 0u64; // every key of a page is above every key of the pages before
    loop {
        let keys: Vec<u64> = got
            .update
            .ops
            .iter()
            .flat_map(|o| o.hashes().iter().map(|k| k.get()))
            .collect();
        assert!(keys.len() <= 7, "page {pages} carries {} keys", keys.len());
        if let Some(&least) = keys.iter().min() {
            assert!(least >= below, "page {pages} goes back to key {least}");
            below = keys.iter().max().map_or(below, |&k| k + 1);
        }
        if got.snapshot_complete {
            break;
        }
        let request = c.client.follow_up(1).expect("the next page at once");
        got = c.exchange(&mut ix, request);
        pages += 1;
    }
    assert!(
        pages >= entries / 7,
        "{entries} entries at 7 per page: {pages} pages"
    );
    assert_eq!(c.entries, whole.entries);
}

/// A key is never split across pages: three pods holding the same four
/// blocks, paged at 2 hashes, come one key (three entries) a page.
#[test]
fn a_key_held_by_more_pods_than_a_page_holds_comes_whole_in_one_page() {
    let pods = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];
    let mut ix = Index::new(
        IndexConfig {
            feed_max_hashes: 2,
            ..IndexConfig::default()
        },
        Metrics::new(),
        3,
    );
    for p in pods {
        ix.add_pod(p, Some(MODEL), origin::STATIC, 0);
        store_blocks(&mut ix, p, 0, 1, 4);
    }
    let mut c = Consumer::default();
    let request = c.client.on_tick(1).unwrap();
    let mut got = c.exchange(&mut ix, request);
    let mut keys_sent = Vec::new();
    loop {
        let mut keys: Vec<IndexKey> = got
            .update
            .ops
            .iter()
            .flat_map(|o| o.hashes().to_vec())
            .collect();
        keys.dedup();
        // Ranges with no key are possible; a page with keys holds exactly one.
        assert!(keys.len() <= 1, "{keys:?}");
        if let Some(&key) = keys.first() {
            assert_eq!(got.update.ops.len(), 3, "the key's three holders");
            keys_sent.push(key);
        }
        if got.snapshot_complete {
            break;
        }
        let request = c.client.follow_up(1).expect("the next page at once");
        got = c.exchange(&mut ix, request);
    }
    assert_eq!(keys_sent.len(), 4);
    assert!(keys_sent.windows(2).all(|w| w[0] < w[1]), "{keys_sent:?}");
    assert_eq!(c.entries.len(), 12);
}

#[test]
fn a_pod_list_change_while_paging_restarts_the_snapshot() {
    let mut ix = index_with(IndexConfig {
        feed_max_hashes: 2,
        ..IndexConfig::default()
    });
    store_blocks(&mut ix, POD, 0, 1, 5);
    let mut c = Consumer::default();
    let request = c.client.on_tick(1).unwrap();
    assert!(!c.exchange(&mut ix, request).snapshot_complete);
    ix.add_pod("10.0.0.9:8000", None, origin::STATIC, 0);
    let request = c.client.follow_up(1).unwrap();
    let again = c.exchange(&mut ix, request);
    assert!(again.update.snapshot, "a new first page, with the new list");
    assert_eq!(again.page, Some(0));
    assert_eq!(again.update.pods.len(), 2);
}

#[test]
fn idle_polls_carry_no_list_and_a_load_change_only_the_load() {
    let mut ix = index();
    store_blocks(&mut ix, POD, 0, 1, 2);
    let mut c = fresh(&mut ix);
    let poll = |c: &mut Consumer, ix: &mut Index| {
        let request = c.client.on_tick(c.now_ms).unwrap();
        c.now_ms += 1000;
        let m = ix.feed(&request);
        let bytes = feed::encode_message(&m).len();
        let got = c
            .client
            .on_response(c.now_ms, FeedResponse::Body(&feed::encode_message(&m)))
            .unwrap();
        (m, bytes, got.update)
    };
    let (m, bytes, update) = poll(&mut c, &mut ix);
    assert_eq!(
        (m.pods.is_none(), m.load.is_none(), bytes),
        (true, true, 41)
    );
    assert!(update.pods_unchanged && update.pods.is_empty());
    assert_eq!(c.client.pods()[0].address, POD);
    ix.set_load(
        POD,
        Load {
            waiting: 3,
            ..Load::default()
        },
        0,
    );
    let (m, _, update) = poll(&mut c, &mut ix);
    assert!(m.pods.is_none());
    assert_eq!(m.load.map(|l| l.len()), Some(1));
    assert!(
        update.pods_unchanged && update.pods.is_empty(),
        "the load alone"
    );
    assert_eq!(update.load.map(|l| l[0].waiting), Some(3));
    assert_eq!(c.client.pods()[0].waiting, 3);
    assert_eq!(poll(&mut c, &mut ix).1, 41, "the load is current again");
    ix.add_pod("10.0.0.9:8000", None, origin::STATIC, 0);
    let (m, _, update) = poll(&mut c, &mut ix);
    assert_eq!(m.pods.map(|p| p.len()), Some(2));
    assert_eq!(update.pods.len(), 2);
    // A pod's speed travels with the pod list: 0 until a source states one,
    // and a change sends the list again.
    assert_eq!(update.pods[1].speed, 0.0);
    ix.set_speed("10.0.0.9:8000", 0.5);
    let (m, _, update) = poll(&mut c, &mut ix);
    assert!(m.pods.is_some(), "a new speed is a new pod list");
    assert_eq!((update.pods[0].speed, update.pods[1].speed), (0.0, 0.5));
    assert_eq!(poll(&mut c, &mut ix).1, 41);
    let debug = ix.debug_pods(0);
    assert_eq!((debug[0].speed, debug[1].speed), (None, Some(0.5)));
}

#[test]
fn per_pod_capacity_is_enforced() {
    let mut ix = index_with(IndexConfig {
        max_blocks_per_pod: 3,
        ..IndexConfig::default()
    });
    ix.handle(
        &msg(
            POD,
            0,
            &batch(vec![stored(&[1, 2, 3, 4, 5], None, tokens(0, 5), None)], 0),
        ),
        0,
    );
    assert_eq!(ix.blocks(), 3);
    assert_eq!(ix.metrics().blocks_refused_capacity.get(), 1);
}

/// The block table, and the pod's first vLLM-hash table, make room at once
/// for what the pods report they can hold (each report capped by
/// `max_blocks_per_pod`, so a pod reporting an absurd capacity cannot make
/// the index allocate more than it may fill), or grow by what is stored with
/// `grow_on_demand`; the index holds the same blocks either way. A second
/// rank's table is not sized again: the reported capacity is the pod's.
#[test]
fn the_tables_are_sized_for_the_reported_capacity() {
    let with = |grow_on_demand: bool, capacity: u32| {
        let mut ix = index_with(IndexConfig {
            max_blocks_per_pod: 50_000,
            grow_on_demand,
            ..IndexConfig::default()
        });
        let load = Load {
            capacity_blocks: capacity,
            ..Load::default()
        };
        ix.set_load(POD, load, 0);
        store_blocks(&mut ix, POD, 0, 1, 64);
        assert_eq!(ix.blocks(), 64);
        let first_rank = ix.memory_bytes();
        let hs: Vec<u64> = (1..65).collect();
        let rank_1 = batch(vec![stored(&hs, None, tokens(16, 64), None)], 1);
        ix.handle(&msg(POD, 0, &rank_1), 0);
        assert_eq!(ix.blocks(), 128);
        let second_rank = ix.memory_bytes() - first_rank;
        assert!(second_rank < 4_000, "{second_rank}");
        first_rank
    };
    let reserved = with(false, 40_000);
    let on_demand = with(true, 40_000);
    // 12-byte records for 40,000 blocks at most 85 % full, and 8-byte
    // vLLM-hash entries for as many at most 90 % full.
    assert!(reserved >= 40_000 * (12 + 8), "{reserved}");
    assert!(on_demand < 40_000, "{on_demand}");
    let absurd = with(false, u32::MAX);
    assert!(
        (50_000 * (12 + 8)..50_000 * (12 + 8) * 2).contains(&absurd),
        "{absurd}"
    );
}

/// Random event streams (stores with parents, removals by tier, clears,
/// restarts, gaps, learned batches, expiry) polled at random points: the
/// incremental consumer must always equal a fresh snapshot.
#[test]
fn randomized_deltas_equal_snapshots() {
    let mut rng = 0x1234_5678_9abc_def1u64;
    let mut next = move |n: u64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng % n
    };
    let pods = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];
    for round in 0..20 {
        let mut ix = Index::new(
            IndexConfig {
                feed_log_hashes: 200 + round * 50,
                feed_max_hashes: 64,
                learned_ttl_ms: 50,
                ..IndexConfig::default()
            },
            Metrics::new(),
            round as u64 + 1,
        );
        for p in pods {
            ix.add_pod(p, Some(MODEL), origin::STATIC, 0);
        }
        let mut c = fresh(&mut ix);
        let mut seqs = [[0u64; 2]; 3];
        let mut held: Vec<Vec<u64>> = vec![Vec::new(); 6];
        for step in 0..400u64 {
            let p = next(3) as usize;
            let rank = next(2) as usize;
            let src = p * 2 + rank;
            let medium = [None, Some(Medium::Cpu), Some(Medium::Gpu)][next(3) as usize].clone();
            let ev = match next(10) {
                0..=4 => {
                    let n = 1 + next(4) as usize;
                    let parent = if held[src].is_empty() || next(3) == 0 {
                        None
                    } else {
                        Some(held[src][next(held[src].len() as u64) as usize])
                    };
                    let hs: Vec<u64> = (0..n).map(|_| 1 + next(300)).collect();
                    held[src].extend(&hs);
                    stored(&hs, parent, tokens(next(50) as u32 * 16, n), medium)
                }
                5..=7 => {
                    let hs: Vec<u64> = (0..3).map(|_| 1 + next(300)).collect();
                    removed(&hs, medium)
                }
                8 => {
                    held[src].clear();
                    KvEvent::AllBlocksCleared
                }
                _ => {
                    ix.apply_learned(
                        &LearnedBatch {
                            entries: vec![(
                                pods[p].into(),
                                (0..3).map(|_| BlockHash::new(next(40))).collect(),
                            )],
                        },
                        step,
                    );
                    continue;
                }
            };
            let seq = match next(30) {
                0 => {
                    held[src].clear();
                    0 // restart
                }
                1 => seqs[p][rank] + 2, // gap
                _ => seqs[p][rank],
            };
            seqs[p][rank] = seq + 1;
            ix.handle(&msg(pods[p], seq, &batch(vec![ev], rank as i64)), step);
            if next(5) == 0 {
                ix.expire(step);
            }
            if next(4) == 0 {
                c.poll(&mut ix);
                while c.cursor < ix.cursor() && c.epoch == ix.epoch() {
                    let u = c.poll(&mut ix);
                    if u.snapshot {
                        break;
                    }
                }
                assert_eq!(
                    c.entries,
                    fresh(&mut ix).entries,
                    "round {round} step {step}"
                );
            }
        }
    }
}

#[test]
fn golden_capture_sequence_applies() {
    let dir = kvroute_testdata::vllm_golden_frames();
    let mut ix = index();
    let names = [
        "00_stored_4blocks_root",
        "01_stored_2blocks_with_parent",
        "02_stored_lora_extrakeys_session",
        "03_removed_gpu",
        "04_removed_cpu_no_group",
        "05_all_cleared",
        "06_mixed_stored_removed_cleared",
    ];
    for kind in ["int", "bytes"] {
        let pod = if kind == "int" { POD } else { "10.0.0.2:8000" };
        ix.add_pod(pod, Some(MODEL), origin::STATIC, 0);
        for (i, n) in names.iter().enumerate() {
            let payload =
                std::fs::read(dir.join(format!("{kind}_{n}.payload.msgpack"))).expect("golden");
            let m = Incoming {
                topic: topic(pod),
                seq: (i as u64).to_be_bytes().to_vec(),
                payload,
                identity: None,
                received_ms: 0,
            };
            ix.handle(&m, 0);
            if i == 0 {
                // 4 blocks of tokens 0..63 from the root.
                let got = fresh(&mut ix).of(pod);
                let want: HashMap<IndexKey, Tier> = kv_chain(&tokens(0, 4))
                    .into_iter()
                    .map(|h| (h.index_key(), Tier::Gpu))
                    .collect();
                assert_eq!(got, want, "{kind}");
            }
        }
        assert!(
            fresh(&mut ix).of(pod).is_empty(),
            "06 ends with AllBlocksCleared"
        );
    }
    assert_eq!(ix.metrics().counter_value("decode_errors", "truncated"), 0);
    assert_eq!(ix.metrics().counter_value("events", "AllBlocksCleared"), 4);
}

#[test]
fn joining_a_running_publisher_replays_its_buffer_from_zero() {
    let toks = tokens(0, 3);
    let ev = |i: usize| chain_link(&toks, i);
    // Without a replay endpoint: applied as is, counted.
    let mut ix = index();
    assert!(ix.handle(&msg(POD, 2, &ev(0)), 0).is_none());
    assert_eq!(ix.metrics().joined_midstream.get(), 1);
    assert_eq!(ix.metrics().seq_gaps_unrecovered.get(), 0);
    assert_eq!(fresh(&mut ix).of(POD).len(), 1);

    // With one: the history is fetched from seq 0 first.
    let mut ix = index_with(IndexConfig {
        replay_port: Some(5600),
        ..IndexConfig::default()
    });
    let req = ix.handle(&msg(POD, 2, &ev(2)), 0).expect("replay from 0");
    assert_eq!(req.from_seq, 0);
    let replayed = (0..=2)
        .map(|i| {
            (
                i as u64,
                encode_batch(&ev(i), Encoding::Map, HashForm::Uint),
            )
        })
        .collect();
    ix.finish_replay(&req, Ok(replayed), 0);
    let want: HashMap<IndexKey, Tier> = kv_chain(&toks)
        .into_iter()
        .map(|h| (h.index_key(), Tier::Gpu))
        .collect();
    assert_eq!(fresh(&mut ix).of(POD), want);
    assert_eq!(ix.metrics().stored_unknown_parent.get(), 0);
}

#[test]
fn configured_identity_takes_its_model_from_the_topic_when_it_names_none() {
    let mut ix = index();
    let mut m = msg(
        "10.9.9.9:1",
        0,
        &batch(vec![stored(&[1], None, tokens(0, 1), None)], 0),
    );
    m.identity = Some((POD.into(), String::new()));
    ix.handle(&m, 0);
    let c = fresh(&mut ix);
    assert_eq!(
        c.of(POD).keys().copied().collect::<Vec<_>>(),
        keys(kv_chain(&tokens(0, 1)))
    );
    assert_eq!(ix.debug_pods(0)[0].models, vec![MODEL.to_string()]);
}

// ------------------------------------------------ what real vLLM sends

fn kv_chain_keyed(toks: &[u32], lora: Option<&str>, extra: &[Option<u64>]) -> Vec<BlockHash> {
    let root = root_hash(Domain::Tokens, MODEL, lora);
    keyed_token_block_hashes(root, toks, 16, usize::MAX, extra)
}

fn gpu(hashes: &[BlockHash]) -> HashMap<IndexKey, Tier> {
    hashes.iter().map(|h| (h.index_key(), Tier::Gpu)).collect()
}

/// vLLM's CPU offloading publishes placeholders (no tokens, block size 0,
/// medium CPU) in the same batch as the GPU pool's events.
#[test]
fn offload_placeholders_mark_known_blocks_cpu_resident_and_poison_nothing() {
    let mut ix = index();
    let toks = tokens(0, 3);
    let kv = kv_chain(&toks);
    let placeholder = |hashes: &[u64]| {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.to_vec(),
            medium: Some(Medium::Cpu),
            ..BlockStored::default()
        })
    };
    let b = batch(
        vec![
            stored(&[1, 2], None, toks[..32].to_vec(), Some(Medium::Gpu)),
            placeholder(&[1, 99]),
            stored(&[3], Some(2), toks[32..].to_vec(), Some(Medium::Gpu)),
        ],
        0,
    );
    ix.handle(&msg(POD, 0, &b), 0);
    let m = ix.metrics();
    assert_eq!(m.counter_value("placeholder_blocks", "applied"), 1);
    assert_eq!(m.counter_value("placeholder_blocks", "unknown"), 1);
    assert_eq!(m.blocks_stored.get(), 3);
    let mut c = fresh(&mut ix);
    assert_eq!(c.of(POD), gpu(&kv));
    // The GPU copy goes; the CPU copy the placeholder announced stays.
    ix.handle(
        &msg(POD, 1, &batch(vec![removed(&[1], Some(Medium::Gpu))], 0)),
        0,
    );
    c.poll(&mut ix);
    assert_eq!(c.of(POD).get(&kv[0].index_key()), Some(&Tier::Cpu));
    ix.handle(
        &msg(POD, 2, &batch(vec![removed(&[1], Some(Medium::Cpu))], 0)),
        0,
    );
    c.poll(&mut ix);
    assert_eq!(c.of(POD).get(&kv[0].index_key()), None);
    assert_eq!(ix.metrics().joined_midstream.get(), 0);
    assert_eq!(ix.metrics().seq_gaps.get(), 0);
}

/// An event that is msgpack but not a valid event is skipped and counted;
/// the batch's other events apply and the sequence goes on.
#[test]
fn an_invalid_event_is_skipped_and_its_batch_applies() {
    let mut ix = index();
    let toks = tokens(0, 2);
    // The bytes of one event: its batch minus `[ts, [` (11 bytes) and the rank (1 byte).
    let event_bytes = |e: KvEvent| {
        let p = encode_batch(&batch(vec![e], 0), Encoding::Array, HashForm::Uint);
        p[11..p.len() - 1].to_vec()
    };
    // A BlockStored whose block size is a string, between two good events.
    let mut bad = Vec::new();
    rmp::encode::write_array_len(&mut bad, 5).unwrap();
    rmp::encode::write_str(&mut bad, "BlockStored").unwrap();
    rmp::encode::write_array_len(&mut bad, 0).unwrap();
    rmp::encode::write_nil(&mut bad).unwrap();
    rmp::encode::write_array_len(&mut bad, 0).unwrap();
    rmp::encode::write_str(&mut bad, "sixteen").unwrap();
    let mut payload = vec![0x93, 0xcb, 0, 0, 0, 0, 0, 0, 0, 0, 0x93];
    payload.extend(event_bytes(stored(&[1], None, toks[..16].to_vec(), None)));
    payload.extend(bad);
    payload.extend(event_bytes(stored(
        &[2],
        Some(1),
        toks[16..].to_vec(),
        None,
    )));
    payload.push(0);
    let m = Incoming {
        payload,
        ..msg(POD, 0, &batch(vec![], 0))
    };
    ix.handle(&m, 0);
    assert_eq!(ix.metrics().counter_value("events_skipped", "invalid"), 1);
    assert_eq!(ix.metrics().counter_value("decode_errors", "invalid"), 0);
    assert_eq!(fresh(&mut ix).of(POD), gpu(&kv_chain(&toks)));
    ix.handle(&msg(POD, 1, &batch(vec![], 0)), 0);
    assert_eq!(ix.metrics().seq_gaps.get(), 0);
}

/// vLLM scopes blocks by cache_salt (block 0's extra keys, after the LoRA
/// name) and multimodal identifiers: the re-hash folds them the way the
/// filter does, so other salts and other images never match.
#[test]
fn extra_keys_scope_the_rehash() {
    let toks = tokens(0, 2);
    let with_keys = |keys: Vec<Option<Vec<ExtraKey>>>, lora: Option<&str>| {
        let mut ix = index();
        let e = KvEvent::BlockStored(BlockStored {
            block_hashes: vec![1, 2],
            token_ids: toks.clone(),
            block_size: 16,
            lora_name: lora.map(str::to_owned),
            lora_id: lora.map(|_| 7),
            extra_keys: Some(keys),
            ..BlockStored::default()
        });
        ix.handle(&msg(POD, 0, &batch(vec![e], 0)), 0);
        let mut got: Vec<IndexKey> = fresh(&mut ix).of(POD).into_keys().collect();
        got.sort();
        got
    };
    let sorted = |v: Vec<BlockHash>| {
        let mut v = keys(v);
        v.sort();
        v
    };
    let salt = |s: &str| ExtraKey::Str(s.into());
    assert_eq!(
        with_keys(vec![Some(vec![salt("salt-A")]), None], None),
        sorted(kv_chain_keyed(&toks, None, &[salt_digest("salt-A")]))
    );
    // The golden capture's shape: the LoRA name first, then the salt.
    assert_eq!(
        with_keys(
            vec![Some(vec![salt("my-lora"), salt("salt-A")])],
            Some("my-lora")
        ),
        sorted(kv_chain_keyed(
            &toks,
            Some("my-lora"),
            &[salt_digest("salt-A")]
        ))
    );
    // LoRA alone hashes as before extra keys existed.
    assert_eq!(
        with_keys(
            vec![Some(vec![salt("my-lora")]), Some(vec![salt("my-lora")])],
            Some("my-lora")
        ),
        sorted(kv_chain_keyed(&toks, Some("my-lora"), &[]))
    );
    // Two images with the same placeholder tokens: different blocks.
    let image = |id: &str| Some(vec![ExtraKey::List(vec![salt(id), ExtraKey::Int(0)])]);
    let a = with_keys(vec![None, image("img-a")], None);
    let b = with_keys(vec![None, image("img-b")], None);
    let plain = sorted(kv_chain(&toks));
    assert!(
        a.contains(&kv_chain(&toks)[0].index_key()),
        "block 0 has no image"
    );
    assert_ne!(a, b);
    assert_ne!(a, plain);
    let digest = extra_keys_digest(&[ExtraKey::List(vec![salt("img-a"), ExtraKey::Int(0)])]);
    assert_eq!(a, sorted(kv_chain_keyed(&toks, None, &[None, digest])));
}

/// Hybrid models: every KV-cache group stores the same hashes; a
/// sliding-window group's eviction must not remove what full attention holds.
#[test]
fn hybrid_groups_are_keyed_apart_and_only_full_attention_is_routed() {
    let mut ix = index();
    let toks = tokens(0, 2);
    let kv = kv_chain(&toks);
    let group = |g: i64, kind: &str| {
        KvEvent::BlockStored(BlockStored {
            block_hashes: vec![1, 2],
            token_ids: toks.clone(),
            block_size: 16,
            group_idx: Some(g),
            kv_cache_spec_kind: Some(kind.into()),
            ..BlockStored::default()
        })
    };
    let removed_in = |g: i64, hashes: &[u64]| {
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: hashes.to_vec(),
            medium: None,
            group_idx: Some(g),
        })
    };
    ix.handle(
        &msg(
            POD,
            0,
            &batch(
                vec![
                    group(0, "full_attention"),
                    group(1, "sliding_window"),
                    group(2, "mamba"),
                    group(3, "full_attention"),
                ],
                0,
            ),
        ),
        0,
    );
    let mut c = fresh(&mut ix);
    assert_eq!(c.of(POD), gpu(&kv));
    assert_eq!(ix.metrics().blocks_not_routed.get(), 4);
    // The window slides: group 1 evicts block 1, full attention keeps it.
    ix.handle(&msg(POD, 1, &batch(vec![removed_in(1, &[1])], 0)), 0);
    c.poll(&mut ix);
    assert_eq!(c.of(POD), gpu(&kv));
    assert_eq!(ix.metrics().removed_unknown.get(), 0);
    // One of two full-attention groups evicts: the other still holds it.
    ix.handle(&msg(POD, 2, &batch(vec![removed_in(0, &[2])], 0)), 0);
    c.poll(&mut ix);
    assert_eq!(c.of(POD), gpu(&kv));
    ix.handle(&msg(POD, 3, &batch(vec![removed_in(3, &[2])], 0)), 0);
    c.poll(&mut ix);
    assert_eq!(c.of(POD), gpu(&kv[..1]));
    // Restarted with another model whose group 1 is full attention: routed again.
    ix.handle(&msg(POD, 0, &batch(vec![group(1, "full_attention")], 0)), 0);
    c.poll(&mut ix);
    assert_eq!(c.of(POD), gpu(&kv));
    ix.handle(&msg(POD, 1, &batch(vec![removed_in(1, &[2])], 0)), 0);
    c.poll(&mut ix);
    assert_eq!(c.of(POD), gpu(&kv[..1]));
    assert_eq!(ix.metrics().blocks_not_routed.get(), 5);
}

/// Hybrid models' attention groups report larger blocks (a multiple of the
/// kernel block): each is re-hashed as several of the filters' blocks.
#[test]
fn blocks_of_a_multiple_size_are_split_and_others_counted() {
    let mut ix = index();
    let toks = tokens(0, 4);
    let kv = kv_chain(&toks);
    let big = |hashes: &[u64], parent: Option<u64>, toks: Vec<u32>, size: u32| {
        KvEvent::BlockStored(BlockStored {
            block_hashes: hashes.to_vec(),
            parent_block_hash: parent,
            token_ids: toks,
            block_size: size,
            ..BlockStored::default()
        })
    };
    ix.handle(
        &msg(
            POD,
            0,
            &batch(
                vec![
                    big(&[1], None, toks[..32].to_vec(), 32),
                    big(&[2], Some(1), toks[32..].to_vec(), 32),
                    big(&[3], None, toks[..24].to_vec(), 24),
                ],
                0,
            ),
        ),
        0,
    );
    let mut c = fresh(&mut ix);
    assert_eq!(c.of(POD), gpu(&kv));
    assert_eq!(ix.metrics().stored_block_size_mismatch.get(), 1);
    ix.handle(&msg(POD, 1, &batch(vec![removed(&[2], None)], 0)), 0);
    c.poll(&mut ix);
    assert_eq!(c.of(POD), gpu(&kv[..2]));
}

#[test]
fn a_block_held_by_several_pods_is_stored_once_and_each_hold_is_its_own() {
    let pods = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"];
    let mut ix = Index::new(IndexConfig::default(), Metrics::new(), 5);
    for p in pods {
        ix.add_pod(p, Some(MODEL), origin::STATIC, 0);
    }
    let toks = tokens(0, 4);
    let kvs = kv_chain(&toks);
    let chain = [11, 12, 13, 14];
    for p in pods {
        let ev = stored(&chain, None, toks.clone(), None);
        ix.handle(&msg(p, 0, &batch(vec![ev], 0)), 0);
    }
    // The third pod also offloads the first two blocks to CPU.
    let ev = stored(&chain[..2], None, tokens(0, 2), Some(Medium::Cpu));
    ix.handle(&msg(pods[2], 1, &batch(vec![ev], 0)), 0);
    assert_eq!(ix.pod_blocks(), 12);
    assert_eq!(ix.distinct_blocks(), 4);
    let mut c = fresh(&mut ix);
    for p in pods {
        assert_eq!(c.of(p), gpu(&kvs));
    }

    // The first pod evicts two blocks: the others keep them.
    ix.handle(
        &msg(pods[0], 1, &batch(vec![removed(&chain[2..], None)], 0)),
        0,
    );
    // The third drops its GPU copies of the first two: their CPU copies remain.
    ix.handle(
        &msg(pods[2], 2, &batch(vec![removed(&chain[..2], None)], 0)),
        0,
    );
    c.poll(&mut ix);
    assert_eq!(c.of(pods[0]), gpu(&kvs[..2]));
    assert_eq!(c.of(pods[1]), gpu(&kvs));
    let mut third = gpu(&kvs[2..]);
    third.extend(kvs[..2].iter().map(|h| (h.index_key(), Tier::Cpu)));
    assert_eq!(c.of(pods[2]), third);
    assert_eq!(ix.distinct_blocks(), 4);

    // The second pod leaves: its entries go, the others' stay.
    ix.remove_origin(pods[1], origin::STATIC);
    c.poll(&mut ix);
    assert!(c.of(pods[1]).is_empty());
    assert_eq!(c.of(pods[0]), gpu(&kvs[..2]));
    assert_eq!(c.of(pods[2]), third);
    assert_eq!(ix.pod_blocks(), 6);

    // A learned entry beside a pod's reported one.
    let learned = LearnedBatch {
        entries: vec![(pods[0].into(), vec![kvs[3]])],
    };
    assert_eq!(ix.apply_learned(&learned, 0), (1, 0));
    assert!(ix.reported_by_a_pod(kvs[3]));

    // The third pod's cache is cleared: what remains is the first pod's.
    ix.handle(
        &msg(pods[2], 3, &batch(vec![KvEvent::AllBlocksCleared], 0)),
        0,
    );
    c.poll(&mut ix);
    assert!(c.of(pods[2]).is_empty());
    let mut first = gpu(&kvs[..2]);
    first.insert(kvs[3].index_key(), Tier::Learned);
    assert_eq!(c.of(pods[0]), first);
    assert_eq!(ix.distinct_blocks(), 3);
    assert!(!ix.reported_by_a_pod(kvs[3]));
    assert_eq!(c.entries, fresh(&mut ix).entries);
}

#[test]
fn a_snapshot_page_lists_each_entry_of_a_pod_once_whatever_refers_to_it() {
    let other = "10.0.0.2:8000";
    let mut ix = index_with(IndexConfig {
        feed_max_hashes: 2,
        ..IndexConfig::default()
    });
    ix.add_pod(other, Some(MODEL), origin::STATIC, 0);
    let mut by_deltas = fresh(&mut ix);
    let t = tokens(0, 3);
    let kv = kv_chain(&t);
    // Two ranks, two tiers, and a learned entry on a block the pod stores: one entry each.
    let gpu = Some(Medium::Gpu);
    ix.handle(
        &msg(
            POD,
            0,
            &batch(vec![stored(&[1, 2, 3], None, t.clone(), gpu.clone())], 0),
        ),
        0,
    );
    let cpu = Some(Medium::Cpu);
    ix.handle(
        &msg(
            POD,
            0,
            &batch(vec![stored(&[1, 2], None, t.clone(), cpu)], 1),
        ),
        0,
    );
    ix.handle(
        &msg(
            other,
            0,
            &batch(vec![stored(&[7], None, t.clone(), None)], 0),
        ),
        0,
    );
    let learned_only = BlockHash::new(0xfeed_0000_0001);
    ix.apply_learned(
        &LearnedBatch {
            entries: vec![(POD.into(), vec![kv[2], learned_only])],
        },
        0,
    );
    // Rank 0 drops its GPU copy of block 2: rank 1's CPU copy is the best left.
    ix.handle(&msg(POD, 1, &batch(vec![removed(&[2], gpu)], 0)), 0);
    let mut want: HashMap<IndexKey, Tier> = HashMap::new();
    want.insert(kv[0].index_key(), Tier::Gpu);
    want.insert(kv[1].index_key(), Tier::Cpu);
    want.insert(kv[2].index_key(), Tier::Gpu);
    want.insert(learned_only.index_key(), Tier::Learned);
    let mut snapshot = Consumer::default();
    let u = snapshot.poll(&mut ix);
    let sent: usize = u
        .ops
        .iter()
        .filter(|op| u.pods[op.pod() as usize].address == POD)
        .map(|op| op.hashes().len())
        .sum();
    assert_eq!(sent, 4, "each of the pod's entries is sent once");
    assert_eq!(snapshot.of(POD), want);
    assert_eq!(snapshot.of(other).len(), 1);
    while by_deltas.cursor < ix.cursor() {
        by_deltas.poll(&mut ix);
    }
    assert_eq!(by_deltas.entries, snapshot.entries);
}
