//! The HTTP API: the feed, lookups, learned entries, debug views and
//! `/metrics`.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming as Body;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::TokioIo;
use kvroute_core::feed::{self, LearnedBatch};
use kvroute_core::feed_client::FeedRequest;
use tokio::net::TcpListener;

use super::Shared;
use crate::auth::Refusal;
use crate::index::Index;
use crate::lookup;

pub(super) async fn serve_http(listener: TcpListener, shared: Shared) {
    loop {
        let (stream, peer) = match listener.accept().await {
            Ok(s) => s,
            Err(_) => {
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let shared = shared.clone();
        tokio::spawn(async move {
            let svc = hyper::service::service_fn(move |req| {
                let shared = shared.clone();
                async move { Ok::<_, Infallible>(route(req, shared, peer).await) }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .serve_connection(TokioIo::new(stream), svc)
                .await;
        });
    }
}

fn respond(
    status: StatusCode,
    content_type: &str,
    body: impl Into<Bytes>,
) -> Response<Full<Bytes>> {
    let mut r = Response::new(Full::new(body.into()));
    *r.status_mut() = status;
    if let Ok(v) = hyper::header::HeaderValue::from_str(content_type) {
        r.headers_mut().insert(hyper::header::CONTENT_TYPE, v);
    }
    r
}

async fn route(req: Request<Body>, shared: Shared, peer: SocketAddr) -> Response<Full<Bytes>> {
    let path = req.uri().path().to_owned();
    let query = req.uri().query().map(str::to_owned);
    match (req.method(), path.as_str()) {
        (&Method::GET, "/v1/feed") => {
            let request = match FeedRequest::parse(query.as_deref()) {
                Ok(r) => r,
                Err(e) => return respond(StatusCode::BAD_REQUEST, "text/plain", e),
            };
            let message = shared.lock().feed(&request);
            let body = feed::encode_message(&message);
            shared.metrics.feed_bytes.inc_by(body.len() as u64);
            shared
                .metrics
                .feed_response_bytes
                .observe(body.len() as f64);
            respond(StatusCode::OK, "application/octet-stream", body)
        }
        (&Method::POST, "/v1/learned") => post_learned(req, &shared, peer).await,
        (&Method::POST, "/v1/lookup") => post_lookup(req, &shared).await,
        (&Method::GET, "/healthz") => respond(StatusCode::OK, "text/plain", "ok\n"),
        (&Method::GET, "/metrics") => {
            {
                let ix = shared.lock();
                ix.update_gauges();
                ix.update_memory_gauge();
            }
            respond(
                StatusCode::OK,
                "application/openmetrics-text; version=1.0.0; charset=utf-8",
                shared.metrics.encode(),
            )
        }
        (&Method::GET, "/v1/debug/pods") => {
            let now = shared.now_ms();
            let pods = shared.lock().debug_pods(now);
            match serde_json::to_vec(&pods) {
                Ok(b) => respond(StatusCode::OK, "application/json", b),
                Err(e) => respond(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    "text/plain",
                    e.to_string(),
                ),
            }
        }
        (
            _,
            "/v1/feed" | "/v1/learned" | "/v1/lookup" | "/healthz" | "/metrics" | "/v1/debug/pods",
        ) => respond(
            StatusCode::METHOD_NOT_ALLOWED,
            "text/plain",
            "method not allowed",
        ),
        _ => respond(StatusCode::NOT_FOUND, "text/plain", "not found"),
    }
}

/// `POST /v1/lookup`: the candidate pods for a prompt's block hashes (see
/// [`crate::lookup`]). Read-only, so open to any proxy, like the feed.
async fn post_lookup(req: Request<Body>, shared: &Shared) -> Response<Full<Bytes>> {
    let body = match Limited::new(req.into_body(), lookup::MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            shared.metrics.lookup("bad_request");
            return respond(
                StatusCode::PAYLOAD_TOO_LARGE,
                "text/plain",
                "body too large",
            );
        }
    };
    let started = Instant::now();
    let request = match lookup::parse_request(&body) {
        Ok(r) => r,
        Err(e) => {
            shared.metrics.lookup("bad_request");
            return respond(StatusCode::BAD_REQUEST, "text/plain", e);
        }
    };
    let answer = lookup::lookup(&shared.lock(), &request);
    match serde_json::to_vec(&answer) {
        Ok(b) => {
            shared.metrics.lookup("answered");
            shared
                .metrics
                .lookup_seconds
                .observe(started.elapsed().as_secs_f64());
            respond(StatusCode::OK, "application/json", b)
        }
        Err(e) => respond(
            StatusCode::INTERNAL_SERVER_ERROR,
            "text/plain",
            e.to_string(),
        ),
    }
}

/// Seconds between two log lines about refused learned writes (each one is counted).
const REFUSAL_LOG_INTERVAL_MS: u64 = 10_000;

/// `POST /v1/learned`: authenticated first (before the body is read), then
/// decoded; hashes that pods report (token domain) are dropped and counted.
async fn post_learned(
    req: Request<Body>,
    shared: &Shared,
    peer: SocketAddr,
) -> Response<Full<Bytes>> {
    let authorization = req
        .headers()
        .get(hyper::header::AUTHORIZATION)
        .map(|v| v.as_bytes());
    if let Err(refusal) = shared.learned_access.check(authorization) {
        return refuse_learned(shared, peer, refusal);
    }
    let body = match Limited::new(req.into_body(), shared.max_learned_body)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(_) => {
            return respond(
                StatusCode::PAYLOAD_TOO_LARGE,
                "text/plain",
                "body too large",
            )
        }
    };
    let mut batch = match feed::decode_learned(&body) {
        Ok(batch) => batch,
        Err(e) => {
            shared.metrics.decode_error("learned");
            return respond(StatusCode::BAD_REQUEST, "text/plain", e.to_string());
        }
    };
    let now = shared.now_ms();
    let mut ix = shared.lock();
    let token_domain = drop_token_domain(&ix, &mut batch);
    shared
        .metrics
        .learned_token_domain
        .inc_by(token_domain as u64);
    let (accepted, rejected) = ix.apply_learned(&batch, now);
    respond(
        StatusCode::OK,
        "application/json",
        format!(
            "{{\"accepted\":{accepted},\"rejected\":{rejected},\"token_domain\":{token_domain}}}"
        ),
    )
}

/// Counts a refused POST /v1/learned, logs it (at most every
/// `REFUSAL_LOG_INTERVAL_MS`), and answers with the status that tells the
/// proxy why: 403 (writes off), 503 (token file unreadable), 401 otherwise.
fn refuse_learned(shared: &Shared, peer: SocketAddr, refusal: Refusal) -> Response<Full<Bytes>> {
    shared.metrics.learned_unauthorized(refusal.reason());
    let now = shared.now_ms().max(1);
    let last = shared.refusal_logged_ms.load(Ordering::Relaxed);
    if last == 0 || now.saturating_sub(last) >= REFUSAL_LOG_INTERVAL_MS {
        shared.refusal_logged_ms.store(now, Ordering::Relaxed);
        eprintln!(
            "kvroute-indexer: POST /v1/learned from {peer} refused: {} \
             (counted in kvroute_indexer_learned_unauthorized_total; logged at most every {} s)",
            refusal.reason(),
            REFUSAL_LOG_INTERVAL_MS / 1000
        );
    }
    match refusal {
        Refusal::WritesDisabled => respond(
            StatusCode::FORBIDDEN,
            "text/plain",
            "learned writes are disabled: the indexer has no --learned-token-file",
        ),
        Refusal::TokenUnavailable => respond(
            StatusCode::SERVICE_UNAVAILABLE,
            "text/plain",
            "the learned-writer token file is unreadable",
        ),
        _ => {
            let mut r = respond(
                StatusCode::UNAUTHORIZED,
                "text/plain",
                format!("unauthorized: {}", refusal.reason()),
            );
            r.headers_mut().insert(
                hyper::header::WWW_AUTHENTICATE,
                hyper::header::HeaderValue::from_static("Bearer"),
            );
            r
        }
    }
}

/// Removes the hashes some pod reports through KV events: they are token
/// blocks, whose locations only the pods' events may state (byte chunks
/// never collide with them). Returns how many were removed.
fn drop_token_domain(ix: &Index, batch: &mut LearnedBatch) -> usize {
    let mut dropped = 0;
    for (_, hashes) in &mut batch.entries {
        let before = hashes.len();
        hashes.retain(|&h| !ix.reported_by_a_pod(h));
        dropped += before - hashes.len();
    }
    dropped
}
