//! Chained block hashes: kvroute's own, pinned by test vectors.
//!
//! For token blocks of `block_size` tokens (full blocks only):
//!
//! ```text
//! h_{-1} = XXH3-64("kvroute/v1/tokens\0" ‖ model ‖ "\0" ‖ lora, seed 0)
//! h_i    = XXH3-64(tokens of block i as little-endian u32, seed = h_{i-1})
//! ```
//!
//! Byte chunks of the canonical prompt rendering chain the same way from a
//! root that names the `bytes` domain instead of `tokens`, so a byte chunk can
//! never collide with a token block of the same model by construction.
//! Because every hash seeds the next, a match of block i implies blocks 0..i
//! matched: longest-prefix search can bisect instead of probing every block.

use xxhash_rust::xxh3::xxh3_64_with_seed;

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
            Domain::Bytes => b"kvroute/v1/bytes\0",
        }
    }
}

/// The seed of block 0: scopes every chain by domain, model and LoRA adapter,
/// so different models never share entries.
pub fn root_hash(domain: Domain, model: &str, lora: Option<&str>) -> u64 {
    let lora = lora.unwrap_or("");
    let tag = domain.tag();
    let mut buf = Vec::with_capacity(tag.len() + model.len() + 1 + lora.len());
    buf.extend_from_slice(tag);
    buf.extend_from_slice(model.as_bytes());
    buf.push(0);
    buf.extend_from_slice(lora.as_bytes());
    xxh3_64_with_seed(&buf, 0)
}

/// Hashes of the full `block_size`-token blocks of `tokens`, at most
/// `max_blocks` of them, chained from `root`. A trailing partial block is not
/// hashed (vLLM caches full blocks only).
pub fn token_block_hashes(
    root: u64,
    tokens: &[u32],
    block_size: usize,
    max_blocks: usize,
) -> Vec<u64> {
    if block_size == 0 {
        return Vec::new();
    }
    let blocks = (tokens.len() / block_size).min(max_blocks);
    let mut out = Vec::with_capacity(blocks);
    let mut bytes = Vec::with_capacity(block_size * 4);
    let mut parent = root;
    for block in tokens.chunks_exact(block_size).take(blocks) {
        bytes.clear();
        for token in block {
            bytes.extend_from_slice(&token.to_le_bytes());
        }
        parent = xxh3_64_with_seed(&bytes, parent);
        out.push(parent);
    }
    out
}

/// Hashes of the full `chunk_bytes`-byte chunks of `text`, at most
/// `max_blocks` of them, chained from `root`. A trailing partial chunk is not
/// hashed, mirroring token blocks.
pub fn byte_chunk_hashes(
    root: u64,
    text: &[u8],
    chunk_bytes: usize,
    max_blocks: usize,
) -> Vec<u64> {
    if chunk_bytes == 0 {
        return Vec::new();
    }
    let mut parent = root;
    text.chunks_exact(chunk_bytes)
        .take(max_blocks)
        .map(|chunk| {
            parent = xxh3_64_with_seed(chunk, parent);
            parent
        })
        .collect()
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

    // Computed independently with Python's `xxhash` package (xxh3_64_intdigest).
    const ROOT_TOKENS_QWEN: u64 = 0xa7ae_0792_94bd_c51e;
    const ROOT_BYTES_QWEN: u64 = 0xc52e_b47c_c914_2ae3;
    const ROOT_TOKENS_QWEN_LORA: u64 = 0x0b58_7113_ceb7_4067;
    const TOKENS_0_63_QWEN: [u64; 4] = [
        0xb2b7_9674_517d_8d36,
        0xa8e1_d591_abb2_2b2d,
        0xebe2_5cdf_bc41_8710,
        0x6b2b_308c_32de_0f48,
    ];
    const BYTES_HELLO_QWEN: [u64; 2] = [0x7f71_4d3e_656b_653f, 0x1596_f951_9923_d2e5];
}
