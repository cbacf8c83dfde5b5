//! vllm-sim: one process serving N simulated vLLM pods. See README.md.

mod api;
mod engine;
mod events;
mod hash;
mod kv;
mod metrics;
mod tokenize;

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use tokio::sync::Notify;

use crate::api::Pod;
use crate::engine::{CostModel, Engine, EngineConfig, PrefixStats};
use crate::events::Publisher;
use crate::tokenize::Tokenizer;

/// Simulated vLLM pod(s): OpenAI API, paged KV cache with prefix caching, KV events.
#[derive(Parser, Debug, Clone)]
#[command(name = "vllm-sim", version)]
struct Args {
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// HTTP port of the first pod; pod i listens on port + i.
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Number of pods served by this process (each its own engine, KV cache and publisher).
    #[arg(long, default_value_t = 1)]
    pods: u16,
    #[arg(long, default_value = "Qwen/Qwen3-32B")]
    model: String,
    /// Names accepted in the `model` field (default: --model). Repeatable.
    #[arg(long, num_args = 1..)]
    served_model_name: Vec<String>,
    #[arg(long, default_value_t = 16)]
    block_size: usize,
    /// KV blocks per pod (19,208 × 16 = 307,328 tokens: Qwen3-32B on 2×H100, llm-d's reference).
    /// One value for every pod, or one per pod (`19208,9604,…`) for unequal capacities.
    #[arg(long, num_args = 1.., value_delimiter = ',', default_value = "19208")]
    num_gpu_blocks: Vec<usize>,
    #[arg(long, default_value_t = 256)]
    max_num_seqs: usize,
    #[arg(long, default_value_t = 8192)]
    max_num_batched_tokens: usize,
    #[arg(long, default_value_t = 40_960)]
    max_model_len: usize,
    /// HuggingFace tokenizer.json; without it a deterministic fallback tokenizer is used.
    #[arg(long)]
    tokenizer: Option<String>,
    /// ZMQ endpoint for KV events (vLLM's rule: '*', '::', ipc:// bind; anything else connects).
    #[arg(long)]
    kv_events_endpoint: Option<String>,
    #[arg(long, default_value = "kv@{host}:{port}@{model}")]
    kv_events_topic_template: String,
    /// ROUTER replay socket port of pod 0; pod i binds port + i.
    #[arg(long)]
    kv_events_replay_port: Option<u16>,
    /// Wall seconds per simulated second (< 1 runs faster than real time).
    #[arg(long, default_value_t = 1.0)]
    time_scale: f64,
    /// Output tokens per streamed chunk after the first (coarse chunks keep CPU low).
    #[arg(long, default_value_t = 16)]
    stream_interval: usize,
    /// max_tokens when a request does not set it (capped by max_model_len - prompt).
    #[arg(long, default_value_t = 256)]
    default_max_tokens: usize,
    /// Cost model: fixed cost per step, the weight read (ms).
    #[arg(long, default_value_t = CostModel::default().step_overhead_ms)]
    step_overhead_ms: f64,
    /// Cost model: prefill cost per prompt token (µs).
    #[arg(long, default_value_t = CostModel::default().prefill_us_per_token)]
    prefill_us_per_token: f64,
    /// Cost model: prefill attention per (new token × context token) pair (ns).
    #[arg(long, default_value_t = CostModel::default().attn_ns_per_pair)]
    attn_ns_per_pair: f64,
    /// Cost model: decode KV read per context token per running sequence (ns).
    #[arg(long, default_value_t = CostModel::default().kv_read_ns_per_token)]
    kv_read_ns_per_token: f64,
    /// Relative speed of each pod (prefill and decode): every step takes 1/speed as long.
    /// One value for every pod, or one per pod (`1,1,0.5,0.5`) for a mixed fleet.
    #[arg(long, num_args = 1.., value_delimiter = ',', default_value = "1.0")]
    speed: Vec<f64>,
    /// When prefix-cache queries/hits are counted: every lookup (vLLM before mid-2026) or
    /// once at admission (vLLM since).
    #[arg(long, value_enum, default_value_t = PrefixStats::Lookup)]
    prefix_cache_stats: PrefixStats,
    /// Emulate vLLM's OffloadingConnector with a CPU tier of this many blocks: its events
    /// (placeholder BlockStored with medium "CPU", CPU BlockRemoved) join the GPU events.
    #[arg(long, default_value_t = 0)]
    kv_offload_cpu_blocks: usize,
    /// A hybrid model: one sliding-window KV-cache group per value (window in tokens) beside
    /// the full-attention group 0; events carry group_idx and kv_cache_spec_kind per group.
    #[arg(long, num_args = 1.., value_delimiter = ',')]
    sliding_window_groups: Vec<u32>,
}

#[derive(Debug)]
enum SimError {
    Config(String),
    Io(String, std::io::Error),
    Zmq(String, zeromq::ZmqError),
}

impl std::fmt::Display for SimError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SimError::Config(s) => write!(f, "{s}"),
            SimError::Io(what, e) => write!(f, "{what}: {e}"),
            SimError::Zmq(what, e) => write!(f, "{what}: {e}"),
        }
    }
}

fn validate(a: &Args) -> Result<(), SimError> {
    let bad = |s: &str| Err(SimError::Config(s.to_string()));
    if a.pods == 0 {
        return bad("--pods must be at least 1");
    }
    if a.num_gpu_blocks.len() != 1 && a.num_gpu_blocks.len() != usize::from(a.pods) {
        return bad("--num-gpu-blocks takes one value, or one per pod");
    }
    if a.block_size == 0
        || a.num_gpu_blocks.contains(&0)
        || a.max_num_seqs == 0
        || a.max_num_batched_tokens == 0
    {
        return bad("--block-size, --num-gpu-blocks, --max-num-seqs and --max-num-batched-tokens must be positive");
    }
    if a.speed.len() != 1 && a.speed.len() != usize::from(a.pods) {
        return bad("--speed takes one value, or one per pod");
    }
    if a.speed.iter().any(|s| !(s.is_finite() && *s > 0.0)) {
        return bad("--speed values must be positive numbers");
    }
    if a.max_model_len < 2 {
        return bad("--max-model-len must be at least 2");
    }
    if !(a.time_scale > 0.0 && a.time_scale.is_finite()) {
        return bad("--time-scale must be a positive number");
    }
    if a.stream_interval == 0 {
        return bad("--stream-interval must be at least 1");
    }
    if a.sliding_window_groups.len() > 31 || a.sliding_window_groups.contains(&0) {
        return bad("--sliding-window-groups takes at most 31 positive windows");
    }
    if u32::from(a.port) + u32::from(a.pods) > 65_536 {
        return bad("--port + --pods exceeds 65535");
    }
    Ok(())
}

/// KV blocks of pod `i` (`--num-gpu-blocks` has one value or one per pod; validated).
fn pod_blocks(a: &Args, i: u16) -> usize {
    let v = &a.num_gpu_blocks;
    v.get(usize::from(i)).or(v.first()).copied().unwrap_or(1)
}

/// Speed of pod `i` (`--speed` has one value or one per pod; validated).
fn pod_speed(a: &Args, i: u16) -> f64 {
    let v = &a.speed;
    v.get(usize::from(i)).or(v.first()).copied().unwrap_or(1.0)
}

/// The engine loop of one pod: schedule (and publish the step's events, as vLLM does at
/// schedule time), wait until the step's end on the simulated clock, commit.
///
/// The clock is deadline-based: while the pod is busy each step ends at the previous step's
/// end plus its simulated duration (× time scale), whatever the wall time spent scheduling
/// or waking up, so overhead is not lost from simulated time; a late wake-up is made up by
/// the next steps. When idle, the clock restarts at the next request.
async fn engine_loop(pod: Arc<Pod>, time_scale: f64) {
    let mut clock: Option<Instant> = None;
    loop {
        let plan = {
            let mut e = pod.engine();
            let plan = e.schedule();
            pod.publish_pending(&mut e);
            plan
        };
        if plan.items.is_empty() {
            clock = None;
            pod.notify.notified().await;
            continue;
        }
        let start = clock.unwrap_or_else(Instant::now);
        let end = start + Duration::from_secs_f64(plan.seconds * time_scale);
        tokio::time::sleep_until(end.into()).await;
        clock = Some(end);
        pod.engine().complete(&plan, end);
    }
}

/// Runs a pod's engine loop on a thread of its own (a current-thread runtime): HTTP work,
/// other pods' steps and their wake-ups never delay this pod's clock.
fn spawn_engine(pod: Arc<Pod>, time_scale: f64, i: u16) -> Result<(), SimError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .build()
        .map_err(|e| SimError::Io(format!("engine runtime of pod {i}"), e))?;
    std::thread::Builder::new()
        .name(format!("engine-{i}"))
        .spawn(move || rt.block_on(engine_loop(pod, time_scale)))
        .map_err(|e| SimError::Io(format!("engine thread of pod {i}"), e))?;
    Ok(())
}

async fn start_pod(
    a: &Args,
    i: u16,
    tokenizer: Arc<Tokenizer>,
    vocab: Arc<HashMap<u32, String>>,
    output_ids: Vec<u32>,
) -> Result<(), SimError> {
    let port = a.port + i;
    let addr = format!("{}:{}", a.host, port);
    let served = if a.served_model_name.is_empty() {
        vec![a.model.clone()]
    } else {
        a.served_model_name.clone()
    };
    let first_name = served.first().cloned().unwrap_or_default();
    let topic = a
        .kv_events_topic_template
        .replace("{host}", &a.host)
        .replace("{port}", &port.to_string())
        .replace("{model}", &first_name);
    let encoding = events::HashEncoding::from_env();
    let publisher = match &a.kv_events_endpoint {
        Some(ep) => {
            let ep = events::pod_endpoint(ep, i);
            events::start_publisher(ep.clone(), &topic, encoding)
                .await
                .map_err(|e| SimError::Zmq(format!("kv events endpoint {ep}"), e))?
        }
        None => Publisher::detached(&topic, encoding),
    };
    if let Some(rp) = a.kv_events_replay_port {
        let ep = format!("tcp://{}:{}", a.host, u32::from(rp) + u32::from(i));
        events::start_replay(ep.clone(), topic.clone(), publisher.replay_buffer())
            .await
            .map_err(|e| SimError::Zmq(format!("kv events replay {ep}"), e))?;
    }
    let cfg = EngineConfig {
        block_size: a.block_size,
        num_gpu_blocks: pod_blocks(a, i),
        max_num_seqs: a.max_num_seqs,
        max_num_batched_tokens: a.max_num_batched_tokens,
        max_model_len: a.max_model_len,
        stream_interval: a.stream_interval,
        cost: CostModel {
            step_overhead_ms: a.step_overhead_ms,
            prefill_us_per_token: a.prefill_us_per_token,
            attn_ns_per_pair: a.attn_ns_per_pair,
            kv_read_ns_per_token: a.kv_read_ns_per_token,
            speed: pod_speed(a, i),
        },
        time_scale: a.time_scale,
        prefix_stats: a.prefix_cache_stats,
        offload_cpu_blocks: a.kv_offload_cpu_blocks,
        sliding_windows: a.sliding_window_groups.clone(),
    };
    let created = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let pod = Arc::new(Pod {
        addr: addr.clone(),
        served_names: served,
        model: a.model.clone(),
        engine: Mutex::new(Engine::new(cfg, output_ids)),
        notify: Notify::new(),
        publisher: Mutex::new(publisher),
        tokenizer,
        vocab,
        default_max_tokens: a.default_max_tokens,
        created,
        counter: AtomicU64::new(0),
    });
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|e| SimError::Io(format!("bind {addr}"), e))?;
    spawn_engine(pod.clone(), a.time_scale, i)?;
    let app = api::router(pod);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            eprintln!("vllm-sim: server {addr} stopped: {e}");
        }
    });
    Ok(())
}

async fn run(a: Args) -> Result<(), SimError> {
    validate(&a)?;
    let tokenizer =
        Arc::new(Tokenizer::load(a.tokenizer.as_deref()).map_err(|e| SimError::Config(e.0))?);
    let out = tokenizer.output_vocab();
    let output_ids: Vec<u32> = out.iter().map(|(id, _)| *id).collect();
    let vocab: Arc<HashMap<u32, String>> = Arc::new(out.into_iter().collect());
    for i in 0..a.pods {
        start_pod(&a, i, tokenizer.clone(), vocab.clone(), output_ids.clone()).await?;
    }
    eprintln!(
        "vllm-sim: {} pod(s) on {}:{}..{} model {} ({:?} blocks × {} tokens, speed {:?}, time scale {})",
        a.pods,
        a.host,
        a.port,
        u32::from(a.port) + u32::from(a.pods) - 1,
        a.model,
        a.num_gpu_blocks,
        a.block_size,
        a.speed,
        a.time_scale
    );
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(|e| SimError::Io("signal".into(), e))?;
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    let args = Args::parse();
    let rt = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("vllm-sim: cannot start runtime: {e}");
            return std::process::ExitCode::from(1);
        }
    };
    match rt.block_on(run(args)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("vllm-sim: {e}");
            std::process::ExitCode::from(2)
        }
    }
}
