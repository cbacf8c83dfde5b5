//! A pod as a cluster holds it: what discovery says of it, the load on it,
//! and what one request may teach its table.

use crate::budget::ClientBudgets;
use crate::config::Config;
use crate::hash::{splitmix64, BlockHash};
use crate::index::PodId;
use crate::peer_load::PodLoad;

/// A pod as discovery states it.
#[derive(Debug, Clone, PartialEq)]
pub struct PodSpec {
    pub address: String,
    pub models: Vec<String>,
    pub capacity_blocks: u32,
    /// Relative speed (1.0: the reference pod).
    pub speed: f64,
}

/// Load the pod reports about itself (vLLM `/metrics`, via the indexer).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct ReportedLoad {
    pub waiting: u32,
    pub running: u32,
    pub kv_usage: f32,
}

#[derive(Debug, Clone)]
pub(super) struct Pod {
    pub(super) spec: PodSpec,
    /// The pod's handle in the block index.
    pub(super) id: PodId,
    /// This VM's requests in flight there, and its peers' (as they last
    /// published them): the pod's load is their sum ([`Pod::load`]).
    pub(super) own: PodLoad,
    pub(super) peers: PodLoad,
    pub(super) reported: ReportedLoad,
    /// Requests in flight there ([`Pod::load`]) when `reported` last changed: the requests this
    /// proxy started or ended there since are not in the report yet.
    pub(super) inflight_at_report: u32,
    /// Its active blocks when `reported` last changed (see `kv_usage_now`).
    pub(super) active_at_report: u64,
    /// The pod failed a request: other pods are preferred until this second.
    pub(super) passed_over_until_s: u32,
    /// What each recent client taught this pod's table.
    pub(super) client_budgets: ClientBudgets,
    /// Orders pods of equal load in the least-loaded walk; redrawn at every
    /// load change, so idle pods take new prefixes in turn.
    pub(super) shuffle: u64,
}

impl Pod {
    pub(super) fn new(spec: PodSpec, id: PodId) -> Pod {
        Pod {
            shuffle: splitmix64(id.slot() as u64),
            spec,
            id,
            own: PodLoad::default(),
            peers: PodLoad::default(),
            reported: ReportedLoad::default(),
            inflight_at_report: 0,
            active_at_report: 0,
            passed_over_until_s: 0,
            client_budgets: ClientBudgets::default(),
        }
    }

    /// Requests in flight there from this VM and its peers.
    pub(super) fn load(&self) -> PodLoad {
        self.own.plus(self.peers)
    }

    /// Where the pod stands in the least-loaded walk: fewest prompt blocks in
    /// flight, then fewest waiting, then fewest requests in flight.
    pub(super) fn load_key(&self, index: usize) -> LoadKey {
        let load = self.load();
        (
            load.pending_blocks,
            self.reported.waiting,
            load.requests,
            self.shuffle,
            index,
        )
    }

    /// Requests running there: the last report, plus those this proxy
    /// started there since, minus those it saw end. A report is up to a
    /// scrape interval old; without the correction every request in that
    /// interval would see the same counts and go to the same pod.
    pub(super) fn running_now(&self) -> u32 {
        let since = i64::from(self.load().requests) - i64::from(self.inflight_at_report);
        (i64::from(self.reported.running) + since).clamp(0, i64::from(u32::MAX)) as u32
    }

    /// KV in use there as a fraction of capacity: the last report, plus
    /// the uncached prompt blocks of requests this proxy routed there since,
    /// minus those of requests it saw end (as `running_now`).
    pub(super) fn kv_usage_now(&self) -> f32 {
        let since = self.load().active_blocks as f64 - self.active_at_report as f64;
        let capacity = f64::from(self.spec.capacity_blocks.max(1));
        (f64::from(self.reported.kv_usage) + since / capacity).max(0.0) as f32
    }

    pub(super) fn serves(&self, model: &str) -> bool {
        self.spec.models.is_empty() || self.spec.models.iter().any(|m| m == model)
    }

    pub(super) fn passed_over(&self, now_s: u32) -> bool {
        now_s < self.passed_over_until_s
    }

    /// The leading blocks one request may teach this pod's table.
    pub(super) fn learnable<'h>(
        &self,
        hashes: &'h [BlockHash],
        policy: &ClusterPolicy,
    ) -> &'h [BlockHash] {
        let share = f64::from(self.spec.capacity_blocks) * policy.max_learn_share;
        let limit = (share.ceil() as usize).max(1);
        &hashes[..hashes.len().min(limit)]
    }
}

/// Position in the least-loaded order (see [`Pod::load_key`]), then the pod's index.
pub(super) type LoadKey = (u64, u32, u32, u64, usize);

/// Pods with no cached prefix that a decision still considers: the least
/// loaded ones serving the model (besides every pod the lookup matched).
/// Enough for a new prefix to find an idle pod and for the fallbacks.
pub const LEAST_LOADED_CANDIDATES: usize = 16;

/// What the configuration says about learning and failures.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ClusterPolicy {
    pub max_learn_share: f64,
    pub max_client_share: f64,
    pub client_window_seconds: u32,
    pub failure_cooldown_seconds: u32,
}

impl ClusterPolicy {
    pub fn of(config: &Config) -> ClusterPolicy {
        ClusterPolicy {
            max_learn_share: config.index.max_learn_share,
            max_client_share: config.index.max_client_share,
            client_window_seconds: config.index.ttl_seconds,
            failure_cooldown_seconds: config.failure_cooldown_seconds,
        }
    }
}

impl Default for ClusterPolicy {
    fn default() -> Self {
        ClusterPolicy::of(&Config::default())
    }
}
