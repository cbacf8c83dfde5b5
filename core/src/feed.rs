//! The indexer → Envoy feed, version 2: a compact little-endian binary codec
//! (on [`crate::codec`]).
//!
//! Dependency-free (it is linked into the wasm filter). The decoder never
//! panics: every count is checked against the bytes that remain before
//! anything is allocated, and every failure is a typed [`FeedError`].
//!
//! Wire format of a [`FeedMessage`], one answer of `GET /v1/feed` (integers
//! little-endian; `varint` = minimal unsigned LEB128; `str` = varint byte
//! length + UTF-8; `key` = an index key, [`crate::hash::IndexKey`], of 40 bits):
//!
//! ```text
//! magic    "KVRF"                      4 bytes
//! version  u16 = 3                     (versions 1 and 2 are refused: UnsupportedVersion)
//! flags    u16   bit 0 PAGE: a page of a snapshot   bit 1 PODS: the pod list follows
//!                bit 2 LOAD: the load list follows (never with PODS)
//!                bit 3 MORE: ask again at once (deltas: more are waiting;
//!                            a page: the next page, whose token follows)
//!                other bits must be 0
//! epoch         u64
//! cursor        u64                    delta: position after it; page: the snapshot's position
//! pods_version  u64                    digest of the pod list's addresses, models, capacities, speeds
//! load_version  u64                    digest of the pods' load
//! PAGE:  page u32 (0: the first page, which replaces all state)
//! PAGE and MORE: next page token: start u64, has_after u8 (0 or 1), [after u64]
//! PODS:  varint n_pods, n_pods × pod:
//!            address str, varint n_models, n_models × str,
//!            capacity_blocks varint, speed u32 (f32 bits: 0 not stated, else finite in (0, 1000]),
//!            waiting varint, running varint, kv_usage u32 (f32 bits)
//! LOAD:  varint n, n × (waiting varint, running varint, kv_usage u32), in pod-list order
//! varint n_runs, n_runs × run:
//!     varint pod << 3 | op    op 0–3 Stored in tier 0 GPU, 1 CPU, 2 disk, 3 learned;
//!                             4 Removed;  5 Cleared; pod: index into the pod list
//!     Stored, Removed: varint n, then the n keys ascending, Elias–Fano packed (see below)
//! (no trailing bytes)
//! ```
//!
//! A packed key list of n ascending keys uses `low` bits per key, the value
//! of 8..=40 whose total is the fewest bytes (ties: the larger `low`), and
//! `high` = 40 − `low`: a bit stream (least significant bit of each byte
//! first) of the n keys' low `low` bits in order, then, when `high` > 0, the
//! high parts in unary: for each key, (its high part − the previous key's)
//! 0 bits then a 1 bit, then 0 bits up to n + 2^high − 1 bits; zero padding
//! to a whole byte. A run of 20 keys takes 94 bytes instead of 100, a
//! snapshot's 13,445 keys of one pod 3.5 bytes a key (docs/contracts.md).
//!
//! A delta or idle poll carries neither list when the consumer's versions are
//! current (a 41-byte idle poll); a page carries at most the indexer's
//! `--feed-max-hashes` keys (more only when one key's holders outnumber
//! them). A snapshot's pages are ascending, disjoint ranges of the index key,
//! each with every (pod, key, tier) of its range, so a page lands on one run
//! of the consumer's buckets; the token ([`PageToken`]) is opaque to the
//! consumer and names the next range's first key. [`crate::feed_client::FeedClient`] keeps the lists
//! and the paging state and turns each message into a [`FeedUpdate`], the form
//! routing consumes. [`encode`]/[`decode`] carry a [`FeedUpdate`] in the same
//! format between the VMs of one proxy: the pod list when it changed, the
//! load alone when only that did, with the list's `pods_version` either way.
//!
//! A [`LearnedBatch`] (`POST /v1/learned`), version 1 and full 64-bit hashes:
//!
//! ```text
//! magic "KVRL", version u16 = 1, flags u16 = 0,
//! n_entries u32, then n_entries × (address: u32 length + UTF-8, n u32, n × u64 hash)
//! ```
//!
//! Semantics (see docs/contracts.md): `pods` is the complete current pod set
//! (a consumer drops every pod absent from it); `Stored` sets the tier of
//! each (pod, key) — the best tier the indexer holds for it, replacing any
//! tier sent before; `Removed` drops the (pod, key) whatever its tier;
//! `Cleared` drops every entry of the pod. The first page of a snapshot
//! replaces all state; the following pages add to it.

use crate::codec::CodecError;
use crate::hash::{BlockHash, IndexKey};
use std::fmt;

mod decode;
mod encode;
mod packed_keys;

pub use decode::{decode, decode_learned, decode_message};
pub use encode::{
    encode, encode_forward, encode_learned, encode_message, load_version, pods_version, Lists,
};

/// Magic bytes of an encoded [`FeedMessage`].
pub const FEED_MAGIC: [u8; 4] = *b"KVRF";
/// Magic bytes of an encoded [`LearnedBatch`].
pub const LEARNED_MAGIC: [u8; 4] = *b"KVRL";
/// Feed format version written by this encoder and accepted by the decoder.
pub const FEED_VERSION: u16 = 3;
/// Learned-batch format version.
pub const LEARNED_VERSION: u16 = 1;

const FLAG_PAGE: u16 = 1;
const FLAG_PODS: u16 = 2;
const FLAG_LOAD: u16 = 4;
const FLAG_MORE: u16 = 8;
const OP_REMOVED: u8 = 4;
const OP_CLEARED: u8 = 5;
/// Bits of a run's first varint that hold the op (the pod index is above them).
const OP_BITS: u32 = 3;
/// Smallest encoded pod: empty address, no models, three 1-byte varints, speed, kv_usage.
const MIN_POD_BYTES: usize = 1 + 1 + 3 + 4 + 4;
/// Largest speed a pod list may state (the plugin config's `endpoints[].speed` bound).
pub const MAX_SPEED: f32 = 1000.0;
/// Smallest encoded load: two 1-byte varints, kv_usage.
const MIN_LOAD_BYTES: usize = 2 + 4;
/// Smallest encoded run: op and pod in one varint.
const MIN_RUN_BYTES: usize = 1;
/// Smallest encoded learned entry: empty address + empty hash list.
const MIN_LEARNED_ENTRY_BYTES: usize = 4 + 4;

/// The routing state change of one feed message, with the complete pod list
/// (or word that it is unchanged): what [`crate::router::Cluster::apply_feed`]
/// consumes.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FeedUpdate {
    /// Identifies the indexer's delta log; changes when the indexer restarts.
    pub epoch: u64,
    /// Position in the delta log after applying this update.
    pub cursor: u64,
    /// True when this update replaces all state instead of extending it (the
    /// first page of a snapshot; the following pages extend it).
    pub snapshot: bool,
    /// The complete current pod set (empty when `pods_unchanged`); ops refer
    /// to pods by their place in the list last sent.
    pub pods: Vec<PodInfo>,
    /// The pod list is that of the previous update: `pods` is then empty,
    /// and nothing adopts it again; the block operations name pods of that
    /// list. Its load is unchanged too, unless `load` says otherwise. At
    /// 1,000 pods copying or adopting the list costs O(pods) work, at every
    /// poll (docs/results/2026-12-04-feed-forward).
    pub pods_unchanged: bool,
    /// Only the load changed (`pods_unchanged`): each pod's new load, in the
    /// order of the list last sent. Decoding and comparing a repeated list
    /// cost each worker 0.4–0.9 ms at 1,000 pods, at every load change.
    pub load: Option<Vec<PodLoad>>,
    /// The indexer's digest of the pod list the update's pods, load and
    /// operations refer to ([`pods_version`]); 0: not stated. A consumer
    /// applies a `load` only to the list of the same digest.
    pub pods_version: u64,
    /// Block operations, in order.
    pub ops: Vec<BlockOp>,
}

impl FeedUpdate {
    /// What the update carries of the pods: the list when it changed, else
    /// the load alone when only that changed.
    pub fn lists(&self) -> Lists<'_> {
        match (&self.load, self.pods_unchanged) {
            (_, false) => Lists::Pods(&self.pods),
            (Some(load), true) => Lists::Load(load),
            (None, true) => Lists::None,
        }
    }
}

/// A pod as the indexer knows it, with its reported load.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct PodInfo {
    /// `host:port`, as written into `x-gateway-destination-endpoint`.
    pub address: String,
    /// Served model names (empty: unknown / every model).
    pub models: Vec<String>,
    /// KV capacity in blocks (0: unknown, use the configured default).
    pub capacity_blocks: u32,
    /// Relative speed (prefill and decode) against a reference pod at 1.0,
    /// as the indexer's pod source states it; 0: not stated. A consumer
    /// prefers its own configured speed for the pod, then this, then 1.0.
    pub speed: f32,
    /// `vllm:num_requests_waiting`.
    pub waiting: u32,
    /// `vllm:num_requests_running`.
    pub running: u32,
    /// `vllm:kv_cache_usage_perc`, a fraction in 0..=1.
    pub kv_usage: f32,
}

/// The load part of a [`PodInfo`], sent alone when only the load changed.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PodLoad {
    pub waiting: u32,
    pub running: u32,
    pub kv_usage: f32,
}

impl PodInfo {
    /// False for an address no destination header may carry
    /// ([`crate::address::is_pod_address`]): consumers skip such a pod.
    pub fn has_pod_address(&self) -> bool {
        crate::address::is_pod_address(&self.address)
    }

    pub fn load(&self) -> PodLoad {
        PodLoad {
            waiting: self.waiting,
            running: self.running,
            kv_usage: self.kv_usage,
        }
    }

    pub fn set_load(&mut self, load: PodLoad) {
        self.waiting = load.waiting;
        self.running = load.running;
        self.kv_usage = load.kv_usage;
    }
}

/// Where a block is held.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Tier {
    /// In GPU memory (vLLM medium `GPU`, or no medium given).
    Gpu,
    /// Offloaded to CPU memory.
    Cpu,
    /// Offloaded to disk or any other lower medium.
    Disk,
    /// Not reported by the pod: learned from a proxy's routing decision.
    Learned,
}

impl Tier {
    /// Wire code of the tier.
    pub fn code(self) -> u8 {
        match self {
            Tier::Gpu => 0,
            Tier::Cpu => 1,
            Tier::Disk => 2,
            Tier::Learned => 3,
        }
    }

    /// The tier of a wire code.
    pub fn from_code(code: u8) -> Option<Tier> {
        match code {
            0 => Some(Tier::Gpu),
            1 => Some(Tier::Cpu),
            2 => Some(Tier::Disk),
            3 => Some(Tier::Learned),
            _ => None,
        }
    }
}

/// A change to the block index, by the index keys of kvroute block hashes
/// (what the wire carries: [`crate::hash::INDEX_KEY_BITS`] bits of each).
#[derive(Debug, Clone, PartialEq)]
pub enum BlockOp {
    /// The pod holds these blocks in `tier` (replaces any earlier tier).
    Stored {
        pod: u32,
        tier: Tier,
        hashes: Vec<IndexKey>,
    },
    /// The pod no longer holds these blocks (any tier).
    Removed { pod: u32, hashes: Vec<IndexKey> },
    /// The pod holds nothing.
    Cleared { pod: u32 },
}

impl BlockOp {
    /// Index of the pod the op refers to.
    pub fn pod(&self) -> u32 {
        match self {
            BlockOp::Stored { pod, .. }
            | BlockOp::Removed { pod, .. }
            | BlockOp::Cleared { pod } => *pod,
        }
    }

    /// Index keys the op carries.
    pub fn hashes(&self) -> &[IndexKey] {
        match self {
            BlockOp::Stored { hashes, .. } | BlockOp::Removed { hashes, .. } => hashes,
            BlockOp::Cleared { .. } => &[],
        }
    }
}

/// Where the next page of a snapshot starts: opaque to the consumer, which
/// sends it back as it came (`page_pod` and `page_after` in the query). The
/// indexer of this release puts the first index key of the next page's key
/// range in `start` and no `after`; earlier ones paged by pod (`start` the
/// pod key, `after` the last hash sent of a pod cut across pages). The layout
/// is unchanged, so either indexer serves either consumer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PageToken {
    pub start: u64,
    pub after: Option<u64>,
}

/// What kind of answer a [`FeedMessage`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FeedKind {
    /// Ops after the consumer's cursor; `more`: the indexer holds more, ask again at once.
    Delta { more: bool },
    /// One page of a snapshot; `next`: the token of the following page.
    Page {
        number: u32,
        next: Option<PageToken>,
    },
}

impl Default for FeedKind {
    fn default() -> Self {
        FeedKind::Delta { more: false }
    }
}

/// One answer of `GET /v1/feed`, as sent.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FeedMessage {
    pub epoch: u64,
    pub cursor: u64,
    /// See [`pods_version`].
    pub pods_version: u64,
    /// See [`load_version`].
    pub load_version: u64,
    pub kind: FeedKind,
    /// The pod list, when the consumer's `pods_version` is not current.
    pub pods: Option<Vec<PodInfo>>,
    /// The pods' load in pod-list order, when only the load changed.
    pub load: Option<Vec<PodLoad>>,
    pub ops: Vec<BlockOp>,
}

/// Approximate routing decisions of one proxy (`POST /v1/learned`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct LearnedBatch {
    /// (pod address, kvroute block hashes routed to it).
    pub entries: Vec<(String, Vec<BlockHash>)>,
}

/// Why a feed or learned message could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeedError {
    /// The message does not start with the expected magic bytes.
    BadMagic,
    /// A version this decoder does not know.
    UnsupportedVersion(u16),
    /// Flag bits this decoder does not know, or a combination it refuses.
    UnknownFlags(u16),
    /// The bytes themselves could not be read (truncated, bad varint, …).
    Codec(CodecError),
    /// A value too large for its field.
    TooLarge { what: &'static str },
    /// Unknown block-op kind.
    BadOpKind(u8),
    /// An op names a pod index outside `pods`.
    PodOutOfRange { pod: u32, pods: usize },
    /// A byte that must be 0 or 1.
    BadBool { what: &'static str },
    /// A pod speed that is neither 0 (not stated) nor finite in (0, [`MAX_SPEED`]): its bits.
    BadSpeed(u32),
    /// A packed key list whose keys do not ascend or with a bit set past its last key.
    BadKeyList,
    /// Bytes left after the message.
    TrailingBytes(usize),
}

impl fmt::Display for FeedError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FeedError::BadMagic => write!(f, "bad magic"),
            FeedError::UnsupportedVersion(v) => write!(
                f,
                "unsupported feed version {v} (this filter reads version {FEED_VERSION}: \
                 run the kvroute-indexer of the same release)"
            ),
            FeedError::UnknownFlags(x) => write!(f, "unknown flags {x:#06x}"),
            FeedError::Codec(e) => e.fmt(f),
            FeedError::TooLarge { what } => write!(f, "{what} is too large"),
            FeedError::BadOpKind(k) => write!(f, "unknown op kind {k}"),
            FeedError::PodOutOfRange { pod, pods } => {
                write!(f, "op names pod {pod} of {pods}")
            }
            FeedError::BadBool { what } => write!(f, "{what} is neither 0 nor 1"),
            FeedError::BadSpeed(bits) => write!(
                f,
                "pod speed {} is neither 0 nor in (0, {MAX_SPEED}]",
                f32::from_bits(*bits)
            ),
            FeedError::BadKeyList => {
                write!(
                    f,
                    "packed keys out of order or with a bit set past the last"
                )
            }
            FeedError::TrailingBytes(n) => write!(f, "{n} trailing bytes"),
        }
    }
}

impl std::error::Error for FeedError {}

impl From<CodecError> for FeedError {
    fn from(e: CodecError) -> FeedError {
        FeedError::Codec(e)
    }
}

#[cfg(test)]
mod tests;
