//! vLLM KV-cache events on the wire: the msgpack payload decoder (rmp-serde;
//! rmp for the keys, names and token ids of map-encoded events), the sequence
//! and topic frames, and an rmp encoder of the same shapes for tests and
//! benchmarks.
//!
//! Both event encodings vLLM has used are accepted: maps (vLLM ≥ 0.26,
//! `{"type": "BlockStored", ...}`, fields in any order) and positional arrays
//! (vLLM ≤ 0.20, `["BlockStored", hashes, parent, ...]`, trailing fields
//! optional), inside a batch `[ts, events]` or `[ts, events, data_parallel_rank]`.
//! Unknown fields are skipped; unknown event types decode to
//! [`KvEvent::Unknown`]. Block hashes may be unsigned ints (u64), signed ints
//! (older builds, read as the same 64 bits) or byte strings
//! (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0`), folded by [`fold_hash_bytes`].
//!
//! Events are decoded one by one: an event that is well-formed msgpack but not
//! a valid event (a wrong field type, a missing field) is skipped and reported
//! in [`DecodedBatch::skipped`], and the rest of its batch is kept. Only a
//! payload that is not a msgpack batch at all is refused as a whole.

use std::fmt;

use kvroute_core::address::is_pod_address;
use kvroute_core::feed::Tier;
use kvroute_core::hash::ExtraKey;

mod decode;
mod encode;

pub use decode::decode_batch;
pub use encode::{encode_batch, Encoding, HashForm};

/// One ZMQ message payload: a batch of events from one publisher.
#[derive(Debug, Clone, PartialEq)]
pub struct EventBatch {
    /// Publisher timestamp (seconds since the epoch).
    pub ts: f64,
    /// Events in publication order.
    pub events: Vec<KvEvent>,
    /// vLLM data-parallel rank of the engine that published the batch.
    pub data_parallel_rank: Option<i64>,
}

/// A decoded payload: the usable events, and why the others were skipped.
#[derive(Debug, Clone, PartialEq)]
pub struct DecodedBatch {
    pub batch: EventBatch,
    pub skipped: Vec<EventError>,
}

/// One KV-cache event.
#[derive(Debug, Clone, PartialEq)]
pub enum KvEvent {
    /// Blocks were filled and are now cached.
    BlockStored(BlockStored),
    /// Blocks were evicted.
    BlockRemoved(BlockRemoved),
    /// The whole prefix cache was dropped.
    AllBlocksCleared,
    /// An event type this decoder does not know (kept so it can be counted).
    Unknown { tag: String },
}

/// A `BlockStored` event.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockStored {
    /// vLLM's hashes of the stored blocks, in chain order.
    pub block_hashes: Vec<u64>,
    /// vLLM's hash of the block preceding the first one; `None` at the root.
    pub parent_block_hash: Option<u64>,
    /// Tokens of all stored blocks, concatenated (empty in CPU-offload placeholders).
    pub token_ids: Vec<u32>,
    /// Tokens per block (0 in CPU-offload placeholders).
    pub block_size: u32,
    /// LoRA adapter id, when the request used one.
    pub lora_id: Option<i64>,
    /// Storage medium (`None`: GPU).
    pub medium: Option<Medium>,
    /// LoRA adapter name (vLLM ≥ 0.26).
    pub lora_name: Option<String>,
    /// Per block: the extra keys vLLM hashed it with (LoRA name, multimodal
    /// identifiers, cache salt on block 0), `None` when it had none.
    pub extra_keys: Option<Vec<Option<Vec<ExtraKey>>>>,
    /// KV-cache group (hybrid models).
    pub group_idx: Option<i64>,
    /// Kind of the group's KV-cache spec (`full_attention`, `sliding_window`, `mamba`…).
    pub kv_cache_spec_kind: Option<String>,
}

impl BlockStored {
    /// vLLM's offloading connectors announce blocks copied to CPU memory with
    /// an event that carries no tokens and block size 0: only their hashes.
    pub fn is_placeholder(&self) -> bool {
        self.block_size == 0 && self.token_ids.is_empty()
    }
}

/// A `BlockRemoved` event.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct BlockRemoved {
    /// vLLM's hashes of the removed blocks.
    pub block_hashes: Vec<u64>,
    /// Storage medium the blocks were removed from (`None`: GPU).
    pub medium: Option<Medium>,
    /// KV-cache group (hybrid models).
    pub group_idx: Option<i64>,
}

/// vLLM storage medium of a block.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Medium {
    /// `"GPU"`.
    Gpu,
    /// `"CPU"`.
    Cpu,
    /// Any other medium name (disk, remote stores…), as sent.
    Other(String),
}

impl Medium {
    fn parse(name: &str) -> Medium {
        if name.eq_ignore_ascii_case("GPU") {
            Medium::Gpu
        } else if name.eq_ignore_ascii_case("CPU") {
            Medium::Cpu
        } else {
            Medium::Other(name.to_owned())
        }
    }

    fn name(&self) -> &str {
        match self {
            Medium::Gpu => "GPU",
            Medium::Cpu => "CPU",
            Medium::Other(name) => name,
        }
    }

    /// The feed tier of a medium: GPU (or no medium) → `Gpu`, CPU → `Cpu`,
    /// anything else → `Disk`.
    pub fn tier(medium: Option<&Medium>) -> Tier {
        match medium {
            None | Some(Medium::Gpu) => Tier::Gpu,
            Some(Medium::Cpu) => Tier::Cpu,
            Some(Medium::Other(_)) => Tier::Disk,
        }
    }
}

/// Why a payload, or one event of it, could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EventError {
    /// The input ended inside a value.
    Truncated,
    /// Bytes that are not msgpack, or a value of the wrong msgpack type.
    Malformed(String),
    /// Nesting deeper than the decoder follows.
    TooDeep,
    /// An integer outside the range of its field.
    OutOfRange,
    /// Well-formed msgpack that is not a valid batch or event (missing
    /// field, wrong type of a field…).
    Invalid(String),
    /// Bytes left after the batch.
    TrailingBytes(usize),
    /// A sequence frame that is not 8 bytes.
    BadSeqFrame(usize),
}

impl fmt::Display for EventError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EventError::Truncated => write!(f, "truncated msgpack"),
            EventError::Malformed(why) => write!(f, "malformed msgpack: {why}"),
            EventError::TooDeep => write!(f, "nesting too deep"),
            EventError::OutOfRange => write!(f, "integer out of range"),
            EventError::Invalid(why) => write!(f, "invalid event: {why}"),
            EventError::TrailingBytes(n) => write!(f, "{n} trailing bytes after the batch"),
            EventError::BadSeqFrame(n) => write!(f, "sequence frame of {n} bytes, expected 8"),
        }
    }
}

impl std::error::Error for EventError {}

impl EventError {
    /// Short stable label for metrics.
    pub fn kind(&self) -> &'static str {
        match self {
            EventError::Truncated => "truncated",
            EventError::Malformed(_) => "malformed",
            EventError::TooDeep => "too_deep",
            EventError::OutOfRange => "out_of_range",
            EventError::Invalid(_) => "invalid",
            EventError::TrailingBytes(_) => "trailing_bytes",
            EventError::BadSeqFrame(_) => "bad_seq_frame",
        }
    }
}

impl From<rmp_serde::decode::Error> for EventError {
    fn from(e: rmp_serde::decode::Error) -> Self {
        use rmp_serde::decode::Error as E;
        match e {
            E::InvalidMarkerRead(io) | E::InvalidDataRead(io)
                if io.kind() == std::io::ErrorKind::UnexpectedEof =>
            {
                EventError::Truncated
            }
            E::DepthLimitExceeded => EventError::TooDeep,
            E::OutOfRange => EventError::OutOfRange,
            E::Syntax(why) | E::Uncategorized(why) => EventError::Invalid(why),
            // 0xc1 starts no msgpack value; any other marker is valid msgpack
            // of a type the field does not take.
            E::TypeMismatch(marker) if marker != rmp::Marker::Reserved => {
                EventError::Invalid(format!("unexpected {marker:?}"))
            }
            other => EventError::Malformed(other.to_string()),
        }
    }
}

impl From<rmp::decode::ValueReadError> for EventError {
    fn from(e: rmp::decode::ValueReadError) -> Self {
        rmp_serde::decode::Error::from(e).into()
    }
}

/// Folds a byte-string block hash to a u64: the last 8 bytes read big-endian
/// (zero-padded on the left when shorter). vLLM's int form is the low 8 bytes
/// of the same digest, so both forms of one block fold to the same value.
pub fn fold_hash_bytes(bytes: &[u8]) -> u64 {
    let tail = if bytes.len() > 8 {
        &bytes[bytes.len() - 8..]
    } else {
        bytes
    };
    tail.iter().fold(0u64, |acc, b| (acc << 8) | u64::from(*b))
}

/// Decodes the 8-byte big-endian sequence frame.
pub fn decode_seq(frame: &[u8]) -> Result<u64, EventError> {
    let a: [u8; 8] = frame
        .try_into()
        .map_err(|_| EventError::BadSeqFrame(frame.len()))?;
    Ok(u64::from_be_bytes(a))
}

/// Pod identity carried in a topic `kv@<host:port>@<model>`, borrowed from
/// the topic (read on every message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TopicIdentity<'a> {
    /// `host:port` of the pod's HTTP server.
    pub address: &'a str,
    /// Served model name (may be empty).
    pub model: &'a str,
}

/// Parses the topic convention `kv@<host:port>@<model>`; `None` for any
/// other topic (e.g. vLLM's default empty topic or `kv@dp0`) and for an
/// address the filters' destination header could not carry
/// ([`is_pod_address`]). The model is everything after the second `@`
/// (model names may contain `@`).
pub fn parse_topic(topic: &str) -> Option<TopicIdentity<'_>> {
    let rest = topic.strip_prefix("kv@")?;
    let (address, model) = match rest.split_once('@') {
        Some((a, m)) => (a, m),
        None => (rest, ""),
    };
    is_pod_address(address).then_some(TopicIdentity { address, model })
}

#[cfg(test)]
mod tests;
