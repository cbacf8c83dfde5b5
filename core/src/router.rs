//! The routing state of one VM and the decision for one request: pods and
//! their load, the block → pod-set index, longest-prefix lookup, scoring,
//! learning.

use crate::admission::all_saturated;
use crate::budget::{ClientBudgets, ClientKey};
use crate::config::{Config, Endpoint};
use crate::feed::{BlockOp, FeedUpdate, Tier};
use crate::hash::{
    keyed_byte_chunk_hashes, keyed_token_block_hashes, root_hash, salt_digest, splitmix64,
    BlockHash, Domain,
};
use crate::index::published::Publication;
use crate::index::{BlockIndex, IndexOp, LookupCost, MatchRules, PodId, PodMatch};
use crate::line::Line;
use crate::peer_load::PodLoad;
use crate::request::{Prompt, PromptRequest};
use crate::score::{rank, CostTerms, PodSignals};
use std::collections::{BTreeSet, HashMap};

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
struct Pod {
    spec: PodSpec,
    /// The pod's handle in the block index.
    id: PodId,
    /// This VM's requests in flight there, and its peers' (as they last
    /// published them): the pod's load is their sum ([`Pod::load`]).
    own: PodLoad,
    peers: PodLoad,
    reported: ReportedLoad,
    /// Requests in flight there ([`Pod::load`]) when `reported` last changed: the requests this
    /// proxy started or ended there since are not in the report yet.
    inflight_at_report: u32,
    /// Its active blocks when `reported` last changed (see `kv_usage_now`).
    active_at_report: u64,
    /// The pod failed a request: other pods are preferred until this second.
    passed_over_until_s: u32,
    /// What each recent client taught this pod's table.
    client_budgets: ClientBudgets,
    /// Orders pods of equal load in the least-loaded walk; redrawn at every
    /// load change, so idle pods take new prefixes in turn.
    shuffle: u64,
}

impl Pod {
    fn new(spec: PodSpec, id: PodId) -> Pod {
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
    fn load(&self) -> PodLoad {
        self.own.plus(self.peers)
    }

    /// Where the pod stands in the least-loaded walk: fewest prompt blocks in
    /// flight, then fewest waiting, then fewest requests in flight.
    fn load_key(&self, index: usize) -> LoadKey {
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
    fn running_now(&self) -> u32 {
        let since = i64::from(self.load().requests) - i64::from(self.inflight_at_report);
        (i64::from(self.reported.running) + since).clamp(0, i64::from(u32::MAX)) as u32
    }

    /// KV in use there as a fraction of capacity: the last report, plus
    /// the uncached prompt blocks of requests this proxy routed there since,
    /// minus those of requests it saw end (as `running_now`).
    fn kv_usage_now(&self) -> f32 {
        let since = self.load().active_blocks as f64 - self.active_at_report as f64;
        let capacity = f64::from(self.spec.capacity_blocks.max(1));
        (f64::from(self.reported.kv_usage) + since / capacity).max(0.0) as f32
    }

    fn serves(&self, model: &str) -> bool {
        self.spec.models.is_empty() || self.spec.models.iter().any(|m| m == model)
    }

    fn passed_over(&self, now_s: u32) -> bool {
        now_s < self.passed_over_until_s
    }

    /// The leading blocks one request may teach this pod's table.
    fn learnable<'h>(&self, hashes: &'h [BlockHash], policy: &ClusterPolicy) -> &'h [BlockHash] {
        let share = f64::from(self.spec.capacity_blocks) * policy.max_learn_share;
        let limit = (share.ceil() as usize).max(1);
        &hashes[..hashes.len().min(limit)]
    }
}

/// Position in the least-loaded order (see [`Pod::load_key`]), then the pod's index.
type LoadKey = (u64, u32, u32, u64, usize);

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

/// A request's prompt as block hashes in its model's scope.
#[derive(Debug, Clone, PartialEq)]
pub struct HashedPrompt {
    /// The model pods must serve (the base model for a LoRA adapter).
    pub serving_model: String,
    pub domain: Domain,
    pub hashes: Vec<BlockHash>,
    /// The prompt's length in blocks: `hashes.len()`, or more when only a
    /// prefix's hashes are known (recalled from the token memo).
    pub blocks: usize,
}

/// Hashes a parsed request per the configuration (block size, chunk size,
/// cap, adapter scoping). A `cache_salt` enters block 0 as vLLM's extra key
/// (see `hash`), in both domains, so salts never share blocks.
pub fn hash_prompt(config: &Config, request: &PromptRequest) -> HashedPrompt {
    let serving_model = serving_model(config, &request.model);
    let lora = config
        .adapters
        .contains_key(&request.model)
        .then_some(request.model.as_str());
    let extra = [request.cache_salt.as_deref().and_then(salt_digest)];
    let (domain, hashes) = match &request.prompt {
        Prompt::Tokens(tokens) => {
            let root = root_hash(Domain::Tokens, &serving_model, lora);
            (
                Domain::Tokens,
                keyed_token_block_hashes(
                    root,
                    tokens,
                    config.block_size,
                    config.max_blocks,
                    &extra,
                ),
            )
        }
        Prompt::Text(text) => {
            let root = root_hash(Domain::Bytes, &serving_model, lora);
            (
                Domain::Bytes,
                keyed_byte_chunk_hashes(root, text, config.chunk_bytes, config.max_blocks, &extra),
            )
        }
    };
    HashedPrompt {
        serving_model,
        domain,
        blocks: hashes.len(),
        hashes,
    }
}

/// The model pods must serve for a request naming `model`: the base model
/// of a configured LoRA adapter, else the model itself.
pub fn serving_model(config: &Config, model: &str) -> String {
    config
        .adapters
        .get(model)
        .cloned()
        .unwrap_or_else(|| model.to_owned())
}

/// Why no pod could be chosen (the request then fails open to Envoy's LB).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NoRoute {
    NoEndpoints,
    NoEndpointForModel,
}

/// A routing decision with everything that explains it.
#[derive(Debug, Clone, PartialEq)]
pub struct Decision {
    pub pod: String,
    /// Next best pods, in order, for the override_host fallback list.
    pub fallbacks: Vec<String>,
    pub matched_blocks: usize,
    pub total_blocks: usize,
    pub domain: Domain,
    pub terms: CostTerms,
    pub signals: PodSignals,
    pub candidates: usize,
    /// With `priority` configured: every candidate is saturated, by test
    /// (see `admission::all_saturated`).
    pub saturation: Option<[usize; 4]>,
    /// What the index lookup cost (blocks probed, runs of equal pod set).
    pub lookup: LookupCost,
}

impl Decision {
    /// The `x-gateway-destination-endpoint` value: pod, then fallbacks.
    pub fn destination(&self) -> String {
        let mut out = self.pod.clone();
        for fallback in &self.fallbacks {
            out.push(',');
            out.push_str(fallback);
        }
        out
    }

    /// One line that explains the decision (debug header and logs).
    pub fn explain(&self) -> String {
        let domain = match self.domain {
            Domain::Tokens => "tokens",
            Domain::Bytes => "bytes",
        };
        let terms = &self.terms;
        let mut out = Line::with_capacity(160);
        out.text("pod=")
            .text(&self.pod)
            .text("; matched=")
            .int(self.matched_blocks)
            .text("/")
            .int(self.total_blocks)
            .text(" ")
            .text(domain)
            .text("; cost=")
            .tenths(terms.total())
            .text(" (prefill=")
            .tenths(terms.prefill)
            .text(" decode=")
            .tenths(terms.decode)
            .text(" queue=")
            .tenths(terms.queue)
            .text(" kv=")
            .tenths(terms.kv);
        // Terms and factors at their defaults stay out, so the header keeps its shape.
        if terms.running != 0.0 {
            out.text(" running=").tenths(terms.running);
        }
        out.text(")");
        if self.signals.speed != 1.0 {
            out.text(" at speed ").text(&self.signals.speed.to_string());
        }
        out.text("; inflight=")
            .int(self.signals.inflight_requests)
            .text(" req/")
            .int(self.signals.inflight_blocks)
            .text(" blocks; candidates=")
            .int(self.candidates);
        if let Some(by_test) = self.saturation {
            out.text("; ").text(&crate::admission::explain(by_test));
        }
        out.into_string()
    }
}

/// The pods a decision ranks: address, prompt blocks matched and signals of
/// each, index-aligned.
pub struct Candidates<'a> {
    pub addresses: &'a [&'a str],
    pub matched: &'a [usize],
    pub signals: &'a [PodSignals],
}

/// Ranks candidates with the cost model and states the decision: the best
/// pod, its fallbacks, and (with `priority`) whether every candidate is
/// saturated. Shared by the local index and the remote lookup.
pub fn decide_among(
    config: &Config,
    prompt: &HashedPrompt,
    candidates: &Candidates,
    tie_seed: u64,
    lookup: LookupCost,
) -> Result<Decision, NoRoute> {
    let signals = candidates.signals;
    let ranked = rank(prompt.blocks, signals, &config.weights, tie_seed);
    let saturation = config
        .priority
        .as_ref()
        .and_then(|p| all_saturated(signals, &p.saturation));
    let Some(&(best, terms)) = ranked.first() else {
        return Err(NoRoute::NoEndpointForModel);
    };
    let address = |c: usize| candidates.addresses[c].to_owned();
    Ok(Decision {
        pod: address(best),
        fallbacks: ranked
            .iter()
            .skip(1)
            .take(config.fallback_endpoints)
            .map(|&(c, _)| address(c))
            .collect(),
        matched_blocks: candidates.matched[best],
        total_blocks: prompt.blocks,
        domain: prompt.domain,
        terms,
        signals: signals[best],
        candidates: signals.len(),
        saturation,
        lookup,
    })
}

/// A pod holding a prefix of the prompt, by its place in the cluster.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LocalMatch {
    /// The pod's position (see [`Cluster::position`]).
    pub pod: usize,
    pub blocks: usize,
    pub credit: f64,
}

impl LocalMatch {
    /// Adds to `matches` that `pod` holds the first `blocks` blocks as a
    /// learned prefix (a worker's own recent decision): a longer prefix than
    /// the pod's match is credited one per block beyond it.
    pub fn merge_learned(matches: &mut Vec<LocalMatch>, pod: usize, blocks: usize) {
        match matches.iter_mut().find(|m| m.pod == pod) {
            Some(m) if m.blocks >= blocks => {}
            Some(m) => {
                m.credit += (blocks - m.blocks) as f64;
                m.blocks = blocks;
            }
            None => matches.push(LocalMatch {
                pod,
                blocks,
                credit: blocks as f64,
            }),
        }
    }
}

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

    /// A request went to `address`: count its load and learn its blocks
    /// (provisionally: a failed answer takes them back, see
    /// [`Cluster::forget_learned`]).
    pub fn record_routed(
        &mut self,
        address: &str,
        prompt_blocks: u32,
        hashes: &[BlockHash],
        now_s: u32,
    ) {
        let policy = self.policy;
        let Some(i) = self.by_address.get(address).copied() else {
            return;
        };
        let blocks = u64::from(prompt_blocks);
        self.update_own_load(i, |own| {
            own.requests = own.requests.saturating_add(1);
            own.pending_blocks = own.pending_blocks.saturating_add(blocks);
            own.active_blocks = own.active_blocks.saturating_add(blocks);
        });
        let pod = &self.pods[i];
        let learned = pod.learnable(hashes, &policy);
        if let Some(index) = &mut self.index {
            index.touch_chain(pod.id, learned, Tier::Learned, now_s);
        }
    }

    /// The leading blocks of `hashes` one request may teach `address`
    /// (`index.max_learn_share` of its capacity).
    pub fn learnable<'h>(&self, address: &str, hashes: &'h [BlockHash]) -> &'h [BlockHash] {
        match self.pod(address) {
            Some(pod) => pod.learnable(hashes, &self.policy),
            None => &[],
        }
    }

    /// The writer learns `hashes` on `address` as a worker sent them (the
    /// worker already cut them to the pod's share); an unknown pod is added
    /// unless discovery owns the pod set.
    pub fn learn_as_told(&mut self, address: &str, hashes: &[BlockHash], now_s: u32) {
        let Some(id) = self.ensure_pod(address).map(|p| p.id) else {
            return;
        };
        if let Some(index) = &mut self.index {
            index.touch_chain(id, hashes, Tier::Learned, now_s);
        }
    }

    /// How many leading blocks of a `want`-block prompt `client` may teach
    /// `address` now (its budget: `index.max_client_share` of the pod's
    /// capacity per `index.ttl_seconds`); what it may teach is charged.
    pub fn client_allowance(
        &mut self,
        address: &str,
        client: ClientKey,
        want: usize,
        now_s: u32,
    ) -> usize {
        let policy = self.policy;
        let Some(pod) = self.pod_mut(address) else {
            return want;
        };
        let limit = (f64::from(pod.spec.capacity_blocks) * policy.max_client_share).ceil() as u64;
        pod.client_budgets
            .charge(client, want, limit, now_s, policy.client_window_seconds)
    }

    /// A peer VM charged `client` `blocks` of its budget on `address`: the
    /// same charge here, so the budget holds for the whole proxy.
    pub fn charge_client(&mut self, address: &str, client: ClientKey, blocks: usize, now_s: u32) {
        let window = self.policy.client_window_seconds;
        if let Some(pod) = self.pod_mut(address) {
            pod.client_budgets
                .charge(client, blocks, u64::MAX, now_s, window);
        }
    }

    /// A request routed to `address` was refused: the blocks it taught
    /// the index are not cached there after all.
    pub fn forget_learned(&mut self, address: &str, hashes: &[BlockHash]) {
        let id = self.pod(address).map(|p| p.id);
        if let (Some(id), Some(index)) = (id, &mut self.index) {
            index.remove_learned(id, hashes);
        }
    }

    /// `address` failed a request (5xx, reset, or Envoy had to serve it
    /// elsewhere): it may have restarted with an empty cache, so what was
    /// learned about it goes, and other pods are preferred for a while.
    pub fn record_failure(&mut self, address: &str, now_s: u32) {
        let cooldown = self.policy.failure_cooldown_seconds;
        if let Some(pod) = self.pod_mut(address) {
            pod.passed_over_until_s = now_s.saturating_add(cooldown);
            let id = pod.id;
            if let Some(index) = &mut self.index {
                index.clear_learned(id);
            }
        }
    }

    /// A request routed to `address` started answering: its prefill is done.
    pub fn record_prefill_done(&mut self, address: &str, prompt_blocks: u32) {
        if let Some(i) = self.by_address.get(address).copied() {
            self.update_own_load(i, |own| {
                own.pending_blocks = own.pending_blocks.saturating_sub(u64::from(prompt_blocks));
            });
        }
    }

    /// A request routed to `address` ended; `prompt_blocks` are those not
    /// yet released by [`Cluster::record_prefill_done`].
    pub fn record_finished(&mut self, address: &str, prompt_blocks: u32) {
        if let Some(i) = self.by_address.get(address).copied() {
            self.update_own_load(i, |own| {
                own.requests = own.requests.saturating_sub(1);
                own.pending_blocks = own.pending_blocks.saturating_sub(u64::from(prompt_blocks));
            });
        }
    }

    /// A request routed to `address` with `prompt_blocks` uncached blocks
    /// ended: the KV it held there is free again.
    pub fn record_released(&mut self, address: &str, prompt_blocks: u32) {
        if let Some(i) = self.by_address.get(address).copied() {
            self.update_own_load(i, |own| {
                own.active_blocks = own.active_blocks.saturating_sub(u64::from(prompt_blocks));
            });
        }
    }

    /// This VM's load per pod (the pods it has requests on), for its peers.
    pub fn own_load(&self) -> Vec<(String, PodLoad)> {
        self.pods
            .iter()
            .filter(|pod| !pod.own.is_zero())
            .map(|pod| (pod.spec.address.clone(), pod.own))
            .collect()
    }

    /// The peers' load per pod as they last published it (see
    /// [`crate::peer_load`]); pods missing from `peers` have none.
    /// Visits only the pods loaded before or now, not the whole fleet.
    pub fn set_peer_load(&mut self, peers: &HashMap<String, PodLoad>) {
        let before = std::mem::take(&mut self.peer_loaded);
        for address in before.iter().filter(|a| !peers.contains_key(*a)) {
            self.set_peers_of(address, PodLoad::default());
        }
        for (address, &load) in peers {
            if self.set_peers_of(address, load) && !load.is_zero() {
                self.peer_loaded.push(address.clone());
            }
        }
    }

    /// False when `address` is not a pod of this cluster.
    fn set_peers_of(&mut self, address: &str, load: PodLoad) -> bool {
        let Some(i) = self.by_address.get(address).copied() else {
            return false;
        };
        if self.pods[i].peers != load {
            self.update_load(i, |pod| pod.peers = load);
        }
        true
    }

    fn update_own_load(&mut self, i: usize, change: impl FnOnce(&mut PodLoad)) {
        self.update_load(i, |pod| change(&mut pod.own));
    }

    /// Changes pod `i`'s load and moves it in the least-loaded order (to a
    /// new place among pods of equal load).
    fn update_load(&mut self, i: usize, change: impl FnOnce(&mut Pod)) {
        let Some(pod) = self.pods.get_mut(i) else {
            return;
        };
        self.load_order.remove(&pod.load_key(i));
        change(pod);
        pod.shuffle = splitmix64(pod.shuffle);
        self.load_order.insert(pod.load_key(i));
    }

    /// Applies an indexer feed update: the pod set and load it states, then
    /// its block operations. Precise entries are trusted for `trust_for_s`.
    /// A snapshot page is applied as it comes: pages are ranges of the index
    /// key, so each lands on its own run of buckets and applying several in
    /// one pass would save no bucket round trip (core/benches/snapshot_load.rs).
    pub fn apply_feed(&mut self, update: &FeedUpdate, now_s: u32, trust_for_s: u32) {
        if !update.pods.is_empty() || self.discovered {
            self.adopt_pods(update);
        }
        self.record_reported_load(update);
        if let Some(mut index) = self.index.take() {
            let mut ops: Vec<IndexOp> = Vec::new();
            self.index_ops(update, &mut ops);
            index.apply_ops(&ops, now_s);
            self.index = Some(index);
        }
        self.precise_until_s = now_s.saturating_add(trust_for_s);
    }

    /// True once the indexer feed has named the pods.
    pub fn is_discovered(&self) -> bool {
        self.discovered
    }

    fn adopt_pods(&mut self, update: &FeedUpdate) {
        self.discovered = true;
        let default_capacity = self.default_capacity.max(1);
        let speeds = &self.configured_speeds;
        let specs = update.pods.iter().map(|p| PodSpec {
            address: p.address.clone(),
            models: p.models.clone(),
            // 0: the indexer has not scraped the pod's capacity yet.
            capacity_blocks: if p.capacity_blocks == 0 {
                default_capacity
            } else {
                p.capacity_blocks
            },
            // A configured endpoint's speed, else the indexer's, else 1.
            speed: speeds.get(&p.address).copied().unwrap_or(if p.speed > 0.0 {
                f64::from(p.speed)
            } else {
                1.0
            }),
        });
        self.set_pods(specs.collect());
    }

    fn record_reported_load(&mut self, update: &FeedUpdate) {
        for info in &update.pods {
            if let Some(i) = self.by_address.get(&info.address).copied() {
                let reported = ReportedLoad {
                    waiting: info.waiting,
                    running: info.running,
                    kv_usage: info.kv_usage,
                };
                // An unchanged load is the same report (or one that moved
                // nothing): what this proxy did since still counts.
                if self.pods.get(i).is_some_and(|pod| pod.reported != reported) {
                    self.update_load(i, |pod| {
                        pod.reported = reported;
                        let load = pod.load();
                        pod.inflight_at_report = load.requests;
                        pod.active_at_report = load.active_blocks;
                    });
                }
            }
        }
    }

    /// `update`'s block operations on the index's pod ids, appended to
    /// `ops`: a snapshot's first page clears every pod first.
    fn index_ops<'u>(&self, update: &'u FeedUpdate, ops: &mut Vec<IndexOp<'u>>) {
        if update.snapshot {
            ops.extend(self.pods.iter().map(|pod| IndexOp::Cleared(pod.id)));
        }
        ops.extend(update.ops.iter().filter_map(|op| {
            let info = update.pods.get(op.pod() as usize)?;
            let id = self.pods[*self.by_address.get(&info.address)?].id;
            Some(match op {
                BlockOp::Stored { tier, hashes, .. } => IndexOp::Stored(id, *tier, hashes),
                BlockOp::Removed { hashes, .. } => IndexOp::Removed(id, hashes),
                BlockOp::Cleared { .. } => IndexOp::Cleared(id),
            })
        }));
    }

    fn pod(&self, address: &str) -> Option<&Pod> {
        self.pods.get(*self.by_address.get(address)?)
    }

    fn pod_mut(&mut self, address: &str) -> Option<&mut Pod> {
        let i = *self.by_address.get(address)?;
        self.pods.get_mut(i)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::budget::client_key;
    use crate::feed::PodInfo;
    use crate::hash::{token_block_hashes, IndexKey};
    use crate::request::parse_request;

    fn config(endpoints: &str) -> Config {
        Config::from_json(format!(r#"{{"endpoints":{endpoints}}}"#).as_bytes()).unwrap()
    }

    fn four_pods() -> (Config, Cluster) {
        let c = config(
            r#"[{"address":"a:1"},{"address":"b:1"},{"address":"c:1"},{"address":"d:1","models":["other"]}]"#,
        );
        let mut cluster = Cluster::default();
        cluster.set_configured(&c, 0);
        (c, cluster)
    }

    /// The hashed prompt of `tokens` token ids 0, 1, … sent to `model`.
    fn token_prompt(config: &Config, model: &str, tokens: u32) -> HashedPrompt {
        let request = PromptRequest::new(model, Prompt::Tokens((0..tokens).collect()));
        hash_prompt(config, &request)
    }

    /// A pod as the indexer feed announces it.
    fn fed_pod(address: &str, capacity_blocks: u32) -> PodInfo {
        PodInfo {
            address: address.into(),
            models: vec![],
            capacity_blocks,
            ..PodInfo::default()
        }
    }

    /// A feed answer carrying only the pods' load (no block operations).
    fn load_report(pods: Vec<PodInfo>) -> FeedUpdate {
        FeedUpdate {
            epoch: 1,
            cursor: 1,
            snapshot: false,
            pods,
            ops: vec![],
        }
    }

    fn chat(system: &str, question: &str) -> PromptRequest {
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{question}"}}]}}"#
        );
        parse_request(body.as_bytes()).unwrap()
    }

    fn route(
        config: &Config,
        cluster: &mut Cluster,
        request: &PromptRequest,
        seed: u64,
    ) -> Decision {
        let hashed = hash_prompt(config, request);
        let d = cluster.decide(config, &hashed, 10, seed).unwrap();
        cluster.record_routed(&d.pod, hashed.hashes.len() as u32, &hashed.hashes, 10);
        d
    }

    /// vLLM shares cached blocks only under one `cache_salt`: the same
    /// prompt under another salt must predict no hit, in either domain.
    #[test]
    fn salts_never_share_blocks() {
        let c = config(r#"[{"address":"a:1"}]"#);
        let salted = |salt: Option<&str>, prompt: Prompt| {
            let mut r = PromptRequest::new("m", prompt);
            r.cache_salt = salt.map(str::to_owned);
            hash_prompt(&c, &r).hashes
        };
        for prompt in [
            Prompt::Tokens((0..64).collect()),
            Prompt::Text(vec![b'x'; 256]),
        ] {
            let plain = salted(None, prompt.clone());
            let a = salted(Some("tenant-a"), prompt.clone());
            let b = salted(Some("tenant-b"), prompt.clone());
            assert_eq!(a.len(), 4);
            assert_eq!(a, salted(Some("tenant-a"), prompt.clone()));
            for (x, y) in [(&a, &b), (&a, &plain), (&b, &plain)] {
                assert!(x.iter().all(|h| !y.contains(h)));
            }
        }
        // The token domain agrees with the indexer's re-hash of vLLM's
        // block 0 extra keys ["tenant-a"].
        let root = root_hash(Domain::Tokens, "m", None);
        let tokens: Vec<u32> = (0..64).collect();
        assert_eq!(
            salted(Some("tenant-a"), Prompt::Tokens(tokens.clone())),
            keyed_token_block_hashes(root, &tokens, 16, 4096, &[salt_digest("tenant-a")])
        );
    }

    #[test]
    fn requests_without_a_model_take_the_pods_one_model_or_the_default() {
        let mut cluster = Cluster::default();
        let one = config(r#"[{"address":"a:1","models":["m"]},{"address":"b:1","models":["m"]}]"#);
        cluster.set_configured(&one, 0);
        assert_eq!(cluster.implied_model(&one).as_deref(), Some("m"));
        for endpoints in [
            r#"[{"address":"a:1","models":["m"]},{"address":"b:1","models":["n"]}]"#,
            r#"[{"address":"a:1","models":["m"]},{"address":"b:1"}]"#,
            r#"[{"address":"a:1","models":["m","n"]}]"#,
            r#"[]"#,
        ] {
            let mut cluster = Cluster::default();
            let c = config(endpoints);
            cluster.set_configured(&c, 0);
            assert_eq!(cluster.implied_model(&c), None, "{endpoints}");
            let with_default = Config {
                default_model: Some("n".into()),
                ..c
            };
            assert_eq!(
                cluster.implied_model(&with_default).as_deref(),
                Some("n"),
                "{endpoints}"
            );
        }
    }

    #[test]
    fn a_failed_pod_loses_its_learned_blocks_and_is_passed_over_until_the_cooldown_ends() {
        let (c, mut cluster) = four_pods();
        let request = chat(&"s".repeat(2000), "q");
        let first = route(&c, &mut cluster, &request, 1);
        cluster.record_finished(&first.pod, first.total_blocks as u32);
        cluster.record_failure(&first.pod, 10);
        for now in [10, 12] {
            let d = cluster
                .decide(&c, &hash_prompt(&c, &request), now, 1)
                .unwrap();
            assert_ne!(d.pod, first.pod, "passed over at second {now}");
            assert!(!d.fallbacks.contains(&first.pod));
            assert_eq!(d.candidates, 2, "{}", d.explain());
        }
        // Back after the cooldown (3 s by default), with nothing learned.
        let d = cluster
            .decide(&c, &hash_prompt(&c, &request), 13, 1)
            .unwrap();
        assert_eq!(d.candidates, 3);
        assert_eq!(d.matched_blocks, 0);
    }

    #[test]
    fn when_every_pod_failed_they_are_all_candidates_again() {
        let (c, mut cluster) = four_pods();
        for pod in ["a:1", "b:1", "c:1"] {
            cluster.record_failure(pod, 10);
        }
        let d = cluster
            .decide(&c, &token_prompt(&c, "m", 64), 11, 1)
            .unwrap();
        assert_eq!(d.candidates, 3);
    }

    #[test]
    fn a_refused_request_takes_back_only_the_blocks_it_taught() {
        let (mut c, mut cluster) = four_pods();
        // About learned blocks only: the two requests' load stays out of it.
        c.weights.running_per_block = 0.0;
        let system = "t".repeat(1280);
        let first = route(&c, &mut cluster, &chat(&system, "first"), 1);
        let attack = hash_prompt(&c, &chat(&system, &"x".repeat(6400)));
        let d = cluster.decide(&c, &attack, 10, 1).unwrap();
        assert_eq!(d.pod, first.pod);
        cluster.record_routed(&d.pod, 0, &attack.hashes, 10);
        cluster.forget_learned(&d.pod, &attack.hashes[d.matched_blocks..]);
        let again = cluster.decide(&c, &attack, 10, 1).unwrap();
        assert_eq!(again.pod, first.pod);
        assert_eq!(again.matched_blocks, d.matched_blocks);
    }

    #[test]
    fn one_client_teaches_a_pod_at_most_its_budget_per_window() {
        let c = config(r#"[{"address":"a:1","capacity_blocks":1000}]"#);
        let mut cluster = Cluster::default();
        cluster.set_configured(&c, 0);
        // 1000 × the default client share 0.5, per ttl_seconds (600).
        let (a, b) = (client_key("a"), client_key("b"));
        assert_eq!(cluster.client_allowance("a:1", a, 300, 10), 300);
        assert_eq!(cluster.client_allowance("a:1", a, 300, 20), 200);
        assert_eq!(cluster.client_allowance("a:1", a, 300, 30), 0);
        assert_eq!(cluster.client_allowance("a:1", b, 300, 30), 300);
        assert_eq!(cluster.client_allowance("a:1", a, 300, 610), 300);
    }

    #[test]
    fn one_request_claims_at_most_its_share_of_a_pods_table() {
        let c = config(r#"[{"address":"a:1","capacity_blocks":800}]"#);
        let mut cluster = Cluster::default();
        cluster.set_configured(&c, 0);
        let prompt = token_prompt(&c, "m", 16 * 400);
        cluster.record_routed("a:1", 0, &prompt.hashes, 10);
        let d = cluster.decide(&c, &prompt, 10, 1).unwrap();
        // 800 × the default share 0.125.
        assert_eq!(d.matched_blocks, 100);
    }

    #[test]
    fn shared_prefix_sticks_and_finished_load_is_released() {
        let (c, mut cluster) = four_pods();
        let system = "You are a helpful assistant. ".repeat(40);
        let first = route(&c, &mut cluster, &chat(&system, "one"), 1);
        cluster.record_finished(&first.pod, first.total_blocks as u32);
        for seed in 2..10 {
            let d = route(
                &c,
                &mut cluster,
                &chat(&system, &format!("question {seed}")),
                seed,
            );
            assert_eq!(d.pod, first.pod);
            assert!(d.matched_blocks >= 18, "{}", d.explain());
            cluster.record_finished(&d.pod, d.total_blocks as u32);
        }
    }

    #[test]
    fn prefill_work_is_released_at_first_bytes_and_the_request_at_the_end() {
        let (c, mut cluster) = four_pods();
        let request = chat(&"p".repeat(3000), "q");
        let d = route(&c, &mut cluster, &request, 1);
        let decide = |cluster: &Cluster| {
            cluster
                .decide(&c, &hash_prompt(&c, &request), 10, 1)
                .unwrap()
        };
        // In flight with its prefill pending: the pod's pending prefill equals the match it
        // offers, and the request counts as running there.
        assert_eq!(
            decide(&cluster).terms.total(),
            d.total_blocks as f64
                + c.weights.running
                + c.weights.running_per_block * d.total_blocks as f64
        );
        cluster.record_prefill_done(&d.pod, d.total_blocks as u32);
        let again = decide(&cluster);
        assert_eq!(
            (
                again.pod.as_str(),
                again.signals.inflight_blocks,
                again.signals.inflight_requests
            ),
            (d.pod.as_str(), 0, 1)
        );
        cluster.record_finished(&d.pod, 0);
        assert_eq!(decide(&cluster).signals.inflight_requests, 0);
    }

    #[test]
    fn pods_not_serving_the_model_are_never_chosen() {
        let (c, mut cluster) = four_pods();
        for seed in 0..50 {
            let d = route(&c, &mut cluster, &chat(&format!("s{seed}"), "q"), seed);
            assert_ne!(d.pod, "d:1");
            assert!(!d.fallbacks.contains(&"d:1".to_string()));
            assert_eq!(d.candidates, 3);
        }
        let other = PromptRequest::new("nobody", Prompt::Text(b"x".to_vec()));
        let only_other = config(r#"[{"address":"d:1","models":["other"]}]"#);
        let mut cl = Cluster::default();
        cl.set_configured(&only_other, 0);
        assert_eq!(
            cl.decide(&only_other, &hash_prompt(&only_other, &other), 0, 0),
            Err(NoRoute::NoEndpointForModel)
        );
        assert_eq!(
            Cluster::default().decide(&c, &hash_prompt(&c, &other), 0, 0),
            Err(NoRoute::NoEndpoints)
        );
    }

    #[test]
    fn hot_pod_sheds_new_prefixes() {
        let (c, mut cluster) = four_pods();
        let hot = route(&c, &mut cluster, &chat(&"x".repeat(4000), "q"), 1);
        for seed in 0..6 {
            let d = route(
                &c,
                &mut cluster,
                &chat(&format!("fresh {seed} {}", "y".repeat(500)), "q"),
                seed,
            );
            assert_ne!(
                d.pod, hot.pod,
                "a new prefix avoids the pod with {} blocks in flight",
                hot.total_blocks
            );
        }
    }

    #[test]
    fn a_recent_learned_prefix_extends_a_shorter_match_only() {
        let cpu_half = LocalMatch {
            pod: 1,
            blocks: 4,
            credit: 2.0,
        };
        let mut matches = vec![cpu_half];
        LocalMatch::merge_learned(&mut matches, 1, 3);
        assert_eq!(matches, vec![cpu_half]);
        LocalMatch::merge_learned(&mut matches, 1, 6);
        LocalMatch::merge_learned(&mut matches, 2, 5);
        assert_eq!(
            matches,
            vec![
                LocalMatch {
                    pod: 1,
                    blocks: 6,
                    credit: 4.0
                },
                LocalMatch {
                    pod: 2,
                    blocks: 5,
                    credit: 5.0
                }
            ]
        );
    }

    #[test]
    fn destination_and_explanation() {
        let (c, mut cluster) = four_pods();
        let d = route(&c, &mut cluster, &chat("s", "q"), 3);
        assert_eq!(d.fallbacks.len(), 2);
        assert_eq!(d.destination().split(',').count(), 3);
        assert!(d
            .explain()
            .starts_with(&format!("pod={}; matched=0/", d.pod)));
    }

    #[test]
    fn adapters_scope_hashes_and_route_to_base_model_pods() {
        let c = Config::from_json(br#"{"adapters":{"sql-lora":"base"},"endpoints":[{"address":"a:1","models":["base"]}]}"#).unwrap();
        let lora = token_prompt(&c, "sql-lora", 64);
        let base = token_prompt(&c, "base", 64);
        assert_eq!(lora.serving_model, "base");
        assert_eq!(lora.hashes.len(), 4);
        assert_ne!(lora.hashes, base.hashes);
        assert_eq!(
            lora.hashes[0],
            token_block_hashes(
                root_hash(Domain::Tokens, "base", Some("sql-lora")),
                &(0..16).collect::<Vec<_>>(),
                16,
                1
            )[0]
        );
    }

    #[test]
    fn feed_owns_pods_and_precise_entries_route() {
        let (c, mut cluster) = four_pods();
        let hashed = token_prompt(&c, "m", 160);
        let pod = |address: &str| fed_pod(address, 100);
        let update = FeedUpdate {
            epoch: 1,
            cursor: 1,
            snapshot: true,
            pods: vec![pod("x:1"), pod("y:1")],
            ops: vec![BlockOp::Stored {
                pod: 1,
                tier: Tier::Gpu,
                hashes: hashed.hashes[..8].iter().map(|h| h.index_key()).collect(),
            }],
        };
        cluster.apply_feed(&update, 100, 5);
        assert_eq!(cluster.len(), 2);
        cluster.set_configured(&c, 0);
        assert_eq!(
            cluster.len(),
            2,
            "configured endpoints do not override discovery"
        );
        let d = cluster.decide(&c, &hashed, 101, 0).unwrap();
        assert_eq!((d.pod.as_str(), d.matched_blocks), ("y:1", 8));
        let stale = cluster.decide(&c, &hashed, 200, 0).unwrap();
        assert_eq!(
            stale.matched_blocks, 0,
            "precise entries are ignored once the feed is stale"
        );
        let removal = FeedUpdate {
            snapshot: false,
            ops: vec![BlockOp::Removed {
                pod: 1,
                hashes: hashed.hashes[4..8].iter().map(|h| h.index_key()).collect(),
            }],
            ..update.clone()
        };
        cluster.apply_feed(&removal, 300, 5);
        assert_eq!(
            cluster.decide(&c, &hashed, 301, 0).unwrap().matched_blocks,
            4
        );
    }

    /// A snapshot in pages by index-key range (what the indexer sends: every
    /// pod's keys of one range per page, ranges ascending) leaves the index
    /// as the same snapshot in one page does.
    #[test]
    fn a_snapshot_paged_by_key_range_applies_as_the_unpaged_one() {
        let pods: Vec<PodInfo> = (0..5).map(|p| fed_pod(&format!("p:{p}"), 400)).collect();
        // Per pod and tier, keys spread over the key space; pods 0–2 share some.
        let key = |i: u64| IndexKey::new(i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        let runs: Vec<(u32, Tier, Vec<IndexKey>)> = (0u32..5)
            .flat_map(|pod| {
                let from = if pod < 3 { 0 } else { 1000 * u64::from(pod) };
                [
                    (Tier::Gpu, 0..60),
                    (Tier::Cpu, 60..80),
                    (Tier::Learned, 80..90),
                ]
                .into_iter()
                .map(move |(tier, range)| {
                    let mut keys: Vec<IndexKey> = range.map(|i| key(from + i)).collect();
                    keys.sort_unstable();
                    (pod, tier, keys)
                })
            })
            .collect();
        let update = |snapshot: bool, ops: Vec<BlockOp>| FeedUpdate {
            epoch: 1,
            cursor: 1,
            snapshot,
            pods: pods.clone(),
            ops,
        };
        let stored = |(pod, tier, keys): &(u32, Tier, Vec<IndexKey>),
                      range: &std::ops::Range<u64>| {
            let hashes: Vec<IndexKey> = keys
                .iter()
                .copied()
                .filter(|k| range.contains(&k.get()))
                .collect();
            (!hashes.is_empty()).then_some(BlockOp::Stored {
                pod: *pod,
                tier: *tier,
                hashes,
            })
        };
        let key_end = 1u64 << crate::hash::INDEX_KEY_BITS;
        let whole = update(
            true,
            runs.iter()
                .filter_map(|run| stored(run, &(0..key_end)))
                .collect(),
        );
        let ranges = 7;
        let width = key_end / ranges;
        let pages: Vec<FeedUpdate> = (0..ranges)
            .map(|i| {
                let range = i * width..if i + 1 == ranges {
                    key_end
                } else {
                    (i + 1) * width
                };
                update(
                    i == 0,
                    runs.iter().filter_map(|run| stored(run, &range)).collect(),
                )
            })
            .collect();
        assert!(
            pages.iter().all(|p| !p.ops.is_empty()),
            "every range holds keys"
        );
        let entries = |cluster: &Cluster| {
            let mut entries = cluster.index().unwrap().entries_oldest_first();
            entries.sort_unstable_by_key(|&(pod, key, _)| (pod, key));
            entries
        };
        let mut unpaged = Cluster::default();
        unpaged.apply_feed(&whole, 100, 5);
        let mut paged = Cluster::default();
        for page in &pages {
            paged.apply_feed(page, 100, 5);
        }
        assert_eq!(entries(&unpaged).len(), 5 * 90);
        assert_eq!(entries(&paged), entries(&unpaged));
    }

    #[test]
    fn discovered_pods_of_unknown_capacity_get_the_configured_default() {
        let (c, mut cluster) = four_pods();
        let update = FeedUpdate {
            epoch: 1,
            cursor: 1,
            snapshot: true,
            pods: vec![fed_pod("x:1", 0)],
            ops: vec![BlockOp::Stored {
                pod: 0,
                tier: Tier::Gpu,
                hashes: (1..=50).map(IndexKey::new).collect(),
            }],
        };
        cluster.apply_feed(&update, 10, 5);
        let prompt = HashedPrompt {
            serving_model: "m".into(),
            domain: Domain::Tokens,
            hashes: (1..=50).map(BlockHash::new).collect(),
            blocks: 50,
        };
        let d = cluster.decide(&c, &prompt, 10, 0).unwrap();
        assert_eq!(d.signals.capacity_blocks, c.default_capacity_blocks);
        assert_eq!(d.matched_blocks, 50);
        // Only a prefix's hashes known (a token memo recall): the rest of the
        // prompt is still charged as uncached prefill.
        let longer = HashedPrompt {
            blocks: 80,
            ..prompt.clone()
        };
        let d = cluster.decide(&c, &longer, 10, 0).unwrap();
        assert_eq!((d.matched_blocks, d.total_blocks), (50, 80));
        assert_eq!(d.terms.prefill, c.weights.prefill * 30.0);
        // Capacity learned later: the index entries stay.
        let scraped = FeedUpdate {
            pods: vec![PodInfo {
                capacity_blocks: 1000,
                ..update.pods[0].clone()
            }],
            ops: vec![],
            snapshot: false,
            ..update
        };
        cluster.apply_feed(&scraped, 11, 5);
        let d = cluster.decide(&c, &prompt, 11, 0).unwrap();
        assert_eq!((d.signals.capacity_blocks, d.matched_blocks), (1000, 50));
        assert_eq!(cluster.index().map(|i| i.stats().blocks), Some(50));
    }

    /// A pod's reported running count is a scrape old: the requests this
    /// proxy started or ended there since count until the next report.
    #[test]
    fn requests_routed_since_a_pods_report_count_as_running_there() {
        let c = config("[]");
        let mut cluster = Cluster::default();
        let report = |a_running: u32| {
            load_report(vec![
                PodInfo {
                    running: a_running,
                    ..fed_pod("a:1", 1000)
                },
                PodInfo {
                    running: 12,
                    ..fed_pod("b:1", 1000)
                },
            ])
        };
        cluster.apply_feed(&report(10), 10, 60);
        let prompt = hash_prompt(&c, &chat("nothing cached", "q"));
        let pick = |cluster: &Cluster| cluster.decide(&c, &prompt, 10, 1).unwrap().pod;
        assert_eq!(pick(&cluster), "a:1");
        for _ in 0..3 {
            cluster.record_routed("a:1", 0, &[], 10);
        }
        // 10 reported + 3 routed since: b (12) is less busy now.
        assert_eq!(pick(&cluster), "b:1");
        // The same load again is no new report: the 3 still count.
        cluster.apply_feed(&report(10), 10, 60);
        assert_eq!(pick(&cluster), "b:1");
        // A report that includes them, then 2 of them end.
        cluster.apply_feed(&report(13), 10, 60);
        assert_eq!(pick(&cluster), "b:1");
        cluster.record_finished("a:1", 0);
        cluster.record_finished("a:1", 0);
        assert_eq!(pick(&cluster), "a:1");
    }

    #[test]
    fn blocks_routed_since_a_pods_report_count_in_its_kv_usage() {
        let mut c = config("[]");
        c.weights.kv_usage = 1.0;
        c.weights.running_per_block = 0.0;
        let mut cluster = Cluster::default();
        let report = |a_kv: f32| {
            load_report(vec![
                PodInfo {
                    kv_usage: a_kv,
                    ..fed_pod("a:1", 1000)
                },
                PodInfo {
                    kv_usage: 0.55,
                    ..fed_pod("b:1", 1000)
                },
            ])
        };
        cluster.apply_feed(&report(0.5), 10, 60);
        let prompt = hash_prompt(&c, &chat("nothing cached", "q"));
        let pick = |cluster: &Cluster| cluster.decide(&c, &prompt, 10, 1).unwrap().pod;
        assert_eq!(pick(&cluster), "a:1");
        // 100 uncached blocks sent to a since (prefilled, now decoding): 0.6.
        cluster.record_routed("a:1", 100, &[], 10);
        cluster.record_prefill_done("a:1", 100);
        assert_eq!(pick(&cluster), "b:1");
        // A new report that includes them leaves them out of the correction.
        cluster.apply_feed(&report(0.52), 10, 60);
        assert_eq!(pick(&cluster), "a:1");
        // The pod reports more; then the request ends: its blocks leave the
        // estimate before the next report.
        cluster.apply_feed(&report(0.62), 10, 60);
        assert_eq!(pick(&cluster), "b:1");
        cluster.record_released("a:1", 100);
        assert_eq!(pick(&cluster), "a:1");
    }

    #[test]
    fn the_peers_load_counts_as_this_vms_and_each_reading_replaces_the_last() {
        let c = config(r#"[{"address":"a:1"},{"address":"b:1"}]"#);
        let mut cluster = Cluster::load_only();
        cluster.set_configured(&c, 0);
        let prompt = hash_prompt(&c, &chat("nothing cached", "q"));
        let pick = |cluster: &Cluster| cluster.decide(&c, &prompt, 10, 1).unwrap().pod;
        cluster.record_routed("a:1", 50, &[], 0);
        assert_eq!(pick(&cluster), "b:1");
        let own = PodLoad {
            requests: 1,
            pending_blocks: 50,
            active_blocks: 50,
        };
        assert_eq!(cluster.own_load(), vec![("a:1".to_string(), own)]);
        let busy = PodLoad {
            requests: 3,
            pending_blocks: 200,
            active_blocks: 200,
        };
        let peers = HashMap::from([("b:1".to_string(), busy), ("gone:1".to_string(), busy)]);
        cluster.set_peer_load(&peers);
        assert_eq!(pick(&cluster), "a:1", "the peers load b more");
        assert_eq!(
            cluster.own_load(),
            vec![("a:1".to_string(), own)],
            "the peers' load is not this VM's to publish"
        );
        cluster.set_peer_load(&HashMap::new());
        assert_eq!(pick(&cluster), "b:1", "the peers' requests on b ended");
        cluster.record_prefill_done("a:1", 50);
        cluster.record_finished("a:1", 0);
        cluster.record_released("a:1", 50);
        assert!(cluster.own_load().is_empty());
    }

    fn many_pods(n: usize) -> (Config, Cluster) {
        let endpoints: Vec<String> = (0..n)
            .map(|i| format!(r#"{{"address":"10.0.{}.{}:8000"}}"#, i / 256, i % 256))
            .collect();
        let c = config(&format!("[{}]", endpoints.join(",")));
        let mut cluster = Cluster::default();
        cluster.set_configured(&c, 0);
        (c, cluster)
    }

    #[test]
    fn a_decision_visits_the_matched_pods_and_the_least_loaded_only() {
        let (c, mut cluster) = many_pods(300);
        let request = chat(&"k".repeat(3000), "q");
        let hashed = hash_prompt(&c, &request);
        cluster.record_routed("10.0.0.7:8000", 0, &hashed.hashes, 10);
        cluster.record_routed("10.0.0.9:8000", 0, &hashed.hashes[..5], 10);
        let d = cluster.decide(&c, &hashed, 10, 1).unwrap();
        assert_eq!(
            (d.pod.as_str(), d.matched_blocks),
            ("10.0.0.7:8000", hashed.hashes.len())
        );
        assert_eq!(d.candidates, 2 + LEAST_LOADED_CANDIDATES, "{}", d.explain());
        assert!(d.lookup.probes <= 2 + 2 * 6, "{:?}", d.lookup);
        // A loaded pod leaves the least-loaded walk: the idle ones are considered.
        let busy = "10.0.0.9:8000";
        cluster.record_routed(busy, 500, &[], 10);
        let fresh = hash_prompt(&c, &chat("other", "q"));
        let d = cluster.decide(&c, &fresh, 10, 1).unwrap();
        assert_eq!(d.candidates, LEAST_LOADED_CANDIDATES);
        assert_ne!(d.pod, busy);
    }

    #[test]
    fn idle_pods_take_new_prefixes_in_turn() {
        let (c, mut cluster) = many_pods(200);
        let mut chosen = std::collections::BTreeSet::new();
        for seed in 0..100 {
            let d = route(
                &c,
                &mut cluster,
                &chat(&format!("prefix {seed}"), "q"),
                seed,
            );
            cluster.record_finished(&d.pod, d.total_blocks as u32);
            chosen.insert(d.pod);
        }
        assert!(
            chosen.len() >= 60,
            "{} pods took 100 new prefixes",
            chosen.len()
        );
    }

    #[test]
    fn reconfiguring_keeps_tables_of_pods_that_stay() {
        let (c, mut cluster) = four_pods();
        let request = chat(&"w".repeat(2000), "q");
        let first = route(&c, &mut cluster, &request, 1);
        cluster.record_finished(&first.pod, first.total_blocks as u32);
        let mut endpoints: Vec<String> = ["a:1", "b:1", "c:1", "e:1"]
            .iter()
            .map(|a| format!(r#"{{"address":"{a}"}}"#))
            .collect();
        endpoints.sort();
        let c2 = config(&format!("[{}]", endpoints.join(",")));
        cluster.set_configured(&c2, 0);
        assert_eq!(cluster.len(), 4);
        let d = cluster
            .decide(&c2, &hash_prompt(&c2, &request), 10, 5)
            .unwrap();
        assert_eq!(
            (d.pod.clone(), d.matched_blocks),
            (first.pod, first.total_blocks)
        );
    }

    #[test]
    fn speeds_survive_discovery_and_decode_pressure_is_released_at_the_end() {
        let c = config(r#"[{"address":"a:1","speed":0.5},{"address":"b:1"}]"#);
        let mut cluster = Cluster::default();
        cluster.set_configured(&c, 0);
        let update = FeedUpdate {
            epoch: 1,
            cursor: 1,
            snapshot: true,
            pods: vec![
                // The configured speed wins over the indexer's.
                PodInfo {
                    speed: 4.0,
                    ..fed_pod("a:1", 100)
                },
                fed_pod("b:1", 100),
                fed_pod("n:1", 100),
                PodInfo {
                    speed: 0.25,
                    ..fed_pod("s:1", 100)
                },
            ],
            ops: vec![],
        };
        cluster.apply_feed(&update, 10, 5);
        let prompt = token_prompt(&c, "m", 64);
        let speeds: Vec<f64> = ["a:1", "b:1", "n:1", "s:1"]
            .iter()
            .map(|a| {
                let i = cluster.by_address[*a];
                cluster.pods[i].spec.speed
            })
            .collect();
        assert_eq!(speeds, vec![0.5, 1.0, 1.0, 0.25]);
        // The proxy's estimate of active KV lives from routing to the end,
        // past the prefill.
        let mut approx = Cluster::default();
        approx.set_configured(&c, 0);
        approx.record_routed("b:1", 4, &prompt.hashes, 10);
        approx.record_prefill_done("b:1", 4);
        let signals = |cl: &Cluster| {
            let i = cl.by_address["b:1"];
            (
                cl.pods[i].load().pending_blocks,
                cl.pods[i].load().active_blocks,
            )
        };
        assert_eq!(signals(&approx), (0, 4));
        approx.record_finished("b:1", 0);
        approx.record_released("b:1", 4);
        assert_eq!(signals(&approx), (0, 0));
    }

    #[test]
    fn saturation_is_judged_only_with_priority_configured() {
        let (c, mut cluster) = four_pods();
        let prompt = token_prompt(&c, "m", 64);
        for pod in ["a:1", "b:1", "c:1"] {
            for _ in 0..2 {
                cluster.record_routed(pod, 1, &[], 10);
            }
        }
        assert_eq!(cluster.decide(&c, &prompt, 10, 1).unwrap().saturation, None);
        let with = Config::from_json(
            br#"{"priority":{"saturation":{"max_inflight_requests":2}},
                "endpoints":[{"address":"a:1"},{"address":"b:1"},{"address":"c:1"},{"address":"d:1","models":["other"]}]}"#,
        )
        .unwrap();
        let d = cluster.decide(&with, &prompt, 10, 1).unwrap();
        assert_eq!(d.saturation, Some([0, 0, 3, 0]), "{}", d.explain());
        cluster.record_finished("c:1", 1);
        assert_eq!(
            cluster.decide(&with, &prompt, 10, 1).unwrap().saturation,
            None
        );
    }
}
