//! Routing state of one worker VM, shared by its root context and its HTTP
//! contexts: the pods and their load, the reader of the index the singleton
//! publishes, this VM's recent decisions (the flush gap), peers and stats.
//! The VM holds no index: its routed prompts go to the singleton's queue.
//!
//! This file holds the VM's state, its start and its tick; its duties are one
//! concern per submodule: `index_read` (a decision's matches), `teaching`
//! (what routed requests teach, and their outcome), `load` (this VM's load
//! and its peers'), `messages` (the queues between VMs).

mod index_read;
mod load;
mod messages;
mod teaching;

use crate::host;
use crate::metrics::{FailOpen, FilterMetrics};
use crate::peers::{Audience, Peers};
use crate::ticker::Ticker;
use kvroute_core::config::Config;
use kvroute_core::hash::BlockHash;
use kvroute_core::index::published::{PublishedView, Unpublished};
use kvroute_core::outbox::Outbox;
use kvroute_core::peer_load::{LoadSnapshot, LOAD_SHARE_MS};
use kvroute_core::recent::RecentRoutes;
use kvroute_core::router::Cluster;
use kvroute_core::token_memo::TokenMemo;
use proxy_wasm::types::LogLevel;
use std::cell::RefCell;
use std::rc::Rc;

/// Tick of a worker VM between batches: peer discovery, heartbeat, gauges.
pub const DUTY_TICK_MS: u64 = 200;
/// Peers learn of this VM's tenant budget charges at most this late (plus a
/// tick's jitter): they go out together, one queue message per peer per batch.
const CHARGE_BATCH_MS: u64 = 10;

pub type SharedWorker = Rc<RefCell<Worker>>;

/// A request kvroute routed, as its response will settle it.
#[derive(Debug, Clone)]
pub struct RoutedRequest {
    /// The pod chosen first.
    pub pod: String,
    /// Its prompt's block hashes, learned provisionally on `pod`.
    pub taught: Taught,
    /// Leading blocks `pod` already held: a refusal takes back only the rest.
    pub matched_blocks: usize,
    /// Confirmed blocks are reported to the indexer (byte chunks only).
    pub report: bool,
    /// The byte chunks of a prompt routed on its token ids, taught on its
    /// pod beside the token blocks: a request of the same group whose
    /// tokenizer call fails routes on bytes and finds that pod instead of
    /// none. Token blocks come from the pods' own events; byte chunks have
    /// no other source, so confirmed ones are reported to the indexer.
    pub fallback: Taught,
}

/// A prompt's chain of block hashes taught on its pod.
#[derive(Debug, Clone, Default)]
pub struct Taught {
    pub hashes: Vec<BlockHash>,
    /// Leading blocks already taught to the pod in this epoch by an earlier
    /// request, which reports them to the indexer.
    pub already_taught: usize,
}

impl Taught {
    /// The blocks this request taught itself.
    fn own(&self) -> &[BlockHash] {
        self.hashes.get(self.already_taught..).unwrap_or(&[])
    }
}

pub struct Worker {
    pub config: Rc<Config>,
    pub cluster: Cluster,
    pub peers: Peers,
    pub metrics: FilterMetrics,
    tie_seed: u64,
    logged_causes: u32,
    /// The published index's head and pod table.
    index: PublishedView,
    /// Position in `cluster` of each published pod id, and the versions
    /// (published pod table, cluster pods) it was built for.
    positions: Vec<Option<usize>>,
    positions_of: (Option<(u64, u64)>, u64),
    /// Why the index was last unusable (logged when it changes).
    unpublished: Option<Unpublished>,
    /// When the index's head was last read and usable.
    head_read_ms: Option<u64>,
    recent: RecentRoutes,
    /// Token blocks of this VM's earlier tokenizer call-outs (precise mode).
    pub token_memo: TokenMemo,
    /// From the last decision, per matched pod (cluster position): the
    /// leading blocks the index showed taught to it in the current epoch,
    /// and the prompt's first hash (see [`Worker::routed`]).
    taught_this_epoch: Vec<(usize, usize)>,
    taught_for: Option<BlockHash>,
    /// Budget charges for the peers' next batch.
    outbox: Outbox,
    /// This VM's load changed since it last published it.
    load_changed: bool,
    /// The last published load named a pod: the duty tick writes it again,
    /// so that it stays fresh for the peers.
    load_published: bool,
    /// When the peers' published load was last read.
    peer_load_read_ms: u64,
    /// This VM's last load publications, for taking its own share out of
    /// the singleton's sum.
    own_published: Vec<LoadSnapshot>,
    /// The tick period last set, and when the periodic duties last ran.
    ticker: Ticker,
    /// The proxy logs debug lines: read at start and every duty tick, so a
    /// change of Envoy's log level shows within [`DUTY_TICK_MS`].
    pub debug_logging: bool,
}

impl Worker {
    /// A worker VM joining the proxy's peers (it registers its queue).
    pub fn start(config: Rc<Config>, vm_id: &str) -> Worker {
        let now = host::now();
        let (now_s, now_ms) = (now.secs, now.millis);
        let mut cluster = Cluster::load_only();
        cluster.set_configured(&config, now_s);
        Worker {
            recent: RecentRoutes::new(recent_keep_ms(&config)),
            token_memo: token_memo_for(&config),
            config,
            cluster,
            peers: Peers::join(vm_id, now_s, now_ms),
            metrics: FilterMetrics::define(),
            tie_seed: host::random_u64(),
            logged_causes: 0,
            index: PublishedView::default(),
            positions: Vec::new(),
            positions_of: (None, 0),
            unpublished: None,
            head_read_ms: None,
            taught_this_epoch: Vec::new(),
            taught_for: None,
            outbox: Outbox::new(CHARGE_BATCH_MS),
            load_changed: false,
            load_published: false,
            peer_load_read_ms: 0,
            own_published: Vec::new(),
            ticker: Ticker::new(DUTY_TICK_MS),
            debug_logging: host::debug_logging(),
        }
    }

    /// Called for every request: a VM that had gone quiet (like Envoy's
    /// main-thread copy) takes per-request messages again, and its load is
    /// read by the others.
    pub fn serve(&mut self) {
        if !self.peers.is_serving() {
            self.peers.start_serving(host::now().secs);
        }
    }

    pub fn reconfigure(&mut self, config: Rc<Config>) {
        self.head_read_ms = None;
        self.cluster.set_configured(&config, host::now().secs);
        self.recent.set_keep_ms(recent_keep_ms(&config));
        // Blocks hashed under another block size, chunk size or model scope
        // would be recalled wrongly: a changed setting starts the memo empty.
        let memo_shape = |c: &Config| {
            (
                c.tokenizer.as_ref().map(|t| t.memo_bytes),
                c.block_size,
                c.chunk_bytes,
                c.max_blocks,
                c.adapters.clone(),
            )
        };
        if memo_shape(&config) != memo_shape(&self.config) {
            self.token_memo = token_memo_for(&config);
        }
        self.config = config;
    }

    pub fn next_tie_seed(&mut self) -> u64 {
        self.tie_seed = self.tie_seed.wrapping_add(0x9e37_79b9_7f4a_7c15);
        self.tie_seed
    }

    /// Counts a fail-open and logs its cause the first time it is seen.
    pub fn fail_open(&mut self, cause: FailOpen, request_id: &str, detail: &str) {
        self.metrics.fallback(cause);
        let bit = 1 << (cause as u32);
        let level = if self.logged_causes & bit == 0 {
            LogLevel::Warn
        } else {
            LogLevel::Debug
        };
        self.logged_causes |= bit;
        host::log(
            level,
            &format!(
                "kvroute: request {request_id} left to the fallback LB ({}): {detail}",
                cause.name()
            ),
        );
    }

    /// Publishes this VM's changed load and sends the batch of charges when
    /// due; every [`DUTY_TICK_MS`]: the batched counters, heartbeat, gauges,
    /// and the load again while there is any (so it stays fresh for the
    /// peers).
    pub fn on_tick(&mut self) {
        let now = host::now();
        let (now_s, now_ms) = (now.secs, now.millis);
        if let Some(batch) = self.outbox.due(now_ms) {
            self.send_all(&batch, Audience::Serving, false);
        }
        let duty = self.ticker.duties_due(now_ms, DUTY_TICK_MS);
        let sharing = self.load_changed && self.peers.serving_count() > 0;
        if (self.load_changed && duty) || sharing || (duty && self.load_published) {
            self.publish_load(now_ms);
        }
        // A load that changed since the last tick is likely to change again
        // (a busy VM): the tick keeps the share period until a tick finds
        // no change, instead of two host calls per period to set it back
        // and forth.
        let mut period = if sharing { LOAD_SHARE_MS } else { DUTY_TICK_MS };
        if !self.outbox.is_empty() {
            period = period.min(self.outbox.delay_ms());
        }
        self.ticker.set_period(period);
        if !duty {
            return;
        }
        self.metrics.flush();
        self.debug_logging = host::debug_logging();
        self.peers.tick(now_s, now_ms);
        if self.peers.is_serving() {
            // Serving VMs sharing their load, this one included.
            self.metrics
                .peers
                .record(self.peers.serving_count() as u64 + 1);
        }
    }
}

/// The token memo of `config`'s tokenizer (empty without one).
fn token_memo_for(config: &Config) -> TokenMemo {
    let budget = config.tokenizer.as_ref().map_or(0, |t| t.memo_bytes);
    TokenMemo::new(budget, config.chunk_bytes, config.block_size)
}

/// Recent decisions live two flush periods: by then the singleton's flush
/// that carries them has landed.
fn recent_keep_ms(config: &Config) -> u64 {
    2 * u64::from(config.index.flush_ms)
}
