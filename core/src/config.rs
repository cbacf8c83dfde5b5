//! Plugin configuration: parsed from the plugin's JSON, validated into a
//! runtime [`Config`]. Every error names the offending field, because Envoy
//! only shows the operator a log line.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;

/// A configuration the filter refuses, with the field that is wrong.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "invalid kvroute config: {}", self.message)
        } else {
            write!(
                f,
                "invalid kvroute config: field `{}`: {}",
                self.field, self.message
            )
        }
    }
}

impl std::error::Error for ConfigError {}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        message: message.into(),
    }
}

/// Which root context this plugin instance runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// HTTP filter in every worker: parses, scores, routes.
    Filter,
    /// Bootstrap `wasm_service` on the main thread: polls the indexer.
    Singleton,
}

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
const MIN_FLUSH_MS: u32 = 10;
/// Readers stop trusting an index whose heartbeat (one per flush) is a few
/// seconds old: a flush period must stay well below that.
const MAX_FLUSH_MS: u32 = 1000;
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

/// The plugin configuration as written by the operator.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub role: Role,
    pub paths: Vec<String>,
    pub max_body_bytes: usize,
    pub block_size: usize,
    pub chunk_bytes: usize,
    pub max_blocks: usize,
    pub destination_header: String,
    pub fallback_endpoints: usize,
    pub decision_header: String,
    /// Response header naming the pod that really served (after Envoy's
    /// retries onto the fallbacks); empty: not added.
    pub served_header: String,
    /// The route sets `served_header` itself (`%UPSTREAM_HOST%`, replacing
    /// any value the pod sent): kvroute reads the serving pod from it
    /// instead of Envoy's `upstream.address` property, a dearer host call.
    pub served_header_from_route: bool,
    /// A pod that failed a request (5xx, reset, or a retry served elsewhere)
    /// is passed over for this long; 0: never passed over.
    pub failure_cooldown_seconds: u32,
    pub weights: Weights,
    pub tier_discount: TierDiscount,
    pub index: IndexSettings,
    pub default_capacity_blocks: u32,
    pub endpoints: Vec<Endpoint>,
    /// LoRA adapter name → base model, so adapter requests hash in the
    /// adapter's scope and go to pods serving the base model.
    pub adapters: BTreeMap<String, String>,
    /// Model a request without `model` is routed in when the pods do not all
    /// serve one model (see `Cluster::implied_model`).
    pub default_model: Option<String>,
    /// Tenant isolation: request header naming the tenant (set by the mesh
    /// from the authenticated identity). When set, every routed request gets
    /// the tenant's `cache_salt` written into its body.
    pub tenant_header: Option<String>,
    /// Priority classes and shedding at saturation; absent: nothing is shed.
    pub priority: Option<PrioritySettings>,
    pub indexer: Option<IndexerSettings>,
    pub tokenizer: Option<TokenizerSettings>,
    pub remote_index: Option<RemoteIndexSettings>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            role: Role::Filter,
            paths: vec!["/v1/chat/completions".into(), "/v1/completions".into()],
            max_body_bytes: 4 << 20,
            block_size: 16,
            chunk_bytes: 64,
            max_blocks: 4096,
            destination_header: "x-gateway-destination-endpoint".into(),
            fallback_endpoints: 2,
            decision_header: "x-kvroute-decision".into(),
            served_header: "x-gateway-destination-endpoint-served".into(),
            served_header_from_route: false,
            failure_cooldown_seconds: 3,
            weights: Weights::default(),
            tier_discount: TierDiscount::default(),
            index: IndexSettings::default(),
            default_capacity_blocks: 16384,
            endpoints: Vec::new(),
            adapters: BTreeMap::new(),
            default_model: None,
            tenant_header: None,
            priority: None,
            indexer: None,
            tokenizer: None,
            remote_index: None,
        }
    }
}

/// Bounds that keep a typo from turning into a memory or CPU bomb.
const MAX_CAPACITY_BLOCKS: u32 = 1 << 24;
const MAX_BLOCKS_PER_REQUEST: usize = 1 << 16;
const MAX_MEMO_BYTES: usize = 1 << 30;
/// Speeds are relative to one reference pod; beyond this is a typo.
const MAX_SPEED: f64 = 1000.0;

impl Config {
    /// Parses and validates the plugin configuration. An empty input means
    /// all defaults.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        let trimmed = bytes.iter().all(|b| b.is_ascii_whitespace());
        let config: Config = if trimmed {
            Config::default()
        } else {
            serde_json::from_slice(bytes)
                .map_err(|e| invalid(field_of_serde_error(&e), e.to_string()))?
        };
        config.validate()?;
        Ok(config)
    }

    fn validate(&self) -> Result<(), ConfigError> {
        if self.paths.is_empty() {
            return Err(invalid("paths", "must list at least one path"));
        }
        for (i, path) in self.paths.iter().enumerate() {
            if !path.starts_with('/') {
                return Err(invalid(format!("paths[{i}]"), "must start with '/'"));
            }
        }
        if self.max_body_bytes == 0 {
            return Err(invalid("max_body_bytes", "must be > 0"));
        }
        if self.block_size == 0 || self.block_size > 1024 {
            return Err(invalid("block_size", "must be between 1 and 1024"));
        }
        if self.chunk_bytes == 0 || self.chunk_bytes > 65536 {
            return Err(invalid("chunk_bytes", "must be between 1 and 65536"));
        }
        if self.max_blocks == 0 || self.max_blocks > MAX_BLOCKS_PER_REQUEST {
            return Err(invalid(
                "max_blocks",
                format!("must be between 1 and {MAX_BLOCKS_PER_REQUEST}"),
            ));
        }
        if !is_header_name(&self.destination_header) {
            return Err(invalid(
                "destination_header",
                "must be a lower-case HTTP header name",
            ));
        }
        if !self.decision_header.is_empty() && !is_header_name(&self.decision_header) {
            return Err(invalid(
                "decision_header",
                "must be a lower-case HTTP header name or empty",
            ));
        }
        if !self.served_header.is_empty() && !is_header_name(&self.served_header) {
            return Err(invalid(
                "served_header",
                "must be a lower-case HTTP header name or empty",
            ));
        }
        if self.served_header_from_route && self.served_header.is_empty() {
            return Err(invalid(
                "served_header_from_route",
                "needs served_header: the header the route sets",
            ));
        }
        if self.failure_cooldown_seconds > 3600 {
            return Err(invalid("failure_cooldown_seconds", "must be <= 3600"));
        }
        let w = &self.weights;
        for (name, value) in [
            ("prefill", w.prefill),
            ("decode", w.decode),
            ("queue", w.queue),
            ("kv_usage", w.kv_usage),
            ("running", w.running),
            ("running_per_block", w.running_per_block),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(invalid(
                    format!("weights.{name}"),
                    "must be a finite number >= 0",
                ));
            }
        }
        for (name, value) in [
            ("cpu", self.tier_discount.cpu),
            ("disk", self.tier_discount.disk),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(invalid(
                    format!("tier_discount.{name}"),
                    "must be between 0 and 1",
                ));
            }
        }
        if self.index.ttl_seconds == 0 {
            return Err(invalid("index.ttl_seconds", "must be > 0"));
        }
        for (name, share) in [
            ("max_learn_share", self.index.max_learn_share),
            ("max_client_share", self.index.max_client_share),
        ] {
            if !(share > 0.0 && share <= 1.0) {
                return Err(invalid(format!("index.{name}"), "must be > 0 and <= 1"));
            }
        }
        if !(MIN_INDEX_BUDGET_BYTES..=MAX_INDEX_BUDGET_BYTES).contains(&self.index.budget_bytes) {
            return Err(invalid(
                "index.budget_bytes",
                format!(
                    "must be between {MIN_INDEX_BUDGET_BYTES} (1 MiB) and {MAX_INDEX_BUDGET_BYTES} (768 MiB)"
                ),
            ));
        }
        if !(MIN_FLUSH_MS..=MAX_FLUSH_MS).contains(&self.index.flush_ms) {
            return Err(invalid(
                "index.flush_ms",
                format!("must be between {MIN_FLUSH_MS} and {MAX_FLUSH_MS}"),
            ));
        }
        check_capacity(
            "default_capacity_blocks",
            Some(self.default_capacity_blocks),
        )?;
        let mut seen = std::collections::BTreeSet::new();
        for (i, endpoint) in self.endpoints.iter().enumerate() {
            if !is_host_port(&endpoint.address) {
                return Err(invalid(
                    format!("endpoints[{i}].address"),
                    "must be ip:port",
                ));
            }
            if !seen.insert(endpoint.address.as_str()) {
                return Err(invalid(
                    format!("endpoints[{i}].address"),
                    "is listed twice",
                ));
            }
            check_capacity(
                &format!("endpoints[{i}].capacity_blocks"),
                endpoint.capacity_blocks,
            )?;
            if let Some(speed) = endpoint.speed {
                if !(speed.is_finite() && speed > 0.0 && speed <= MAX_SPEED) {
                    return Err(invalid(
                        format!("endpoints[{i}].speed"),
                        format!("must be > 0 and <= {MAX_SPEED}"),
                    ));
                }
            }
        }
        if let Some(priority) = &self.priority {
            check_priority(priority)?;
        }
        if self.default_model.as_ref().is_some_and(|m| m.is_empty()) {
            return Err(invalid(
                "default_model",
                "must name a model (or be left out)",
            ));
        }
        if let Some(header) = &self.tenant_header {
            if !is_header_name(header) {
                return Err(invalid(
                    "tenant_header",
                    "must be a lower-case HTTP header name",
                ));
            }
        }
        if let Some(indexer) = &self.indexer {
            check_callout("indexer", &indexer.cluster, indexer.timeout_ms)?;
            if indexer.poll_ms < 10 {
                return Err(invalid("indexer.poll_ms", "must be >= 10"));
            }
            for (name, path) in [
                ("feed_path", &indexer.feed_path),
                ("learned_path", &indexer.learned_path),
            ] {
                if !path.starts_with('/') {
                    return Err(invalid(format!("indexer.{name}"), "must start with '/'"));
                }
            }
            if let Some(name) = &indexer.token_env {
                if !is_env_name(name) {
                    return Err(invalid(
                        "indexer.token_env",
                        "must be an environment variable name ([A-Za-z_][A-Za-z0-9_]*)",
                    ));
                }
            }
        }
        if let Some(tokenizer) = &self.tokenizer {
            check_callout("tokenizer", &tokenizer.cluster, tokenizer.timeout_ms)?;
            if !tokenizer.path.starts_with('/') {
                return Err(invalid("tokenizer.path", "must start with '/'"));
            }
            if tokenizer.memo_bytes > MAX_MEMO_BYTES {
                return Err(invalid("tokenizer.memo_bytes", "must be at most 1 GiB"));
            }
        }
        if let Some(remote) = &self.remote_index {
            check_callout("remote_index", &remote.cluster, remote.timeout_ms)?;
            if !remote.path.starts_with('/') {
                return Err(invalid("remote_index.path", "must start with '/'"));
            }
            if remote.min_blocks == 0 || remote.min_blocks > self.max_blocks {
                return Err(invalid(
                    "remote_index.min_blocks",
                    "must be between 1 and max_blocks",
                ));
            }
        }
        Ok(())
    }

    /// Capacity of an endpoint, with the configured default.
    pub fn capacity_of(&self, endpoint: &Endpoint) -> u32 {
        endpoint
            .capacity_blocks
            .unwrap_or(self.default_capacity_blocks)
    }

    /// Relative speed of an endpoint (1.0 when not configured).
    pub fn speed_of(&self, endpoint: &Endpoint) -> f64 {
        endpoint.speed.unwrap_or(1.0)
    }

    /// True when requests on this path are routed.
    pub fn routes_path(&self, path: &str) -> bool {
        let path = path.split('?').next().unwrap_or(path);
        self.paths.iter().any(|p| p == path)
    }
}

fn check_priority(p: &PrioritySettings) -> Result<(), ConfigError> {
    if !is_header_name(&p.header) {
        return Err(invalid(
            "priority.header",
            "must be a lower-case HTTP header name",
        ));
    }
    if p.classes.keys().any(|name| name.is_empty()) {
        return Err(invalid("priority.classes", "class names must not be empty"));
    }
    if !p.classes.contains_key(&p.default_class) {
        return Err(invalid(
            "priority.default_class",
            "must be one of priority.classes",
        ));
    }
    let kv = p.saturation.max_kv_usage;
    if !(kv.is_finite() && (0.0..=1.0).contains(&kv)) {
        return Err(invalid(
            "priority.saturation.max_kv_usage",
            "must be between 0 and 1 (0: test off)",
        ));
    }
    if p.retry_after_seconds == 0 || p.retry_after_seconds > 3600 {
        return Err(invalid(
            "priority.retry_after_seconds",
            "must be between 1 and 3600",
        ));
    }
    Ok(())
}

fn check_capacity(field: &str, capacity: Option<u32>) -> Result<(), ConfigError> {
    match capacity {
        Some(0) => Err(invalid(field, "must be > 0")),
        Some(c) if c > MAX_CAPACITY_BLOCKS => {
            Err(invalid(field, format!("must be <= {MAX_CAPACITY_BLOCKS}")))
        }
        _ => Ok(()),
    }
}

/// `[A-Za-z_][A-Za-z0-9_]*`, what a shell and Kubernetes accept everywhere.
fn is_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn check_callout(section: &str, cluster: &str, timeout_ms: u32) -> Result<(), ConfigError> {
    if cluster.is_empty() {
        return Err(invalid(
            format!("{section}.cluster"),
            "must name an Envoy cluster",
        ));
    }
    if timeout_ms == 0 || timeout_ms > 60_000 {
        return Err(invalid(
            format!("{section}.timeout_ms"),
            "must be between 1 and 60000",
        ));
    }
    Ok(())
}

fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_' || b == b'.'
        })
}

fn is_host_port(address: &str) -> bool {
    match address.rsplit_once(':') {
        Some((host, port)) => !host.is_empty() && port.parse::<u16>().is_ok_and(|p| p > 0),
        None => false,
    }
}

/// serde_json names unknown fields in its message but not the path of a type
/// error; pull the backticked field name out when there is one.
fn field_of_serde_error(error: &serde_json::Error) -> String {
    let text = error.to_string();
    let mut parts = text.split('`');
    match (parts.next(), parts.next()) {
        (Some(_), Some(field))
            if text.starts_with("unknown field") || text.starts_with("missing field") =>
        {
            field.to_string()
        }
        _ => String::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(json: &str) -> ConfigError {
        Config::from_json(json.as_bytes()).unwrap_err()
    }

    #[test]
    fn empty_config_means_defaults() {
        assert_eq!(Config::from_json(b"").unwrap(), Config::default());
        assert_eq!(Config::from_json(b"{}").unwrap(), Config::default());
    }

    #[test]
    fn full_config_parses() {
        let c = Config::from_json(
            br#"{"weights":{"prefill":2,"decode":0.5},"endpoints":[{"address":"10.0.0.1:8000","capacity_blocks":19208,"models":["m"]}],
                "indexer":{"cluster":"idx"},"tokenizer":{"cluster":"tok","timeout_ms":20},"adapters":{"sql-lora":"m"}}"#,
        )
        .unwrap();
        assert_eq!(c.weights.prefill, 2.0);
        assert_eq!(c.weights.queue, 0.0);
        assert_eq!(c.capacity_of(&c.endpoints[0]), 19208);
        let indexer = c.indexer.unwrap();
        assert_eq!(indexer.poll_ms, 100);
        assert!(indexer.share_learned);
        assert_eq!(indexer.token_env, None);
        let tokenizer = c.tokenizer.unwrap();
        assert_eq!(tokenizer.path, "/tokenize");
        assert_eq!(tokenizer.memo_bytes, 8 << 20);
    }

    #[test]
    fn errors_name_the_field() {
        assert_eq!(err(r#"{"wieghts":{}}"#).field, "wieghts");
        assert_eq!(err(r#"{"weights":{"prefil":1}}"#).field, "prefil");
        assert_eq!(err(r#"{"weights":{"decode":-1}}"#).field, "weights.decode");
        assert_eq!(err(r#"{"block_size":0}"#).field, "block_size");
        assert_eq!(
            err(r#"{"tokenizer":{"cluster":"t","memo_bytes":2147483648}}"#).field,
            "tokenizer.memo_bytes"
        );
        assert_eq!(
            err(r#"{"endpoints":[{"address":"nope"}]}"#).field,
            "endpoints[0].address"
        );
        assert_eq!(
            err(r#"{"endpoints":[{"address":"a:1"},{"address":"a:1"}]}"#).field,
            "endpoints[1].address"
        );
        assert_eq!(
            err(r#"{"endpoints":[{"capacity_blocks":3}]}"#).field,
            "address"
        );
        assert_eq!(
            err(r#"{"indexer":{"cluster":""}}"#).field,
            "indexer.cluster"
        );
        for bad in ["", "1TOKEN", "KVROUTE-TOKEN", "A B"] {
            let json = format!(r#"{{"indexer":{{"cluster":"i","token_env":"{bad}"}}}}"#);
            assert_eq!(err(&json).field, "indexer.token_env", "{bad:?}");
        }
        let ok = Config::from_json(
            br#"{"indexer":{"cluster":"i","token_env":"KVROUTE_INDEXER_TOKEN","share_learned":false}}"#,
        )
        .unwrap()
        .indexer
        .unwrap();
        assert_eq!(ok.token_env.as_deref(), Some("KVROUTE_INDEXER_TOKEN"));
        assert!(!ok.share_learned);
        assert_eq!(
            err(r#"{"destination_header":"X-Bad"}"#).field,
            "destination_header"
        );
        assert_eq!(err(r#"{"paths":["v1"]}"#).field, "paths[0]");
        assert_eq!(err(r#"{"served_header":"Served"}"#).field, "served_header");
        assert_eq!(
            err(r#"{"served_header":"","served_header_from_route":true}"#).field,
            "served_header_from_route"
        );
        assert_eq!(
            err(r#"{"failure_cooldown_seconds":7200}"#).field,
            "failure_cooldown_seconds"
        );
        for budget in [0, (1 << 20) - 1, (768 << 20) + 1] {
            assert_eq!(
                err(&format!(r#"{{"index":{{"budget_bytes":{budget}}}}}"#)).field,
                "index.budget_bytes"
            );
        }
        assert_eq!(err(r#"{"index":{"flush_ms":5}}"#).field, "index.flush_ms");
        assert_eq!(
            err(r#"{"index":{"flush_ms":5000}}"#).field,
            "index.flush_ms"
        );
        assert_eq!(
            err(r#"{"index":{"max_learn_share":0}}"#).field,
            "index.max_learn_share"
        );
        assert_eq!(
            err(r#"{"index":{"max_client_share":1.5}}"#).field,
            "index.max_client_share"
        );
        assert_eq!(err(r#"{"default_model":""}"#).field, "default_model");
        assert_eq!(
            err(r#"{"endpoints":[{"address":"a:1","speed":0}]}"#).field,
            "endpoints[0].speed"
        );
        assert_eq!(
            err(r#"{"priority":{"default_class":"gold"}}"#).field,
            "priority.default_class"
        );
        assert_eq!(
            err(r#"{"priority":{"header":"X-Priority"}}"#).field,
            "priority.header"
        );
        assert_eq!(
            err(r#"{"priority":{"saturation":{"max_kv_usage":1.5}}}"#).field,
            "priority.saturation.max_kv_usage"
        );
        assert_eq!(
            err(r#"{"priority":{"retry_after_seconds":0}}"#).field,
            "priority.retry_after_seconds"
        );
        assert!(err(r#"{"priority":{"classes":{"x":"maybe"}}}"#)
            .to_string()
            .contains("unknown variant `maybe`"));
        assert_eq!(
            err(r#"{"tenant_header":"X-Tenant"}"#).field,
            "tenant_header"
        );
        assert!(err(r#"{"max_blocks":"many"}"#)
            .to_string()
            .contains("invalid type"));
        assert!(err("not json")
            .to_string()
            .starts_with("invalid kvroute config"));
    }

    #[test]
    fn priority_classes_with_a_default() {
        let c = Config::from_json(
            br#"{"priority":{"default_class":"batch","classes":{"interactive":"critical","batch":"sheddable"}},
                "endpoints":[{"address":"a:1","speed":0.5},{"address":"b:1"}]}"#,
        )
        .unwrap();
        let p = c.priority.clone().unwrap();
        assert_eq!(p.header, "x-kvroute-priority");
        assert_eq!(p.admission_of(Some("interactive")), Admission::Critical);
        for value in [None, Some("batch"), Some("unknown"), Some("")] {
            assert_eq!(p.admission_of(value), Admission::Sheddable, "{value:?}");
        }
        assert_eq!(
            (c.speed_of(&c.endpoints[0]), c.speed_of(&c.endpoints[1])),
            (0.5, 1.0)
        );
        // Turned on without classes: only requests marked sheddable are shed.
        let plain = Config::from_json(br#"{"priority":{}}"#)
            .unwrap()
            .priority
            .unwrap();
        assert_eq!(plain.admission_of(None), Admission::Critical);
        assert_eq!(plain.admission_of(Some("sheddable")), Admission::Sheddable);
    }

    #[test]
    fn remote_index_defaults_and_errors_name_the_field() {
        let remote = Config::from_json(br#"{"remote_index":{"cluster":"idx"}}"#)
            .unwrap()
            .remote_index
            .unwrap();
        assert_eq!(
            (
                remote.authority.as_str(),
                remote.path.as_str(),
                remote.timeout_ms,
                remote.min_blocks
            ),
            ("kvroute-indexer", "/v1/lookup", 50, 4)
        );
        for (json, field) in [
            (r#"{"remote_index":{}}"#, "cluster"),
            (r#"{"remote_index":{"cluster":""}}"#, "remote_index.cluster"),
            (
                r#"{"remote_index":{"cluster":"i","timeout_ms":0}}"#,
                "remote_index.timeout_ms",
            ),
            (
                r#"{"remote_index":{"cluster":"i","path":"v1/lookup"}}"#,
                "remote_index.path",
            ),
            (
                r#"{"remote_index":{"cluster":"i","min_blocks":0}}"#,
                "remote_index.min_blocks",
            ),
            (
                r#"{"max_blocks":8,"remote_index":{"cluster":"i","min_blocks":9}}"#,
                "remote_index.min_blocks",
            ),
            (r#"{"remote_index":{"cluster":"i","timeout":5}}"#, "timeout"),
        ] {
            assert_eq!(err(json).field, field, "{json}");
        }
    }

    #[test]
    fn path_matching_ignores_query() {
        let c = Config::default();
        assert!(c.routes_path("/v1/completions?x=1"));
        assert!(!c.routes_path("/v1/embeddings"));
    }
}
