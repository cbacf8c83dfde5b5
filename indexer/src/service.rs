//! The running service: ZMQ ingestion, replay, discovery, load scraping,
//! expiry, and the HTTP API. All state lives in one [`Index`] behind a mutex;
//! one applier task owns the write path. Submodules: `ingest` (events in),
//! `discovery` (pods and their load), `http_api`.

mod discovery;
mod http_api;
mod ingest;

pub use ingest::replay;

use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use tokio::net::TcpListener;
use tokio::sync::mpsc;
use zeromq::{Socket, SubSocket};

use crate::auth::{TokenFile, WriteAccess};
use crate::config::{bind_endpoint, Args};
use crate::index::{new_epoch, origin, Index};
use crate::metrics::Metrics;
use discovery::{add_source_pod, dns_loop, scrape_loop};
use http_api::serve_http;
use ingest::{apply_loop, receive, Msg};

/// Errors that stop the service at start-up.
#[derive(Debug)]
pub enum ServiceError {
    /// A ZMQ socket could not bind or connect.
    Zmq { endpoint: String, error: String },
    /// The HTTP listener could not bind.
    Listen { addr: SocketAddr, error: String },
    /// `--learned-token-file` gives no usable token.
    TokenFile { path: String, error: String },
}

impl std::fmt::Display for ServiceError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServiceError::Zmq { endpoint, error } => write!(f, "zmq {endpoint}: {error}"),
            ServiceError::Listen { addr, error } => write!(f, "listen {addr}: {error}"),
            ServiceError::TokenFile { path, error } => {
                write!(f, "--learned-token-file {path}: {error}")
            }
        }
    }
}

impl std::error::Error for ServiceError {}

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
    let connects = seed_index(&args, &mut index);
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

    start_subscribers(&args, connects, &tx, &shared).await?;
    start_background(&args, rx, &tx, &shared);
    start_http(&args, &shared, epoch).await?;
    shutdown_signal().await;
    eprintln!("kvroute-indexer: shutting down");
    Ok(())
}

/// A `--zmq-connect` endpoint and the pod (address, model) its events speak for, when the flag
/// names one.
type Connect = (String, Option<(String, String)>);

/// The pods the flags name (`--pod`, `--zmq-connect …=ADDRESS`) and their replay endpoints,
/// entered into `index`; the connected sockets to open, each with the pod it speaks for.
fn seed_index(args: &Args, index: &mut Index) -> Vec<Connect> {
    for pod in &args.pods {
        add_source_pod(index, pod, &pod.address, &args.model, origin::STATIC, 0);
    }
    let mut connects = Vec::new();
    for (endpoint, pod) in &args.zmq_connect {
        let identity = match pod {
            Some(pod) => {
                add_source_pod(index, pod, &pod.address, &args.model, origin::CONNECT, 0);
                let model = pod.model.clone().or_else(|| args.model.clone());
                Some((pod.address.clone(), model.unwrap_or_default()))
            }
            None => None,
        };
        connects.push((endpoint.clone(), identity));
    }
    for (address, endpoint) in &args.replay_endpoints {
        index.set_replay_endpoint(address, endpoint);
    }
    connects
}

/// Starts the ZMQ subscribers: a SUB bound at each `--zmq-bind` endpoint, and one connected SUB
/// per `--zmq-connect` endpoint (retried until the pod's publisher is up).
async fn start_subscribers(
    args: &Args,
    connects: Vec<Connect>,
    tx: &mpsc::Sender<Msg>,
    shared: &Shared,
) -> Result<(), ServiceError> {
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
        let shared = shared.clone();
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
            receive(sock, identity, tx, shared).await;
        });
    }
    Ok(())
}

/// Starts the event applier, housekeeping, and (when the flags ask) load scraping and DNS
/// discovery.
fn start_background(args: &Args, rx: mpsc::Receiver<Msg>, tx: &mpsc::Sender<Msg>, shared: &Shared) {
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
}

/// Binds the HTTP API (feed, lookup, learned, metrics) and serves it in the background.
async fn start_http(args: &Args, shared: &Shared, epoch: u64) -> Result<(), ServiceError> {
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
