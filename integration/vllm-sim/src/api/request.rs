//! Reading a request body as vLLM does: fields, their types and bounds, the
//! chat or completion prompt as token ids, with vLLM's messages on errors.

use axum::body::Bytes;
use serde_json::{Map, Value};

use super::error::{ApiError, ApiResult};
use super::Pod;
use crate::engine::MmItem;
use crate::tokenize::{render_chat, ChatMessage};

pub(super) fn parse_body(body: &Bytes) -> ApiResult<Map<String, Value>> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("JSON decode error: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::bad(
            "Input should be a valid dictionary or object to extract fields from",
        )),
    }
}

pub(super) fn check_model(pod: &Pod, m: &Map<String, Value>) -> ApiResult<String> {
    match m.get("model") {
        None | Some(Value::Null) => Ok(pod.served_names.first().cloned().unwrap_or_default()),
        Some(Value::String(s)) => {
            if pod.served_names.iter().any(|n| n == s) {
                Ok(s.clone())
            } else {
                Err(ApiError::not_found_model(s))
            }
        }
        Some(_) => Err(ApiError::bad_param(
            "model",
            "model: Input should be a valid string",
        )),
    }
}

pub(super) fn opt_bool(
    m: &Map<String, Value>,
    key: &'static str,
    default: bool,
) -> ApiResult<bool> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(default),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad_param(
            key,
            format!("{key}: Input should be a valid boolean"),
        )),
    }
}

fn opt_uint(m: &Map<String, Value>, key: &'static str) -> ApiResult<Option<u64>> {
    match m.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Number(n)) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => Ok(Some(u)),
            (None, Some(i)) => Err(ApiError::bad_param(
                key,
                format!("{key} must be at least 1, got {i}."),
            )),
            _ => Err(ApiError::bad_param(
                key,
                format!("{key}: Input should be a valid integer"),
            )),
        },
        Some(_) => Err(ApiError::bad_param(
            key,
            format!("{key}: Input should be a valid integer"),
        )),
    }
}

fn token_array(v: &Value, key: &'static str) -> ApiResult<Vec<u32>> {
    let arr = v
        .as_array()
        .ok_or_else(|| ApiError::bad_param(key, format!("{key}: Input should be a valid list")))?;
    arr.iter()
        .map(|t| {
            t.as_u64()
                .and_then(|u| u32::try_from(u).ok())
                .ok_or_else(|| {
                    ApiError::bad_param(
                        key,
                        format!("{key}: token ids must be non-negative 32-bit integers"),
                    )
                })
        })
        .collect()
}

/// Stands for an image part in rendered chat text; replaced by the image's placeholder tokens.
const IMAGE_SENTINEL: char = '\u{FFFC}';
/// Qwen2-VL's `<|image_pad|>`: every image becomes this many copies of it (real models vary
/// the count with the resolution; the routing question is only that the ids repeat).
const IMAGE_PAD_TOKEN: u32 = 151_655;
const IMAGE_PAD_TOKENS: usize = 64;

/// A message's text, with [`IMAGE_SENTINEL`] for each image part (its URL pushed to `images`).
fn message_text(content: &Value, images: &mut Vec<String>) -> ApiResult<String> {
    match content {
        Value::Null => Ok(String::new()),
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut s = String::new();
            for p in parts {
                match (
                    p.get("type").and_then(Value::as_str),
                    p.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => s.push_str(t),
                    (Some("image_url"), _) => {
                        let url = p
                            .get("image_url")
                            .and_then(|u| u.get("url"))
                            .and_then(Value::as_str)
                            .ok_or_else(|| {
                                ApiError::bad_param(
                                    "messages",
                                    "messages: image_url part without `image_url.url`",
                                )
                            })?;
                        images.push(url.to_string());
                        s.push(IMAGE_SENTINEL);
                    }
                    (Some("text"), None) => {
                        return Err(ApiError::bad_param(
                            "messages",
                            "messages: text part without `text`",
                        ))
                    }
                    (Some(other), _) => {
                        return Err(ApiError::bad_param(
                            "messages",
                            format!(
                            "messages: content part type `{other}` is not supported by this model"
                        ),
                        ))
                    }
                    (None, _) => {
                        return Err(ApiError::bad_param(
                            "messages",
                            "messages: content part without `type`",
                        ))
                    }
                }
            }
            Ok(s)
        }
        _ => Err(ApiError::bad_param(
            "messages",
            "messages: content should be a string or a list of parts",
        )),
    }
}

fn chat_messages(m: &Map<String, Value>, images: &mut Vec<String>) -> ApiResult<Vec<ChatMessage>> {
    let msgs = match m.get("messages") {
        None => return Err(ApiError::bad_param("messages", "messages: Field required")),
        Some(Value::Array(a)) => a,
        Some(_) => {
            return Err(ApiError::bad_param(
                "messages",
                "messages: Input should be a valid list",
            ))
        }
    };
    if msgs.is_empty() {
        return Err(ApiError::bad_param(
            "messages",
            "messages: List should have at least 1 item",
        ));
    }
    msgs.iter()
        .map(|msg| {
            let role = msg.get("role").and_then(Value::as_str).ok_or_else(|| {
                ApiError::bad_param("messages", "messages: each message needs a string `role`")
            })?;
            Ok(ChatMessage {
                role: role.to_string(),
                content: message_text(msg.get("content").unwrap_or(&Value::Null), images)?,
            })
        })
        .collect()
}

/// Prompt token ids of a chat request: `prompt_token_ids` when given, else the template.
pub(super) fn chat_tokens(pod: &Pod, m: &Map<String, Value>) -> ApiResult<Vec<u32>> {
    Ok(chat_prompt(pod, m)?.0)
}

/// Chat prompt ids and their multimodal items. Text between images is tokenized piecewise;
/// each image becomes `IMAGE_PAD_TOKENS` placeholder ids, identified (as vLLM's mm hash
/// identifies the image) by a hash of its URL.
pub(super) fn chat_prompt(pod: &Pod, m: &Map<String, Value>) -> ApiResult<(Vec<u32>, Vec<MmItem>)> {
    if let Some(v) = m.get("prompt_token_ids").filter(|v| !v.is_null()) {
        return Ok((token_array(v, "prompt_token_ids")?, Vec::new()));
    }
    let mut images = Vec::new();
    let msgs = chat_messages(m, &mut images)?;
    let text = render_chat(&msgs, opt_bool(m, "add_generation_prompt", true)?);
    let special = opt_bool(m, "add_special_tokens", false)?;
    let mut tokens = Vec::new();
    let mut items = Vec::new();
    for (i, piece) in text.split(IMAGE_SENTINEL).enumerate() {
        if i > 0 {
            let url = images.get(i - 1).map(String::as_str).unwrap_or_default();
            items.push(MmItem {
                identifier: format!("{:032x}", xxhash_rust::xxh3::xxh3_128(url.as_bytes())),
                offset: tokens.len(),
                len: IMAGE_PAD_TOKENS,
            });
            tokens.extend(std::iter::repeat_n(IMAGE_PAD_TOKEN, IMAGE_PAD_TOKENS));
        }
        if !piece.is_empty() {
            let ids = pod
                .tokenizer
                .encode(piece, special && i == 0)
                .map_err(|e| ApiError::internal(e.0))?;
            tokens.extend(ids);
        }
    }
    Ok((tokens, items))
}

/// vLLM's `cache_salt`: a non-empty string when given.
pub(super) fn cache_salt(m: &Map<String, Value>) -> ApiResult<Option<String>> {
    match m.get("cache_salt") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) if !s.is_empty() => Ok(Some(s.clone())),
        Some(_) => Err(ApiError::bad_param(
            "cache_salt",
            "Parameter 'cache_salt' must be a non-empty string if provided.",
        )),
    }
}

/// Prompts of a completions request (string, strings, ids, or lists of ids).
pub(super) fn completion_prompts(pod: &Pod, m: &Map<String, Value>) -> ApiResult<Vec<Vec<u32>>> {
    let special = opt_bool(m, "add_special_tokens", true)?;
    let enc = |s: &str| {
        pod.tokenizer
            .encode(s, special)
            .map_err(|e| ApiError::internal(e.0))
    };
    let prompts = match m.get("prompt") {
        None | Some(Value::Null) => {
            return Err(ApiError::bad_param("prompt", "prompt: Field required"))
        }
        Some(Value::String(s)) => vec![enc(s)?],
        Some(Value::Array(a)) if a.is_empty() => {
            return Err(ApiError::bad_param(
                "prompt",
                "prompt: List should have at least 1 item",
            ))
        }
        Some(Value::Array(a)) => match &a[0] {
            Value::Number(_) => vec![token_array(&Value::Array(a.clone()), "prompt")?],
            Value::String(_) => a
                .iter()
                .map(|s| {
                    s.as_str()
                        .ok_or_else(|| ApiError::bad_param("prompt", "prompt: mixed list"))
                        .and_then(enc)
                })
                .collect::<ApiResult<_>>()?,
            Value::Array(_) => a
                .iter()
                .map(|x| token_array(x, "prompt"))
                .collect::<ApiResult<_>>()?,
            _ => {
                return Err(ApiError::bad_param(
                    "prompt",
                    "prompt: Input should be a string or a list",
                ))
            }
        },
        Some(_) => {
            return Err(ApiError::bad_param(
                "prompt",
                "prompt: Input should be a string or a list",
            ))
        }
    };
    Ok(prompts)
}

/// Sampling fields shared by both endpoints; returns (stream, include_usage, max_tokens option).
pub(super) fn sampling(
    m: &Map<String, Value>,
    chat: bool,
) -> ApiResult<(bool, bool, Option<usize>)> {
    let stream = opt_bool(m, "stream", false)?;
    let include_usage = match m.get("stream_options") {
        None | Some(Value::Null) => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::bad_param(
                    "stream_options",
                    "Stream options can only be defined when `stream=True`.",
                ));
            }
            opt_bool(o, "include_usage", false)?
        }
        Some(_) => {
            return Err(ApiError::bad_param(
                "stream_options",
                "stream_options: Input should be an object",
            ))
        }
    };
    opt_bool(m, "ignore_eos", false)?;
    if let Some(n) = opt_uint(m, "n")? {
        if n != 1 {
            return Err(ApiError::bad_param(
                "n",
                "n: only n=1 is supported by vllm-sim",
            ));
        }
    }
    let mut max_tokens = opt_uint(m, "max_tokens")?;
    if chat {
        if let Some(v) = opt_uint(m, "max_completion_tokens")? {
            max_tokens = Some(v);
        }
    }
    if max_tokens == Some(0) {
        return Err(ApiError::bad_param(
            "max_tokens",
            "max_tokens must be at least 1, got 0.",
        ));
    }
    Ok((stream, include_usage, max_tokens.map(|v| v as usize)))
}

/// vLLM's length checks; returns the effective max_tokens.
pub(super) fn check_lengths(
    pod: &Pod,
    prompt: &[u32],
    max_tokens: Option<usize>,
) -> ApiResult<usize> {
    let (max_len, bs, blocks) = {
        let e = pod.engine();
        (e.cfg.max_model_len, e.cfg.block_size, e.cfg.num_gpu_blocks)
    };
    let n = prompt.len();
    if n == 0 {
        return Err(ApiError::bad_param("prompt", "The prompt cannot be empty."));
    }
    if n >= max_len {
        return Err(ApiError::bad(format!(
            "This model's maximum context length is {max_len} tokens. However, your request has {n} input tokens. Please reduce the length of the input messages."
        )));
    }
    let max_tokens = max_tokens.unwrap_or_else(|| pod.default_max_tokens.min(max_len - n));
    if n + max_tokens > max_len {
        return Err(ApiError::bad(format!(
            "This model's maximum context length is {max_len} tokens. However, you requested {} tokens ({n} in the messages, {max_tokens} in the completion). Please reduce the length of the messages or completion.",
            n + max_tokens
        )));
    }
    if (n + max_tokens).div_ceil(bs) > blocks {
        return Err(ApiError::bad(format!(
            "The request needs {} KV blocks but the pod has only {blocks} (--num-gpu-blocks).",
            (n + max_tokens).div_ceil(bs)
        )));
    }
    Ok(max_tokens)
}
