//! The indexer's state: pods, per-publisher sequence tracking, the block
//! index (vLLM hash → kvroute hash per pod and rank), learned entries and the
//! feed delta log. Pure and synchronous: the service wraps it in a mutex and
//! feeds it messages; tests and the benchmark drive it directly.

use std::collections::hash_map::Entry;
use std::collections::{BTreeMap, HashMap, VecDeque};
use std::hash::{BuildHasher, Hasher};

use kvroute_core::feed::{LearnedBatch, Tier};
use kvroute_core::hash::{
    extra_keys_digest, index_key, keyed_token_block_hashes, root_hash, Domain, ExtraKey,
};

use crate::metrics::Metrics;

mod feed;
use crate::vllm_wire::{
    decode_batch, decode_seq, parse_topic, BlockRemoved, BlockStored, DecodedBatch, EventBatch,
    KvEvent, Medium,
};

// ------------------------------------------------------------------ hashing

/// Hasher for keys that are already hashes: one multiply-xorshift.
#[derive(Default, Clone, Copy)]
pub struct MixHasher(u64);

impl Hasher for MixHasher {
    fn finish(&self) -> u64 {
        let y = self.0.wrapping_mul(0x9e37_79b9_7f4a_7c15);
        y ^ (y >> 29)
    }
    fn write(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 = (self.0 ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    fn write_u64(&mut self, v: u64) {
        self.0 ^= v;
    }
}

/// Builds [`MixHasher`]s.
#[derive(Default, Clone, Copy)]
pub struct BuildMix;

impl BuildHasher for BuildMix {
    type Hasher = MixHasher;
    fn build_hasher(&self) -> MixHasher {
        MixHasher(0)
    }
}

type Map<V> = HashMap<u64, V, BuildMix>;

/// KV-cache spec kinds whose blocks hold the prompt's whole prefix, so a hit
/// means the pod can skip that prefill. Sliding-window and mamba groups keep
/// only a window or a state: not routed on. No kind (vLLM before hybrid
/// groups, or a plain model): full attention.
fn routed_spec_kind(kind: Option<&str>) -> bool {
    matches!(
        kind,
        None | Some("full_attention" | "mla_attention" | "sink_full_attention")
    )
}

/// Bytes a hashbrown map holds for `capacity` entries of `entry` bytes.
fn map_bytes<V>(m: &Map<V>) -> usize {
    let buckets = if m.capacity() == 0 {
        0
    } else {
        (m.capacity() * 8 / 7).next_power_of_two()
    };
    buckets * (std::mem::size_of::<(u64, V)>() + 1)
}

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

// ------------------------------------------------------------------ pods

/// How a pod became known.
pub mod origin {
    /// `--pod`.
    pub const STATIC: u8 = 1;
    /// DNS of the headless Service.
    pub const DNS: u8 = 2;
    /// First seen in an event (only with `--accept-unknown-publishers`).
    pub const EVENTS: u8 = 4;
    /// `--connect ENDPOINT=ADDRESS`.
    pub const CONNECT: u8 = 8;
}

/// Load of a pod, from its `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    pub capacity_blocks: u32,
    pub waiting: u32,
    pub running: u32,
    pub kv_usage: f32,
}

/// Per-tier reference counts of one kvroute hash on one pod.
#[derive(Debug, Clone, Copy, Default)]
struct TierCounts([u16; 4]);

impl TierCounts {
    fn best(&self) -> Option<Tier> {
        const TIERS: [Tier; 4] = [Tier::Gpu, Tier::Cpu, Tier::Disk, Tier::Learned];
        self.0.iter().position(|&c| c > 0).map(|i| TIERS[i])
    }
}

fn tier_bit(t: Tier) -> u8 {
    1 << t.code()
}

/// A vLLM block held by one publisher (pod, rank).
#[derive(Debug, Clone, Copy)]
struct SourceEntry {
    /// kvroute hash of the block (of its last kvroute-sized part when it
    /// spans several: the parent of the next block).
    kv: u64,
    /// Bit per tier (GPU, CPU, disk).
    tiers: u8,
}

/// The blocks of one KV-cache group of a publisher. Hybrid models store
/// each block once per group under the same vLLM hash, and each group evicts
/// on its own.
#[derive(Default)]
struct Group {
    /// vLLM hash → entry.
    blocks: Map<SourceEntry>,
    /// vLLM hash → kvroute hashes of the parts before the entry's `kv`, for
    /// blocks of a multiple of the configured block size (kept apart so the
    /// common entry stays small).
    heads: Map<Box<[u64]>>,
}

impl Group {
    fn memory_bytes(&self) -> usize {
        map_bytes(&self.blocks)
            + map_bytes(&self.heads)
            + self.heads.values().map(|h| h.len() * 8).sum::<usize>()
    }
}

/// Adds (`up`) or drops one count of `tier` for every kvroute hash of a block.
#[allow(clippy::too_many_arguments)]
fn adjust_block(
    blocks: &mut Map<TierCounts>,
    sink: &mut Sink,
    pod: u64,
    kv: u64,
    head: Option<&[u64]>,
    tier: Tier,
    up: bool,
) {
    for &part in head.unwrap_or_default() {
        adjust(blocks, sink, pod, part, tier, up);
    }
    adjust(blocks, sink, pod, kv, tier, up);
}

/// Drops every tier count a block holds.
fn drop_block(
    blocks: &mut Map<TierCounts>,
    sink: &mut Sink,
    pod: u64,
    entry: SourceEntry,
    head: Option<&[u64]>,
) {
    for t in [Tier::Gpu, Tier::Cpu, Tier::Disk] {
        if entry.tiers & tier_bit(t) != 0 {
            adjust_block(blocks, sink, pod, entry.kv, head, t, false);
        }
    }
}

struct PendingReplay {
    id: u64,
    from: u64,
    buffered: Vec<(u64, EventBatch, u64)>,
}

/// One publisher: a data-parallel rank of a pod.
#[derive(Default)]
struct Source {
    next_seq: Option<u64>,
    /// KV-cache group (`group_idx`, 0 when absent) → its blocks.
    groups: BTreeMap<i64, Group>,
    /// KV-cache groups whose spec kind is not routed on (their removals are ignored).
    unrouted_groups: Vec<i64>,
    replay: Option<PendingReplay>,
}

struct Pod {
    address: String,
    models: Vec<String>,
    origins: u8,
    replay_endpoint: Option<String>,
    load: Load,
    last_seen_ms: u64,
    sources: BTreeMap<i64, Source>,
    /// kvroute hash → tier counts, what the feed serves.
    blocks: Map<TierCounts>,
    /// Learned kvroute hash → expiry (ms).
    learned: Map<u64>,
    source_blocks: usize,
}

impl Pod {
    fn new(address: String, origins: u8, now_ms: u64) -> Pod {
        Pod {
            address,
            models: Vec::new(),
            origins,
            replay_endpoint: None,
            load: Load::default(),
            last_seen_ms: now_ms,
            sources: BTreeMap::new(),
            blocks: Map::default(),
            learned: Map::default(),
            source_blocks: 0,
        }
    }

    fn memory_bytes(&self) -> usize {
        map_bytes(&self.blocks)
            + map_bytes(&self.learned)
            + self
                .sources
                .values()
                .flat_map(|s| s.groups.values())
                .map(Group::memory_bytes)
                .sum::<usize>()
    }
}

// ------------------------------------------------------------------ ops

#[derive(Debug, Clone, PartialEq)]
enum Op {
    Stored(Tier, Vec<u64>),
    Removed(Vec<u64>),
    Cleared,
}

impl Op {
    fn hashes(&self) -> usize {
        match self {
            Op::Stored(_, h) | Op::Removed(h) => h.len(),
            Op::Cleared => 0,
        }
    }
}

#[derive(Debug, Clone)]
struct LogOp {
    pod: u64,
    op: Op,
}

/// Collects ops, merging consecutive ones of the same pod, kind and tier.
#[derive(Default)]
struct Sink {
    ops: Vec<LogOp>,
}

impl Sink {
    fn stored(&mut self, pod: u64, tier: Tier, h: u64) {
        if let Some(LogOp {
            pod: p,
            op: Op::Stored(t, hs),
        }) = self.ops.last_mut()
        {
            if *p == pod && *t == tier {
                hs.push(h);
                return;
            }
        }
        self.ops.push(LogOp {
            pod,
            op: Op::Stored(tier, vec![h]),
        });
    }

    fn removed(&mut self, pod: u64, h: u64) {
        if let Some(LogOp {
            pod: p,
            op: Op::Removed(hs),
        }) = self.ops.last_mut()
        {
            if *p == pod {
                hs.push(h);
                return;
            }
        }
        self.ops.push(LogOp {
            pod,
            op: Op::Removed(vec![h]),
        });
    }

    fn cleared(&mut self, pod: u64) {
        // Earlier ops of the pod in this batch are moot.
        self.ops.retain(|o| o.pod != pod);
        self.ops.push(LogOp {
            pod,
            op: Op::Cleared,
        });
    }
}

/// Adds `delta` (±1) to `tier` of `kv` on a pod, emitting an op when the
/// best tier of the hash changes. Counted per index key: routing compares
/// only those bits, so two hashes that share them are one entry here too.
fn adjust(blocks: &mut Map<TierCounts>, sink: &mut Sink, pod: u64, kv: u64, tier: Tier, up: bool) {
    let i = tier.code() as usize;
    let kv = index_key(kv);
    match blocks.entry(kv) {
        Entry::Occupied(mut e) => {
            let before = e.get().best();
            let c = &mut e.get_mut().0[i];
            *c = if up {
                c.saturating_add(1)
            } else {
                c.saturating_sub(1)
            };
            let after = e.get().best();
            if after.is_none() {
                e.remove();
            }
            if before != after {
                match after {
                    Some(t) => sink.stored(pod, t, kv),
                    None => sink.removed(pod, kv),
                }
            }
        }
        Entry::Vacant(e) => {
            if up {
                let mut c = TierCounts::default();
                c.0[i] = 1;
                e.insert(c);
                sink.stored(pod, tier, kv);
            }
        }
    }
}

/// A block's extra keys without the LoRA adapter, which vLLM lists first and
/// kvroute already has in the chain's root.
fn without_lora<'a>(keys: &'a [ExtraKey], e: &BlockStored) -> &'a [ExtraKey] {
    let is_lora = match (keys.first(), &e.lora_name, e.lora_id) {
        (Some(ExtraKey::Str(k)), Some(name), _) => k == name,
        (Some(ExtraKey::Int(k)), None, Some(id)) => *k == i128::from(id),
        _ => false,
    };
    if is_lora {
        &keys[1..]
    } else {
        keys
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
    pods: BTreeMap<u64, Pod>,
    by_address: HashMap<String, u64>,
    next_pod_key: u64,
    next_replay_id: u64,
    /// Ops after cursor `log_start`, oldest first.
    log: VecDeque<LogOp>,
    log_start: u64,
    log_hashes: usize,
    /// (expiry ms, pod key, hash) in insertion order (constant TTL).
    learned_fifo: VecDeque<(u64, u64, u64)>,
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
            by_address: HashMap::new(),
            next_pod_key: 1,
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

    // -------------------------------------------------------------- pods

    /// Adds (or refreshes) a pod known from configuration or DNS.
    pub fn add_pod(&mut self, address: &str, model: Option<&str>, origin: u8, now_ms: u64) {
        let key = match self.by_address.get(address) {
            Some(&k) => k,
            None => {
                if self.pods.len() >= self.cfg.max_pods {
                    self.metrics.rejected("max_pods");
                    return;
                }
                let k = self.next_pod_key;
                self.next_pod_key += 1;
                self.pods.insert(k, Pod::new(address.to_owned(), 0, now_ms));
                self.by_address.insert(address.to_owned(), k);
                k
            }
        };
        if let Some(pod) = self.pods.get_mut(&key) {
            pod.origins |= origin;
            if let Some(m) = model.filter(|m| !m.is_empty()) {
                if !pod.models.iter().any(|x| x == m) {
                    pod.models.push(m.to_owned());
                }
            }
        }
        self.update_gauges();
    }

    /// Sets an explicit replay endpoint of a pod (rank 0; rank r uses port + r).
    pub fn set_replay_endpoint(&mut self, address: &str, endpoint: &str) {
        if let Some(pod) = self
            .by_address
            .get(address)
            .and_then(|k| self.pods.get_mut(k))
        {
            pod.replay_endpoint = Some(endpoint.to_owned());
        }
    }

    /// Withdraws an origin (e.g. the pod left DNS); a pod left with no origin
    /// is dropped with its entries.
    pub fn remove_origin(&mut self, address: &str, origin: u8) {
        let Some(&key) = self.by_address.get(address) else {
            return;
        };
        let gone = match self.pods.get_mut(&key) {
            Some(pod) => {
                pod.origins &= !origin;
                pod.origins == 0
            }
            None => false,
        };
        if gone {
            self.drop_pod(key);
        }
    }

    /// Addresses of the pods, with their origins.
    pub fn pod_addresses(&self) -> Vec<(String, u8)> {
        self.pods
            .values()
            .map(|p| (p.address.clone(), p.origins))
            .collect()
    }

    fn drop_pod(&mut self, key: u64) {
        let mut sink = Sink::default();
        if let Some(pod) = self.pods.remove(&key) {
            self.by_address.remove(&pod.address);
            self.learned_total = self.learned_total.saturating_sub(pod.learned.len());
            sink.cleared(key);
        }
        self.commit(sink);
    }

    /// Records a pod's load (a successful scrape also counts as a sign of life).
    pub fn set_load(&mut self, address: &str, load: Load, now_ms: u64) {
        if let Some(pod) = self
            .by_address
            .get(address)
            .and_then(|k| self.pods.get_mut(k))
        {
            pod.load = load;
            pod.last_seen_ms = now_ms;
        }
    }

    // -------------------------------------------------------------- events

    /// Handles one ZMQ message. Returns a replay request when a gap should be
    /// filled from the pod's replay socket.
    pub fn handle(&mut self, m: &Incoming, now_ms: u64) -> Option<ReplayRequest> {
        self.metrics.messages_received.inc();
        let topic = std::str::from_utf8(&m.topic).ok().and_then(parse_topic);
        let (address, model) = match (&m.identity, topic) {
            // Configured identity wins; a model it does not name may come from the topic.
            (Some((a, model)), t) if model.is_empty() => {
                (a.clone(), t.map(|t| t.model).unwrap_or_default())
            }
            (Some((a, model)), _) => (a.clone(), model.clone()),
            (None, t) => match t {
                Some(t) => (t.address, t.model),
                None => {
                    self.metrics.rejected("no_identity");
                    return None;
                }
            },
        };
        let seq = match decode_seq(&m.seq) {
            Ok(s) => s,
            Err(e) => {
                self.metrics.decode_error(e.kind());
                return None;
            }
        };
        let batch = self.decode(&m.payload)?;
        let key = match self.by_address.get(&address) {
            Some(&k) => k,
            None if self.cfg.accept_unknown_publishers => {
                self.add_pod(&address, Some(&model), origin::EVENTS, now_ms);
                match self.by_address.get(&address) {
                    Some(&k) => k,
                    None => return None,
                }
            }
            None => {
                self.metrics.rejected("unknown_pod");
                return None;
            }
        };
        if let Some(pod) = self.pods.get_mut(&key) {
            pod.last_seen_ms = now_ms;
            if pod.models.is_empty() && !model.is_empty() {
                pod.models.push(model);
            }
        }
        let rank = batch.data_parallel_rank.unwrap_or(0);
        self.sequence(key, rank, seq, batch, m.received_ms, now_ms)
    }

    /// Decodes a payload, counting the events it skipped; `None` (counted)
    /// when it is not a batch at all.
    fn decode(&self, payload: &[u8]) -> Option<EventBatch> {
        match decode_batch(payload) {
            Ok(DecodedBatch { batch, skipped }) => {
                for e in &skipped {
                    self.metrics.event_skipped(e.kind());
                }
                Some(batch)
            }
            Err(e) => {
                self.metrics.decode_error(e.kind());
                None
            }
        }
    }

    fn sequence(
        &mut self,
        key: u64,
        rank: i64,
        seq: u64,
        batch: EventBatch,
        received_ms: u64,
        now_ms: u64,
    ) -> Option<ReplayRequest> {
        let endpoint = self.replay_endpoint(key, rank);
        let replay_id = self.next_replay_id;
        let pod = self.pods.get_mut(&key)?;
        let source = pod.sources.entry(rank).or_default();
        if let Some(p) = &mut source.replay {
            if seq >= p.from {
                if p.buffered.len() < self.cfg.replay_buffer {
                    p.buffered.push((seq, batch, received_ms));
                    return None;
                }
                // Buffer full: give up on the replay, apply what we have.
                self.metrics.replay("abandoned");
                if let Some(p) = source.replay.take() {
                    self.flush_after_replay(key, rank, p, now_ms);
                }
                self.apply_in_order(key, rank, seq, batch, received_ms, now_ms);
                return None;
            }
            // A sequence below the replay start: the publisher restarted.
            source.replay = None;
        }
        // The first sequence that should have come: a gap starts there.
        let missing_from = match source.next_seq {
            Some(next) if seq > next => {
                self.metrics.seq_gaps.inc();
                self.metrics.seq_missed.inc_by(seq - next);
                Some(next)
            }
            Some(next) if seq < next => {
                self.metrics.restarts.inc();
                self.clear_source(key, rank);
                None
            }
            Some(_) => None,
            // Joined a running publisher (the indexer started after the pod):
            // what it published before is in its replay buffer.
            None if seq > 0 => {
                self.metrics.joined_midstream.inc();
                Some(0)
            }
            None => None,
        };
        if let Some(from) = missing_from {
            match (endpoint, self.pods.get_mut(&key)) {
                (Some(endpoint), Some(pod)) => {
                    self.next_replay_id += 1;
                    let source = pod.sources.entry(rank).or_default();
                    source.replay = Some(PendingReplay {
                        id: replay_id,
                        from,
                        buffered: vec![(seq, batch, received_ms)],
                    });
                    return Some(ReplayRequest {
                        pod: pod.address.clone(),
                        rank,
                        id: replay_id,
                        endpoint,
                        from_seq: from,
                    });
                }
                _ => {
                    if from > 0 {
                        self.metrics.seq_gaps_unrecovered.inc();
                    }
                }
            }
        }
        self.apply_seq(key, rank, seq, &batch, received_ms, now_ms);
        None
    }

    /// Applies what was buffered during a replay. The gap before the first
    /// buffered message was counted when it was detected (or was the join of
    /// a running publisher): if the replay left it open, it counts once more
    /// only as unrecovered.
    fn flush_after_replay(&mut self, key: u64, rank: i64, pending: PendingReplay, now_ms: u64) {
        let mut buffered = pending.buffered.into_iter();
        if let Some((seq, batch, received_ms)) = buffered.next() {
            let next = self
                .pods
                .get(&key)
                .and_then(|p| p.sources.get(&rank))
                .and_then(|s| s.next_seq)
                .unwrap_or(pending.from);
            if seq > next && pending.from > 0 {
                self.metrics.seq_gaps_unrecovered.inc();
            }
            if seq >= next {
                self.apply_seq(key, rank, seq, &batch, received_ms, now_ms);
            }
        }
        for (s, b, r) in buffered {
            self.apply_in_order(key, rank, s, b, r, now_ms);
        }
    }

    /// Applies a batch whose sequence follows, counts a gap or restart otherwise
    /// (no replay: used to flush buffers).
    fn apply_in_order(
        &mut self,
        key: u64,
        rank: i64,
        seq: u64,
        batch: EventBatch,
        received_ms: u64,
        now_ms: u64,
    ) {
        let next = self
            .pods
            .get(&key)
            .and_then(|p| p.sources.get(&rank))
            .and_then(|s| s.next_seq);
        match next {
            Some(n) if seq < n => return, // already applied (replay overlap)
            Some(n) if seq > n => {
                self.metrics.seq_gaps.inc();
                self.metrics.seq_missed.inc_by(seq - n);
                self.metrics.seq_gaps_unrecovered.inc();
            }
            _ => {}
        }
        self.apply_seq(key, rank, seq, &batch, received_ms, now_ms);
    }

    fn apply_seq(
        &mut self,
        key: u64,
        rank: i64,
        seq: u64,
        batch: &EventBatch,
        received_ms: u64,
        now_ms: u64,
    ) {
        let mut sink = Sink::default();
        self.apply_batch(key, rank, batch, &mut sink);
        if let Some(s) = self
            .pods
            .get_mut(&key)
            .and_then(|p| p.sources.get_mut(&rank))
        {
            s.next_seq = Some(seq.wrapping_add(1));
        }
        self.commit(sink);
        self.metrics
            .apply_lag_seconds
            .observe(now_ms.saturating_sub(received_ms) as f64 / 1000.0);
    }

    fn replay_endpoint(&self, key: u64, rank: i64) -> Option<String> {
        let pod = self.pods.get(&key)?;
        let offset = u16::try_from(rank).ok()?;
        if let Some(e) = &pod.replay_endpoint {
            let (base, port) = e.rsplit_once(':')?;
            let port: u16 = port.parse().ok()?;
            return Some(format!("{base}:{}", port.checked_add(offset)?));
        }
        let port = self.cfg.replay_port?.checked_add(offset)?;
        let (host, _) = pod.address.rsplit_once(':')?;
        Some(format!("tcp://{host}:{port}"))
    }

    /// Result of a replay: `messages` are (seq frame, payload) pairs as
    /// received (the end marker excluded); `Err` when the replay failed.
    pub fn finish_replay(
        &mut self,
        req: &ReplayRequest,
        messages: Result<Vec<(u64, Vec<u8>)>, String>,
        now_ms: u64,
    ) {
        let Some(&key) = self.by_address.get(&req.pod) else {
            return;
        };
        let pending = match self
            .pods
            .get_mut(&key)
            .and_then(|p| p.sources.get_mut(&req.rank))
        {
            Some(s) if s.replay.as_ref().map(|p| p.id) == Some(req.id) => s.replay.take(),
            _ => None,
        };
        let Some(pending) = pending else {
            return;
        };
        match messages {
            Ok(msgs) => {
                self.metrics.replay("ok");
                let mut next = pending.from;
                for (seq, payload) in msgs {
                    if seq < next {
                        continue;
                    }
                    if pending.buffered.first().is_some_and(|(s, _, _)| seq >= *s) {
                        break;
                    }
                    if let Some(b) = self.decode(&payload) {
                        self.apply_in_order(key, req.rank, seq, b, now_ms, now_ms);
                        self.metrics.replayed_messages.inc();
                        next = seq + 1;
                    }
                }
            }
            Err(_) => self.metrics.replay("failed"),
        }
        self.flush_after_replay(key, req.rank, pending, now_ms);
    }

    fn apply_batch(&mut self, key: u64, rank: i64, batch: &EventBatch, sink: &mut Sink) {
        for ev in &batch.events {
            match ev {
                KvEvent::BlockStored(e) => {
                    self.metrics.event("BlockStored");
                    if e.is_placeholder() {
                        self.placeholder(key, rank, e, sink);
                    } else {
                        self.stored(key, rank, e, sink);
                    }
                }
                KvEvent::BlockRemoved(e) => {
                    self.metrics.event("BlockRemoved");
                    self.removed(key, rank, e, sink);
                }
                KvEvent::AllBlocksCleared => {
                    self.metrics.event("AllBlocksCleared");
                    self.clear_source_into(key, rank, sink);
                }
                KvEvent::Unknown { .. } => self.metrics.event("Unknown"),
            }
        }
    }

    /// kvroute blocks per vLLM block of `block_size` tokens, `None` when
    /// that size cannot be re-hashed into the filters' blocks.
    fn span(&self, block_size: u32) -> Option<usize> {
        match self.cfg.block_size {
            _ if block_size == 0 => None,
            0 => Some(1),
            b if block_size % b == 0 => Some((block_size / b) as usize),
            _ => None,
        }
    }

    fn stored(&mut self, key: u64, rank: i64, e: &BlockStored, sink: &mut Sink) {
        let group_idx = e.group_idx.unwrap_or(0);
        let span = self.span(e.block_size);
        let Some(pod) = self.pods.get_mut(&key) else {
            return;
        };
        let source = pod.sources.entry(rank).or_default();
        let unrouted_at = source.unrouted_groups.iter().position(|g| *g == group_idx);
        if !routed_spec_kind(e.kv_cache_spec_kind.as_deref()) {
            if unrouted_at.is_none() {
                source.unrouted_groups.push(group_idx);
            }
            self.metrics
                .blocks_not_routed
                .inc_by(e.block_hashes.len() as u64);
            return;
        }
        // A group's kind changes only when the pod restarts with another model.
        if let Some(i) = unrouted_at {
            source.unrouted_groups.swap_remove(i);
        }
        let Some(span) = span else {
            self.metrics.stored_block_size_mismatch.inc();
            return;
        };
        let model = match pod.models.first().or(self.cfg.default_model.as_ref()) {
            Some(m) => m,
            None => {
                self.metrics.rejected("no_model");
                return;
            }
        };
        let n = e.block_hashes.len();
        let bs = e.block_size as usize;
        let Some(need) = n.checked_mul(bs).filter(|&need| need <= e.token_ids.len()) else {
            self.metrics.stored_token_mismatch.inc();
            return;
        };
        let group = pod
            .sources
            .entry(rank)
            .or_default()
            .groups
            .entry(group_idx)
            .or_default();
        let parent_kv = match e.parent_block_hash {
            None => match (&e.lora_name, e.lora_id) {
                (Some(name), _) => root_hash(Domain::Tokens, model, Some(name)),
                // Older vLLM names no adapter, only its id: scope the chain by the id
                // so that it can never pass for the base model's blocks.
                (None, Some(id)) => {
                    root_hash(Domain::Tokens, model, Some(&format!("#lora-id:{id}")))
                }
                (None, None) => root_hash(Domain::Tokens, model, None),
            },
            Some(p) => match group.blocks.get(&p) {
                Some(entry) => entry.kv,
                None => {
                    self.metrics.stored_unknown_parent.inc();
                    return;
                }
            },
        };
        // Extra keys belong to the first kvroute block of each vLLM block.
        let mut extra = Vec::new();
        if let Some(keys) = &e.extra_keys {
            extra.resize(n * span, None);
            for (i, block_keys) in keys.iter().take(n).enumerate() {
                if let Some(block_keys) = block_keys {
                    extra[i * span] = extra_keys_digest(without_lora(block_keys, e));
                }
            }
        }
        let kvs =
            keyed_token_block_hashes(parent_kv, &e.token_ids[..need], bs / span, n * span, &extra);
        let tier = Medium::tier(e.medium.as_ref());
        let bit = tier_bit(tier);
        let mut applied = 0u64;
        for (&vh, parts) in e.block_hashes.iter().zip(kvs.chunks_exact(span)) {
            let Some((&kv, head)) = parts.split_last() else {
                continue;
            };
            let head = (!head.is_empty()).then_some(head);
            match group.blocks.entry(vh) {
                Entry::Occupied(mut o) => {
                    let entry = o.get_mut();
                    if entry.kv != kv {
                        // Same vLLM hash, other content (e.g. other LoRA scope): replace.
                        let old = group.heads.remove(&vh);
                        drop_block(&mut pod.blocks, sink, key, *entry, old.as_deref());
                        *entry = SourceEntry { kv, tiers: 0 };
                        if let Some(head) = head {
                            group.heads.insert(vh, head.into());
                        }
                    }
                    if entry.tiers & bit == 0 {
                        entry.tiers |= bit;
                        adjust_block(&mut pod.blocks, sink, key, kv, head, tier, true);
                    }
                }
                Entry::Vacant(v) => {
                    if pod.source_blocks >= self.cfg.max_blocks_per_pod {
                        self.metrics.blocks_refused_capacity.inc();
                        break;
                    }
                    v.insert(SourceEntry { kv, tiers: bit });
                    if let Some(head) = head {
                        group.heads.insert(vh, head.into());
                    }
                    pod.source_blocks += 1;
                    adjust_block(&mut pod.blocks, sink, key, kv, head, tier, true);
                }
            }
            applied += 1;
        }
        self.metrics.blocks_stored.inc_by(applied);
    }

    /// A CPU-offload placeholder names blocks by hash only: they now also
    /// reside in its medium. Blocks this publisher never stored with tokens
    /// cannot be re-hashed, so they are counted and skipped.
    fn placeholder(&mut self, key: u64, rank: i64, e: &BlockStored, sink: &mut Sink) {
        let Some(pod) = self.pods.get_mut(&key) else {
            return;
        };
        let group = pod
            .sources
            .get_mut(&rank)
            .and_then(|s| s.groups.get_mut(&e.group_idx.unwrap_or(0)));
        let Some(group) = group else {
            self.metrics
                .placeholder_blocks("unknown", e.block_hashes.len() as u64);
            return;
        };
        let tier = Medium::tier(e.medium.as_ref());
        let bit = tier_bit(tier);
        let (mut applied, mut unknown) = (0, 0);
        for vh in &e.block_hashes {
            let Some(entry) = group.blocks.get_mut(vh) else {
                unknown += 1;
                continue;
            };
            if entry.tiers & bit == 0 {
                entry.tiers |= bit;
                let head = group.heads.get(vh).map(|h| &h[..]);
                adjust_block(&mut pod.blocks, sink, key, entry.kv, head, tier, true);
            }
            applied += 1;
        }
        self.metrics.placeholder_blocks("applied", applied);
        self.metrics.placeholder_blocks("unknown", unknown);
    }

    fn removed(&mut self, key: u64, rank: i64, e: &BlockRemoved, sink: &mut Sink) {
        let Some(pod) = self.pods.get_mut(&key) else {
            return;
        };
        let group_idx = e.group_idx.unwrap_or(0);
        let source = pod.sources.entry(rank).or_default();
        if source.unrouted_groups.contains(&group_idx) {
            self.metrics
                .blocks_not_routed
                .inc_by(e.block_hashes.len() as u64);
            return;
        }
        let Some(group) = source.groups.get_mut(&group_idx) else {
            self.metrics
                .removed_unknown
                .inc_by(e.block_hashes.len() as u64);
            return;
        };
        let tier = Medium::tier(e.medium.as_ref());
        let bit = tier_bit(tier);
        let mut removed = 0u64;
        for vh in &e.block_hashes {
            let Entry::Occupied(mut o) = group.blocks.entry(*vh) else {
                self.metrics.removed_unknown.inc();
                continue;
            };
            let entry = o.get_mut();
            if entry.tiers & bit == 0 {
                self.metrics.removed_unknown.inc();
                continue;
            }
            entry.tiers &= !bit;
            let kv = entry.kv;
            let gone = entry.tiers == 0;
            if gone {
                o.remove();
                pod.source_blocks = pod.source_blocks.saturating_sub(1);
            }
            let head = if gone {
                group.heads.remove(vh)
            } else {
                group.heads.get(vh).cloned()
            };
            adjust_block(&mut pod.blocks, sink, key, kv, head.as_deref(), tier, false);
            removed += 1;
        }
        self.metrics.blocks_removed.inc_by(removed);
    }

    fn clear_source(&mut self, key: u64, rank: i64) {
        let mut sink = Sink::default();
        self.clear_source_into(key, rank, &mut sink);
        self.commit(sink);
    }

    /// Drops a publisher's blocks; when it was the pod's only holder of
    /// entries, the pod's learned entries go too (its cache is gone) and one
    /// `Cleared` op replaces the per-hash removals.
    fn clear_source_into(&mut self, key: u64, rank: i64, sink: &mut Sink) {
        let Some(pod) = self.pods.get_mut(&key) else {
            return;
        };
        let others = pod
            .sources
            .iter()
            .any(|(r, s)| *r != rank && s.groups.values().any(|g| !g.blocks.is_empty()));
        let Some(source) = pod.sources.get_mut(&rank) else {
            return;
        };
        if !others {
            pod.source_blocks = 0;
            source.groups.clear();
            self.learned_total = self.learned_total.saturating_sub(pod.learned.len());
            pod.learned.clear();
            pod.blocks.clear();
            sink.cleared(key);
            return;
        }
        for (_, mut group) in std::mem::take(&mut source.groups) {
            for (vh, entry) in group.blocks.drain() {
                pod.source_blocks = pod.source_blocks.saturating_sub(1);
                let head = group.heads.remove(&vh);
                drop_block(&mut pod.blocks, sink, key, entry, head.as_deref());
            }
        }
    }

    // -------------------------------------------------------------- learned

    /// True when some pod reports `hash` through KV events (any tier but
    /// learned): such a hash is a token-domain block, never a byte chunk.
    /// Compared on the index key, as routing compares it: a learned hash that
    /// differs only in the bits above cannot pass for a byte chunk.
    pub fn reported_by_a_pod(&self, hash: u64) -> bool {
        self.pods.values().any(|p| {
            p.blocks
                .get(&index_key(hash))
                .and_then(TierCounts::best)
                .is_some_and(|t| t != Tier::Learned)
        })
    }

    /// Applies a proxy's learned batch; hashes of unknown pods are rejected.
    pub fn apply_learned(&mut self, batch: &LearnedBatch, now_ms: u64) -> (usize, usize) {
        let (mut accepted, mut rejected) = (0, 0);
        let mut sink = Sink::default();
        let expiry = now_ms.saturating_add(self.cfg.learned_ttl_ms);
        for (address, hashes) in &batch.entries {
            let Some(&key) = self.by_address.get(address) else {
                rejected += hashes.len();
                continue;
            };
            for &h in hashes {
                if self.cfg.learned_max_entries == 0 {
                    rejected += 1;
                    continue;
                }
                let present = self
                    .pods
                    .get(&key)
                    .is_some_and(|p| p.learned.contains_key(&h));
                if !present && self.learned_total >= self.cfg.learned_max_entries {
                    self.evict_learned(&mut sink, now_ms, 1);
                }
                let Some(pod) = self.pods.get_mut(&key) else {
                    break;
                };
                if pod.learned.insert(h, expiry).is_none() {
                    self.learned_total += 1;
                    adjust(&mut pod.blocks, &mut sink, key, h, Tier::Learned, true);
                }
                self.learned_fifo.push_back((expiry, key, h));
                accepted += 1;
            }
        }
        self.metrics.learned_accepted.inc_by(accepted as u64);
        self.metrics.learned_rejected.inc_by(rejected as u64);
        if self.learned_fifo.len() > 4 * self.cfg.learned_max_entries.max(1024) {
            let pods = &self.pods;
            self.learned_fifo
                .retain(|(exp, k, h)| pods.get(k).and_then(|p| p.learned.get(h)) == Some(exp));
        }
        self.commit(sink);
        self.update_gauges();
        (accepted, rejected)
    }

    /// Pops learned records due by `now_ms` (or `force` live ones regardless).
    fn evict_learned(&mut self, sink: &mut Sink, now_ms: u64, mut force: usize) {
        while let Some(&(exp, key, h)) = self.learned_fifo.front() {
            if exp > now_ms && force == 0 {
                break;
            }
            self.learned_fifo.pop_front();
            let Some(pod) = self.pods.get_mut(&key) else {
                continue;
            };
            if pod.learned.get(&h) != Some(&exp) {
                continue; // refreshed or already gone
            }
            pod.learned.remove(&h);
            self.learned_total = self.learned_total.saturating_sub(1);
            adjust(&mut pod.blocks, sink, key, h, Tier::Learned, false);
            if exp > now_ms {
                self.metrics.learned_evicted.inc();
                force = force.saturating_sub(1);
            }
        }
    }

    /// Expires learned entries and drops silent pods.
    pub fn expire(&mut self, now_ms: u64) {
        let mut sink = Sink::default();
        self.evict_learned(&mut sink, now_ms, 0);
        self.commit(sink);
        if self.cfg.pod_timeout_ms > 0 {
            let silent: Vec<(u64, u8)> = self
                .pods
                .iter()
                .filter(|(_, p)| now_ms.saturating_sub(p.last_seen_ms) > self.cfg.pod_timeout_ms)
                .filter(|(_, p)| {
                    p.origins == origin::EVENTS || !p.blocks.is_empty() || !p.sources.is_empty()
                })
                .map(|(k, p)| (*k, p.origins))
                .collect();
            for (key, origins) in silent {
                self.metrics.pods_expired.inc();
                if origins == origin::EVENTS {
                    self.drop_pod(key);
                } else {
                    self.reset_pod(key);
                }
            }
        }
        self.update_gauges();
    }

    /// Drops a pod's entries and sequence state but keeps it listed.
    fn reset_pod(&mut self, key: u64) {
        let mut sink = Sink::default();
        if let Some(pod) = self.pods.get_mut(&key) {
            self.learned_total = self.learned_total.saturating_sub(pod.learned.len());
            pod.learned = Map::default();
            pod.blocks = Map::default();
            pod.sources.clear();
            pod.source_blocks = 0;
            sink.cleared(key);
        }
        self.commit(sink);
    }

    // -------------------------------------------------------------- feed

    fn commit(&mut self, sink: Sink) {
        for op in sink.ops {
            self.log_hashes += op.op.hashes();
            self.log.push_back(op);
        }
        while self.log_hashes > self.cfg.feed_log_hashes {
            let Some(old) = self.log.pop_front() else {
                break;
            };
            self.log_hashes -= old.op.hashes();
            self.log_start += 1;
        }
    }

    // -------------------------------------------------------------- stats

    /// Estimated bytes held: maps by capacity, the delta log, learned records.
    pub fn memory_bytes(&self) -> usize {
        let pods: usize = self.pods.values().map(Pod::memory_bytes).sum();
        let log = self.log.capacity() * std::mem::size_of::<LogOp>() + self.log_hashes * 8;
        let fifo = self.learned_fifo.capacity() * 24;
        pods + log + fifo
    }

    /// (vLLM block, pod, rank) entries.
    pub fn blocks(&self) -> usize {
        self.pods.values().map(|p| p.source_blocks).sum()
    }

    /// (kvroute hash, pod) entries served in the feed.
    pub fn pod_blocks(&self) -> usize {
        self.pods.values().map(|p| p.blocks.len()).sum()
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

    /// Pods for `GET /v1/debug/pods`.
    pub fn debug_pods(&self, now_ms: u64) -> Vec<PodDebug> {
        self.pods
            .values()
            .map(|p| {
                let mut by_tier = BTreeMap::new();
                for c in p.blocks.values() {
                    let name = match c.best() {
                        Some(Tier::Gpu) => "gpu",
                        Some(Tier::Cpu) => "cpu",
                        Some(Tier::Disk) => "disk",
                        Some(Tier::Learned) => "learned",
                        None => continue,
                    };
                    *by_tier.entry(name).or_insert(0) += 1;
                }
                let mut origins = Vec::new();
                for (bit, name) in [
                    (origin::STATIC, "static"),
                    (origin::DNS, "dns"),
                    (origin::EVENTS, "events"),
                    (origin::CONNECT, "connect"),
                ] {
                    if p.origins & bit != 0 {
                        origins.push(name);
                    }
                }
                PodDebug {
                    address: p.address.clone(),
                    models: p.models.clone(),
                    origins,
                    blocks: p.blocks.len(),
                    blocks_by_tier: by_tier,
                    learned: p.learned.len(),
                    sources: p
                        .sources
                        .iter()
                        .map(|(r, s)| SourceDebug {
                            rank: *r,
                            next_seq: s.next_seq,
                            blocks: s.groups.values().map(|g| g.blocks.len()).sum(),
                            replay_pending: s.replay.is_some(),
                        })
                        .collect(),
                    capacity_blocks: p.load.capacity_blocks,
                    waiting: p.load.waiting,
                    running: p.load.running,
                    kv_usage: p.load.kv_usage,
                    silent_ms: now_ms.saturating_sub(p.last_seen_ms),
                }
            })
            .collect()
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
