//! The singleton (bootstrap `wasm_service`, main thread): the only writer of
//! the proxy's routing index. It applies the indexer feed and what the
//! workers' routed prompts teach (its queue), and publishes what changed to
//! shared data every `index.flush_ms`, where every worker VM reads it.
//! Workers get from the feed only the pods and their load. It reports the
//! workers' confirmed decisions to the indexer.
//!
//! This file holds its state, its start, its tick and the queue; the rest is
//! one concern per submodule: `indexer_feed` (the indexer feed's calls and answers),
//! `publish` (the flush to shared data), `learned` (reports of confirmed
//! decisions).

mod indexer_feed;
mod learned;
mod publish;

use crate::host;
use crate::load_sum::LoadSummer;
use crate::metrics::{FeedMetrics, IndexMetrics};
use crate::peers::{Peers, SINGLETON_QUEUE};
use crate::ticker::Ticker;
use kvroute_core::config::{Config, IndexerSettings};
use kvroute_core::feed::LearnedBatch;
use kvroute_core::feed_client::{FeedClient, Received};
use kvroute_core::feed_forward::ListForwarding;
use kvroute_core::router::Cluster;
use kvroute_core::wire::{self, PeerMessage};
use proxy_wasm::types::LogLevel;
use std::rc::Rc;

/// Bytes of buckets the singleton's index keeps in memory at most (2,048
/// full buckets of 4.6 KB; an index of few blocks per bucket stays whole):
/// the rest lives only in its published copy in shared data, read back on a
/// bucket's first write since it was stored.
const MAX_RESIDENT_BYTES: usize = 9 << 20;

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
            load_summer: LoadSummer::define(),
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
        self.send_learned_report(&indexer);
    }

    /// The tick: the duty period, shorter while the workers have load to sum.
    fn tick_period_ms(&self) -> u64 {
        self.load_summer
            .period_ms(self.peers.serving_load_keys().len())
            .map_or(self.duty_ms, |share| share.min(self.duty_ms))
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

    pub fn on_http_call_response(&mut self, token_id: u32, num_headers: usize, body_size: usize) {
        if self.learned_call == Some(token_id) {
            self.learned_call = None;
            self.on_learned_answer(num_headers);
            return;
        }
        let Some((token, started_ms)) = self.feed_call else {
            return;
        };
        if token != token_id {
            return;
        }
        self.feed_call = None;
        self.on_feed_answer(started_ms, num_headers, body_size);
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

/// The singleton's tick: the flush period, or the poll period when shorter.
fn tick_ms(config: &Config) -> u32 {
    config.indexer.as_ref().map_or(config.index.flush_ms, |i| {
        i.poll_ms.min(config.index.flush_ms)
    })
}
