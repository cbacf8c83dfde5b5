//! vLLM's HTTP interface: OpenAI-compatible completions (streaming and not),
//! /tokenize, the /render endpoints, /v1/models, /health, /metrics, and the
//! simulator's /admin/flush. Errors use vLLM's body
//! `{"error": {"message", "type", "param", "code"}}` with vLLM's statuses.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Map, Value};
use tokio::sync::{mpsc, Notify};

use crate::engine::{Engine, Finish, HashKeys, MmItem, NewRequest, Out, Sink};
use crate::events::Publisher;
use crate::tokenize::{render_chat, ChatMessage, Tokenizer};

/// Header naming the pod on every response.
pub const POD_HEADER: &str = "x-vllm-sim-pod";

pub struct Pod {
    /// `host:port`, the pod's identity.
    pub addr: String,
    pub served_names: Vec<String>,
    pub model: String,
    pub engine: Mutex<Engine>,
    pub notify: Notify,
    pub publisher: Mutex<Publisher>,
    pub tokenizer: Arc<Tokenizer>,
    pub vocab: Arc<HashMap<u32, String>>,
    pub default_max_tokens: usize,
    pub created: u64,
    pub counter: AtomicU64,
}

impl Pod {
    pub fn engine(&self) -> MutexGuard<'_, Engine> {
        self.engine.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publishes whatever events the engine has pending (called with the engine locked).
    pub fn publish_pending(&self, engine: &mut Engine) {
        let evs = engine.pool.take_events();
        if !evs.is_empty() {
            self.publisher
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .publish(evs);
        }
    }

    fn new_id(&self, prefix: &str) -> String {
        let n = self.counter.fetch_add(1, Ordering::Relaxed);
        let h = xxhash_rust::xxh3::xxh3_128(format!("{}#{n}", self.addr).as_bytes());
        format!("{prefix}-{h:032x}")
    }

    fn max_model_len(&self) -> usize {
        self.engine().cfg.max_model_len
    }
}

// ---------------------------------------------------------------- errors

#[derive(Debug)]
pub struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    fn bad(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: None,
        }
    }

    fn bad_param(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param),
        }
    }

    fn not_found_model(model: &str) -> Self {
        Self {
            status: StatusCode::NOT_FOUND,
            message: format!("The model `{model}` does not exist."),
            param: Some("model"),
        }
    }

    fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            param: None,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::BAD_REQUEST => "BadRequestError",
            StatusCode::NOT_FOUND => "NotFoundError",
            _ => "InternalServerError",
        };
        let body = json!({"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status.as_u16()}});
        (self.status, axum::Json(body)).into_response()
    }
}

type ApiResult<T> = Result<T, ApiError>;

// ---------------------------------------------------------------- request parsing

fn parse_body(body: &Bytes) -> ApiResult<Map<String, Value>> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad(format!("JSON decode error: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        _ => Err(ApiError::bad(
            "Input should be a valid dictionary or object to extract fields from",
        )),
    }
}

fn check_model(pod: &Pod, m: &Map<String, Value>) -> ApiResult<String> {
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

fn opt_bool(m: &Map<String, Value>, key: &'static str, default: bool) -> ApiResult<bool> {
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
fn chat_tokens(pod: &Pod, m: &Map<String, Value>) -> ApiResult<Vec<u32>> {
    Ok(chat_prompt(pod, m)?.0)
}

/// Chat prompt ids and their multimodal items. Text between images is tokenized piecewise;
/// each image becomes `IMAGE_PAD_TOKENS` placeholder ids, identified (as vLLM's mm hash
/// identifies the image) by a hash of its URL.
fn chat_prompt(pod: &Pod, m: &Map<String, Value>) -> ApiResult<(Vec<u32>, Vec<MmItem>)> {
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
fn cache_salt(m: &Map<String, Value>) -> ApiResult<Option<String>> {
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
fn completion_prompts(pod: &Pod, m: &Map<String, Value>) -> ApiResult<Vec<Vec<u32>>> {
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
fn sampling(m: &Map<String, Value>, chat: bool) -> ApiResult<(bool, bool, Option<usize>)> {
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
fn check_lengths(pod: &Pod, prompt: &[u32], max_tokens: Option<usize>) -> ApiResult<usize> {
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

// ---------------------------------------------------------------- generation

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

fn submit(
    pod: &Pod,
    prompts: Vec<(Vec<u32>, usize, HashKeys)>,
) -> mpsc::UnboundedReceiver<(usize, Out)> {
    let (tx, rx) = mpsc::unbounded_channel();
    {
        let mut e = pod.engine();
        let now = Instant::now();
        for (idx, (prompt, max_tokens, keys)) in prompts.into_iter().enumerate() {
            e.add(
                NewRequest {
                    prompt,
                    max_tokens,
                    keys,
                    sink: Sink {
                        idx,
                        tx: tx.clone(),
                    },
                },
                now,
            );
        }
    }
    pod.notify.notify_one();
    rx
}

fn text_of(pod: &Pod, toks: &[u32]) -> String {
    toks.iter()
        .filter_map(|t| pod.vocab.get(t))
        .map(String::as_str)
        .collect()
}

fn usage(fins: &[Finish]) -> Value {
    let p: usize = fins.iter().map(|f| f.prompt_tokens).sum();
    let c: usize = fins.iter().map(|f| f.completion_tokens).sum();
    let cached: usize = fins.iter().map(|f| f.cached_tokens).sum();
    json!({"prompt_tokens": p, "total_tokens": p + c, "completion_tokens": c, "prompt_tokens_details": {"cached_tokens": cached}})
}

struct Gen {
    chat: bool,
    id: String,
    model: String,
    created: u64,
}

impl Gen {
    fn chunk(&self, idx: usize, text: Option<&str>, role: bool, finish: Option<&str>) -> Value {
        let choice = if self.chat {
            let mut delta = Map::new();
            if role {
                delta.insert("role".into(), json!("assistant"));
            }
            if let Some(t) = text {
                delta.insert("content".into(), json!(t));
            }
            json!({"index": idx, "delta": delta, "logprobs": null, "finish_reason": finish})
        } else {
            json!({"index": idx, "text": text.unwrap_or(""), "logprobs": null, "finish_reason": finish, "stop_reason": null})
        };
        json!({"id": self.id, "object": if self.chat {"chat.completion.chunk"} else {"text_completion"},
               "created": self.created, "model": self.model, "choices": [choice]})
    }
}

fn sse(v: &Value, out: &mut Vec<u8>) {
    out.extend_from_slice(b"data: ");
    out.extend_from_slice(v.to_string().as_bytes());
    out.extend_from_slice(b"\n\n");
}

struct StreamState {
    pod: Arc<Pod>,
    gen: Gen,
    rx: mpsc::UnboundedReceiver<(usize, Out)>,
    include_usage: bool,
    started: Vec<bool>,
    fins: Vec<Finish>,
    remaining: usize,
    ended: bool,
}

fn stream_response(
    pod: Arc<Pod>,
    gen: Gen,
    rx: mpsc::UnboundedReceiver<(usize, Out)>,
    n: usize,
    include_usage: bool,
) -> Response {
    let st = StreamState {
        pod,
        gen,
        rx,
        include_usage,
        started: vec![false; n],
        fins: Vec::new(),
        remaining: n,
        ended: false,
    };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        if st.ended {
            return None;
        }
        let mut out = Vec::new();
        match st.rx.recv().await {
            Some((idx, Out::Tokens(toks))) => {
                if st.gen.chat && !st.started.get(idx).copied().unwrap_or(true) {
                    sse(&st.gen.chunk(idx, Some(""), true, None), &mut out);
                }
                if let Some(s) = st.started.get_mut(idx) {
                    *s = true;
                }
                let text = text_of(&st.pod, &toks);
                sse(&st.gen.chunk(idx, Some(&text), false, None), &mut out);
            }
            Some((idx, Out::Done(f))) => {
                sse(
                    &st.gen.chunk(
                        idx,
                        if st.gen.chat { None } else { Some("") },
                        false,
                        Some(f.reason),
                    ),
                    &mut out,
                );
                st.fins.push(f);
                st.remaining = st.remaining.saturating_sub(1);
                if st.remaining == 0 {
                    if st.include_usage {
                        let v = json!({"id": st.gen.id, "object": if st.gen.chat {"chat.completion.chunk"} else {"text_completion"},
                                       "created": st.gen.created, "model": st.gen.model, "choices": [], "usage": usage(&st.fins)});
                        sse(&v, &mut out);
                    }
                    out.extend_from_slice(b"data: [DONE]\n\n");
                    st.ended = true;
                }
            }
            None => {
                let err = json!({"error": {"message": "engine stopped", "type": "InternalServerError", "param": null, "code": 500}});
                sse(&err, &mut out);
                out.extend_from_slice(b"data: [DONE]\n\n");
                st.ended = true;
            }
        }
        Some((Ok::<Bytes, std::convert::Infallible>(Bytes::from(out)), st))
    });
    let mut res = Response::new(Body::from_stream(stream));
    res.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/event-stream; charset=utf-8"),
    );
    res
}

async fn collect(
    pod: &Pod,
    gen: &Gen,
    mut rx: mpsc::UnboundedReceiver<(usize, Out)>,
    n: usize,
) -> ApiResult<Response> {
    let mut texts = vec![String::new(); n];
    let mut fins: Vec<Option<Finish>> = vec![None; n];
    let mut remaining = n;
    while remaining > 0 {
        match rx.recv().await {
            Some((idx, Out::Tokens(t))) => {
                if let Some(s) = texts.get_mut(idx) {
                    s.push_str(&text_of(pod, &t));
                }
            }
            Some((idx, Out::Done(f))) => {
                if let Some(slot) = fins.get_mut(idx) {
                    *slot = Some(f);
                }
                remaining -= 1;
            }
            None => return Err(ApiError::internal("engine stopped")),
        }
    }
    let fins: Vec<Finish> = fins.into_iter().flatten().collect();
    let choices: Vec<Value> = texts
        .iter()
        .zip(&fins)
        .enumerate()
        .map(|(i, (t, f))| {
            if gen.chat {
                json!({"index": i, "message": {"role": "assistant", "content": t, "tool_calls": []}, "logprobs": null, "finish_reason": f.reason, "stop_reason": null})
            } else {
                json!({"index": i, "text": t, "logprobs": null, "finish_reason": f.reason, "stop_reason": null, "prompt_logprobs": null})
            }
        })
        .collect();
    let body = json!({"id": gen.id, "object": if gen.chat {"chat.completion"} else {"text_completion"}, "created": gen.created,
                      "model": gen.model, "choices": choices, "usage": usage(&fins)});
    Ok(axum::Json(body).into_response())
}

/// Runs request parsing and tokenisation (the CPU-heavy part of a request) on tokio's blocking
/// pool, so the one runtime thread that times every pod's engine steps is never held up.
async fn off_thread<T: Send + 'static>(
    f: impl FnOnce() -> ApiResult<T> + Send + 'static,
) -> ApiResult<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("request worker failed: {e}")))?
}

async fn generate(pod: Arc<Pod>, body: Bytes, chat: bool) -> ApiResult<Response> {
    let p = pod.clone();
    let (model, stream, include_usage, reqs) = off_thread(move || {
        let m = parse_body(&body)?;
        let model = check_model(&p, &m)?;
        let (stream, include_usage, max_tokens) = sampling(&m, chat)?;
        let salt = cache_salt(&m)?;
        let prompts = if chat {
            vec![chat_prompt(&p, &m)?]
        } else {
            completion_prompts(&p, &m)?
                .into_iter()
                .map(|t| (t, Vec::new()))
                .collect()
        };
        let mut reqs = Vec::with_capacity(prompts.len());
        for (prompt, mm) in prompts {
            let mt = check_lengths(&p, &prompt, max_tokens)?;
            let keys = HashKeys {
                cache_salt: salt.clone(),
                mm,
            };
            reqs.push((prompt, mt, keys));
        }
        Ok((model, stream, include_usage, reqs))
    })
    .await?;
    let n = reqs.len();
    let gen = Gen {
        chat,
        id: pod.new_id(if chat { "chatcmpl" } else { "cmpl" }),
        model,
        created: now_secs(),
    };
    let rx = submit(&pod, reqs);
    if stream {
        Ok(stream_response(pod, gen, rx, n, include_usage))
    } else {
        collect(&pod, &gen, rx, n).await
    }
}

async fn chat_completions(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    generate(pod, body, true)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

async fn completions(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    generate(pod, body, false)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

// ---------------------------------------------------------------- tokenize and render

fn json_or_error(r: ApiResult<Value>) -> Response {
    match r {
        Ok(v) => axum::Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn tokenize(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let r: ApiResult<Value> = off_thread(move || {
        let m = parse_body(&body)?;
        check_model(&pod, &m)?;
        let tokens = if m.contains_key("messages") {
            chat_tokens(&pod, &m)?
        } else {
            match m.get("prompt") {
                Some(Value::String(s)) => pod
                    .tokenizer
                    .encode(s, opt_bool(&m, "add_special_tokens", true)?)
                    .map_err(|e| ApiError::internal(e.0))?,
                None => return Err(ApiError::bad_param("prompt", "prompt: Field required")),
                Some(_) => {
                    return Err(ApiError::bad_param(
                        "prompt",
                        "prompt: Input should be a valid string",
                    ))
                }
            }
        };
        Ok(
            json!({"count": tokens.len(), "max_model_len": pod.max_model_len(), "tokens": tokens, "token_strs": null}),
        )
    })
    .await;
    json_or_error(r)
}

fn sampling_params(m: &Map<String, Value>, chat: bool) -> ApiResult<Value> {
    let (_, _, max_tokens) = sampling(m, chat)?;
    Ok(json!({"max_tokens": max_tokens, "ignore_eos": opt_bool(m, "ignore_eos", false)?}))
}

async fn chat_render(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let r: ApiResult<Value> = off_thread(move || {
        let m = parse_body(&body)?;
        let model = check_model(&pod, &m)?;
        let tokens = chat_tokens(&pod, &m)?;
        Ok(
            json!({"request_id": pod.new_id("chatcmpl"), "token_ids": tokens, "sampling_params": sampling_params(&m, true)?, "model": model}),
        )
    })
    .await;
    json_or_error(r)
}

async fn completions_render(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    let r: ApiResult<Value> = off_thread(move || {
        let m = parse_body(&body)?;
        let model = check_model(&pod, &m)?;
        let sp = sampling_params(&m, false)?;
        let out: Vec<Value> = completion_prompts(&pod, &m)?
            .into_iter()
            .map(|t| json!({"request_id": pod.new_id("cmpl"), "token_ids": t, "sampling_params": sp, "model": model}))
            .collect();
        Ok(Value::Array(out))
    })
    .await;
    json_or_error(r)
}

// ---------------------------------------------------------------- the rest

async fn models(State(pod): State<Arc<Pod>>) -> Response {
    let max_len = pod.max_model_len();
    let data: Vec<Value> = pod
        .served_names
        .iter()
        .map(|n| {
            json!({"id": n, "object": "model", "created": pod.created, "owned_by": "vllm", "root": pod.model,
                   "parent": null, "max_model_len": max_len})
        })
        .collect();
    axum::Json(json!({"object": "list", "data": data})).into_response()
}

async fn metrics(State(pod): State<Arc<Pod>>) -> Response {
    let text = {
        let e = pod.engine();
        crate::metrics::render(&crate::metrics::Snapshot {
            model_name: pod.served_names.first().map(String::as_str).unwrap_or(""),
            running: e.num_running(),
            waiting: e.num_waiting(),
            kv_usage: e.pool.usage(),
            num_gpu_blocks: e.cfg.num_gpu_blocks,
            block_size: e.cfg.block_size,
            counters: &e.counters,
        })
    };
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response()
}

async fn flush(State(pod): State<Arc<Pod>>) -> Response {
    let mut e = pod.engine();
    let flushed = e.flush();
    pod.publish_pending(&mut e);
    drop(e);
    // As vLLM's reset_prefix_cache, refused while requests hold blocks (409).
    let status = if flushed {
        StatusCode::OK
    } else {
        StatusCode::CONFLICT
    };
    (
        status,
        axum::Json(json!({"flushed": flushed, "pod": pod.addr})),
    )
        .into_response()
}

async fn not_found() -> Response {
    (
        StatusCode::NOT_FOUND,
        axum::Json(json!({"detail": "Not Found"})),
    )
        .into_response()
}

pub fn router(pod: Arc<Pod>) -> Router {
    let pod_header =
        HeaderValue::from_str(&pod.addr).unwrap_or_else(|_| HeaderValue::from_static("invalid"));
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions/render", post(chat_render))
        .route("/v1/completions/render", post(completions_render))
        .route("/tokenize", post(tokenize))
        .route("/v1/models", get(models))
        .route("/health", get(|| async { StatusCode::OK }))
        .route(
            "/version",
            get(|| async {
                axum::Json(json!({"version": concat!("vllm-sim ", env!("CARGO_PKG_VERSION"))}))
            }),
        )
        .route("/metrics", get(metrics))
        .route("/admin/flush", post(flush))
        .fallback(not_found)
        // Large enough for the proxy's oversize-body tests (200 MB): the pod must not be the limit.
        .layer(axum::extract::DefaultBodyLimit::max(256 << 20))
        .layer(axum::middleware::map_response(move |mut res: Response| {
            let v = pod_header.clone();
            async move {
                res.headers_mut().insert(POD_HEADER, v);
                res
            }
        }))
        .with_state(pod)
}
