use super::*;
use crate::budget::client_key;
use crate::feed::{self, BlockOp, FeedUpdate, PodInfo, Tier};
use crate::hash::{
    keyed_token_block_hashes, root_hash, salt_digest, token_block_hashes, BlockHash, Domain,
    IndexKey,
};
use crate::peer_load::PodLoad;
use crate::request::{parse_request, Prompt, PromptRequest};

fn config(endpoints: &str) -> Config {
    Config::from_json(format!(r#"{{"endpoints":{endpoints}}}"#).as_bytes()).unwrap()
}

fn four_pods() -> (Config, Cluster) {
    let c = config(
        r#"[{"address":"a:1"},{"address":"b:1"},{"address":"c:1"},{"address":"d:1","models":["other"]}]"#,
    );
    let mut cluster = Cluster::default();
    cluster.set_configured(&c, 0);
    (c, cluster)
}

/// The hashed prompt of `tokens` token ids 0, 1, … sent to `model`.
fn token_prompt(config: &Config, model: &str, tokens: u32) -> HashedPrompt {
    let request = PromptRequest::new(model, Prompt::Tokens((0..tokens).collect()));
    hash_prompt(config, &request)
}

/// A pod as the indexer feed announces it.
fn fed_pod(address: &str, capacity_blocks: u32) -> PodInfo {
    PodInfo {
        address: address.into(),
        models: vec![],
        capacity_blocks,
        ..PodInfo::default()
    }
}

/// A feed answer carrying only the pods' load (no block operations).
fn load_report(pods: Vec<PodInfo>) -> FeedUpdate {
    FeedUpdate {
        epoch: 1,
        cursor: 1,
        snapshot: false,
        pods,
        pods_unchanged: false,
        load: None,
        pods_version: 0,
        ops: vec![],
    }
}

fn chat(system: &str, question: &str) -> PromptRequest {
    let body = format!(
        r#"{{"model":"m","messages":[{{"role":"system","content":"{system}"}},{{"role":"user","content":"{question}"}}]}}"#
    );
    parse_request(body.as_bytes()).unwrap()
}

fn route(config: &Config, cluster: &mut Cluster, request: &PromptRequest, seed: u64) -> Decision {
    let hashed = hash_prompt(config, request);
    let d = cluster.decide(config, &hashed, 10, seed).unwrap();
    cluster.record_routed(&d.pod, hashed.hashes.len() as u32, &hashed.hashes, 10);
    d
}

/// vLLM shares cached blocks only under one `cache_salt`: the same
/// prompt under another salt must predict no hit, in either domain.
#[test]
fn salts_never_share_blocks() {
    let c = config(r#"[{"address":"a:1"}]"#);
    let salted = |salt: Option<&str>, prompt: Prompt| {
        let mut r = PromptRequest::new("m", prompt);
        r.cache_salt = salt.map(str::to_owned);
        hash_prompt(&c, &r).hashes
    };
    for prompt in [
        Prompt::Tokens((0..64).collect()),
        Prompt::Text(vec![b'x'; 256]),
    ] {
        let plain = salted(None, prompt.clone());
        let a = salted(Some("tenant-a"), prompt.clone());
        let b = salted(Some("tenant-b"), prompt.clone());
        assert_eq!(a.len(), 4);
        assert_eq!(a, salted(Some("tenant-a"), prompt.clone()));
        for (x, y) in [(&a, &b), (&a, &plain), (&b, &plain)] {
            assert!(x.iter().all(|h| !y.contains(h)));
        }
    }
    // The token domain agrees with the indexer's re-hash of vLLM's
    // block 0 extra keys ["tenant-a"].
    let root = root_hash(Domain::Tokens, "m", None);
    let tokens: Vec<u32> = (0..64).collect();
    assert_eq!(
        salted(Some("tenant-a"), Prompt::Tokens(tokens.clone())),
        keyed_token_block_hashes(root, &tokens, 16, 4096, &[salt_digest("tenant-a")])
    );
}

#[test]
fn requests_without_a_model_take_the_pods_one_model_or_the_default() {
    let mut cluster = Cluster::default();
    let one = config(r#"[{"address":"a:1","models":["m"]},{"address":"b:1","models":["m"]}]"#);
    cluster.set_configured(&one, 0);
    assert_eq!(cluster.implied_model(&one).as_deref(), Some("m"));
    for endpoints in [
        r#"[{"address":"a:1","models":["m"]},{"address":"b:1","models":["n"]}]"#,
        r#"[{"address":"a:1","models":["m"]},{"address":"b:1"}]"#,
        r#"[{"address":"a:1","models":["m","n"]}]"#,
        r#"[]"#,
    ] {
        let mut cluster = Cluster::default();
        let c = config(endpoints);
        cluster.set_configured(&c, 0);
        assert_eq!(cluster.implied_model(&c), None, "{endpoints}");
        let with_default = Config {
            default_model: Some("n".into()),
            ..c
        };
        assert_eq!(
            cluster.implied_model(&with_default).as_deref(),
            Some("n"),
            "{endpoints}"
        );
    }
}

#[test]
fn a_failed_pod_loses_its_learned_blocks_and_is_passed_over_until_the_cooldown_ends() {
    let (c, mut cluster) = four_pods();
    let request = chat(&"s".repeat(2000), "q");
    let first = route(&c, &mut cluster, &request, 1);
    cluster.record_finished(&first.pod, first.total_blocks as u32);
    cluster.record_failure(&first.pod, 10);
    for now in [10, 12] {
        let d = cluster
            .decide(&c, &hash_prompt(&c, &request), now, 1)
            .unwrap();
        assert_ne!(d.pod, first.pod, "passed over at second {now}");
        assert!(!d.fallbacks.contains(&first.pod));
        assert_eq!(d.candidates, 2, "{}", d.explain());
    }
    // Back after the cooldown (3 s by default), with nothing learned.
    let d = cluster
        .decide(&c, &hash_prompt(&c, &request), 13, 1)
        .unwrap();
    assert_eq!(d.candidates, 3);
    assert_eq!(d.matched_blocks, 0);
}

#[test]
fn when_every_pod_failed_they_are_all_candidates_again() {
    let (c, mut cluster) = four_pods();
    for pod in ["a:1", "b:1", "c:1"] {
        cluster.record_failure(pod, 10);
    }
    let d = cluster
        .decide(&c, &token_prompt(&c, "m", 64), 11, 1)
        .unwrap();
    assert_eq!(d.candidates, 3);
}

#[test]
fn a_refused_request_takes_back_only_the_blocks_it_taught() {
    let (mut c, mut cluster) = four_pods();
    // About learned blocks only: the two requests' load stays out of it.
    c.weights.running_per_block = 0.0;
    let system = "t".repeat(1280);
    let first = route(&c, &mut cluster, &chat(&system, "first"), 1);
    let attack = hash_prompt(&c, &chat(&system, &"x".repeat(6400)));
    let d = cluster.decide(&c, &attack, 10, 1).unwrap();
    assert_eq!(d.pod, first.pod);
    cluster.record_routed(&d.pod, 0, &attack.hashes, 10);
    cluster.forget_learned(&d.pod, &attack.hashes[d.matched_blocks..]);
    let again = cluster.decide(&c, &attack, 10, 1).unwrap();
    assert_eq!(again.pod, first.pod);
    assert_eq!(again.matched_blocks, d.matched_blocks);
}

#[test]
fn one_client_teaches_a_pod_at_most_its_budget_per_window() {
    let c = config(r#"[{"address":"a:1","capacity_blocks":1000}]"#);
    let mut cluster = Cluster::default();
    cluster.set_configured(&c, 0);
    // 1000 × the default client share 0.5, per ttl_seconds (600).
    let (a, b) = (client_key("a"), client_key("b"));
    assert_eq!(cluster.client_allowance("a:1", a, 300, 10), 300);
    assert_eq!(cluster.client_allowance("a:1", a, 300, 20), 200);
    assert_eq!(cluster.client_allowance("a:1", a, 300, 30), 0);
    assert_eq!(cluster.client_allowance("a:1", b, 300, 30), 300);
    assert_eq!(cluster.client_allowance("a:1", a, 300, 610), 300);
}

#[test]
fn one_request_claims_at_most_its_share_of_a_pods_table() {
    let c = config(r#"[{"address":"a:1","capacity_blocks":800}]"#);
    let mut cluster = Cluster::default();
    cluster.set_configured(&c, 0);
    let prompt = token_prompt(&c, "m", 16 * 400);
    cluster.record_routed("a:1", 0, &prompt.hashes, 10);
    let d = cluster.decide(&c, &prompt, 10, 1).unwrap();
    // 800 × the default share 0.125.
    assert_eq!(d.matched_blocks, 100);
}

#[test]
fn shared_prefix_sticks_and_finished_load_is_released() {
    let (c, mut cluster) = four_pods();
    let system = "You are a helpful assistant. ".repeat(40);
    let first = route(&c, &mut cluster, &chat(&system, "one"), 1);
    cluster.record_finished(&first.pod, first.total_blocks as u32);
    for seed in 2..10 {
        let d = route(
            &c,
            &mut cluster,
            &chat(&system, &format!("question {seed}")),
            seed,
        );
        assert_eq!(d.pod, first.pod);
        assert!(d.matched_blocks >= 18, "{}", d.explain());
        cluster.record_finished(&d.pod, d.total_blocks as u32);
    }
}

#[test]
fn prefill_work_is_released_at_first_bytes_and_the_request_at_the_end() {
    let (c, mut cluster) = four_pods();
    let request = chat(&"p".repeat(3000), "q");
    let d = route(&c, &mut cluster, &request, 1);
    let decide = |cluster: &Cluster| {
        cluster
            .decide(&c, &hash_prompt(&c, &request), 10, 1)
            .unwrap()
    };
    // In flight with its prefill pending: the pod's pending prefill equals the match it
    // offers, and the request counts as running there.
    assert_eq!(
        decide(&cluster).terms.total(),
        d.total_blocks as f64
            + c.weights.running
            + c.weights.running_per_block * d.total_blocks as f64
    );
    cluster.record_prefill_done(&d.pod, d.total_blocks as u32);
    let again = decide(&cluster);
    assert_eq!(
        (
            again.pod.as_str(),
            again.signals.inflight_blocks,
            again.signals.inflight_requests
        ),
        (d.pod.as_str(), 0, 1)
    );
    cluster.record_finished(&d.pod, 0);
    assert_eq!(decide(&cluster).signals.inflight_requests, 0);
}

#[test]
fn pods_not_serving_the_model_are_never_chosen() {
    let (c, mut cluster) = four_pods();
    for seed in 0..50 {
        let d = route(&c, &mut cluster, &chat(&format!("s{seed}"), "q"), seed);
        assert_ne!(d.pod, "d:1");
        assert!(!d.fallbacks.contains(&"d:1".to_string()));
        assert_eq!(d.candidates, 3);
    }
    let other = PromptRequest::new("nobody", Prompt::Text(b"x".to_vec()));
    let only_other = config(r#"[{"address":"d:1","models":["other"]}]"#);
    let mut cl = Cluster::default();
    cl.set_configured(&only_other, 0);
    assert_eq!(
        cl.decide(&only_other, &hash_prompt(&only_other, &other), 0, 0),
        Err(NoRoute::NoEndpointForModel)
    );
    assert_eq!(
        Cluster::default().decide(&c, &hash_prompt(&c, &other), 0, 0),
        Err(NoRoute::NoEndpoints)
    );
}

#[test]
fn hot_pod_sheds_new_prefixes() {
    let (c, mut cluster) = four_pods();
    let hot = route(&c, &mut cluster, &chat(&"x".repeat(4000), "q"), 1);
    for seed in 0..6 {
        let d = route(
            &c,
            &mut cluster,
            &chat(&format!("fresh {seed} {}", "y".repeat(500)), "q"),
            seed,
        );
        assert_ne!(
            d.pod, hot.pod,
            "a new prefix avoids the pod with {} blocks in flight",
            hot.total_blocks
        );
    }
}

#[test]
fn a_recent_learned_prefix_extends_a_shorter_match_only() {
    let cpu_half = LocalMatch {
        pod: 1,
        blocks: 4,
        credit: 2.0,
    };
    let mut matches = vec![cpu_half];
    LocalMatch::merge_learned(&mut matches, 1, 3);
    assert_eq!(matches, vec![cpu_half]);
    LocalMatch::merge_learned(&mut matches, 1, 6);
    LocalMatch::merge_learned(&mut matches, 2, 5);
    assert_eq!(
        matches,
        vec![
            LocalMatch {
                pod: 1,
                blocks: 6,
                credit: 4.0
            },
            LocalMatch {
                pod: 2,
                blocks: 5,
                credit: 5.0
            }
        ]
    );
}

#[test]
fn destination_and_explanation() {
    let (c, mut cluster) = four_pods();
    let d = route(&c, &mut cluster, &chat("s", "q"), 3);
    assert_eq!(d.fallbacks.len(), 2);
    assert_eq!(d.destination().split(',').count(), 3);
    assert!(d
        .explain()
        .starts_with(&format!("pod={}; matched=0/", d.pod)));
}

#[test]
fn adapters_scope_hashes_and_route_to_base_model_pods() {
    let c = Config::from_json(
        br#"{"adapters":{"sql-lora":"base"},"endpoints":[{"address":"a:1","models":["base"]}]}"#,
    )
    .unwrap();
    let lora = token_prompt(&c, "sql-lora", 64);
    let base = token_prompt(&c, "base", 64);
    assert_eq!(lora.serving_model, "base");
    assert_eq!(lora.hashes.len(), 4);
    assert_ne!(lora.hashes, base.hashes);
    assert_eq!(
        lora.hashes[0],
        token_block_hashes(
            root_hash(Domain::Tokens, "base", Some("sql-lora")),
            &(0..16).collect::<Vec<_>>(),
            16,
            1
        )[0]
    );
}

#[test]
fn feed_owns_pods_and_precise_entries_route() {
    let (c, mut cluster) = four_pods();
    let hashed = token_prompt(&c, "m", 160);
    let pod = |address: &str| fed_pod(address, 100);
    let update = FeedUpdate {
        epoch: 1,
        cursor: 1,
        snapshot: true,
        pods: vec![pod("x:1"), pod("y:1")],
        pods_unchanged: false,
        load: None,
        pods_version: 0,
        ops: vec![BlockOp::Stored {
            pod: 1,
            tier: Tier::Gpu,
            hashes: hashed.hashes[..8].iter().map(|h| h.index_key()).collect(),
        }],
    };
    cluster.apply_feed(&update, 100, 5);
    assert_eq!(cluster.len(), 2);
    cluster.set_configured(&c, 0);
    assert_eq!(
        cluster.len(),
        2,
        "configured endpoints do not override discovery"
    );
    let d = cluster.decide(&c, &hashed, 101, 0).unwrap();
    assert_eq!((d.pod.as_str(), d.matched_blocks), ("y:1", 8));
    // An update whose list did not change (the feed client's between lists):
    // the pods stay, and the word that the feed is alive keeps precise
    // entries trusted.
    let heartbeat = FeedUpdate {
        snapshot: false,
        pods: Vec::new(),
        pods_unchanged: true,
        ops: Vec::new(),
        ..update.clone()
    };
    cluster.apply_feed(&heartbeat, 104, 5);
    assert_eq!(cluster.len(), 2, "an unchanged list keeps the pods");
    let d = cluster.decide(&c, &hashed, 108, 0).unwrap();
    assert_eq!((d.pod.as_str(), d.matched_blocks), ("y:1", 8));
    let stale = cluster.decide(&c, &hashed, 200, 0).unwrap();
    assert_eq!(
        stale.matched_blocks, 0,
        "precise entries are ignored once the feed is stale"
    );
    // A delta that repeats no list: its ops name pods of the last one.
    let removal = FeedUpdate {
        snapshot: false,
        pods: Vec::new(),
        pods_unchanged: true,
        ops: vec![BlockOp::Removed {
            pod: 1,
            hashes: hashed.hashes[4..8].iter().map(|h| h.index_key()).collect(),
        }],
        ..update.clone()
    };
    cluster.apply_feed(&removal, 300, 5);
    assert_eq!(
        cluster.decide(&c, &hashed, 301, 0).unwrap().matched_blocks,
        4
    );
}

/// A repeated list's load lands by the pods' places; a list whose order the
/// pods cannot follow (a repeated address) by address. Refused addresses
/// take no place.
#[test]
fn reported_load_lands_on_its_pod_in_order_or_not() {
    let mut cluster = Cluster::load_only();
    let pod = |address: &str, waiting| PodInfo {
        waiting,
        ..fed_pod(address, 100)
    };
    let waiting = |cluster: &Cluster| -> Vec<(String, u32)> {
        let pods = cluster.pods.iter();
        pods.map(|p| (p.spec.address.clone(), p.reported.waiting))
            .collect()
    };
    let held = |list: &[(&str, u32)]| -> Vec<(String, u32)> {
        list.iter().map(|(a, w)| (a.to_string(), *w)).collect()
    };
    cluster.apply_feed(&load_report(vec![pod("a:1", 0), pod("b:1", 0)]), 0, 5);
    cluster.apply_feed(&load_report(vec![pod("a:1", 3), pod("b:1", 5)]), 1, 5);
    assert_eq!(waiting(&cluster), held(&[("a:1", 3), ("b:1", 5)]));
    let with_refused = vec![pod("a,b:1", 1), pod("a:1", 2), pod("b:1", 4)];
    cluster.apply_feed(&load_report(with_refused), 2, 5);
    assert_eq!(waiting(&cluster), held(&[("a:1", 2), ("b:1", 4)]));
    let repeated = vec![pod("b:1", 6), pod("b:1", 6), pod("a:1", 7)];
    cluster.apply_feed(&load_report(repeated), 3, 5);
    assert_eq!(waiting(&cluster), held(&[("b:1", 6), ("a:1", 7)]));
    cluster.apply_feed(&load_report(vec![pod("b:1", 8), pod("a:1", 9)]), 4, 5);
    assert_eq!(waiting(&cluster), held(&[("b:1", 8), ("a:1", 9)]));
    // The load alone lands by place on the list of its digest, the refused
    // pod's place included; load for another list is left for the next list.
    let listed = FeedUpdate {
        pods_version: 41,
        ..load_report(vec![pod("a,b:1", 0), pod("b:1", 8), pod("a:1", 9)])
    };
    cluster.apply_feed(&listed, 5, 5);
    let load_alone = |version: u64, waiting: &[u32]| FeedUpdate {
        pods: Vec::new(),
        pods_unchanged: true,
        load: Some(
            waiting
                .iter()
                .map(|&w| feed::PodLoad {
                    waiting: w,
                    ..feed::PodLoad::default()
                })
                .collect(),
        ),
        pods_version: version,
        ..listed.clone()
    };
    cluster.apply_feed(&load_alone(41, &[1, 10, 11]), 6, 5);
    assert_eq!(waiting(&cluster), held(&[("b:1", 10), ("a:1", 11)]));
    cluster.apply_feed(&load_alone(42, &[1, 12, 13]), 7, 5);
    cluster.apply_feed(&load_alone(41, &[12, 13]), 7, 5);
    cluster.apply_feed(&load_alone(0, &[1, 12, 13]), 7, 5);
    assert_eq!(waiting(&cluster), held(&[("b:1", 10), ("a:1", 11)]));
    // Out of order (a repeated address): by address, as the list was.
    let repeated = FeedUpdate {
        pods_version: 43,
        ..load_report(vec![pod("a:1", 0), pod("a:1", 0), pod("b:1", 0)])
    };
    cluster.apply_feed(&repeated, 8, 5);
    cluster.apply_feed(&load_alone(43, &[14, 15, 16]), 9, 5);
    assert_eq!(waiting(&cluster), held(&[("a:1", 15), ("b:1", 16)]));
}

/// The feed repeats its pod list every second: the same list again keeps
/// the pod table as it is (its version, so workers keep their positions),
/// and a changed one replaces it.
#[test]
fn the_same_pod_list_again_rebuilds_nothing() {
    let (c, mut cluster) = four_pods();
    let hashed = token_prompt(&c, "m", 64);
    let routed = cluster.decide(&c, &hashed, 0, 0).unwrap().pod;
    cluster.record_routed(&routed, 4, &[], 0);
    let specs: Vec<PodSpec> = cluster.pods.iter().map(|p| p.spec.clone()).collect();
    let version = cluster.pods_version();
    cluster.set_pods(specs.clone());
    assert_eq!(cluster.pods_version(), version);
    assert_eq!(cluster.len(), 4);
    let mut slower = specs;
    slower[0].speed = 0.5;
    cluster.set_pods(slower);
    assert_ne!(cluster.pods_version(), version);
    assert_eq!(cluster.pods[0].spec.speed, 0.5);
    let kept = cluster
        .pods
        .iter()
        .find(|p| p.spec.address == routed)
        .unwrap();
    assert_eq!(kept.load().requests, 1, "a pod that stays keeps its load");
}

/// A snapshot in pages by index-key range (what the indexer sends: every
/// pod's keys of one range per page, ranges ascending) leaves the index
/// as the same snapshot in one page does.
#[test]
fn a_snapshot_paged_by_key_range_applies_as_the_unpaged_one() {
    let pods: Vec<PodInfo> = (1..6).map(|p| fed_pod(&format!("p:{p}"), 400)).collect();
    // Per pod and tier, keys spread over the key space; pods 0–2 share some.
    let key = |i: u64| IndexKey::new(i.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let runs: Vec<(u32, Tier, Vec<IndexKey>)> = (0u32..5)
        .flat_map(|pod| {
            let from = if pod < 3 { 0 } else { 1000 * u64::from(pod) };
            [
                (Tier::Gpu, 0..60),
                (Tier::Cpu, 60..80),
                (Tier::Learned, 80..90),
            ]
            .into_iter()
            .map(move |(tier, range)| {
                let mut keys: Vec<IndexKey> = range.map(|i| key(from + i)).collect();
                keys.sort_unstable();
                (pod, tier, keys)
            })
        })
        .collect();
    let update = |snapshot: bool, ops: Vec<BlockOp>| FeedUpdate {
        epoch: 1,
        cursor: 1,
        snapshot,
        pods: pods.clone(),
        pods_unchanged: false,
        load: None,
        pods_version: 0,
        ops,
    };
    let stored = |(pod, tier, keys): &(u32, Tier, Vec<IndexKey>), range: &std::ops::Range<u64>| {
        let hashes: Vec<IndexKey> = keys
            .iter()
            .copied()
            .filter(|k| range.contains(&k.get()))
            .collect();
        (!hashes.is_empty()).then_some(BlockOp::Stored {
            pod: *pod,
            tier: *tier,
            hashes,
        })
    };
    let key_end = 1u64 << crate::hash::INDEX_KEY_BITS;
    let whole = update(
        true,
        runs.iter()
            .filter_map(|run| stored(run, &(0..key_end)))
            .collect(),
    );
    let ranges = 7;
    let width = key_end / ranges;
    let pages: Vec<FeedUpdate> = (0..ranges)
        .map(|i| {
            let range = i * width..if i + 1 == ranges {
                key_end
            } else {
                (i + 1) * width
            };
            update(
                i == 0,
                runs.iter().filter_map(|run| stored(run, &range)).collect(),
            )
        })
        .collect();
    assert!(
        pages.iter().all(|p| !p.ops.is_empty()),
        "every range holds keys"
    );
    let entries = |cluster: &Cluster| {
        let mut entries = cluster.index().unwrap().entries_oldest_first();
        entries.sort_unstable_by_key(|&(pod, key, _)| (pod, key));
        entries
    };
    let mut unpaged = Cluster::default();
    unpaged.apply_feed(&whole, 100, 5);
    let mut paged = Cluster::default();
    for page in &pages {
        paged.apply_feed(page, 100, 5);
    }
    assert_eq!(entries(&unpaged).len(), 5 * 90);
    assert_eq!(entries(&paged), entries(&unpaged));
}

#[test]
fn discovered_pods_of_unknown_capacity_get_the_configured_default() {
    let (c, mut cluster) = four_pods();
    let update = FeedUpdate {
        epoch: 1,
        cursor: 1,
        snapshot: true,
        pods: vec![fed_pod("x:1", 0)],
        pods_unchanged: false,
        load: None,
        pods_version: 0,
        ops: vec![BlockOp::Stored {
            pod: 0,
            tier: Tier::Gpu,
            hashes: (1..=50).map(IndexKey::new).collect(),
        }],
    };
    cluster.apply_feed(&update, 10, 5);
    let prompt = HashedPrompt {
        serving_model: "m".into(),
        domain: Domain::Tokens,
        hashes: (1..=50).map(BlockHash::new).collect(),
        blocks: 50,
    };
    let d = cluster.decide(&c, &prompt, 10, 0).unwrap();
    assert_eq!(d.signals.capacity_blocks, c.default_capacity_blocks);
    assert_eq!(d.matched_blocks, 50);
    // Only a prefix's hashes known (a token memo recall): the rest of the
    // prompt is still charged as uncached prefill.
    let longer = HashedPrompt {
        blocks: 80,
        ..prompt.clone()
    };
    let d = cluster.decide(&c, &longer, 10, 0).unwrap();
    assert_eq!((d.matched_blocks, d.total_blocks), (50, 80));
    assert_eq!(d.terms.prefill, c.weights.prefill * 30.0);
    // Capacity learned later: the index entries stay.
    let scraped = FeedUpdate {
        pods: vec![PodInfo {
            capacity_blocks: 1000,
            ..update.pods[0].clone()
        }],
        ops: vec![],
        snapshot: false,
        ..update
    };
    cluster.apply_feed(&scraped, 11, 5);
    let d = cluster.decide(&c, &prompt, 11, 0).unwrap();
    assert_eq!((d.signals.capacity_blocks, d.matched_blocks), (1000, 50));
    assert_eq!(cluster.index().map(|i| i.stats().blocks), Some(50));
}

/// A pod's reported running count is a scrape old: the requests this
/// proxy started or ended there since count until the next report.
#[test]
fn requests_routed_since_a_pods_report_count_as_running_there() {
    let c = config("[]");
    let mut cluster = Cluster::default();
    let report = |a_running: u32| {
        load_report(vec![
            PodInfo {
                running: a_running,
                ..fed_pod("a:1", 1000)
            },
            PodInfo {
                running: 12,
                ..fed_pod("b:1", 1000)
            },
        ])
    };
    cluster.apply_feed(&report(10), 10, 60);
    let prompt = hash_prompt(&c, &chat("nothing cached", "q"));
    let pick = |cluster: &Cluster| cluster.decide(&c, &prompt, 10, 1).unwrap().pod;
    assert_eq!(pick(&cluster), "a:1");
    for _ in 0..3 {
        cluster.record_routed("a:1", 0, &[], 10);
    }
    // 10 reported + 3 routed since: b (12) is less busy now.
    assert_eq!(pick(&cluster), "b:1");
    // The same load again is no new report: the 3 still count.
    cluster.apply_feed(&report(10), 10, 60);
    assert_eq!(pick(&cluster), "b:1");
    // A report that includes them, then 2 of them end.
    cluster.apply_feed(&report(13), 10, 60);
    assert_eq!(pick(&cluster), "b:1");
    cluster.record_finished("a:1", 0);
    cluster.record_finished("a:1", 0);
    assert_eq!(pick(&cluster), "a:1");
}

#[test]
fn blocks_routed_since_a_pods_report_count_in_its_kv_usage() {
    let mut c = config("[]");
    c.weights.kv_usage = 1.0;
    c.weights.running_per_block = 0.0;
    let mut cluster = Cluster::default();
    let report = |a_kv: f32| {
        load_report(vec![
            PodInfo {
                kv_usage: a_kv,
                ..fed_pod("a:1", 1000)
            },
            PodInfo {
                kv_usage: 0.55,
                ..fed_pod("b:1", 1000)
            },
        ])
    };
    cluster.apply_feed(&report(0.5), 10, 60);
    let prompt = hash_prompt(&c, &chat("nothing cached", "q"));
    let pick = |cluster: &Cluster| cluster.decide(&c, &prompt, 10, 1).unwrap().pod;
    assert_eq!(pick(&cluster), "a:1");
    // 100 uncached blocks sent to a since (prefilled, now decoding): 0.6.
    cluster.record_routed("a:1", 100, &[], 10);
    cluster.record_prefill_done("a:1", 100);
    assert_eq!(pick(&cluster), "b:1");
    // A new report that includes them leaves them out of the correction.
    cluster.apply_feed(&report(0.52), 10, 60);
    assert_eq!(pick(&cluster), "a:1");
    // The pod reports more; then the request ends: its blocks leave the
    // estimate before the next report.
    cluster.apply_feed(&report(0.62), 10, 60);
    assert_eq!(pick(&cluster), "b:1");
    cluster.record_released("a:1", 100);
    assert_eq!(pick(&cluster), "a:1");
}

#[test]
fn the_peers_load_counts_as_this_vms_and_each_reading_replaces_the_last() {
    let c = config(r#"[{"address":"a:1"},{"address":"b:1"}]"#);
    let mut cluster = Cluster::load_only();
    cluster.set_configured(&c, 0);
    let prompt = hash_prompt(&c, &chat("nothing cached", "q"));
    let pick = |cluster: &Cluster| cluster.decide(&c, &prompt, 10, 1).unwrap().pod;
    cluster.record_routed("a:1", 50, &[], 0);
    assert_eq!(pick(&cluster), "b:1");
    let own = PodLoad {
        requests: 1,
        pending_blocks: 50,
        active_blocks: 50,
    };
    assert_eq!(cluster.own_load(), vec![("a:1".to_string(), own)]);
    let busy = PodLoad {
        requests: 3,
        pending_blocks: 200,
        active_blocks: 200,
    };
    let peers = HashMap::from([("b:1".to_string(), busy), ("gone:1".to_string(), busy)]);
    cluster.set_peer_load(&peers);
    assert_eq!(pick(&cluster), "a:1", "the peers load b more");
    assert_eq!(
        cluster.own_load(),
        vec![("a:1".to_string(), own)],
        "the peers' load is not this VM's to publish"
    );
    cluster.set_peer_load(&HashMap::new());
    assert_eq!(pick(&cluster), "b:1", "the peers' requests on b ended");
    cluster.record_prefill_done("a:1", 50);
    cluster.record_finished("a:1", 0);
    cluster.record_released("a:1", 50);
    assert!(cluster.own_load().is_empty());
}

fn many_pods(n: usize) -> (Config, Cluster) {
    let endpoints: Vec<String> = (0..n)
        .map(|i| format!(r#"{{"address":"10.0.{}.{}:8000"}}"#, i / 256, i % 256))
        .collect();
    let c = config(&format!("[{}]", endpoints.join(",")));
    let mut cluster = Cluster::default();
    cluster.set_configured(&c, 0);
    (c, cluster)
}

#[test]
fn a_decision_visits_the_matched_pods_and_the_least_loaded_only() {
    let (c, mut cluster) = many_pods(300);
    let request = chat(&"k".repeat(3000), "q");
    let hashed = hash_prompt(&c, &request);
    cluster.record_routed("10.0.0.7:8000", 0, &hashed.hashes, 10);
    cluster.record_routed("10.0.0.9:8000", 0, &hashed.hashes[..5], 10);
    let d = cluster.decide(&c, &hashed, 10, 1).unwrap();
    assert_eq!(
        (d.pod.as_str(), d.matched_blocks),
        ("10.0.0.7:8000", hashed.hashes.len())
    );
    assert_eq!(d.candidates, 2 + LEAST_LOADED_CANDIDATES, "{}", d.explain());
    assert!(d.lookup.probes <= 2 + 2 * 6, "{:?}", d.lookup);
    // A loaded pod leaves the least-loaded walk: the idle ones are considered.
    let busy = "10.0.0.9:8000";
    cluster.record_routed(busy, 500, &[], 10);
    let fresh = hash_prompt(&c, &chat("other", "q"));
    let d = cluster.decide(&c, &fresh, 10, 1).unwrap();
    assert_eq!(d.candidates, LEAST_LOADED_CANDIDATES);
    assert_ne!(d.pod, busy);
}

#[test]
fn idle_pods_take_new_prefixes_in_turn() {
    let (c, mut cluster) = many_pods(200);
    let mut chosen = std::collections::BTreeSet::new();
    for seed in 0..100 {
        let d = route(
            &c,
            &mut cluster,
            &chat(&format!("prefix {seed}"), "q"),
            seed,
        );
        cluster.record_finished(&d.pod, d.total_blocks as u32);
        chosen.insert(d.pod);
    }
    assert!(
        chosen.len() >= 60,
        "{} pods took 100 new prefixes",
        chosen.len()
    );
}

#[test]
fn reconfiguring_keeps_tables_of_pods_that_stay() {
    let (c, mut cluster) = four_pods();
    let request = chat(&"w".repeat(2000), "q");
    let first = route(&c, &mut cluster, &request, 1);
    cluster.record_finished(&first.pod, first.total_blocks as u32);
    let mut endpoints: Vec<String> = ["a:1", "b:1", "c:1", "e:1"]
        .iter()
        .map(|a| format!(r#"{{"address":"{a}"}}"#))
        .collect();
    endpoints.sort();
    let c2 = config(&format!("[{}]", endpoints.join(",")));
    cluster.set_configured(&c2, 0);
    assert_eq!(cluster.len(), 4);
    let d = cluster
        .decide(&c2, &hash_prompt(&c2, &request), 10, 5)
        .unwrap();
    assert_eq!(
        (d.pod.clone(), d.matched_blocks),
        (first.pod, first.total_blocks)
    );
}

#[test]
fn speeds_survive_discovery_and_decode_pressure_is_released_at_the_end() {
    let c = config(r#"[{"address":"a:1","speed":0.5},{"address":"b:1"}]"#);
    let mut cluster = Cluster::default();
    cluster.set_configured(&c, 0);
    let update = FeedUpdate {
        epoch: 1,
        cursor: 1,
        snapshot: true,
        pods: vec![
            // The configured speed wins over the indexer's.
            PodInfo {
                speed: 4.0,
                ..fed_pod("a:1", 100)
            },
            fed_pod("b:1", 100),
            fed_pod("n:1", 100),
            PodInfo {
                speed: 0.25,
                ..fed_pod("s:1", 100)
            },
        ],
        pods_unchanged: false,
        load: None,
        pods_version: 0,
        ops: vec![],
    };
    cluster.apply_feed(&update, 10, 5);
    let prompt = token_prompt(&c, "m", 64);
    let speeds: Vec<f64> = ["a:1", "b:1", "n:1", "s:1"]
        .iter()
        .map(|a| {
            let i = cluster.by_address[*a];
            cluster.pods[i].spec.speed
        })
        .collect();
    assert_eq!(speeds, vec![0.5, 1.0, 1.0, 0.25]);
    // The proxy's estimate of active KV lives from routing to the end,
    // past the prefill.
    let mut approx = Cluster::default();
    approx.set_configured(&c, 0);
    approx.record_routed("b:1", 4, &prompt.hashes, 10);
    approx.record_prefill_done("b:1", 4);
    let signals = |cl: &Cluster| {
        let i = cl.by_address["b:1"];
        (
            cl.pods[i].load().pending_blocks,
            cl.pods[i].load().active_blocks,
        )
    };
    assert_eq!(signals(&approx), (0, 4));
    approx.record_finished("b:1", 0);
    approx.record_released("b:1", 4);
    assert_eq!(signals(&approx), (0, 0));
}

#[test]
fn saturation_is_judged_only_with_priority_configured() {
    let (c, mut cluster) = four_pods();
    let prompt = token_prompt(&c, "m", 64);
    for pod in ["a:1", "b:1", "c:1"] {
        for _ in 0..2 {
            cluster.record_routed(pod, 1, &[], 10);
        }
    }
    assert_eq!(cluster.decide(&c, &prompt, 10, 1).unwrap().saturation, None);
    let with = Config::from_json(
        br#"{"priority":{"saturation":{"max_inflight_requests":2}},
            "endpoints":[{"address":"a:1"},{"address":"b:1"},{"address":"c:1"},{"address":"d:1","models":["other"]}]}"#,
    )
    .unwrap();
    let d = cluster.decide(&with, &prompt, 10, 1).unwrap();
    assert_eq!(d.saturation, Some([0, 0, 3, 0]), "{}", d.explain());
    cluster.record_finished("c:1", 1);
    assert_eq!(
        cluster.decide(&with, &prompt, 10, 1).unwrap().saturation,
        None
    );
}

#[test]
fn feed_pods_no_header_can_name_are_skipped() {
    let (c, mut cluster) = four_pods();
    let hashed = token_prompt(&c, "m", 160);
    let keys = |range: std::ops::Range<usize>| -> Vec<_> {
        hashed.hashes[range].iter().map(|h| h.index_key()).collect()
    };
    let update = FeedUpdate {
        epoch: 1,
        cursor: 1,
        snapshot: true,
        pods: vec![
            fed_pod("x:1", 100),
            fed_pod("x:1,y:1", 100),
            fed_pod("y:1", 100),
            fed_pod("z:1\r\nx-evil: 1", 100),
        ],
        pods_unchanged: false,
        load: None,
        pods_version: 0,
        ops: vec![
            BlockOp::Stored {
                pod: 1,
                tier: Tier::Gpu,
                hashes: keys(0..8),
            },
            BlockOp::Stored {
                pod: 2,
                tier: Tier::Gpu,
                hashes: keys(0..4),
            },
            BlockOp::Stored {
                pod: 3,
                tier: Tier::Gpu,
                hashes: keys(0..10),
            },
        ],
    };
    assert_eq!(
        update.pods.iter().filter(|p| !p.has_pod_address()).count(),
        2
    );
    cluster.apply_feed(&update, 100, 5);
    assert_eq!(cluster.len(), 2, "only x:1 and y:1 are taken");
    let d = cluster.decide(&c, &hashed, 101, 0).unwrap();
    assert_eq!(
        (d.pod.as_str(), d.matched_blocks),
        ("y:1", 4),
        "the skipped pods' blocks were dropped, not given to another pod"
    );
}
