//! The filter's request path on arbitrary bodies: parsing, the tokenizer
//! call-out helpers, hashing and the tenant-salt rewrite never panic; a body
//! that parses is JSON and its prompt hashes to at most `max_blocks` blocks;
//! a rewritten body is JSON (a value whenever the input was) and parses with
//! the tenant's salt; a `/tokenize` answer (an object) reads as serde reads
//! it into `Vec<u32>`.
#![no_main]

use kvroute_core::config::Config;
use kvroute_core::request::{
    parse_request, parse_tokenize_response, tokenize_call_body, with_cache_salt,
};
use kvroute_core::router::hash_prompt;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let config = Config::default();
    if let Ok(request) = parse_request(data) {
        // The object walk accepts only JSON.
        assert!(serde_json::from_slice::<serde::de::IgnoredAny>(data).is_ok());
        let hashed = hash_prompt(&config, &request);
        assert!(hashed.hashes.len() <= config.max_blocks);
    }
    // Both rewrites copy fields verbatim: JSON text in, JSON text out; and a
    // body serde_json can hold as a value (numbers within f64, no lone
    // surrogate escapes) stays one.
    let input_is_value = serde_json::from_slice::<serde_json::Value>(data).is_ok();
    let check = |out: &[u8]| {
        assert!(serde_json::from_slice::<&serde_json::value::RawValue>(out).is_ok());
        assert!(!input_is_value || serde_json::from_slice::<serde_json::Value>(out).is_ok());
    };
    if let Some(call) = tokenize_call_body(data) {
        check(&call);
    }
    if let Ok(salted) = with_cache_salt(data, "kvroute-tenant-0") {
        check(&salted);
        if let Ok(request) = parse_request(&salted) {
            assert_eq!(request.cache_salt.as_deref(), Some("kvroute-tenant-0"));
        }
    }
    #[derive(serde::Deserialize)]
    struct Tokenized {
        tokens: Vec<u32>,
    }
    // serde also reads the struct from an array (`[[]]`); an answer is an object.
    let is_object = data.iter().find(|b| !b" \t\n\r".contains(b)) == Some(&b'{');
    let by_serde = serde_json::from_slice::<Tokenized>(data)
        .ok()
        .filter(|_| is_object)
        .map(|t| t.tokens);
    assert_eq!(parse_tokenize_response(data).ok(), by_serde);
    let _ = Config::from_json(data);
});
