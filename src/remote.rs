//! The remote lookup call-out (plugin field `remote_index`): a proxy that
//! holds no index asks kvroute-indexer for a prompt's candidate pods and
//! ranks them (kvroute_core::lookup). Failures are the caller's to fall
//! back on: this module only sends, reads and counts.

use crate::host;
use crate::worker::SharedWorker;
use kvroute_core::config::Config;
use kvroute_core::lookup::{self, InFlight, LookupError};
use kvroute_core::request::PromptRequest;
use kvroute_core::router::{Decision, HashedPrompt, NoRoute};
use proxy_wasm::types::LogLevel;
use std::cell::RefCell;

thread_local! {
    /// Requests this VM routed after a lookup, still in flight (the pods are
    /// not in the VM's cluster, whose counts serve local decisions).
    static IN_FLIGHT: RefCell<InFlight> = RefCell::new(InFlight::default());
}

/// A lookup under way for a paused request.
pub struct PendingLookup {
    pub token: u32,
    pub request: PromptRequest,
    pub prompt: HashedPrompt,
    /// When the request's routing started, µs.
    pub started_us: u64,
}

/// Whether `prompt` is looked up: `remote_index` is set and the prompt has
/// at least `min_blocks` blocks.
pub fn wanted(config: &Config, prompt: &HashedPrompt) -> bool {
    config
        .remote_index
        .as_ref()
        .is_some_and(|r| prompt.hashes.len() >= r.min_blocks)
}

/// Sends the lookup for `prompt`; the token of the call.
pub fn start(config: &Config, prompt: &HashedPrompt) -> Result<u32, LookupError> {
    let remote = config.remote_index.as_ref().ok_or(LookupError::NotSent)?;
    host::http_call(
        &remote.cluster,
        &remote.authority,
        "POST",
        &remote.path,
        Some(&lookup::encode_request(prompt)),
        remote.timeout_ms,
    )
    .map_err(|_| LookupError::NotSent)
}

/// Ranks the answer to `pending` (a call response of `num_headers` headers
/// and `body_size` bytes) with this VM's in-flight counts; counts it
/// answered when it gives a decision.
pub fn answer(
    worker: &SharedWorker,
    config: &Config,
    pending: &PendingLookup,
    num_headers: usize,
    body_size: usize,
    now_us: u64,
) -> Result<Decision, LookupError> {
    let candidates = read_answer(pending, num_headers, body_size)?;
    let seed = worker.try_borrow_mut().map_or(0, |mut w| w.next_tie_seed());
    let decision = IN_FLIGHT.with(|f| {
        lookup::decide(config, &pending.prompt, &candidates, &f.borrow(), seed)
            .map_err(|_: NoRoute| LookupError::NoCandidates)
    })?;
    if let Ok(w) = worker.try_borrow() {
        w.metrics.remote_lookup_answered.inc();
        w.metrics
            .remote_lookup_us
            .record(now_us.saturating_sub(pending.started_us));
    }
    Ok(decision)
}

/// Counts and logs (debug, with the request id) a lookup that gave no usable
/// answer; the note for the decision header.
pub fn failed(worker: &SharedWorker, request_id: &str, e: &LookupError) -> String {
    if let Ok(w) = worker.try_borrow() {
        w.metrics.remote_lookup_failed.inc();
    }
    host::log(
        LogLevel::Debug,
        &format!("kvroute: request {request_id}: remote lookup failed ({e}); deciding locally"),
    );
    format!("lookup=local ({})", e.brief())
}

fn read_answer(
    pending: &PendingLookup,
    num_headers: usize,
    body_size: usize,
) -> Result<Vec<lookup::Candidate>, LookupError> {
    match host::http_call_status(num_headers) {
        None => return Err(LookupError::NoAnswer),
        Some(200) => {}
        Some(status) => return Err(LookupError::Status(status)),
    }
    let body = host::http_call_body(num_headers, body_size).unwrap_or_default();
    lookup::decode_answer(&body, pending.prompt.hashes.len())
}

/// A request went to `pod` on a looked-up decision.
pub fn routed(pod: &str, prompt_blocks: u32) {
    IN_FLIGHT.with(|f| f.borrow_mut().routed(pod, prompt_blocks));
}

pub fn prefill_done(pod: &str, prompt_blocks: u32) {
    IN_FLIGHT.with(|f| f.borrow_mut().prefill_done(pod, prompt_blocks));
}

pub fn finished(pod: &str, prompt_blocks: u32) {
    IN_FLIGHT.with(|f| f.borrow_mut().finished(pod, prompt_blocks));
}
