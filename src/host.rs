//! The one seam between kvroute and the proxy: every host call goes through
//! here, with errors turned into values (the SDK's trait helpers unwrap).

use proxy_wasm::hostcalls;
use proxy_wasm::types::{BufferType, Bytes, LogLevel, MapType, MetricType, Status};
use std::time::{Duration, UNIX_EPOCH};

/// One reading of the wall clock since the epoch. A callback reads it once
/// and passes it down: every read is a host call.
#[derive(Debug, Clone, Copy)]
pub struct Now {
    pub secs: u32,
    pub millis: u64,
    pub micros: u64,
}

impl Now {
    /// Microseconds from this moment to the host's clock now.
    pub fn elapsed_us(self) -> u64 {
        now().micros.saturating_sub(self.micros)
    }
}

pub fn now() -> Now {
    let micros = hostcalls::get_current_time()
        .ok()
        .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_micros() as u64);
    Now {
        secs: (micros / 1_000_000) as u32,
        millis: micros / 1000,
        micros,
    }
}

/// 64 random bits from the host's RNG (WASI `random_get`, which Envoy
/// backs with its crypto RNG, reached through std's `RandomState`). Two VMs
/// configured in the same instant must not pick the same queue name.
pub fn random_u64() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    std::collections::hash_map::RandomState::new()
        .build_hasher()
        .finish()
}

pub fn log(level: LogLevel, message: &str) {
    let _ = hostcalls::log(level, message);
}

/// Whether the proxy logs debug lines (Envoy's `wasm` logger level), so a
/// per-request line is formatted only when it will be written.
pub fn debug_logging() -> bool {
    matches!(
        hostcalls::get_log_level(),
        Ok(LogLevel::Trace | LogLevel::Debug)
    )
}

pub fn property(path: &[&str]) -> Option<String> {
    let bytes = hostcalls::get_property(path.to_vec()).ok()??;
    String::from_utf8(bytes).ok()
}

pub fn set_tick_period(ms: u64) {
    let _ = hostcalls::set_tick_period(Duration::from_millis(ms));
}

pub fn plugin_configuration() -> Option<Bytes> {
    hostcalls::get_buffer(BufferType::PluginConfiguration, 0, usize::MAX).ok()?
}

pub fn request_header(name: &str) -> Option<String> {
    header_value(MapType::HttpRequestHeaders, name)
}

#[link(wasm_import_module = "env")]
extern "C" {
    fn proxy_get_header_map_pairs(
        map_type: MapType,
        return_map_data: *mut *mut u8,
        return_map_size: *mut usize,
    ) -> Status;
}

/// Every request header in one host call, as the proxy serialized them
/// (read with `kvroute_core::header_map::HeaderMap`). The SDK's own reader
/// would panic on a header name that is not UTF-8.
pub fn request_header_map() -> Option<Bytes> {
    header_map(MapType::HttpRequestHeaders)
}

/// Every response header in one host call (see [`request_header_map`]).
pub fn response_header_map() -> Option<Bytes> {
    header_map(MapType::HttpResponseHeaders)
}

fn header_map(map: MapType) -> Option<Bytes> {
    let mut data: *mut u8 = std::ptr::null_mut();
    let mut size: usize = 0;
    // SAFETY: on success the host hands over a buffer of `size` bytes that
    // it allocated through this module's `proxy_on_memory_allocate` (the
    // SDK's, a `Vec<u8>` of that capacity): ownership passes to the Vec.
    unsafe {
        let status = proxy_get_header_map_pairs(map, &mut data, &mut size);
        if status != Status::Ok || data.is_null() {
            return None;
        }
        Some(Vec::from_raw_parts(data, size, size))
    }
}

pub fn response_header(name: &str) -> Option<String> {
    header_value(MapType::HttpResponseHeaders, name)
}

/// A header's value, read as bytes: the SDK's string getter unwraps its UTF-8
/// conversion, so one client byte above 0x7f (legal in HTTP) would panic the
/// VM. Invalid sequences become U+FFFD instead.
fn header_value(map: MapType, name: &str) -> Option<String> {
    let bytes = hostcalls::get_map_value_bytes(map, name).ok()??;
    Some(String::from_utf8_lossy(&bytes).into_owned())
}

pub fn set_request_header(name: &str, value: Option<&str>) -> Result<(), Status> {
    hostcalls::set_map_value(MapType::HttpRequestHeaders, name, value)
}

pub fn add_response_header(name: &str, value: &str) {
    let _ = hostcalls::add_map_value(MapType::HttpResponseHeaders, name, value);
}

pub fn request_body(size: usize) -> Option<Bytes> {
    hostcalls::get_buffer(BufferType::HttpRequestBody, 0, size).ok()?
}

/// Replaces the buffered request body (`size` bytes: all of it) with `body`.
pub fn set_request_body(size: usize, body: &[u8]) -> Result<(), Status> {
    hostcalls::set_buffer(BufferType::HttpRequestBody, 0, size, body)
}

/// Answers the request from the proxy (a local reply): the stream goes no
/// further upstream.
pub fn send_local_reply(status: u32, headers: &[(&str, &str)], body: &[u8]) -> Result<(), Status> {
    hostcalls::send_http_response(status, headers.to_vec(), Some(body))
}

pub fn resume_request() {
    let _ = hostcalls::resume_http_request();
}

/// A shared-data value and its CAS token.
pub fn shared_get(key: &str) -> Option<(Bytes, u32)> {
    match hostcalls::get_shared_data(key) {
        Ok((Some(value), Some(cas))) => Some((value, cas)),
        Ok((Some(value), None)) => Some((value, 0)),
        _ => None,
    }
}

/// Shared data as the published index's readers see it.
pub struct SharedData;

impl kvroute_core::index::published::KeyReader for SharedData {
    fn read(&self, key: &str) -> Option<Vec<u8>> {
        shared_get(key).map(|(value, _)| value)
    }
}

/// The singleton's write-through index stores its buckets here.
impl kvroute_core::index::published::KeyStore for SharedData {
    fn write(&self, key: &str, value: &[u8]) -> bool {
        shared_set(key, value, 0)
    }
}

/// Sets a shared-data value if its CAS token still matches (0 = any).
pub fn shared_set(key: &str, value: &[u8], cas: u32) -> bool {
    hostcalls::set_shared_data(key, Some(value), (cas != 0).then_some(cas)).is_ok()
}

pub fn queue_register(name: &str) -> Option<u32> {
    hostcalls::register_shared_queue(name).ok()
}

pub fn queue_resolve(vm_id: &str, name: &str) -> Option<u32> {
    hostcalls::resolve_shared_queue(vm_id, name).ok()?
}

pub fn queue_enqueue(queue: u32, message: &[u8]) -> bool {
    hostcalls::enqueue_shared_queue(queue, Some(message)).is_ok()
}

pub fn queue_dequeue(queue: u32) -> Option<Bytes> {
    hostcalls::dequeue_shared_queue(queue).ok()?
}

/// Dispatches an HTTP call to an Envoy cluster; the answer arrives in
/// `on_http_call_response` of the calling context.
pub fn http_call(
    cluster: &str,
    authority: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    timeout_ms: u32,
) -> Result<u32, Status> {
    http_call_with_headers(cluster, authority, method, path, body, timeout_ms, &[])
}

/// [`http_call`] with more request headers (e.g. `authorization`).
pub fn http_call_with_headers(
    cluster: &str,
    authority: &str,
    method: &str,
    path: &str,
    body: Option<&[u8]>,
    timeout_ms: u32,
    extra: &[(&str, &str)],
) -> Result<u32, Status> {
    let mut headers = vec![
        (":method", method),
        (":path", path),
        (":authority", authority),
    ];
    if body.is_some() {
        headers.push(("content-type", "application/json"));
    }
    headers.extend_from_slice(extra);
    hostcalls::dispatch_http_call(
        cluster,
        headers,
        body,
        vec![],
        Duration::from_millis(u64::from(timeout_ms)),
    )
}

/// The status of a dispatched call's response. A call that failed without
/// one (reset, timeout, a response over Envoy's async-client buffer limit)
/// arrives with no headers and no response to read: the host then answers
/// a read with BadArgument, on which the SDK panics, so it is not asked.
pub fn http_call_status(num_headers: usize) -> Option<u16> {
    if num_headers == 0 {
        return None;
    }
    header_value(MapType::HttpCallResponseHeaders, ":status")?
        .parse()
        .ok()
}

/// The body of a dispatched call's response (see [`http_call_status`]).
pub fn http_call_body(num_headers: usize, size: usize) -> Option<Bytes> {
    if num_headers == 0 {
        return None;
    }
    hostcalls::get_buffer(BufferType::HttpCallResponseBody, 0, size).ok()?
}

/// An Envoy stat defined by this VM. Undefinable metrics become no-ops:
/// stats must never take routing down.
#[derive(Debug, Clone, Copy)]
pub struct Metric(Option<u32>);

impl Metric {
    pub fn counter(name: &str) -> Metric {
        Metric(hostcalls::define_metric(MetricType::Counter, name).ok())
    }

    pub fn gauge(name: &str) -> Metric {
        Metric(hostcalls::define_metric(MetricType::Gauge, name).ok())
    }

    pub fn histogram(name: &str) -> Metric {
        Metric(hostcalls::define_metric(MetricType::Histogram, name).ok())
    }

    pub fn inc(self) {
        self.add(1);
    }

    /// Adding nothing spares the host call.
    pub fn add(self, n: u64) {
        if let (Some(id), true) = (self.0, n > 0) {
            let _ = hostcalls::increment_metric(id, n as i64);
        }
    }

    /// Sets a gauge or records a histogram sample.
    pub fn record(self, value: u64) {
        if let Some(id) = self.0 {
            let _ = hostcalls::record_metric(id, value);
        }
    }
}

/// A variable of the VM's environment: Envoy passes only those listed in
/// `vm_config.environment_variables` (host_env_keys / key_values).
pub fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}
