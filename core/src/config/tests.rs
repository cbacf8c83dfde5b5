use super::*;

fn err(json: &str) -> ConfigError {
    Config::from_json(json.as_bytes()).unwrap_err()
}

#[test]
fn empty_config_means_defaults() {
    assert_eq!(Config::from_json(b"").unwrap(), Config::default());
    assert_eq!(Config::from_json(b"{}").unwrap(), Config::default());
}

#[test]
fn full_config_parses() {
    let c = Config::from_json(
        br#"{"weights":{"prefill":2,"decode":0.5},"endpoints":[{"address":"10.0.0.1:8000","capacity_blocks":19208,"models":["m"]}],
            "indexer":{"cluster":"idx"},"tokenizer":{"cluster":"tok","timeout_ms":20},"adapters":{"sql-lora":"m"}}"#,
    )
    .unwrap();
    assert_eq!(c.weights.prefill, 2.0);
    assert_eq!(c.weights.queue, 0.0);
    assert_eq!(c.capacity_of(&c.endpoints[0]), 19208);
    let indexer = c.indexer.unwrap();
    assert_eq!(indexer.poll_ms, 100);
    assert!(indexer.share_learned);
    assert_eq!(indexer.token_env, None);
    let tokenizer = c.tokenizer.unwrap();
    assert_eq!(tokenizer.path, "/tokenize");
    assert_eq!(tokenizer.memo_bytes, 8 << 20);
}

#[test]
fn errors_name_the_field() {
    assert_eq!(err(r#"{"wieghts":{}}"#).field, "wieghts");
    assert_eq!(err(r#"{"weights":{"prefil":1}}"#).field, "prefil");
    assert_eq!(err(r#"{"weights":{"decode":-1}}"#).field, "weights.decode");
    assert_eq!(err(r#"{"block_size":0}"#).field, "block_size");
    assert_eq!(
        err(r#"{"tokenizer":{"cluster":"t","memo_bytes":2147483648}}"#).field,
        "tokenizer.memo_bytes"
    );
    assert_eq!(
        err(r#"{"endpoints":[{"address":"nope"}]}"#).field,
        "endpoints[0].address"
    );
    // A comma would split the address in the destination header's pod list.
    assert_eq!(
        err(r#"{"endpoints":[{"address":"10.0.0.1,10.0.0.2:8000"}]}"#).field,
        "endpoints[0].address"
    );
    assert_eq!(
        err(r#"{"endpoints":[{"address":"a:1"},{"address":"a:1"}]}"#).field,
        "endpoints[1].address"
    );
    assert_eq!(
        err(r#"{"endpoints":[{"capacity_blocks":3}]}"#).field,
        "address"
    );
    assert_eq!(
        err(r#"{"indexer":{"cluster":""}}"#).field,
        "indexer.cluster"
    );
    for bad in ["", "1TOKEN", "KVROUTE-TOKEN", "A B"] {
        let json = format!(r#"{{"indexer":{{"cluster":"i","token_env":"{bad}"}}}}"#);
        assert_eq!(err(&json).field, "indexer.token_env", "{bad:?}");
    }
    let ok = Config::from_json(
        br#"{"indexer":{"cluster":"i","token_env":"KVROUTE_INDEXER_TOKEN","share_learned":false}}"#,
    )
    .unwrap()
    .indexer
    .unwrap();
    assert_eq!(ok.token_env.as_deref(), Some("KVROUTE_INDEXER_TOKEN"));
    assert!(!ok.share_learned);
    assert_eq!(
        err(r#"{"destination_header":"X-Bad"}"#).field,
        "destination_header"
    );
    assert_eq!(err(r#"{"paths":["v1"]}"#).field, "paths[0]");
    assert_eq!(err(r#"{"served_header":"Served"}"#).field, "served_header");
    assert_eq!(
        err(r#"{"served_header":"","served_header_from_route":true}"#).field,
        "served_header_from_route"
    );
    assert_eq!(
        err(r#"{"failure_cooldown_seconds":7200}"#).field,
        "failure_cooldown_seconds"
    );
    for budget in [0, (1 << 20) - 1, (768 << 20) + 1] {
        assert_eq!(
            err(&format!(r#"{{"index":{{"budget_bytes":{budget}}}}}"#)).field,
            "index.budget_bytes"
        );
    }
    assert_eq!(err(r#"{"index":{"flush_ms":5}}"#).field, "index.flush_ms");
    assert_eq!(
        err(r#"{"index":{"flush_ms":5000}}"#).field,
        "index.flush_ms"
    );
    assert_eq!(
        err(r#"{"index":{"max_learn_share":0}}"#).field,
        "index.max_learn_share"
    );
    assert_eq!(
        err(r#"{"index":{"max_client_share":1.5}}"#).field,
        "index.max_client_share"
    );
    assert_eq!(err(r#"{"default_model":""}"#).field, "default_model");
    assert_eq!(
        err(r#"{"endpoints":[{"address":"a:1","speed":0}]}"#).field,
        "endpoints[0].speed"
    );
    assert_eq!(
        err(r#"{"priority":{"default_class":"gold"}}"#).field,
        "priority.default_class"
    );
    assert_eq!(
        err(r#"{"priority":{"header":"X-Priority"}}"#).field,
        "priority.header"
    );
    assert_eq!(
        err(r#"{"priority":{"saturation":{"max_kv_usage":1.5}}}"#).field,
        "priority.saturation.max_kv_usage"
    );
    assert_eq!(
        err(r#"{"priority":{"retry_after_seconds":0}}"#).field,
        "priority.retry_after_seconds"
    );
    assert!(err(r#"{"priority":{"classes":{"x":"maybe"}}}"#)
        .to_string()
        .contains("unknown variant `maybe`"));
    assert_eq!(
        err(r#"{"tenant_header":"X-Tenant"}"#).field,
        "tenant_header"
    );
    assert!(err(r#"{"max_blocks":"many"}"#)
        .to_string()
        .contains("invalid type"));
    assert!(err("not json")
        .to_string()
        .starts_with("invalid kvroute config"));
}

#[test]
fn priority_classes_with_a_default() {
    let c = Config::from_json(
        br#"{"priority":{"default_class":"batch","classes":{"interactive":"critical","batch":"sheddable"}},
            "endpoints":[{"address":"a:1","speed":0.5},{"address":"b:1"}]}"#,
    )
    .unwrap();
    let p = c.priority.clone().unwrap();
    assert_eq!(p.header, "x-kvroute-priority");
    assert_eq!(p.admission_of(Some("interactive")), Admission::Critical);
    for value in [None, Some("batch"), Some("unknown"), Some("")] {
        assert_eq!(p.admission_of(value), Admission::Sheddable, "{value:?}");
    }
    assert_eq!(
        (c.speed_of(&c.endpoints[0]), c.speed_of(&c.endpoints[1])),
        (0.5, 1.0)
    );
    // Turned on without classes: only requests marked sheddable are shed.
    let plain = Config::from_json(br#"{"priority":{}}"#)
        .unwrap()
        .priority
        .unwrap();
    assert_eq!(plain.admission_of(None), Admission::Critical);
    assert_eq!(plain.admission_of(Some("sheddable")), Admission::Sheddable);
}

#[test]
fn remote_index_defaults_and_errors_name_the_field() {
    let remote = Config::from_json(br#"{"remote_index":{"cluster":"idx"}}"#)
        .unwrap()
        .remote_index
        .unwrap();
    assert_eq!(
        (
            remote.authority.as_str(),
            remote.path.as_str(),
            remote.timeout_ms,
            remote.min_blocks
        ),
        ("kvroute-indexer", "/v1/lookup", 50, 4)
    );
    for (json, field) in [
        (r#"{"remote_index":{}}"#, "cluster"),
        (r#"{"remote_index":{"cluster":""}}"#, "remote_index.cluster"),
        (
            r#"{"remote_index":{"cluster":"i","timeout_ms":0}}"#,
            "remote_index.timeout_ms",
        ),
        (
            r#"{"remote_index":{"cluster":"i","path":"v1/lookup"}}"#,
            "remote_index.path",
        ),
        (
            r#"{"remote_index":{"cluster":"i","min_blocks":0}}"#,
            "remote_index.min_blocks",
        ),
        (
            r#"{"max_blocks":8,"remote_index":{"cluster":"i","min_blocks":9}}"#,
            "remote_index.min_blocks",
        ),
        (r#"{"remote_index":{"cluster":"i","timeout":5}}"#, "timeout"),
    ] {
        assert_eq!(err(json).field, field, "{json}");
    }
}

#[test]
fn path_matching_ignores_query() {
    let c = Config::default();
    assert!(c.routes_path("/v1/completions?x=1"));
    assert!(!c.routes_path("/v1/embeddings"));
}
