use super::packed_keys::{packed, packed_len, put_packed};
use super::*;
use crate::codec::Reader;
use crate::hash::{hashes, keys, INDEX_KEY_BITS};
use crate::test_rng::xorshift;

const KEY_MAX: u64 = (1 << INDEX_KEY_BITS) - 1;

/// Lowercase hex of `bytes`, as the pinned wire vectors are written.
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn pods() -> Vec<PodInfo> {
    vec![
        PodInfo {
            address: "10.0.0.1:8000".into(),
            models: vec!["Qwen/Qwen3-32B".into(), "lora-a".into()],
            capacity_blocks: 19208,
            speed: 0.5,
            waiting: 3,
            running: 17,
            kv_usage: 0.625,
        },
        PodInfo {
            address: "10.0.0.2:8000".into(),
            ..PodInfo::default()
        },
    ]
}

fn sample() -> FeedUpdate {
    FeedUpdate {
        epoch: 0xdead_beef_0000_0001,
        cursor: 42,
        snapshot: true,
        pods: pods(),
        pods_unchanged: false,
        load: None,
        pods_version: 0,
        ops: vec![
            BlockOp::Stored {
                pod: 0,
                tier: Tier::Gpu,
                hashes: keys(&[1, 3, KEY_MAX]),
            },
            BlockOp::Stored {
                pod: 1,
                tier: Tier::Learned,
                hashes: vec![],
            },
            BlockOp::Removed {
                pod: 0,
                hashes: keys(&[KEY_MAX]),
            },
            BlockOp::Cleared { pod: 1 },
            BlockOp::Stored {
                pod: 1,
                tier: Tier::Cpu,
                hashes: keys(&[7]),
            },
            BlockOp::Stored {
                pod: 1,
                tier: Tier::Disk,
                hashes: keys(&[8]),
            },
        ],
    }
}

fn messages() -> Vec<FeedMessage> {
    let u = sample();
    vec![
        FeedMessage {
            epoch: 9,
            cursor: 10,
            pods_version: pods_version(&u.pods),
            load_version: load_version(&u.pods),
            kind: FeedKind::Page {
                number: 0,
                next: Some(PageToken {
                    start: 3,
                    after: Some(u64::MAX),
                }),
            },
            pods: Some(u.pods.clone()),
            load: None,
            ops: u.ops.clone(),
        },
        FeedMessage {
            kind: FeedKind::Page {
                number: 7,
                next: Some(PageToken {
                    start: 4,
                    after: None,
                }),
            },
            ops: vec![BlockOp::Stored {
                pod: 300,
                tier: Tier::Gpu,
                hashes: vec![IndexKey::new(5); 200],
            }],
            ..FeedMessage::default()
        },
        FeedMessage {
            kind: FeedKind::Page {
                number: 8,
                next: None,
            },
            ..FeedMessage::default()
        },
        FeedMessage {
            kind: FeedKind::Delta { more: true },
            load: Some(vec![
                PodLoad {
                    waiting: 1,
                    running: 300,
                    kv_usage: 0.5,
                },
                PodLoad::default(),
            ]),
            ops: vec![BlockOp::Cleared { pod: 1 }],
            ..FeedMessage::default()
        },
        FeedMessage::default(),
        FeedMessage {
            ops: vec![BlockOp::Stored {
                pod: 70_000,
                tier: Tier::Learned,
                hashes: keys(&spread_keys(1000, 11)),
            }],
            ..FeedMessage::default()
        },
    ]
}

/// `n` ascending pseudo-random keys over the whole key range.
fn spread_keys(n: usize, seed: u64) -> Vec<u64> {
    let mut next = xorshift(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
    let mut keys: Vec<u64> = (0..n).map(|_| next() & KEY_MAX).collect();
    keys.sort_unstable();
    keys
}

#[test]
fn packed_keys_roundtrip_in_the_predicted_bytes() {
    for n in [0, 1, 2, 3, 7, 20, 21, 100, 1000, 13_445, 100_000] {
        let mut keys = spread_keys(n, n as u64);
        if n >= 3 {
            keys[0] = 0;
            keys[1] = 0;
            keys[n - 1] = KEY_MAX;
        }
        let mut out = Vec::new();
        put_packed(&mut out, &keys);
        assert_eq!(out.len() as u64, packed_len(n as u64), "{n} keys");
        let mut r = Reader::new(&out);
        assert_eq!(packed(&mut r, n), Ok(keys), "{n} keys");
        assert!(r.is_empty());
    }
    // Keys bunched at both ends: the unary part holds runs of zeros
    // longer than the decoder's 56-bit window.
    for n in [3, 100, 1000, 13_445] {
        let mut keys: Vec<u64> = (0..n as u64 - 1).collect();
        keys.push(KEY_MAX);
        let mut out = Vec::new();
        put_packed(&mut out, &keys);
        assert_eq!(
            packed(&mut Reader::new(&out), n),
            Ok(keys),
            "{n} bunched keys"
        );
    }
    // Never more than 5 bytes a key; fewer as runs grow.
    assert_eq!(packed_len(1), 5);
    assert_eq!(packed_len(2), 10);
    assert_eq!(packed_len(20), 94);
    assert!(packed_len(13_445) * 100 < 13_445 * 355);
    for n in 0..2000 {
        assert!(packed_len(n) <= 5 * n, "{n}");
    }
}

#[test]
fn packed_keys_refuse_a_bit_past_the_last_key() {
    let keys = spread_keys(20, 3);
    let mut out = Vec::new();
    put_packed(&mut out, &keys);
    // 20 × 35 low bits + 20 + 31 unary bits = 751: bit 751 is padding.
    let last = out.len() - 1;
    out[last] |= 0x80;
    assert_eq!(
        packed(&mut Reader::new(&out), 20),
        Err(FeedError::BadKeyList)
    );
    // A unary part with too few ones.
    let mut none = vec![0u8; out.len()];
    none[0] = 1;
    assert_eq!(
        packed(&mut Reader::new(&none), 20),
        Err(FeedError::BadKeyList)
    );
}

#[test]
fn messages_roundtrip() {
    for m in messages() {
        assert_eq!(decode_message(&encode_message(&m)), Ok(m));
    }
}

#[test]
fn updates_roundtrip_as_index_keys() {
    let u = sample();
    assert_eq!(decode(&encode(&u)), Ok(u.clone()));
    let empty = FeedUpdate::default();
    assert_eq!(decode(&encode(&empty)), Ok(empty));
    // A block hash travels as its 40-bit index key.
    let key = BlockHash::new(0xB2B7_9674_517D_8D36).index_key();
    assert_eq!(key.get(), 0x74_517D_8D36);
    let full = FeedUpdate {
        pods: pods(),
        ops: vec![BlockOp::Removed {
            pod: 0,
            hashes: vec![key],
        }],
        ..FeedUpdate::default()
    };
    let back = decode(&encode(&full)).unwrap();
    assert_eq!(back.ops[0].hashes(), [key]);
    // A message without the pod list leaves the last one in place.
    let idle = encode_message(&FeedMessage::default());
    let heartbeat = decode(&idle).unwrap();
    assert!(heartbeat.pods_unchanged && heartbeat.pods.is_empty());
    let unchanged = FeedUpdate {
        pods: Vec::new(),
        pods_unchanged: true,
        ..full
    };
    assert_eq!(decode(&encode(&unchanged)), Ok(unchanged));
}

/// What the singleton forwards from the lists it keeps decodes as the
/// update of that list, of that load alone, or as word that they are
/// unchanged, each naming the list's digest.
#[test]
fn borrowed_lists_encode_as_their_update() {
    let list = FeedUpdate {
        epoch: 3,
        cursor: 9,
        pods: pods(),
        pods_version: 77,
        ..FeedUpdate::default()
    };
    assert_eq!(
        decode(&encode_forward(3, 9, false, 77, Lists::Pods(&pods()))),
        Ok(list.clone())
    );
    let load: Vec<PodLoad> = pods().iter().map(PodInfo::load).collect();
    let load_only = FeedUpdate {
        pods: Vec::new(),
        pods_unchanged: true,
        load: Some(load.clone()),
        ..list.clone()
    };
    let encoded = encode_forward(3, 9, false, 77, Lists::Load(&load));
    assert_eq!(decode(&encoded), Ok(load_only.clone()));
    assert_eq!(encode(&load_only), encoded);
    let word = FeedUpdate {
        load: None,
        ..load_only
    };
    assert_eq!(
        decode(&encode_forward(3, 9, false, 77, Lists::None)),
        Ok(word)
    );
}

/// An idle poll (nothing changed) is the fixed header and an empty run list.
#[test]
fn an_idle_poll_is_41_bytes() {
    assert_eq!(encode_message(&FeedMessage::default()).len(), 41);
}

/// A run of 20 keys (one vLLM event) costs 94 bytes and a 3-byte header
/// at 1,000 pods: 4.85 bytes a block event.
#[test]
fn a_block_event_costs_under_five_bytes_with_its_share_of_the_run_header() {
    let run = |n: usize| FeedMessage {
        ops: vec![BlockOp::Stored {
            pod: 999,
            tier: Tier::Gpu,
            hashes: keys(&spread_keys(n, 5)),
        }],
        ..FeedMessage::default()
    };
    let header = encode_message(&run(0)).len();
    assert_eq!(encode_message(&run(20)).len() - header, 94);
    assert_eq!(header - 41, 3); // op and 2-byte pod in one varint, 1-byte count
}

#[test]
fn versions_follow_what_they_cover() {
    let a = pods();
    let mut b = a.clone();
    b[0].waiting += 1;
    assert_eq!(pods_version(&a), pods_version(&b));
    assert_ne!(load_version(&a), load_version(&b));
    b[1].capacity_blocks = 5;
    assert_ne!(pods_version(&a), pods_version(&b));
    let mut c = a.clone();
    c[1].speed = 2.0;
    assert_ne!(pods_version(&a), pods_version(&c));
    assert_ne!(pods_version(&[]), 0);
}

/// Pins the byte layout: a change here breaks deployed filters.
#[test]
fn layout_vector() {
    let m = FeedMessage {
        epoch: 1,
        cursor: 2,
        pods_version: 3,
        load_version: 4,
        kind: FeedKind::Page {
            number: 1,
            next: Some(PageToken {
                start: 5,
                after: Some(6),
            }),
        },
        pods: Some(vec![PodInfo {
            address: "a:1".into(),
            models: vec!["m".into()],
            capacity_blocks: 300,
            speed: 2.0,
            waiting: 6,
            running: 7,
            kv_usage: 0.5,
        }]),
        load: None,
        ops: vec![
            BlockOp::Stored {
                pod: 0,
                tier: Tier::Cpu,
                hashes: keys(&[0x01_0203_0405]),
            },
            BlockOp::Removed {
                pod: 0,
                hashes: keys(&[0x0a]),
            },
            BlockOp::Cleared { pod: 0 },
        ],
    };
    assert_eq!(
        hex(&encode_message(&m)),
        concat!(
            "4b565246",
            "0300",
            "0b00",
            "0100000000000000",
            "0200000000000000",
            "0300000000000000",
            "0400000000000000",
            "01000000",
            "0500000000000000",
            "01",
            "0600000000000000",
            "01",
            "03613a31",
            "01",
            "016d",
            "ac02",
            "00000040",
            "06",
            "07",
            "0000003f",
            "03",
            "01",
            "01",
            "0504030201",
            "04",
            "01",
            "0a00000000",
            "05"
        )
    );
    // Eight keys: the first count packed (37 low bits, 3 high bits in unary).
    let packed_run = FeedMessage {
        ops: vec![BlockOp::Removed {
            pod: 1,
            hashes: (0..8).map(|i| IndexKey::new(i << 37 | 1)).collect(),
        }],
        ..FeedMessage::default()
    };
    let bytes = encode_message(&packed_run);
    assert_eq!(bytes.len(), 41 + 2 + 39);
    assert_eq!(
        hex(&bytes[41..]),
        concat!(
            "0c",
            "08",
            "0100000020000000000400000080000000001000000000020000004000000000080000",
            "00005555"
        )
    );
    let learned = LearnedBatch {
        entries: vec![("a:1".into(), vec![BlockHash::new(9)])],
    };
    assert_eq!(
        hex(&encode_learned(&learned)),
        concat!(
            "4b56524c",
            "0100",
            "0000",
            "01000000",
            "03000000",
            "613a31",
            "01000000",
            "0900000000000000"
        )
    );
}

#[test]
fn learned_roundtrip() {
    let b = LearnedBatch {
        entries: vec![
            ("10.0.0.1:8000".into(), hashes(&[1, 2, u64::MAX])),
            ("10.0.0.2:8000".into(), vec![]),
        ],
    };
    assert_eq!(decode_learned(&encode_learned(&b)), Ok(b));
    let empty = LearnedBatch::default();
    assert_eq!(decode_learned(&encode_learned(&empty)), Ok(empty));
}

#[test]
fn every_truncation_is_an_error() {
    for m in messages() {
        let bytes = encode_message(&m);
        for n in 0..bytes.len() {
            assert!(decode_message(&bytes[..n]).is_err(), "prefix of {n} bytes");
        }
    }
    let learned = encode_learned(&LearnedBatch {
        entries: vec![("x:1".into(), hashes(&[1, 2]))],
    });
    for n in 0..learned.len() {
        assert!(decode_learned(&learned[..n]).is_err());
    }
}

#[test]
fn typed_errors() {
    let good = encode(&sample());
    let mut b = good.clone();
    b[0] = b'X';
    assert_eq!(decode(&b), Err(FeedError::BadMagic));
    // Versions 1 (8-byte hashes, the pod list in every answer) and 2
    // (5-byte keys, no speeds) are refused by name.
    for old in [1, 2] {
        let mut b = good.clone();
        b[4] = old;
        assert_eq!(decode(&b), Err(FeedError::UnsupportedVersion(old.into())));
    }
    assert!(FeedError::UnsupportedVersion(2)
        .to_string()
        .contains("unsupported feed version 2 (this filter reads version 3"));
    let mut b = good.clone();
    b[6] = 0x33;
    assert_eq!(decode(&b), Err(FeedError::UnknownFlags(0x33)));
    // The pod list and the load list exclude each other.
    let mut b = good.clone();
    b[6] |= 0x04;
    assert!(matches!(decode(&b), Err(FeedError::UnknownFlags(_))));
    let mut b = good.clone();
    b.push(0);
    assert_eq!(decode(&b), Err(FeedError::TrailingBytes(1)));
    // A huge pod count must be refused before allocating.
    let mut b = encode(&FeedUpdate::default());
    b.truncate(b.len() - 2); // the empty pod list and run list
    b.extend_from_slice(&[0xff, 0xff, 0xff, 0xff, 0x0f]);
    assert!(matches!(
        decode(&b),
        Err(FeedError::Codec(CodecError::CountTooLarge {
            what: "pods",
            ..
        }))
    ));
    // A packed key count beyond the input.
    let mut b = encode_message(&FeedMessage::default());
    b.truncate(b.len() - 1);
    b.extend_from_slice(&[1, 0, 3]);
    assert!(matches!(
        decode_message(&b),
        Err(FeedError::Codec(CodecError::CountTooLarge {
            what: "keys",
            ..
        }))
    ));
    // Op naming a pod that does not exist.
    let one_op = FeedUpdate {
        pods: vec![PodInfo::default()],
        ops: vec![BlockOp::Cleared { pod: 0 }],
        ..FeedUpdate::default()
    };
    let mut b = encode(&one_op);
    let n = b.len();
    b[n - 1] = 1 << OP_BITS | OP_CLEARED;
    assert_eq!(
        decode(&b),
        Err(FeedError::PodOutOfRange { pod: 1, pods: 1 })
    );
    b[n - 1] = 6;
    assert_eq!(decode(&b), Err(FeedError::BadOpKind(6)));
    // A non-minimal varint (op 5, pod 0 in two bytes).
    b[n - 1] = 0x80 | OP_CLEARED;
    b.push(0);
    assert_eq!(
        decode(&b),
        Err(FeedError::Codec(CodecError::BadVarint { what: "op" }))
    );
    // A speed out of range.
    for bad in [-1.0f32, 1001.0, f32::NAN, -0.0] {
        let mut pods = pods();
        pods[1].speed = bad;
        let b = encode(&FeedUpdate {
            pods,
            ..FeedUpdate::default()
        });
        assert_eq!(decode(&b), Err(FeedError::BadSpeed(bad.to_bits())), "{bad}");
    }
    let bad_utf8 = FeedUpdate {
        pods: vec![PodInfo {
            address: "ab".into(),
            ..PodInfo::default()
        }],
        ..FeedUpdate::default()
    };
    let mut b = encode(&bad_utf8);
    b[43] = 0xff;
    assert_eq!(
        decode(&b),
        Err(FeedError::Codec(CodecError::BadUtf8 { what: "address" }))
    );
    let mut token = encode_message(&messages()[1]);
    token[52] = 2;
    assert_eq!(
        decode_message(&token),
        Err(FeedError::BadBool { what: "page token" })
    );
    assert_eq!(decode_learned(&good), Err(FeedError::BadMagic));
}

/// Deterministic mutation run: flips, truncations and splices of valid
/// messages must give an error or a value that re-encodes to the input.
#[test]
fn mutations_never_panic_and_roundtrip() {
    let mut seeds: Vec<Vec<u8>> = messages().iter().map(encode_message).collect();
    seeds.push(encode(&sample()));
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let mut decoded_ok = 0;
    for i in 0..20_000 {
        let mut b = seeds[i % seeds.len()].clone();
        let edits = 1 + next() % 4;
        for _ in 0..edits {
            let len = b.len().max(1);
            match next() % 4 {
                0 => {
                    let at = (next() as usize) % len;
                    if let Some(x) = b.get_mut(at) {
                        *x ^= 1 << (next() % 8);
                    }
                }
                1 => b.truncate((next() as usize) % len),
                2 => {
                    let at = (next() as usize) % len;
                    if at <= b.len() {
                        b.insert(at, next() as u8);
                    }
                }
                _ => {
                    let at = (next() as usize) % len;
                    if at + 4 <= b.len() {
                        b[at..at + 4].copy_from_slice(&(next() as u32).to_le_bytes());
                    }
                }
            }
        }
        if let Ok(m) = decode_message(&b) {
            decoded_ok += 1;
            assert_eq!(
                encode_message(&m),
                b,
                "decoded value must re-encode to its input"
            );
        }
        let _ = decode_learned(&b);
    }
    assert!(decoded_ok > 0, "mutations should sometimes stay valid");
}
