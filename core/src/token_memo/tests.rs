use super::*;
use crate::hash::{byte_chunk_hashes, root_hash, token_block_hashes, Domain};

const CHUNK: usize = 64;
const BLOCK: usize = 16;

/// A word-level tokenizer: each maximal run of letters or digits, with
/// the space before it, is one token; any other byte is one token.
fn tokenize(text: &str) -> Vec<u32> {
    let mut tokens = Vec::new();
    let mut piece = String::new();
    let flush = |piece: &mut String, tokens: &mut Vec<u32>| {
        if !piece.is_empty() {
            tokens.push(xxh3_64_with_seed(piece.as_bytes(), 7) as u32);
            piece.clear();
        }
    };
    for ch in text.chars() {
        if ch.is_alphanumeric() {
            piece.push(ch);
        } else if ch == ' ' {
            flush(&mut piece, &mut tokens);
            piece.push(' ');
        } else {
            flush(&mut piece, &mut tokens);
            tokens.push(u32::from(ch));
        }
    }
    flush(&mut piece, &mut tokens);
    tokens
}

struct Prompt {
    text: PromptText,
    blocks: Vec<BlockHash>,
}

impl Prompt {
    fn of(text: &str) -> Prompt {
        let chunks = byte_chunk_hashes(
            root_hash(Domain::Bytes, "m", None),
            text.as_bytes(),
            CHUNK,
            4096,
        );
        let blocks = token_block_hashes(
            root_hash(Domain::Tokens, "m", None),
            &tokenize(text),
            BLOCK,
            4096,
        );
        Prompt {
            text: PromptText::of(text.as_bytes(), chunks, CHUNK),
            blocks,
        }
    }

    fn key(&self) -> &PromptText {
        &self.text
    }

    fn learn_into(&self, memo: &mut TokenMemo) {
        memo.learn(&self.text, self.blocks.clone());
    }
}

/// Deterministic words from a seed.
fn words(seed: u64, n: usize) -> String {
    (0..n)
        .map(|i| {
            let h = xxh3_64_with_seed(&i.to_le_bytes(), seed);
            let len = 1 + (h % 9) as usize;
            let mut w: String = (0..len)
                .map(|k| (b'a' + ((h >> (k * 5)) % 26) as u8) as char)
                .collect();
            if h % 13 == 0 {
                w.push(',');
            }
            w
        })
        .collect::<Vec<_>>()
        .join(" ")
}

fn memo() -> TokenMemo {
    TokenMemo::new(64 << 20, CHUNK, BLOCK)
}

#[test]
fn nothing_is_recalled_before_two_prompts_calibrate() {
    let mut memo = memo();
    let system = words(1, 1500);
    let a = Prompt::of(&format!("{system} {}", words(2, 300)));
    let b = Prompt::of(&format!("{system} {}", words(3, 300)));
    assert_eq!(memo.recall(a.key()), None);
    a.learn_into(&mut memo);
    assert_eq!(memo.recall(b.key()), None, "one sample, no calibration");
    b.learn_into(&mut memo);
    let c = Prompt::of(&format!("{system} {}", words(4, 300)));
    let got = memo.recall(c.key()).expect("calibrated");
    assert!(!got.whole);
    assert_eq!(
        got.hashes,
        c.blocks[..got.hashes.len()],
        "a prefix of the true blocks"
    );
    let common = c
        .blocks
        .iter()
        .zip(&a.blocks)
        .take_while(|(x, y)| x == y)
        .count();
    assert!(
        got.hashes.len() + memo.margin_blocks + 1 >= common,
        "{} of {common}",
        got.hashes.len()
    );
    let estimate = got.blocks as f64 / c.blocks.len() as f64;
    assert!(
        (0.9..1.1).contains(&estimate),
        "length estimate off: {estimate}"
    );
}

#[test]
fn an_equal_prompt_recalls_every_block() {
    let mut memo = memo();
    let a = Prompt::of(&words(5, 2000));
    a.learn_into(&mut memo);
    let got = memo.recall(a.key()).expect("equal text");
    assert!(got.whole);
    assert_eq!(got.hashes, a.blocks);
    assert_eq!(got.blocks, a.blocks.len());
}

#[test]
fn same_chunks_but_another_tail_is_not_whole() {
    let mut memo = memo();
    let base = words(6, 2000);
    let a = Prompt::of(&format!("{base} x"));
    let b = Prompt::of(&format!("{base} y"));
    assert_eq!(a.text.chunks, b.text.chunks, "tails shorter than a chunk");
    a.learn_into(&mut memo);
    assert_eq!(memo.recall(b.key()), None);
    // Both stored: each is recalled whole, though their chunks are the same.
    b.learn_into(&mut memo);
    assert!(memo
        .recall(a.key())
        .is_some_and(|r| r.whole && r.hashes == a.blocks));
    assert!(memo
        .recall(b.key())
        .is_some_and(|r| r.whole && r.hashes == b.blocks));
}

/// The property the router relies on: whatever earlier prompts taught,
/// a recall is a prefix of the prompt's own token blocks.
#[test]
fn recalls_are_prefixes_of_the_true_blocks() {
    let mut memo = memo();
    let prefixes: Vec<String> = (0..6)
        .map(|g| words(100 + g, 400 + 150 * g as usize))
        .collect();
    let (mut recalled, mut blocks_recalled) = (0, 0);
    for i in 0..400u64 {
        let h = xxh3_64_with_seed(&i.to_le_bytes(), 99);
        let prefix = &prefixes[(h % 6) as usize];
        // Cut the shared prefix at a random word or byte, then a unique tail.
        let cut = prefix.len() - (h >> 8) as usize % (prefix.len() / 4);
        let text = format!(
            "{}{}",
            &prefix[..cut],
            words(i + 1000, 50 + (h >> 20) as usize % 200)
        );
        let p = Prompt::of(&text);
        if let Some(got) = memo.recall(p.key()) {
            assert_eq!(got.hashes, p.blocks[..got.hashes.len()], "prompt {i}");
            recalled += 1;
            blocks_recalled += got.hashes.len();
        } else {
            p.learn_into(&mut memo);
        }
    }
    assert!(recalled > 200, "only {recalled} of 400 recalled");
    assert!(blocks_recalled > 0);
}

/// A conversation's next turn shares all of the last turn's text: the
/// memo must not recall only the shallow prefix calibrated earlier.
#[test]
fn a_conversations_next_turn_makes_the_call_out() {
    let mut memo = memo();
    let system = words(8, 100);
    let turn1 = format!("{system} {}", words(9, 300));
    let other = Prompt::of(&format!("{system} {}", words(10, 300)));
    let first = Prompt::of(&turn1);
    first.learn_into(&mut memo);
    other.learn_into(&mut memo);
    let turn2 = Prompt::of(&format!("{turn1} {}", words(11, 200)));
    assert_eq!(
        memo.recall(turn2.key()),
        None,
        "only the system prompt is calibrated"
    );
    turn2.learn_into(&mut memo);
    // A regenerated second turn parts from turn 2 where turn 1 ended: calibrated now.
    let again = Prompt::of(&format!("{turn1} {}", words(12, 200)));
    let got = memo
        .recall(again.key())
        .expect("calibrated at turn 1's end");
    assert_eq!(got.hashes, again.blocks[..got.hashes.len()]);
    assert!(
        got.hashes.len() + 8 >= first.blocks.len(),
        "{} of {}",
        got.hashes.len(),
        first.blocks.len()
    );
}

/// A prompt recalled in part is seen again: the memo knows its text beyond
/// any calibration (a ghost), so it makes the call-out; a third sight is
/// recalled whole. And a conversation whose first turn was recalled in
/// part calls out for its second.
#[test]
fn a_prompt_recalled_in_part_calls_out_when_seen_again() {
    let mut memo = memo();
    let system = words(13, 1500);
    for seed in [14, 15] {
        Prompt::of(&format!("{system} {}", words(seed, 300))).learn_into(&mut memo);
    }
    let p = Prompt::of(&format!("{system} {}", words(16, 300)));
    assert!(
        memo.recall(p.key()).is_some_and(|r| !r.whole),
        "first sight: the shared prefix"
    );
    assert_eq!(memo.recall(p.key()), None, "second sight: the call-out");
    p.learn_into(&mut memo);
    let whole = memo.recall(p.key()).expect("third sight");
    assert!(whole.whole && whole.hashes == p.blocks);
    // The group stays calibrated for new prompts.
    let q = Prompt::of(&format!("{system} {}", words(17, 300)));
    assert!(memo
        .recall(q.key())
        .is_some_and(|r| !r.whole && r.hashes == q.blocks[..r.hashes.len()]));
    let next_turn = Prompt::of(&format!("{system} {} {}", words(17, 300), words(18, 100)));
    assert_eq!(
        memo.recall(next_turn.key()),
        None,
        "the next turn of a partly recalled prompt"
    );
}

#[test]
fn the_budget_is_never_exceeded_and_recalled_samples_stay() {
    let one = Prompt::of(&words(7, 1000));
    let mut memo = TokenMemo::new(3 * one.text.chunks.len() * 40 + 1000, CHUNK, BLOCK);
    let budget = memo.budget_bytes;
    one.learn_into(&mut memo);
    for i in 0..50 {
        let p = Prompt::of(&words(200 + i, 1000));
        p.learn_into(&mut memo);
        assert!(memo.used_bytes <= budget);
        // Keep the first one in use: second chance keeps it.
        assert!(memo.recall(one.key()).is_some(), "evicted after {i}");
    }
    assert!(memo.samples.len() < 5);
    let mut none = TokenMemo::new(0, CHUNK, BLOCK);
    one.learn_into(&mut none);
    assert_eq!((none.used_bytes, none.samples.len()), (0, 0));
    assert_eq!(none.recall(one.key()), None);
}

#[test]
fn a_texts_hash_continues_its_chain_and_hashes_only_the_rest_again() {
    let chained = |model: &str, text: &str, max_blocks: usize| {
        let root = root_hash(Domain::Bytes, model, None);
        let chunks = byte_chunk_hashes(root, text.as_bytes(), CHUNK, max_blocks);
        PromptText::of(text.as_bytes(), chunks, CHUNK).text_hash
    };
    let of = |text: &str| chained("m", text, 4096);
    let text = "x".repeat(CHUNK * 3 + 10);
    assert_eq!(of(&text), of(&text.clone()));
    // The same chain, another tail.
    let other_tail = format!("{}{}", &text[..CHUNK * 3], "y".repeat(10));
    assert_ne!(of(&text), of(&other_tail));
    // Another byte inside the chain, the same tail.
    let other_chunk = format!("y{}", &text[1..]);
    assert_ne!(of(&text), of(&other_chunk));
    // Another model: another chain.
    assert_ne!(of(&text), chained("n", &text, 4096));
    // Beyond a capped chain every byte is hashed again.
    let long = "x".repeat(CHUNK * 4);
    let other_late = format!("{}y{}", "x".repeat(CHUNK * 3), "x".repeat(CHUNK - 1));
    assert_ne!(chained("m", &long, 2), chained("m", &other_late, 2));
}

#[test]
fn empty_inputs_are_ignored() {
    let mut memo = memo();
    let empty = PromptText::of(b"", Vec::new(), CHUNK);
    memo.learn(&empty, vec![BlockHash::new(1)]);
    assert_eq!(memo.recall(&empty), None);
    assert_eq!(memo.samples.len(), 0);
}
