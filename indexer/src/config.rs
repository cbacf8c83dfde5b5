//! Command line of `kvroute-indexer` (every flag is documented with its
//! default in indexer/README.md).

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Parser;
use kvroute_core::address::{is_pod_address, POD_ADDRESS_RULE};
use kvroute_core::feed::MAX_SPEED;

use crate::index::IndexConfig;

/// Consumes vLLM KV-cache events and pod load; serves the block index to
/// kvroute's Envoy filters.
#[derive(Parser, Debug, Clone)]
#[command(name = "kvroute-indexer", version, about)]
pub struct Args {
    /// HTTP listen address (feed, learned, healthz, metrics, debug). Loopback
    /// by default: a deployment names the interface it serves on.
    #[arg(long, default_value = "127.0.0.1:8090")]
    pub listen: SocketAddr,

    /// File of bearer tokens accepted on POST /v1/learned, one per line
    /// (re-read when it changes). Without it, learned writes are refused.
    #[arg(long, value_name = "PATH")]
    pub learned_token_file: Option<PathBuf>,

    /// Accept POST /v1/learned without a token, from anyone who reaches the
    /// port. Only for a loopback-bound indexer or a trusted network.
    #[arg(long, conflicts_with = "learned_token_file")]
    pub allow_unauthenticated_learned: bool,

    /// ZMQ endpoint the SUB socket binds (vLLM pods connect to it).
    /// Repeatable; `none` disables binding. `*` means all interfaces.
    #[arg(long = "zmq-bind", default_value = "tcp://*:5557")]
    pub zmq_bind: Vec<String>,

    /// ZMQ endpoint of a pod that binds its publisher, to connect to:
    /// `ENDPOINT[=ADDRESS[@MODEL][,speed=S]]`. With `=ADDRESS` the pod's
    /// identity comes from this flag (and the pod is known); otherwise from the topic.
    #[arg(long = "zmq-connect", value_parser = parse_connect)]
    pub zmq_connect: Vec<(String, Option<PodSource>)>,

    /// A pod known statically: `ADDRESS[@MODEL][,speed=S]` (ADDRESS = ip:port
    /// of its HTTP server, as in x-gateway-destination-endpoint; S its relative
    /// speed, sent to the filters with the pod list). Repeatable.
    #[arg(long = "pod", value_parser = parse_pod)]
    pub pods: Vec<PodSource>,

    /// A headless Service: `HOST:PORT[@MODEL][,speed=S]`; each A/AAAA record
    /// is a pod at PORT, of that model and speed. Repeatable (one per pool of
    /// pods, e.g. one per GPU type).
    #[arg(long = "dns-service", value_parser = parse_pod)]
    pub dns_services: Vec<PodSource>,

    /// How often the DNS name is resolved, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub dns_interval_ms: u64,

    /// Accept events from publishers that discovery does not know, creating
    /// pods from their topic. Off by default: any host that can reach the ZMQ
    /// port could otherwise steer traffic.
    #[arg(long)]
    pub accept_unknown_publishers: bool,

    /// Model for pods whose topic and configuration name none.
    #[arg(long)]
    pub model: Option<String>,

    /// Tokens per block the filters hash with (vLLM --block-size); events of
    /// another block size are not indexed. 0 accepts any.
    #[arg(long, default_value_t = 16)]
    pub block_size: u32,

    /// Replay (ROUTER) port of every pod: gaps are filled from
    /// tcp://<pod ip>:<port + data-parallel rank>. Unset: no replay.
    #[arg(long)]
    pub replay_port: Option<u16>,

    /// Replay endpoint of one pod: `ADDRESS=tcp://HOST:PORT` (rank r uses PORT + r). Repeatable.
    #[arg(long = "replay-endpoint", value_parser = parse_replay_endpoint)]
    pub replay_endpoints: Vec<(String, String)>,

    /// Time allowed for a replay exchange, in milliseconds.
    #[arg(long, default_value_t = 2_000)]
    pub replay_timeout_ms: u64,

    /// Live messages buffered per publisher while its replay is in flight.
    #[arg(long, default_value_t = 10_000)]
    pub replay_buffer: usize,

    /// Capacity of the event queue between the ZMQ sockets and the index;
    /// when full, new messages are dropped (counted; the gap is then
    /// detected by sequence and replayed when configured).
    #[arg(long, default_value_t = 65_536)]
    pub queue_capacity: usize,

    /// Cap on (vLLM block, rank) entries per pod; further stores are refused (counted).
    #[arg(long, default_value_t = 1 << 20)]
    pub max_blocks_per_pod: usize,

    /// Size the block table by what is stored, growing by eighths, instead
    /// of making room at once for every pod's reported KV capacity (capped by
    /// --max-blocks-per-pod). Less memory when pods share most of their
    /// blocks; a slower fill, and a growth briefly holds two tables.
    #[arg(long)]
    pub grow_on_demand: bool,

    /// Cap on pods.
    #[arg(long, default_value_t = 1024)]
    pub max_pods: usize,

    /// Hashes retained in the feed delta log; older cursors get a snapshot.
    #[arg(long, default_value_t = 1 << 20)]
    pub feed_log_hashes: usize,

    /// Hashes per feed answer, a delta or a snapshot page (at most 5 bytes each
    /// on the wire: the default keeps a page under 2.7 MB); the client asks again at once for the rest.
    #[arg(long, default_value_t = 1 << 19)]
    pub feed_max_hashes: usize,

    /// Lifetime of learned entries (POST /v1/learned), in seconds.
    #[arg(long, default_value_t = 600)]
    pub learned_ttl_seconds: u64,

    /// Cap on learned (hash, pod) entries; the oldest are evicted first.
    #[arg(long, default_value_t = 1 << 20)]
    pub learned_max_entries: usize,

    /// Largest accepted POST /v1/learned body, in bytes.
    #[arg(long, default_value_t = 4 << 20)]
    pub max_learned_body_bytes: usize,

    /// Pods with no event and no successful scrape for this long lose their
    /// entries (pods known only from events are forgotten). 0: never.
    #[arg(long, default_value_t = 120)]
    pub pod_timeout_seconds: u64,

    /// Interval of the pods' /metrics scrape, in milliseconds. 0 disables scraping.
    #[arg(long, default_value_t = 1_000)]
    pub scrape_interval_ms: u64,

    /// Timeout of one scrape, in milliseconds.
    #[arg(long, default_value_t = 500)]
    pub scrape_timeout_ms: u64,

    /// Path scraped on each pod.
    #[arg(long, default_value = "/metrics")]
    pub scrape_path: String,
}

impl Args {
    /// The index tunables these flags select.
    pub fn index_config(&self) -> IndexConfig {
        IndexConfig {
            block_size: self.block_size,
            default_model: self.model.clone(),
            accept_unknown_publishers: self.accept_unknown_publishers,
            max_blocks_per_pod: self.max_blocks_per_pod,
            grow_on_demand: self.grow_on_demand,
            max_pods: self.max_pods,
            feed_log_hashes: self.feed_log_hashes,
            feed_max_hashes: self.feed_max_hashes.max(1),
            learned_ttl_ms: self.learned_ttl_seconds.saturating_mul(1000),
            learned_max_entries: self.learned_max_entries,
            pod_timeout_ms: self.pod_timeout_seconds.saturating_mul(1000),
            replay_buffer: self.replay_buffer,
            replay_port: self.replay_port,
        }
    }
}

/// A pod or a pool of pods as a flag names it: `ADDRESS[@MODEL][,speed=S]`.
#[derive(Debug, Clone, PartialEq)]
pub struct PodSource {
    /// `ip:port` of a pod, or `HOST:PORT` of a headless Service.
    pub address: String,
    pub model: Option<String>,
    /// Relative speed of the pods (prefill and decode) against a reference
    /// pod at 1.0; None: not stated (the filters count 1.0 unless their
    /// config names the pod).
    pub speed: Option<f32>,
}

/// Parses `ADDRESS[@MODEL][,speed=S]` (S finite, > 0, <= 1000).
pub fn parse_pod(spec: &str) -> Result<PodSource, String> {
    let (pod, options) = match spec.split_once(',') {
        Some((pod, options)) => (pod, Some(options)),
        None => (spec, None),
    };
    let mut speed = None;
    for option in options.into_iter().flat_map(|o| o.split(',')) {
        let value = option
            .strip_prefix("speed=")
            .ok_or_else(|| format!("unknown option {option:?} (known: speed=S)"))?;
        let s: f32 = value
            .parse()
            .map_err(|_| format!("speed {value:?} is not a number"))?;
        if !(s.is_finite() && s > 0.0 && s <= MAX_SPEED) {
            return Err(format!("speed {value} is not in (0, {MAX_SPEED}]"));
        }
        speed = Some(s);
    }
    let (address, model) = match pod.split_once('@') {
        Some((a, m)) if !m.is_empty() => (a, Some(m.to_owned())),
        Some((a, _)) => (a, None),
        None => (pod, None),
    };
    if !is_pod_address(address) {
        return Err(format!("address {address:?} is not {POD_ADDRESS_RULE}"));
    }
    Ok(PodSource {
        address: address.to_owned(),
        model,
        speed,
    })
}

/// Parses `ENDPOINT[=ADDRESS[@MODEL][,speed=S]]`.
pub fn parse_connect(spec: &str) -> Result<(String, Option<PodSource>), String> {
    match spec.split_once('=') {
        Some((e, pod)) => Ok((e.to_owned(), Some(parse_pod(pod)?))),
        None => Ok((spec.to_owned(), None)),
    }
}

/// Parses `ADDRESS=ENDPOINT`: a pod's address and its replay socket.
pub fn parse_replay_endpoint(spec: &str) -> Result<(String, String), String> {
    let (address, endpoint) = spec
        .split_once('=')
        .ok_or_else(|| format!("{spec:?} is not ADDRESS=ENDPOINT"))?;
    if !is_pod_address(address) {
        return Err(format!("address {address:?} is not {POD_ADDRESS_RULE}"));
    }
    if endpoint.is_empty() {
        return Err("no endpoint after '='".into());
    }
    Ok((address.to_owned(), endpoint.to_owned()))
}

/// zeromq (the crate) binds to an address, not `*`: `tcp://*:P` → `tcp://0.0.0.0:P`.
pub fn bind_endpoint(endpoint: &str) -> String {
    if let Some(rest) = endpoint.strip_prefix("tcp://*:") {
        format!("tcp://0.0.0.0:{rest}")
    } else if let Some(rest) = endpoint.strip_prefix("tcp://[::]:") {
        format!("tcp://[::]:{rest}")
    } else {
        endpoint.to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(address: &str, model: Option<&str>, speed: Option<f32>) -> PodSource {
        PodSource {
            address: address.into(),
            model: model.map(Into::into),
            speed,
        }
    }

    #[test]
    fn specs() {
        assert_eq!(
            parse_pod("1.2.3.4:80@m/x"),
            Ok(pod("1.2.3.4:80", Some("m/x"), None))
        );
        assert_eq!(parse_pod("1.2.3.4:80"), Ok(pod("1.2.3.4:80", None, None)));
        assert_eq!(
            parse_pod("1.2.3.4:80@m,speed=0.5"),
            Ok(pod("1.2.3.4:80", Some("m"), Some(0.5)))
        );
        assert_eq!(
            parse_pod("vllm-fast.llm.svc:8000,speed=2"),
            Ok(pod("vllm-fast.llm.svc:8000", None, Some(2.0)))
        );
        assert_eq!(
            parse_connect("tcp://1.2.3.4:5557=1.2.3.4:80@m"),
            Ok((
                "tcp://1.2.3.4:5557".into(),
                Some(pod("1.2.3.4:80", Some("m"), None))
            ))
        );
        assert_eq!(parse_connect("tcp://h:1"), Ok(("tcp://h:1".into(), None)));
        assert_eq!(bind_endpoint("tcp://*:5557"), "tcp://0.0.0.0:5557");
        assert_eq!(bind_endpoint("tcp://127.0.0.1:1"), "tcp://127.0.0.1:1");
    }

    #[test]
    fn addresses_no_destination_header_can_carry_are_refused() {
        for bad in ["", "@m", "a", "a:0", "a:65536", "a b:80@m", "[::1:80"] {
            assert!(parse_pod(bad).is_err(), "{bad:?}");
            assert!(
                parse_connect(&format!("tcp://h:1={bad}")).is_err(),
                "{bad:?}"
            );
        }
        let e = Args::try_parse_from(["kvroute-indexer", "--dns-service=svc@m"])
            .expect_err("no port")
            .to_string();
        assert!(
            e.contains("--dns-service") && e.contains("\"svc\" is not host:port"),
            "{e}"
        );
    }

    #[test]
    fn replay_endpoints_name_a_pod_and_a_socket() {
        assert_eq!(
            parse_replay_endpoint("10.0.0.1:8000=tcp://10.0.0.1:5558"),
            Ok(("10.0.0.1:8000".into(), "tcp://10.0.0.1:5558".into()))
        );
        for bad in ["10.0.0.1:8000", "10.0.0.1=tcp://h:1", "a:1="] {
            assert!(parse_replay_endpoint(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn bad_speeds_are_refused_naming_the_flag() {
        for bad in [
            "a:1,speed=0",
            "a:1,speed=-1",
            "a:1,speed=1001",
            "a:1,speed=x",
            "a:1,fast",
        ] {
            assert!(parse_pod(bad).is_err(), "{bad}");
        }
        let e = Args::try_parse_from(["kvroute-indexer", "--pod=a:1,speed=0"])
            .expect_err("speed 0")
            .to_string();
        assert!(
            e.contains("--pod") && e.contains("speed 0 is not in (0, 1000]"),
            "{e}"
        );
        let a = Args::try_parse_from([
            "kvroute-indexer",
            "--dns-service=fast:8000,speed=2",
            "--dns-service=slow:8000@m,speed=0.5",
        ])
        .expect("two services");
        assert_eq!(a.dns_services[1], pod("slow:8000", Some("m"), Some(0.5)));
    }

    #[test]
    fn defaults_parse() {
        let a = Args::try_parse_from(["kvroute-indexer"]).expect("defaults");
        assert_eq!(a.zmq_bind, vec!["tcp://*:5557".to_string()]);
        assert!(!a.accept_unknown_publishers);
        assert!(a.listen.ip().is_loopback());
        assert!(a.learned_token_file.is_none() && !a.allow_unauthenticated_learned);
        assert_eq!(a.index_config().pod_timeout_ms, 120_000);
    }

    #[test]
    fn token_file_and_open_writes_exclude_each_other() {
        let both = Args::try_parse_from([
            "kvroute-indexer",
            "--learned-token-file=/run/secrets/token",
            "--allow-unauthenticated-learned",
        ]);
        assert!(both.is_err());
    }
}
