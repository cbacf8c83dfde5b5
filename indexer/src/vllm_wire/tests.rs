//! The codec against hand-built frames of both encodings, the golden vLLM
//! captures, and mutated inputs.

// Test code may unwrap and panic.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use super::*;

#[test]
fn seq_frames() {
    assert_eq!(decode_seq(&[0, 0, 0, 0, 0, 0, 1, 2]), Ok(258));
    assert_eq!(decode_seq(&[0xff; 8]), Ok(u64::MAX));
    assert_eq!(decode_seq(&[1, 2, 3]), Err(EventError::BadSeqFrame(3)));
}

#[test]
fn topics() {
    assert_eq!(
        parse_topic("kv@10.1.2.3:8000@Qwen/Qwen3-32B"),
        Some(TopicIdentity {
            address: "10.1.2.3:8000",
            model: "Qwen/Qwen3-32B"
        })
    );
    assert_eq!(
        parse_topic("kv@[::1]:8000@m@x"),
        Some(TopicIdentity {
            address: "[::1]:8000",
            model: "m@x"
        })
    );
    assert_eq!(parse_topic("kv@pod-a:80").map(|t| t.model), Some(""));
    assert_eq!(parse_topic(""), None);
    assert_eq!(parse_topic("kv@dp0"), None);
    assert_eq!(parse_topic("kv@host:99999@m"), None);
    assert_eq!(parse_topic("kv@:80@m"), None);
    assert_eq!(parse_topic("xx@1.2.3.4:80@m"), None);
    // Addresses the filters' destination header could not carry.
    assert_eq!(parse_topic("kv@a,b:80@m"), None);
    assert_eq!(parse_topic("kv@a b:80@m"), None);
    assert_eq!(parse_topic("kv@a:0@m"), None);
    assert_eq!(parse_topic("kv@a\r\nx:80@m"), None);
}

/// msgpack for hand-built frames (shapes the encoder does not write), on rmp.
#[derive(Default)]
struct W(Vec<u8>);

impl W {
    fn arr(&mut self, n: u32) -> &mut Self {
        rmp::encode::write_array_len(&mut self.0, n).unwrap();
        self
    }
    fn map(&mut self, n: u32) -> &mut Self {
        rmp::encode::write_map_len(&mut self.0, n).unwrap();
        self
    }
    fn s(&mut self, v: &str) -> &mut Self {
        rmp::encode::write_str(&mut self.0, v).unwrap();
        self
    }
    fn u(&mut self, v: u64) -> &mut Self {
        rmp::encode::write_u64(&mut self.0, v).unwrap();
        self
    }
    fn i(&mut self, v: i64) -> &mut Self {
        rmp::encode::write_i64(&mut self.0, v).unwrap();
        self
    }
    fn nil(&mut self) -> &mut Self {
        rmp::encode::write_nil(&mut self.0).unwrap();
        self
    }
    fn f64(&mut self, v: f64) -> &mut Self {
        rmp::encode::write_f64(&mut self.0, v).unwrap();
        self
    }
    fn bin(&mut self, v: &[u8]) -> &mut Self {
        rmp::encode::write_bin(&mut self.0, v).unwrap();
        self
    }
    fn tokens(&mut self, t: &[u32]) -> &mut Self {
        self.arr(t.len() as u32);
        for &x in t {
            rmp::encode::write_u32(&mut self.0, x).unwrap();
        }
        self
    }
}

fn tokens(n: u32) -> Vec<u32> {
    (0..n).map(|i| 100_000 + i).collect()
}

fn decode(bytes: &[u8]) -> EventBatch {
    let d = decode_batch(bytes).expect("decodes");
    assert_eq!(d.skipped, vec![], "nothing skipped");
    d.batch
}

#[test]
fn garbage_is_an_error() {
    assert_eq!(decode_batch(&[]), Err(EventError::Truncated));
    assert!(matches!(
        decode_batch(&[0x91, 0xc1]),
        Err(EventError::Invalid(_))
    ));
    assert!(matches!(
        decode_batch(&[0x92, 0xc1, 0x90]),
        Err(EventError::Malformed(_))
    ));
    assert_eq!(
        decode_batch(&[0x92, 0xcb, 0x00]),
        Err(EventError::Truncated)
    );
    // Huge counts are refused before allocating.
    assert_eq!(
        decode_batch(&[0x92, 0x00, 0xdd, 0xff, 0xff, 0xff, 0xff]),
        Err(EventError::Truncated)
    );
    let mut w = W::default();
    w.arr(2).f64(0.0).arr(0);
    w.0.push(0x01);
    assert_eq!(decode_batch(&w.0), Err(EventError::TrailingBytes(1)));
    // Deep nesting in an unknown field: the batch is not followed.
    let mut deep = W::default();
    deep.arr(2)
        .f64(0.0)
        .arr(1)
        .map(2)
        .s("type")
        .s("AllBlocksCleared")
        .s("x");
    deep.0.extend(std::iter::repeat_n(0x91, 100));
    deep.0.push(0x00);
    assert_eq!(decode_batch(&deep.0), Err(EventError::TooDeep));
}

#[test]
fn array_encoding_full_form() {
    // [ts, [stored, removed, cleared], rank] with every positional field.
    let mut w = W::default();
    w.arr(3).f64(1.5).arr(3);
    w.arr(12).s("BlockStored").arr(2).u(u64::MAX).u(7).u(9);
    w.tokens(&tokens(32)).u(16).u(3).s("CPU").s("my-lora");
    w.arr(2).arr(2).s("my-lora").s("salt").nil();
    w.u(1).s("full_attention").nil();
    w.arr(4).s("BlockRemoved").arr(1).i(-2).s("GPU").u(0);
    w.arr(1).s("AllBlocksCleared");
    w.u(2);
    let b = decode(&w.0);
    assert_eq!(b.ts, 1.5);
    assert_eq!(b.data_parallel_rank, Some(2));
    assert_eq!(
        b.events,
        vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![u64::MAX, 7],
                parent_block_hash: Some(9),
                token_ids: tokens(32),
                block_size: 16,
                lora_id: Some(3),
                medium: Some(Medium::Cpu),
                lora_name: Some("my-lora".into()),
                extra_keys: Some(vec![
                    Some(vec![
                        ExtraKey::Str("my-lora".into()),
                        ExtraKey::Str("salt".into())
                    ]),
                    None
                ]),
                group_idx: Some(1),
                kv_cache_spec_kind: Some("full_attention".into()),
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![(-2i64) as u64],
                medium: Some(Medium::Gpu),
                group_idx: Some(0),
            }),
            KvEvent::AllBlocksCleared,
        ]
    );
}

#[test]
fn array_encoding_oldest_form() {
    // [ts, events] with a 6-element BlockStored (i64 hash) and a 2-element
    // BlockRemoved with a bin hash.
    let mut w = W::default();
    w.arr(2).f64(2.0).arr(2);
    w.arr(6).s("BlockStored").arr(1).i(-5).nil();
    w.tokens(&tokens(16)).u(16).nil();
    w.arr(2).s("BlockRemoved").arr(1).bin(&[0xaa; 32]);
    let b = decode(&w.0);
    assert_eq!(b.data_parallel_rank, None);
    assert_eq!(
        b.events,
        vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![(-5i64) as u64],
                token_ids: tokens(16),
                block_size: 16,
                ..BlockStored::default()
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![0xaaaa_aaaa_aaaa_aaaa],
                ..BlockRemoved::default()
            }),
        ]
    );
}

#[test]
fn unknown_fields_and_types_are_tolerated() {
    let mut w = W::default();
    w.arr(4).f64(0.0).arr(3);
    // Map event with an unknown nested field before the type and one after.
    w.map(4).s("future").map(1).s("k").arr(2).nil().f64(1.0);
    w.s("type").s("BlockRemoved").s("block_hashes").arr(1).u(5);
    w.s("blob").bin(&[1, 2, 3]);
    // Array event with extra trailing elements.
    w.arr(6).s("BlockRemoved").arr(0).nil().nil().s("x").map(0);
    // Unknown event type.
    w.arr(2).s("BlockMoved").u(1);
    w.u(0).s("extra batch element");
    let b = decode(&w.0);
    assert_eq!(
        b.events,
        vec![
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: vec![5],
                ..BlockRemoved::default()
            }),
            KvEvent::BlockRemoved(BlockRemoved::default()),
            KvEvent::Unknown {
                tag: "BlockMoved".into()
            },
        ]
    );
}

/// One bad event is skipped with its reason; its neighbours survive.
#[test]
fn a_bad_event_never_poisons_its_batch() {
    let good = |w: &mut W| {
        w.map(2)
            .s("type")
            .s("BlockRemoved")
            .s("block_hashes")
            .arr(1)
            .u(1);
    };
    let mut w = W::default();
    w.arr(3).f64(0.0).arr(8);
    good(&mut w);
    w.map(1).s("block_hashes").arr(0); // no type
    w.map(2).s("type").s("BlockStored").s("block_hashes").arr(0); // no tokens
    w.arr(5).s("BlockStored").arr(0).nil().arr(1).i(-1).u(16); // negative token
    w.u(3); // not an event
    w.arr(2).s("BlockRemoved").arr(1).nil(); // nil hash
    w.arr(2).s("BlockRemoved").bin(&[1; 32]); // a digest where the list belongs
    good(&mut w);
    w.u(4);
    let d = decode_batch(&w.0).expect("the batch decodes");
    let removed = KvEvent::BlockRemoved(BlockRemoved {
        block_hashes: vec![1],
        ..BlockRemoved::default()
    });
    assert_eq!(d.batch.events, vec![removed.clone(), removed]);
    assert_eq!(d.batch.data_parallel_rank, Some(4));
    let kinds: Vec<&str> = d.skipped.iter().map(EventError::kind).collect();
    assert_eq!(kinds.len(), 6, "{:?}", d.skipped);
    assert!(kinds.iter().all(|k| *k == "invalid" || *k == "malformed"));
    assert!(
        d.skipped[0].to_string().contains("type"),
        "{}",
        d.skipped[0]
    );
    assert!(
        d.skipped[1].to_string().contains("missing field"),
        "{}",
        d.skipped[1]
    );
}

/// vLLM's CPU offloading publishes placeholders: no tokens, block size 0.
#[test]
fn offload_placeholders_decode() {
    let placeholder = BlockStored {
        block_hashes: vec![11, 12],
        medium: Some(Medium::Cpu),
        ..BlockStored::default()
    };
    assert!(placeholder.is_placeholder());
    let batch = EventBatch {
        ts: 0.5,
        events: vec![KvEvent::BlockStored(placeholder)],
        data_parallel_rank: Some(0),
    };
    for enc in [Encoding::Map, Encoding::Array] {
        assert_eq!(decode(&encode_batch(&batch, enc, HashForm::Uint)), batch);
    }
}

#[test]
fn encoder_roundtrips_through_the_decoder() {
    let batch = EventBatch {
        ts: 1.25,
        events: vec![
            KvEvent::BlockStored(BlockStored {
                block_hashes: vec![u64::MAX, 3],
                parent_block_hash: Some(1 << 40),
                token_ids: (0..32).map(|i| i * 1000).collect(),
                block_size: 16,
                lora_id: Some(-1),
                medium: Some(Medium::Cpu),
                lora_name: Some("a-rather-long-lora-name-of-40-bytes-xxxx".into()),
                extra_keys: Some(vec![
                    Some(vec![
                        ExtraKey::Str("mm-hash".into()),
                        ExtraKey::List(vec![ExtraKey::Int(-3), ExtraKey::Bytes(vec![1, 2])]),
                        ExtraKey::Float(0.5),
                        ExtraKey::Bool(true),
                        ExtraKey::Nil,
                    ]),
                    None,
                ]),
                group_idx: Some(2),
                kv_cache_spec_kind: Some("sliding_window".into()),
            }),
            KvEvent::BlockRemoved(BlockRemoved {
                block_hashes: (0..20).collect(),
                medium: Some(Medium::Other("DISK".into())),
                group_idx: None,
            }),
            KvEvent::AllBlocksCleared,
            KvEvent::Unknown { tag: "Next".into() },
        ],
        data_parallel_rank: Some(1),
    };
    for enc in [Encoding::Map, Encoding::Array] {
        for form in [HashForm::Uint, HashForm::Bin32] {
            let bytes = encode_batch(&batch, enc, form);
            assert_eq!(decode(&bytes), batch, "{enc:?} {form:?}");
        }
    }
}

// ------------------------------------------------ golden vLLM captures

fn golden_dir() -> std::path::PathBuf {
    kvroute_testdata::vllm_golden_frames()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len() / 2)
        .map(|i| u8::from_str_radix(&s[2 * i..2 * i + 2], 16).expect("hex"))
        .collect()
}

fn json_hash(v: &serde_json::Value) -> u64 {
    if let Some(n) = v.as_u64() {
        n
    } else if let Some(n) = v.as_i64() {
        n as u64
    } else {
        fold_hash_bytes(&unhex(v["bin_hex"].as_str().expect("bin_hex")))
    }
}

fn json_key(v: &serde_json::Value) -> ExtraKey {
    match v {
        serde_json::Value::String(s) => ExtraKey::Str(s.clone()),
        serde_json::Value::Array(items) => ExtraKey::List(items.iter().map(json_key).collect()),
        serde_json::Value::Null => ExtraKey::Nil,
        serde_json::Value::Bool(b) => ExtraKey::Bool(*b),
        v => match (v.as_i64(), v.as_f64()) {
            (Some(i), _) => ExtraKey::Int(i128::from(i)),
            (None, Some(f)) => ExtraKey::Float(f),
            _ => panic!("extra key {v}"),
        },
    }
}

/// Checks a decoded batch against the capture's generic msgpack decode.
fn check_against_json(b: &EventBatch, j: &serde_json::Value) {
    let arr = j.as_array().expect("batch array");
    assert_eq!(b.ts, arr[0].as_f64().expect("ts"));
    assert_eq!(b.data_parallel_rank, arr.get(2).and_then(|v| v.as_i64()));
    let evs = arr[1].as_array().expect("events");
    assert_eq!(b.events.len(), evs.len());
    for (e, j) in b.events.iter().zip(evs) {
        let hashes = |v: &serde_json::Value| -> Vec<u64> {
            v.as_array()
                .expect("hashes")
                .iter()
                .map(json_hash)
                .collect()
        };
        let medium = |v: &serde_json::Value| v.as_str().map(Medium::parse);
        match (e, j["type"].as_str().expect("type")) {
            (KvEvent::BlockStored(s), "BlockStored") => {
                assert_eq!(s.block_hashes, hashes(&j["block_hashes"]));
                assert_eq!(
                    s.parent_block_hash,
                    (!j["parent_block_hash"].is_null()).then(|| json_hash(&j["parent_block_hash"]))
                );
                let toks: Vec<u32> = j["token_ids"]
                    .as_array()
                    .expect("tokens")
                    .iter()
                    .map(|t| t.as_u64().expect("token") as u32)
                    .collect();
                assert_eq!(s.token_ids, toks);
                assert_eq!(
                    u64::from(s.block_size),
                    j["block_size"].as_u64().expect("bs")
                );
                assert_eq!(s.lora_id, j["lora_id"].as_i64());
                assert_eq!(s.medium, medium(&j["medium"]));
                assert_eq!(s.lora_name.as_deref(), j["lora_name"].as_str());
                assert_eq!(s.group_idx, j["group_idx"].as_i64());
                assert_eq!(
                    s.kv_cache_spec_kind.as_deref(),
                    j["kv_cache_spec_kind"].as_str()
                );
                let keys = j["extra_keys"].as_array().map(|blocks| {
                    blocks
                        .iter()
                        .map(|k| k.as_array().map(|k| k.iter().map(json_key).collect()))
                        .collect::<Vec<Option<Vec<ExtraKey>>>>()
                });
                assert_eq!(s.extra_keys, keys);
            }
            (KvEvent::BlockRemoved(r), "BlockRemoved") => {
                assert_eq!(r.block_hashes, hashes(&j["block_hashes"]));
                assert_eq!(r.medium, medium(&j["medium"]));
                assert_eq!(r.group_idx, j["group_idx"].as_i64());
            }
            (KvEvent::AllBlocksCleared, "AllBlocksCleared") => {}
            (e, t) => panic!("decoded {e:?} for a {t} event"),
        }
    }
}

fn split_multipart(bytes: &[u8]) -> Vec<Vec<u8>> {
    let mut frames = Vec::new();
    let mut rest = bytes;
    while !rest.is_empty() {
        let n = u32::from_be_bytes(rest[..4].try_into().expect("len")) as usize;
        frames.push(rest[4..4 + n].to_vec());
        rest = &rest[4 + n..];
    }
    frames
}

fn golden_payloads() -> Vec<(String, Vec<u8>)> {
    let dir = golden_dir();
    let mut names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("golden captures at {}: {e}", dir.display()))
        .map(|e| e.expect("entry").file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".payload.msgpack"))
        .collect();
    names.sort();
    names
        .into_iter()
        .map(|n| {
            let bytes = std::fs::read(dir.join(&n)).expect("read");
            (n, bytes)
        })
        .collect()
}

#[test]
fn golden_frames_decode_and_match_their_json() {
    let dir = golden_dir();
    let payloads = golden_payloads();
    assert!(
        payloads.len() >= 18,
        "expected every golden capture, found {}",
        payloads.len()
    );
    for (name, payload) in &payloads {
        let stem = name.trim_end_matches(".payload.msgpack");
        let multipart = std::fs::read(dir.join(format!("{stem}.multipart.bin"))).expect("mp");
        let frames = split_multipart(&multipart);
        assert_eq!(frames.len(), 3, "{stem}");
        assert_eq!(&frames[2], payload, "{stem}");
        let txt: serde_json::Value =
            serde_json::from_slice(&std::fs::read(dir.join(format!("{stem}.txt"))).expect("txt"))
                .expect("json");
        let seq = decode_seq(&frames[1]).expect("seq");
        assert_eq!(
            frames[1],
            unhex(txt["frames"]["seq_hex"].as_str().expect("seq_hex")),
            "{stem}"
        );
        if let Some(s) = txt["frames"]["seq"].as_u64() {
            assert_eq!(seq, s, "{stem}");
        }
        let batch = decode_batch(payload).unwrap_or_else(|e| panic!("{stem}: {e}"));
        assert_eq!(batch.skipped, vec![], "{stem}");
        check_against_json(&batch.batch, &txt["msgpack_decoded"]);
    }
}

#[test]
fn golden_salt_and_lora_reach_the_extra_keys() {
    let payload =
        kvroute_testdata::golden_frame("int_02_stored_lora_extrakeys_session.payload.msgpack")
            .expect("golden");
    let batch = decode(&payload);
    let KvEvent::BlockStored(s) = &batch.events[0] else {
        panic!("expected BlockStored");
    };
    assert_eq!(
        s.extra_keys,
        Some(vec![Some(vec![
            ExtraKey::Str("my-lora".into()),
            ExtraKey::Str("salt-A".into())
        ])])
    );
}

#[test]
fn golden_int_and_bytes_captures_fold_to_the_same_events() {
    let payloads = golden_payloads();
    let mut pairs = 0;
    for (name, payload) in &payloads {
        if let Some(rest) = name.strip_prefix("int_") {
            let other = payloads
                .iter()
                .find(|(n, _)| n.strip_prefix("bytes_") == Some(rest))
                .expect("bytes twin");
            assert_eq!(
                decode_batch(payload).expect("int"),
                decode_batch(&other.1).expect("bytes"),
                "{rest}"
            );
            pairs += 1;
        }
    }
    assert!(pairs >= 9);
}

#[test]
fn golden_replay_exchanges_decode() {
    for kind in ["int", "bytes"] {
        let path = golden_dir().join(format!("{kind}_replay_from_seq4.txt"));
        let j: serde_json::Value =
            serde_json::from_slice(&std::fs::read(path).expect("replay")).expect("json");
        let msgs = j["reply_messages_frames_hex"].as_array().expect("msgs");
        let mut seqs = Vec::new();
        for m in msgs {
            let frames: Vec<Vec<u8>> = m
                .as_array()
                .expect("frames")
                .iter()
                .map(|f| unhex(f.as_str().expect("hex")))
                .collect();
            // >= 0.26: ["", topic, seq, payload]
            assert_eq!(frames.len(), 4);
            let seq = decode_seq(&frames[2]).expect("seq");
            seqs.push(seq);
            if seq == u64::MAX {
                assert!(frames[3].is_empty());
            } else {
                decode_batch(&frames[3]).unwrap_or_else(|e| panic!("{kind} seq {seq}: {e}"));
            }
        }
        assert_eq!(seqs, vec![4, 5, 6, u64::MAX]);
    }
}

/// Deterministic mutation run over every golden payload and the hand-built
/// array case: decode must return (never panic), and any accepted mutant must
/// decode the same way twice.
#[test]
fn mutations_never_panic() {
    let mut seeds: Vec<Vec<u8>> = golden_payloads().into_iter().map(|(_, p)| p).collect();
    let mut w = W::default();
    w.arr(3).f64(1.5).arr(2);
    w.arr(12).s("BlockStored").arr(2).u(1).i(-7).u(9);
    w.tokens(&tokens(32)).u(16);
    w.u(3)
        .s("CPU")
        .s("l")
        .arr(1)
        .arr(1)
        .s("salt")
        .u(1)
        .s("full_attention")
        .nil();
    w.arr(4)
        .s("BlockRemoved")
        .arr(1)
        .bin(&[3; 32])
        .s("GPU")
        .u(0);
    w.u(2);
    seeds.push(w.0);
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut ok, mut err, mut skipped) = (0, 0, 0);
    for i in 0..30_000 {
        let mut b = seeds[i % seeds.len()].clone();
        for _ in 0..1 + next() % 3 {
            let len = b.len().max(1);
            let at = (next() as usize) % len;
            match next() % 5 {
                0 => {
                    if let Some(x) = b.get_mut(at) {
                        *x ^= 1 << (next() % 8);
                    }
                }
                1 => b.truncate(at),
                2 => b.insert(at.min(b.len()), next() as u8),
                3 => {
                    if let Some(x) = b.get_mut(at) {
                        // Markers that change lengths and types.
                        *x =
                            [0xc1, 0xdd, 0xdf, 0xdb, 0xc6, 0xc9, 0xd3, 0x9f][(next() % 8) as usize];
                    }
                }
                _ => {
                    let end = (at + 1 + (next() as usize) % 16).min(b.len());
                    b.drain(at..end);
                }
            }
        }
        match decode_batch(&b) {
            Ok(x) => {
                ok += 1;
                skipped += x.skipped.len();
                // Debug text: a NaN timestamp decodes fine and NaN != NaN.
                assert_eq!(
                    format!("{:?}", decode_batch(&b)),
                    format!("{:?}", Ok::<_, EventError>(x))
                );
            }
            Err(e) => {
                err += 1;
                assert!(!e.to_string().is_empty());
            }
        }
    }
    assert!(
        ok > 0 && err > 0 && skipped > 0,
        "ok {ok} err {err} skipped {skipped}"
    );
}

/// Token ids of map-encoded events are read without serde: every int width
/// decodes (compact, as vLLM sends them; as uint 64; the payload's last
/// bytes), and a token that is no u32 skips its event only.
#[test]
fn map_event_tokens_decode_at_every_width_and_a_bad_one_skips_its_event() {
    let tokens = [0, 127, 128, 255, 256, 65_535, 65_536, u32::MAX];
    let stored = |w: &mut W, token: &dyn Fn(&mut W, usize)| {
        w.map(5)
            .s("type")
            .s("BlockStored")
            .s("block_hashes")
            .arr(1)
            .u(9);
        w.s("parent_block_hash")
            .nil()
            .s("block_size")
            .u(8)
            .s("token_ids")
            .arr(tokens.len() as u32);
        for i in 0..tokens.len() {
            token(w, i);
        }
    };
    let mut w = W::default();
    w.arr(2).f64(0.0).arr(4);
    stored(&mut w, &|w, i| {
        rmp::encode::write_uint(&mut w.0, u64::from(tokens[i])).unwrap();
    });
    stored(&mut w, &|w, i| {
        w.i(if i == 3 { -1 } else { 1 });
    });
    stored(&mut w, &|w, i| {
        w.u(if i == 5 { 1 << 32 } else { 1 });
    });
    stored(&mut w, &|w, i| {
        w.u(u64::from(tokens[i]));
    });
    let d = decode_batch(&w.0).expect("the batch decodes");
    let Some(KvEvent::BlockStored(first)) = d.batch.events.first() else {
        panic!("{:?}", d.skipped);
    };
    assert_eq!(first.token_ids, tokens);
    assert_eq!(d.batch.events.len(), 2);
    assert_eq!(d.batch.events[0], d.batch.events[1]);
    let kinds: Vec<&str> = d.skipped.iter().map(EventError::kind).collect();
    assert_eq!(kinds, ["out_of_range", "out_of_range"]);
}

#[test]
fn map_event_hashes_decode_in_every_wire_form() {
    let mut bin = [0u8; 32];
    bin[24..].copy_from_slice(&0x0102_0304_0506_0708u64.to_be_bytes());
    let mut w = W::default();
    w.arr(2).f64(0.0).arr(2);
    w.map(2)
        .s("type")
        .s("BlockRemoved")
        .s("block_hashes")
        .arr(5);
    w.u(u64::MAX).u(7).i(-2).bin(&bin);
    rmp::encode::write_uint(&mut w.0, 300).unwrap();
    // A bin where the array belongs is an error, not an array of its bytes.
    w.map(2)
        .s("type")
        .s("BlockRemoved")
        .s("block_hashes")
        .bin(&bin);
    let d = decode_batch(&w.0).expect("the batch decodes");
    let [KvEvent::BlockRemoved(removed)] = &d.batch.events[..] else {
        panic!("{:?} {:?}", d.batch.events, d.skipped);
    };
    assert_eq!(
        removed.block_hashes,
        [u64::MAX, 7, -2i64 as u64, 0x0102_0304_0506_0708, 300]
    );
    assert_eq!(d.skipped.len(), 1);
}
