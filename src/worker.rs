//! Routing state of one worker VM, shared by its root context and its HTTP
//! contexts: the pods and their load, the reader of the index the singleton
//! publishes, this VM's recent decisions (the flush gap), peers and stats.
//! The VM holds no index: its routed prompts go to the singleton's queue.

use crate::host::{self, Now, SharedData};
use crate::metrics::{FailOpen, FilterMetrics};
use crate::peers::{Audience, Peers};
use crate::ticker::Ticker;
use kvroute_core::config::Config;
use kvroute_core::feed;
use kvroute_core::hash::BlockHash;
use kvroute_core::index::published::{PublishedView, Unpublished};
use kvroute_core::index::{epoch_start_s, match_lengths, LookupCost, PodMatch};
use kvroute_core::outbox::{Outbox, Pushed};
use kvroute_core::outcome::Outcome;
use kvroute_core::peer_load::{self, LoadSnapshot, LoadSum, PodLoad, LOAD_SHARE_MS};
use kvroute_core::recent::RecentRoutes;
use kvroute_core::router::{Cluster, Decision, HashedPrompt, LocalMatch, NoRoute};
use kvroute_core::token_memo::TokenMemo;
use kvroute_core::wire::{self, PeerMessage};
use proxy_wasm::types::LogLevel;
use std::cell::RefCell;
use std::collections::HashMap;
use std::rc::Rc;

/// Precise entries stay trusted this long after the last feed update when
/// no indexer poll period is configured.
const DEFAULT_TRUST_S: u32 = 5;
/// Tick of a worker VM between batches: peer discovery, heartbeat, gauges.
pub const DUTY_TICK_MS: u64 = 200;
/// Peers learn of this VM's tenant budget charges at most this late (plus a
/// tick's jitter): they go out together, one queue message per peer per batch.
const CHARGE_BATCH_MS: u64 = 10;
/// An index whose head (rewritten at every flush) is older than this is not
/// read: its writer stopped, and the VM routes on load only.
const STALE_AFTER_MS: u64 = 5000;
/// A VM reads the index's head (a host call) at most this often: a view up
/// to this much behind the writer's flushes (every 100 ms) costs nothing,
/// and its recent routes cover what it sent meanwhile.
const HEAD_REREAD_MS: u64 = 10;
/// Own load publications kept: the singleton's sum counts one at most a
/// few share periods old.
const OWN_PUBLICATIONS_KEPT: usize = 8;

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

    /// Picks the pod for `prompt`: the published index's matches and this
    /// VM's own recent decisions, ranked with the pods' load. Without a
    /// published index, on load only, and the reason.
    pub fn decide(
        &mut self,
        config: &Config,
        prompt: &HashedPrompt,
        now: Now,
    ) -> (Result<Decision, NoRoute>, Option<Unpublished>) {
        if self.cluster.is_empty() {
            // Nothing to route to, whatever the index says (a sidecar's local fallback).
            return (Err(NoRoute::NoEndpoints), None);
        }
        self.read_peer_load(now.millis);
        let seed = self.next_tie_seed();
        self.taught_for = prompt.hashes.first().copied();
        let (matches, lookup, unpublished) = self.index_matches(config, &prompt.hashes, true, now);
        self.note_index_state(unpublished);
        let decision = self
            .cluster
            .decide_on(config, prompt, now.secs, seed, &matches, lookup);
        (decision, unpublished)
    }

    /// The most leading blocks of `hashes` any pod is known to hold (the
    /// published index and this VM's recent decisions); 0 without an index.
    pub fn longest_known(&mut self, config: &Config, hashes: &[BlockHash], now: Now) -> usize {
        let (matches, ..) = self.index_matches(config, hashes, false, now);
        matches.iter().map(|m| m.blocks).max().unwrap_or(0)
    }

    /// Every pod's leading blocks of `hashes` in the published index and in
    /// this VM's recent decisions. With `for_decision`, also notes which
    /// blocks the index showed taught this epoch (see [`Worker::routed`]).
    fn index_matches(
        &mut self,
        config: &Config,
        hashes: &[BlockHash],
        for_decision: bool,
        now: Now,
    ) -> (Vec<LocalMatch>, LookupCost, Option<Unpublished>) {
        let (now_s, now_ms) = (now.secs, now.millis);
        let mut matches: Vec<LocalMatch> = Vec::new();
        let mut lookup = LookupCost::default();
        if for_decision {
            self.taught_this_epoch.clear();
        }
        let head_is_recent = self
            .head_read_ms
            .is_some_and(|read| now_ms.saturating_sub(read) < HEAD_REREAD_MS);
        if !head_is_recent {
            if let Err(why) = self.index.refresh(&SharedData, now_ms, STALE_AFTER_MS) {
                self.head_read_ms = None;
                self.metrics.index_unpublished.inc();
                return (matches, lookup, Some(why));
            }
            self.head_read_ms = Some(now_ms);
        }
        self.refresh_positions();
        if let Some(source) = self.index.source(&SharedData) {
            let rules = self.cluster.match_rules(config, now_s);
            let mut found: Vec<PodMatch> = Vec::new();
            lookup = match_lengths(&source, hashes, now_s, &rules, &mut found);
            let m = &self.metrics;
            let (reads, reused) = source.reads();
            m.index_unreadable.add(source.unreadable());
            m.index_lookup_reads.add(reads);
            m.index_lookup_reused.add(reused);
            for m in &found {
                let Some(&Some(pod)) = self.positions.get(m.pod.slot()) else {
                    continue;
                };
                matches.push(LocalMatch {
                    pod,
                    blocks: m.blocks,
                    credit: m.credit,
                });
                if for_decision && m.taught_this_epoch > 0 {
                    self.taught_this_epoch.push((pod, m.taught_this_epoch));
                }
            }
        }
        // The flush gap: what this VM routed and the index may not show yet.
        for (pod, blocks) in self.recent.matches(hashes, now_ms) {
            if let Some(pod) = self.cluster.position(pod) {
                LocalMatch::merge_learned(&mut matches, pod, blocks);
            }
        }
        (matches, lookup, None)
    }

    /// Logs when the published index becomes unusable and when it is back.
    fn note_index_state(&mut self, now: Option<Unpublished>) {
        if now == self.unpublished {
            return;
        }
        match now {
            Some(why) => host::log(
                LogLevel::Warn,
                &format!(
                    "kvroute: no routing index published ({}): routing on load only until the \
                     singleton (bootstrap wasm_service, same vm_id) publishes one",
                    why.name()
                ),
            ),
            None => host::log(
                LogLevel::Info,
                "kvroute: routing index published; reading it",
            ),
        }
        self.unpublished = now;
    }

    /// Maps published pod ids to this VM's pods when either side changed.
    fn refresh_positions(&mut self) {
        let key = (self.index.pods_version(), self.cluster.pods_version());
        if key == self.positions_of {
            return;
        }
        let table = self.index.pods();
        self.positions = vec![None; table.id_span()];
        for (id, address) in table.addresses() {
            self.positions[id.slot()] = self.cluster.position(address);
        }
        self.positions_of = key;
    }

    /// A request went to `pod` (just decided on `hashes`): its load is
    /// counted here and by the peers, and the blocks it teaches go to the
    /// singleton (and the recent decisions, until the singleton's flush
    /// shows them), except the leading ones the decision's lookup found
    /// already taught to `pod` in this epoch, or this VM sent in it:
    /// teaching them again would change nothing but cost the singleton
    /// their buckets' reads. Returns how many leading blocks were skipped.
    pub fn routed(
        &mut self,
        pod: &str,
        prompt_blocks: u32,
        hashes: &[BlockHash],
        now: Now,
    ) -> usize {
        self.cluster
            .record_routed(pod, prompt_blocks, &[], now.secs);
        self.note_load_change();
        let position = self.cluster.position(pod);
        let in_index = match self.taught_for.take() {
            Some(first) if hashes.first() == Some(&first) => self
                .taught_this_epoch
                .iter()
                .find(|&&(p, _)| Some(p) == position)
                .map_or(0, |&(_, blocks)| blocks),
            _ => 0,
        };
        self.taught_this_epoch.clear();
        let already_taught = in_index.max(self.sent_this_epoch(pod, hashes, now));
        self.teach(pod, hashes, already_taught, now.millis);
        already_taught
    }

    /// Leading `hashes` the published index (as the request's decision read
    /// it) shows taught to `pod` in this epoch.
    fn taught_in_index(&self, pod: &str, hashes: &[BlockHash], now: Now) -> usize {
        let (Some(position), Some(source)) =
            (self.cluster.position(pod), self.index.source(&SharedData))
        else {
            return 0;
        };
        let rules = self.cluster.match_rules(&self.config, now.secs);
        let mut found: Vec<PodMatch> = Vec::new();
        match_lengths(&source, hashes, now.secs, &rules, &mut found);
        found
            .iter()
            .find(|m| self.positions.get(m.pod.slot()) == Some(&Some(position)))
            .map_or(0, |m| m.taught_this_epoch)
    }

    /// Leading `hashes` this VM sent for `pod` in this epoch, which the index
    /// may not show yet (the flush gap).
    fn sent_this_epoch(&self, pod: &str, hashes: &[BlockHash], now: Now) -> usize {
        let epoch_start_ms =
            u64::from(epoch_start_s(self.config.index.ttl_seconds, now.secs)) * 1000;
        self.recent
            .taught_since(pod, hashes, epoch_start_ms, now.millis)
    }

    /// Teaches a token-routed prompt's byte chunks on `pod` (see
    /// [`RoutedRequest::fallback`]), but for the leading ones the index
    /// shows taught to it in this epoch, or this VM sent in it. The decision
    /// looked up the token blocks only: this second lookup costs a few
    /// probes of the chain, where teaching and reporting every chunk again
    /// would cost the singleton and the indexer a write each.
    pub fn teach_byte_fallback(&mut self, pod: &str, hashes: Vec<BlockHash>, now: Now) -> Taught {
        // A prompt this VM sent whole in the epoch (a repeated one) needs no
        // lookup: the index cannot show more.
        let sent = self.sent_this_epoch(pod, &hashes, now);
        let already_taught = if sent == hashes.len() {
            sent
        } else {
            self.taught_in_index(pod, &hashes, now).max(sent)
        };
        self.teach(pod, &hashes, already_taught, now.millis);
        Taught {
            hashes,
            already_taught,
        }
    }

    /// Sends what `pod` holds (cut to its share) to the singleton, but for
    /// its first `already_taught` blocks.
    fn teach(&mut self, pod: &str, hashes: &[BlockHash], already_taught: usize, now_ms: u64) {
        let learned = self.cluster.learnable(pod, hashes);
        if learned.is_empty() {
            return;
        }
        self.recent.record(pod, learned, now_ms);
        let skipped = already_taught.min(learned.len());
        self.metrics.blocks_already_taught.add(skipped as u64);
        if skipped == learned.len() {
            return;
        }
        let message = PeerMessage::Routed {
            pod: pod.to_string(),
            hashes: learned[skipped..].to_vec(),
        };
        self.send(message, Audience::None, true);
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

    /// A request routed here got its first response bytes: its prompt's
    /// blocks stop counting as the pod's pending prefill.
    pub fn prefill_done(&mut self, pod: &str, prompt_blocks: u32) {
        self.cluster.record_prefill_done(pod, prompt_blocks);
        self.note_load_change();
    }

    /// A request routed here ended: `prompt_blocks` of its prefill were still
    /// pending, `routed_blocks` uncached blocks held KV on the pod.
    pub fn finished(&mut self, pod: &str, prompt_blocks: u32, routed_blocks: u32) {
        self.cluster.record_finished(pod, prompt_blocks);
        self.cluster.record_released(pod, routed_blocks);
        self.note_load_change();
    }

    /// This VM's load changed: it is published within [`LOAD_SHARE_MS`]
    /// when there are serving peers to read it, else at the next duty tick.
    fn note_load_change(&mut self) {
        self.load_changed = true;
        if self.peers.serving_count() > 0 {
            let period = self.ticker.period_ms().min(LOAD_SHARE_MS);
            self.ticker.set_period(period);
        }
    }

    /// Writes this VM's load to its key (see [`kvroute_core::peer_load`]).
    fn publish_load(&mut self, now_ms: u64) {
        self.load_changed = false;
        let Some(key) = self.peers.own_load_key() else {
            return;
        };
        // Strictly increasing: the singleton's sum names a snapshot by it.
        let written_ms = self
            .own_published
            .last()
            .map_or(now_ms, |last| now_ms.max(last.written_ms + 1));
        let snapshot = LoadSnapshot {
            written_ms,
            pods: self.cluster.own_load(),
        };
        self.load_published = !snapshot.pods.is_empty();
        match snapshot.encode() {
            Ok(bytes) => {
                if !host::shared_set(key, &bytes, 0) {
                    self.metrics.peer_errors.inc();
                }
            }
            Err(e) => host::log(LogLevel::Warn, &format!("kvroute: load not published: {e}")),
        }
        if self.own_published.len() == OWN_PUBLICATIONS_KEPT {
            self.own_published.remove(0);
        }
        self.own_published.push(snapshot);
    }

    /// The serving peers' load as they last published it, read at most
    /// every [`LOAD_SHARE_MS`].
    fn read_peer_load(&mut self, now_ms: u64) {
        if now_ms.saturating_sub(self.peer_load_read_ms) < LOAD_SHARE_MS {
            return;
        }
        self.peer_load_read_ms = now_ms;
        if self.peers.serving_count() == 0 {
            self.cluster.set_peer_load(&HashMap::new());
            return;
        }
        if let Some(others) = self.summed_peer_load(now_ms) {
            self.metrics.peer_sum_reads.inc();
            self.cluster.set_peer_load(&others);
            return;
        }
        let mut snapshots = Vec::new();
        for key in self.peers.serving_load_keys() {
            let Some((bytes, _)) = host::shared_get(key) else {
                continue;
            };
            match LoadSnapshot::decode(&bytes) {
                Ok(snapshot) => snapshots.push(snapshot),
                Err(_) => self.metrics.peer_errors.inc(),
            }
        }
        self.cluster
            .set_peer_load(&peer_load::sum_fresh(&snapshots, now_ms));
    }

    /// The peers' load from the singleton's sum (one read instead of one
    /// per peer), if it is fresh and counted this VM's load as kept.
    fn summed_peer_load(&self, now_ms: u64) -> Option<HashMap<String, PodLoad>> {
        // Its serving peers and itself.
        if !peer_load::is_summed(self.peers.serving_count() + 1) {
            return None;
        }
        let own_key = self.peers.own_load_key()?;
        let (bytes, _) = host::shared_get(peer_load::SUM_KEY)?;
        let Ok(sum) = LoadSum::decode(&bytes) else {
            self.metrics.peer_errors.inc();
            return None;
        };
        sum.without(own_key, &self.own_published, now_ms)
    }

    /// Tells the serving peers about a budget charge, in the next batch
    /// (within [`CHARGE_BATCH_MS`]): every queue message wakes each peer's VM.
    pub fn tell_peers(&mut self, message: PeerMessage, now: Now) {
        if self.peers.serving_count() == 0 {
            return;
        }
        if self.outbox.push(message, now.millis) == Pushed::Armed {
            self.ticker.set_period(self.outbox.delay_ms());
        }
    }

    /// Hands confirmed blocks to the singleton, which reports them to the
    /// indexer as learned entries (when this proxy shares what it learns);
    /// the singleton learned them when they were routed.
    pub fn report_learned(&self, pod: &str, hashes: &[BlockHash]) {
        let sharing = self
            .config
            .indexer
            .as_ref()
            .is_some_and(|i| i.share_learned);
        if sharing && !hashes.is_empty() {
            let message = PeerMessage::Learned {
                pod: pod.to_string(),
                hashes: hashes.to_vec(),
            };
            self.send(message, Audience::None, true);
        }
    }

    /// Settles a routed request by its response: confirms or takes back what
    /// it taught, passes over a pod that failed. `report` says whether its
    /// blocks are shared with the indexer (byte chunks: token blocks come
    /// from the pods' own events). A request reports only the blocks it
    /// taught: the request that taught the leading ones in this epoch
    /// reported them, and the indexer's learned entries outlive an epoch.
    pub fn settle(&mut self, request: &RoutedRequest, outcome: Outcome, request_id: &str) {
        self.metrics.outcome(&outcome);
        let chosen = &request.pod;
        match outcome {
            Outcome::Confirmed => {
                if request.report {
                    self.report_learned(chosen, request.taught.own());
                }
                self.report_learned(chosen, request.fallback.own());
            }
            Outcome::Refused => {
                let hashes = &request.taught.hashes;
                let taught = hashes.get(request.matched_blocks..).unwrap_or(&[]);
                self.recent.forget(chosen);
                let messages: Vec<PeerMessage> = [taught, request.fallback.own()]
                    .into_iter()
                    .filter(|hashes| !hashes.is_empty())
                    .map(|hashes| PeerMessage::Unlearned {
                        pod: chosen.clone(),
                        hashes: hashes.to_vec(),
                    })
                    .collect();
                self.send_all(&messages, Audience::None, true);
            }
            Outcome::Failed | Outcome::ServedElsewhere { .. } => {
                self.cluster.record_failure(chosen, host::now().secs);
                self.recent.forget(chosen);
                // Peers pass the pod over; the singleton clears what was learned on it.
                let message = PeerMessage::Failed {
                    pod: chosen.clone(),
                };
                self.send(message, Audience::Serving, true);
                host::log(
                    LogLevel::Warn,
                    &format!(
                        "kvroute: request {request_id}: pod {chosen} failed ({}); passed over for {} s",
                        outcome.name(),
                        self.config.failure_cooldown_seconds
                    ),
                );
            }
        }
        if let Outcome::ServedElsewhere { pod, success: true } = outcome {
            let hashes = &request.taught.hashes;
            self.teach(pod, hashes, 0, host::now().millis);
            if request.report {
                self.report_learned(pod, hashes);
            }
            let bytes = &request.fallback.hashes;
            if !bytes.is_empty() {
                self.teach(pod, bytes, 0, host::now().millis);
                self.report_learned(pod, bytes);
            }
        }
    }

    fn send(&self, message: PeerMessage, audience: Audience, to_singleton: bool) {
        self.send_all(&[message], audience, to_singleton);
    }

    fn send_all(&self, messages: &[PeerMessage], audience: Audience, to_singleton: bool) {
        match wire::encode_batch(messages) {
            Ok(bytes) => {
                self.peers.broadcast(&bytes, audience, to_singleton);
            }
            Err(e) => host::log(
                LogLevel::Warn,
                &format!("kvroute: peer message not sent: {e}"),
            ),
        }
    }

    /// Applies what peers sent to this VM's queue.
    pub fn drain_queue(&mut self) {
        let Some(queue) = self.peers.own_queue() else {
            return;
        };
        let now_s = host::now().secs;
        while let Some(bytes) = host::queue_dequeue(queue) {
            match wire::decode_batch(&bytes) {
                Ok(messages) => messages.into_iter().for_each(|m| self.apply(m, now_s)),
                Err(e) => {
                    self.metrics.peer_errors.inc();
                    host::log(
                        LogLevel::Warn,
                        &format!("kvroute: dropped a peer message: {e}"),
                    );
                }
            }
        }
    }

    fn apply(&mut self, message: PeerMessage, now_s: u32) {
        match message {
            // Only the singleton takes these (it writes the index).
            PeerMessage::Routed { .. }
            | PeerMessage::Learned { .. }
            | PeerMessage::Unlearned { .. } => {}
            PeerMessage::Failed { pod } => self.cluster.record_failure(&pod, now_s),
            PeerMessage::Charged {
                pod,
                client,
                blocks,
            } => self
                .cluster
                .charge_client(&pod, client, blocks as usize, now_s),
            PeerMessage::Feed(bytes) => match feed::decode(&bytes) {
                Ok(update) => {
                    let trust_s = self.config.indexer.as_ref().map_or(DEFAULT_TRUST_S, |i| {
                        (i.poll_ms.saturating_mul(30) / 1000).max(DEFAULT_TRUST_S)
                    });
                    self.cluster.apply_feed(&update, now_s, trust_s);
                }
                Err(e) => {
                    self.metrics.peer_errors.inc();
                    host::log(
                        LogLevel::Warn,
                        &format!("kvroute: dropped a feed update: {e}"),
                    );
                }
            },
        }
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

/// Recent decisions live two flush periods: by then the singleton's flush
/// that carries them has landed.
fn token_memo_for(config: &Config) -> TokenMemo {
    let budget = config.tokenizer.as_ref().map_or(0, |t| t.memo_bytes);
    TokenMemo::new(budget, config.chunk_bytes, config.block_size)
}

fn recent_keep_ms(config: &Config) -> u64 {
    2 * u64::from(config.index.flush_ms)
}
