//! OpenAI-style request bodies → the prompt kvroute hashes.
//!
//! Prompt sources, in order: pretokenized ids (`prompt` as an int array or an
//! array of int arrays for completions, `prompt_token_ids` for chat), else a
//! canonical byte rendering of `messages` or of a string `prompt`. Only the
//! first prompt of a batch is used: it decides where the batch goes.
//!
//! A body without `model` is accepted (vLLM then serves its one served
//! model): [`PromptRequest::model`] is empty and the router scopes it (see
//! `Cluster::implied_model`). `cache_salt` is kept: it scopes the prompt's
//! hashes as it scopes vLLM's prefix cache.

use serde::de::IgnoredAny;
use serde::Deserialize;
use serde_json::value::RawValue;
use std::borrow::Cow;
use std::collections::BTreeMap;
use std::fmt;
use xxhash_rust::xxh3::xxh3_64;

mod json_string;
mod messages;
mod token_ids;
use json_string::read_string;
use messages::{read_messages, render_messages, RawMessage};
use token_ids::parse_token_ids;

/// What the filter hashes for one request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Prompt {
    /// Token ids from the client (or a tokenizer call-out).
    Tokens(Vec<u32>),
    /// Canonical rendering of the prompt text (byte fallback).
    Text(Vec<u8>),
}

/// A parsed request: the model that scopes its hashes and its prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptRequest {
    /// The `model` field; empty when the body names none.
    pub model: String,
    pub prompt: Prompt,
    /// vLLM's `cache_salt`: requests share cached blocks only under the same salt.
    pub cache_salt: Option<String>,
    /// The messages hold non-text parts (images, audio…). Their placeholder
    /// tokens are the same for every image, so such prompts route on bytes,
    /// whose rendering digests each part.
    pub multimodal: bool,
}

impl PromptRequest {
    /// A request for `model` with `prompt`, no salt, text only.
    pub fn new(model: impl Into<String>, prompt: Prompt) -> PromptRequest {
        PromptRequest {
            model: model.into(),
            prompt,
            cache_salt: None,
            multimodal: false,
        }
    }
}

/// Why a body yields no prompt. Each maps to a fail-open counter.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseError {
    /// Not JSON, or JSON of the wrong shape.
    Malformed(String),
    /// Neither `messages`, `prompt` nor token ids.
    NoPrompt,
}

impl fmt::Display for ParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ParseError::Malformed(why) => write!(f, "malformed request body: {why}"),
            ParseError::NoPrompt => write!(f, "request has no prompt"),
        }
    }
}

impl std::error::Error for ParseError {}

impl From<serde_json::Error> for ParseError {
    fn from(e: serde_json::Error) -> Self {
        ParseError::Malformed(e.to_string())
    }
}

/// A field of a body as read: `None` until the body gives it, `Some(None)`
/// when it gives `null`.
type Given<T> = Option<Option<T>>;

/// The fields of a request body kvroute reads; the rest are skipped.
#[derive(Default)]
struct RawRequest<'a> {
    model: Given<Cow<'a, str>>,
    messages: Given<Vec<RawMessage<'a>>>,
    prompt: Given<PromptValue<'a>>,
    prompt_token_ids: Given<PromptValue<'a>>,
    cache_salt: Given<Cow<'a, str>>,
}

/// `prompt` or `prompt_token_ids` as read in the body's one pass: an array
/// of ids is parsed where it stands (serde would first scan it to find its
/// end, half the cost of an 8k-id body), a string by the string reader;
/// any other value is kept raw.
enum PromptValue<'a> {
    Ids(Vec<u32>),
    Text(Cow<'a, str>),
    Raw(&'a RawValue),
}

impl<'a> RawRequest<'a> {
    /// Reads a request body: a JSON object whose other fields are skipped.
    fn read(body: &'a [u8]) -> Result<RawRequest<'a>, ParseError> {
        const WHAT: &str = "request";
        let mut raw = RawRequest::default();
        walk_body(body, WHAT, |key, value| match key.as_ref() {
            "model" => read_into(&mut raw.model, WHAT, &key, value),
            "messages" => {
                first_time(&raw.messages, WHAT, &key)?;
                let (messages, used) = read_messages(value)?;
                raw.messages = Some(messages);
                Ok(used)
            }
            "cache_salt" => read_into(&mut raw.cache_salt, WHAT, &key, value),
            "prompt" => read_prompt_value(&mut raw.prompt, WHAT, &key, value),
            "prompt_token_ids" => read_prompt_value(&mut raw.prompt_token_ids, WHAT, &key, value),
            _ => Ok(json_value::<IgnoredAny>(value)?.1),
        })?;
        Ok(raw)
    }
}

/// Refuses a field the body gives twice, as serde's derive does.
fn first_time<T>(slot: &Option<T>, what: &str, key: &str) -> Result<(), ParseError> {
    match slot {
        Some(_) => Err(ParseError::Malformed(format!(
            "{what}: duplicate field `{key}`"
        ))),
        None => Ok(()),
    }
}

/// Reads a field's value into `slot`; the bytes it took.
fn read_into<'a, T: Deserialize<'a>>(
    slot: &mut Given<T>,
    what: &str,
    key: &str,
    value: &'a [u8],
) -> Result<usize, ParseError> {
    first_time(slot, what, key)?;
    let (read, used) = json_value::<Option<T>>(value)?;
    *slot = Some(read);
    Ok(used)
}

/// Reads `prompt` or `prompt_token_ids`: an array whose first element is a
/// number goes to the id scanner, a string to the string reader, anything
/// else is kept raw.
fn read_prompt_value<'a>(
    slot: &mut Given<PromptValue<'a>>,
    what: &str,
    key: &str,
    value: &'a [u8],
) -> Result<usize, ParseError> {
    first_time(slot, what, key)?;
    let open = skip_whitespace(value, 0);
    let first = skip_whitespace(value, open + 1);
    if value.get(open) == Some(&b'[') && value.get(first).is_some_and(u8::is_ascii_digit) {
        let (ids, used) = parse_token_ids(value)?;
        *slot = Some(Some(PromptValue::Ids(ids)));
        return Ok(used);
    }
    if value.get(open) == Some(&b'"') {
        let (text, used) = read_string(&value[open..])?;
        *slot = Some(Some(PromptValue::Text(text)));
        return Ok(open + used);
    }
    let (raw, used) = json_value::<Option<&RawValue>>(value)?;
    *slot = Some(raw.map(PromptValue::Raw));
    Ok(used)
}

/// Parses a chat or completion body. Unknown fields are ignored, as an
/// OpenAI-compatible server does.
pub fn parse_request(body: &[u8]) -> Result<PromptRequest, ParseError> {
    let raw = RawRequest::read(body)?;
    let model = raw.model.flatten().map(Cow::into_owned).unwrap_or_default();
    let mut multimodal = false;
    let prompt = if let Some(tokens) = raw.prompt_token_ids.flatten() {
        Prompt::Tokens(match tokens {
            PromptValue::Ids(ids) => ids,
            PromptValue::Text(_) => {
                return Err(ParseError::Malformed(
                    "prompt_token_ids must be an array of token ids".into(),
                ))
            }
            PromptValue::Raw(raw) => parse_token_ids(raw.get().as_bytes())?.0,
        })
    } else if let Some(prompt) = raw.prompt.flatten() {
        match prompt {
            PromptValue::Ids(ids) => Prompt::Tokens(ids),
            PromptValue::Text(text) => Prompt::Text(text.into_owned().into_bytes()),
            PromptValue::Raw(raw) => parse_prompt(raw)?,
        }
    } else if let Some(messages) = raw.messages.flatten() {
        let (text, parts) = render_messages(&messages)?;
        multimodal = parts;
        Prompt::Text(text)
    } else {
        return Err(ParseError::NoPrompt);
    };
    Ok(PromptRequest {
        model,
        prompt,
        // vLLM refuses an empty salt; as routing scope it means none.
        cache_salt: raw
            .cache_salt
            .flatten()
            .filter(|s| !s.is_empty())
            .map(Cow::into_owned),
        multimodal,
    })
}

/// `prompt` of a completion, other than a string: an array of strings, an
/// array of token ids or an array of such arrays. Dispatch on the first
/// bytes so the body is not buffered twice (serde's untagged enums would).
fn parse_prompt(raw: &RawValue) -> Result<Prompt, ParseError> {
    let text = raw.get().trim_start();
    match text.as_bytes().first() {
        Some(b'[') => match text[1..].trim_start().as_bytes().first() {
            Some(b'"') => {
                let batch: Vec<Cow<str>> = serde_json::from_str(text)?;
                first_of(batch).map(|s| Prompt::Text(s.into_owned().into_bytes()))
            }
            Some(b'[') => {
                // A batch: route on its first prompt; serde already checked the rest is JSON.
                let inner = text[1..].trim_start();
                let (first, _) = parse_token_ids(inner.as_bytes())?;
                Ok(Prompt::Tokens(first))
            }
            Some(b']') => Err(ParseError::NoPrompt),
            _ => Ok(Prompt::Tokens(parse_token_ids(text.as_bytes())?.0)),
        },
        Some(b'n') => Err(ParseError::NoPrompt),
        _ => Err(ParseError::Malformed(
            "prompt must be a string, token ids or an array of them".into(),
        )),
    }
}

/// The position of the first non-whitespace byte (JSON whitespace) from `i`.
fn skip_whitespace(bytes: &[u8], mut i: usize) -> usize {
    while i < bytes.len() && matches!(bytes[i], b' ' | b'\n' | b'\r' | b'\t') {
        i += 1;
    }
    i
}

fn first_of<T>(batch: Vec<T>) -> Result<T, ParseError> {
    batch.into_iter().next().ok_or(ParseError::NoPrompt)
}

/// The `cache_salt` of a tenant (tenant isolation): a digest of its identity,
/// the same at every proxy, that does not show the identity to the pods.
pub fn tenant_salt(identity: &str) -> String {
    let mut input = Vec::with_capacity(identity.len() + 20);
    input.extend_from_slice(b"kvroute/v1/tenant\0");
    input.extend_from_slice(identity.as_bytes());
    format!("kvroute-tenant-{:016x}", xxh3_64(&input))
}

/// The body with `cache_salt` set to `salt`, any client value replaced. The
/// other fields are copied verbatim (numbers, escapes and all), first
/// `cache_salt`, then the rest in key order.
pub fn with_cache_salt(body: &[u8], salt: &str) -> Result<Vec<u8>, ParseError> {
    let fields: BTreeMap<Cow<str>, &RawValue> = serde_json::from_slice(body)?;
    let mut out = Vec::with_capacity(body.len() + salt.len() + 32);
    out.extend_from_slice(b"{\"cache_salt\":");
    serde_json::to_writer(&mut out, salt)?;
    for (key, value) in &fields {
        if key == "cache_salt" {
            continue;
        }
        out.push(b',');
        serde_json::to_writer(&mut out, key)?;
        out.push(b':');
        out.extend_from_slice(value.get().as_bytes());
    }
    out.push(b'}');
    Ok(out)
}

/// Body of a vLLM-compatible `POST /tokenize` call for a request without
/// token ids: a chat request's model (when named) and messages (rendered with
/// the generation prompt, as the chat request itself is), or a completion's
/// model and string prompt. `None` for other bodies.
pub fn tokenize_call_body(body: &[u8]) -> Option<Vec<u8>> {
    #[derive(Deserialize)]
    struct Untokenized<'a> {
        #[serde(borrow, default)]
        model: Option<&'a RawValue>,
        #[serde(borrow, default)]
        messages: Option<&'a RawValue>,
        #[serde(borrow, default)]
        prompt: Option<&'a RawValue>,
    }
    let request: Untokenized = serde_json::from_slice(body).ok()?;
    let (field, value, tail): (&[u8], &str, &[u8]) = match (request.messages, request.prompt) {
        (Some(messages), _) => (
            b",\"messages\":",
            messages.get(),
            b",\"add_generation_prompt\":true}",
        ),
        (None, Some(prompt)) if prompt.get().trim_start().starts_with('"') => {
            (b",\"prompt\":", prompt.get(), b"}")
        }
        _ => return None,
    };
    let mut out = Vec::with_capacity(value.len() + 128);
    out.push(b'{');
    // Without a model the pod tokenizes for its served model, as it serves the request.
    if let Some(model) = request.model {
        out.extend_from_slice(b"\"model\":");
        out.extend_from_slice(model.get().as_bytes());
        out.push(b',');
    }
    out.extend_from_slice(&field[1..]);
    out.extend_from_slice(value.as_bytes());
    out.extend_from_slice(tail);
    Some(out)
}

/// Token ids from a `/tokenize` answer (`{"tokens": [...], ...}`), as
/// serde would read it into `Vec<u32>` (the same answers accepted, the same
/// ids), at a fraction of the cost: the answer is the largest body a
/// precise-mode request handles, and serde spends ~10 ns on every id. The
/// object is walked here; keys and the other fields' values are read by
/// serde, the `tokens` array by the token-id scanner.
pub fn parse_tokenize_response(body: &[u8]) -> Result<Vec<u32>, ParseError> {
    const WHAT: &str = "tokenize answer";
    let mut tokens = None;
    walk_body(body, WHAT, |key, value| {
        if key != "tokens" {
            return Ok(json_value::<IgnoredAny>(value)?.1);
        }
        first_time(&tokens, WHAT, &key)?;
        let (ids, used) = parse_token_ids(value)?;
        tokens = Some(ids);
        Ok(used)
    })?;
    tokens.ok_or_else(|| ParseError::Malformed(format!("{WHAT}: missing field `tokens`")))
}

/// Walks the JSON object that is the whole of `body` (`what` names it in
/// errors), as [`walk_object`] does.
fn walk_body<'a>(
    body: &'a [u8],
    what: &str,
    field: impl FnMut(Cow<'a, str>, &'a [u8]) -> Result<usize, ParseError>,
) -> Result<(), ParseError> {
    let used = walk_object(body, what, field)?;
    if skip_whitespace(body, used) != body.len() {
        return Err(ParseError::Malformed(format!(
            "{what}: text after the object"
        )));
    }
    Ok(())
}

/// Walks the JSON object at the start of `value` (after whitespace; `what`
/// names it in errors): keys are read by serde, and `field(key, rest)`
/// reads the value at the start of `rest` and returns the bytes it took.
/// The bytes the object took. Hand-walked so that the largest values,
/// token-id arrays and message texts, are scanned once by their own readers.
fn walk_object<'a>(
    value: &'a [u8],
    what: &str,
    mut field: impl FnMut(Cow<'a, str>, &'a [u8]) -> Result<usize, ParseError>,
) -> Result<usize, ParseError> {
    let bad = |problem: &str| ParseError::Malformed(format!("{what}: {problem}"));
    let mut i = skip_whitespace(value, 0);
    if value.get(i) != Some(&b'{') {
        return Err(bad("expected an object"));
    }
    i = skip_whitespace(value, i + 1);
    if value.get(i) == Some(&b'}') {
        return Ok(i + 1);
    }
    loop {
        let (key, used) = json_value::<Cow<str>>(&value[i..])?;
        i = skip_whitespace(value, i + used);
        if value.get(i) != Some(&b':') {
            return Err(bad("expected ':' after a key"));
        }
        i = skip_whitespace(value, i + 1);
        i += field(key, &value[i..])?;
        i = skip_whitespace(value, i);
        match value.get(i) {
            Some(b',') => i = skip_whitespace(value, i + 1),
            Some(b'}') => return Ok(i + 1),
            _ => return Err(bad("expected ',' or '}' after a value")),
        }
    }
}

/// The JSON value at the start of `bytes` (after any whitespace) and the
/// bytes it took.
fn json_value<'a, T: Deserialize<'a>>(bytes: &'a [u8]) -> Result<(T, usize), ParseError> {
    let mut values = serde_json::Deserializer::from_slice(bytes).into_iter::<T>();
    match values.next() {
        Some(value) => Ok((value?, values.byte_offset())),
        None => Err(ParseError::Malformed("expected a value".into())),
    }
}

#[cfg(test)]
mod tests;
