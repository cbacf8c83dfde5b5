//! The plugin configuration: any bytes are taken or refused, never a panic,
//! and a configuration that is taken routes: hashing a chat and a token
//! prompt per its settings, deciding among its endpoints, learning what was
//! routed there and deciding again must not panic either (a bound the
//! validation missed would show here as an overflow, a division by zero or
//! an allocation beyond the budget). Seeds (fuzz/seeds/config_parse): the
//! configurations shipped in envoy/*.yaml and istio/, and one that sets
//! every section.
#![no_main]

use kvroute_core::config::Config;
use kvroute_core::request::{Prompt, PromptRequest};
use kvroute_core::router::{hash_prompt, Cluster};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(config) = Config::from_json(data) else {
        return;
    };
    let mut cluster = Cluster::default();
    cluster.set_configured(&config, 0);
    // A model some endpoint serves, else the configured default, else any.
    let model = config
        .endpoints
        .iter()
        .find_map(|e| e.models.first().cloned())
        .or_else(|| config.default_model.clone())
        .unwrap_or_default();
    let prompts = [
        Prompt::Text(b"system: be brief. user: the same long question ".repeat(40)),
        Prompt::Tokens((0..2_000).collect()),
    ];
    for prompt in prompts {
        let request = PromptRequest::new(model.clone(), prompt);
        let hashed = hash_prompt(&config, &request);
        assert!(hashed.hashes.len() <= config.max_blocks);
        for now_s in [1, 2] {
            let Ok(decision) = cluster.decide(&config, &hashed, now_s, 7) else {
                break;
            };
            let _ = decision.explain();
            let blocks = u32::try_from(hashed.blocks).unwrap_or(u32::MAX);
            cluster.record_routed(&decision.pod, blocks, &hashed.hashes, now_s);
        }
    }
});
