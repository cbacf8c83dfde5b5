//! The step-time model: what one engine step of prefill and decode work costs.

/// Step-time model; see README.md "Cost model" for the derivation of the defaults.
#[derive(Debug, Clone, Copy)]
pub struct CostModel {
    /// Fixed cost of every step: reading the weights once (ms).
    pub step_overhead_ms: f64,
    /// Linear prefill cost per prompt token (µs): 2 × params FLOPs at the achieved rate.
    pub prefill_us_per_token: f64,
    /// Attention cost per (new token × context token) pair during prefill (ns).
    pub attn_ns_per_pair: f64,
    /// Decode cost per context token of each decoding sequence: KV bytes / effective bandwidth (ns).
    pub kv_read_ns_per_token: f64,
    /// Relative speed of this pod's accelerator (1.0: the constants above; 0.5: every step
    /// takes twice as long, prefill and decode alike).
    pub speed: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            step_overhead_ms: 13.0,
            prefill_us_per_token: 73.7,
            attn_ns_per_pair: 2.36,
            kv_read_ns_per_token: 91.0,
            speed: 1.0,
        }
    }
}

impl CostModel {
    /// Seconds for a step that computes, per scheduled request, `n` new tokens over `ctx`
    /// already-computed ones, on a pod of `speed`.
    pub fn step_seconds(&self, work: impl Iterator<Item = (usize, usize, bool)>) -> f64 {
        let mut s = self.step_overhead_ms * 1e-3;
        for (ctx, n, decode) in work {
            let (ctx, n) = (ctx as f64, n as f64);
            if decode {
                s += (ctx + n) * self.kv_read_ns_per_token * 1e-9;
            } else {
                s += n * self.prefill_us_per_token * 1e-6
                    + n * (ctx + n / 2.0) * self.attn_ns_per_pair * 1e-9;
            }
        }
        s / self.speed
    }
}
