//! Validation of a parsed configuration: every bound and shape checked, and
//! every error naming its field.

use super::sections::{MAX_FLUSH_MS, MIN_FLUSH_MS};
use super::{
    invalid, Config, ConfigError, PrioritySettings, MAX_INDEX_BUDGET_BYTES, MIN_INDEX_BUDGET_BYTES,
};
use crate::address::{is_pod_address, POD_ADDRESS_RULE};

/// Bounds that keep a typo from turning into a memory or CPU bomb.
const MAX_CAPACITY_BLOCKS: u32 = 1 << 24;
const MAX_BLOCKS_PER_REQUEST: usize = 1 << 16;
const MAX_MEMO_BYTES: usize = 1 << 30;
/// Speeds are relative to one reference pod; beyond this is a typo.
const MAX_SPEED: f64 = 1000.0;

impl Config {
    pub(super) fn validate(&self) -> Result<(), ConfigError> {
        self.check_request_handling()?;
        self.check_scoring()?;
        self.check_index()?;
        self.check_endpoints()?;
        if let Some(priority) = &self.priority {
            check_priority(priority)?;
        }
        if self.default_model.as_ref().is_some_and(|m| m.is_empty()) {
            return Err(invalid(
                "default_model",
                "must name a model (or be left out)",
            ));
        }
        if let Some(header) = &self.tenant_header {
            if !is_header_name(header) {
                return Err(invalid(
                    "tenant_header",
                    "must be a lower-case HTTP header name",
                ));
            }
        }
        self.check_callouts()
    }

    /// Which requests are routed, how their bodies are read and hashed, the headers written,
    /// and how long a failed pod is passed over.
    fn check_request_handling(&self) -> Result<(), ConfigError> {
        if self.paths.is_empty() {
            return Err(invalid("paths", "must list at least one path"));
        }
        for (i, path) in self.paths.iter().enumerate() {
            if !path.starts_with('/') {
                return Err(invalid(format!("paths[{i}]"), "must start with '/'"));
            }
        }
        if self.max_body_bytes == 0 {
            return Err(invalid("max_body_bytes", "must be > 0"));
        }
        if self.block_size == 0 || self.block_size > 1024 {
            return Err(invalid("block_size", "must be between 1 and 1024"));
        }
        if self.chunk_bytes == 0 || self.chunk_bytes > 65536 {
            return Err(invalid("chunk_bytes", "must be between 1 and 65536"));
        }
        if self.max_blocks == 0 || self.max_blocks > MAX_BLOCKS_PER_REQUEST {
            return Err(invalid(
                "max_blocks",
                format!("must be between 1 and {MAX_BLOCKS_PER_REQUEST}"),
            ));
        }
        if !is_header_name(&self.destination_header) {
            return Err(invalid(
                "destination_header",
                "must be a lower-case HTTP header name",
            ));
        }
        if !self.decision_header.is_empty() && !is_header_name(&self.decision_header) {
            return Err(invalid(
                "decision_header",
                "must be a lower-case HTTP header name or empty",
            ));
        }
        if !self.served_header.is_empty() && !is_header_name(&self.served_header) {
            return Err(invalid(
                "served_header",
                "must be a lower-case HTTP header name or empty",
            ));
        }
        if self.served_header_from_route && self.served_header.is_empty() {
            return Err(invalid(
                "served_header_from_route",
                "needs served_header: the header the route sets",
            ));
        }
        if self.failure_cooldown_seconds > 3600 {
            return Err(invalid("failure_cooldown_seconds", "must be <= 3600"));
        }
        Ok(())
    }

    /// The cost model's weights and the discount of offloaded tiers.
    fn check_scoring(&self) -> Result<(), ConfigError> {
        let w = &self.weights;
        for (name, value) in [
            ("prefill", w.prefill),
            ("decode", w.decode),
            ("queue", w.queue),
            ("kv_usage", w.kv_usage),
            ("running", w.running),
            ("running_per_block", w.running_per_block),
        ] {
            if !(value.is_finite() && value >= 0.0) {
                return Err(invalid(
                    format!("weights.{name}"),
                    "must be a finite number >= 0",
                ));
            }
        }
        for (name, value) in [
            ("cpu", self.tier_discount.cpu),
            ("disk", self.tier_discount.disk),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return Err(invalid(
                    format!("tier_discount.{name}"),
                    "must be between 0 and 1",
                ));
            }
        }
        Ok(())
    }

    /// The local index: lifetimes, teaching shares, memory budget, flush period.
    fn check_index(&self) -> Result<(), ConfigError> {
        if self.index.ttl_seconds == 0 {
            return Err(invalid("index.ttl_seconds", "must be > 0"));
        }
        for (name, share) in [
            ("max_learn_share", self.index.max_learn_share),
            ("max_client_share", self.index.max_client_share),
        ] {
            if !(share > 0.0 && share <= 1.0) {
                return Err(invalid(format!("index.{name}"), "must be > 0 and <= 1"));
            }
        }
        if !(MIN_INDEX_BUDGET_BYTES..=MAX_INDEX_BUDGET_BYTES).contains(&self.index.budget_bytes) {
            return Err(invalid(
                "index.budget_bytes",
                format!(
                    "must be between {MIN_INDEX_BUDGET_BYTES} (1 MiB) and {MAX_INDEX_BUDGET_BYTES} (768 MiB)"
                ),
            ));
        }
        if !(MIN_FLUSH_MS..=MAX_FLUSH_MS).contains(&self.index.flush_ms) {
            return Err(invalid(
                "index.flush_ms",
                format!("must be between {MIN_FLUSH_MS} and {MAX_FLUSH_MS}"),
            ));
        }
        Ok(())
    }

    /// The configured pods: addresses (each once), capacities and speeds.
    fn check_endpoints(&self) -> Result<(), ConfigError> {
        check_capacity(
            "default_capacity_blocks",
            Some(self.default_capacity_blocks),
        )?;
        let mut seen = std::collections::BTreeSet::new();
        for (i, endpoint) in self.endpoints.iter().enumerate() {
            if !is_pod_address(&endpoint.address) {
                return Err(invalid(
                    format!("endpoints[{i}].address"),
                    format!("must be {POD_ADDRESS_RULE}"),
                ));
            }
            if !seen.insert(endpoint.address.as_str()) {
                return Err(invalid(
                    format!("endpoints[{i}].address"),
                    "is listed twice",
                ));
            }
            check_capacity(
                &format!("endpoints[{i}].capacity_blocks"),
                endpoint.capacity_blocks,
            )?;
            if let Some(speed) = endpoint.speed {
                if !(speed.is_finite() && speed > 0.0 && speed <= MAX_SPEED) {
                    return Err(invalid(
                        format!("endpoints[{i}].speed"),
                        format!("must be > 0 and <= {MAX_SPEED}"),
                    ));
                }
            }
        }
        Ok(())
    }

    /// The call-outs: indexer feed, tokenizer, remote lookup.
    fn check_callouts(&self) -> Result<(), ConfigError> {
        if let Some(indexer) = &self.indexer {
            check_callout("indexer", &indexer.cluster, indexer.timeout_ms)?;
            if indexer.poll_ms < 10 {
                return Err(invalid("indexer.poll_ms", "must be >= 10"));
            }
            for (name, path) in [
                ("feed_path", &indexer.feed_path),
                ("learned_path", &indexer.learned_path),
            ] {
                if !path.starts_with('/') {
                    return Err(invalid(format!("indexer.{name}"), "must start with '/'"));
                }
            }
            if let Some(name) = &indexer.token_env {
                if !is_env_name(name) {
                    return Err(invalid(
                        "indexer.token_env",
                        "must be an environment variable name ([A-Za-z_][A-Za-z0-9_]*)",
                    ));
                }
            }
        }
        if let Some(tokenizer) = &self.tokenizer {
            check_callout("tokenizer", &tokenizer.cluster, tokenizer.timeout_ms)?;
            if !tokenizer.path.starts_with('/') {
                return Err(invalid("tokenizer.path", "must start with '/'"));
            }
            if tokenizer.memo_bytes > MAX_MEMO_BYTES {
                return Err(invalid("tokenizer.memo_bytes", "must be at most 1 GiB"));
            }
        }
        if let Some(remote) = &self.remote_index {
            check_callout("remote_index", &remote.cluster, remote.timeout_ms)?;
            if !remote.path.starts_with('/') {
                return Err(invalid("remote_index.path", "must start with '/'"));
            }
            if remote.min_blocks == 0 || remote.min_blocks > self.max_blocks {
                return Err(invalid(
                    "remote_index.min_blocks",
                    "must be between 1 and max_blocks",
                ));
            }
        }
        Ok(())
    }
}

fn check_priority(p: &PrioritySettings) -> Result<(), ConfigError> {
    if !is_header_name(&p.header) {
        return Err(invalid(
            "priority.header",
            "must be a lower-case HTTP header name",
        ));
    }
    if p.classes.keys().any(|name| name.is_empty()) {
        return Err(invalid("priority.classes", "class names must not be empty"));
    }
    if !p.classes.contains_key(&p.default_class) {
        return Err(invalid(
            "priority.default_class",
            "must be one of priority.classes",
        ));
    }
    let kv = p.saturation.max_kv_usage;
    if !(kv.is_finite() && (0.0..=1.0).contains(&kv)) {
        return Err(invalid(
            "priority.saturation.max_kv_usage",
            "must be between 0 and 1 (0: test off)",
        ));
    }
    if p.retry_after_seconds == 0 || p.retry_after_seconds > 3600 {
        return Err(invalid(
            "priority.retry_after_seconds",
            "must be between 1 and 3600",
        ));
    }
    Ok(())
}

fn check_capacity(field: &str, capacity: Option<u32>) -> Result<(), ConfigError> {
    match capacity {
        Some(0) => Err(invalid(field, "must be > 0")),
        Some(c) if c > MAX_CAPACITY_BLOCKS => {
            Err(invalid(field, format!("must be <= {MAX_CAPACITY_BLOCKS}")))
        }
        _ => Ok(()),
    }
}

/// `[A-Za-z_][A-Za-z0-9_]*`, what a shell and Kubernetes accept everywhere.
fn is_env_name(name: &str) -> bool {
    let mut chars = name.chars();
    chars
        .next()
        .is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn check_callout(section: &str, cluster: &str, timeout_ms: u32) -> Result<(), ConfigError> {
    if cluster.is_empty() {
        return Err(invalid(
            format!("{section}.cluster"),
            "must name an Envoy cluster",
        ));
    }
    if timeout_ms == 0 || timeout_ms > 60_000 {
        return Err(invalid(
            format!("{section}.timeout_ms"),
            "must be between 1 and 60000",
        ));
    }
    Ok(())
}

fn is_header_name(name: &str) -> bool {
    !name.is_empty()
        && name.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_' || b == b'.'
        })
}
