//! Chained block hashes: kvroute's own, pinned by test vectors.
//!
//! For token blocks of `block_size` tokens (full blocks only):
//!
//! ```text
//! h_{-1} = XXH3-64("kvroute/v1/tokens\0" ‖ model ‖ "\0" ‖ lora, seed 0)
//! h_i    = XXH3-64(tokens of block i as little-endian u32, seed = h_{i-1})
//! ```
//!
//! Byte chunks of the canonical prompt rendering chain from a root that
//! names the `bytes` domain instead of `tokens`, so a byte chunk can never
//! collide with a token block of the same model by construction. Each chunk
//! is hashed on its own with XXH64, and only a cheap mix carries the chain:
//!
//! ```text
//! b_{-1} = XXH3-64("kvroute/v3/bytes\0" ‖ model ‖ "\0" ‖ lora, seed 0)
//! b_i    = SplitMix64(b_{i-1} ⊕ XXH64(bytes of chunk i, seed 0))
//! ```
//!
//! where SplitMix64 is [`splitmix64`], a bijection. Only the filter hashes
//! bytes, and it hashes every chunk of every routed body (480 per 30 KiB).
//! In wasm, which has no 64 × 64 → 128-bit multiply, XXH3 cost ~35 ns per
//! 64-byte chunk and XXH64 ~18 (v1 used XXH3). Seeded by the chunk before
//! (v2), each XXH64 waited for the one before it; unseeded, the CPU overlaps
//! them and only the mix is chained: 30 KB hash in 4.8–5.2 µs instead of
//! 6.2–6.7 in node's V8 (`make bench-phases-wasm`, alternated runs).
//! Token blocks keep XXH3: the indexer hashes them too, from vLLM's events.
//! Because every hash is computed from the one before (its seed, or the
//! mix's input), a match of block i implies blocks 0..i matched:
//! longest-prefix search can bisect instead of probing every block.
//!
//! ## Extra keys (cache salt, multimodal inputs)
//!
//! vLLM hashes a block over its tokens *and* its extra keys: the LoRA name,
//! the identifiers of multimodal inputs overlapping the block, and the
//! request's `cache_salt` on block 0. Two blocks with equal tokens but other
//! extra keys are different cache entries, so kvroute's hash covers them too:
//!
//! ```text
//! h_i = XXH3-64(tokens of block i as little-endian u32 ‖ d_i as little-endian u64, seed = h_{i-1})
//! d_i = XXH3-64(canonical encoding of block i's extra keys, seed 0)
//! ```
//!
//! where the extra keys are vLLM's minus the LoRA name (already in the root),
//! and `‖ d_i` is present only when that list is not empty: a block without
//! extra keys hashes exactly as above (the pinned vectors do not change). The
//! canonical encoding ([`extra_keys_digest`]) writes each key as a type byte
//! and its value (`n` nil, `t`/`f` booleans, `i` integer as 16-byte LE i128,
//! `d` float as LE f64 bits, `s` string and `b` bytes as LE u64 length and
//! bytes, `l` list as LE u64 count and items). The filter puts a request's
//! `cache_salt` into block 0's keys (`[salt]`), in the token and the byte
//! domain alike (`b_i = SplitMix64(b_{i-1} ⊕ XXH64(chunk i ‖ d_i, seed 0))`); the indexer
//! folds the keys each BlockStored event reports.
//! The same prompt under two salts therefore shares no block hash.
//!
//! ## Hash kinds
//!
//! A chained hash is a [`BlockHash`]; the part of it the routing index
//! compares is an [`IndexKey`]. Both are transparent newtypes over u64, so
//! the compiler refuses mixing them (or either with a vLLM hash, a pod or a
//! client key) at no cost in size; they become bare u64 only where a codec
//! writes or reads them.

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::xxh3_64_with_seed;
use xxhash_rust::xxh64::xxh64;

/// kvroute's chained hash of one block (or of the chain's root): what
/// [`hash_prompt`](crate::router::hash_prompt) and the indexer compute, and
/// what lookups, learned routes and the worker → singleton messages carry.
/// Serialised as the bare u64 (the lookup's JSON is unchanged).
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize,
)]
#[serde(transparent)]
#[repr(transparent)]
pub struct BlockHash(u64);

impl BlockHash {
    /// The hash a codec read (or a test picked).
    pub const fn new(hash: u64) -> BlockHash {
        BlockHash(hash)
    }

    /// The bare u64, for a codec to write.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The bits of this hash the routing index compares.
    pub const fn index_key(self) -> IndexKey {
        IndexKey::new(self.0)
    }
}

/// The [`INDEX_KEY_BITS`] low bits of a [`BlockHash`]: what the routing index
/// compares and what the indexer feed carries. Two blocks with equal keys
/// are one block to the index.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(transparent)]
pub struct IndexKey(u64);

impl IndexKey {
    /// The key of `bits` (those above [`INDEX_KEY_BITS`] are dropped): a
    /// key the feed carries, or a block hash's.
    pub const fn new(bits: u64) -> IndexKey {
        IndexKey(bits & ((1u64 << INDEX_KEY_BITS) - 1))
    }

    /// The bare u64 (below 2^[`INDEX_KEY_BITS`]), for a codec to write.
    pub const fn get(self) -> u64 {
        self.0
    }
}

impl From<BlockHash> for IndexKey {
    fn from(hash: BlockHash) -> IndexKey {
        hash.index_key()
    }
}

/// What a chain of hashes was computed over.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Domain {
    /// Token ids, `block_size` per block: comparable with vLLM's KV blocks.
    Tokens,
    /// Bytes of the canonical prompt rendering, `chunk_bytes` per chunk.
    Bytes,
}

impl Domain {
    fn tag(self) -> &'static [u8] {
        match self {
            Domain::Tokens => b"kvroute/v1/tokens\0",
            // v3: chunks hashed on their own, then mixed into the chain
            // (v2: XXH64 seeded by the chunk before; v1: XXH3).
            Domain::Bytes => b"kvroute/v3/bytes\0",
        }
    }
}

/// One element of a block's extra keys, as vLLM reports it (a string for the
/// LoRA name, a multimodal identifier or the cache salt; any msgpack value in
/// general).
#[derive(Debug, Clone, PartialEq)]
pub enum ExtraKey {
    Nil,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    Bytes(Vec<u8>),
    List(Vec<ExtraKey>),
}

impl ExtraKey {
    fn encode(&self, out: &mut Vec<u8>) {
        let len = |n: usize| (n as u64).to_le_bytes();
        match self {
            ExtraKey::Nil => out.push(b'n'),
            ExtraKey::Bool(true) => out.push(b't'),
            ExtraKey::Bool(false) => out.push(b'f'),
            ExtraKey::Int(v) => {
                out.push(b'i');
                out.extend_from_slice(&v.to_le_bytes());
            }
            ExtraKey::Float(v) => {
                out.push(b'd');
                out.extend_from_slice(&v.to_bits().to_le_bytes());
            }
            ExtraKey::Str(s) => {
                out.push(b's');
                out.extend_from_slice(&len(s.len()));
                out.extend_from_slice(s.as_bytes());
            }
            ExtraKey::Bytes(b) => {
                out.push(b'b');
                out.extend_from_slice(&len(b.len()));
                out.extend_from_slice(b);
            }
            ExtraKey::List(items) => {
                out.push(b'l');
                out.extend_from_slice(&len(items.len()));
                for item in items {
                    item.encode(out);
                }
            }
        }
    }
}

/// Digest of one block's extra keys (LoRA name already removed), or `None`
/// for an empty list: such a block hashes as a block without extra keys.
pub fn extra_keys_digest(keys: &[ExtraKey]) -> Option<u64> {
    if keys.is_empty() {
        return None;
    }
    let mut out = Vec::with_capacity(32);
    for key in keys {
        key.encode(&mut out);
    }
    Some(xxh3_64_with_seed(&out, 0))
}

/// Bits of a block hash the routing index keys on and the indexer feed may
/// carry. 40 bits keep a feed entry at 5 bytes, while at 13.45 M entries (1,000
/// pods × 19,208 blocks × 70 %) an absent block still matches a present key with
/// probability ≈ 1.2 × 10⁻⁵ per probe (n / 2⁴⁰).
pub const INDEX_KEY_BITS: u32 = 40;

/// The extra-key digest of block 0 of a request with this `cache_salt`
/// (vLLM puts the salt, alone when no LoRA or multimodal input, into block 0's keys).
pub fn salt_digest(salt: &str) -> Option<u64> {
    extra_keys_digest(&[ExtraKey::Str(salt.to_owned())])
}

/// The seed of block 0: scopes every chain by domain, model and LoRA adapter,
/// so different models never share entries.
pub fn root_hash(domain: Domain, model: &str, lora: Option<&str>) -> BlockHash {
    let lora = lora.unwrap_or("");
    let tag = domain.tag();
    let mut buf = Vec::with_capacity(tag.len() + model.len() + 1 + lora.len());
    buf.extend_from_slice(tag);
    buf.extend_from_slice(model.as_bytes());
    buf.push(0);
    buf.extend_from_slice(lora.as_bytes());
    BlockHash(xxh3_64_with_seed(&buf, 0))
}

/// Hashes of the full `block_size`-token blocks of `tokens`, at most
/// `max_blocks` of them, chained from `root`. A trailing partial block is not
/// hashed (vLLM caches full blocks only).
pub fn token_block_hashes(
    root: BlockHash,
    tokens: &[u32],
    block_size: usize,
    max_blocks: usize,
) -> Vec<BlockHash> {
    keyed_token_block_hashes(root, tokens, block_size, max_blocks, &[])
}

/// [`token_block_hashes`] where block `i` also covers `extra[i]`, the
/// [`extra_keys_digest`] of its extra keys (`None` or past the end: none).
pub fn keyed_token_block_hashes(
    root: BlockHash,
    tokens: &[u32],
    block_size: usize,
    max_blocks: usize,
    extra: &[Option<u64>],
) -> Vec<BlockHash> {
    if block_size == 0 {
        return Vec::new();
    }
    let blocks = (tokens.len() / block_size).min(max_blocks);
    let mut out = Vec::with_capacity(blocks);
    // One buffer written in place: pushed token by token, an 8k-token
    // prompt took 12-13 µs to hash natively instead of 7-9 (request_phases).
    let body = block_size * 4;
    let mut bytes = vec![0u8; body + 8];
    let mut parent = root;
    for (i, block) in tokens.chunks_exact(block_size).take(blocks).enumerate() {
        let (token_bytes, digest_bytes) = bytes.split_at_mut(body);
        for (to, token) in token_bytes.chunks_exact_mut(4).zip(block) {
            to.copy_from_slice(&token.to_le_bytes());
        }
        let len = match extra.get(i) {
            Some(Some(digest)) => {
                digest_bytes.copy_from_slice(&digest.to_le_bytes());
                body + 8
            }
            _ => body,
        };
        parent = BlockHash(xxh3_64_with_seed(&bytes[..len], parent.0));
        out.push(parent);
    }
    out
}

/// Hashes of the full `chunk_bytes`-byte chunks of `text`, at most
/// `max_blocks` of them, chained from `root`. A trailing partial chunk is not
/// hashed, mirroring token blocks.
pub fn byte_chunk_hashes(
    root: BlockHash,
    text: &[u8],
    chunk_bytes: usize,
    max_blocks: usize,
) -> Vec<BlockHash> {
    keyed_byte_chunk_hashes(root, text, chunk_bytes, max_blocks, &[])
}

/// [`byte_chunk_hashes`] where chunk `i` also covers `extra[i]`, as
/// [`keyed_token_block_hashes`] does for token blocks.
pub fn keyed_byte_chunk_hashes(
    root: BlockHash,
    text: &[u8],
    chunk_bytes: usize,
    max_blocks: usize,
    extra: &[Option<u64>],
) -> Vec<BlockHash> {
    if chunk_bytes == 0 {
        return Vec::new();
    }
    let mut parent = root;
    let mut keyed = Vec::new();
    text.chunks_exact(chunk_bytes)
        .take(max_blocks)
        .enumerate()
        .map(|(i, chunk)| {
            let own = match extra.get(i) {
                Some(Some(digest)) => {
                    keyed.clear();
                    keyed.extend_from_slice(chunk);
                    keyed.extend_from_slice(&digest.to_le_bytes());
                    xxh64(&keyed, 0)
                }
                _ => xxh64(chunk, 0),
            };
            parent = BlockHash(splitmix64(parent.0 ^ own));
            parent
        })
        .collect()
}

/// How many leading blocks two chains share. A chained hash covers its
/// whole prefix, so equal hashes at block i mean blocks 0..=i are equal:
/// this bisects (about log2 n compares) instead of comparing block by block.
pub fn shared_prefix(a: &[BlockHash], b: &[BlockHash]) -> usize {
    let n = a.len().min(b.len());
    // The common cases in one compare each: other prompts, the same prompt.
    if n == 0 || a.first() != b.first() {
        return 0;
    }
    if a.get(n - 1) == b.get(n - 1) {
        return n;
    }
    // Invariant: blocks below `equal` match; blocks from `differs` on do not.
    let (mut equal, mut differs) = (1, n - 1);
    while equal < differs {
        let mid = equal + (differs - equal) / 2;
        if a.get(mid) == b.get(mid) {
            equal = mid + 1;
        } else {
            differs = mid;
        }
    }
    equal
}

/// SplitMix64's output for state `x` (advance by the golden gamma, then
/// finalise): a bijection of u64 that spreads any input over all bits. For
/// shuffles, tie-breaks and set hashes, and as the byte chunks' chain mix.
pub fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9e37_79b9_7f4a_7c15);
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// Block hashes of these bits, for tests that pick them by hand.
#[cfg(test)]
pub(crate) fn hashes(bits: &[u64]) -> Vec<BlockHash> {
    bits.iter().map(|&b| BlockHash(b)).collect()
}

/// Index keys of these bits, for tests that pick them by hand.
#[cfg(test)]
pub(crate) fn keys(bits: &[u64]) -> Vec<IndexKey> {
    bits.iter().map(|&b| IndexKey::new(b)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Pinned vectors: changing the hash function breaks every deployed
    /// index and the indexer/filter contract, so it must be deliberate.
    #[test]
    fn root_hash_vectors() {
        assert_eq!(
            root_hash(Domain::Tokens, "Qwen/Qwen3-32B", None),
            ROOT_TOKENS_QWEN
        );
        assert_eq!(
            root_hash(Domain::Bytes, "Qwen/Qwen3-32B", None),
            ROOT_BYTES_QWEN
        );
        assert_eq!(
            root_hash(Domain::Tokens, "Qwen/Qwen3-32B", Some("sql-lora")),
            ROOT_TOKENS_QWEN_LORA
        );
    }

    #[test]
    fn token_block_vectors() {
        let tokens: Vec<u32> = (0..64).collect();
        let hashes = token_block_hashes(ROOT_TOKENS_QWEN, &tokens, 16, usize::MAX);
        assert_eq!(hashes, TOKENS_0_63_QWEN.to_vec());
    }

    #[test]
    fn byte_chunk_vectors() {
        let text = "user\u{1f}Hello, world! ".repeat(10);
        let hashes = byte_chunk_hashes(ROOT_BYTES_QWEN, text.as_bytes(), 64, usize::MAX);
        assert_eq!(hashes, BYTES_HELLO_QWEN.to_vec());
    }

    #[test]
    fn chain_depends_on_every_earlier_block() {
        let root = root_hash(Domain::Tokens, "m", None);
        let a: Vec<u32> = (0..48).collect();
        let mut b = a.clone();
        b[3] = 999;
        let ha = token_block_hashes(root, &a, 16, usize::MAX);
        let hb = token_block_hashes(root, &b, 16, usize::MAX);
        assert!(ha.iter().zip(&hb).all(|(x, y)| x != y));
    }

    #[test]
    fn shared_prefix_bisects_to_the_first_differing_block() {
        let root = root_hash(Domain::Bytes, "m", None);
        let base: Vec<u8> = (0..=255u8).cycle().take(64 * 40).collect();
        let chain = byte_chunk_hashes(root, &base, 64, usize::MAX);
        for change in [0, 1, 17, 39] {
            let mut other = base.clone();
            other[change * 64 + 5] ^= 1;
            let other = byte_chunk_hashes(root, &other, 64, usize::MAX);
            let linear = chain.iter().zip(&other).take_while(|(a, b)| a == b).count();
            assert_eq!(linear, change);
            assert_eq!(shared_prefix(&chain, &other), change);
            assert_eq!(shared_prefix(&other, &chain), change);
        }
        // One chain a prefix of the other, and empty ones.
        assert_eq!(shared_prefix(&chain, &chain[..25]), 25);
        assert_eq!(shared_prefix(&chain[..1], &chain), 1);
        assert_eq!(shared_prefix(&chain, &chain), chain.len());
        assert_eq!(shared_prefix(&chain, &[]), 0);
        assert_eq!(shared_prefix(&[], &[]), 0);
    }

    #[test]
    fn partial_blocks_and_caps() {
        let root = root_hash(Domain::Tokens, "m", None);
        let tokens: Vec<u32> = (0..47).collect();
        assert_eq!(token_block_hashes(root, &tokens, 16, usize::MAX).len(), 2);
        assert_eq!(token_block_hashes(root, &tokens, 16, 1).len(), 1);
        assert!(token_block_hashes(root, &tokens, 0, 8).is_empty());
        assert_eq!(
            byte_chunk_hashes(root, &[7u8; 200], 64, usize::MAX).len(),
            3
        );
        assert!(byte_chunk_hashes(root, &[7u8; 200], 0, 8).is_empty());
    }

    #[test]
    fn models_and_domains_never_share_roots() {
        let roots = [
            root_hash(Domain::Tokens, "a", None),
            root_hash(Domain::Bytes, "a", None),
            root_hash(Domain::Tokens, "b", None),
            root_hash(Domain::Tokens, "a", Some("x")),
            root_hash(Domain::Tokens, "a\0x", None),
        ];
        for (i, x) in roots.iter().enumerate() {
            for y in &roots[i + 1..] {
                assert_ne!(x, y);
            }
        }
    }

    #[test]
    fn extra_keys_change_only_their_block_and_what_follows() {
        let root = root_hash(Domain::Tokens, "Qwen/Qwen3-32B", None);
        let tokens: Vec<u32> = (0..64).collect();
        let salt = salt_digest("tenant-a");
        assert_eq!(
            keyed_token_block_hashes(root, &tokens, 16, usize::MAX, &[None, None]),
            TOKENS_0_63_QWEN.to_vec(),
            "no extra keys hash as before"
        );
        let a = keyed_token_block_hashes(root, &tokens, 16, usize::MAX, &[salt]);
        let b = keyed_token_block_hashes(root, &tokens, 16, usize::MAX, &[salt_digest("b")]);
        assert_eq!(a, KEYED_SALT_A.to_vec());
        assert!(a.iter().zip(&TOKENS_0_63_QWEN).all(|(x, y)| x != y));
        assert!(a.iter().zip(&b).all(|(x, y)| x != y));
        let tail = keyed_token_block_hashes(root, &tokens, 16, usize::MAX, &[None, salt]);
        assert_eq!(tail[0], TOKENS_0_63_QWEN[0]);
        assert_ne!(tail[1], TOKENS_0_63_QWEN[1]);
        let text = [7u8; 128];
        let broot = root_hash(Domain::Bytes, "m", None);
        let plain = byte_chunk_hashes(broot, &text, 64, usize::MAX);
        assert_eq!(
            keyed_byte_chunk_hashes(broot, &text, 64, usize::MAX, &[]),
            plain
        );
        let salted = keyed_byte_chunk_hashes(broot, &text, 64, usize::MAX, &[salt]);
        assert!(salted.iter().zip(&plain).all(|(x, y)| x != y));
    }

    #[test]
    fn extra_key_digest_is_canonical_and_typed() {
        use ExtraKey::*;
        assert_eq!(extra_keys_digest(&[]), None);
        assert_eq!(salt_digest("s"), extra_keys_digest(&[Str("s".into())]));
        // Type bytes and lengths keep look-alike values apart.
        let distinct = [
            vec![Str("1".into())],
            vec![Bytes(b"1".to_vec())],
            vec![Int(1)],
            vec![Float(1.0)],
            vec![Bool(true)],
            vec![Nil],
            vec![Str("ab".into())],
            vec![Str("a".into()), Str("b".into())],
            vec![List(vec![Str("a".into()), Str("b".into())])],
        ];
        let digests: Vec<_> = distinct.iter().map(|k| extra_keys_digest(k)).collect();
        for (i, x) in digests.iter().enumerate() {
            assert!(x.is_some());
            for y in &digests[i + 1..] {
                assert_ne!(x, y);
            }
        }
        assert_eq!(salt_digest("tenant-a"), Some(SALT_TENANT_A));
    }

    #[test]
    fn hash_kinds_cost_no_space_and_keys_keep_the_low_bits() {
        use std::mem::size_of;
        assert_eq!(size_of::<BlockHash>(), size_of::<u64>());
        assert_eq!(size_of::<IndexKey>(), size_of::<u64>());
        let hash = TOKENS_0_63_QWEN[0];
        assert_eq!(hash.index_key().get(), 0x74_517d_8d36);
        assert_eq!(IndexKey::from(hash), hash.index_key());
        // A key the feed carries is its own key; bits above the 40 are dropped.
        assert_eq!(IndexKey::new(0x74_517d_8d36), hash.index_key());
        assert_eq!(IndexKey::new(u64::MAX).get(), (1 << INDEX_KEY_BITS) - 1);
        // The lookup's JSON carries the bare u64.
        let json = serde_json::to_string(&[hash, BlockHash::new(u64::MAX)]).unwrap();
        assert_eq!(json, format!("[{},{}]", hash.get(), u64::MAX));
        let back: Vec<BlockHash> = serde_json::from_str(&json).unwrap();
        assert_eq!(back, [hash, BlockHash::new(u64::MAX)]);
    }

    // Computed independently with Python's `xxhash` package (xxh3_64_intdigest).
    const ROOT_TOKENS_QWEN: BlockHash = BlockHash(0xa7ae_0792_94bd_c51e);
    // The byte chunks with `xxh64_intdigest` (seed 0), mixed by SplitMix64
    // written out in Python.
    const ROOT_BYTES_QWEN: BlockHash = BlockHash(0x767e_1576_4fda_9e9e);
    const ROOT_TOKENS_QWEN_LORA: BlockHash = BlockHash(0x0b58_7113_ceb7_4067);
    const TOKENS_0_63_QWEN: [BlockHash; 4] = [
        BlockHash(0xb2b7_9674_517d_8d36),
        BlockHash(0xa8e1_d591_abb2_2b2d),
        BlockHash(0xebe2_5cdf_bc41_8710),
        BlockHash(0x6b2b_308c_32de_0f48),
    ];
    const BYTES_HELLO_QWEN: [BlockHash; 2] = [
        BlockHash(0xbdef_54d2_1944_779c),
        BlockHash(0x58a7_2146_f2bb_b794),
    ];
    // xxh3_64(b"s" + (8).to_bytes(8, "little") + b"tenant-a"), then the first
    // block of tokens 0..15 (LE u32) followed by that digest (LE u64).
    const SALT_TENANT_A: u64 = 0x9e04_c984_4521_12aa;
    const KEYED_SALT_A: [BlockHash; 4] = [
        BlockHash(0x7697_38a1_a2a3_170f),
        BlockHash(0x16b6_cf6b_c387_4ff8),
        BlockHash(0x2f87_7728_c121_51c8),
        BlockHash(0x5ea8_8b84_8750_f30d),
    ];
}
