//! The HTTP filter: buffers a routed request's body, picks the pod, sets
//! the destination header for the override_host load balancer, and releases
//! the pod's load when the stream ends. Every failure fails open.
//!
//! This file holds the request's state and the proxy's callbacks; the steps
//! they call are one concern per submodule: `route` (parse, hash, decide,
//! apply or shed), `tokenizer` (precise mode's token ids: the memo or the
//! call-out), `settle` (the response judged, the load released), `headers`
//! (a callback's headers in one host call).

mod headers;
mod route;
mod settle;
mod tokenizer;

use crate::host;
use crate::metrics::FailOpen;
use crate::remote::PendingLookup;
use crate::worker::{RoutedRequest, SharedWorker};
use headers::Headers;
use kvroute_core::config::Admission;
use kvroute_core::hash::BlockHash;
use kvroute_core::header_map::HeaderMap;
use kvroute_core::outcome::names_a_host;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, LogLevel};
use tokenizer::PendingTokenize;

pub struct RequestFilter {
    worker: SharedWorker,
    /// This request is routed by kvroute (routed path, POST, has a body).
    routing: bool,
    /// The request is on a routed path (its response reports the served pod).
    on_routed_path: bool,
    request_id: String,
    /// The pod, its pending prefill blocks and the uncached blocks routed
    /// there, counted as in flight and released at the end.
    in_flight: Option<(String, u32, u32)>,
    /// The request's priority class (critical when priority is off).
    admission: Admission,
    /// The decision, until its response settles it.
    unsettled: Option<RoutedRequest>,
    /// A decision whose pod answered successfully: confirmed when the stream
    /// ends, unless the pod cut the answer (see `outcome::judge_end`).
    answering: Option<RoutedRequest>,
    /// The response's last byte passed: the pod did not cut it.
    response_complete: bool,
    explanation: Option<String>,
    /// Why the request was left to Envoy's LB, for the decision header.
    fallback: Option<FailOpen>,
    /// Pending tokenizer call-out.
    tokenizing: Option<PendingTokenize>,
    /// Where the token ids came from when not from the client, for the
    /// decision header.
    tokens_note: Option<&'static str>,
    /// The byte chunks of a prompt routed on its token ids, taught beside
    /// them (see `Worker::teach_byte_fallback`).
    byte_fallback: Option<Vec<BlockHash>>,
    /// Pending remote lookup (`remote_index`).
    looking_up: Option<PendingLookup>,
    /// The decision came from a remote lookup: its pod's load is counted
    /// in `remote`, not in the VM's cluster.
    looked_up: bool,
    /// How the remote lookup went, for the decision header.
    lookup_note: Option<String>,
    /// Why the published index could not be read, for the decision header.
    index_note: Option<String>,
}

impl RequestFilter {
    pub fn new(worker: SharedWorker) -> RequestFilter {
        RequestFilter {
            worker,
            routing: false,
            on_routed_path: false,
            request_id: String::new(),
            in_flight: None,
            admission: Admission::Critical,
            unsettled: None,
            answering: None,
            response_complete: false,
            explanation: None,
            fallback: None,
            tokenizing: None,
            tokens_note: None,
            byte_fallback: None,
            looking_up: None,
            looked_up: false,
            lookup_note: None,
            index_note: None,
        }
    }

    fn fail_open(&mut self, cause: FailOpen, detail: &str) {
        self.fallback = Some(cause);
        if let Ok(mut w) = self.worker.try_borrow_mut() {
            w.fail_open(cause, &self.request_id, detail);
        }
    }
}

impl Context for RequestFilter {
    fn on_http_call_response(
        &mut self,
        token_id: u32,
        num_headers: usize,
        body_size: usize,
        _num_trailers: usize,
    ) {
        if let Some(pending) = self.looking_up.take() {
            if pending.token == token_id {
                if !self.on_lookup_answer(pending, num_headers, body_size) {
                    host::resume_request();
                }
            } else {
                self.looking_up = Some(pending);
            }
            return;
        }
        let Some(pending) = self.tokenizing.take() else {
            return;
        };
        if pending.token != token_id {
            self.tokenizing = Some(pending);
            return;
        }
        self.on_tokenizer_answer(pending, num_headers, body_size);
    }
}

impl HttpContext for RequestFilter {
    fn on_http_request_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        let Ok(w) = self.worker.try_borrow() else {
            return Action::Continue;
        };
        let config = w.config.clone();
        drop(w);
        // One host call for every header this callback reads.
        let serialized = host::request_header_map();
        let decoded = serialized.as_deref().map(HeaderMap::decode);
        let headers = Headers::of(&decoded, host::request_header, "request");
        // A client must never pick the pod: drop any value it sent.
        if headers.may_contain(&config.destination_header)
            && host::set_request_header(&config.destination_header, None).is_err()
        {
            host::log(
                LogLevel::Warn,
                "kvroute: could not strip the client's destination header",
            );
        }
        let is_post = headers.get(":method").is_some_and(|m| m == "POST");
        let path = headers.get(":path").unwrap_or_default();
        if !is_post || !config.routes_path(&path) {
            return Action::Continue;
        }
        self.on_routed_path = true;
        self.request_id = headers.get("x-request-id").unwrap_or_default();
        if let Some(priority) = &config.priority {
            self.admission = priority.admission_of(headers.get(&priority.header).as_deref());
        }
        if let Ok(w) = self.worker.try_borrow() {
            w.metrics.requests.inc();
        }
        if end_of_stream {
            self.fail_open(FailOpen::NoPrompt, "request has no body");
            return Action::Continue;
        }
        // A body known to be too large is never buffered: Envoy streams it
        // as it would without kvroute.
        let declared = headers
            .get("content-length")
            .and_then(|v| v.parse::<u64>().ok());
        if let Some(length) = declared.filter(|&n| n > config.max_body_bytes as u64) {
            self.fail_open(
                FailOpen::BodyTooLarge,
                &format!(
                    "content-length {length} > max_body_bytes {}",
                    config.max_body_bytes
                ),
            );
            return Action::Continue;
        }
        self.routing = true;
        Action::Pause
    }

    fn on_http_request_body(&mut self, body_size: usize, end_of_stream: bool) -> Action {
        if !self.routing {
            return Action::Continue;
        }
        let max = self
            .worker
            .try_borrow()
            .map_or(0, |w| w.config.max_body_bytes);
        if body_size > max {
            self.routing = false;
            self.fail_open(
                FailOpen::BodyTooLarge,
                &format!("{body_size} bytes > max_body_bytes {max}"),
            );
            return Action::Continue;
        }
        if !end_of_stream {
            return Action::Pause;
        }
        self.routing = false;
        let Some(body) = host::request_body(body_size) else {
            self.fail_open(FailOpen::Malformed, "body could not be read");
            return Action::Continue;
        };
        if self.on_body(&body) {
            Action::Pause
        } else {
            Action::Continue
        }
    }

    fn on_http_response_headers(&mut self, _num_headers: usize, end_of_stream: bool) -> Action {
        if !self.on_routed_path {
            return Action::Continue;
        }
        self.response_complete = end_of_stream;
        let Some(config) = self.worker.try_borrow().ok().map(|w| w.config.clone()) else {
            return Action::Continue;
        };
        // One host call for the status and the served header.
        let serialized = host::response_header_map();
        let decoded = serialized.as_deref().map(HeaderMap::decode);
        let headers = Headers::of(&decoded, host::response_header, "response");
        // The route's header spares the property read: docs/results/2026-12-04-overhead-host-calls.
        let served_by = if config.served_header_from_route {
            headers
                .get(&config.served_header)
                .filter(|v| names_a_host(v))
        } else {
            host::property(&["upstream", "address"])
        };
        let status = headers.get(":status").and_then(|s| s.parse().ok());
        self.settle(status, served_by.as_deref());
        let (lookup_note, index_note) = (self.lookup_note.take(), self.index_note.take());
        let explanation = self
            .explanation
            .take()
            .or_else(|| self.fallback.map(|c| format!("fallback={}", c.name())))
            .map(|mut text| {
                let notes = [
                    self.tokens_note,
                    lookup_note.as_deref(),
                    index_note.as_deref(),
                ];
                for note in notes.into_iter().flatten() {
                    text.push_str("; ");
                    text.push_str(note);
                }
                text
            });
        if let Some(text) = explanation.filter(|_| !config.decision_header.is_empty()) {
            host::add_response_header(&config.decision_header, &text);
        }
        let added = !config.served_header.is_empty() && !config.served_header_from_route;
        if let Some(pod) = served_by.filter(|_| added) {
            host::add_response_header(&config.served_header, &pod);
        }
        Action::Continue
    }

    fn on_http_response_body(&mut self, _body_size: usize, end_of_stream: bool) -> Action {
        self.response_complete |= end_of_stream;
        self.prefill_done();
        Action::Continue
    }

    fn on_log(&mut self) {
        self.settle_end();
        self.release();
    }
}

impl Drop for RequestFilter {
    /// Streams that end without an access-log callback still settle and
    /// release load.
    fn drop(&mut self) {
        self.settle_end();
        self.release();
    }
}
