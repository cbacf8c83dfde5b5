//! Shared-data probe for the fleet-scale design spike (docs/fleet-scale-design.md).
//!
//! One module, two roles chosen by the plugin configuration:
//! - `"role": "writer"` (a bootstrap `wasm_service` with `singleton: true`, main thread):
//!   fills `fill_keys` slot keys `s/<i>` with `value_bytes` bytes each, `fill_per_tick` per
//!   tick, then publishes `probe/filled`; afterwards it rewrites `rewrites_per_tick` buckets
//!   per tick (round robin over the first `rewrite_buckets` keys, `rewrite_bytes` each), the
//!   single-writer pattern of candidate A, so the main thread's CPU per rewrite can be read
//!   from /proc. Gauge `probe.filled`, counter `probe.rewrites`.
//! - `"role": "reader"` (the HTTP filter, one VM per worker): each request does
//!   `x-probe-gets` reads of random keys among the first `x-probe-keys` and answers locally
//!   with the time spent inside the reads (`x-probe-ns`), the hits and the bytes returned.
//!   No upstream is involved, so Envoy's CPU per request is the probe's cost plus HTTP.
//!   With `x-probe-callout: <bytes>` it instead posts that many bytes to the `scorer` cluster
//!   (`dispatch_http_call`, 50 ms timeout) and answers once the reply is in: the round trip a
//!   sidecar would pay to have its block hashes scored remotely (candidate C).
//!
//! With `fleet_buckets` set, the writer instead fills a whole fleet's block → pod-set index
//! (see fleet.rs) and a request with `x-probe-decide: <buckets>,<bucket bytes>` runs candidate
//! A's decision against it: bisect the prompt's chain with one bucket read per probe.
//!
//! The driver is integration/spike/shared_data_probe.py. Panics abort the VM: this is a
//! measuring tool, and the driver treats a missing answer as a failed run.

use proxy_wasm::hostcalls;
use proxy_wasm::traits::{Context, HttpContext, RootContext};
use proxy_wasm::types::{Action, ContextType, LogLevel, MetricType};
use serde::Deserialize;
use std::borrow::Cow;
use std::rc::Rc;
use std::time::{Duration, UNIX_EPOCH};

mod fleet;

proxy_wasm::main! {{
    proxy_wasm::set_log_level(LogLevel::Info);
    proxy_wasm::set_root_context(|_| -> Box<dyn RootContext> { Box::new(Probe::default()) });
}}

#[derive(Deserialize, Default, Clone)]
#[serde(default)]
struct Settings {
    role: String,
    fill_keys: u64,
    value_bytes: usize,
    fill_per_tick: u64,
    rewrite_buckets: u64,
    rewrite_bytes: usize,
    rewrites_per_tick: u64,
    rewrite_read_back: bool,
    tick_ms: u64,
    fleet_buckets: u64,
    bucket_bytes: usize,
    fill: f64,
    /// Reader: hold the fleet in this VM's memory (candidate B) instead of reading shared data.
    local_fleet_buckets: u64,
}

#[derive(Default)]
struct Probe {
    settings: Settings,
    filled: u64,
    filled_gauge: u32,
    rewrites_counter: u32,
    next_rewrite: u64,
    round: u8,
    fleet: Option<fleet::FleetWriter>,
    local_fleet: Option<Rc<fleet::LocalFleet>>,
}

fn nanos() -> u64 {
    hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as u64)
}

fn slot_key(i: u64) -> String {
    format!("s/{i}")
}

impl Context for Probe {}

impl RootContext for Probe {
    fn on_configure(&mut self, _size: usize) -> bool {
        let Ok(Some(raw)) = hostcalls::get_buffer(
            proxy_wasm::types::BufferType::PluginConfiguration,
            0,
            usize::MAX,
        ) else {
            return false;
        };
        let Ok(settings) = serde_json::from_slice::<Settings>(&raw) else {
            let _ = hostcalls::log(LogLevel::Error, "probe: bad configuration");
            return false;
        };
        self.settings = settings;
        if self.settings.role == "writer" {
            self.filled_gauge =
                hostcalls::define_metric(MetricType::Gauge, "probe.filled").unwrap_or(0);
            self.rewrites_counter =
                hostcalls::define_metric(MetricType::Counter, "probe.rewrites").unwrap_or(0);
            let _ = hostcalls::set_tick_period(Duration::from_millis(self.settings.tick_ms.max(1)));
        }
        let s = &self.settings;
        if s.role == "reader" && s.local_fleet_buckets > 0 {
            let layout = fleet::Layout::new(s.local_fleet_buckets, s.bucket_bytes);
            self.local_fleet = Some(Rc::new(fleet::LocalFleet::build(layout, s.fill)));
        }
        true
    }

    fn on_tick(&mut self) {
        let s = self.settings.clone();
        if s.fleet_buckets > 0 {
            self.fill_fleet();
            return;
        }
        if self.filled < s.fill_keys {
            let value = vec![0x5a_u8; s.value_bytes];
            let end = (self.filled + s.fill_per_tick.max(1)).min(s.fill_keys);
            for i in self.filled..end {
                let _ = hostcalls::set_shared_data(&slot_key(i), Some(&value), None);
            }
            self.filled = end;
            let _ = hostcalls::record_metric(self.filled_gauge, self.filled);
            if self.filled == s.fill_keys {
                let _ = hostcalls::set_shared_data(
                    "probe/filled",
                    Some(self.filled.to_string().as_bytes()),
                    None,
                );
            }
            return;
        }
        if s.rewrites_per_tick == 0 || s.rewrite_buckets == 0 {
            return;
        }
        // Either the writer keeps its own copy of each bucket (a rewrite is "patch, set") or it
        // reads the bucket back from shared data first (`rewrite_read_back`: "get, patch, set").
        self.round = self.round.wrapping_add(1);
        let mut bucket = vec![self.round; s.rewrite_bytes];
        for _ in 0..s.rewrites_per_tick {
            let i = self.next_rewrite % s.rewrite_buckets;
            self.next_rewrite += 1;
            let key = slot_key(i);
            if s.rewrite_read_back {
                if let Ok((Some(current), _)) = hostcalls::get_shared_data(&key) {
                    bucket = current;
                }
            }
            let at = (i as usize) % bucket.len().max(1);
            if let Some(byte) = bucket.get_mut(at) {
                *byte ^= 1;
            }
            let _ = hostcalls::set_shared_data(&key, Some(&bucket), None);
        }
        let _ = hostcalls::increment_metric(self.rewrites_counter, s.rewrites_per_tick as i64);
    }

    fn create_http_context(&self, _context_id: u32) -> Option<Box<dyn HttpContext>> {
        Some(Box::new(Reader {
            local_fleet: self.local_fleet.clone(),
        }))
    }

    fn get_type(&self) -> Option<ContextType> {
        Some(ContextType::HttpContext)
    }
}

impl Probe {
    fn fill_fleet(&mut self) {
        let s = &self.settings;
        if self.filled >= s.fleet_buckets {
            return;
        }
        let writer = self.fleet.get_or_insert_with(|| {
            let w = fleet::FleetWriter::new(
                fleet::Layout::new(s.fleet_buckets, s.bucket_bytes),
                s.fill,
            );
            for (key, value) in w.sets() {
                let _ = hostcalls::set_shared_data(&key, Some(&value), None);
            }
            w
        });
        let end = (self.filled + s.fill_per_tick.max(1)).min(s.fleet_buckets);
        for b in self.filled..end {
            let bucket = writer.bucket(b);
            let _ = hostcalls::set_shared_data(&fleet::bucket_key(b), Some(&bucket), None);
        }
        self.filled = end;
        let _ = hostcalls::record_metric(self.filled_gauge, self.filled);
    }
}

struct Reader {
    local_fleet: Option<Rc<fleet::LocalFleet>>,
}

/// Candidate A: the layout from the request (`<buckets>,<bucket bytes>`), buckets from shared data.
fn decide_shared(layout: &str) -> Vec<(&'static str, String)> {
    let mut parts = layout
        .split(',')
        .map(|x| x.trim().parse::<u64>().unwrap_or(0));
    let layout = fleet::Layout::new(
        parts.next().unwrap_or(1),
        parts.next().unwrap_or(8) as usize,
    );
    let mut read = |key: fleet::Key| {
        hostcalls::get_shared_data(&key.shared_data_name())
            .ok()
            .and_then(|(v, _)| v)
            .map(Cow::Owned)
    };
    decide(&layout, &mut read)
}

fn decide<'a>(
    layout: &fleet::Layout,
    read: &mut dyn FnMut(fleet::Key) -> Option<Cow<'a, [u8]>>,
) -> Vec<(&'static str, String)> {
    let chain = fleet::hot_chain();
    let start = nanos();
    let (answer, probes) = fleet::match_lengths(layout, &chain, read);
    let spent = nanos().saturating_sub(start);
    let valid = answer == fleet::expected();
    vec![
        ("x-probe-ns", spent.to_string()),
        ("x-probe-probes", probes.to_string()),
        ("x-probe-pods", answer.len().to_string()),
        ("x-probe-valid", u8::from(valid).to_string()),
    ]
}

impl Context for Reader {
    fn on_http_call_response(
        &mut self,
        _token: u32,
        _headers: usize,
        body: usize,
        _trailers: usize,
    ) {
        let status = hostcalls::get_map_value(
            proxy_wasm::types::MapType::HttpCallResponseHeaders,
            ":status",
        )
        .ok()
        .flatten()
        .unwrap_or_default();
        let _ = hostcalls::send_http_response(
            200,
            vec![
                ("x-probe-callout-status", status.as_str()),
                ("x-probe-bytes", body.to_string().as_str()),
            ],
            None,
        );
    }
}

fn header_u64(name: &str) -> u64 {
    hostcalls::get_map_value(proxy_wasm::types::MapType::HttpRequestHeaders, name)
        .ok()
        .flatten()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

impl HttpContext for Reader {
    fn on_http_request_headers(&mut self, _headers: usize, _end_of_stream: bool) -> Action {
        let decided = if header_u64("x-probe-decide-local") > 0 {
            // Candidate B: this VM's own copy (the request fails the driver's check if absent).
            self.local_fleet.as_ref().map(|local| {
                let mut read = |key: fleet::Key| local.read(key);
                decide(&local.layout, &mut read)
            })
        } else {
            hostcalls::get_map_value(
                proxy_wasm::types::MapType::HttpRequestHeaders,
                "x-probe-decide",
            )
            .ok()
            .flatten()
            .map(|layout| decide_shared(&layout))
        };
        if let Some(headers) = decided {
            let _ = hostcalls::send_http_response(
                200,
                headers.iter().map(|(k, v)| (*k, v.as_str())).collect(),
                None,
            );
            return Action::Pause;
        }
        let callout = header_u64("x-probe-callout");
        if callout > 0 {
            let payload = vec![0xa5_u8; callout as usize];
            let sent = hostcalls::dispatch_http_call(
                "scorer",
                vec![
                    (":method", "POST"),
                    (":path", "/score"),
                    (":authority", "scorer"),
                ],
                Some(&payload),
                vec![],
                Duration::from_millis(50),
            );
            if sent.is_err() {
                let _ = hostcalls::send_http_response(503, vec![], None);
            }
            return Action::Pause;
        }
        let gets = header_u64("x-probe-gets");
        let keys = header_u64("x-probe-keys").max(1);
        let mut state = header_u64("x-probe-seed") | 1;
        // Keys are formatted before the clock starts: only the host calls are timed.
        let names: Vec<String> = (0..gets)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                slot_key(state % keys)
            })
            .collect();
        let (mut hits, mut bytes) = (0u64, 0u64);
        let start = nanos();
        for name in &names {
            if let Ok((Some(value), _)) = hostcalls::get_shared_data(name) {
                hits += 1;
                bytes += value.len() as u64;
            }
        }
        let spent = nanos().saturating_sub(start);
        let _ = hostcalls::send_http_response(
            200,
            vec![
                ("x-probe-ns", spent.to_string().as_str()),
                ("x-probe-hits", hits.to_string().as_str()),
                ("x-probe-bytes", bytes.to_string().as_str()),
            ],
            None,
        );
        Action::Pause
    }
}
