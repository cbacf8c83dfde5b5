//! Scoring: the cost of sending a prompt to each candidate pod; lowest wins.
//!
//! ```text
//! cost(p) = w_prefill × uncached_prompt_blocks(p)
//!         + w_decode  × in_flight_uncached_blocks(p)
//!         + w_queue   × waiting_requests(p)
//!         + w_kv      × kv_usage(p) × capacity_blocks(p)
//! ```
//! Dynamo's KV-router form, every term in blocks so weights are unitless.
//! Ties go to the pod with fewer requests in flight, then to a random one.

use crate::config::Weights;

/// What the router knows about one candidate pod for one request.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PodSignals {
    /// Prompt blocks already cached there, weighted by tier credit.
    pub cached_credit: f64,
    /// Uncached prompt blocks routed there whose response has not started:
    /// its pending prefill (counted by the proxy).
    pub inflight_blocks: u64,
    /// Requests in flight there (counted by the proxy).
    pub inflight_requests: u32,
    /// Requests waiting in the pod's queue (pod-reported; 0 when unknown).
    pub waiting: u32,
    /// Fraction of the pod's KV cache in use (pod-reported; 0 when unknown).
    pub kv_usage: f32,
    pub capacity_blocks: u32,
}

/// Every weighted term of a pod's cost, for logs and the decision header.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CostTerms {
    pub prefill: f64,
    pub decode: f64,
    pub queue: f64,
    pub kv: f64,
}

impl CostTerms {
    pub fn total(&self) -> f64 {
        self.prefill + self.decode + self.queue + self.kv
    }
}

pub fn cost(prompt_blocks: usize, pod: &PodSignals, w: &Weights) -> CostTerms {
    let uncached = (prompt_blocks as f64 - pod.cached_credit).max(0.0);
    CostTerms {
        prefill: w.prefill * uncached,
        decode: w.decode * pod.inflight_blocks as f64,
        queue: w.queue * pod.waiting as f64,
        kv: w.kv_usage * f64::from(pod.kv_usage.clamp(0.0, 1.0)) * f64::from(pod.capacity_blocks),
    }
}

/// Candidates ordered best first: (index into `pods`, its cost terms).
/// `tie_seed` breaks exact ties at random without a host RNG.
pub fn rank(
    prompt_blocks: usize,
    pods: &[PodSignals],
    w: &Weights,
    tie_seed: u64,
) -> Vec<(usize, CostTerms)> {
    let mut ranked: Vec<(usize, CostTerms, f64, u64)> = pods
        .iter()
        .enumerate()
        .map(|(i, pod)| {
            let terms = cost(prompt_blocks, pod, w);
            (i, terms, terms.total(), mix(tie_seed ^ i as u64))
        })
        .collect();
    ranked.sort_by(|a, b| {
        a.2.total_cmp(&b.2)
            .then(
                pods[a.0]
                    .inflight_requests
                    .cmp(&pods[b.0].inflight_requests),
            )
            .then(a.3.cmp(&b.3))
    });
    ranked
        .into_iter()
        .map(|(i, terms, _, _)| (i, terms))
        .collect()
}

/// SplitMix64 finaliser: a well-mixed tie-break key per candidate.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(cached: f64, active: u64) -> PodSignals {
        PodSignals {
            cached_credit: cached,
            inflight_blocks: active,
            capacity_blocks: 1000,
            ..Default::default()
        }
    }

    /// Dynamo's documented example: 10 prompt blocks; (cached, active) =
    /// (2,10), (5,5), (8,9) → costs 18, 10, 11: worker 2 wins although worker 3
    /// has the best cache match.
    #[test]
    fn dynamo_worked_example() {
        let w = Weights {
            prefill: 1.0,
            decode: 1.0,
            queue: 0.0,
            kv_usage: 0.0,
        };
        let pods = [pod(2.0, 10), pod(5.0, 5), pod(8.0, 9)];
        let costs: Vec<f64> = pods.iter().map(|p| cost(10, p, &w).total()).collect();
        assert_eq!(costs, vec![18.0, 10.0, 11.0]);
        assert_eq!(rank(10, &pods, &w, 7)[0].0, 1);
    }

    #[test]
    fn ties_go_to_fewer_requests_then_spread_at_random() {
        let w = Weights::default();
        let mut busy = pod(0.0, 0);
        busy.inflight_requests = 3;
        assert_eq!(rank(4, &[busy, pod(0.0, 0)], &w, 1)[0].0, 1);
        let idle = [pod(0.0, 0), pod(0.0, 0), pod(0.0, 0), pod(0.0, 0)];
        let winners: std::collections::BTreeSet<usize> =
            (0..64).map(|seed| rank(4, &idle, &w, seed)[0].0).collect();
        assert_eq!(winners.len(), 4, "exact ties spread over every pod");
    }

    #[test]
    fn pod_reported_terms() {
        let w = Weights {
            prefill: 0.0,
            decode: 0.0,
            queue: 2.0,
            kv_usage: 1.0,
        };
        let p = PodSignals {
            waiting: 3,
            kv_usage: 0.5,
            capacity_blocks: 100,
            ..Default::default()
        };
        let terms = cost(10, &p, &w);
        assert_eq!((terms.queue, terms.kv), (6.0, 50.0));
        let clamped = PodSignals { kv_usage: 7.0, ..p };
        assert_eq!(cost(10, &clamped, &w).kv, 100.0);
    }

    #[test]
    fn prefix_weight_zero_is_load_only() {
        let w = Weights {
            prefill: 0.0,
            ..Weights::default()
        };
        assert_eq!(rank(10, &[pod(10.0, 5), pod(0.0, 1)], &w, 0)[0].0, 1);
    }
}
