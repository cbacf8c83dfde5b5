//! The indexer's state: pods, per-publisher sequence tracking, the block
//! index (vLLM hash → kvroute hash per pod and rank), learned entries and the
//! feed delta log. Pure and synchronous: the service wraps it in a mutex and
//! feeds it messages; tests and the benchmark drive it directly.
//!
//! One concern per file: `pods` (discovery, load, liveness), `sequence`
//! (per-publisher ordering and replay), `sources` (a publisher's blocks and
//! the events applied to them), `source_table` (a group's vLLM-hash table),
//! `block_table` (the block records by kvroute hash), `blocks` (the block → pod map),
//! `key_ranges` (the records' ids by key range, for snapshot pages), `learned`
//! (proxy-reported entries), `feed_log` (the delta log), `feed` ([`Index::feed`]:
//! deltas, snapshot pages, versioned pod list),
//! `held` (what each pod holds of one prompt, for `POST /v1/lookup`),
//! `least_loaded` (the serving pods in load order, for the same), `origin`
//! (how a pod became known), `keys`
//! (the newtypes of pod keys and block hashes), `prefetch` (cache hints for
//! the table probes of one event).

mod block_table;
mod blocks;
mod buckets;
mod feed;
mod feed_log;
mod hashing;
mod held;
mod key_ranges;
mod keys;
mod learned;
mod least_loaded;
pub mod origin;
mod pods;
mod prefetch;
mod sequence;
mod source_table;
mod sources;

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::Hasher;

use crate::metrics::Metrics;

use blocks::Blocks;
use feed_log::LogOp;
pub use hashing::{BuildMix, MixHasher};
pub use held::PodView;
use keys::BlockHash;
pub use keys::PodKey;
use least_loaded::LeastLoaded;
pub use least_loaded::Load;
use pods::Pod;

// ------------------------------------------------------------------ config

/// Tunables of the index (flags of the service).
#[derive(Debug, Clone)]
pub struct IndexConfig {
    /// Block size the filters hash with. Events of a multiple of it are split
    /// into blocks of this size; events of another size are not indexed. 0: any.
    pub block_size: u32,
    /// Model for pods whose topic and configuration name none.
    pub default_model: Option<String>,
    /// Accept events from publishers that discovery does not know (creates pods).
    pub accept_unknown_publishers: bool,
    /// Cap on (vLLM block, rank) entries per pod; further stores are refused.
    pub max_blocks_per_pod: usize,
    /// Grow the block table by eighths only, instead of at once to the pods'
    /// reported capacity (see `Index::make_block_room`).
    pub grow_on_demand: bool,
    /// Cap on pods.
    pub max_pods: usize,
    /// Hashes retained in the feed delta log.
    pub feed_log_hashes: usize,
    /// Hashes per feed answer, a delta or a snapshot page (the client asks again for the rest).
    pub feed_max_hashes: usize,
    /// Lifetime of learned entries, milliseconds.
    pub learned_ttl_ms: u64,
    /// Cap on learned (hash, pod) entries.
    pub learned_max_entries: usize,
    /// Pods silent (no event, no successful scrape) this long are dropped. 0: never.
    pub pod_timeout_ms: u64,
    /// Live messages buffered per publisher while its replay is in flight.
    pub replay_buffer: usize,
    /// Replay port of every pod (`tcp://<pod ip>:<port + rank>`); None: no replay
    /// except pods with an explicit endpoint.
    pub replay_port: Option<u16>,
}

impl Default for IndexConfig {
    fn default() -> Self {
        IndexConfig {
            block_size: 16,
            default_model: None,
            accept_unknown_publishers: false,
            max_blocks_per_pod: 1 << 20,
            grow_on_demand: false,
            max_pods: 1024,
            feed_log_hashes: 1 << 20,
            feed_max_hashes: 1 << 19,
            learned_ttl_ms: 600_000,
            learned_max_entries: 1 << 20,
            pod_timeout_ms: 120_000,
            replay_buffer: 10_000,
            replay_port: None,
        }
    }
}

// ------------------------------------------------------------------ messages

/// A ZMQ message as received.
#[derive(Debug, Clone)]
pub struct Incoming {
    pub topic: Vec<u8>,
    pub seq: Vec<u8>,
    pub payload: Vec<u8>,
    /// Identity given by configuration (`--connect ENDPOINT=ADDRESS[@MODEL]`),
    /// which wins over the topic.
    pub identity: Option<(String, String)>,
    /// Monotonic receive time, ms.
    pub received_ms: u64,
}

/// Ask the service to fetch missed messages from a pod's replay socket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayRequest {
    pub pod: String,
    pub rank: i64,
    pub id: u64,
    pub endpoint: String,
    pub from_seq: u64,
}

/// A pod as shown by `GET /v1/debug/pods`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct PodDebug {
    pub address: String,
    pub models: Vec<String>,
    pub origins: Vec<&'static str>,
    pub blocks: usize,
    pub blocks_by_tier: BTreeMap<&'static str, usize>,
    pub learned: usize,
    pub sources: Vec<SourceDebug>,
    pub capacity_blocks: u32,
    /// As the pod's source states it; absent: not stated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub speed: Option<f32>,
    pub waiting: u32,
    pub running: u32,
    pub kv_usage: f32,
    pub silent_ms: u64,
}

/// A publisher (pod, rank) as shown by `GET /v1/debug/pods`.
#[derive(Debug, Clone, serde::Serialize)]
pub struct SourceDebug {
    pub rank: i64,
    pub next_seq: Option<u64>,
    pub blocks: usize,
    pub replay_pending: bool,
}

// ------------------------------------------------------------------ index

/// The whole state.
pub struct Index {
    cfg: IndexConfig,
    metrics: Metrics,
    epoch: u64,
    pods: BTreeMap<PodKey, Pod>,
    /// The pods of each model in load order (`POST /v1/lookup`).
    least_loaded: LeastLoaded,
    /// Every (kvroute hash, pod) the feed serves, each hash stored once.
    blocks: Blocks,
    by_address: HashMap<String, PodKey>,
    next_pod_key: PodKey,
    next_replay_id: u64,
    /// Ops after cursor `log_start`, oldest first.
    log: VecDeque<LogOp>,
    log_start: u64,
    log_hashes: usize,
    /// (expiry ms, pod key, hash) in insertion order (constant TTL).
    learned_fifo: VecDeque<(u64, PodKey, BlockHash)>,
    learned_total: usize,
}

impl Index {
    /// An empty index; `epoch` must differ between runs (see [`new_epoch`]).
    pub fn new(cfg: IndexConfig, metrics: Metrics, epoch: u64) -> Index {
        Index {
            cfg,
            metrics,
            epoch,
            pods: BTreeMap::new(),
            least_loaded: LeastLoaded::default(),
            blocks: Blocks::default(),
            by_address: HashMap::new(),
            next_pod_key: PodKey::FIRST,
            next_replay_id: 1,
            log: VecDeque::new(),
            log_start: 0,
            log_hashes: 0,
            learned_fifo: VecDeque::new(),
            learned_total: 0,
        }
    }

    /// The feed epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Head of the delta log.
    pub fn cursor(&self) -> u64 {
        self.log_start + self.log.len() as u64
    }

    /// The metrics this index updates.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    // -------------------------------------------------------------- stats

    /// Estimated bytes held: the block map, the pods' vLLM hash tables by
    /// capacity, the delta log, learned records.
    pub fn memory_bytes(&self) -> usize {
        let pods: usize = self.pods.values().map(Pod::memory_bytes).sum();
        let log = self.log.capacity() * std::mem::size_of::<LogOp>() + self.log_hashes * 8;
        let fifo = self.learned_fifo.capacity() * std::mem::size_of::<(u64, PodKey, BlockHash)>();
        self.blocks.memory_bytes() + pods + log + fifo
    }

    /// (vLLM block, pod, rank) entries.
    pub fn blocks(&self) -> usize {
        self.pods.values().map(|p| p.source_blocks).sum()
    }

    /// Distinct kvroute hashes some pod holds (each stored once, however many
    /// pods hold it).
    pub fn distinct_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// (kvroute hash, pod) entries served in the feed.
    pub fn pod_blocks(&self) -> usize {
        self.pods.values().map(|p| p.held.total()).sum()
    }

    /// Refreshes the size gauges (a walk over the pods: called by housekeeping,
    /// not per message).
    pub fn update_gauges(&self) {
        let g = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        self.metrics.pods.set(g(self.pods.len()));
        self.metrics.blocks.set(g(self.blocks()));
        self.metrics.pod_blocks.set(g(self.pod_blocks()));
        self.metrics.learned_entries.set(g(self.learned_total));
        self.metrics
            .feed_cursor
            .set(i64::try_from(self.cursor()).unwrap_or(i64::MAX));
        self.metrics.feed_log_ops.set(g(self.log.len()));
        self.metrics.feed_log_hashes.set(g(self.log_hashes));
    }

    /// Refreshes the memory gauge (costs a walk over the pods).
    pub fn update_memory_gauge(&self) {
        self.metrics
            .memory_bytes
            .set(i64::try_from(self.memory_bytes()).unwrap_or(i64::MAX));
    }
}

/// An epoch for this run: differs between runs (time and process id).
pub fn new_epoch() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    let mut h = MixHasher(nanos ^ (u64::from(std::process::id()) << 32));
    h.write_u64(0x6b76_726f_7574_6521);
    h.finish().max(1)
}
