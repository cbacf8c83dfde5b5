//! kvroute-indexer: consumes vLLM KV-cache events over ZMQ, keeps the block
//! index re-hashed with kvroute's chained hash, scrapes pod load, and serves
//! the feed that kvroute's Envoy singletons poll.

pub mod auth;
pub mod config;
pub mod index;
pub mod lookup;
pub mod metrics;
pub mod scrape;
pub mod service;
pub mod vllm_wire;
