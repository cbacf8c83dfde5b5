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

use xxhash_rust::xxh3::xxh3_64;

/// First id the fallback tokenizer hands out.
const FALLBACK_ID_BASE: u32 = 1000;
/// Ids the fallback tokenizer spreads pieces over.
const FALLBACK_ID_SPAN: u64 = 150_000;

/// Words the simulated model "generates", cycled.
const OUTPUT_WORDS: [&str; 16] = [
    " the", " cache", " routes", " each", " request", " to", " a", " pod", " that", " holds",
    " its", " prefix", " and", " keeps", " load", " even",
];

pub enum Tokenizer {
    Real(Box<tokenizers::Tokenizer>),
    Fallback,
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
        match path {
            None => Ok(Tokenizer::Fallback),
            Some(p) => tokenizers::Tokenizer::from_file(p)
                .map(|t| Tokenizer::Real(Box::new(t)))
                .map_err(|e| TokenizerError(format!("cannot load tokenizer {p}: {e}"))),
        }
    }

    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        match self {
            Tokenizer::Real(t) => t
                .encode(text, add_special_tokens)
                .map(|e| e.get_ids().to_vec())
                .map_err(|e| TokenizerError(format!("tokenizer failed: {e}"))),
            Tokenizer::Fallback => Ok(fallback_encode(text)),
        }
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
