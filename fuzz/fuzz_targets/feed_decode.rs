//! Feed (version 3) and learned-batch decoding: never panic, and whatever
//! decodes must re-encode to exactly the input (the format has one encoding
//! per value). The feed client takes the same bytes as an answer and must
//! neither panic nor stop asking. An update that decodes is applied to a
//! cluster as the singleton applies it, as a snapshot and then as a delta,
//! and a prompt of the blocks it names is decided on the result: the pod
//! chosen always has an address a destination header can carry.
#![no_main]

use kvroute_core::address::is_pod_address;
use kvroute_core::config::Config;
use kvroute_core::feed::{
    decode, decode_learned, decode_message, encode, encode_learned, encode_message, FeedUpdate,
};
use kvroute_core::feed_client::{FeedClient, FeedResponse};
use kvroute_core::hash::{BlockHash, Domain};
use kvroute_core::router::{Cluster, HashedPrompt};
use libfuzzer_sys::fuzz_target;

/// Applies `update` to a cluster with the default index (one configured
/// pod, which the feed's pod list replaces) and decides on what it stored.
fn route_after(update: &FeedUpdate) {
    let config = Config::from_json(br#"{"endpoints":[{"address":"configured:1"}]}"#)
        .expect("the target's own config");
    let mut cluster = Cluster::default();
    cluster.set_configured(&config, 0);
    cluster.apply_feed(update, 10, 5);
    let delta = FeedUpdate {
        snapshot: false,
        ..update.clone()
    };
    cluster.apply_feed(&delta, 11, 5);
    // A prompt of the keys the update names, as token blocks of a model
    // its first pod serves (or of any model, when it names none).
    let hashes: Vec<BlockHash> = update
        .ops
        .iter()
        .flat_map(|op| op.hashes())
        .take(512)
        .map(|key| BlockHash::new(key.get()))
        .collect();
    let model = update
        .pods
        .first()
        .and_then(|pod| pod.models.first().cloned())
        .unwrap_or_default();
    let prompt = HashedPrompt {
        serving_model: model,
        domain: Domain::Tokens,
        blocks: hashes.len(),
        hashes,
    };
    if let Ok(decision) = cluster.decide(&config, &prompt, 12, 0) {
        assert!(decision.matched_blocks <= decision.total_blocks);
        // Whatever address the feed carried, only one a destination header
        // can hold is ever chosen.
        assert!(is_pod_address(&decision.pod), "{:?}", decision.pod);
    }
}

fuzz_target!(|data: &[u8]| {
    if let Ok(message) = decode_message(data) {
        assert_eq!(encode_message(&message), data);
    }
    // A complete update (pod list included) survives the trip between VMs.
    if let Ok(update) = decode(data) {
        let bytes = encode(&update);
        assert_eq!(decode(&bytes).map(|u| encode(&u)), Ok(bytes));
        route_after(&update);
    }
    if let Ok(batch) = decode_learned(data) {
        assert_eq!(encode_learned(&batch), data);
    }
    // The singleton's path: what the client accepts goes to the index's
    // writer, whose ops name pods of the list the client keeps.
    // (The writer's full-size index is made only for an accepted answer.)
    let mut client = FeedClient::new(100);
    let mut writer: Option<Cluster> = None;
    let mut answer = |client: &mut FeedClient, now_ms| {
        if let Ok(received) = client.on_response(now_ms, FeedResponse::Body(data)) {
            writer
                .get_or_insert_with(Cluster::default)
                .apply_feed(&received.update, 10, 0);
        }
    };
    for now_ms in [0, 100_000] {
        assert!(client.on_tick(now_ms).is_some());
        answer(&mut client, now_ms);
        let _ = client.follow_up(now_ms);
        answer(&mut client, now_ms);
    }
});
