//! vLLM's `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0` form against the `bytes_*` golden captures.

use super::*;

fn golden(name: &str) -> Vec<u8> {
    kvroute_testdata::golden_frame(name).unwrap_or_else(|e| panic!("{e}"))
}

/// The value with every hash (bin) replaced by a marker, so structures compare.
fn shape(v: &rmpv::Value) -> rmpv::Value {
    use rmpv::Value as V;
    match v {
        V::Binary(b) => V::from(format!("bin{}", b.len())),
        V::Array(a) => V::Array(a.iter().map(shape).collect()),
        V::Map(m) => V::Map(m.iter().map(|(k, x)| (k.clone(), shape(x))).collect()),
        other => other.clone(),
    }
}

fn decode(b: &[u8]) -> rmpv::Value {
    rmpv::decode::read_value(&mut &b[..]).unwrap()
}

#[test]
fn bytes_hashes_match_golden_structure() {
    let d = crate::hash::chain(&(0..64).collect::<Vec<u32>>(), 16);
    let e = HashEncoding::Bytes;
    let stored = KvEvent::stored(d.clone(), None, (0..64).collect(), 16);
    let ours = encode_batch_with(1_700_000_000.5, &[stored], 0, e);
    let g = golden("bytes_00_stored_4blocks_root.payload.msgpack");
    assert_eq!(ours.len(), g.len());
    assert_eq!(shape(&decode(&ours)), shape(&decode(&g)));
    let with_parent = KvEvent::stored(d[2..].to_vec(), Some(d[1]), (32..64).collect(), 16);
    let removed = KvEvent::removed(vec![d[3]]);
    let mixed = encode_batch_with(
        1_700_000_000.5,
        &[with_parent, removed, KvEvent::AllBlocksCleared],
        0,
        e,
    );
    let g = golden("bytes_06_mixed_stored_removed_cleared.payload.msgpack");
    assert_eq!(mixed.len(), g.len());
    assert_eq!(shape(&decode(&mixed)), shape(&decode(&g)));
}

#[test]
fn bytes_form_ends_with_the_int_form() {
    let h: BlockHash = 0x0102_0304_0506_0708_1122_3344_5566_7788;
    let b = hash_bytes32(h);
    assert_eq!(b[24..], event_hash(h).to_be_bytes());
    assert_eq!(b[16..], h.to_be_bytes());
    // vLLM's captures have the same relation between their two forms.
    let g = golden("bytes_03_removed_gpu.payload.msgpack");
    let v = decode(&g);
    let bin = v[1][0]["block_hashes"][0].as_slice().unwrap().to_vec();
    assert_eq!(bin[24..], 4393453693117533255u64.to_be_bytes());
}
