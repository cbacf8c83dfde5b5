//! The simulator's own block hash, shaped like vLLM's (not kvroute's).
//!
//! vLLM V1 hashes block i as `H((parent_digest, tuple(tokens_i), extra_keys_i))`
//! with `parent_digest = NONE_HASH` for block 0, and publishes the low 64 bits
//! of the digest as the event's int hash. We keep that shape with a cheap
//! 128-bit hash: `h_i = XXH3-128(parent_digest (16 B, big-endian) ‖ tokens as
//! u32 little-endian ‖ (0xFF ‖ key bytes) per extra key)`, and
//! `NONE_HASH = XXH3-128("vllm-sim-none-hash")`. The published (event) hash is
//! the low 64 bits. It is deliberately *not* kvroute's XXH3-64 seed chain, so a
//! consumer must re-hash `token_ids` as it must against a real vLLM.

use xxhash_rust::xxh3::xxh3_128;

/// Full digest of a block, as kept in the prefix cache.
pub type BlockHash = u128;

/// Seed string of the root ("NONE_HASH"), like vLLM's `"vllm-none-hash"`.
const NONE_SEED: &[u8] = b"vllm-sim-none-hash";

/// Digest that parents block 0.
pub fn none_hash() -> BlockHash {
    xxh3_128(NONE_SEED)
}

/// Digest of one full block given its parent digest and its extra keys (vLLM's
/// `extra_keys`: LoRA name, multimodal identifiers, cache salt on block 0).
pub fn block_hash(parent: BlockHash, tokens: &[u32], extra_keys: &[String]) -> BlockHash {
    let extra_len: usize = extra_keys.iter().map(|k| k.len() + 1).sum();
    let mut buf = Vec::with_capacity(16 + tokens.len() * 4 + extra_len);
    buf.extend_from_slice(&parent.to_be_bytes());
    for t in tokens {
        buf.extend_from_slice(&t.to_le_bytes());
    }
    for key in extra_keys {
        buf.push(0xFF);
        buf.extend_from_slice(key.as_bytes());
    }
    xxh3_128(&buf)
}

/// The int hash published in KV events: the low 64 bits of the digest.
pub fn event_hash(h: BlockHash) -> u64 {
    h as u64
}

/// Chained digests of the full blocks of `tokens` without extra keys (a partial tail block is not hashed).
#[cfg(test)]
pub fn chain(tokens: &[u32], block_size: usize) -> Vec<BlockHash> {
    let mut out = Vec::with_capacity(tokens.len() / block_size.max(1));
    extend_chain(&mut out, tokens, block_size, |_| Vec::new());
    out
}

/// Extends `hashes` (digests of the first `hashes.len()` blocks of `tokens`)
/// with the digests of the remaining full blocks; `extra_keys(i)` gives block i's extra keys.
pub fn extend_chain(
    hashes: &mut Vec<BlockHash>,
    tokens: &[u32],
    block_size: usize,
    extra_keys: impl Fn(usize) -> Vec<String>,
) {
    if block_size == 0 {
        return;
    }
    let full = tokens.len() / block_size;
    while hashes.len() < full {
        let i = hashes.len();
        let parent = if i == 0 { none_hash() } else { hashes[i - 1] };
        let blk = &tokens[i * block_size..(i + 1) * block_size];
        hashes.push(block_hash(parent, blk, &extra_keys(i)));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chained_hash_depends_on_parent_and_tokens() {
        let toks: Vec<u32> = (0..64).collect();
        let h = chain(&toks, 16);
        assert_eq!(h.len(), 4);
        // Block 1 hashed alone from the root differs from block 1 chained after block 0.
        assert_ne!(block_hash(none_hash(), &toks[16..32], &[]), h[1]);
        assert_eq!(block_hash(h[0], &toks[16..32], &[]), h[1]);
        // Same tokens in a different prefix give a different hash.
        let mut other = toks.clone();
        other[0] = 999;
        let h2 = chain(&other, 16);
        assert_ne!(h2[0], h[0]);
        assert_ne!(h2[3], h[3]);
        // A partial tail is not hashed; determinism.
        assert_eq!(chain(&toks[..63], 16).len(), 3);
        assert_eq!(chain(&toks, 16), h);
        // An extra key on block 0 (a cache salt) changes the whole chain; on block 2 only blocks 2 and 3.
        let mut salted = Vec::new();
        extend_chain(&mut salted, &toks, 16, |i| {
            if i == 0 {
                vec!["salt-A".into()]
            } else {
                vec![]
            }
        });
        assert!(salted.iter().zip(&h).all(|(a, b)| a != b));
        let mut mm = Vec::new();
        extend_chain(&mut mm, &toks, 16, |i| {
            if i == 2 {
                vec!["img".into()]
            } else {
                vec![]
            }
        });
        assert_eq!(mm[..2], h[..2]);
        assert!(mm[2] != h[2] && mm[3] != h[3]);
        // extend_chain continues an existing prefix.
        let mut partial = chain(&toks[..40], 16);
        extend_chain(&mut partial, &toks, 16, |_| Vec::new());
        assert_eq!(partial, h);
    }

    #[test]
    fn event_hash_is_low_64_bits() {
        let h: BlockHash = (0xAAAA_BBBB_CCCC_DDDDu128 << 64) | 0x1122_3344_5566_7788;
        assert_eq!(event_hash(h), 0x1122_3344_5566_7788);
    }
}
