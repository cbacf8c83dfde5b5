//! The plugin configuration's sections and their defaults: weights, tier
//! discounts, the index, endpoints, priority and saturation, the indexer,
//! the tokenizer and the remote index.

use serde::Deserialize;
use std::collections::BTreeMap;

/// Cost weights (Dynamo's KV-router form; docs/architecture.md, "Scoring").
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Weights {
    /// Per uncached prompt block (prefill work the pod would redo), default 4.
    pub prefill: f64,
    /// Per uncached prompt block routed to the pod whose response has not
    /// started: its pending prefill (cached blocks are shared, so add none).
    pub decode: f64,
    /// Per request waiting in the pod's queue (pod-reported).
    pub queue: f64,
    /// Per KV block in use on the pod: `kv_usage` × capacity as the pod
    /// reports it (precise), else the uncached prompt blocks of requests
    /// routed there and not finished (the proxy's estimate).
    pub kv_usage: f64,
    /// Per request running on the pod (pod-reported; else requests in flight).
    pub running: f64,
    /// Per request running on the pod and per block of this request's
    /// prompt (at least one): the load term grows with the prefix terms it
    /// balances.
    pub running_per_block: f64,
}

impl Default for Weights {
    fn default() -> Self {
        // Leaving the pod that holds a prefix must beat its queue by 4× the
        // request's own uncached work: a copy on a second pod costs the
        // cluster that prefill and splits the group's later requests
        // (bench: a cold 150-group burst got 40% prefix hits at prefill = 1,
        // 56% at 4 and at 8). The running term brings work back to a pod
        // that restarted empty, which the prefix terms keep away, and keeps
        // the pods that drew the busier groups from running out of KV. It
        // scales with the prompt, as the prefix terms do, so a group leaves
        // its prefix's pod at the same running gap whatever its prompt's
        // length: 4 / 0.07 × uncached share, ~47 sequences for a 5:1
        // prefix:question prompt. A flat weight cannot do both: 450-block
        // prompts (full profile) measured best at 32 per request (TTFT p90
        // 0.379 / 0.318 s against 0.329 / 1.259 s at 8), 112-block ones
        // (restart profile) at 8 (2.288 s after the restart against 9.673 /
        // 10.0 s at 32), and both are this gap.
        Weights {
            prefill: 4.0,
            decode: 1.0,
            queue: 0.0,
            kv_usage: 0.0,
            running: 0.0,
            running_per_block: 0.07,
        }
    }
}

/// Credit of a block held in a lower cache tier, relative to GPU (1.0).
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TierDiscount {
    pub cpu: f64,
    pub disk: f64,
}

impl Default for TierDiscount {
    fn default() -> Self {
        TierDiscount {
            cpu: 0.5,
            disk: 0.25,
        }
    }
}

/// 192 MiB: holds the issue-10 fleet (1,000 pods × 19,208 blocks at 70 %,
/// 13.45 M entries without sharing) with room for learned entries: at most
/// 18 M blocks at the buckets' 7/8 load.
pub const DEFAULT_INDEX_BUDGET_BYTES: usize = 192 << 20;
/// The index flush period: a tenth of a second keeps other workers' view of
/// a new prefix about as fresh as the indexer feed's (`indexer.poll_ms`).
pub const DEFAULT_FLUSH_MS: u32 = 100;
pub(super) const MIN_FLUSH_MS: u32 = 10;
/// Readers stop trusting an index whose heartbeat (one per flush) is a few
/// seconds old: a flush period must stay well below that.
pub(super) const MAX_FLUSH_MS: u32 = 1000;
/// Below this the index holds too few buckets to be worth having.
pub const MIN_INDEX_BUDGET_BYTES: usize = 1 << 20;
/// The singleton's copy must fit in its VM's heap (about 1 GiB in Envoy).
pub const MAX_INDEX_BUDGET_BYTES: usize = 768 << 20;

#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IndexSettings {
    /// Learned (approximate) entries older than this are not matched.
    pub ttl_seconds: u32,
    /// How often the singleton publishes what changed in the index to
    /// shared data (workers see other workers' routing after at most this).
    pub flush_ms: u32,
    /// Share of a pod's table one request may claim when its blocks are
    /// learned: a few huge prompts cannot flush what everyone else taught.
    pub max_learn_share: f64,
    /// Share of a pod's table one client (named by `tenant_header`) may
    /// teach per `ttl_seconds`.
    pub max_client_share: f64,
    /// Bytes the block index may take (buckets and interned pod sets); what
    /// goes first when it is full: core/src/index.rs.
    pub budget_bytes: usize,
}

impl Default for IndexSettings {
    fn default() -> Self {
        IndexSettings {
            ttl_seconds: 600,
            flush_ms: DEFAULT_FLUSH_MS,
            max_learn_share: 0.125,
            max_client_share: 0.5,
            budget_bytes: DEFAULT_INDEX_BUDGET_BYTES,
        }
    }
}

/// A pod the filter may route to.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Endpoint {
    /// `ip:port`, exactly as the override_host LB knows the host.
    pub address: String,
    /// KV-cache capacity in blocks; `default_capacity_blocks` when absent.
    #[serde(default)]
    pub capacity_blocks: Option<u32>,
    /// Models served; empty means every model.
    #[serde(default)]
    pub models: Vec<String>,
    /// Relative speed (prefill and decode) against a reference pod at 1.0:
    /// a pod at 0.5 takes twice as long for the same work. Default 1.0.
    #[serde(default)]
    pub speed: Option<f64>,
}

/// How a priority class is treated when every candidate pod is saturated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Admission {
    /// Always routed.
    Critical,
    /// Answered 429 by the proxy while every candidate pod is saturated.
    Sheddable,
}

/// When a pod counts as saturated (see `admission`). A threshold of 0 turns
/// its test off.
#[derive(Debug, Clone, Copy, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Saturation {
    /// Pod-reported (precise): this many requests waiting in its queue.
    pub max_waiting: u32,
    /// Pod-reported `kv_usage` at or above this fraction (precise); the
    /// proxy's active-block estimate at or above it × capacity otherwise.
    pub max_kv_usage: f64,
    /// Without fresh pod reports (approximate): this many requests in flight
    /// per unit of the pod's speed.
    pub max_inflight_requests: u32,
    /// Pod-reported (precise): this many sequences running per unit of the
    /// pod's speed. vLLM admits requests into a larger batch while KV and
    /// `max_num_seqs` allow, so overload shows as running sequences before
    /// it shows as a queue.
    pub max_running: u32,
}

impl Default for Saturation {
    fn default() -> Self {
        Saturation {
            max_waiting: 4,
            max_kv_usage: 0.95,
            max_inflight_requests: 64,
            max_running: 64,
        }
    }
}

/// Priority classes and shedding at saturation. Absent: nothing is shed.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrioritySettings {
    /// Request header naming the request's class.
    pub header: String,
    /// Class of a request without the header or naming an unknown class.
    pub default_class: String,
    /// Class name → `critical` or `sheddable`.
    pub classes: BTreeMap<String, Admission>,
    pub saturation: Saturation,
    /// `Retry-After` of a shed request's 429, in seconds.
    pub retry_after_seconds: u32,
}

impl Default for PrioritySettings {
    fn default() -> Self {
        PrioritySettings {
            header: "x-kvroute-priority".into(),
            default_class: "critical".into(),
            classes: BTreeMap::from([
                ("critical".into(), Admission::Critical),
                ("sheddable".into(), Admission::Sheddable),
            ]),
            saturation: Saturation::default(),
            retry_after_seconds: 1,
        }
    }
}

impl PrioritySettings {
    /// The admission of a request whose priority header is `value`.
    pub fn admission_of(&self, value: Option<&str>) -> Admission {
        let class = value
            .map(str::trim)
            .filter(|v| self.classes.contains_key(*v));
        let class = class.unwrap_or(&self.default_class);
        self.classes
            .get(class)
            .copied()
            .unwrap_or(Admission::Critical)
    }
}

/// An HTTP call-out target (an Envoy cluster).
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IndexerSettings {
    pub cluster: String,
    #[serde(default = "IndexerSettings::default_authority")]
    pub authority: String,
    #[serde(default = "IndexerSettings::default_feed_path")]
    pub feed_path: String,
    #[serde(default = "IndexerSettings::default_learned_path")]
    pub learned_path: String,
    #[serde(default = "IndexerSettings::default_poll_ms")]
    pub poll_ms: u32,
    #[serde(default = "IndexerSettings::default_timeout_ms")]
    pub timeout_ms: u32,
    /// Report this proxy's routing decisions to the indexer (`POST
    /// learned_path`) so other proxies learn them; off: only read the feed.
    #[serde(default = "IndexerSettings::default_share_learned")]
    pub share_learned: bool,
    /// Name of the VM environment variable (Envoy `vm_config.
    /// environment_variables`) holding the bearer token of learned reports;
    /// the secret itself never appears in the plugin configuration.
    #[serde(default)]
    pub token_env: Option<String>,
}

impl IndexerSettings {
    fn default_authority() -> String {
        "kvroute-indexer".into()
    }
    fn default_feed_path() -> String {
        "/v1/feed".into()
    }
    fn default_learned_path() -> String {
        "/v1/learned".into()
    }
    fn default_poll_ms() -> u32 {
        100
    }
    fn default_timeout_ms() -> u32 {
        1000
    }
    fn default_share_learned() -> bool {
        true
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TokenizerSettings {
    pub cluster: String,
    #[serde(default = "TokenizerSettings::default_authority")]
    pub authority: String,
    #[serde(default = "TokenizerSettings::default_path")]
    pub path: String,
    #[serde(default = "TokenizerSettings::default_timeout_ms")]
    pub timeout_ms: u32,
    /// Bytes of token blocks each worker keeps from earlier call-outs, so a
    /// prompt sharing their text skips the call-out (see `token_memo`); 0:
    /// every prompt is sent.
    #[serde(default = "TokenizerSettings::default_memo_bytes")]
    pub memo_bytes: usize,
}

impl TokenizerSettings {
    fn default_authority() -> String {
        "tokenizer".into()
    }
    fn default_path() -> String {
        "/tokenize".into()
    }
    fn default_timeout_ms() -> u32 {
        50
    }
    fn default_memo_bytes() -> usize {
        8 << 20
    }
}

/// Remote lookup at the indexer (`POST /v1/lookup`), for proxies that hold
/// no index (mesh sidecars): see `lookup`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteIndexSettings {
    pub cluster: String,
    #[serde(default = "IndexerSettings::default_authority")]
    pub authority: String,
    #[serde(default = "RemoteIndexSettings::default_path")]
    pub path: String,
    /// The request waits this long for the answer, then is decided locally.
    #[serde(default = "RemoteIndexSettings::default_timeout_ms")]
    pub timeout_ms: u32,
    /// Prompts of fewer blocks are decided locally: a call-out (≈ 0.4 ms)
    /// cannot pay off on a prefill that short.
    #[serde(default = "RemoteIndexSettings::default_min_blocks")]
    pub min_blocks: usize,
}

impl RemoteIndexSettings {
    fn default_path() -> String {
        "/v1/lookup".into()
    }
    fn default_timeout_ms() -> u32 {
        50
    }
    fn default_min_blocks() -> usize {
        4
    }
}
