//! vLLM's HTTP interface: OpenAI-compatible completions (streaming and not),
//! /tokenize, the /render endpoints, /v1/models, /health, /metrics, and the
//! simulator's /admin/flush. Errors use vLLM's body
//! `{"error": {"message", "type", "param", "code"}}` with vLLM's statuses.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use serde_json::{json, Map, Value};
use tokio::sync::Notify;

use crate::engine::Engine;
use crate::events::Publisher;
use crate::tokenize::Tokenizer;

mod error;
mod generate;
mod request;

use error::{ApiError, ApiResult};
use generate::{chat_completions, completions, off_thread};
use request::{chat_tokens, check_model, completion_prompts, opt_bool, parse_body, sampling};

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
