//! Tokenisation and the chat template.
//!
//! - With `--tokenizer PATH/tokenizer.json`: the HuggingFace `tokenizers` crate
//!   (e.g. the offline DeepSeek tokenizer shipped in the PyPI `litellm` wheel at
//!   `litellm/litellm_core_utils/tokenizers/deepseek_tokenizer.json`).
//! - Otherwise a deterministic fallback: the text is cut into pieces — a
//!   maximal run of alphanumeric characters, or one other non-space character —
//!   each remembering whether whitespace preceded it; a piece's id is
//!   `1000 + XXH3-64(flag byte ‖ piece) mod 150000` (ids 0..999 are left for
//!   special tokens; 151,000 ≈ Qwen3's 151,936-entry vocabulary). English text
//!   gives about one token per word, close to real BPE counts.
//!
//! Chat template (both tokenizers), ChatML as Qwen uses it:
//! `<|im_start|>{role}\n{content}<|im_end|>\n` per message, then
//! `<|im_start|>assistant\n` when `add_generation_prompt` (default true).
//! `/tokenize`, `/v1/chat/completions/render` and chat completions all use it,
//! so they agree token for token.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};

use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

/// First id the fallback tokenizer hands out.
const FALLBACK_ID_BASE: u32 = 1000;
/// Ids the fallback tokenizer spreads pieces over.
const FALLBACK_ID_SPAN: u64 = 150_000;

/// Words the simulated model "generates", cycled.
const OUTPUT_WORDS: [&str; 16] = [
    " the", " cache", " routes", " each", " request", " to", " a", " pod", " that", " holds",
    " its", " prefix", " and", " keeps", " load", " even",
];

/// Token ids the encode cache of a real tokenizer may hold (64 MiB).
const CACHE_MAX_TOKENS: usize = 16 << 20;

pub struct Tokenizer {
    kind: Kind,
    cache: Mutex<EncodeCache>,
}

enum Kind {
    Real(Box<tokenizers::Tokenizer>),
    Fallback,
}

/// Results of a real tokenizer by (text, add_special_tokens), oldest dropped first once
/// `max_tokens` ids are held. A real BPE costs ~11 ms of CPU for a 7,000-token prompt (measured,
/// release build); benchmark data sets repeat their prompts, so this keeps the pods cheap.
struct EncodeCache {
    map: HashMap<u128, Arc<Vec<u32>>>,
    order: VecDeque<u128>,
    tokens: usize,
    max_tokens: usize,
}

impl EncodeCache {
    fn new(max_tokens: usize) -> Self {
        Self {
            map: HashMap::new(),
            order: VecDeque::new(),
            tokens: 0,
            max_tokens,
        }
    }

    fn key(text: &str, special: bool) -> u128 {
        xxh3_128(text.as_bytes()) ^ u128::from(special)
    }

    fn get(&self, key: u128) -> Option<Arc<Vec<u32>>> {
        self.map.get(&key).cloned()
    }

    fn insert(&mut self, key: u128, ids: Arc<Vec<u32>>) {
        if ids.len() > self.max_tokens || self.map.contains_key(&key) {
            return;
        }
        while self.tokens + ids.len() > self.max_tokens {
            let Some(old) = self.order.pop_front() else {
                break;
            };
            if let Some(v) = self.map.remove(&old) {
                self.tokens -= v.len();
            }
        }
        self.tokens += ids.len();
        self.order.push_back(key);
        self.map.insert(key, ids);
    }
}

#[derive(Debug)]
pub struct TokenizerError(pub String);

impl std::fmt::Display for TokenizerError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl Tokenizer {
    pub fn load(path: Option<&str>) -> Result<Self, TokenizerError> {
        let kind = match path {
            None => Kind::Fallback,
            Some(p) => tokenizers::Tokenizer::from_file(p)
                .map(|t| Kind::Real(Box::new(t)))
                .map_err(|e| TokenizerError(format!("cannot load tokenizer {p}: {e}")))?,
        };
        Ok(Self {
            kind,
            cache: Mutex::new(EncodeCache::new(CACHE_MAX_TOKENS)),
        })
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        let t = match &self.kind {
            Kind::Real(t) => t,
            Kind::Fallback => return Ok(fallback_encode(text)),
        };
        let key = EncodeCache::key(text, add_special_tokens);
        if let Some(ids) = self
            .cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(key)
        {
            return Ok(ids.as_ref().clone());
        }
        let ids = t
            .encode(text, add_special_tokens)
            .map(|e| e.get_ids().to_vec())
            .map_err(|e| TokenizerError(format!("tokenizer failed: {e}")))?;
        self.cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(key, Arc::new(ids.clone()));
        Ok(ids)
    }

    /// `(token id, text)` of each word the simulated model emits.
    pub fn output_vocab(&self) -> Vec<(u32, String)> {
        OUTPUT_WORDS
            .iter()
            .map(|w| {
                let id = self
                    .encode(w, false)
                    .ok()
                    .and_then(|v| v.first().copied())
                    .unwrap_or(FALLBACK_ID_BASE);
                (id, (*w).to_string())
            })
            .collect()
    }
}

pub fn fallback_encode(text: &str) -> Vec<u32> {
    let mut out = Vec::with_capacity(text.len() / 4 + 1);
    let mut piece = String::new();
    let mut space_before = false;
    let mut piece_space = false;
    let flush = |piece: &mut String, space: bool, out: &mut Vec<u32>| {
        if piece.is_empty() {
            return;
        }
        let mut buf = Vec::with_capacity(piece.len() + 1);
        buf.push(u8::from(space));
        buf.extend_from_slice(piece.as_bytes());
        out.push(FALLBACK_ID_BASE + (xxh3_64(&buf) % FALLBACK_ID_SPAN) as u32);
        piece.clear();
    };
    for ch in text.chars() {
        if ch.is_whitespace() {
            flush(&mut piece, piece_space, &mut out);
            space_before = true;
        } else if ch.is_alphanumeric() {
            if piece.is_empty() {
                piece_space = space_before;
                space_before = false;
            }
            piece.push(ch);
        } else {
            flush(&mut piece, piece_space, &mut out);
            piece.push(ch);
            piece_space = space_before;
            space_before = false;
            flush(&mut piece, piece_space, &mut out);
        }
    }
    flush(&mut piece, piece_space, &mut out);
    out
}

/// A chat message reduced to role and text.
pub struct ChatMessage {
    pub role: String,
    pub content: String,
}

pub fn render_chat(messages: &[ChatMessage], add_generation_prompt: bool) -> String {
    let mut s = String::new();
    for m in messages {
        s.push_str("<|im_start|>");
        s.push_str(&m.role);
        s.push('\n');
        s.push_str(&m.content);
        s.push_str("<|im_end|>\n");
    }
    if add_generation_prompt {
        s.push_str("<|im_start|>assistant\n");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fallback_is_deterministic_and_word_like() {
        let a = fallback_encode("Hello, world! Hello world");
        assert_eq!(a.len(), 6);
        assert_eq!(a, fallback_encode("Hello, world! Hello world"));
        // "world" after a space vs after nothing differ; "Hello" at start vs after space differ.
        assert_ne!(a[0], a[4]);
        assert_eq!(a[2], fallback_encode("x world")[1]);
        assert_eq!(a[2], a[5]);
        assert!(a.iter().all(|t| (1000..151_000).contains(t)));
        // A shared prefix of text gives a shared prefix of tokens.
        let b = fallback_encode("Hello, world! Goodbye");
        assert_eq!(a[..4], b[..4]);
        assert!(fallback_encode("").is_empty());
    }

    #[test]
    fn encode_cache_is_bounded_oldest_first() {
        let mut c = EncodeCache::new(10);
        let k = |s: &str| EncodeCache::key(s, false);
        c.insert(k("a"), Arc::new(vec![1; 4]));
        c.insert(k("b"), Arc::new(vec![2; 4]));
        assert_eq!(c.get(k("a")).map(|v| v.len()), Some(4));
        assert!(c.get(EncodeCache::key("a", true)).is_none());
        c.insert(k("c"), Arc::new(vec![3; 4])); // 12 > 10: drops "a"
        assert!(c.get(k("a")).is_none());
        assert!(c.get(k("b")).is_some() && c.get(k("c")).is_some());
        assert_eq!(c.tokens, 8);
        c.insert(k("huge"), Arc::new(vec![0; 11])); // larger than the cache: not kept
        assert!(c.get(k("huge")).is_none());
        assert_eq!(c.tokens, 8);
    }

    #[test]
    fn chat_template_is_chatml() {
        let m = vec![
            ChatMessage {
                role: "system".into(),
                content: "S".into(),
            },
            ChatMessage {
                role: "user".into(),
                content: "U".into(),
            },
        ];
        assert_eq!(render_chat(&m, true), "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n");
        assert!(!render_chat(&m, false).ends_with("assistant\n"));
    }
}
