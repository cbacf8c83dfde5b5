//! Prometheus metrics of the indexer (text exposition via `prometheus-client`).

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

type Labels = [(&'static str, &'static str); 1];

/// Every metric the indexer exports. Cloning shares the underlying values.
#[derive(Clone)]
pub struct Metrics {
    events: Family<Labels, Counter>,
    decode_errors: Family<Labels, Counter>,
    events_skipped: Family<Labels, Counter>,
    placeholder_blocks: Family<Labels, Counter>,
    rejected: Family<Labels, Counter>,
    dropped: Family<Labels, Counter>,
    replays: Family<Labels, Counter>,
    feed_requests: Family<Labels, Counter>,
    lookups: Family<Labels, Counter>,
    /// Time to answer a `POST /v1/lookup` (decode, lookup, encode).
    pub lookup_seconds: Histogram,
    /// Messages received from ZMQ (before queueing).
    pub messages_received: Counter,
    /// Blocks stored (per block of every BlockStored applied).
    pub blocks_stored: Counter,
    /// Blocks removed (per block of every BlockRemoved that matched).
    pub blocks_removed: Counter,
    /// BlockRemoved hashes the pod never stored (or already dropped).
    pub removed_unknown: Counter,
    /// BlockStored events whose parent is unknown (cannot be re-hashed).
    pub stored_unknown_parent: Counter,
    /// BlockStored events whose token count does not cover their blocks.
    pub stored_token_mismatch: Counter,
    /// BlockStored events of another block size than configured.
    pub stored_block_size_mismatch: Counter,
    /// Blocks refused because a pod is at `--max-blocks-per-pod`.
    pub blocks_refused_capacity: Counter,
    /// Blocks stored or removed in KV-cache groups that are not routed on
    /// (sliding-window, mamba… groups of hybrid models).
    pub blocks_not_routed: Counter,
    /// Sequence gaps detected.
    pub seq_gaps: Counter,
    /// Messages missing in those gaps.
    pub seq_missed: Counter,
    /// Gaps after which messages are still missing (no replay, or replay short).
    pub seq_gaps_unrecovered: Counter,
    /// Publisher restarts detected (sequence went back).
    pub restarts: Counter,
    /// Publishers first heard mid-stream (first sequence above 0).
    pub joined_midstream: Counter,
    /// Messages applied from replay sockets.
    pub replayed_messages: Counter,
    /// Learned hashes accepted / rejected (unknown pod).
    pub learned_accepted: Counter,
    pub learned_rejected: Counter,
    /// Learned entries dropped before their TTL to stay under the cap.
    pub learned_evicted: Counter,
    /// POST /v1/learned requests refused before reading the body, by reason.
    learned_unauthorized: Family<Labels, Counter>,
    /// Learned hashes refused because pods report them (token domain).
    pub learned_token_domain: Counter,
    /// Pods dropped from the index for silence.
    pub pods_expired: Counter,
    /// Scrapes of pod /metrics, and failures.
    pub scrapes: Counter,
    pub scrape_errors: Counter,
    /// Bytes of feed responses served.
    pub feed_bytes: Counter,
    /// Current values.
    pub pods: Gauge,
    pub blocks: Gauge,
    pub pod_blocks: Gauge,
    pub learned_entries: Gauge,
    pub memory_bytes: Gauge,
    pub queue_depth: Gauge,
    pub feed_cursor: Gauge,
    pub feed_log_ops: Gauge,
    pub feed_log_hashes: Gauge,
    /// Ops the last delta request was behind the head of the log.
    pub feed_lag_ops: Gauge,
    /// Seconds from ZMQ receive to applied.
    pub apply_lag_seconds: Histogram,
    /// Size of each feed response.
    pub feed_response_bytes: Histogram,
    registry: std::sync::Arc<Registry>,
}

impl Metrics {
    /// Creates and registers every metric.
    pub fn new() -> Metrics {
        let mut r = Registry::default();
        let events = Family::<Labels, Counter>::default();
        let decode_errors = Family::<Labels, Counter>::default();
        let events_skipped = Family::<Labels, Counter>::default();
        let placeholder_blocks = Family::<Labels, Counter>::default();
        let rejected = Family::<Labels, Counter>::default();
        let dropped = Family::<Labels, Counter>::default();
        let replays = Family::<Labels, Counter>::default();
        let feed_requests = Family::<Labels, Counter>::default();
        let apply_lag_seconds = Histogram::new(exponential_buckets(0.000_01, 4.0, 10));
        let feed_response_bytes = Histogram::new(exponential_buckets(64.0, 4.0, 12));
        let lookup_seconds = Histogram::new(exponential_buckets(0.000_002, 2.0, 16));
        let m = Metrics {
            events,
            decode_errors,
            events_skipped,
            placeholder_blocks,
            rejected,
            dropped,
            replays,
            feed_requests,
            lookups: Family::<Labels, Counter>::default(),
            lookup_seconds: lookup_seconds.clone(),
            messages_received: Counter::default(),
            blocks_stored: Counter::default(),
            blocks_removed: Counter::default(),
            removed_unknown: Counter::default(),
            stored_unknown_parent: Counter::default(),
            stored_token_mismatch: Counter::default(),
            stored_block_size_mismatch: Counter::default(),
            blocks_refused_capacity: Counter::default(),
            blocks_not_routed: Counter::default(),
            seq_gaps: Counter::default(),
            seq_missed: Counter::default(),
            seq_gaps_unrecovered: Counter::default(),
            restarts: Counter::default(),
            joined_midstream: Counter::default(),
            replayed_messages: Counter::default(),
            learned_accepted: Counter::default(),
            learned_rejected: Counter::default(),
            learned_evicted: Counter::default(),
            learned_unauthorized: Family::<Labels, Counter>::default(),
            learned_token_domain: Counter::default(),
            pods_expired: Counter::default(),
            scrapes: Counter::default(),
            scrape_errors: Counter::default(),
            feed_bytes: Counter::default(),
            pods: Gauge::default(),
            blocks: Gauge::default(),
            pod_blocks: Gauge::default(),
            learned_entries: Gauge::default(),
            memory_bytes: Gauge::default(),
            queue_depth: Gauge::default(),
            feed_cursor: Gauge::default(),
            feed_log_ops: Gauge::default(),
            feed_log_hashes: Gauge::default(),
            feed_lag_ops: Gauge::default(),
            apply_lag_seconds: apply_lag_seconds.clone(),
            feed_response_bytes: feed_response_bytes.clone(),
            registry: std::sync::Arc::new(Registry::default()),
        };
        macro_rules! add {
            ($name:expr, $help:expr, $m:expr) => {
                r.register(format!("kvroute_indexer_{}", $name), $help, $m.clone())
            };
        }
        add!("events", "KV events applied, by type", m.events);
        add!(
            "decode_errors",
            "Messages dropped as undecodable, by kind",
            m.decode_errors
        );
        add!(
            "events_skipped",
            "Events skipped inside a decoded message (the rest of it applied), by reason",
            m.events_skipped
        );
        add!(
            "placeholder_blocks",
            "Blocks of CPU-offload placeholder events, by result (applied: the block was known by hash; unknown: it was not)",
            m.placeholder_blocks
        );
        add!(
            "messages_rejected",
            "Messages rejected, by reason",
            m.rejected
        );
        add!(
            "messages_dropped",
            "Messages dropped by a bounded queue, by reason",
            m.dropped
        );
        add!(
            "replays",
            "Replay requests to pods' replay sockets, by result",
            m.replays
        );
        add!(
            "feed_requests",
            "Feed requests served, by kind",
            m.feed_requests
        );
        add!(
            "lookups",
            "POST /v1/lookup requests, by result (answered, bad_request)",
            m.lookups
        );
        add!(
            "lookup_seconds",
            "Time to answer a POST /v1/lookup",
            m.lookup_seconds
        );
        add!(
            "messages_received",
            "ZMQ messages received",
            m.messages_received
        );
        add!(
            "blocks_stored",
            "Blocks stored by BlockStored events",
            m.blocks_stored
        );
        add!(
            "blocks_removed",
            "Blocks removed by BlockRemoved events",
            m.blocks_removed
        );
        add!(
            "removed_unknown",
            "BlockRemoved hashes not in the index",
            m.removed_unknown
        );
        add!(
            "stored_unknown_parent",
            "BlockStored events with an unknown parent",
            m.stored_unknown_parent
        );
        add!(
            "stored_token_mismatch",
            "BlockStored events whose tokens do not cover their blocks",
            m.stored_token_mismatch
        );
        add!(
            "stored_block_size_mismatch",
            "BlockStored events of another block size than configured",
            m.stored_block_size_mismatch
        );
        add!(
            "blocks_refused_capacity",
            "Blocks refused at --max-blocks-per-pod",
            m.blocks_refused_capacity
        );
        add!(
            "blocks_not_routed",
            "Blocks stored or removed in KV-cache groups not routed on (sliding-window, mamba)",
            m.blocks_not_routed
        );
        add!("seq_gaps", "Sequence gaps detected", m.seq_gaps);
        add!(
            "seq_missed",
            "Messages missing in sequence gaps",
            m.seq_missed
        );
        add!(
            "seq_gaps_unrecovered",
            "Sequence gaps not filled by replay",
            m.seq_gaps_unrecovered
        );
        add!(
            "restarts",
            "Publisher restarts detected (sequence went back)",
            m.restarts
        );
        add!(
            "joined_midstream",
            "Publishers first heard mid-stream (replayed from 0 when a replay endpoint is known)",
            m.joined_midstream
        );
        add!(
            "replayed_messages",
            "Messages applied from replay sockets",
            m.replayed_messages
        );
        add!(
            "learned_accepted",
            "Learned hashes accepted",
            m.learned_accepted
        );
        add!(
            "learned_rejected",
            "Learned hashes rejected (unknown pod)",
            m.learned_rejected
        );
        add!(
            "learned_evicted",
            "Learned entries evicted to stay under the cap",
            m.learned_evicted
        );
        add!(
            "learned_unauthorized",
            "POST /v1/learned requests refused (no, malformed or wrong bearer token; writes disabled), by reason",
            m.learned_unauthorized
        );
        add!(
            "learned_token_domain",
            "Learned hashes refused because pods report them through KV events (token domain, not shared)",
            m.learned_token_domain
        );
        add!(
            "pods_expired",
            "Pods dropped from the index after silence",
            m.pods_expired
        );
        add!("scrapes", "Pod /metrics scrapes", m.scrapes);
        add!(
            "scrape_errors",
            "Failed pod /metrics scrapes",
            m.scrape_errors
        );
        add!("feed_bytes", "Bytes of feed responses", m.feed_bytes);
        add!("pods", "Pods known", m.pods);
        add!("blocks", "(vLLM block, pod, rank) entries held", m.blocks);
        add!(
            "pod_blocks",
            "(kvroute hash, pod) entries served in the feed",
            m.pod_blocks
        );
        add!(
            "learned_entries",
            "Learned (hash, pod) entries held",
            m.learned_entries
        );
        add!(
            "memory_bytes",
            "Estimated bytes held by the index, the delta log and learned entries",
            m.memory_bytes
        );
        add!(
            "queue_depth",
            "Messages waiting in the event queue",
            m.queue_depth
        );
        add!("feed_cursor", "Head of the feed delta log", m.feed_cursor);
        add!(
            "feed_log_ops",
            "Ops retained in the feed delta log",
            m.feed_log_ops
        );
        add!(
            "feed_log_hashes",
            "Hashes retained in the feed delta log",
            m.feed_log_hashes
        );
        add!(
            "feed_lag_ops",
            "Ops the last delta request was behind the head",
            m.feed_lag_ops
        );
        add!(
            "apply_lag_seconds",
            "Seconds from ZMQ receive to applied",
            m.apply_lag_seconds
        );
        add!(
            "feed_response_bytes",
            "Size of feed responses",
            m.feed_response_bytes
        );
        Metrics {
            registry: std::sync::Arc::new(r),
            ..m
        }
    }

    fn inc(family: &Family<Labels, Counter>, key: &'static str, value: &'static str, by: u64) {
        family.get_or_create(&[(key, value)]).inc_by(by);
    }

    /// An event of `kind` was applied.
    pub fn event(&self, kind: &'static str) {
        Self::inc(&self.events, "type", kind, 1);
    }

    /// A message could not be decoded.
    pub fn decode_error(&self, kind: &'static str) {
        Self::inc(&self.decode_errors, "kind", kind, 1);
    }

    /// An event of a decoded message was skipped for `reason`.
    pub fn event_skipped(&self, reason: &'static str) {
        Self::inc(&self.events_skipped, "reason", reason, 1);
    }

    /// `n` blocks of placeholder events ended with `result`.
    pub fn placeholder_blocks(&self, result: &'static str, n: u64) {
        if n > 0 {
            Self::inc(&self.placeholder_blocks, "result", result, n);
        }
    }

    /// A message was rejected.
    pub fn rejected(&self, reason: &'static str) {
        Self::inc(&self.rejected, "reason", reason, 1);
    }

    /// Messages were dropped by a bounded queue.
    pub fn dropped(&self, reason: &'static str, n: u64) {
        Self::inc(&self.dropped, "reason", reason, n);
    }

    /// A replay finished with `result`.
    pub fn replay(&self, result: &'static str) {
        Self::inc(&self.replays, "result", result, 1);
    }

    /// A feed request of `kind` was served.
    pub fn feed_request(&self, kind: &'static str) {
        Self::inc(&self.feed_requests, "kind", kind, 1);
    }

    /// A `POST /v1/lookup` ended with `result`.
    pub fn lookup(&self, result: &'static str) {
        Self::inc(&self.lookups, "result", result, 1);
    }

    /// A POST /v1/learned was refused for `reason`.
    pub fn learned_unauthorized(&self, reason: &'static str) {
        Self::inc(&self.learned_unauthorized, "reason", reason, 1);
    }

    /// Value of a labelled counter (tests and the debug endpoint).
    pub fn counter_value(&self, family: &str, value: &'static str) -> u64 {
        let (f, key) = match family {
            "events" => (&self.events, "type"),
            "decode_errors" => (&self.decode_errors, "kind"),
            "events_skipped" => (&self.events_skipped, "reason"),
            "placeholder_blocks" => (&self.placeholder_blocks, "result"),
            "rejected" => (&self.rejected, "reason"),
            "dropped" => (&self.dropped, "reason"),
            "replays" => (&self.replays, "result"),
            "lookups" => (&self.lookups, "result"),
            "learned_unauthorized" => (&self.learned_unauthorized, "reason"),
            _ => return 0,
        };
        f.get_or_create(&[(key, value)]).get()
    }

    /// Prometheus text exposition.
    pub fn encode(&self) -> String {
        let mut out = String::new();
        if encode(&mut out, &self.registry).is_err() {
            out.clear();
        }
        out
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}
