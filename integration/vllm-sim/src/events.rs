//! KV-cache events as vLLM (>= 0.26) publishes them, and the ZMQ publisher.
//!
//! Wire format (see docs/vllm-kv-events.md and testdata/vllm-golden/):
//! one ZMQ message per engine step with 3 frames `[topic, seq (u64 BE), payload]`;
//! payload = msgpack array `[ts (f64), [event...], data_parallel_rank]`.
//! Events are msgpack maps whose first key is `"type"`, fields in vLLM's
//! order. vLLM encodes them with msgspec, which writes a `map16` header for
//! structs that have more than 15 fields (BlockStored) and a fixmap for the
//! others; we reproduce that byte for byte.

use std::collections::VecDeque;
use std::io::Write;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures_util::StreamExt;
use rmp::encode as enc;
use tokio::sync::mpsc;
use zeromq::{Socket, SocketRecv, SocketSend, ZmqMessage};

use crate::hash::{event_hash, BlockHash};

/// How long one connect attempt of a connecting publisher may take.
const RECONNECT_ATTEMPT: std::time::Duration = std::time::Duration::from_secs(1);
/// Pause between connect attempts (libzmq's default reconnect interval is 100 ms).
const RECONNECT_INTERVAL: std::time::Duration = std::time::Duration::from_millis(200);

/// Where a block lives (vLLM's `medium`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Medium {
    Gpu,
    /// CPU tier of vLLM's OffloadingConnector (placeholder stores, CPU evictions).
    Cpu,
}

impl Medium {
    fn wire(self) -> &'static str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
        }
    }
}

/// The KV-cache group an event belongs to (vLLM's `group_idx`, and on stores
/// `kv_cache_spec_kind` / `kv_cache_spec_sliding_window` when a model has several groups).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Group {
    pub idx: u32,
    pub kind: Option<&'static str>,
    pub sliding_window: Option<u32>,
}

impl Group {
    /// The only group of a plain (non-hybrid) model, as vLLM writes it: `group_idx` 0, no kind.
    pub const PLAIN: Group = Group {
        idx: 0,
        kind: None,
        sliding_window: None,
    };
}

/// Per-block extra keys of a store (vLLM's `extra_keys`: one entry per block, nil when a
/// block has none); `None` when no block has any (the field is then omitted, as vLLM does).
pub type ExtraKeys = Option<Vec<Option<Vec<String>>>>;

/// One KV-cache event (the fields the simulator sets). Hashes are full digests; the
/// wire form is chosen by [`HashEncoding`] when the batch is encoded.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    BlockStored {
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
        lora_id: Option<u32>,
        lora_name: Option<String>,
        medium: Medium,
        extra_keys: ExtraKeys,
        /// `None`: no group fields (vLLM's OffloadingConnector placeholders).
        group: Option<Group>,
    },
    BlockRemoved {
        block_hashes: Vec<BlockHash>,
        medium: Medium,
        group: Option<Group>,
    },
    AllBlocksCleared,
}

impl KvEvent {
    /// A GPU store of full blocks in the plain group, without LoRA or extra keys.
    #[cfg(test)]
    pub fn stored(
        block_hashes: Vec<BlockHash>,
        parent_block_hash: Option<BlockHash>,
        token_ids: Vec<u32>,
        block_size: u32,
    ) -> Self {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id: None,
            lora_name: None,
            medium: Medium::Gpu,
            extra_keys: None,
            group: Some(Group::PLAIN),
        }
    }

    /// A GPU removal in the plain group.
    #[cfg(test)]
    pub fn removed(block_hashes: Vec<BlockHash>) -> Self {
        KvEvent::BlockRemoved {
            block_hashes,
            medium: Medium::Gpu,
            group: Some(Group::PLAIN),
        }
    }

    /// vLLM's OffloadingConnector placeholder: blocks now also held in CPU memory, named by
    /// hash only (empty token_ids, block_size 0, medium "CPU", no parent, no group).
    pub fn cpu_placeholder(block_hashes: Vec<BlockHash>) -> Self {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash: None,
            token_ids: Vec::new(),
            block_size: 0,
            lora_id: None,
            lora_name: None,
            medium: Medium::Cpu,
            extra_keys: None,
            group: None,
        }
    }
}

/// vLLM's replay buffer size (`buffer_steps` default).
pub const REPLAY_BUFFER_STEPS: usize = 10_000;
/// Sequence number of the replay end marker.
pub const REPLAY_END_SEQ: u64 = u64::MAX;

type W = Vec<u8>;

fn str_(w: &mut W, s: &str) {
    // Writing into a Vec cannot fail.
    let _ = enc::write_str(w, s);
}

fn nil(w: &mut W) {
    let _ = enc::write_nil(w);
}

fn uint(w: &mut W, v: u64) {
    let _ = enc::write_uint(w, v);
}

/// How block hashes go on the wire, as vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HashEncoding {
    /// `=1` (vLLM's default): the last 8 bytes of the digest as an unsigned int.
    Int,
    /// `=0`: the digest as 32 bytes (msgpack bin8). Ours is `XXH3-128(digest) ‖ digest`
    /// (big-endian), so its last 8 bytes are the int form, as with vLLM's digests.
    Bytes,
}

impl HashEncoding {
    /// vLLM's environment switch; anything but `0`/`false` keeps ints.
    pub fn from_env() -> Self {
        match std::env::var("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES")
            .map(|v| v.trim().to_ascii_lowercase())
        {
            Ok(v) if v == "0" || v == "false" => HashEncoding::Bytes,
            _ => HashEncoding::Int,
        }
    }
}

/// The 32-byte wire form of a digest (see [`HashEncoding::Bytes`]).
pub fn hash_bytes32(h: BlockHash) -> [u8; 32] {
    let digest = h.to_be_bytes();
    let mut out = [0u8; 32];
    out[..16].copy_from_slice(&xxhash_rust::xxh3::xxh3_128(&digest).to_be_bytes());
    out[16..].copy_from_slice(&digest);
    out
}

fn hash_value(w: &mut W, h: BlockHash, e: HashEncoding) {
    match e {
        // msgspec writes non-negative ints in the smallest unsigned form.
        HashEncoding::Int => uint(w, event_hash(h)),
        HashEncoding::Bytes => {
            let _ = enc::write_bin(w, &hash_bytes32(h));
        }
    }
}

fn hashes(w: &mut W, hs: &[BlockHash], e: HashEncoding) {
    let _ = enc::write_array_len(w, hs.len() as u32);
    for h in hs {
        hash_value(w, *h, e);
    }
}

fn opt_uint(w: &mut W, v: Option<u32>) {
    match v {
        Some(v) => uint(w, u64::from(v)),
        None => nil(w),
    }
}

fn encode_event(w: &mut W, ev: &KvEvent, e: HashEncoding) {
    match ev {
        KvEvent::BlockStored {
            block_hashes,
            parent_block_hash,
            token_ids,
            block_size,
            lora_id,
            lora_name,
            medium,
            extra_keys,
            group,
        } => {
            // Fields in vLLM's order; optional ones only when set (msgspec omit_defaults).
            // The struct has > 15 fields, so msgspec always writes a map16 header.
            let fields = 8
                + u16::from(extra_keys.is_some())
                + group.map_or(0, |g| {
                    1 + u16::from(g.kind.is_some()) + u16::from(g.sliding_window.is_some())
                });
            w.push(0xde);
            w.extend_from_slice(&fields.to_be_bytes());
            str_(w, "type");
            str_(w, "BlockStored");
            str_(w, "block_hashes");
            hashes(w, block_hashes, e);
            str_(w, "parent_block_hash");
            match parent_block_hash {
                Some(p) => hash_value(w, *p, e),
                None => nil(w),
            }
            str_(w, "token_ids");
            let _ = enc::write_array_len(w, token_ids.len() as u32);
            for t in token_ids {
                uint(w, u64::from(*t));
            }
            str_(w, "block_size");
            uint(w, u64::from(*block_size));
            str_(w, "lora_id");
            opt_uint(w, *lora_id);
            str_(w, "medium");
            str_(w, medium.wire());
            str_(w, "lora_name");
            match lora_name {
                Some(n) => str_(w, n),
                None => nil(w),
            }
            if let Some(per_block) = extra_keys {
                str_(w, "extra_keys");
                let _ = enc::write_array_len(w, per_block.len() as u32);
                for keys in per_block {
                    match keys {
                        Some(keys) => {
                            let _ = enc::write_array_len(w, keys.len() as u32);
                            for k in keys {
                                str_(w, k);
                            }
                        }
                        None => nil(w),
                    }
                }
            }
            if let Some(g) = group {
                str_(w, "group_idx");
                uint(w, u64::from(g.idx));
                if let Some(kind) = g.kind {
                    str_(w, "kv_cache_spec_kind");
                    str_(w, kind);
                }
                if let Some(window) = g.sliding_window {
                    str_(w, "kv_cache_spec_sliding_window");
                    uint(w, u64::from(window));
                }
            }
        }
        KvEvent::BlockRemoved {
            block_hashes,
            medium,
            group,
        } => {
            let _ = enc::write_map_len(w, 3 + u32::from(group.is_some()));
            str_(w, "type");
            str_(w, "BlockRemoved");
            str_(w, "block_hashes");
            hashes(w, block_hashes, e);
            str_(w, "medium");
            str_(w, medium.wire());
            if let Some(g) = group {
                str_(w, "group_idx");
                uint(w, u64::from(g.idx));
            }
        }
        KvEvent::AllBlocksCleared => {
            let _ = enc::write_map_len(w, 1);
            str_(w, "type");
            str_(w, "AllBlocksCleared");
        }
    }
}

/// Encodes one batch `[ts, events, data_parallel_rank]` with int hashes (vLLM's default).
#[cfg(test)]
pub fn encode_batch(ts: f64, events: &[KvEvent], dp_rank: u32) -> Vec<u8> {
    encode_batch_with(ts, events, dp_rank, HashEncoding::Int)
}

/// Encodes one batch `[ts, events, data_parallel_rank]`.
pub fn encode_batch_with(ts: f64, events: &[KvEvent], dp_rank: u32, e: HashEncoding) -> Vec<u8> {
    let mut w = Vec::with_capacity(64 + events.len() * 64);
    let _ = enc::write_array_len(&mut w, 3);
    let _ = enc::write_f64(&mut w, ts);
    let _ = enc::write_array_len(&mut w, events.len() as u32);
    for ev in events {
        encode_event(&mut w, ev, e);
    }
    uint(&mut w, u64::from(dp_rank));
    let _ = w.flush();
    w
}

/// vLLM's rule: the publisher binds when the endpoint contains `*` or `::`
/// or is `ipc://` / `inproc://`; otherwise it connects.
pub fn should_bind(endpoint: &str) -> bool {
    endpoint.contains('*')
        || endpoint.contains("::")
        || endpoint.starts_with("ipc://")
        || endpoint.starts_with("inproc://")
}

/// The endpoint pod `i` of this process uses. Connecting pods share the
/// endpoint (the subscriber binds); binding pods cannot share a port, so pod i
/// binds port + i (like vLLM's data-parallel rank offset), or `path-i` for ipc.
pub fn pod_endpoint(endpoint: &str, i: u16) -> String {
    if i == 0 || !should_bind(endpoint) {
        return endpoint.to_string();
    }
    if let Some(path) = endpoint.strip_prefix("ipc://") {
        return format!("ipc://{path}-{i}");
    }
    if let Some(pos) = endpoint.rfind(':') {
        if let Ok(port) = endpoint[pos + 1..].parse::<u32>() {
            return format!("{}:{}", &endpoint[..pos], port + u32::from(i));
        }
    }
    endpoint.to_string()
}

/// Converts a bind endpoint in vLLM syntax for the zeromq crate (`*` → 0.0.0.0).
fn bind_addr(endpoint: &str) -> String {
    endpoint.replace("tcp://*:", "tcp://0.0.0.0:")
}

/// Shared replay ring: `(seq, payload)` of the last REPLAY_BUFFER_STEPS batches.
pub type ReplayBuffer = Arc<Mutex<VecDeque<(u64, Bytes)>>>;

/// Per-pod publisher state held by the engine: assigns sequence numbers,
/// keeps the replay buffer and hands encoded frames to the socket task.
pub struct Publisher {
    topic: Bytes,
    seq: u64,
    tx: Option<mpsc::UnboundedSender<ZmqMessage>>,
    replay: ReplayBuffer,
    encoding: HashEncoding,
}

impl Publisher {
    /// A publisher that only numbers batches (no socket): used when events are disabled and in tests.
    pub fn detached(topic: &str, encoding: HashEncoding) -> Self {
        Self {
            topic: Bytes::copy_from_slice(topic.as_bytes()),
            seq: 0,
            tx: None,
            replay: Arc::default(),
            encoding,
        }
    }

    pub fn replay_buffer(&self) -> ReplayBuffer {
        self.replay.clone()
    }

    /// Publishes one engine step's events (nothing when empty, as vLLM).
    pub fn publish(&mut self, events: Vec<KvEvent>) {
        if events.is_empty() {
            return;
        }
        let ts = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs_f64())
            .unwrap_or(0.0);
        let payload = Bytes::from(encode_batch_with(ts, &events, 0, self.encoding));
        let seq = self.seq;
        self.seq += 1;
        {
            let mut buf = self.replay.lock().unwrap_or_else(|e| e.into_inner());
            if buf.len() >= REPLAY_BUFFER_STEPS {
                buf.pop_front();
            }
            buf.push_back((seq, payload.clone()));
        }
        if let Some(tx) = &self.tx {
            let frames = vec![
                self.topic.clone(),
                Bytes::copy_from_slice(&seq.to_be_bytes()),
                payload,
            ];
            if let Ok(msg) = ZmqMessage::try_from(frames) {
                let _ = tx.send(msg);
            }
        }
    }
}

/// Starts the PUB socket task (bind or connect by vLLM's rule) and returns the publisher.
/// Connecting never blocks the pod: batches published while no subscriber is
/// connected are dropped, as a PUB socket does. Like libzmq under vLLM, a
/// connecting publisher reconnects when its subscriber goes away (a restarted
/// indexer must get the events again).
pub async fn start_publisher(
    endpoint: String,
    topic: &str,
    encoding: HashEncoding,
) -> Result<Publisher, zeromq::ZmqError> {
    let (tx, mut rx) = mpsc::unbounded_channel::<ZmqMessage>();
    let mut opts = zeromq::SocketOptions::default();
    opts.connect_timeout(RECONNECT_ATTEMPT);
    let mut sock = zeromq::PubSocket::with_options(opts);
    let bind = should_bind(&endpoint);
    if bind {
        sock.bind(&bind_addr(&endpoint)).await?;
    }
    let mut monitor = sock.monitor();
    tokio::spawn(async move {
        let mut connected = bind;
        let mut retry = tokio::time::interval(RECONNECT_INTERVAL);
        loop {
            tokio::select! {
                msg = rx.recv() => {
                    let Some(msg) = msg else { break };
                    if connected {
                        if let Err(e) = sock.send(msg).await {
                            eprintln!("vllm-sim: kv-events send failed: {e}");
                        }
                    }
                }
                event = monitor.next() => {
                    if let Some(zeromq::SocketEvent::Disconnected(_)) = event {
                        connected = bind;
                    }
                }
                _ = retry.tick(), if !connected => {
                    match sock.connect(&endpoint).await {
                        Ok(()) => connected = true,
                        Err(e) => eprintln!("vllm-sim: kv-events connect to {endpoint} failed (retrying): {e}"),
                    }
                }
            }
        }
    });
    Ok(Publisher {
        topic: Bytes::copy_from_slice(topic.as_bytes()),
        seq: 0,
        tx: Some(tx),
        replay: Arc::default(),
        encoding,
    })
}

/// Serves vLLM's replay protocol on a ROUTER socket: a DEALER sends
/// `["", start_seq (8 B BE)]`; the answer is `["", topic, seq, payload]` for every
/// buffered batch with seq >= start, then `["", "", 0xFFFF_FFFF_FFFF_FFFF, ""]`.
pub async fn start_replay(
    endpoint: String,
    topic: String,
    replay: ReplayBuffer,
) -> Result<(), zeromq::ZmqError> {
    let mut sock = zeromq::RouterSocket::new();
    sock.bind(&bind_addr(&endpoint)).await?;
    tokio::spawn(async move {
        loop {
            let msg = match sock.recv().await {
                Ok(m) => m,
                Err(zeromq::ZmqError::NoMessage) => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                    continue;
                }
                Err(_) => continue,
            };
            let frames = msg.into_vec();
            // [identity, "", start_seq]
            if frames.len() < 3 || frames[2].len() != 8 {
                continue;
            }
            let identity = frames[0].clone();
            let mut be = [0u8; 8];
            be.copy_from_slice(&frames[2]);
            let start = u64::from_be_bytes(be);
            let batches: Vec<(u64, Bytes)> = {
                let buf = replay.lock().unwrap_or_else(|e| e.into_inner());
                buf.iter().filter(|(s, _)| *s >= start).cloned().collect()
            };
            let topic_b = Bytes::copy_from_slice(topic.as_bytes());
            for (seq, payload) in batches {
                let frames = vec![
                    identity.clone(),
                    Bytes::new(),
                    topic_b.clone(),
                    Bytes::copy_from_slice(&seq.to_be_bytes()),
                    payload,
                ];
                if let Ok(m) = ZmqMessage::try_from(frames) {
                    let _ = sock.send(m).await;
                }
            }
            let end = vec![
                identity,
                Bytes::new(),
                Bytes::new(),
                Bytes::copy_from_slice(&REPLAY_END_SEQ.to_be_bytes()),
                Bytes::new(),
            ];
            if let Ok(m) = ZmqMessage::try_from(end) {
                let _ = sock.send(m).await;
            }
        }
    });
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn golden(name: &str) -> Vec<u8> {
        kvroute_testdata::golden_frame(name).unwrap_or_else(|e| panic!("{e}"))
    }

    const TS: f64 = 1_700_000_000.5;
    const H: [u128; 4] = [
        3262291359910021016,
        7142137847444424233,
        11309060389865205804,
        4393453693117533255,
    ];

    #[test]
    fn stored_from_root_matches_golden_bytes() {
        let ev = KvEvent::stored(H.to_vec(), None, (0..64).collect(), 16);
        assert_eq!(
            encode_batch(TS, &[ev], 0),
            golden("int_00_stored_4blocks_root.payload.msgpack")
        );
    }

    #[test]
    fn stored_with_parent_matches_golden_bytes() {
        let g = golden("int_01_stored_2blocks_with_parent.payload.msgpack");
        let v = rmpv::decode::read_value(&mut &g[..]).unwrap();
        let ev = &v[1][0];
        let hs: Vec<u128> = ev["block_hashes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| u128::from(x.as_u64().unwrap()))
            .collect();
        let toks: Vec<u32> = ev["token_ids"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as u32)
            .collect();
        let ours = KvEvent::stored(
            hs,
            ev["parent_block_hash"].as_u64().map(u128::from),
            toks,
            16,
        );
        assert_eq!(encode_batch(TS, &[ours], 0), g);
    }

    #[test]
    fn removed_cleared_and_mixed_match_golden_bytes() {
        let removed = KvEvent::removed(vec![H[3]]);
        assert_eq!(
            encode_batch(TS, std::slice::from_ref(&removed), 0),
            golden("int_03_removed_gpu.payload.msgpack")
        );
        assert_eq!(
            encode_batch(TS, &[KvEvent::AllBlocksCleared], 0),
            golden("int_05_all_cleared.payload.msgpack")
        );
        let stored = KvEvent::stored(vec![H[2], H[3]], Some(H[1]), (32..64).collect(), 16);
        let mixed = encode_batch(TS, &[stored, removed, KvEvent::AllBlocksCleared], 0);
        assert_eq!(
            mixed,
            golden("int_06_mixed_stored_removed_cleared.payload.msgpack")
        );
    }

    #[test]
    fn lora_and_extra_keys_have_vllm_field_order() {
        // Golden 02 also carries session_id, which we never set; every field we write
        // appears in the golden's order with its value (extra_keys included).
        let g = golden("int_02_stored_lora_extrakeys_session.payload.msgpack");
        let gv = rmpv::decode::read_value(&mut &g[..]).unwrap();
        let ours = encode_batch(
            TS,
            &[KvEvent::BlockStored {
                block_hashes: vec![H[0]],
                parent_block_hash: None,
                token_ids: (0..16).collect(),
                block_size: 16,
                lora_id: Some(7),
                lora_name: Some("my-lora".into()),
                medium: Medium::Gpu,
                extra_keys: Some(vec![Some(vec!["my-lora".into(), "salt-A".into()])]),
                group: Some(Group::PLAIN),
            }],
            0,
        );
        let ov = rmpv::decode::read_value(&mut &ours[..]).unwrap();
        let gm = gv[1][0].as_map().unwrap();
        let om = ov[1][0].as_map().unwrap();
        let golden_keys: Vec<&str> = gm.iter().map(|(k, _)| k.as_str().unwrap()).collect();
        let our_keys: Vec<&str> = om.iter().map(|(k, _)| k.as_str().unwrap()).collect();
        let filtered: Vec<&str> = golden_keys
            .iter()
            .copied()
            .filter(|k| our_keys.contains(k))
            .collect();
        assert_eq!(filtered, our_keys);
        assert_eq!(
            golden_keys.len(),
            our_keys.len() + 1,
            "only session_id is missing"
        );
        for (k, v) in om {
            let gvv = gm.iter().find(|(gk, _)| gk == k).map(|(_, v)| v).unwrap();
            assert_eq!(gvv, v, "field {k}");
        }
        // Header is map16 as msgspec writes it for BlockStored.
        assert_eq!(ours[11], 0xde);
    }

    #[test]
    fn cpu_removal_without_group_matches_golden_bytes() {
        let ev = KvEvent::BlockRemoved {
            block_hashes: vec![H[0], H[1]],
            medium: Medium::Cpu,
            group: None,
        };
        assert_eq!(
            encode_batch(TS, &[ev], 0),
            golden("int_04_removed_cpu_no_group.payload.msgpack")
        );
    }

    #[test]
    fn offload_placeholder_and_hybrid_group_shapes() {
        let batch = encode_batch(
            TS,
            &[
                KvEvent::cpu_placeholder(vec![H[0]]),
                KvEvent::BlockStored {
                    block_hashes: vec![H[1]],
                    parent_block_hash: Some(H[0]),
                    token_ids: (16..32).collect(),
                    block_size: 16,
                    lora_id: None,
                    lora_name: None,
                    medium: Medium::Gpu,
                    extra_keys: Some(vec![None]),
                    group: Some(Group {
                        idx: 1,
                        kind: Some("sliding_window"),
                        sliding_window: Some(128),
                    }),
                },
            ],
            0,
        );
        let v = rmpv::decode::read_value(&mut &batch[..]).unwrap();
        let keys = |e: &rmpv::Value| -> Vec<String> {
            e.as_map()
                .unwrap()
                .iter()
                .map(|(k, _)| k.as_str().unwrap().to_string())
                .collect()
        };
        let placeholder = &v[1][0];
        assert_eq!(
            keys(placeholder),
            [
                "type",
                "block_hashes",
                "parent_block_hash",
                "token_ids",
                "block_size",
                "lora_id",
                "medium",
                "lora_name"
            ]
        );
        assert_eq!(placeholder["token_ids"].as_array().unwrap().len(), 0);
        assert_eq!(placeholder["block_size"].as_u64(), Some(0));
        assert_eq!(placeholder["medium"].as_str(), Some("CPU"));
        let sliding = &v[1][1];
        assert_eq!(
            keys(sliding)[8..],
            [
                "extra_keys",
                "group_idx",
                "kv_cache_spec_kind",
                "kv_cache_spec_sliding_window"
            ]
        );
        assert!(sliding["extra_keys"][0].is_nil());
        assert_eq!(sliding["group_idx"].as_u64(), Some(1));
        assert_eq!(sliding["kv_cache_spec_sliding_window"].as_u64(), Some(128));
        // Every BlockStored keeps msgspec's map16 header, whatever its field count.
        assert_eq!(batch[11], 0xde);
    }

    #[test]
    fn golden_multipart_frames_match_our_framing() {
        // multipart.bin = per frame u32 BE length + bytes: topic, seq, payload.
        let g = golden("int_03_removed_gpu.multipart.bin");
        let mut frames = Vec::new();
        let mut i = 0;
        while i + 4 <= g.len() {
            let n = u32::from_be_bytes([g[i], g[i + 1], g[i + 2], g[i + 3]]) as usize;
            frames.push(g[i + 4..i + 4 + n].to_vec());
            i += 4 + n;
        }
        assert_eq!(frames.len(), 3);
        assert_eq!(frames[0], b"");
        assert_eq!(frames[1], 3u64.to_be_bytes());
        assert_eq!(
            frames[2],
            encode_batch(TS, &[KvEvent::removed(vec![H[3]])], 0)
        );
    }

    #[test]
    fn bind_rule_and_pod_endpoints() {
        assert!(should_bind("tcp://*:5557"));
        assert!(should_bind("tcp://[::]:5557"));
        assert!(should_bind("ipc:///tmp/kv"));
        assert!(!should_bind("tcp://127.0.0.1:5557"));
        assert_eq!(pod_endpoint("tcp://*:5557", 2), "tcp://*:5559");
        assert_eq!(
            pod_endpoint("tcp://127.0.0.1:5557", 2),
            "tcp://127.0.0.1:5557"
        );
        assert_eq!(pod_endpoint("ipc:///tmp/kv", 1), "ipc:///tmp/kv-1");
        assert_eq!(bind_addr("tcp://*:5557"), "tcp://0.0.0.0:5557");
    }

    #[test]
    fn publisher_numbers_batches_and_bounds_replay() {
        let mut p = Publisher::detached("t", HashEncoding::Int);
        p.publish(vec![]);
        assert!(p.replay_buffer().lock().unwrap().is_empty());
        for _ in 0..3 {
            p.publish(vec![KvEvent::AllBlocksCleared]);
        }
        let seqs: Vec<u64> = p
            .replay_buffer()
            .lock()
            .unwrap()
            .iter()
            .map(|(s, _)| *s)
            .collect();
        assert_eq!(seqs, vec![0, 1, 2]);
    }
}

/// Interop with kvroute's own decoder (indexer/src/vllm_wire/decode.rs), which the indexer uses on real vLLM pods.
#[cfg(test)]
mod interop_tests {
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
        let root = kvroute_core::hash::root_hash(
            kvroute_core::hash::Domain::Tokens,
            "Qwen/Qwen3-32B",
            None,
        );
        let theirs = kvroute_core::hash::token_block_hashes(root, &toks, 16, 64);
        assert_eq!(theirs.len(), ours.len());
        assert!(ours.iter().all(|h| theirs.iter().all(|t| t.get() != *h)));
    }
}

/// vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` form against the `bytes_*` golden captures.
#[cfg(test)]
mod bytes_tests {
    use super::*;

    fn golden(name: &str) -> Vec<u8> {
        kvroute_testdata::golden_frame(name).unwrap_or_else(|e| panic!("{e}"))
    }

    /// The value with every hash (bin) replaced by a marker, so structures compare.
    fn shape(v: &rmpv::Value) -> rmpv::Value {
        use rmpv::Value as V;
        match v {
            V::Binary(b) => V::from(format!("bin{}", b.len())),
            V::Array(a) => V::Array(a.iter().map(shape).collect()),
            V::Map(m) => V::Map(m.iter().map(|(k, x)| (k.clone(), shape(x))).collect()),
            other => other.clone(),
        }
    }

    fn decode(b: &[u8]) -> rmpv::Value {
        rmpv::decode::read_value(&mut &b[..]).unwrap()
    }

    #[test]
    fn bytes_hashes_match_golden_structure() {
        let d = crate::hash::chain(&(0..64).collect::<Vec<u32>>(), 16);
        let e = HashEncoding::Bytes;
        let stored = KvEvent::stored(d.clone(), None, (0..64).collect(), 16);
        let ours = encode_batch_with(1_700_000_000.5, &[stored], 0, e);
        let g = golden("bytes_00_stored_4blocks_root.payload.msgpack");
        assert_eq!(ours.len(), g.len());
        assert_eq!(shape(&decode(&ours)), shape(&decode(&g)));
        let with_parent = KvEvent::stored(d[2..].to_vec(), Some(d[1]), (32..64).collect(), 16);
        let removed = KvEvent::removed(vec![d[3]]);
        let mixed = encode_batch_with(
            1_700_000_000.5,
            &[with_parent, removed, KvEvent::AllBlocksCleared],
            0,
            e,
        );
        let g = golden("bytes_06_mixed_stored_removed_cleared.payload.msgpack");
        assert_eq!(mixed.len(), g.len());
        assert_eq!(shape(&decode(&mixed)), shape(&decode(&g)));
    }

    #[test]
    fn bytes_form_ends_with_the_int_form() {
        let h: BlockHash = 0x0102_0304_0506_0708_1122_3344_5566_7788;
        let b = hash_bytes32(h);
        assert_eq!(b[24..], event_hash(h).to_be_bytes());
        assert_eq!(b[16..], h.to_be_bytes());
        // vLLM's captures have the same relation between their two forms.
        let g = golden("bytes_03_removed_gpu.payload.msgpack");
        let v = decode(&g);
        let bin = v[1][0]["block_hashes"][0].as_slice().unwrap().to_vec();
        assert_eq!(bin[24..], 4393453693117533255u64.to_be_bytes());
    }
}
