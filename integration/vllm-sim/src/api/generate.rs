//! Generation: a request submitted to the engine, its tokens collected or
//! streamed back as server-sent events.

use std::sync::Arc;
use std::time::Instant;

use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{header, HeaderValue};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use super::error::{ApiError, ApiResult};
use super::request::{
    cache_salt, chat_prompt, check_lengths, check_model, completion_prompts, parse_body, sampling,
};
use super::Pod;
use crate::engine::{Finish, HashKeys, NewRequest, Out, Sink};

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
pub(super) async fn off_thread<T: Send + 'static>(
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

pub(super) async fn chat_completions(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    generate(pod, body, true)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

pub(super) async fn completions(State(pod): State<Arc<Pod>>, body: Bytes) -> Response {
    generate(pod, body, false)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}
