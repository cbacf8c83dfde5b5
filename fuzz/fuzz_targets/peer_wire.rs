//! What the VMs of one proxy tell each other: queue message batches and
//! published load snapshots and the singleton's sum of them. Decoding never panics, and whatever decodes
//! re-encodes to exactly the input (one encoding per value).
#![no_main]

use kvroute_core::peer_load::{LoadSnapshot, LoadSum};
use kvroute_core::wire::{decode_batch, encode_batch};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(messages) = decode_batch(data) {
        assert_eq!(encode_batch(&messages).ok().as_deref(), Some(data));
    }
    if let Ok(snapshot) = LoadSnapshot::decode(data) {
        assert_eq!(snapshot.encode().ok().as_deref(), Some(data));
    }
    if let Ok(sum) = LoadSum::decode(data) {
        assert_eq!(sum.encode().ok().as_deref(), Some(data));
        let _ = sum.without("kvroute/load/kvroute/q/00", &[], sum.written_ms);
    }
});
