//! Remote lookup bodies: the proxy's answer decoder and the indexer's request
//! decoder must return, never panic; an answer the proxy accepts must rank
//! (a decision naming one of its candidates).
#![no_main]

use kvroute_core::config::Config;
use kvroute_core::hash::{BlockHash, Domain};
use kvroute_core::lookup::{decide, decode_answer, InFlight};
use kvroute_core::router::HashedPrompt;
use kvroute_indexer::lookup::parse_request;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = parse_request(data);
    let prompt = HashedPrompt {
        serving_model: "m".into(),
        domain: Domain::Tokens,
        hashes: (0..64).map(BlockHash::new).collect(),
        blocks: 64,
    };
    if let Ok(candidates) = decode_answer(data, prompt.hashes.len()) {
        let decision = decide(
            &Config::default(),
            &prompt,
            &candidates,
            &InFlight::default(),
            7,
        )
        .expect("a valid answer ranks");
        assert!(candidates.iter().any(|c| c.address == decision.pod));
        assert!(decision.matched_blocks <= prompt.hashes.len());
    }
});
