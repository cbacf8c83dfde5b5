//! The singleton (bootstrap `wasm_service`, main thread): polls the
//! indexer's feed on a tick and forwards each update verbatim to every
//! worker VM's queue; collects the workers' routing decisions and reports
//! them to the indexer, which shares them with every other proxy (with the
//! bearer token named by `indexer.token_env`, when `indexer.share_learned`).

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
    /// `authorization` header value of learned reports (from `indexer.token_env`).
    authorization: Option<String>,
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
    learned_failing: bool,
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
        let (now_s, _) = host::now();
        let authorization = authorization(&config)?;
        let indexer = config.indexer.clone();
        if let Some(i) = &indexer {
            host::set_tick_period(i.poll_ms);
        } else {
            host::log(
                LogLevel::Warn,
                "kvroute singleton: no `indexer` configured; nothing to poll",
            );
        }
        Ok(Singleton {
            indexer,
            authorization,
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
            learned_failing: false,
        })
    }

    /// Adopts `config`; on error the previous configuration stays.
    pub fn reconfigure(&mut self, config: Rc<Config>) -> Result<(), String> {
        self.authorization = authorization(&config)?;
        self.indexer = config.indexer.clone();
        if let Some(i) = &self.indexer {
            host::set_tick_period(i.poll_ms);
        }
        Ok(())
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
                    let sharing = self.indexer.as_ref().is_some_and(|i| i.share_learned);
                    if !sharing || self.pending_hashes + hashes.len() > MAX_PENDING_LEARNED {
                        continue;
                    }
                    self.pending_hashes += hashes.len();
                    self.pending.entries.push((pod, hashes));
                }
            }
        }
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
        let (_, now_ms) = host::now();
        self.metrics
            .latency_ms
            .record(now_ms.saturating_sub(started_ms));
        match host::http_call_status(num_headers) {
            Some(200) => {}
            Some(status) => return self.failed(&format!("feed answered {status}")),
            None => {
                return self.failed(
                    "feed call ended without a response (reset, timeout, or an answer over \
                     Envoy's 32 MiB async-client buffer)",
                )
            }
        }
        if body_size > MAX_FEED_BYTES {
            self.failed(&format!(
                "feed body of {body_size} bytes is over {MAX_FEED_BYTES}"
            ));
            return;
        }
        let Some(body) = host::http_call_body(num_headers, body_size) else {
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
