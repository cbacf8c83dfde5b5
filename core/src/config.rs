//! Plugin configuration: parsed from the plugin's JSON, validated into a
//! runtime [`Config`]. Every error names the offending field, because Envoy
//! only shows the operator a log line.

use serde::Deserialize;
use std::collections::BTreeMap;
use std::fmt;

/// A configuration the filter refuses, with the field that is wrong.
#[derive(Debug, Clone, PartialEq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.field.is_empty() {
            write!(f, "invalid kvroute config: {}", self.message)
        } else {
            write!(
                f,
                "invalid kvroute config: field `{}`: {}",
                self.field, self.message
            )
        }
    }
}

impl std::error::Error for ConfigError {}

fn invalid(field: impl Into<String>, message: impl Into<String>) -> ConfigError {
    ConfigError {
        field: field.into(),
        message: message.into(),
    }
}

/// Which root context this plugin instance runs as.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// HTTP filter in every worker: parses, scores, routes.
    Filter,
    /// Bootstrap `wasm_service` on the main thread: polls the indexer.
    Singleton,
}

mod sections;
mod validate;

pub use sections::{
    Admission, Endpoint, IndexSettings, IndexerSettings, PrioritySettings, RemoteIndexSettings,
    Saturation, TierDiscount, TokenizerSettings, Weights, DEFAULT_FLUSH_MS,
    DEFAULT_INDEX_BUDGET_BYTES, MAX_INDEX_BUDGET_BYTES, MIN_INDEX_BUDGET_BYTES,
};
#[cfg(test)]
mod tests;

/// The plugin configuration as written by the operator.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub role: Role,
    pub paths: Vec<String>,
    pub max_body_bytes: usize,
    pub block_size: usize,
    pub chunk_bytes: usize,
    pub max_blocks: usize,
    pub destination_header: String,
    pub fallback_endpoints: usize,
    pub decision_header: String,
    /// Response header naming the pod that really served (after Envoy's
    /// retries onto the fallbacks); empty: not added.
    pub served_header: String,
    /// The route sets `served_header` itself (`%UPSTREAM_HOST%`, replacing
    /// any value the pod sent): kvroute reads the serving pod from it
    /// instead of Envoy's `upstream.address` property, a dearer host call.
    pub served_header_from_route: bool,
    /// A pod that failed a request (5xx, reset, or a retry served elsewhere)
    /// is passed over for this long; 0: never passed over.
    pub failure_cooldown_seconds: u32,
    pub weights: Weights,
    pub tier_discount: TierDiscount,
    pub index: IndexSettings,
    pub default_capacity_blocks: u32,
    pub endpoints: Vec<Endpoint>,
    /// LoRA adapter name → base model, so adapter requests hash in the
    /// adapter's scope and go to pods serving the base model.
    pub adapters: BTreeMap<String, String>,
    /// Model a request without `model` is routed in when the pods do not all
    /// serve one model (see `Cluster::implied_model`).
    pub default_model: Option<String>,
    /// Tenant isolation: request header naming the tenant (set by the mesh
    /// from the authenticated identity). When set, every routed request gets
    /// the tenant's `cache_salt` written into its body.
    pub tenant_header: Option<String>,
    /// Priority classes and shedding at saturation; absent: nothing is shed.
    pub priority: Option<PrioritySettings>,
    pub indexer: Option<IndexerSettings>,
    pub tokenizer: Option<TokenizerSettings>,
    pub remote_index: Option<RemoteIndexSettings>,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            role: Role::Filter,
            paths: vec!["/v1/chat/completions".into(), "/v1/completions".into()],
            max_body_bytes: 4 << 20,
            block_size: 16,
            chunk_bytes: 64,
            max_blocks: 4096,
            destination_header: "x-gateway-destination-endpoint".into(),
            fallback_endpoints: 2,
            decision_header: "x-kvroute-decision".into(),
            served_header: "x-gateway-destination-endpoint-served".into(),
            served_header_from_route: false,
            failure_cooldown_seconds: 3,
            weights: Weights::default(),
            tier_discount: TierDiscount::default(),
            index: IndexSettings::default(),
            default_capacity_blocks: 16384,
            endpoints: Vec::new(),
            adapters: BTreeMap::new(),
            default_model: None,
            tenant_header: None,
            priority: None,
            indexer: None,
            tokenizer: None,
            remote_index: None,
        }
    }
}

impl Config {
    /// Parses and validates the plugin configuration. An empty input means
    /// all defaults.
    pub fn from_json(bytes: &[u8]) -> Result<Config, ConfigError> {
        let trimmed = bytes.iter().all(|b| b.is_ascii_whitespace());
        let config: Config = if trimmed {
            Config::default()
        } else {
            serde_json::from_slice(bytes)
                .map_err(|e| invalid(field_of_serde_error(&e), e.to_string()))?
        };
        config.validate()?;
        Ok(config)
    }

    /// Capacity of an endpoint, with the configured default.
    pub fn capacity_of(&self, endpoint: &Endpoint) -> u32 {
        endpoint
            .capacity_blocks
            .unwrap_or(self.default_capacity_blocks)
    }

    /// Relative speed of an endpoint (1.0 when not configured).
    pub fn speed_of(&self, endpoint: &Endpoint) -> f64 {
        endpoint.speed.unwrap_or(1.0)
    }

    /// True when requests on this path are routed.
    pub fn routes_path(&self, path: &str) -> bool {
        let path = path.split('?').next().unwrap_or(path);
        self.paths.iter().any(|p| p == path)
    }
}

/// serde_json names unknown fields in its message but not the path of a type
/// error; pull the backticked field name out when there is one.
fn field_of_serde_error(error: &serde_json::Error) -> String {
    let text = error.to_string();
    let mut parts = text.split('`');
    match (parts.next(), parts.next()) {
        (Some(_), Some(field))
            if text.starts_with("unknown field") || text.starts_with("missing field") =>
        {
            field.to_string()
        }
        _ => String::new(),
    }
}
