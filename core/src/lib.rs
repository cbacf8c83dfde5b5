//! kvroute's pure logic, free of proxy-wasm calls so that it is unit-tested
//! natively and shared by the filter, the indexer and the simulator.

pub mod hash;
pub mod events;
pub mod feed;
