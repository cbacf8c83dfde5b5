//! The Envoy stats kvroute exports (Envoy prefixes them with `wasmcustom.`).

use std::cell::Cell;

use crate::host::Metric;
use kvroute_core::outcome::Outcome;
use kvroute_core::request::ParseError;
use kvroute_core::router::NoRoute;

/// Why a request was left to Envoy's own load balancer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailOpen {
    BodyTooLarge,
    Malformed,
    NoModel,
    NoPrompt,
    NoEndpoints,
    NoEndpointForModel,
    HeaderRejected,
}

impl FailOpen {
    pub const ALL: [FailOpen; 7] = [
        FailOpen::BodyTooLarge,
        FailOpen::Malformed,
        FailOpen::NoModel,
        FailOpen::NoPrompt,
        FailOpen::NoEndpoints,
        FailOpen::NoEndpointForModel,
        FailOpen::HeaderRejected,
    ];

    pub fn name(self) -> &'static str {
        match self {
            FailOpen::BodyTooLarge => "body_too_large",
            FailOpen::Malformed => "malformed",
            FailOpen::NoModel => "no_model",
            FailOpen::NoPrompt => "no_prompt",
            FailOpen::NoEndpoints => "no_endpoints",
            FailOpen::NoEndpointForModel => "no_endpoint_for_model",
            FailOpen::HeaderRejected => "header_rejected",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

impl From<&ParseError> for FailOpen {
    fn from(e: &ParseError) -> Self {
        match e {
            ParseError::Malformed(_) => FailOpen::Malformed,
            ParseError::NoPrompt => FailOpen::NoPrompt,
        }
    }
}

impl From<NoRoute> for FailOpen {
    fn from(e: NoRoute) -> Self {
        match e {
            NoRoute::NoEndpoints => FailOpen::NoEndpoints,
            NoRoute::NoEndpointForModel => FailOpen::NoEndpointForModel,
        }
    }
}

/// A counter bumped on every routed request. The VM sums in memory and
/// adds the sum to Envoy's stat at each duty tick, every `DUTY_TICK_MS`
/// (200 ms; [`FilterMetrics::flush`]): one host call per counter and tick
/// instead of one per bump, of which a request made about ten. The stat
/// lags by at most that tick.
#[derive(Debug)]
pub struct BatchedCounter {
    metric: Metric,
    pending: Cell<u64>,
}

impl BatchedCounter {
    fn new(name: &str) -> BatchedCounter {
        BatchedCounter {
            metric: Metric::counter(name),
            pending: Cell::new(0),
        }
    }

    pub fn inc(&self) {
        self.add(1);
    }

    pub fn add(&self, n: u64) {
        self.pending.set(self.pending.get().saturating_add(n));
    }

    fn flush(&self) {
        self.metric.add(self.pending.replace(0));
    }
}

/// Stats of the HTTP filter. Counters bumped on the request path are
/// [`BatchedCounter`]s; the rare ones (fail-opens, errors) and the
/// histograms reach Envoy at once.
#[derive(Debug)]
pub struct FilterMetrics {
    pub requests: BatchedCounter,
    pub decision_prefix: BatchedCounter,
    pub decision_load: BatchedCounter,
    pub blocks_matched: BatchedCounter,
    pub blocks_total: BatchedCounter,
    /// Routed blocks not sent to the singleton: the index showed them
    /// taught to the chosen pod in the current epoch.
    pub blocks_already_taught: BatchedCounter,
    pub decision_us: Metric,
    /// Decisions on load only: no singleton publishes the index (absent,
    /// stale or unreadable head).
    pub index_unpublished: Metric,
    /// Published buckets or set chunks that did not decode (each a miss).
    pub index_unreadable: Metric,
    /// Published buckets and set chunks the lookups read from shared data,
    /// and those the VM's copies (kept until the next flush) answered.
    pub index_lookup_reads: BatchedCounter,
    pub index_lookup_reused: BatchedCounter,
    pub peers: Metric,
    pub peer_errors: Metric,
    /// Reads of the peers' load answered by the singleton's sum (one key)
    /// rather than by each peer's key.
    pub peer_sum_reads: BatchedCounter,
    pub tokenizer_ok: Metric,
    pub tokenizer_failed: Metric,
    /// Prompts whose token blocks came from the token memo (no call-out).
    pub tokenizer_recalled: BatchedCounter,
    pub tokenizer_us: Metric,
    /// Decisions taken while every candidate pod was saturated (priority on).
    pub saturated: Metric,
    /// Sheddable requests answered 429 at saturation.
    pub shed: Metric,
    pub remote_lookup_answered: Metric,
    pub remote_lookup_failed: Metric,
    pub remote_lookup_us: Metric,
    fallback: Vec<Metric>,
    /// Responses by verdict on the decision: confirmed, refused, failed, rerouted.
    outcomes: [BatchedCounter; 4],
}

impl Drop for FilterMetrics {
    fn drop(&mut self) {
        self.flush();
    }
}

impl FilterMetrics {
    pub fn define() -> FilterMetrics {
        FilterMetrics {
            requests: BatchedCounter::new("kvroute.requests"),
            decision_prefix: BatchedCounter::new("kvroute.decision.prefix"),
            decision_load: BatchedCounter::new("kvroute.decision.load"),
            blocks_matched: BatchedCounter::new("kvroute.blocks.matched"),
            blocks_total: BatchedCounter::new("kvroute.blocks.total"),
            blocks_already_taught: BatchedCounter::new("kvroute.blocks.already_taught"),
            decision_us: Metric::histogram("kvroute.decision_us"),
            index_unpublished: Metric::counter("kvroute.index.unpublished"),
            index_unreadable: Metric::counter("kvroute.index.unreadable"),
            index_lookup_reads: BatchedCounter::new("kvroute.index.lookup_reads"),
            index_lookup_reused: BatchedCounter::new("kvroute.index.lookup_reused"),
            peers: Metric::gauge("kvroute.peers"),
            peer_errors: Metric::counter("kvroute.peer.errors"),
            peer_sum_reads: BatchedCounter::new("kvroute.peer.sum_reads"),
            tokenizer_ok: Metric::counter("kvroute.tokenizer.ok"),
            tokenizer_failed: Metric::counter("kvroute.tokenizer.failed"),
            tokenizer_recalled: BatchedCounter::new("kvroute.tokenizer.recalled"),
            tokenizer_us: Metric::histogram("kvroute.tokenizer_us"),
            saturated: Metric::counter("kvroute.saturated"),
            shed: Metric::counter("kvroute.shed"),
            remote_lookup_answered: Metric::counter("kvroute.remote_lookup.answered"),
            remote_lookup_failed: Metric::counter("kvroute.remote_lookup.failed"),
            remote_lookup_us: Metric::histogram("kvroute.remote_lookup_us"),
            fallback: FailOpen::ALL
                .iter()
                .map(|c| Metric::counter(&format!("kvroute.fallback.{}", c.name())))
                .collect(),
            outcomes: Outcome::NAMES
                .map(|name| BatchedCounter::new(&format!("kvroute.outcome.{name}"))),
        }
    }

    /// Adds the batched counts to Envoy's stats (each duty tick, and when the
    /// worker goes).
    pub fn flush(&self) {
        let batched = [
            &self.requests,
            &self.decision_prefix,
            &self.decision_load,
            &self.blocks_matched,
            &self.blocks_total,
            &self.blocks_already_taught,
            &self.index_lookup_reads,
            &self.index_lookup_reused,
            &self.peer_sum_reads,
            &self.tokenizer_recalled,
        ];
        batched
            .into_iter()
            .chain(&self.outcomes)
            .for_each(BatchedCounter::flush);
    }

    /// A routed decision: by prefix or by load alone, its blocks, its time.
    pub fn decided(&self, matched_blocks: usize, total_blocks: usize, elapsed_us: u64) {
        if matched_blocks > 0 {
            self.decision_prefix.inc()
        } else {
            self.decision_load.inc()
        }
        self.blocks_matched.add(matched_blocks as u64);
        self.blocks_total.add(total_blocks as u64);
        self.decision_us.record(elapsed_us);
    }

    pub fn outcome(&self, outcome: &Outcome) {
        self.outcomes[outcome.index()].inc();
    }

    pub fn fallback(&self, cause: FailOpen) {
        if let Some(m) = self.fallback.get(cause.index()) {
            m.inc();
        }
    }
}

/// Stats of the singleton: the index it writes and publishes.
#[derive(Debug, Clone, Copy)]
pub struct IndexMetrics {
    pub blocks: Metric,
    pub bytes: Metric,
    pub evicted: Metric,
    pub dropped: Metric,
    /// Shared-data keys written by index flushes.
    pub flushed: Metric,
    /// Main-thread µs spent in index flushes (encoding and writing keys).
    pub flush_us: Metric,
    /// Changed keys the last flush left for the next (its bound was reached).
    pub deferred: Metric,
    /// Buckets the singleton holds in memory (its working set).
    pub resident_buckets: Metric,
    /// Bytes of their slots (the working set's bound applies to these).
    pub resident_bytes: Metric,
    /// Buckets stored back before a flush because the working set was full.
    pub written_back_early: Metric,
    /// Buckets read back from shared data (written while not in the working set).
    pub read_back: Metric,
    /// The singleton VM's linear memory (its heap's high-water mark).
    pub writer_memory_bytes: Metric,
    /// Buckets that could not be read back from shared data (started empty).
    pub unloadable: Metric,
}

impl IndexMetrics {
    pub fn define() -> IndexMetrics {
        IndexMetrics {
            blocks: Metric::gauge("kvroute.index.blocks"),
            bytes: Metric::gauge("kvroute.index.bytes"),
            evicted: Metric::gauge("kvroute.index.evicted"),
            dropped: Metric::gauge("kvroute.index.dropped"),
            flushed: Metric::counter("kvroute.index.flushed"),
            flush_us: Metric::counter("kvroute.index.flush_us"),
            deferred: Metric::gauge("kvroute.index.deferred"),
            resident_buckets: Metric::gauge("kvroute.index.resident_buckets"),
            resident_bytes: Metric::gauge("kvroute.index.resident_bytes"),
            written_back_early: Metric::gauge("kvroute.index.written_back_early"),
            read_back: Metric::gauge("kvroute.index.read_back"),
            writer_memory_bytes: Metric::gauge("kvroute.index.writer_memory_bytes"),
            unloadable: Metric::gauge("kvroute.index.unloadable"),
        }
    }
}

/// Stats of the singleton that polls the indexer.
#[derive(Debug, Clone, Copy)]
pub struct FeedMetrics {
    pub ok: Metric,
    pub errors: Metric,
    pub snapshots: Metric,
    pub pages: Metric,
    pub bytes: Metric,
    pub latency_ms: Metric,
    /// Main-thread µs spent decoding and applying feed answers.
    pub apply_us: Metric,
    pub pods: Metric,
    pub pods_refused: Metric,
    pub learned_sent: Metric,
    pub learned_refused: Metric,
    /// Pod lists forwarded to the workers (changed, to a new worker, every 10 s).
    pub forwarded_lists: Metric,
    /// Load changes forwarded to the workers without the list.
    pub forwarded_loads: Metric,
}

impl FeedMetrics {
    pub fn define() -> FeedMetrics {
        FeedMetrics {
            ok: Metric::counter("kvroute.feed.ok"),
            errors: Metric::counter("kvroute.feed.errors"),
            snapshots: Metric::counter("kvroute.feed.snapshots"),
            pages: Metric::counter("kvroute.feed.pages"),
            bytes: Metric::counter("kvroute.feed.bytes"),
            latency_ms: Metric::histogram("kvroute.feed.latency_ms"),
            apply_us: Metric::counter("kvroute.feed.apply_us"),
            pods: Metric::gauge("kvroute.feed.pods"),
            pods_refused: Metric::counter("kvroute.feed.pods_refused"),
            learned_sent: Metric::counter("kvroute.feed.learned_sent"),
            learned_refused: Metric::counter("kvroute.feed.learned_refused"),
            forwarded_lists: Metric::counter("kvroute.feed.forwarded_lists"),
            forwarded_loads: Metric::counter("kvroute.feed.forwarded_loads"),
        }
    }
}
