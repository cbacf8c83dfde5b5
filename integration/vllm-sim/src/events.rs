//! KV-cache events as vLLM (>= 0.26) publishes them, and the ZMQ publisher.
//!
//! Wire format (see docs/vllm-kv-events.md and testdata/vllm-golden/):
//! one ZMQ message per engine step with 3 frames `[topic, seq (u64 BE), payload]`;
//! payload = msgpack array `[ts (f64), [event...], data_parallel_rank]`.
//! Events are msgpack maps whose first key is `"type"`, fields in vLLM's
//! order. vLLM encodes them with msgspec, which writes a `map16` header for
//! structs that have more than 15 fields (BlockStored) and a fixmap for the
//! others; we reproduce that byte for byte.

use std::io::Write;

use rmp::encode as enc;

use crate::hash::{event_hash, BlockHash};

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

mod publisher;
pub use publisher::{pod_endpoint, start_publisher, start_replay, Publisher};

#[cfg(test)]
mod tests;

#[cfg(test)]
mod interop_tests;

#[cfg(test)]
mod bytes_tests;
