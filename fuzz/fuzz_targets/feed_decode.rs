//! Feed (version 3) and learned-batch decoding: never panic, and whatever
//! decodes must re-encode to exactly the input (the format has one encoding
//! per value). The feed client takes the same bytes as an answer and must
//! neither panic nor stop asking.
#![no_main]

use kvroute_core::feed::{
    decode, decode_learned, decode_message, encode, encode_learned, encode_message,
};
use kvroute_core::feed_client::{FeedClient, FeedResponse};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = decode_message(data) {
        assert_eq!(encode_message(&message), data);
    }
    // A complete update (pod list included) survives the trip between VMs.
    if let Ok(update) = decode(data) {
        let bytes = encode(&update);
        assert_eq!(decode(&bytes).map(|u| encode(&u)), Ok(bytes));
    }
    if let Ok(batch) = decode_learned(data) {
        assert_eq!(encode_learned(&batch), data);
    }
    let mut client = FeedClient::new(100);
    for now_ms in [0, 100_000] {
        assert!(client.on_tick(now_ms).is_some());
        let _ = client.on_response(now_ms, FeedResponse::Body(data));
        let _ = client.follow_up(now_ms);
        let _ = client.on_response(now_ms, FeedResponse::Body(data));
    }
});
