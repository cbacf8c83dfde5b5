//! Ranking the candidate pods with the cost model, and the decision that
//! explains itself (debug header, logs).

use super::HashedPrompt;
use crate::admission::all_saturated;
use crate::config::Config;
use crate::hash::Domain;
use crate::index::LookupCost;
use crate::line::Line;
use crate::score::{rank, CostTerms, PodSignals};

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
    /// The pod's position (see [`super::Cluster::position`]).
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
