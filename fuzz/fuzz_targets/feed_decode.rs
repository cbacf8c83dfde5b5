//! Feed and learned-batch decoding: never panic, and whatever decodes must
//! re-encode to exactly the input (the format has one encoding per value).
#![no_main]

use kvroute_core::feed::{decode, decode_learned, encode, encode_learned};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(update) = decode(data) {
        assert_eq!(encode(&update), data);
    }
    if let Ok(batch) = decode_learned(data) {
        assert_eq!(encode_learned(&batch), data);
    }
});
