//! The singleton (bootstrap `wasm_service`, main thread): polls the
//! indexer's feed on a tick and forwards each update verbatim to every
//! worker VM's queue; collects the workers' routing decisions and reports
//! them to the indexer, which shares them with every other proxy.

use crate::host;
use crate::metrics::FeedMetrics;
use crate::peers::{Audience, Peers, SINGLETON_QUEUE};
use kvroute_core::config::{Config, IndexerSettings};
use kvroute_core::feed::{self, LearnedBatch};
use kvroute_core::wire::{self, PeerMessage};
use proxy_wasm::types::LogLevel;
use std::rc::Rc;

/// Learned hashes waiting to be reported; beyond this they are dropped
/// (the indexer is slow or down, and the queue must stay bounded).
const MAX_PENDING_LEARNED: usize = 1 << 16;
/// Feed bodies larger than this are refused (a snapshot of 64 pods × 64k
/// blocks is ~34 MB; anything bigger is a misconfiguration).
const MAX_FEED_BYTES: usize = 64 << 20;

pub struct Singleton {
    indexer: Option<IndexerSettings>,
    metrics: FeedMetrics,
    peers: Peers,
    queue: Option<u32>,
    epoch: u64,
    cursor: u64,
    feed_call: Option<(u32, u64)>,
    learned_call: Option<u32>,
    pending: LearnedBatch,
    pending_hashes: usize,
    failing: bool,
}

impl Singleton {
    pub fn start(config: Rc<Config>, vm_id: &str) -> Singleton {
        let (now_s, _) = host::now();
        let indexer = config.indexer.clone();
        if let Some(i) = &indexer {
            host::set_tick_period(i.poll_ms);
        } else {
            host::log(
                LogLevel::Warn,
                "kvroute singleton: no `indexer` configured; nothing to poll",
            );
        }
        Singleton {
            indexer,
            metrics: FeedMetrics::define(),
            peers: Peers::observer(vm_id, now_s),
            queue: host::queue_register(SINGLETON_QUEUE),
            epoch: 0,
            cursor: 0,
            feed_call: None,
            learned_call: None,
            pending: LearnedBatch::default(),
            pending_hashes: 0,
            failing: false,
        }
    }

    pub fn reconfigure(&mut self, config: Rc<Config>) {
        self.indexer = config.indexer.clone();
        if let Some(i) = &self.indexer {
            host::set_tick_period(i.poll_ms);
        }
    }

    pub fn on_tick(&mut self) {
        let (now_s, now_ms) = host::now();
        self.peers.tick(now_s, now_ms);
        let Some(indexer) = self.indexer.clone() else {
            return;
        };
        if self.feed_call.is_none() {
            let path = format!(
                "{}?epoch={}&cursor={}",
                indexer.feed_path, self.epoch, self.cursor
            );
            match host::http_call(
                &indexer.cluster,
                &indexer.authority,
                "GET",
                &path,
                None,
                indexer.timeout_ms,
            ) {
                Ok(token) => self.feed_call = Some((token, now_ms)),
                Err(status) => self.failed(&format!("feed call not sent: {status:?}")),
            }
        }
        if self.learned_call.is_none() && !self.pending.entries.is_empty() {
            let batch = std::mem::take(&mut self.pending);
            self.pending_hashes = 0;
            let body = feed::encode_learned(&batch);
            match host::http_call(
                &indexer.cluster,
                &indexer.authority,
                "POST",
                &indexer.learned_path,
                Some(&body),
                indexer.timeout_ms,
            ) {
                Ok(token) => {
                    self.learned_call = Some(token);
                    self.metrics.learned_sent.add(batch.entries.len() as u64);
                }
                Err(status) => self.failed(&format!("learned report not sent: {status:?}")),
            }
        }
    }

    /// Workers' routing decisions, kept for the next learned report.
    pub fn drain_queue(&mut self) {
        let Some(queue) = self.queue else {
            return;
        };
        while let Some(bytes) = host::queue_dequeue(queue) {
            let Ok(messages) = wire::decode_batch(&bytes) else {
                continue;
            };
            for message in messages {
                if let PeerMessage::Learned { pod, hashes } = message {
                    if self.indexer.is_none()
                        || self.pending_hashes + hashes.len() > MAX_PENDING_LEARNED
                    {
                        continue;
                    }
                    self.pending_hashes += hashes.len();
                    self.pending.entries.push((pod, hashes));
                }
            }
        }
    }

    pub fn on_http_call_response(&mut self, token_id: u32, body_size: usize) {
        if self.learned_call == Some(token_id) {
            self.learned_call = None;
            if host::http_call_status() != Some(200) {
                self.failed("learned report refused");
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
        let (_, now_ms) = host::now();
        self.metrics
            .latency_ms
            .record(now_ms.saturating_sub(started_ms));
        let status = host::http_call_status();
        if status != Some(200) {
            self.failed(&format!("feed answered {status:?}"));
            return;
        }
        if body_size > MAX_FEED_BYTES {
            self.failed(&format!(
                "feed body of {body_size} bytes is over {MAX_FEED_BYTES}"
            ));
            return;
        }
        let Some(body) = host::http_call_body(body_size) else {
            self.failed("feed body unreadable");
            return;
        };
        let update = match feed::decode(&body) {
            Ok(u) => u,
            Err(e) => {
                self.failed(&format!("feed undecodable: {e}"));
                return;
            }
        };
        self.epoch = update.epoch;
        self.cursor = update.cursor;
        self.metrics.ok.inc();
        self.metrics.bytes.add(body.len() as u64);
        self.metrics.pods.record(update.pods.len() as u64);
        if update.snapshot {
            self.metrics.snapshots.inc();
        }
        if self.failing {
            self.failing = false;
            host::log(LogLevel::Info, "kvroute singleton: indexer feed is back");
        }
        match wire::encode_batch(&[PeerMessage::Feed(body)]) {
            Ok(message) => {
                self.peers.broadcast(&message, Audience::All, false);
            }
            Err(e) => host::log(
                LogLevel::Warn,
                &format!("kvroute singleton: feed not forwarded: {e}"),
            ),
        }
    }

    /// Counts a failure; logs when the feed goes from healthy to failing.
    fn failed(&mut self, why: &str) {
        self.metrics.errors.inc();
        let level = if self.failing {
            LogLevel::Debug
        } else {
            LogLevel::Warn
        };
        self.failing = true;
        host::log(
            level,
            &format!("kvroute singleton: {why}; filters keep routing on what they have"),
        );
    }
}
