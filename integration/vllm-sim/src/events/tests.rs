use super::*;

fn golden(name: &str) -> Vec<u8> {
    kvroute_testdata::golden_frame(name).unwrap_or_else(|e| panic!("{e}"))
}

const TS: f64 = 1_700_000_000.5;
const H: [u128; 4] = [
    3262291359910021016,
    7142137847444424233,
    11309060389865205804,
    4393453693117533255,
];

#[test]
fn stored_from_root_matches_golden_bytes() {
    let ev = KvEvent::stored(H.to_vec(), None, (0..64).collect(), 16);
    assert_eq!(
        encode_batch(TS, &[ev], 0),
        golden("int_00_stored_4blocks_root.payload.msgpack")
    );
}

#[test]
fn stored_with_parent_matches_golden_bytes() {
    let g = golden("int_01_stored_2blocks_with_parent.payload.msgpack");
    let v = rmpv::decode::read_value(&mut &g[..]).unwrap();
    let ev = &v[1][0];
    let hs: Vec<u128> = ev["block_hashes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| u128::from(x.as_u64().unwrap()))
        .collect();
    let toks: Vec<u32> = ev["token_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect();
    let ours = KvEvent::stored(
        hs,
        ev["parent_block_hash"].as_u64().map(u128::from),
        toks,
        16,
    );
    assert_eq!(encode_batch(TS, &[ours], 0), g);
}

#[test]
fn removed_cleared_and_mixed_match_golden_bytes() {
    let removed = KvEvent::removed(vec![H[3]]);
    assert_eq!(
        encode_batch(TS, std::slice::from_ref(&removed), 0),
        golden("int_03_removed_gpu.payload.msgpack")
    );
    assert_eq!(
        encode_batch(TS, &[KvEvent::AllBlocksCleared], 0),
        golden("int_05_all_cleared.payload.msgpack")
    );
    let stored = KvEvent::stored(vec![H[2], H[3]], Some(H[1]), (32..64).collect(), 16);
    let mixed = encode_batch(TS, &[stored, removed, KvEvent::AllBlocksCleared], 0);
    assert_eq!(
        mixed,
        golden("int_06_mixed_stored_removed_cleared.payload.msgpack")
    );
}

#[test]
fn lora_and_extra_keys_have_vllm_field_order() {
    // Golden 02 also carries session_id, which we never set; every field we write
    // appears in the golden's order with its value (extra_keys included).
    let g = golden("int_02_stored_lora_extrakeys_session.payload.msgpack");
    let gv = rmpv::decode::read_value(&mut &g[..]).unwrap();
    let ours = encode_batch(
        TS,
        &[KvEvent::BlockStored {
            block_hashes: vec![H[0]],
            parent_block_hash: None,
            token_ids: (0..16).collect(),
            block_size: 16,
            lora_id: Some(7),
            lora_name: Some("my-lora".into()),
            medium: Medium::Gpu,
            extra_keys: Some(vec![Some(vec!["my-lora".into(), "salt-A".into()])]),
            group: Some(Group::PLAIN),
        }],
        0,
    );
    let ov = rmpv::decode::read_value(&mut &ours[..]).unwrap();
    let gm = gv[1][0].as_map().unwrap();
    let om = ov[1][0].as_map().unwrap();
    let golden_keys: Vec<&str> = gm.iter().map(|(k, _)| k.as_str().unwrap()).collect();
    let our_keys: Vec<&str> = om.iter().map(|(k, _)| k.as_str().unwrap()).collect();
    let filtered: Vec<&str> = golden_keys
        .iter()
        .copied()
        .filter(|k| our_keys.contains(k))
        .collect();
    assert_eq!(filtered, our_keys);
    assert_eq!(
        golden_keys.len(),
        our_keys.len() + 1,
        "only session_id is missing"
    );
    for (k, v) in om {
        let gvv = gm.iter().find(|(gk, _)| gk == k).map(|(_, v)| v).unwrap();
        assert_eq!(gvv, v, "field {k}");
    }
    // Header is map16 as msgspec writes it for BlockStored.
    assert_eq!(ours[11], 0xde);
}

#[test]
fn cpu_removal_without_group_matches_golden_bytes() {
    let ev = KvEvent::BlockRemoved {
        block_hashes: vec![H[0], H[1]],
        medium: Medium::Cpu,
        group: None,
    };
    assert_eq!(
        encode_batch(TS, &[ev], 0),
        golden("int_04_removed_cpu_no_group.payload.msgpack")
    );
}

#[test]
fn offload_placeholder_and_hybrid_group_shapes() {
    let batch = encode_batch(
        TS,
        &[
            KvEvent::cpu_placeholder(vec![H[0]]),
            KvEvent::BlockStored {
                block_hashes: vec![H[1]],
                parent_block_hash: Some(H[0]),
                token_ids: (16..32).collect(),
                block_size: 16,
                lora_id: None,
                lora_name: None,
                medium: Medium::Gpu,
                extra_keys: Some(vec![None]),
                group: Some(Group {
                    idx: 1,
                    kind: Some("sliding_window"),
                    sliding_window: Some(128),
                }),
            },
        ],
        0,
    );
    let v = rmpv::decode::read_value(&mut &batch[..]).unwrap();
    let keys = |e: &rmpv::Value| -> Vec<String> {
        e.as_map()
            .unwrap()
            .iter()
            .map(|(k, _)| k.as_str().unwrap().to_string())
            .collect()
    };
    let placeholder = &v[1][0];
    assert_eq!(
        keys(placeholder),
        [
            "type",
            "block_hashes",
            "parent_block_hash",
            "token_ids",
            "block_size",
            "lora_id",
            "medium",
            "lora_name"
        ]
    );
    assert_eq!(placeholder["token_ids"].as_array().unwrap().len(), 0);
    assert_eq!(placeholder["block_size"].as_u64(), Some(0));
    assert_eq!(placeholder["medium"].as_str(), Some("CPU"));
    let sliding = &v[1][1];
    assert_eq!(
        keys(sliding)[8..],
        [
            "extra_keys",
            "group_idx",
            "kv_cache_spec_kind",
            "kv_cache_spec_sliding_window"
        ]
    );
    assert!(sliding["extra_keys"][0].is_nil());
    assert_eq!(sliding["group_idx"].as_u64(), Some(1));
    assert_eq!(sliding["kv_cache_spec_sliding_window"].as_u64(), Some(128));
    // Every BlockStored keeps msgspec's map16 header, whatever its field count.
    assert_eq!(batch[11], 0xde);
}

#[test]
fn golden_multipart_frames_match_our_framing() {
    // multipart.bin = per frame u32 BE length + bytes: topic, seq, payload.
    let g = golden("int_03_removed_gpu.multipart.bin");
    let mut frames = Vec::new();
    let mut i = 0;
    while i + 4 <= g.len() {
        let n = u32::from_be_bytes([g[i], g[i + 1], g[i + 2], g[i + 3]]) as usize;
        frames.push(g[i + 4..i + 4 + n].to_vec());
        i += 4 + n;
    }
    assert_eq!(frames.len(), 3);
    assert_eq!(frames[0], b"");
    assert_eq!(frames[1], 3u64.to_be_bytes());
    assert_eq!(
        frames[2],
        encode_batch(TS, &[KvEvent::removed(vec![H[3]])], 0)
    );
}
