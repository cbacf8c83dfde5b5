//! Prometheus text exposition with vLLM's (V1) metric names.

use std::fmt::Write;

/// vLLM's buckets for `vllm:time_to_first_token_seconds`.
pub const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];
/// vLLM's buckets for `vllm:e2e_request_latency_seconds`.
pub const E2E_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// Counters exported on /metrics (reset by /admin/flush).
#[derive(Debug, Clone)]
pub struct Counters {
    /// vLLM's `PrefixCacheStats.queries/hits` (tokens) of requests never preempted.
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    /// `preempted_queries/hits`: lookups of resumed requests, kept apart as vLLM does.
    pub preempted_prefix_queries: u64,
    pub preempted_prefix_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub preemptions: u64,
    pub requests_finished: u64,
    pub requests_aborted: u64,
    pub ttft: Histogram,
    pub e2e: Histogram,
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            prefix_queries: 0,
            prefix_hits: 0,
            preempted_prefix_queries: 0,
            preempted_prefix_hits: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            preemptions: 0,
            requests_finished: 0,
            requests_aborted: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(E2E_BUCKETS),
        }
    }
}

#[derive(Debug, Clone)]
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Self {
        Self {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub fn observe(&mut self, v: f64) {
        if let Some(i) = self.bounds.iter().position(|b| v <= *b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }

    fn render(&self, out: &mut String, name: &str, help: &str, labels: &str) {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        let mut cum = 0;
        for (b, c) in self.bounds.iter().zip(&self.counts) {
            cum += c;
            let _ = writeln!(out, "{name}_bucket{{{labels},le=\"{b:?}\"}} {cum}");
        }
        let _ = writeln!(out, "{name}_bucket{{{labels},le=\"+Inf\"}} {}", self.count);
        let _ = writeln!(out, "{name}_sum{{{labels}}} {:?}", self.sum);
        let _ = writeln!(out, "{name}_count{{{labels}}} {}", self.count);
    }
}

/// A pod's state at scrape time.
pub struct Snapshot<'a> {
    pub model_name: &'a str,
    pub running: usize,
    pub waiting: usize,
    pub kv_usage: f64,
    pub num_gpu_blocks: usize,
    pub block_size: usize,
    pub counters: &'a Counters,
}

fn gauge(out: &mut String, name: &str, help: &str, labels: &str, v: f64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} gauge\n{name}{{{labels}}} {v:?}"
    );
}

fn counter(out: &mut String, name: &str, help: &str, labels: &str, v: f64) {
    let _ = writeln!(
        out,
        "# HELP {name} {help}\n# TYPE {name} counter\n{name}{{{labels}}} {v:?}"
    );
}

pub fn render(s: &Snapshot) -> String {
    let mut out = String::with_capacity(8192);
    let labels = format!(
        "engine=\"0\",model_name=\"{}\"",
        s.model_name.replace('\\', "\\\\").replace('"', "\\\"")
    );
    let l = labels.as_str();
    let c = s.counters;
    gauge(
        &mut out,
        "vllm:num_requests_running",
        "Number of requests in model execution batches.",
        l,
        s.running as f64,
    );
    gauge(
        &mut out,
        "vllm:num_requests_waiting",
        "Number of requests waiting to be processed.",
        l,
        s.waiting as f64,
    );
    gauge(
        &mut out,
        "vllm:kv_cache_usage_perc",
        "KV-cache usage. 1 means 100 percent usage.",
        l,
        s.kv_usage,
    );
    counter(
        &mut out,
        "vllm:prefix_cache_queries_total",
        "Prefix cache queries, in terms of number of queried tokens.",
        l,
        c.prefix_queries as f64,
    );
    counter(
        &mut out,
        "vllm:prefix_cache_hits_total",
        "Prefix cache hits, in terms of number of cached tokens.",
        l,
        c.prefix_hits as f64,
    );
    // Not exported by vLLM (it logs them): lookups of resumed requests, kept apart as its
    // PrefixCacheStats does, so the vllm: pair above stays comparable.
    counter(
        &mut out,
        "vllm_sim:preempted_prefix_cache_queries_total",
        "Prefix cache queries of previously preempted requests, in tokens.",
        l,
        c.preempted_prefix_queries as f64,
    );
    counter(
        &mut out,
        "vllm_sim:preempted_prefix_cache_hits_total",
        "Prefix cache hits of previously preempted requests, in tokens.",
        l,
        c.preempted_prefix_hits as f64,
    );
    counter(
        &mut out,
        "vllm:num_preemptions_total",
        "Cumulative number of preemption from the engine.",
        l,
        c.preemptions as f64,
    );
    counter(
        &mut out,
        "vllm:prompt_tokens_total",
        "Number of prefill tokens processed.",
        l,
        c.prompt_tokens as f64,
    );
    counter(
        &mut out,
        "vllm:generation_tokens_total",
        "Number of generation tokens processed.",
        l,
        c.generation_tokens as f64,
    );
    let _ = writeln!(
        out,
        "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter\nvllm:request_success_total{{{l},finished_reason=\"length\"}} {:?}\nvllm:request_success_total{{{l},finished_reason=\"abort\"}} {:?}",
        c.requests_finished as f64, c.requests_aborted as f64
    );
    c.ttft.render(
        &mut out,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        l,
    );
    c.e2e.render(
        &mut out,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        l,
    );
    let _ = writeln!(
        out,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge\nvllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",engine=\"0\",num_gpu_blocks=\"{}\"}} 1.0",
        s.block_size, s.num_gpu_blocks
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let mut h = Histogram::new(TTFT_BUCKETS);
        h.observe(0.003);
        h.observe(0.3);
        h.observe(10_000.0);
        let mut s = String::new();
        h.render(&mut s, "x", "h", "a=\"b\"");
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.001\"} 0\n"));
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.005\"} 1\n"));
        assert!(s.contains("x_bucket{a=\"b\",le=\"0.5\"} 2\n"));
        assert!(s.contains("x_bucket{a=\"b\",le=\"2560.0\"} 2\n"));
        assert!(s.contains("x_bucket{a=\"b\",le=\"+Inf\"} 3\n"));
        assert!(s.contains("x_count{a=\"b\"} 3\n"));
    }
}
