//! Scoring: the cost of sending a prompt to each candidate pod; lowest wins.
//!
//! One cost model, in time: the work the pod would have to do before this
//! request's answer, in blocks a speed-1 pod computes, divided by the pod's
//! speed (issue 15: unequal pods).
//!
//! ```text
//! work(p) = w_prefill × uncached_prompt_blocks(p)
//!         + w_decode  × pending_prefill_blocks(p)
//!         + w_queue   × waiting_requests(p)
//!         + (w_running + w_running_per_block × max(prompt_blocks, 1))
//!               × running_requests(p)
//!         + w_kv      × active_kv_blocks(p)
//! cost(p) = work(p) / speed(p)
//! ```
//! Dynamo's KV-router form, every term in blocks so weights are unitless;
//! with every speed 1 (the default) the cost is the block count itself.
//! Decode pressure (the running and KV terms) comes from the pod while its
//! reports are fresh (precise mode: `vllm:num_requests_running`, corrected by
//! the requests the proxy started or saw end there since the report, and
//! `vllm:kv_cache_usage_perc` × capacity) and from the proxy's own count
//! otherwise (approximate mode: requests in flight, and the uncached prompt
//! blocks of requests routed there and not finished).
//! Ties go to the pod with fewer requests in flight, then to a random one.

use crate::config::Weights;
use crate::hash::splitmix64;

/// What the router knows about one candidate pod for one request.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct PodSignals {
    /// Prompt blocks already cached there, weighted by tier credit.
    pub cached_credit: f64,
    /// Uncached prompt blocks routed there whose response has not started:
    /// its pending prefill (counted by the proxy).
    pub inflight_blocks: u64,
    /// Uncached prompt blocks routed there whose request has not finished:
    /// the proxy's estimate of the KV those requests hold.
    pub active_blocks: u64,
    /// Requests in flight there (counted by the proxy).
    pub inflight_requests: u32,
    /// True while the pod's own reports (`waiting`, `running`, `kv_usage`)
    /// are fresh: they then measure its decode pressure.
    pub reported: bool,
    /// Requests waiting in the pod's queue (pod-reported; 0 when unknown).
    pub waiting: u32,
    /// Requests running on the pod (pod-reported, plus those the proxy
    /// started there since the report, minus those it saw end; 0 when unknown).
    pub running: u32,
    /// Fraction of the pod's KV cache in use (pod-reported; 0 when unknown).
    pub kv_usage: f32,
    pub capacity_blocks: u32,
    /// Relative speed (1.0: the reference pod; 0.5 takes twice as long).
    pub speed: f64,
}

impl PodSignals {
    /// Requests decoding there: pod-reported when fresh, else the proxy's count.
    pub fn running_requests(&self) -> u32 {
        if self.reported {
            self.running
        } else {
            self.inflight_requests
        }
    }

    /// KV blocks in use there: pod-reported when fresh, else the proxy's estimate.
    pub fn active_kv_blocks(&self) -> f64 {
        if self.reported {
            f64::from(self.kv_usage.clamp(0.0, 1.0)) * f64::from(self.capacity_blocks)
        } else {
            self.active_blocks as f64
        }
    }

    /// The speed work is divided by; a missing or nonsensical one counts as 1.
    fn divisor(&self) -> f64 {
        if self.speed.is_finite() && self.speed > 0.0 {
            self.speed
        } else {
            1.0
        }
    }
}

/// Every weighted term of a pod's cost (already divided by its speed), for
/// logs and the decision header.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct CostTerms {
    pub prefill: f64,
    pub decode: f64,
    pub queue: f64,
    pub running: f64,
    pub kv: f64,
}

impl CostTerms {
    pub fn total(&self) -> f64 {
        self.prefill + self.decode + self.queue + self.running + self.kv
    }
}

pub fn cost(prompt_blocks: usize, pod: &PodSignals, w: &Weights) -> CostTerms {
    let uncached = (prompt_blocks as f64 - pod.cached_credit).max(0.0);
    let per_speed = 1.0 / pod.divisor();
    let waiting = if pod.reported { pod.waiting } else { 0 };
    // A prompt shorter than a block still occupies one: load still counts.
    let load_blocks = prompt_blocks.max(1) as f64;
    CostTerms {
        prefill: w.prefill * uncached * per_speed,
        decode: w.decode * pod.inflight_blocks as f64 * per_speed,
        queue: w.queue * f64::from(waiting) * per_speed,
        running: (w.running + w.running_per_block * load_blocks)
            * f64::from(pod.running_requests())
            * per_speed,
        kv: w.kv_usage * pod.active_kv_blocks() * per_speed,
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
            (i, terms, terms.total(), splitmix64(tie_seed ^ i as u64))
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
            ..Weights::default()
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

    fn only(w: Weights) -> Weights {
        Weights {
            prefill: 0.0,
            decode: 0.0,
            ..w
        }
    }

    #[test]
    fn pod_reported_terms_count_while_fresh() {
        let w = only(Weights {
            queue: 2.0,
            running: 0.5,
            running_per_block: 0.25,
            kv_usage: 1.0,
            ..Weights::default()
        });
        let p = PodSignals {
            reported: true,
            waiting: 3,
            running: 8,
            kv_usage: 0.5,
            capacity_blocks: 100,
            inflight_requests: 1,
            active_blocks: 7,
            ..Default::default()
        };
        let terms = cost(10, &p, &w);
        // Running: 8 × (0.5 + 0.25 per block of the 10-block prompt).
        assert_eq!((terms.queue, terms.running, terms.kv), (6.0, 24.0, 50.0));
        let clamped = PodSignals { kv_usage: 7.0, ..p };
        assert_eq!(cost(10, &clamped, &w).kv, 100.0);
        // Stale or absent reports: the proxy's own counts stand in.
        let estimated = cost(
            10,
            &PodSignals {
                reported: false,
                ..p
            },
            &w,
        );
        assert_eq!(
            (estimated.queue, estimated.running, estimated.kv),
            (0.0, 3.0, 7.0)
        );
    }

    #[test]
    fn a_group_leaves_its_prefix_pod_at_the_same_running_gap_whatever_its_prompt_length() {
        let w = Weights::default();
        let empty = PodSignals {
            reported: true,
            speed: 1.0,
            ..Default::default()
        };
        for prompt_blocks in [112, 450, 2_000] {
            // A 5:1 prefix:question prompt whose prefix one pod holds.
            let holder = |running| PodSignals {
                cached_credit: prompt_blocks as f64 * 5.0 / 6.0,
                running,
                ..empty
            };
            let chosen = |running| rank(prompt_blocks, &[holder(running), empty], &w, 1)[0].0;
            assert_eq!(
                chosen(40),
                0,
                "{prompt_blocks} blocks: 40 more running stay"
            );
            assert_eq!(
                chosen(55),
                1,
                "{prompt_blocks} blocks: 55 more running leave"
            );
        }
    }

    #[test]
    fn cost_is_time_a_half_speed_pod_takes_twice_as_long() {
        let w = Weights {
            kv_usage: 0.5,
            ..Weights::default()
        };
        let fast = PodSignals {
            speed: 1.0,
            active_blocks: 40,
            inflight_blocks: 6,
            ..pod(2.0, 6)
        };
        let slow = PodSignals { speed: 0.5, ..fast };
        let (f, s) = (cost(10, &fast, &w), cost(10, &slow, &w));
        assert_eq!(f.total(), 4.0 * 8.0 + 6.0 + 20.0);
        assert_eq!(s.total(), 2.0 * f.total());
        // The same work goes to the fast pod; the slow one wins only when
        // its work is less than half.
        assert_eq!(rank(10, &[slow, fast], &w, 3)[0].0, 1);
        let idle_slow = PodSignals {
            cached_credit: 10.0,
            active_blocks: 0,
            inflight_blocks: 0,
            ..slow
        };
        assert_eq!(rank(10, &[idle_slow, fast], &w, 3)[0].0, 0);
        // A speed left at 0 (unset) counts as 1, never as infinite cost.
        assert_eq!(cost(10, &PodSignals { speed: 0.0, ..fast }, &w), f);
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
