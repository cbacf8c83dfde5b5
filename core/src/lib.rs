//! kvroute's pure logic, free of proxy-wasm calls so that it is unit-tested
//! natively and shared by the filter, the indexer and the simulator.

pub mod address;
pub mod admission;
pub mod budget;
pub mod codec;
pub mod config;
pub mod feed;
pub mod feed_client;
pub mod feed_forward;
pub mod hash;
pub mod header_map;
pub mod index;
pub mod line;
pub mod lookup;
pub mod outbox;
pub mod outcome;
pub mod peer_load;
pub mod recent;
pub mod registry;
pub mod request;
pub mod router;
pub mod score;
#[cfg(test)]
mod test_rng;
pub mod token_memo;
pub mod wire;
