//! The routing state of one VM and the decision for one request: pods and
//! their load, the block → pod-set index, longest-prefix lookup, scoring,
//! learning. One concern per submodule; [`Cluster`] holds the state they
//! share.

mod decision;
mod feed_apply;
mod learning;
mod load;
mod pod;
mod prompt;
#[cfg(test)]
mod tests;

pub use decision::{decide_among, Candidates, Decision, LocalMatch, NoRoute};
pub use pod::{ClusterPolicy, PodSpec, ReportedLoad, LEAST_LOADED_CANDIDATES};
pub use prompt::{hash_prompt, serving_model, HashedPrompt};

use crate::config::{Config, Endpoint};
use crate::index::published::Publication;
use crate::index::{BlockIndex, LookupCost, MatchRules, PodId, PodMatch};
use crate::score::PodSignals;
use pod::{LoadKey, Pod};
use std::collections::{BTreeSet, HashMap};

/// The pods one VM routes to, their load, and (in the proxy's single
/// writer, and natively) the block index. A worker VM holds no index: it
/// reads the copy the singleton publishes and decides with
/// [`Cluster::decide_on`].
#[derive(Debug, Clone)]
pub struct Cluster {
    pods: Vec<Pod>,
    by_address: HashMap<String, usize>,
    /// Index into `pods` of each index pod id (`usize::MAX`: none).
    by_id: Vec<usize>,
    /// Every pod by [`Pod::load_key`]: the least-loaded walk.
    load_order: BTreeSet<LoadKey>,
    index: Option<BlockIndex>,
    /// Ids of an index-less cluster's pods (their tie-break seeds).
    next_local_id: u32,
    /// Bumped whenever the pod set changes (positions move).
    pods_version: u64,
    /// True once the indexer feed has named the pods: it then owns the set.
    discovered: bool,
    /// The position among the pods of each entry of the feed's last pod
    /// list, in its order (`None`: skipped): what a feed block operation's
    /// pod number and a load-only update's places name, also when the update
    /// repeats no list. Positions hold until the next list: once the feed
    /// owns the pod set, only a list changes it.
    feed_places: Vec<Option<usize>>,
    /// The indexer's digest of that list (0: not stated).
    feed_list_version: u64,
    /// Precise entries are trusted until this second (feed freshness).
    precise_until_s: u32,
    /// Capacity of discovered pods whose capacity the indexer does not know.
    default_capacity: u32,
    /// Speeds of configured endpoints, kept for the pods discovery names.
    configured_speeds: HashMap<String, f64>,
    policy: ClusterPolicy,
    /// Pods the peers last said they load (see [`Cluster::set_peer_load`]).
    peer_loaded: Vec<String>,
}

impl Default for Cluster {
    /// A cluster that holds the block index (the writer; native tests).
    fn default() -> Self {
        let settings = Config::default().index;
        Cluster {
            index: Some(BlockIndex::new(settings.budget_bytes, settings.ttl_seconds)),
            ..Cluster::load_only()
        }
    }
}

impl Cluster {
    /// A cluster of pods and their load, without an index (a worker VM).
    pub fn load_only() -> Cluster {
        Cluster {
            pods: Vec::new(),
            by_address: HashMap::new(),
            by_id: Vec::new(),
            load_order: BTreeSet::new(),
            index: None,
            next_local_id: 0,
            pods_version: 0,
            discovered: false,
            feed_places: Vec::new(),
            feed_list_version: 0,
            precise_until_s: 0,
            default_capacity: 0,
            configured_speeds: HashMap::new(),
            policy: ClusterPolicy::default(),
            peer_loaded: Vec::new(),
        }
    }

    /// Keeps only the index's working set in memory, the rest in `store`
    /// (see [`BlockIndex::write_through`]).
    pub fn write_through(
        &mut self,
        store: std::rc::Rc<dyn crate::index::published::KeyStore>,
        max_resident_bytes: usize,
    ) {
        self.index = self
            .index
            .take()
            .map(|index| index.write_through(store, max_resident_bytes));
    }

    /// Index budget and TTL from `config` (the pods are left as they are).
    pub fn configure_index(&mut self, config: &Config, now_s: u32) {
        self.default_capacity = config.default_capacity_blocks;
        self.policy = ClusterPolicy::of(config);
        let settings = &config.index;
        if let Some(index) = &mut self.index {
            if settings.budget_bytes != index.budget_bytes()
                || settings.ttl_seconds != index.ttl_seconds()
            {
                *index = index.reconfigured(settings.budget_bytes, settings.ttl_seconds, now_s);
            }
        }
    }

    /// Pods from the plugin configuration; ignored once the indexer feed has
    /// named the pods (discovery then owns the set).
    pub fn set_configured(&mut self, config: &Config, now_s: u32) {
        self.configure_index(config, now_s);
        self.configured_speeds = config
            .endpoints
            .iter()
            .map(|e| (e.address.clone(), config.speed_of(e)))
            .collect();
        if self.discovered {
            return;
        }
        let specs = config.endpoints.iter().map(|e: &Endpoint| PodSpec {
            address: e.address.clone(),
            models: e.models.clone(),
            capacity_blocks: config.capacity_of(e),
            speed: config.speed_of(e),
        });
        self.set_pods(specs.collect());
    }

    /// Replaces the pod set, keeping the index entries and load of every pod
    /// that stays. Pods beyond what the index can tell apart
    /// ([`crate::index::MAX_PODS`]) are left out.
    pub fn set_pods(&mut self, specs: Vec<PodSpec>) {
        // The same pods in the same order (a configuration applied again; a
        // repeated feed list is caught before, see `adopt_pods`): rebuilding
        // the maps of 1,000 pods would change nothing.
        if specs.len() == self.pods.len() && specs.iter().zip(&self.pods).all(|(s, p)| *s == p.spec)
        {
            return;
        }
        let mut old: HashMap<String, Pod> = self
            .pods
            .drain(..)
            .map(|p| (p.spec.address.clone(), p))
            .collect();
        self.by_address.clear();
        for spec in specs {
            if self.by_address.contains_key(&spec.address) {
                continue;
            }
            let pod = match old.remove(&spec.address) {
                Some(mut kept) => {
                    kept.spec = spec;
                    kept
                }
                None => match self.new_pod_id() {
                    Some(id) => Pod::new(spec, id),
                    None => continue,
                },
            };
            self.by_address
                .insert(pod.spec.address.clone(), self.pods.len());
            self.pods.push(pod);
        }
        if let Some(index) = &mut self.index {
            for gone in old.into_values() {
                index.remove_pod(gone.id);
            }
        }
        self.pods_version += 1;
        self.by_id.clear();
        self.load_order.clear();
        for (i, pod) in self.pods.iter().enumerate() {
            let slot = pod.id.slot();
            if self.by_id.len() <= slot {
                self.by_id.resize(slot + 1, usize::MAX);
            }
            self.by_id[slot] = i;
            self.load_order.insert(pod.load_key(i));
        }
    }

    /// An id for a new pod: the index's, or a local one without an index.
    fn new_pod_id(&mut self) -> Option<PodId> {
        match &mut self.index {
            Some(index) => index.add_pod(),
            None => {
                self.next_local_id = self.next_local_id.wrapping_add(1);
                Some(PodId::local(self.next_local_id))
            }
        }
    }

    /// Adds `address` with the default capacity, unless discovery owns the
    /// pod set or it is known: the writer learns the pods from the workers'
    /// messages (its configuration names none).
    fn ensure_pod(&mut self, address: &str) -> Option<&Pod> {
        if !self.discovered && !self.by_address.contains_key(address) {
            let mut specs: Vec<PodSpec> = self.pods.iter().map(|p| p.spec.clone()).collect();
            specs.push(PodSpec {
                address: address.to_string(),
                models: Vec::new(),
                capacity_blocks: self.default_capacity.max(1),
                speed: 1.0,
            });
            self.set_pods(specs);
        }
        self.pod(address)
    }

    pub fn len(&self) -> usize {
        self.pods.len()
    }

    /// Where `address` stands among the pods (until the pod set changes,
    /// see [`Cluster::pods_version`]).
    pub fn position(&self, address: &str) -> Option<usize> {
        self.by_address.get(address).copied()
    }

    /// Changes whenever the pod set does.
    pub fn pods_version(&self) -> u64 {
        self.pods_version
    }

    /// The model a request that names none is routed in: the one model every
    /// pod names (vLLM then serves that model), else `default_model` of the
    /// configuration. `None` when neither settles it.
    pub fn implied_model(&self, config: &Config) -> Option<String> {
        let mut served = self.pods.iter().map(|p| p.spec.models.as_slice());
        let only = match served.next() {
            Some([model]) if served.all(|m| m == [model.as_str()]) => Some(model.clone()),
            _ => None,
        };
        only.or_else(|| config.default_model.clone())
    }

    pub fn is_empty(&self) -> bool {
        self.pods.is_empty()
    }

    /// The block index, for its counters (`None` in a worker VM).
    pub fn index(&self) -> Option<&BlockIndex> {
        self.index.as_ref()
    }

    /// What a lookup may trust now: precise entries only while the feed is fresh.
    pub fn match_rules(&self, config: &Config, now_s: u32) -> MatchRules {
        MatchRules {
            trust_precise: now_s < self.precise_until_s,
            cpu_credit: config.tier_discount.cpu,
            disk_credit: config.tier_discount.disk,
        }
    }

    /// Publishes what changed in the index (see [`BlockIndex::publish`]).
    pub fn publish(&mut self, max_writes: usize, writer: u64, now_ms: u64) -> Option<Publication> {
        let (pods, by_id) = (&self.pods, &self.by_id);
        let address = |id: PodId| {
            let i = *by_id.get(id.slot())?;
            pods.get(i).map(|p| p.spec.address.clone())
        };
        Some(
            self.index
                .as_mut()?
                .publish(max_writes, writer, now_ms, &address),
        )
    }

    /// Picks the pod for a hashed prompt. The candidates are the pods the
    /// index lookup matched and the [`LEAST_LOADED_CANDIDATES`] least-loaded
    /// pods serving the model: the cost of a decision does not grow with the
    /// number of pods.
    pub fn decide(
        &self,
        config: &Config,
        prompt: &HashedPrompt,
        now_s: u32,
        tie_seed: u64,
    ) -> Result<Decision, NoRoute> {
        let rules = self.match_rules(config, now_s);
        let mut matches: Vec<PodMatch> = Vec::new();
        let lookup = match &self.index {
            Some(index) => index.match_lengths(&prompt.hashes, now_s, &rules, &mut matches),
            None => LookupCost::default(),
        };
        let local: Vec<LocalMatch> = matches
            .iter()
            .filter_map(|m| {
                let pod = *self.by_id.get(m.pod.slot()).filter(|&&i| i != usize::MAX)?;
                Some(LocalMatch {
                    pod,
                    blocks: m.blocks,
                    credit: m.credit,
                })
            })
            .collect();
        self.decide_on(config, prompt, now_s, tie_seed, &local, lookup)
    }

    /// Picks the pod given the pods that hold a prefix (`matches`, from any
    /// index, one entry per pod) and what finding them cost.
    pub fn decide_on(
        &self,
        config: &Config,
        prompt: &HashedPrompt,
        now_s: u32,
        tie_seed: u64,
        matches: &[LocalMatch],
        lookup: LookupCost,
    ) -> Result<Decision, NoRoute> {
        if self.pods.is_empty() {
            return Err(NoRoute::NoEndpoints);
        }
        let rules = self.match_rules(config, now_s);
        let serving = |i: usize| self.pods[i].serves(&prompt.serving_model);
        // (pod index, blocks matched, credit), matched pods first.
        let mut candidates: Vec<(usize, usize, f64)> = matches
            .iter()
            .filter(|m| m.pod < self.pods.len() && serving(m.pod))
            .map(|m| (m.pod, m.blocks, m.credit))
            .collect();
        let mut matched: Vec<usize> = candidates.iter().map(|c| c.0).collect();
        matched.sort_unstable();
        let mut idle_found = 0;
        for &(.., i) in &self.load_order {
            if idle_found == LEAST_LOADED_CANDIDATES {
                break;
            }
            if !serving(i) || matched.binary_search(&i).is_ok() {
                continue;
            }
            candidates.push((i, 0, 0.0));
            if !self.pods[i].passed_over(now_s) {
                idle_found += 1;
            }
        }
        // Pods that just failed are passed over while any other can serve.
        if candidates
            .iter()
            .any(|&(i, ..)| !self.pods[i].passed_over(now_s))
        {
            candidates.retain(|&(i, ..)| !self.pods[i].passed_over(now_s));
        }
        let signals: Vec<PodSignals> = candidates
            .iter()
            .map(|&(i, _, credit)| {
                let pod = &self.pods[i];
                let load = pod.load();
                PodSignals {
                    cached_credit: credit,
                    inflight_blocks: load.pending_blocks,
                    active_blocks: load.active_blocks,
                    inflight_requests: load.requests,
                    reported: rules.trust_precise,
                    waiting: pod.reported.waiting,
                    running: pod.running_now(),
                    kv_usage: pod.kv_usage_now(),
                    capacity_blocks: pod.spec.capacity_blocks,
                    speed: pod.spec.speed,
                }
            })
            .collect();
        let addresses: Vec<&str> = candidates
            .iter()
            .map(|&(i, ..)| self.pods[i].spec.address.as_str())
            .collect();
        let matched: Vec<usize> = candidates.iter().map(|&(_, blocks, _)| blocks).collect();
        let ranking = Candidates {
            addresses: &addresses,
            matched: &matched,
            signals: &signals,
        };
        decide_among(config, prompt, &ranking, tie_seed, lookup)
    }

    fn pod(&self, address: &str) -> Option<&Pod> {
        self.pods.get(*self.by_address.get(address)?)
    }

    fn pod_mut(&mut self, address: &str) -> Option<&mut Pod> {
        let i = *self.by_address.get(address)?;
        self.pods.get_mut(i)
    }
}
