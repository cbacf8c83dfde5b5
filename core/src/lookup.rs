//! Remote lookup: a proxy that holds no index (a mesh sidecar) sends a
//! prompt's block hashes to the indexer (`POST /v1/lookup`), which answers the
//! candidate pods with the prefix each holds and its reported load; the proxy
//! ranks them with the usual cost model and its own in-flight counts.
//!
//! Both ends share this module: the request and answer types, the prefix
//! walk the indexer runs per pod, the answer's validation and the ranking.

use crate::address::is_pod_address;
use crate::config::Config;
use crate::feed::Tier;
use crate::hash::BlockHash;
use crate::index::LookupCost;
use crate::router::{decide_among, Candidates, Decision, HashedPrompt, NoRoute};
use crate::score::PodSignals;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use std::collections::HashMap;
use std::fmt;

/// Candidates an answer may list; more is refused as a bad answer (the
/// indexer sends far fewer, see indexer/src/lookup.rs).
pub const MAX_CANDIDATES: usize = 1024;

/// The body of `POST /v1/lookup` (JSON). Unknown fields are ignored here
/// and in the answer, so proxies and indexers of other versions interoperate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LookupRequest<'a> {
    /// The model pods must serve (the base model for a LoRA adapter).
    #[serde(borrow)]
    pub model: Cow<'a, str>,
    /// The prompt's kvroute block hashes, block 0 first.
    pub hashes: Cow<'a, [BlockHash]>,
}

/// The leading blocks of a chain one pod holds, by the tiers they may be in.
/// `gpu_blocks <= cpu_blocks <= blocks`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct HeldPrefix {
    /// Leading blocks held in GPU memory or learned from routing.
    pub gpu_blocks: u32,
    /// … or in CPU memory.
    pub cpu_blocks: u32,
    /// … or on disk: every tier.
    pub blocks: u32,
}

impl HeldPrefix {
    /// Extends the prefix by its next block, held in `tier` (`None`: not
    /// held). False once the pod no longer holds the chain: the prefix is
    /// then final. A block in a slower tier ends the faster tiers' runs.
    pub fn extend(&mut self, tier: Option<Tier>) -> bool {
        self.extend_by(tier, 1)
    }

    /// [`HeldPrefix::extend`] by `blocks` consecutive blocks all held in `tier`.
    pub fn extend_by(&mut self, tier: Option<Tier>, blocks: u32) -> bool {
        let Some(tier) = tier else {
            return false;
        };
        let at = self.blocks;
        if self.cpu_blocks == at && tier != Tier::Disk {
            if self.gpu_blocks == at && matches!(tier, Tier::Gpu | Tier::Learned) {
                self.gpu_blocks = self.gpu_blocks.saturating_add(blocks);
            }
            self.cpu_blocks = self.cpu_blocks.saturating_add(blocks);
        }
        self.blocks = self.blocks.saturating_add(blocks);
        true
    }

    /// Blocks weighted by tier credit, as a local lookup counts them.
    fn credit(&self, config: &Config) -> f64 {
        f64::from(self.gpu_blocks)
            + f64::from(self.cpu_blocks - self.gpu_blocks) * config.tier_discount.cpu
            + f64::from(self.blocks - self.cpu_blocks) * config.tier_discount.disk
    }
}

/// One candidate pod of an answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Candidate {
    /// `ip:port`, as the override_host load balancer knows the pod.
    pub address: String,
    pub held: HeldPrefix,
    /// Load the pod reports (vLLM `/metrics`, scraped by the indexer).
    pub waiting: u32,
    pub running: u32,
    pub kv_usage: f32,
    /// 0: not scraped yet.
    pub capacity_blocks: u32,
    /// Relative speed as the indexer's pod source states it (absent: not
    /// stated); the proxy's configured `endpoints[].speed` wins over it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speed: Option<f32>,
}

/// The answer to `POST /v1/lookup` (JSON).
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
pub struct LookupAnswer {
    pub candidates: Vec<Candidate>,
}

/// Why a lookup gave no usable answer (the proxy then decides locally).
#[derive(Debug, Clone, PartialEq)]
pub enum LookupError {
    /// The call could not be dispatched (unknown cluster, …).
    NotSent,
    /// No response: timeout, reset, or a response over Envoy's limits.
    NoAnswer,
    /// The indexer answered another status than 200.
    Status(u16),
    /// The body is not an answer.
    Malformed(String),
    /// An answer that contradicts itself or the request.
    Invalid(&'static str),
    /// A valid answer with no pod to route to.
    NoCandidates,
}

impl LookupError {
    /// Why, briefly, for the decision header: the name, and the status when
    /// there is one (Envoy answers 503 itself when the indexer is unreachable).
    pub fn brief(&self) -> Cow<'static, str> {
        match self {
            LookupError::Status(s) => Cow::Owned(format!("status {s}")),
            other => Cow::Borrowed(other.name()),
        }
    }

    /// Short name of the kind of failure.
    pub fn name(&self) -> &'static str {
        match self {
            LookupError::NotSent => "not_sent",
            LookupError::NoAnswer => "no_answer",
            LookupError::Status(_) => "status",
            LookupError::Malformed(_) | LookupError::Invalid(_) => "bad_answer",
            LookupError::NoCandidates => "no_candidates",
        }
    }
}

impl fmt::Display for LookupError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LookupError::NotSent => write!(f, "lookup call not sent"),
            LookupError::NoAnswer => write!(f, "no answer (timeout or reset)"),
            LookupError::Status(s) => write!(f, "status {s}"),
            LookupError::Malformed(e) => write!(f, "malformed answer: {e}"),
            LookupError::Invalid(why) => write!(f, "invalid answer: {why}"),
            LookupError::NoCandidates => write!(f, "no candidate pods"),
        }
    }
}

impl std::error::Error for LookupError {}

/// The request body for a hashed prompt.
pub fn encode_request(prompt: &HashedPrompt) -> Vec<u8> {
    let request = LookupRequest {
        model: Cow::Borrowed(&prompt.serving_model),
        hashes: Cow::Borrowed(&prompt.hashes),
    };
    // Serialising strings and integers cannot fail.
    serde_json::to_vec(&request).unwrap_or_default()
}

/// Decodes and checks an answer to a lookup of `prompt_blocks` blocks.
pub fn decode_answer(body: &[u8], prompt_blocks: usize) -> Result<Vec<Candidate>, LookupError> {
    let answer: LookupAnswer =
        serde_json::from_slice(body).map_err(|e| LookupError::Malformed(e.to_string()))?;
    if answer.candidates.len() > MAX_CANDIDATES {
        return Err(LookupError::Invalid("too many candidates"));
    }
    for c in &answer.candidates {
        let h = c.held;
        if !(h.gpu_blocks <= h.cpu_blocks && h.cpu_blocks <= h.blocks) {
            return Err(LookupError::Invalid("prefix tiers out of order"));
        }
        if h.blocks as usize > prompt_blocks {
            return Err(LookupError::Invalid("prefix longer than the prompt"));
        }
        if !is_pod_address(&c.address) {
            return Err(LookupError::Invalid("address is not host:port"));
        }
        if !(c.kv_usage.is_finite() && c.kv_usage >= 0.0) {
            return Err(LookupError::Invalid("kv_usage is not a number >= 0"));
        }
        if c.speed
            .is_some_and(|s| !(s.is_finite() && s > 0.0 && s <= crate::feed::MAX_SPEED))
        {
            return Err(LookupError::Invalid("speed is not in (0, 1000]"));
        }
    }
    if answer.candidates.is_empty() {
        return Err(LookupError::NoCandidates);
    }
    Ok(answer.candidates)
}

/// Requests this proxy routed after a lookup and still in flight, per pod:
/// the decode term of the cost, which only the proxy knows.
#[derive(Debug, Clone, Default)]
pub struct InFlight {
    by_pod: HashMap<String, PodInFlight>,
}

#[derive(Debug, Clone, Copy, Default)]
struct PodInFlight {
    requests: u32,
    /// Uncached prompt blocks whose prefill has not started answering.
    blocks: u64,
}

impl InFlight {
    pub fn routed(&mut self, pod: &str, prompt_blocks: u32) {
        let p = self.by_pod.entry(pod.to_owned()).or_default();
        p.requests = p.requests.saturating_add(1);
        p.blocks = p.blocks.saturating_add(u64::from(prompt_blocks));
    }

    /// The first response bytes: the prefill is done.
    pub fn prefill_done(&mut self, pod: &str, prompt_blocks: u32) {
        if let Some(p) = self.by_pod.get_mut(pod) {
            p.blocks = p.blocks.saturating_sub(u64::from(prompt_blocks));
        }
    }

    /// The request ended; `prompt_blocks` are those not released by
    /// [`InFlight::prefill_done`]. A pod with nothing in flight is forgotten,
    /// so the map holds only pods with requests in flight.
    pub fn finished(&mut self, pod: &str, prompt_blocks: u32) {
        if let Some(p) = self.by_pod.get_mut(pod) {
            p.requests = p.requests.saturating_sub(1);
            p.blocks = p.blocks.saturating_sub(u64::from(prompt_blocks));
            if p.requests == 0 {
                self.by_pod.remove(pod);
            }
        }
    }

    /// Pods with requests in flight.
    pub fn len(&self) -> usize {
        self.by_pod.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_pod.is_empty()
    }

    fn of(&self, pod: &str) -> PodInFlight {
        self.by_pod.get(pod).copied().unwrap_or_default()
    }
}

/// Ranks an answer's candidates with the cost model, as
/// [`crate::router::Cluster::decide`] ranks the pods it holds.
pub fn decide(
    config: &Config,
    prompt: &HashedPrompt,
    candidates: &[Candidate],
    in_flight: &InFlight,
    tie_seed: u64,
) -> Result<Decision, NoRoute> {
    let signals: Vec<PodSignals> = candidates
        .iter()
        .map(|c| {
            let mine = in_flight.of(&c.address);
            PodSignals {
                cached_credit: c.held.credit(config),
                inflight_blocks: mine.blocks,
                // The sidecar knows only its own requests; the pod's
                // report (fresh: the indexer just answered) covers the rest.
                active_blocks: mine.blocks,
                inflight_requests: mine.requests,
                reported: true,
                waiting: c.waiting,
                running: c.running,
                kv_usage: c.kv_usage,
                speed: config
                    .endpoints
                    .iter()
                    .find(|e| e.address == c.address)
                    .map(|e| config.speed_of(e))
                    .or(c.speed.map(f64::from))
                    .unwrap_or(1.0),
                // 0: the indexer has not scraped the pod's capacity yet.
                capacity_blocks: if c.capacity_blocks == 0 {
                    config.default_capacity_blocks
                } else {
                    c.capacity_blocks
                },
            }
        })
        .collect();
    let addresses: Vec<&str> = candidates.iter().map(|c| c.address.as_str()).collect();
    let matched: Vec<usize> = candidates.iter().map(|c| c.held.blocks as usize).collect();
    let ranking = Candidates {
        addresses: &addresses,
        matched: &matched,
        signals: &signals,
    };
    // The indexer walked the chain, not this proxy: no local probes.
    decide_among(config, prompt, &ranking, tie_seed, LookupCost::default())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::{hashes, Domain};
    use std::collections::HashMap;

    fn prompt(blocks: u64) -> HashedPrompt {
        HashedPrompt {
            serving_model: "m".into(),
            domain: Domain::Tokens,
            hashes: (1..=blocks).map(BlockHash::new).collect(),
            blocks: blocks as usize,
        }
    }

    fn candidate(address: &str, blocks: u32) -> Candidate {
        Candidate {
            address: address.into(),
            held: HeldPrefix {
                gpu_blocks: blocks,
                cpu_blocks: blocks,
                blocks,
            },
            waiting: 0,
            running: 0,
            kv_usage: 0.0,
            capacity_blocks: 1000,
            speed: None,
        }
    }

    fn answer(candidates: &[Candidate]) -> Vec<u8> {
        serde_json::to_vec(&LookupAnswer {
            candidates: candidates.to_vec(),
        })
        .unwrap()
    }

    #[test]
    fn request_round_trips() {
        let p = prompt(3);
        let body = encode_request(&p);
        let decoded: LookupRequest = serde_json::from_slice(&body).unwrap();
        assert_eq!(decoded.model, "m");
        assert_eq!(decoded.hashes.as_ref(), hashes(&[1, 2, 3]));
        // Hashes above 2^53 keep every bit (JSON integers, not floats).
        let big = HashedPrompt {
            hashes: hashes(&[u64::MAX, 1 << 63]),
            ..p
        };
        let body = encode_request(&big);
        let decoded: LookupRequest = serde_json::from_slice(&body).unwrap();
        assert_eq!(decoded.hashes.as_ref(), hashes(&[u64::MAX, 1 << 63]));
    }

    /// The prefix of `hashes` a pod holds, block by block, as the indexer walks it.
    fn walk(hashes: &[u64], tier_of: impl Fn(u64) -> Option<Tier>) -> HeldPrefix {
        let mut held = HeldPrefix::default();
        for &h in hashes {
            if !held.extend(tier_of(h)) {
                break;
            }
        }
        held
    }

    #[test]
    fn held_prefix_counts_each_tier_boundary() {
        let hashes: Vec<u64> = (0..40).collect();
        let tiers: HashMap<u64, Tier> = (0..40)
            .filter_map(|h| match h {
                0..=9 => Some((h, Tier::Gpu)),
                10..=14 => Some((h, Tier::Learned)),
                15..=21 => Some((h, Tier::Cpu)),
                22..=29 => Some((h, Tier::Disk)),
                _ => None,
            })
            .collect();
        let held = walk(&hashes, |h| tiers.get(&h).copied());
        assert_eq!(
            held,
            HeldPrefix {
                gpu_blocks: 15,
                cpu_blocks: 22,
                blocks: 30
            }
        );
        assert_eq!(walk(&hashes, |_| None), HeldPrefix::default());
        assert_eq!(walk(&[], |_| Some(Tier::Gpu)), HeldPrefix::default());
        // A disk block first: nothing in a faster tier counts.
        let disk_first = walk(&hashes, |h| {
            Some(if h == 0 { Tier::Disk } else { Tier::Gpu })
        });
        assert_eq!((disk_first.gpu_blocks, disk_first.blocks), (0, 40));
    }

    #[test]
    fn garbage_answers_are_typed_errors() {
        let cases: [(&[u8], &str); 4] = [
            (b"", "bad_answer"),
            (b"not json", "bad_answer"),
            (br#"{"candidates":[{"address":"a:1"}]}"#, "bad_answer"),
            (br#"{"candidates":{}}"#, "bad_answer"),
        ];
        for (body, name) in cases {
            assert_eq!(decode_answer(body, 4).unwrap_err().name(), name, "{body:?}");
        }
        assert_eq!(
            decode_answer(br#"{"candidates":[]}"#, 4),
            Err(LookupError::NoCandidates)
        );
        assert_eq!(LookupError::Status(503).brief(), "status 503");
        assert_eq!(LookupError::NoAnswer.brief(), "no_answer");
        let mut bad = candidate("10.0.0.1:8000", 3);
        bad.held.gpu_blocks = 4;
        assert_eq!(
            decode_answer(&answer(&[bad]), 8),
            Err(LookupError::Invalid("prefix tiers out of order"))
        );
        assert_eq!(
            decode_answer(&answer(&[candidate("10.0.0.1:8000", 9)]), 8),
            Err(LookupError::Invalid("prefix longer than the prompt"))
        );
        for address in ["nope", "10.0.0.1:0", "a:1,b:2", ":80"] {
            assert_eq!(
                decode_answer(&answer(&[candidate(address, 1)]), 8),
                Err(LookupError::Invalid("address is not host:port")),
                "{address}"
            );
        }
        let too_many = vec![candidate("10.0.0.1:8000", 0); MAX_CANDIDATES + 1];
        assert_eq!(
            decode_answer(&answer(&too_many), 8),
            Err(LookupError::Invalid("too many candidates"))
        );
        let negative = br#"{"candidates":[{"address":"a:1","held":{"gpu_blocks":0,"cpu_blocks":0,"blocks":0},"waiting":0,"running":0,"kv_usage":-1.0,"capacity_blocks":0}]}"#;
        assert_eq!(
            decode_answer(negative, 8),
            Err(LookupError::Invalid("kv_usage is not a number >= 0"))
        );
        let mut stalled = candidate("10.0.0.1:8000", 8);
        for bad in [0.0, -1.0, 1001.0] {
            stalled.speed = Some(bad);
            assert_eq!(
                decode_answer(&answer(&[stalled.clone()]), 8),
                Err(LookupError::Invalid("speed is not in (0, 1000]")),
                "{bad}"
            );
        }
        let good = decode_answer(&answer(&[candidate("10.0.0.1:8000", 8)]), 8).unwrap();
        assert_eq!(good[0].held.blocks, 8);
        // An answer without speeds (an older indexer) reads as "not stated".
        assert_eq!(good[0].speed, None);
        assert!(!String::from_utf8_lossy(&answer(&good)).contains("speed"));
    }

    #[test]
    fn the_indexers_speed_counts_unless_the_config_names_the_pod() {
        let config = Config::default();
        let p = prompt(10);
        // Equal holders: the faster one costs less.
        let mut slow = candidate("10.0.0.1:8000", 8);
        slow.speed = Some(0.5);
        let fast = candidate("10.0.0.2:8000", 8);
        let d = decide(
            &config,
            &p,
            &[slow.clone(), fast.clone()],
            &InFlight::default(),
            1,
        )
        .unwrap();
        assert_eq!(d.pod, "10.0.0.2:8000");
        let alone = decide(&config, &p, &[slow.clone()], &InFlight::default(), 1).unwrap();
        assert!(
            alone.explain().contains("at speed 0.5"),
            "{}",
            alone.explain()
        );
        // The configured speed wins over the indexer's.
        let configured =
            Config::from_json(br#"{"endpoints":[{"address":"10.0.0.1:8000","speed":2.0}]}"#)
                .unwrap();
        let d = decide(&configured, &p, &[slow, fast], &InFlight::default(), 1).unwrap();
        assert_eq!(d.pod, "10.0.0.1:8000");
        assert!(d.explain().contains("at speed 2"), "{}", d.explain());
    }

    #[test]
    fn ranks_the_holder_first_unless_it_is_overloaded() {
        let config = Config::default();
        let p = prompt(10);
        let candidates = [
            candidate("10.0.0.1:8000", 0),
            candidate("10.0.0.2:8000", 8),
            candidate("10.0.0.3:8000", 2),
        ];
        let mut in_flight = InFlight::default();
        let d = decide(&config, &p, &candidates, &in_flight, 1).unwrap();
        assert_eq!(d.pod, "10.0.0.2:8000");
        assert_eq!((d.matched_blocks, d.total_blocks, d.candidates), (8, 10, 3));
        assert_eq!(d.fallbacks, vec!["10.0.0.3:8000", "10.0.0.1:8000"]);
        // The proxy's own in-flight prefill on the holder outweighs its 8
        // cached blocks (prefill weight 4 × 8 = 32 < 40 pending blocks).
        in_flight.routed("10.0.0.2:8000", 40);
        let d = decide(&config, &p, &candidates, &in_flight, 1).unwrap();
        assert_eq!(d.pod, "10.0.0.3:8000");
        in_flight.prefill_done("10.0.0.2:8000", 40);
        assert_eq!(
            decide(&config, &p, &candidates, &in_flight, 1).unwrap().pod,
            "10.0.0.2:8000"
        );
        in_flight.finished("10.0.0.2:8000", 0);
        assert!(
            in_flight.is_empty(),
            "a pod with nothing in flight is forgotten"
        );
    }

    #[test]
    fn lower_tiers_earn_their_discount_and_unknown_capacity_the_default() {
        let config = Config {
            weights: crate::config::Weights {
                prefill: 1.0,
                decode: 0.0,
                queue: 0.0,
                running: 0.0,
                running_per_block: 0.0,
                kv_usage: 1.0,
            },
            ..Config::default()
        };
        let mut on_disk = candidate("10.0.0.1:8000", 8);
        on_disk.held = HeldPrefix {
            gpu_blocks: 0,
            cpu_blocks: 4,
            blocks: 8,
        };
        on_disk.capacity_blocks = 0;
        on_disk.kv_usage = 0.5;
        let d = decide(&config, &prompt(8), &[on_disk], &InFlight::default(), 0).unwrap();
        // credit = 4 × 0.5 + 4 × 0.25 = 3 → prefill 5; kv = 0.5 × 16384.
        assert_eq!(d.terms.prefill, 5.0);
        assert_eq!(d.terms.kv, 8192.0);
        assert_eq!(d.signals.capacity_blocks, config.default_capacity_blocks);
    }
}
