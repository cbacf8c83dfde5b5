//! The filter's request path on arbitrary bodies: parsing, the tokenizer
//! call-out helpers and hashing never panic; a parsed prompt always hashes
//! to at most `max_blocks` blocks.
#![no_main]

use kvroute_core::config::Config;
use kvroute_core::request::{parse_request, parse_tokenize_response, tokenize_call_body};
use kvroute_core::router::hash_prompt;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let config = Config::default();
    if let Ok(request) = parse_request(data) {
        let hashed = hash_prompt(&config, &request);
        assert!(hashed.hashes.len() <= config.max_blocks);
    }
    if let Some(call) = tokenize_call_body(data) {
        assert!(serde_json::from_slice::<serde_json::Value>(&call).is_ok());
    }
    let _ = parse_tokenize_response(data);
    let _ = Config::from_json(data);
});
