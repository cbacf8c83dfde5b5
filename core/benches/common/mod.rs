//! What the core benches share.

use kvroute_core::config::Config;

/// A filter config with `pods` endpoints of one Qwen3-32B pod's capacity each
/// (19,208 blocks). Each request may teach its whole prompt: a 32k-token
/// prompt is 2,000 chunks.
pub fn fleet_config(pods: usize) -> Config {
    let endpoints: Vec<String> = (0..pods)
        .map(|i| format!(r#"{{"address":"10.0.{}.{}:8000"}}"#, i / 256, i % 256))
        .collect();
    let json = format!(
        r#"{{"default_capacity_blocks":19208,"max_blocks":4096,"index":{{"max_learn_share":1.0}},"endpoints":[{}]}}"#,
        endpoints.join(",")
    );
    Config::from_json(json.as_bytes()).expect("bench config")
}
