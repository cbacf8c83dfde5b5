//! The singleton (bootstrap `wasm_service`, main thread): the only writer of
//! the proxy's routing index. It applies the indexer feed (the calls
//! `kvroute_core::feed_client` asks for: a poll per `indexer.poll_ms`,
//! snapshot pages and waiting deltas at once; each page is applied as it
//! comes, on its own run of buckets: pages are ranges of the index key) and what the workers' routed
//! prompts teach (its queue), and publishes what changed to shared data
//! every `index.flush_ms`, where every worker VM reads it. Workers get from
//! the feed only the pods and their load. It reports the workers' confirmed
//! decisions to the indexer, which shares them with every other proxy (with
//! the bearer token named by `indexer.token_env`, when `indexer.share_learned`).

use crate::host;
use crate::load_sum::LoadSummer;
use crate::metrics::{FeedMetrics, IndexMetrics};
use crate::peers::{Audience, Peers, SINGLETON_QUEUE};
use crate::ticker::Ticker;
use kvroute_core::config::{Config, IndexerSettings};
use kvroute_core::feed::{self, FeedUpdate, LearnedBatch};
use kvroute_core::feed_client::{FeedClient, FeedRequest, FeedResponse, Received};
use kvroute_core::feed_forward::ListForwarding;
use kvroute_core::hash::BlockHash;
use kvroute_core::router::Cluster;
use kvroute_core::wire::{self, PeerMessage};
use proxy_wasm::types::LogLevel;
use std::rc::Rc;

/// Shared-data keys one flush writes at most (about 1.6 µs each for a 4 KiB
/// bucket: ≈ 13 ms of the main thread; a full 1,000-pod index is published
/// in 4 flushes); the rest waits for the next flush (`kvroute.index.deferred`).
const MAX_FLUSH_WRITES: usize = 8192;

/// Keys one batch of a flush encodes before writing them (≈ 1.2 MB of full
/// buckets at most).
const FLUSH_BATCH_WRITES: usize = 256;

/// Bytes of buckets the singleton's index keeps in memory at most (2,048
/// full buckets of 4.6 KB; an index of few blocks per bucket stays whole):
/// the rest lives only in its published copy in shared data, read back on a
/// bucket's first write since it was stored.
const MAX_RESIDENT_BYTES: usize = 9 << 20;

/// Learned hashes waiting to be reported; beyond this they are dropped
/// (the indexer is slow or down, and the queue must stay bounded).
const MAX_PENDING_LEARNED: usize = 1 << 16;

/// The tick that applies a feed answer after its callback returned.
const APPLY_AFTER_MS: u64 = 1;

pub struct Singleton {
    /// The proxy's one block index, and the pods it names.
    cluster: Cluster,
    /// This writer's id in the published head (readers re-read the pod
    /// table of a new writer).
    writer: u64,
    flush_ms: u32,
    last_flush_ms: u64,
    index_metrics: IndexMetrics,
    indexer: Option<IndexerSettings>,
    /// `authorization` header value of learned reports (from `indexer.token_env`).
    authorization: Option<String>,
    metrics: FeedMetrics,
    peers: Peers,
    /// When the workers last got the whole pod list.
    list_forwarding: ListForwarding,
    queue: Option<u32>,
    feed: FeedClient,
    /// The feed call in flight: its token and when it was sent (ms).
    feed_call: Option<(u32, u64)>,
    /// A feed answer applied at the next tick, after the call for the one
    /// that follows it has left (see [`Singleton::on_http_call_response`]).
    unapplied: Option<Received>,
    learned_call: Option<u32>,
    /// Confirmed decisions waiting for the next learned report, and their hashes.
    pending: LearnedBatch,
    pending_hashes: usize,
    failing: bool,
    learned_failing: bool,
    load_summer: LoadSummer,
    /// The period of the singleton's duties (flush, feed, learned reports,
    /// registry), and its tick (shorter while it sums the workers' load).
    duty_ms: u64,
    ticker: Ticker,
}

/// The `authorization` header `indexer.token_env` asks for; an error (naming
/// the field) when the variable is missing from the VM's environment.
fn authorization(config: &Config) -> Result<Option<String>, String> {
    let Some(name) = config.indexer.as_ref().and_then(|i| i.token_env.as_deref()) else {
        return Ok(None);
    };
    match host::env_var(name).map(|t| t.trim().to_owned()) {
        Some(token) if !token.is_empty() => Ok(Some(format!("Bearer {token}"))),
        _ => Err(format!(
            "invalid kvroute config: field `indexer.token_env`: environment variable {name} \
             is unset or empty in the VM (list it in vm_config.environment_variables.host_env_keys)"
        )),
    }
}

impl Singleton {
    /// A singleton for `config`; an error names the field that cannot be honoured.
    pub fn start(config: Rc<Config>, vm_id: &str) -> Result<Singleton, String> {
        let now_s = host::now().secs;
        let authorization = authorization(&config)?;
        let indexer = config.indexer.clone();
        let poll_ms = indexer.as_ref().map_or(1000, |i| i.poll_ms);
        if indexer.is_none() {
            host::log(
                LogLevel::Info,
                "kvroute singleton: no `indexer` configured; the index holds what the workers route",
            );
        }
        let duty_ms = u64::from(tick_ms(&config));
        host::set_tick_period(duty_ms);
        let mut cluster = Cluster::default();
        cluster.write_through(Rc::new(host::SharedData), MAX_RESIDENT_BYTES);
        cluster.configure_index(&config, now_s);
        Ok(Singleton {
            cluster,
            writer: host::random_u64(),
            flush_ms: config.index.flush_ms,
            last_flush_ms: 0,
            index_metrics: IndexMetrics::define(),
            indexer,
            authorization,
            metrics: FeedMetrics::define(),
            peers: Peers::observer(vm_id, now_s),
            list_forwarding: ListForwarding::default(),
            queue: host::queue_register(SINGLETON_QUEUE),
            feed: FeedClient::new(poll_ms),
            feed_call: None,
            unapplied: None,
            learned_call: None,
            pending: LearnedBatch::default(),
            pending_hashes: 0,
            failing: false,
            learned_failing: false,
            load_summer: LoadSummer::default(),
            duty_ms,
            ticker: Ticker::new(duty_ms),
        })
    }

    /// Adopts `config`; on error the previous configuration stays.
    pub fn reconfigure(&mut self, config: Rc<Config>) -> Result<(), String> {
        self.authorization = authorization(&config)?;
        self.indexer = config.indexer.clone();
        if let Some(i) = &self.indexer {
            self.feed.set_poll_ms(i.poll_ms);
        }
        self.duty_ms = u64::from(tick_ms(&config));
        self.ticker.set_period(self.duty_ms);
        self.flush_ms = config.index.flush_ms;
        self.cluster.configure_index(&config, host::now().secs);
        Ok(())
    }

    /// Sums the workers' load every tick; the other duties every duty
    /// period.
    pub fn on_tick(&mut self) {
        if let Some(received) = self.unapplied.take() {
            self.apply(received);
            self.ticker.set_period(self.tick_period_ms());
        }
        let now = host::now();
        let (now_s, now_ms) = (now.secs, now.millis);
        self.load_summer
            .tick(self.peers.serving_load_keys(), now_ms);
        if !self.ticker.duties_due(now_ms, self.duty_ms) {
            return;
        }
        self.peers.tick(now_s, now_ms);
        self.ticker.set_period(self.tick_period_ms());
        if now_ms.saturating_sub(self.last_flush_ms) >= u64::from(self.flush_ms) {
            self.last_flush_ms = now_ms;
            self.flush(now_ms);
        }
        let Some(indexer) = self.indexer.clone() else {
            return;
        };
        if let Some(request) = self.feed.on_tick(now_ms) {
            self.send_feed(&indexer, request, now_ms);
        }
        if self.learned_call.is_none() && !self.pending.entries.is_empty() {
            let batch = std::mem::take(&mut self.pending);
            self.pending_hashes = 0;
            let body = feed::encode_learned(&batch);
            let headers: Vec<(&str, &str)> = self
                .authorization
                .as_deref()
                .map(|a| ("authorization", a))
                .into_iter()
                .collect();
            match host::http_call_with_headers(
                &indexer.cluster,
                &indexer.authority,
                "POST",
                &indexer.learned_path,
                Some(&body),
                indexer.timeout_ms,
                &headers,
            ) {
                Ok(token) => {
                    self.learned_call = Some(token);
                    self.metrics.learned_sent.add(batch.entries.len() as u64);
                }
                Err(status) => self.learned_failed(&format!("not sent: {status:?}")),
            }
        }
    }

    /// The tick: the duty period, shorter while the workers' load is summed.
    fn tick_period_ms(&self) -> u64 {
        LoadSummer::period_ms(self.peers.serving_load_keys().len())
            .map_or(self.duty_ms, |share| share.min(self.duty_ms))
    }

    /// Publishes what changed in the index since the last flush (pod
    /// table, new sets, buckets, then the head with its heartbeat).
    /// Published in batches of [`FLUSH_BATCH_WRITES`] keys: the encoded
    /// buckets of a whole flush are never in memory at once.
    fn flush(&mut self, now_ms: u64) {
        let started = host::now();
        let mut room = MAX_FLUSH_WRITES;
        let mut written = 0;
        let deferred = loop {
            let batch = room.min(FLUSH_BATCH_WRITES);
            let Some(publication) = self.cluster.publish(batch, self.writer, now_ms) else {
                return;
            };
            for (key, value) in &publication.writes {
                if host::shared_set(key, value, 0) {
                    written += 1;
                } else {
                    host::log(
                        LogLevel::Warn,
                        &format!("kvroute singleton: could not write shared data key {key}"),
                    );
                }
            }
            // Every answer ends with the head.
            let stored = publication.writes.len().saturating_sub(1);
            room = room.saturating_sub(stored);
            if publication.deferred == 0 || room == 0 || stored == 0 {
                break publication.deferred;
            }
        };
        let m = &self.index_metrics;
        m.flushed.add(written);
        m.flush_us.add(started.elapsed_us());
        m.deferred.record(deferred as u64);
        if let Some(index) = self.cluster.index() {
            let stats = index.stats();
            m.blocks.record(stats.blocks as u64);
            m.bytes.record(stats.bytes as u64);
            m.evicted.record(stats.evicted);
            m.dropped.record(stats.dropped);
            m.resident_buckets.record(stats.resident_buckets as u64);
            m.resident_bytes.record(stats.resident_bytes as u64);
            m.written_back_early.record(stats.written_back_early);
            m.read_back.record(stats.read_back);
            m.unloadable.record(stats.unloadable);
        }
        m.writer_memory_bytes.record(linear_memory_bytes());
    }

    /// The workers' messages: what routed prompts teach, refusals and
    /// failures (applied to the index), and confirmed decisions (kept for
    /// the next learned report).
    pub fn drain_queue(&mut self) {
        let Some(queue) = self.queue else {
            return;
        };
        let now_s = host::now().secs;
        while let Some(bytes) = host::queue_dequeue(queue) {
            let messages = match wire::decode_batch(&bytes) {
                Ok(messages) => messages,
                Err(e) => {
                    host::log(
                        LogLevel::Warn,
                        &format!("kvroute singleton: dropped a worker message: {e}"),
                    );
                    continue;
                }
            };
            for message in messages {
                match message {
                    PeerMessage::Routed { pod, hashes } => {
                        self.cluster.learn_as_told(&pod, &hashes, now_s)
                    }
                    PeerMessage::Unlearned { pod, hashes } => {
                        self.cluster.forget_learned(&pod, &hashes)
                    }
                    PeerMessage::Failed { pod } => self.cluster.record_failure(&pod, now_s),
                    PeerMessage::Learned { pod, hashes } => self.keep_for_report(pod, hashes),
                    // Budget and feed messages are the workers' own business.
                    PeerMessage::Charged { .. } | PeerMessage::Feed(_) => {}
                }
            }
        }
    }

    fn keep_for_report(&mut self, pod: String, hashes: Vec<BlockHash>) {
        let sharing = self.indexer.as_ref().is_some_and(|i| i.share_learned);
        if !sharing || self.pending_hashes + hashes.len() > MAX_PENDING_LEARNED {
            return;
        }
        self.pending_hashes += hashes.len();
        self.pending.entries.push((pod, hashes));
    }

    pub fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize) {
        if self.learned_call == Some(token_id) {
            self.learned_call = None;
            match host::http_call_status(num_headers) {
                Some(200) => {
                    if self.learned_failing {
                        self.learned_failing = false;
                        host::log(
                            LogLevel::Info,
                            "kvroute singleton: learned reports are accepted again",
                        );
                    }
                }
                Some(401) => self.learned_failed(
                    "refused (401): the token of indexer.token_env is not one the indexer's \
                     --learned-token-file accepts",
                ),
                Some(403) => self.learned_failed(
                    "refused (403): the indexer or the mesh policy takes no learned entries \
                     from this proxy (set indexer.share_learned to false to stop reporting)",
                ),
                status => self.learned_failed(&format!("answered {status:?}")),
            }
            return;
        }
        let Some((token, started_ms)) = self.feed_call else {
            return;
        };
        if token != token_id {
            return;
        }
        self.feed_call = None;
        let answered = host::now();
        let now_ms = answered.millis;
        self.metrics
            .latency_ms
            .record(now_ms.saturating_sub(started_ms));
        // Envoy's async client refuses bodies above its buffer limit (no
        // response); the indexer keeps every answer far below it (pages).
        let body;
        let response = match host::http_call_status(num_headers) {
            Some(200) => {
                body = host::http_call_body(num_headers, body_size).unwrap_or_default();
                FeedResponse::Body(&body)
            }
            Some(status) => FeedResponse::Status(u32::from(status)),
            None => FeedResponse::NoResponse,
        };
        let outcome = self.feed.on_response(now_ms, response);
        self.metrics.apply_us.add(answered.elapsed_us());
        // The next page (or waiting deltas) is asked for at once. Envoy sends
        // the call only once this callback returns, so the answer is applied
        // at a tick a millisecond later: the indexer then prepares the next
        // answer while the index takes this one, instead of after it.
        let mut asked = false;
        if let Some(request) = self.feed.follow_up(now_ms) {
            if let Some(indexer) = self.indexer.clone() {
                asked = self.send_feed(&indexer, request, now_ms);
            }
        }
        match outcome {
            Ok(received) => {
                self.metrics.bytes.add(body_size as u64);
                if let Some(earlier) = self.unapplied.take() {
                    self.apply(earlier);
                }
                if asked {
                    self.unapplied = Some(received);
                    self.ticker.set_period(APPLY_AFTER_MS);
                } else {
                    self.apply(received);
                }
            }
            Err(fault) => self.failed(&fault.to_string()),
        }
    }

    /// Sends a feed call; true when it left.
    fn send_feed(&mut self, indexer: &IndexerSettings, request: FeedRequest, now_ms: u64) -> bool {
        let path = format!("{}?{}", indexer.feed_path, request.query());
        match host::http_call(
            &indexer.cluster,
            &indexer.authority,
            "GET",
            &path,
            None,
            indexer.timeout_ms,
        ) {
            Ok(token) => {
                self.feed_call = Some((token, now_ms));
                true
            }
            Err(status) => {
                let fault = self.feed.on_response(now_ms, FeedResponse::NotSent);
                if let Err(fault) = fault {
                    self.failed(&format!("{fault}: {status:?}"));
                }
                false
            }
        }
    }

    /// Applies a feed answer, timed (`kvroute.feed.apply_us`).
    fn apply(&mut self, received: Received) {
        let started = host::now();
        self.received(received);
        self.metrics.apply_us.add(started.elapsed_us());
    }

    /// Counts an applied feed answer and passes its update on.
    fn received(&mut self, received: Received) {
        self.metrics.ok.inc();
        self.metrics.pods.record(received.update.pods.len() as u64);
        if received.page.is_some() {
            self.metrics.pages.inc();
        }
        if received.snapshot_complete {
            self.metrics.snapshots.inc();
        }
        if self.failing {
            self.failing = false;
            host::log(LogLevel::Info, "kvroute singleton: indexer feed is back");
        }
        self.forward(&received.update);
        // The singleton decides nothing: trusting precise entries is the
        // workers' call, from when the feed last reached them.
        self.cluster
            .apply_feed(&received.update, host::now().secs, 0);
    }

    /// Every worker VM gets the pods and their load when it may lack them,
    /// which also renews its trust in precise entries (see
    /// `kvroute_core::feed_forward`); between those, no word.
    fn forward(&mut self, update: &FeedUpdate) {
        let recipients = self.peers.recipients(Audience::All);
        let due =
            self.list_forwarding
                .list_due(!update.pods_unchanged, &recipients, host::now().millis);
        if !due {
            return;
        }
        let pods_and_load = FeedUpdate {
            epoch: update.epoch,
            cursor: update.cursor,
            snapshot: update.snapshot,
            pods: update.pods.clone(),
            pods_unchanged: false,
            ops: Vec::new(),
        };
        match wire::encode_batch(&[PeerMessage::Feed(feed::encode(&pods_and_load))]) {
            Ok(message) => {
                self.peers.broadcast(&message, Audience::All, false);
            }
            Err(e) => host::log(
                LogLevel::Warn,
                &format!("kvroute singleton: feed not forwarded: {e}"),
            ),
        }
    }

    /// Counts a learned report that failed; logs when reports start failing.
    /// Routing does not depend on it: this proxy keeps its own decisions.
    fn learned_failed(&mut self, why: &str) {
        self.metrics.learned_refused.inc();
        host::log(
            first_failure_level(&mut self.learned_failing),
            &format!("kvroute singleton: learned report {why}; other proxies do not see this one's decisions"),
        );
    }

    /// Counts a failure; logs when the feed goes from healthy to failing.
    fn failed(&mut self, why: &str) {
        self.metrics.errors.inc();
        host::log(
            first_failure_level(&mut self.failing),
            &format!("kvroute singleton: {why}; filters keep routing on what they have"),
        );
    }
}

/// Warn when a healthy path starts failing, then only debug until it recovers.
fn first_failure_level(failing: &mut bool) -> LogLevel {
    let first = !std::mem::replace(failing, true);
    if first {
        LogLevel::Warn
    } else {
        LogLevel::Debug
    }
}

/// Bytes of this VM's linear memory: its heap's high-water mark (a wasm
/// memory grows and never shrinks).
fn linear_memory_bytes() -> u64 {
    #[cfg(target_arch = "wasm32")]
    let pages = core::arch::wasm32::memory_size::<0>() as u64;
    #[cfg(not(target_arch = "wasm32"))]
    let pages = 0;
    pages * 65_536
}

/// The singleton's tick: the flush period, or the poll period when shorter.
fn tick_ms(config: &Config) -> u32 {
    config.indexer.as_ref().map_or(config.index.flush_ms, |i| {
        i.poll_ms.min(config.index.flush_ms)
    })
}
