//! What the VMs of one proxy tell each other: queue message batches and
//! published load snapshots. Decoding never panics, and whatever decodes
//! re-encodes to exactly the input (one encoding per value).
#![no_main]

use kvroute_core::peer_load::LoadSnapshot;
use kvroute_core::wire::{decode_batch, encode_batch};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(messages) = decode_batch(data) {
        assert_eq!(encode_batch(&messages).ok().as_deref(), Some(data));
    }
    if let Ok(snapshot) = LoadSnapshot::decode(data) {
        assert_eq!(snapshot.encode().ok().as_deref(), Some(data));
    }
});
