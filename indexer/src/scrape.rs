//! Pod load from vLLM's Prometheus `/metrics`.

use crate::index::Load;

/// Parses vLLM's metrics text: `vllm:num_requests_waiting` and
/// `vllm:num_requests_running` are summed over series (engines / data-parallel
/// ranks), `vllm:kv_cache_usage_perc` (or the older `vllm:gpu_cache_usage_perc`)
/// is the maximum, and the capacity comes from `vllm:cache_config_info`'s
/// `num_gpu_blocks` label (summed over engines). `None` when none is present.
pub fn parse_vllm_metrics(text: &str) -> Option<Load> {
    let mut load = Load::default();
    let mut seen = false;
    let mut waiting = 0f64;
    let mut running = 0f64;
    let mut capacity = 0u64;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (name, labels, rest) = match line.find('{') {
            Some(i) => {
                let Some(j) = line[i..].find('}') else {
                    continue;
                };
                (&line[..i], &line[i + 1..i + j], &line[i + j + 1..])
            }
            None => match line.split_once(char::is_whitespace) {
                Some((n, r)) => (n, "", r),
                None => continue,
            },
        };
        let Some(value) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        else {
            continue;
        };
        if !value.is_finite() {
            continue;
        }
        match name {
            "vllm:num_requests_waiting" => {
                waiting += value.max(0.0);
                seen = true;
            }
            "vllm:num_requests_running" => {
                running += value.max(0.0);
                seen = true;
            }
            "vllm:kv_cache_usage_perc" | "vllm:gpu_cache_usage_perc" => {
                load.kv_usage = load.kv_usage.max(value.clamp(0.0, 1.0) as f32);
                seen = true;
            }
            "vllm:cache_config_info" => {
                if let Some(n) = label(labels, "num_gpu_blocks").and_then(|v| v.parse::<u64>().ok())
                {
                    capacity = capacity.saturating_add(n);
                    seen = true;
                }
            }
            _ => {}
        }
    }
    load.waiting = waiting.min(f64::from(u32::MAX)) as u32;
    load.running = running.min(f64::from(u32::MAX)) as u32;
    load.capacity_blocks = u32::try_from(capacity).unwrap_or(u32::MAX);
    seen.then_some(load)
}

fn label<'a>(labels: &'a str, key: &str) -> Option<&'a str> {
    let mut rest = labels;
    while !rest.is_empty() {
        let (k, after) = rest.split_once('=')?;
        let after = after.strip_prefix('"')?;
        let end = after.find('"')?;
        if k.trim().trim_start_matches(',').trim() == key {
            return Some(&after[..end]);
        }
        rest = &after[end + 1..];
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vllm_metrics() {
        let text = r#"
# HELP vllm:num_requests_waiting Number of requests waiting.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="Qwen/Qwen3-32B"} 3.0
vllm:num_requests_waiting{engine="1",model_name="Qwen/Qwen3-32B"} 2.0
vllm:num_requests_running{engine="0",model_name="Qwen/Qwen3-32B"} 17.0
vllm:kv_cache_usage_perc{engine="0",model_name="Qwen/Qwen3-32B"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="Qwen/Qwen3-32B"} 0.5
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="19208",num_cpu_blocks="None"} 1.0
vllm:num_requests_waiting_total 99
"#;
        let l = parse_vllm_metrics(text).expect("load");
        assert_eq!(l.waiting, 5);
        assert_eq!(l.running, 17);
        assert_eq!(l.kv_usage, 0.5);
        assert_eq!(l.capacity_blocks, 19208);
        assert_eq!(parse_vllm_metrics("# nothing\nfoo 1\n"), None);
        let old = parse_vllm_metrics("vllm:gpu_cache_usage_perc 0.75\n").expect("old");
        assert_eq!(old.kv_usage, 0.75);
        assert_eq!(
            parse_vllm_metrics("vllm:num_requests_running{x=\"}\"} NaN\n"),
            None
        );
    }

    /// Engines whose capacities sum beyond u64 read as the largest
    /// capacity, not a wrapped small one (or an overflow panic in a build
    /// that checks).
    #[test]
    fn capacities_beyond_u64_saturate() {
        let engine = |e: u32| {
            format!(
                "vllm:cache_config_info{{engine=\"{e}\",num_gpu_blocks=\"{}\"}} 1.0\n",
                u64::MAX - 1
            )
        };
        let text = engine(0) + &engine(1);
        let load = parse_vllm_metrics(&text).expect("load");
        assert_eq!(load.capacity_blocks, u32::MAX);
    }
}
