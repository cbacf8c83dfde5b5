//! The running service: ZMQ ingestion, replay, discovery, load scraping,
//! expiry, and the HTTP API. All state lives in one [`Index`] behind a mutex;
//! one applier task owns the write path.

use std::collections::{HashMap, HashSet};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Full, Limited};
use hyper::body::Incoming as Body;
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvroute_core::feed::{self, LearnedBatch};
use kvroute_core::feed_client::FeedRequest;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

use crate::auth::{Refusal, TokenFile, WriteAccess};
use crate::config::{bind_endpoint, Args, PodSource};
use crate::index::{new_epoch, origin, Incoming, Index, ReplayRequest};
use crate::lookup;
use crate::metrics::Metrics;
use crate::scrape::parse_vllm_metrics;
use crate::vllm_wire::decode_seq;

/// Errors that stop the service at start-up.
#[derive(Debug)]
pub enum ServiceError {
    /// A ZMQ socket could not bind or connect.
    Zmq { endpoint: String, error: String },
    /// The HTTP listener could not bind.
    Listen { addr: SocketAddr, error: String },
    /// A flag value is malformed.
    BadFlag { flag: &'static str, value: String },
    /// `--learned-token-file` gives no usable token.
    TokenFile { path: String, error: String },
}

impl std::fmt::Display for ServiceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServiceError::Zmq { endpoint, error } => write!(f, "zmq {endpoint}: {error}"),
            ServiceError::Listen { addr, error } => write!(f, "listen {addr}: {error}"),
            ServiceError::BadFlag { flag, value } => write!(f, "--{flag}: bad value {value:?}"),
            ServiceError::TokenFile { path, error } => {
                write!(f, "--learned-token-file {path}: {error}")
            }
        }
    }
}

impl std::error::Error for ServiceError {}

enum Msg {
    Event(Incoming),
    ReplayDone(ReplayRequest, Result<Vec<(u64, Vec<u8>)>, String>),
}

#[derive(Clone)]
struct Shared {
    index: Arc<Mutex<Index>>,
    metrics: Metrics,
    start: Instant,
    max_learned_body: usize,
    learned_access: Arc<WriteAccess>,
    /// When a refused write was last logged (ms since start; 0: never).
    refusal_logged_ms: Arc<AtomicU64>,
}

impl Shared {
    fn now_ms(&self) -> u64 {
        u64::try_from(self.start.elapsed().as_millis()).unwrap_or(u64::MAX)
    }

    fn lock(&self) -> MutexGuard<'_, Index> {
        self.index.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// Runs the service until SIGINT/SIGTERM.
pub async fn run(args: Args) -> Result<(), ServiceError> {
    let metrics = Metrics::new();
    let epoch = new_epoch();
    let mut index = Index::new(args.index_config(), metrics.clone(), epoch);
    for pod in &args.pods {
        add_source_pod(
            &mut index,
            pod,
            &pod.address,
            &args.model,
            origin::STATIC,
            0,
        );
    }
    let mut connects = Vec::new();
    for (endpoint, pod) in &args.zmq_connect {
        let identity = match pod {
            Some(pod) => {
                add_source_pod(
                    &mut index,
                    pod,
                    &pod.address,
                    &args.model,
                    origin::CONNECT,
                    0,
                );
                let model = pod.model.clone().or_else(|| args.model.clone());
                Some((pod.address.clone(), model.unwrap_or_default()))
            }
            None => None,
        };
        connects.push((endpoint.clone(), identity));
    }
    for spec in &args.replay_endpoints {
        let Some((address, endpoint)) = spec.split_once('=') else {
            return Err(ServiceError::BadFlag {
                flag: "replay-endpoint",
                value: spec.clone(),
            });
        };
        index.set_replay_endpoint(address, endpoint);
    }
    let learned_access = learned_write_access(&args)?;
    let shared = Shared {
        index: Arc::new(Mutex::new(index)),
        metrics: metrics.clone(),
        start: Instant::now(),
        max_learned_body: args.max_learned_body_bytes,
        learned_access: Arc::new(learned_access),
        refusal_logged_ms: Arc::new(AtomicU64::new(0)),
    };

    let (tx, rx) = mpsc::channel::<Msg>(args.queue_capacity.max(1));

    // ZMQ sockets: bound SUB(s), and one connected SUB per pod that binds.
    for endpoint in args.zmq_bind.iter().filter(|e| e.as_str() != "none") {
        let mut sock = SubSocket::new();
        let real = bind_endpoint(endpoint);
        let bound = sock.bind(&real).await.map_err(|e| ServiceError::Zmq {
            endpoint: endpoint.clone(),
            error: e.to_string(),
        })?;
        sock.subscribe("").await.map_err(|e| ServiceError::Zmq {
            endpoint: endpoint.clone(),
            error: e.to_string(),
        })?;
        eprintln!("kvroute-indexer: zmq SUB bound at {bound}");
        tokio::spawn(receive(sock, None, tx.clone(), shared.clone()));
    }
    for (endpoint, identity) in connects {
        let mut sock = SubSocket::new();
        sock.subscribe("").await.map_err(|e| ServiceError::Zmq {
            endpoint: endpoint.clone(),
            error: e.to_string(),
        })?;
        let tx = tx.clone();
        let shared2 = shared.clone();
        tokio::spawn(async move {
            // Retry until the pod's publisher is up; the socket reconnects by itself after.
            loop {
                match sock.connect(&endpoint).await {
                    Ok(()) => break,
                    Err(e) => {
                        eprintln!("kvroute-indexer: zmq connect {endpoint}: {e}; retrying");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
            eprintln!("kvroute-indexer: zmq SUB connected to {endpoint}");
            receive(sock, identity, tx, shared2).await;
        });
    }

    tokio::spawn(apply_loop(
        rx,
        tx.clone(),
        shared.clone(),
        args.replay_timeout_ms,
        args.queue_capacity,
    ));
    tokio::spawn(housekeeping(shared.clone()));
    if args.scrape_interval_ms > 0 {
        tokio::spawn(scrape_loop(
            shared.clone(),
            Duration::from_millis(args.scrape_interval_ms),
            Duration::from_millis(args.scrape_timeout_ms.max(1)),
            args.scrape_path.clone(),
        ));
    }
    if !args.dns_services.is_empty() {
        tokio::spawn(dns_loop(
            shared.clone(),
            args.dns_services.clone(),
            args.model.clone(),
            Duration::from_millis(args.dns_interval_ms.max(100)),
        ));
    }

    let listener = TcpListener::bind(args.listen)
        .await
        .map_err(|e| ServiceError::Listen {
            addr: args.listen,
            error: e.to_string(),
        })?;
    let local = listener.local_addr().map_err(|e| ServiceError::Listen {
        addr: args.listen,
        error: e.to_string(),
    })?;
    eprintln!("kvroute-indexer: HTTP on {local}, feed epoch {epoch}");
    tokio::spawn(serve_http(listener, shared.clone()));

    shutdown_signal().await;
    eprintln!("kvroute-indexer: shutting down");
    Ok(())
}

/// The write policy of POST /v1/learned the flags select.
fn learned_write_access(args: &Args) -> Result<WriteAccess, ServiceError> {
    if let Some(path) = &args.learned_token_file {
        let file = TokenFile::open(path).map_err(|e| ServiceError::TokenFile {
            path: path.display().to_string(),
            error: e.to_string(),
        })?;
        return Ok(WriteAccess::Token(file));
    }
    if args.allow_unauthenticated_learned {
        let exposure = if args.listen.ip().is_loopback() {
            "from this host"
        } else {
            "from anyone who reaches the listen address: any of them can steer every proxy"
        };
        eprintln!(
            "kvroute-indexer: POST /v1/learned accepts writes without a token {exposure} \
             (--allow-unauthenticated-learned)"
        );
        return Ok(WriteAccess::Open);
    }
    eprintln!(
        "kvroute-indexer: no --learned-token-file: POST /v1/learned is refused \
         (proxies share no learned entries)"
    );
    Ok(WriteAccess::Closed)
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        match signal(SignalKind::terminate()) {
            Ok(mut term) => {
                tokio::select! {
                    _ = term.recv() => {}
                    _ = tokio::signal::ctrl_c() => {}
                }
            }
            Err(_) => {
                let _ = tokio::signal::ctrl_c().await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = tokio::signal::ctrl_c().await;
    }
}

/// Receives from one SUB socket into the bounded queue; drops (counted) when full.
async fn receive(
    mut sock: SubSocket,
    identity: Option<(String, String)>,
    tx: mpsc::Sender<Msg>,
    shared: Shared,
) {
    loop {
        let msg = match sock.recv().await {
            Ok(m) => m,
            Err(_) => {
                // A peer went away (or nothing is connected yet); keep receiving.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let received_ms = shared.now_ms();
        let mut frames = msg.into_vec();
        if frames.len() != 3 {
            shared.metrics.messages_received.inc();
            shared.metrics.decode_error("frame_count");
            continue;
        }
        let payload = frames.pop().map(|b| b.to_vec()).unwrap_or_default();
        let seq = frames.pop().map(|b| b.to_vec()).unwrap_or_default();
        let topic = frames.pop().map(|b| b.to_vec()).unwrap_or_default();
        let incoming = Incoming {
            topic,
            seq,
            payload,
            identity: identity.clone(),
            received_ms,
        };
        match tx.try_send(Msg::Event(incoming)) {
            Ok(()) => {}
            Err(mpsc::error::TrySendError::Full(_)) => {
                shared.metrics.messages_received.inc();
                shared.metrics.dropped("queue_full", 1);
            }
            Err(mpsc::error::TrySendError::Closed(_)) => return,
        }
    }
}

/// The single writer: applies queued messages in batches under one lock.
async fn apply_loop(
    mut rx: mpsc::Receiver<Msg>,
    tx: mpsc::Sender<Msg>,
    shared: Shared,
    replay_timeout_ms: u64,
    capacity: usize,
) {
    let mut batch = Vec::with_capacity(256);
    loop {
        if rx.recv_many(&mut batch, 256).await == 0 {
            return;
        }
        let mut replays = Vec::new();
        {
            let mut ix = shared.lock();
            let now = shared.now_ms();
            for m in batch.drain(..) {
                match m {
                    Msg::Event(inc) => {
                        if let Some(req) = ix.handle(&inc, now) {
                            replays.push(req);
                        }
                    }
                    Msg::ReplayDone(req, result) => ix.finish_replay(&req, result, now),
                }
            }
        }
        shared
            .metrics
            .queue_depth
            .set(i64::try_from(capacity.saturating_sub(tx.capacity())).unwrap_or(0));
        for req in replays {
            let tx = tx.clone();
            let metrics = shared.metrics.clone();
            tokio::spawn(async move {
                let timeout = Duration::from_millis(replay_timeout_ms.max(1));
                let result = match tokio::time::timeout(
                    timeout,
                    replay(&req.endpoint, req.from_seq),
                )
                .await
                {
                    Ok(r) => r,
                    Err(_) => {
                        metrics.replay("timeout");
                        Err("timeout".to_owned())
                    }
                };
                let _ = tx.send(Msg::ReplayDone(req, result)).await;
            });
        }
    }
}

/// One replay exchange with a vLLM replay ROUTER: send `["", start_seq]`,
/// read `["", topic, seq, payload]` (≥ 0.26) or `["", seq, payload]` (≤ 0.20)
/// until the end marker (seq = 2^64-1).
pub async fn replay(endpoint: &str, from_seq: u64) -> Result<Vec<(u64, Vec<u8>)>, String> {
    let mut sock = DealerSocket::new();
    sock.connect(endpoint).await.map_err(|e| e.to_string())?;
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&from_seq.to_be_bytes()),
    ])
    .map_err(|e| e.to_string())?;
    sock.send(request).await.map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    loop {
        let msg = sock.recv().await.map_err(|e| e.to_string())?;
        let frames = msg.into_vec();
        let (seq, payload) = match frames.len() {
            4 => (&frames[2], &frames[3]),
            3 => (&frames[1], &frames[2]),
            n => return Err(format!("replay reply of {n} frames")),
        };
        let seq = decode_seq(seq).map_err(|e| e.to_string())?;
        if seq == u64::MAX {
            return Ok(out);
        }
        out.push((seq, payload.to_vec()));
    }
}

/// Expires learned entries and silent pods; refreshes the memory gauge.
async fn housekeeping(shared: Shared) {
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    loop {
        tick.tick().await;
        let ix = &mut *shared.lock();
        ix.expire(shared.now_ms());
        ix.update_memory_gauge();
    }
}

fn http_client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

async fn scrape_loop(shared: Shared, interval: Duration, timeout: Duration, path: String) {
    let client = http_client();
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let pods: Vec<String> = shared
            .lock()
            .pod_addresses()
            .into_iter()
            .map(|(a, _)| a)
            .collect();
        let mut tasks = tokio::task::JoinSet::new();
        for address in pods {
            let client = client.clone();
            let path = path.clone();
            tasks.spawn(async move {
                let r = tokio::time::timeout(timeout, scrape(&client, &address, &path)).await;
                (address, r.ok().flatten())
            });
        }
        while let Some(done) = tasks.join_next().await {
            let Ok((address, load)) = done else { continue };
            shared.metrics.scrapes.inc();
            match load {
                Some(load) => {
                    let now = shared.now_ms();
                    shared.lock().set_load(&address, load, now);
                }
                None => {
                    shared.metrics.scrape_errors.inc();
                }
            }
        }
    }
}

async fn scrape(
    client: &Client<hyper_util::client::legacy::connect::HttpConnector, Empty<Bytes>>,
    address: &str,
    path: &str,
) -> Option<crate::index::Load> {
    let uri: hyper::Uri = format!("http://{address}{path}").parse().ok()?;
    let resp = client.get(uri).await.ok()?;
    if !resp.status().is_success() {
        return None;
    }
    let body = Limited::new(resp.into_body(), 16 << 20)
        .collect()
        .await
        .ok()?
        .to_bytes();
    parse_vllm_metrics(std::str::from_utf8(&body).ok()?)
}

/// Adds the pod at `address` that `source` names (itself, or a record of its
/// Service), with the source's model (else `default_model`) and speed.
fn add_source_pod(
    index: &mut Index,
    source: &PodSource,
    address: &str,
    default_model: &Option<String>,
    origin: u8,
    now_ms: u64,
) {
    let model = source.model.as_deref().or(default_model.as_deref());
    index.add_pod(address, model, origin, now_ms);
    if let Some(speed) = source.speed {
        index.set_speed(address, speed);
    }
}

/// Resolves every headless Service each `interval`: a record new to DNS
/// becomes a pod with its Service's model and speed, a pod no Service
/// resolves to any more loses its DNS origin. A Service whose resolution
/// fails keeps its last records.
async fn dns_loop(
    shared: Shared,
    services: Vec<PodSource>,
    default_model: Option<String>,
    interval: Duration,
) {
    let mut tick = tokio::time::interval(interval);
    let mut records: Vec<Option<HashSet<String>>> = vec![None; services.len()];
    loop {
        tick.tick().await;
        for (service, last) in services.iter().zip(records.iter_mut()) {
            let name = service.address.as_str();
            match tokio::net::lookup_host(name).await {
                Ok(addrs) => *last = Some(addrs.map(|a| a.to_string()).collect()),
                Err(e) => {
                    eprintln!("kvroute-indexer: DNS {name}: {e}");
                    shared.metrics.rejected("dns_error");
                }
            }
        }
        let now = shared.now_ms();
        let mut ix = shared.lock();
        let known: HashMap<String, u8> = ix.pod_addresses().into_iter().collect();
        let mut resolved = HashSet::new();
        for (service, last) in services.iter().zip(&records) {
            for address in last.iter().flatten() {
                if known.get(address).is_none_or(|o| o & origin::DNS == 0)
                    && !resolved.contains(address)
                {
                    add_source_pod(&mut ix, service, address, &default_model, origin::DNS, now);
                }
                resolved.insert(address.clone());
            }
        }
        for (address, origins) in known {
            if origins & origin::DNS != 0 && !resolved.contains(&address) {
                ix.remove_origin(&address, origin::DNS);
            }
        }
    }
}

// ------------------------------------------------------------------ HTTP

async fn serve_http(listener: TcpListener, shared: Shared) {
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
        return match refusal {
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
        };
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
