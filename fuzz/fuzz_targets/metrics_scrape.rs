//! A pod's Prometheus `/metrics` text as the indexer scrapes it (UTF-8, up
//! to 16 MiB): any text parses to a load or to none, never a panic, and a
//! load keeps `kv_usage` a fraction.
#![no_main]

use kvroute_indexer::scrape::parse_vllm_metrics;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Some(load) = parse_vllm_metrics(text) {
        assert!((0.0..=1.0).contains(&load.kv_usage), "{load:?}");
    }
});
