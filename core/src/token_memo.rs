//! The token memo: token blocks of earlier prompts, recalled for a prompt
//! that shares their text, so that most requests need no tokenizer call-out.
//!
//! Precise mode hashes token ids, and a proxy has no tokenizer of its own:
//! each prompt costs a `/tokenize` round trip to a pod. Prompts that share a
//! long prefix (a system prompt, a conversation's earlier turns, a repeat)
//! share its token ids too, except near the point where their text parts:
//! a tokenizer may cut the last words before it differently.
//!
//! The memo keeps *samples*: for a prompt that went through the tokenizer,
//! its byte-chunk chain (the approximate mode's hashes, one per
//! `chunk_bytes` of text), a hash of the whole text, and its token block
//! hashes. Every chunk hash points at the first sample that held it. Because
//! chunk hashes chain, the deepest chunk of a new prompt found in the memo
//! says how many leading bytes it shares with that sample (bisected).
//!
//! How many token blocks that shared text fixes is learned, never guessed:
//! when a tokenized prompt parts from a sample after chunk `j`, the number of
//! leading token blocks the two have in common (`b`) is a *calibration
//! point* `(j, b)` of both. A later prompt sharing at least chunks `0..=j`
//! parts from the sample in chunk `j + 1` or later, so at most `chunk_bytes`
//! bytes (at most `chunk_bytes` tokens) before where the calibrating pair
//! parted; it is given `b - margin` blocks, where
//! `margin = ceil(chunk_bytes / block_size) + 1` blocks covers those tokens
//! and one block of retokenised words at the cut. A prompt sharing more
//! than `MAX_UNCALIBRATED_CHUNKS` chunks beyond its deepest point (a
//! conversation's next turn) is not recalled: `b` would hide the rest of
//! what it shares, so it makes the call-out, which calibrates that depth.
//! A prompt equal to a sample (same chunks, same whole-text hash) is given
//! all its blocks.
//!
//! Chunks stay with their first sample, so a shared prefix keeps pointing
//! at the sample its calibration points are on. A prompt
//! recalled only in part leaves a *ghost*: its chunks beyond the shared
//! ones, without token blocks. Seeing that text again (a repeat, or a
//! conversation's next turn) finds the ghost deepest: the memo knows the
//! text but not its tokens, and some pod may hold them, so the prompt makes
//! the call-out, and its sample replaces the ghost.
//!
//! Recalled blocks are a prefix of the prompt's: the prompt's length in
//! blocks is estimated from the sample's tokens per byte, so the cost model
//! still charges the uncached rest. A recall that is wrong (a tokenizer
//! whose cut moved further than a block) matches blocks the pod does not
//! hold: the request is routed less well, never refused.
//!
//! Memory is bounded by `budget_bytes` (accounted per sample: its chunks,
//! its blocks, its points and its map entries). The sample not recalled for
//! the longest time is evicted first (second chance: a sample recalled since
//! it was queued goes round once more).

use std::collections::VecDeque;

use hashbrown::HashMap;
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::hash::{shared_prefix, BlockHash};

/// Calibration points kept per sample; past that the shallowest goes.
const MAX_POINTS: usize = 16;
/// How many chunks a prompt may share with a sample beyond its deepest
/// calibration point and still be recalled. Sharing much more (the next
/// turn of a conversation) would recall only the shallow prefix and hide
/// the rest from the index: such a prompt makes the call-out, which
/// calibrates that deeper point.
const MAX_UNCALIBRATED_CHUNKS: usize = 4;
/// Bytes one map entry costs, hash table overhead included (measured order).
const ENTRY_BYTES: usize = 24;
/// Bytes a sample costs beyond its vectors.
const SAMPLE_BYTES: usize = 96;

/// A prompt's text as the memo sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptText {
    /// Its byte-chunk chain (full chunks only).
    pub chunks: Vec<BlockHash>,
    /// A hash of the whole text that continues its chunk chain (so it
    /// covers the model, adapter and salt too): equal texts, equal hashes.
    pub text_hash: u64,
    pub text_len: usize,
}

impl PromptText {
    /// The text and its byte-chunk chain (`hash_prompt` of the text, in
    /// chunks of `chunk_bytes`). The chain's last hash already covers every
    /// byte up to it, so only the bytes after the chain (the partial last
    /// chunk, or all beyond `max_blocks`) are hashed again, seeded by it.
    /// Hashing the whole text again cost a 30 KiB precise-mode request 5–6 µs
    /// of Envoy CPU (docs/results/2026-12-04-overhead-quiet-3900308).
    pub fn of(text: &[u8], chunks: Vec<BlockHash>, chunk_bytes: usize) -> PromptText {
        let chained = chunks.len().saturating_mul(chunk_bytes);
        let rest = text.get(chained..).unwrap_or_default();
        let seed = chunks.last().map_or(0, |c| c.get());
        PromptText {
            text_hash: xxh3_64_with_seed(rest, seed),
            text_len: text.len(),
            chunks,
        }
    }
}

/// Token blocks recalled for a prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recalled {
    /// The leading token block hashes the shared text fixes.
    pub hashes: Vec<BlockHash>,
    /// The prompt's estimated length in blocks (≥ `hashes.len()`).
    pub blocks: usize,
    /// Whole prompt (an equal text) or a shared prefix.
    pub whole: bool,
    /// Leading chunks of the prompt's text the memo shares with the sample.
    pub shared_chunks: usize,
}

/// A tokenized prompt, or a *ghost*: a prompt recalled only in part, kept
/// without token blocks so that its next sight (whose text the memo then
/// knows beyond any calibration) makes the call-out.
#[derive(Debug)]
struct Sample {
    /// The chunks this sample put in the map (those no earlier sample held).
    owned: Vec<BlockHash>,
    last_chunk: Option<BlockHash>,
    /// Empty for a ghost.
    blocks: Vec<BlockHash>,
    text_hash: u64,
    text_len: usize,
    /// `(deepest shared chunk, leading blocks in common)`, sorted by chunk.
    points: Vec<(u32, u32)>,
    last_used: u64,
}

impl Sample {
    fn is_ghost(&self) -> bool {
        self.blocks.is_empty()
    }

    fn cost(&self) -> usize {
        SAMPLE_BYTES
            + (self.owned.len() + 1) * (8 + ENTRY_BYTES)
            + self.blocks.len() * 8
            + MAX_POINTS * 8
    }

    /// Blocks guaranteed (up to `margin`) for a prompt sharing chunks
    /// `0..=depth`, when a calibration point lies at most
    /// `MAX_UNCALIBRATED_CHUNKS` above it.
    fn stable_blocks(&self, depth: usize, margin: usize) -> Option<usize> {
        let &(j, b) = self
            .points
            .iter()
            .rev()
            .find(|&&(j, _)| j as usize <= depth)?;
        if depth - j as usize > MAX_UNCALIBRATED_CHUNKS {
            return None;
        }
        Some((b as usize).saturating_sub(margin))
    }

    fn add_point(&mut self, depth: usize, blocks: usize) {
        let depth = u32::try_from(depth).unwrap_or(u32::MAX);
        let blocks = u32::try_from(blocks).unwrap_or(u32::MAX);
        match self.points.binary_search_by_key(&depth, |&(j, _)| j) {
            // Two pairs parted in the same chunk: keep the smaller agreement.
            Ok(at) => self.points[at].1 = self.points[at].1.min(blocks),
            Err(at) if self.points.len() < MAX_POINTS => self.points.insert(at, (depth, blocks)),
            // Full: the shallowest point goes (its prompts fall back to the call-out).
            Err(at) => {
                self.points.remove(0);
                self.points.insert(at.saturating_sub(1), (depth, blocks));
            }
        }
    }
}

#[derive(Debug)]
pub struct TokenMemo {
    budget_bytes: usize,
    margin_blocks: usize,
    used_bytes: usize,
    samples: HashMap<u64, Sample>,
    /// Chunk hash → the first sample that held it (a shared prefix stays
    /// with the sample its calibration points are on).
    by_chunk: HashMap<BlockHash, u64>,
    /// Whole-text hash → the newest tokenized sample of that text.
    by_text: HashMap<u64, u64>,
    /// Eviction order: (sample, tick when queued).
    queue: VecDeque<(u64, u64)>,
    next_id: u64,
    tick: u64,
}

impl TokenMemo {
    /// A memo of at most `budget_bytes`, for chunks of `chunk_bytes` and
    /// token blocks of `block_size`. A budget of 0 keeps nothing.
    pub fn new(budget_bytes: usize, chunk_bytes: usize, block_size: usize) -> TokenMemo {
        TokenMemo {
            budget_bytes,
            margin_blocks: chunk_bytes.div_ceil(block_size.max(1)) + 1,
            used_bytes: 0,
            samples: HashMap::new(),
            by_chunk: HashMap::new(),
            by_text: HashMap::new(),
            queue: VecDeque::new(),
            next_id: 0,
            tick: 0,
        }
    }

    /// The deepest chunk of `chunks` some sample holds, and that sample.
    /// Chained hashes make presence a prefix property, so this bisects; an
    /// eviction that left a hole makes it find a shallower chunk, never a
    /// wrong one.
    fn deepest(&self, chunks: &[BlockHash]) -> Option<(usize, u64)> {
        let first = *self.by_chunk.get(chunks.first()?)?;
        let (mut found, mut lo, mut hi) = ((0, first), 1, chunks.len());
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match self.by_chunk.get(&chunks[mid]) {
                Some(&id) => {
                    found = (mid, id);
                    lo = mid + 1;
                }
                None => hi = mid,
            }
        }
        Some(found)
    }

    /// Token blocks for a prompt, when a sample's calibration covers it.
    /// A prompt recalled in part leaves a ghost of its text.
    pub fn recall(&mut self, text: &PromptText) -> Option<Recalled> {
        if let Some(&id) = self.by_text.get(&text.text_hash) {
            let equal = self.samples.get(&id).is_some_and(|s| {
                s.text_len == text.text_len && s.last_chunk == text.chunks.last().copied()
            });
            if equal {
                return self.recalled(id, None, text);
            }
        }
        let (depth, id) = self.deepest(&text.chunks)?;
        let recalled = self.recalled(id, Some(depth), text)?;
        if text.chunks.len() > depth + 1 {
            self.insert(text, Vec::new(), None);
        }
        Some(recalled)
    }

    /// What sample `id` gives a prompt sharing its chunks `0..=depth`, or its
    /// whole text (`None`). Nothing from a ghost.
    fn recalled(&mut self, id: u64, depth: Option<usize>, text: &PromptText) -> Option<Recalled> {
        self.tick += 1;
        let tick = self.tick;
        let margin = self.margin_blocks;
        let sample = self.samples.get_mut(&id).filter(|s| !s.is_ghost())?;
        let stable = match depth {
            None => sample.blocks.len(),
            Some(depth) => sample
                .stable_blocks(depth, margin)?
                .min(sample.blocks.len()),
        };
        if stable == 0 {
            return None;
        }
        sample.last_used = tick;
        let estimate = (text.text_len as u128 * sample.blocks.len() as u128)
            .checked_div(sample.text_len as u128)
            .and_then(|b| usize::try_from(b).ok())
            .unwrap_or(0);
        Some(Recalled {
            hashes: sample.blocks[..stable].to_vec(),
            blocks: estimate.max(stable),
            whole: depth.is_none(),
            shared_chunks: depth.map_or(text.chunks.len(), |d| d + 1),
        })
    }

    /// Stores a prompt the tokenizer answered (replacing its ghosts),
    /// calibrating the sample it shares the most text with.
    pub fn learn(&mut self, text: &PromptText, blocks: Vec<BlockHash>) {
        if text.chunks.is_empty() || blocks.is_empty() {
            return;
        }
        let mut point = None;
        while let Some((depth, id)) = self.deepest(&text.chunks) {
            let Some(sample) = self.samples.get_mut(&id) else {
                break;
            };
            if sample.is_ghost() {
                self.remove(id);
                continue;
            }
            let common = shared_prefix(&sample.blocks, &blocks);
            sample.add_point(depth, common);
            point = Some((depth, common));
            break;
        }
        self.insert(text, blocks, point);
    }

    /// Stores a sample (a ghost when `blocks` is empty) with its first
    /// calibration point.
    fn insert(&mut self, text: &PromptText, blocks: Vec<BlockHash>, point: Option<(usize, usize)>) {
        self.tick += 1;
        let id = self.next_id;
        let owned: Vec<BlockHash> = text
            .chunks
            .iter()
            .copied()
            .filter(|c| !self.by_chunk.contains_key(c))
            .collect();
        let mut sample = Sample {
            owned,
            last_chunk: text.chunks.last().copied(),
            blocks,
            text_hash: text.text_hash,
            text_len: text.text_len,
            points: Vec::new(),
            last_used: self.tick,
        };
        if let Some((depth, blocks)) = point {
            sample.add_point(depth, blocks);
        }
        let cost = sample.cost();
        if cost > self.budget_bytes {
            return;
        }
        self.next_id += 1;
        for &chunk in &sample.owned {
            self.by_chunk.insert(chunk, id);
        }
        if !sample.is_ghost() {
            self.by_text.insert(sample.text_hash, id);
        }
        self.used_bytes += cost;
        self.samples.insert(id, sample);
        self.queue.push_back((id, self.tick));
        self.evict();
    }

    fn remove(&mut self, id: u64) {
        let Some(sample) = self.samples.remove(&id) else {
            return;
        };
        self.used_bytes -= sample.cost();
        for chunk in &sample.owned {
            if self.by_chunk.get(chunk) == Some(&id) {
                self.by_chunk.remove(chunk);
            }
        }
        if self.by_text.get(&sample.text_hash) == Some(&id) {
            self.by_text.remove(&sample.text_hash);
        }
    }

    fn evict(&mut self) {
        while self.used_bytes > self.budget_bytes {
            let Some((id, queued)) = self.queue.pop_front() else {
                return;
            };
            let Some(sample) = self.samples.get(&id) else {
                continue;
            };
            if sample.last_used > queued {
                self.tick += 1;
                self.queue.push_back((id, self.tick));
                continue;
            }
            self.remove(id);
        }
    }
}

#[cfg(test)]
mod tests;
