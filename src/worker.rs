//! Routing state of one worker VM, shared by its root context and its HTTP
//! contexts: the cluster view, peers, stats and the snapshot duty.

use crate::host;
use crate::metrics::{FailOpen, FilterMetrics};
use crate::peers::{Audience, Peers};
use kvroute_core::config::Config;
use kvroute_core::feed;
use kvroute_core::outcome::Outcome;
use kvroute_core::router::Cluster;
use kvroute_core::wire::{self, PeerMessage};
use proxy_wasm::types::LogLevel;
use std::cell::RefCell;
use std::rc::Rc;

const SNAPSHOT_KEY: &str = "kvroute/snapshot/v1";
const LEASE_KEY: &str = "kvroute/snapshot/lease";
/// Precise entries stay trusted this long after the last feed update when
/// no indexer poll period is configured.
const DEFAULT_TRUST_S: u32 = 5;

pub type SharedWorker = Rc<RefCell<Worker>>;

/// A request kvroute routed, as its response will settle it.
#[derive(Debug, Clone)]
pub struct RoutedRequest {
    /// The pod chosen first.
    pub pod: String,
    /// Its prompt's block hashes, learned provisionally on `pod`.
    pub hashes: Vec<u64>,
    /// Leading blocks `pod` already held: a refusal takes back only the rest.
    pub matched_blocks: usize,
    /// Confirmed blocks are reported to the indexer (byte chunks only).
    pub report: bool,
}

pub struct Worker {
    pub config: Rc<Config>,
    pub cluster: Cluster,
    pub peers: Peers,
    pub metrics: FilterMetrics,
    tie_seed: u64,
    last_snapshot_ms: u64,
    logged_causes: u32,
}

impl Worker {
    /// A worker VM joining the proxy's peers (it registers its queue).
    pub fn start(config: Rc<Config>, vm_id: &str) -> Worker {
        let (now_s, now_ms) = host::now();
        let mut cluster = Cluster::default();
        cluster.set_configured(&config, now_s);
        let mut worker = Worker {
            config,
            cluster,
            peers: Peers::join(vm_id, now_s, now_ms),
            metrics: FilterMetrics::define(),
            tie_seed: host::random_u64(),
            last_snapshot_ms: 0,
            logged_causes: 0,
        };
        worker.restore_snapshot(now_s);
        worker
    }

    /// Called for every request. A VM that had gone quiet (it served nothing
    /// for a while, like Envoy's main-thread copy) missed its peers' routing
    /// decisions: it serves again and catches up from the index snapshot.
    pub fn serve(&mut self) {
        let (now_s, _) = host::now();
        if self.peers.start_serving(now_s) {
            self.restore_snapshot(now_s);
        }
    }

    /// Adds what the newest index snapshot knows, so the VM starts warm.
    fn restore_snapshot(&mut self, now_s: u32) {
        if let Some((raw, _)) = host::shared_get(SNAPSHOT_KEY) {
            if let Some((&flag, body)) = raw.split_first() {
                match feed::decode(body) {
                    Ok(snapshot) => self.cluster.restore(&snapshot, flag == 1, now_s),
                    Err(e) => host::log(
                        LogLevel::Warn,
                        &format!("kvroute: ignoring unreadable index snapshot: {e}"),
                    ),
                }
            }
        }
    }

    pub fn reconfigure(&mut self, config: Rc<Config>) {
        self.cluster.set_configured(&config, host::now().0);
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

    /// Tells the serving peers about a routing event.
    pub fn tell_peers(&self, message: PeerMessage) {
        self.send(message, Audience::Serving, false);
    }

    /// Hands confirmed blocks to the singleton, which reports them to the
    /// indexer as learned entries (when this proxy shares what it learns).
    pub fn report_learned(&self, pod: &str, hashes: Vec<u64>) {
        if self
            .config
            .indexer
            .as_ref()
            .is_some_and(|i| i.share_learned)
        {
            let message = PeerMessage::Learned {
                pod: pod.to_string(),
                hashes,
            };
            self.send(message, Audience::None, true);
        }
    }

    /// Settles a routed request by its response: confirms or takes back what
    /// it taught, passes over a pod that failed. `report` says whether its
    /// blocks are shared with the indexer (byte chunks: token blocks come
    /// from the pods' own events).
    pub fn settle(&mut self, request: &RoutedRequest, outcome: Outcome, request_id: &str) {
        let (now_s, _) = host::now();
        self.metrics.outcome(&outcome);
        let chosen = &request.pod;
        match outcome {
            Outcome::Confirmed => {
                if request.report {
                    self.report_learned(chosen, request.hashes.clone());
                }
            }
            Outcome::Refused => {
                let taught = request.hashes.get(request.matched_blocks..).unwrap_or(&[]);
                self.cluster.forget_learned(chosen, taught);
                self.tell_peers(PeerMessage::Unlearned {
                    pod: chosen.clone(),
                    hashes: taught.to_vec(),
                });
            }
            Outcome::Failed | Outcome::ServedElsewhere { .. } => {
                self.cluster.record_failure(chosen, now_s);
                self.tell_peers(PeerMessage::Failed {
                    pod: chosen.clone(),
                });
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
            self.cluster.record_learned(pod, &request.hashes, now_s);
            self.tell_peers(PeerMessage::Learned {
                pod: pod.to_string(),
                hashes: request.hashes.clone(),
            });
            if request.report {
                self.report_learned(pod, request.hashes.clone());
            }
        }
    }

    fn send(&self, message: PeerMessage, audience: Audience, to_singleton: bool) {
        match wire::encode_batch(&[message]) {
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
        let (now_s, _) = host::now();
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
            PeerMessage::Routed {
                pod,
                prompt_blocks,
                hashes,
            } => self
                .cluster
                .record_routed(&pod, prompt_blocks, &hashes, now_s),
            PeerMessage::Learned { pod, hashes } => {
                self.cluster.record_learned(&pod, &hashes, now_s)
            }
            PeerMessage::Unlearned { pod, hashes } => self.cluster.forget_learned(&pod, &hashes),
            PeerMessage::Failed { pod } => self.cluster.record_failure(&pod, now_s),
            PeerMessage::Charged {
                pod,
                client,
                blocks,
            } => self
                .cluster
                .charge_client(&pod, client, blocks as usize, now_s),
            PeerMessage::PrefillDone { pod, prompt_blocks } => {
                self.cluster.record_prefill_done(&pod, prompt_blocks)
            }
            PeerMessage::Finished { pod, prompt_blocks } => {
                self.cluster.record_finished(&pod, prompt_blocks)
            }
            PeerMessage::Released { pod, prompt_blocks } => {
                self.cluster.record_released(&pod, prompt_blocks)
            }
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

    /// Periodic duties: heartbeat, gauges, and the index snapshot when this
    /// VM holds the lease.
    pub fn on_tick(&mut self) {
        let (now_s, now_ms) = host::now();
        self.peers.tick(now_s, now_ms);
        if !self.peers.is_serving() {
            return;
        }
        let index = self.cluster.index().stats();
        self.metrics.index_blocks.record(index.blocks as u64);
        self.metrics.index_bytes.record(index.bytes as u64);
        self.metrics.index_evicted.record(index.evicted);
        self.metrics.index_dropped.record(index.dropped);
        // Serving VMs sharing what they learn, this one included.
        self.metrics
            .peers
            .record(self.peers.serving_count() as u64 + 1);
        let interval = u64::from(self.config.index.snapshot_interval_ms);
        if now_ms.saturating_sub(self.last_snapshot_ms) >= interval
            && self.take_lease(now_ms, interval)
        {
            self.last_snapshot_ms = now_ms;
            let mut value = vec![u8::from(self.cluster.is_discovered())];
            value.extend_from_slice(&feed::encode(&self.cluster.snapshot()));
            if !host::shared_set(SNAPSHOT_KEY, &value, 0) {
                host::log(
                    LogLevel::Warn,
                    "kvroute: could not write the index snapshot",
                );
            }
        }
    }

    /// One VM at a time writes the snapshot: the lease is `<name> <expiry ms>`.
    fn take_lease(&self, now_ms: u64, interval_ms: u64) -> bool {
        let me = self.peers.name();
        if me.is_empty() {
            return false;
        }
        let (raw, cas) = host::shared_get(LEASE_KEY).unwrap_or_default();
        let text = String::from_utf8_lossy(&raw);
        let mut parts = text.split(' ');
        let holder = parts.next().unwrap_or("");
        let expiry: u64 = parts.next().and_then(|e| e.parse().ok()).unwrap_or(0);
        if holder != me && expiry > now_ms {
            return false;
        }
        let lease = format!("{me} {}", now_ms + 3 * interval_ms);
        host::shared_set(LEASE_KEY, lease.as_bytes(), cas)
    }
}
