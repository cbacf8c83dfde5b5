//! The HTTP filter: buffers a routed request's body, picks the pod, sets
//! the destination header for the override_host load balancer, and releases
//! the pod's load when the stream ends. Every failure fails open.

use crate::host::{self, Now};
use crate::metrics::FailOpen;
use crate::remote::{self, PendingLookup};
use crate::worker::{RoutedRequest, SharedWorker, Taught};
use kvroute_core::admission::sheds;
use kvroute_core::budget::client_key;
use kvroute_core::codec::CodecError;
use kvroute_core::config::{Admission, Config};
use kvroute_core::hash::{BlockHash, Domain};
use kvroute_core::header_map::HeaderMap;
use kvroute_core::lookup::LookupError;
use kvroute_core::outcome::{judge, judge_end, names_a_host, Outcome, Response};
use kvroute_core::request::{self, Prompt, PromptRequest};
use kvroute_core::router::{hash_prompt, serving_model, Decision, HashedPrompt, NoRoute};
use kvroute_core::token_memo::PromptText;
use kvroute_core::wire::PeerMessage;
use proxy_wasm::traits::{Context, HttpContext};
use proxy_wasm::types::{Action, LogLevel};

/// A request waiting for its tokenizer call-out.
struct PendingTokenize {
    token: u32,
    request: PromptRequest,
    started_us: u64,
    /// The prompt's text, for the token memo to learn with the answer.
    text: PromptText,
}

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

    /// Parses the buffered body and routes it, or starts a tokenizer call.
    /// Returns true when the request must stay paused for the call.
    fn on_body(&mut self, body: &[u8]) -> bool {
        let parsed = request::parse_request(body);
        let mut request = match parsed {
            Ok(r) => r,
            Err(e) => {
                self.fail_open(FailOpen::from(&e), &e.to_string());
                return false;
            }
        };
        // Before anything may fail open: the pod must get the tenant's salt.
        if let Some(header) = self
            .worker
            .try_borrow()
            .ok()
            .and_then(|w| w.config.tenant_header.clone())
        {
            if let Err(why) = inject_tenant_salt(&header, body, &mut request) {
                host::log(
                    LogLevel::Warn,
                    &format!(
                        "kvroute: request {}: tenant salt not written: {why}",
                        self.request_id
                    ),
                );
            }
        }
        if request.model.is_empty() {
            let implied = self
                .worker
                .try_borrow()
                .ok()
                .and_then(|w| w.cluster.implied_model(&w.config));
            match implied {
                Some(model) => request.model = model,
                None => {
                    let why = "request names no model and the pods serve no single one (set default_model)";
                    self.fail_open(FailOpen::NoModel, why);
                    return false;
                }
            }
        }
        if let Some(text) = self.text_for_tokenizer(&request) {
            let started = host::now();
            if let Some(recalled) = self.recall_tokens(&request, &text, started) {
                self.byte_fallback = Some(text.chunks);
                return self.route_hashed(request, recalled, started);
            }
            if let Some(token) = self.start_tokenizer(body) {
                self.tokenizing = Some(PendingTokenize {
                    token,
                    request,
                    started_us: started.micros,
                    text,
                });
                return true;
            }
            return self.route_on_bytes(request, text.chunks, started);
        }
        self.route(request)
    }

    /// A text prompt's chunks, when precise mode wants its token ids.
    fn text_for_tokenizer(&self, request: &PromptRequest) -> Option<PromptText> {
        let Prompt::Text(text) = &request.prompt else {
            return None;
        };
        let w = self.worker.try_borrow().ok()?;
        if request.multimodal || w.config.tokenizer.is_none() {
            return None;
        }
        let chunks = hash_prompt(&w.config, request).hashes;
        Some(PromptText::of(text, chunks, w.config.chunk_bytes))
    }

    /// The prompt's leading token blocks from the memo, if it covers them.
    fn recall_tokens(
        &mut self,
        request: &PromptRequest,
        text: &PromptText,
        now: Now,
    ) -> Option<HashedPrompt> {
        let mut w = self.worker.try_borrow_mut().ok()?;
        let recalled = w.token_memo.recall(text)?;
        if !recalled.whole {
            // Another worker (or an earlier decision) routed more of this
            // text: some pod may hold its blocks beyond the shared prefix,
            // which only the call-out's token ids can match.
            let config = w.config.clone();
            if w.longest_known(&config, &text.chunks, now) > recalled.shared_chunks {
                return None;
            }
        }
        w.metrics.tokenizer_recalled.inc();
        self.tokens_note = Some(if recalled.whole {
            "tokens=memo (whole prompt)"
        } else {
            "tokens=memo (shared prefix)"
        });
        Some(HashedPrompt {
            serving_model: serving_model(&w.config, &request.model),
            domain: Domain::Tokens,
            hashes: recalled.hashes,
            blocks: recalled.blocks,
        })
    }

    /// Sends a chat body to the configured `/tokenize`, when there is one.
    fn start_tokenizer(&self, body: &[u8]) -> Option<u32> {
        let w = self.worker.try_borrow().ok()?;
        let tokenizer = w.config.tokenizer.as_ref()?;
        let call_body = request::tokenize_call_body(body)?;
        match host::http_call(
            &tokenizer.cluster,
            &tokenizer.authority,
            "POST",
            &tokenizer.path,
            Some(&call_body),
            tokenizer.timeout_ms,
        ) {
            Ok(token) => Some(token),
            Err(status) => {
                w.metrics.tokenizer_failed.inc();
                host::log(
                    LogLevel::Debug,
                    &format!(
                        "kvroute: request {}: tokenizer call not sent: {status:?}",
                        self.request_id
                    ),
                );
                None
            }
        }
    }

    /// Hashes the prompt and decides: locally, or after a remote lookup
    /// (`remote_index`). Returns true when the request must stay paused: for
    /// the lookup, or because it was shed (answered 429 by the proxy).
    fn route(&mut self, request: PromptRequest) -> bool {
        let started = host::now();
        let Some(hashed) = self
            .worker
            .try_borrow()
            .ok()
            .map(|w| hash_prompt(&w.config, &request))
        else {
            return false;
        };
        self.route_hashed(request, hashed, started)
    }

    /// `route` for a text prompt whose byte chunks are already hashed (the
    /// tokenizer could not be asked, or failed).
    fn route_on_bytes(
        &mut self,
        request: PromptRequest,
        chunks: Vec<BlockHash>,
        started: Now,
    ) -> bool {
        let Some(serving_model) = self
            .worker
            .try_borrow()
            .ok()
            .map(|w| serving_model(&w.config, &request.model))
        else {
            return false;
        };
        let hashed = HashedPrompt {
            serving_model,
            domain: Domain::Bytes,
            blocks: chunks.len(),
            hashes: chunks,
        };
        self.route_hashed(request, hashed, started)
    }

    /// Decides for a hashed prompt (see `route`).
    fn route_hashed(&mut self, request: PromptRequest, hashed: HashedPrompt, started: Now) -> bool {
        let Some(config) = self.worker.try_borrow().ok().map(|w| w.config.clone()) else {
            return false;
        };
        if remote::wanted(&config, &hashed) {
            match remote::start(&config, &hashed) {
                Ok(token) => {
                    self.looking_up = Some(PendingLookup {
                        token,
                        request,
                        prompt: hashed,
                        started_us: started.micros,
                    });
                    return true;
                }
                Err(e) => self.lookup_failed(&e),
            }
        } else if config.remote_index.is_some() {
            self.lookup_note = Some("lookup=local (below min_blocks)".into());
        }
        let decision = self.decide_locally(&config, &hashed, started);
        self.apply(&config, &request, hashed, decision, started)
    }

    fn decide_locally(
        &mut self,
        config: &Config,
        hashed: &HashedPrompt,
        now: Now,
    ) -> Result<Decision, NoRoute> {
        let Ok(mut w) = self.worker.try_borrow_mut() else {
            return Err(NoRoute::NoEndpoints);
        };
        let (decision, unpublished) = w.decide(config, hashed, now);
        self.index_note = unpublished.map(|why| format!("index={} (load only)", why.name()));
        decision
    }

    /// The lookup's answer arrived: rank it, or decide locally if it is no use.
    /// True when the request was shed (it must not resume).
    fn on_lookup_answer(
        &mut self,
        pending: PendingLookup,
        num_headers: usize,
        body_size: usize,
    ) -> bool {
        let answered = host::now();
        let Some(config) = self.worker.try_borrow().ok().map(|w| w.config.clone()) else {
            return false;
        };
        let answer = remote::answer(
            &self.worker,
            &config,
            &pending,
            num_headers,
            body_size,
            answered.micros,
        );
        let decision = match answer {
            Ok(d) => {
                self.looked_up = true;
                self.lookup_note = Some("lookup=remote".into());
                Ok(d)
            }
            Err(e) => {
                self.lookup_failed(&e);
                self.decide_locally(&config, &pending.prompt, answered)
            }
        };
        // decision_us: the work after the answer (the wait is remote_lookup_us).
        let (request, prompt) = (pending.request, pending.prompt);
        self.apply(&config, &request, prompt, decision, answered)
    }

    fn lookup_failed(&mut self, e: &LookupError) {
        self.lookup_note = Some(remote::failed(&self.worker, &self.request_id, e));
    }

    /// Sets the destination of a decision and counts it; true when the
    /// request was shed instead (answered 429 by the proxy).
    fn apply(
        &mut self,
        config: &Config,
        request: &PromptRequest,
        hashed: HashedPrompt,
        decision: Result<Decision, NoRoute>,
        started: Now,
    ) -> bool {
        let Ok(mut w) = self.worker.try_borrow_mut() else {
            return false;
        };
        let decision = match decision {
            Ok(d) => d,
            Err(e) => {
                self.fallback = Some(FailOpen::from(e));
                w.fail_open(
                    FailOpen::from(e),
                    &self.request_id,
                    &format!("model {}", request.model),
                );
                return false;
            }
        };
        if decision.saturation.is_some() {
            w.metrics.saturated.inc();
        }
        if sheds(self.admission, decision.saturation) {
            return self.shed(&w, config, &decision.explain());
        }
        if let Err(status) =
            host::set_request_header(&config.destination_header, Some(&decision.destination()))
        {
            self.fallback = Some(FailOpen::HeaderRejected);
            w.fail_open(
                FailOpen::HeaderRejected,
                &self.request_id,
                &format!("{status:?}"),
            );
            return false;
        }
        // The pod's load is the prefill work routed to it and still in flight:
        // blocks it must compute. Cached blocks are shared with the requests
        // that put them there, so they add no work and must not push a
        // group's requests away from the pod that holds its prefix.
        let prompt_blocks = u32::try_from(
            decision
                .total_blocks
                .saturating_sub(decision.matched_blocks),
        )
        .unwrap_or(u32::MAX);
        let mut hashes = hashed.hashes;
        let hashed_len = hashes.len();
        // With tenant isolation the tenant's salt names the client: beyond
        // the blocks the pod already holds, it teaches only its budget.
        if let Some(salt) = request
            .cache_salt
            .as_deref()
            .filter(|_| config.tenant_header.is_some())
        {
            let new = hashes.len().saturating_sub(decision.matched_blocks);
            let client = client_key(salt);
            let allowed = w
                .cluster
                .client_allowance(&decision.pod, client, new, started.secs);
            hashes.truncate(decision.matched_blocks + allowed);
            if allowed > 0 {
                w.tell_peers(
                    PeerMessage::Charged {
                        pod: decision.pod.clone(),
                        client,
                        blocks: u32::try_from(allowed).unwrap_or(u32::MAX),
                    },
                    started,
                );
            }
        }
        let mut fallback = Taught::default();
        let mut already_taught = 0;
        if self.looked_up {
            remote::routed(&decision.pod, prompt_blocks);
        } else {
            already_taught = w.routed(&decision.pod, prompt_blocks, &hashes, started);
            if let Some(mut bytes) = self.byte_fallback.take() {
                // A tenant's budget was charged in token blocks: its byte
                // chunks teach no more than that.
                if hashes.len() < hashed_len {
                    bytes.truncate(hashes.len());
                }
                fallback = w.teach_byte_fallback(&decision.pod, bytes, started);
            }
        }
        let m = &w.metrics;
        if decision.matched_blocks > 0 {
            m.decision_prefix.inc()
        } else {
            m.decision_load.inc()
        }
        m.blocks_matched.add(decision.matched_blocks as u64);
        m.blocks_total.add(decision.total_blocks as u64);
        m.decision_us.record(started.elapsed_us());
        let explanation = decision.explain();
        if w.debug_logging {
            host::log(
                LogLevel::Debug,
                &format!(
                    "kvroute: request {} model {} → {}",
                    self.request_id, request.model, explanation
                ),
            );
        }
        self.unsettled = Some(RoutedRequest {
            pod: decision.pod.clone(),
            taught: Taught {
                hashes,
                already_taught,
            },
            matched_blocks: decision.matched_blocks,
            // Token blocks are reported by the pods themselves (KV events): a
            // learned guess shared through the indexer could outlive the pod's
            // own removal of the block. Byte chunks have no other source.
            report: hashed.domain == Domain::Bytes,
            fallback,
        });
        self.in_flight = Some((decision.pod, prompt_blocks, prompt_blocks));
        self.explanation = Some(explanation);
        false
    }

    /// Answers a sheddable request 429 with `Retry-After`: every candidate
    /// pod is saturated. If the proxy refuses the local reply, the request
    /// fails open to Envoy's LB (never lost).
    fn shed(&self, w: &crate::worker::Worker, config: &Config, why: &str) -> bool {
        let retry_after = config
            .priority
            .as_ref()
            .map_or(1, |p| p.retry_after_seconds)
            .to_string();
        let explanation = format!("shed=sheddable; {why}");
        let mut headers = vec![("retry-after", retry_after.as_str())];
        if !config.decision_header.is_empty() {
            headers.push((config.decision_header.as_str(), explanation.as_str()));
        }
        let body = b"every pod is saturated: retry later\n";
        match host::send_local_reply(429, &headers, body) {
            Ok(()) => {
                w.metrics.shed.inc();
                host::log(
                    LogLevel::Debug,
                    &format!("kvroute: request {} shed: {explanation}", self.request_id),
                );
                true
            }
            Err(status) => {
                host::log(
                    LogLevel::Warn,
                    &format!(
                        "kvroute: request {}: local 429 refused ({status:?}); left to the fallback LB",
                        self.request_id
                    ),
                );
                false
            }
        }
    }

    /// Judges the response against the decision and acts on the verdict; a
    /// successful answer waits for its end ([`RequestFilter::settle_end`]).
    fn settle(&mut self, status: Option<u16>, served_by: Option<&str>) {
        let Some(request) = self.unsettled.take() else {
            return;
        };
        let outcome = judge(&request.pod, &Response { status, served_by });
        if outcome == Outcome::Confirmed {
            self.answering = Some(request);
        } else if let Ok(mut w) = self.worker.try_borrow_mut() {
            w.settle(&request, outcome, &self.request_id);
        }
    }

    /// The stream ended: a successful answer is confirmed, or fails its pod
    /// when the pod cut it (it died mid-answer, e.g. restarted; the blocks
    /// learned about it go and it is passed over, as for any failure).
    fn settle_end(&mut self) {
        let Some(request) = self.answering.take() else {
            return;
        };
        // Only a response that did not pass whole can have been cut: the
        // property read is spared for the others.
        let details = if self.response_complete {
            None
        } else {
            host::property(&["response", "code_details"])
        };
        let outcome = judge_end(Outcome::Confirmed, details.as_deref());
        if let Ok(mut w) = self.worker.try_borrow_mut() {
            w.settle(&request, outcome, &self.request_id);
        }
    }

    /// The first response bytes mean the pod finished this prompt's prefill:
    /// its blocks stop counting as that pod's pending work.
    fn prefill_done(&mut self) {
        let Some((pod, prompt_blocks, _)) = self.in_flight.as_mut() else {
            return;
        };
        if *prompt_blocks == 0 {
            return;
        }
        let blocks = std::mem::take(prompt_blocks);
        if self.looked_up {
            remote::prefill_done(pod, blocks);
        } else if let Ok(mut w) = self.worker.try_borrow_mut() {
            w.prefill_done(pod, blocks);
        }
    }

    fn release(&mut self) {
        if let Some((pod, prompt_blocks, routed_blocks)) = self.in_flight.take() {
            if self.looked_up {
                remote::finished(&pod, prompt_blocks);
            } else if let Ok(mut w) = self.worker.try_borrow_mut() {
                w.finished(&pod, prompt_blocks, routed_blocks);
            }
        }
    }
}

/// Tenant isolation: writes the salt of the tenant named by `header` into the
/// body as `cache_salt` (replacing the client's), so the pods and routing
/// scope the prompt alike. A request without the header is the anonymous tenant.
fn inject_tenant_salt(
    header: &str,
    body: &[u8],
    request: &mut PromptRequest,
) -> Result<(), String> {
    let salt = request::tenant_salt(&host::request_header(header).unwrap_or_default());
    let salted = request::with_cache_salt(body, &salt).map_err(|e| e.to_string())?;
    host::set_request_body(body.len(), &salted).map_err(|s| format!("body: {s:?}"))?;
    host::set_request_header("content-length", Some(&salted.len().to_string()))
        .map_err(|s| format!("content-length: {s:?}"))?;
    request.cache_salt = Some(salt);
    Ok(())
}

/// A callback's headers: read at once, or (should the proxy's map not
/// decode) one host call per header read with the given reader.
enum Headers<'a> {
    Read(&'a HeaderMap<'a>),
    OneByOne(fn(&str) -> Option<String>),
}

impl<'a> Headers<'a> {
    /// The headers in `decoded` (what the proxy serialized, decoded), or
    /// `one_by_one` when there is no map; `which` names them in the log line.
    fn of(
        decoded: &'a Option<Result<HeaderMap<'a>, CodecError>>,
        one_by_one: fn(&str) -> Option<String>,
        which: &str,
    ) -> Headers<'a> {
        match decoded {
            Some(Ok(map)) => Headers::Read(map),
            Some(Err(e)) => {
                host::log(
                    LogLevel::Warn,
                    &format!("kvroute: {which} headers unreadable at once ({e}); reading them one by one"),
                );
                Headers::OneByOne(one_by_one)
            }
            None => Headers::OneByOne(one_by_one),
        }
    }

    fn get(&self, name: &str) -> Option<String> {
        match self {
            Headers::Read(map) => map.get(name),
            Headers::OneByOne(read) => read(name),
        }
    }

    fn may_contain(&self, name: &str) -> bool {
        match self {
            Headers::Read(map) => map.contains(name),
            Headers::OneByOne(_) => true,
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
        let tokens = match (
            host::http_call_status(num_headers),
            host::http_call_body(num_headers, body_size),
        ) {
            (Some(200), Some(body)) => {
                request::parse_tokenize_response(&body).map_err(|e| e.to_string())
            }
            (status, _) => Err(format!("status {status:?}")),
        };
        let PendingTokenize {
            request,
            started_us,
            text,
            ..
        } = pending;
        // Token blocks, or the byte chunks to route on when the call failed.
        let answered = host::now();
        let (request, hashed) = match tokens {
            Ok(tokens) => {
                let request = PromptRequest {
                    prompt: Prompt::Tokens(tokens),
                    ..request
                };
                let Ok(mut w) = self.worker.try_borrow_mut() else {
                    host::resume_request();
                    return;
                };
                w.metrics.tokenizer_ok.inc();
                w.metrics
                    .tokenizer_us
                    .record(answered.micros.saturating_sub(started_us));
                let hashed = hash_prompt(&w.config, &request);
                // A later call that fails routes this prompt's group on
                // bytes: these chunks let it find the same pod.
                w.token_memo.learn(&text, hashed.hashes.clone());
                self.byte_fallback = Some(text.chunks);
                (request, Ok(hashed))
            }
            Err(why) => {
                if let Ok(w) = self.worker.try_borrow() {
                    w.metrics.tokenizer_failed.inc();
                }
                host::log(
                    LogLevel::Debug,
                    &format!(
                        "kvroute: request {}: tokenizer failed ({why}); routing on bytes",
                        self.request_id
                    ),
                );
                (request, Err(text.chunks))
            }
        };
        let paused = match hashed {
            Ok(tokens) => self.route_hashed(request, tokens, answered),
            Err(chunks) => self.route_on_bytes(request, chunks, answered),
        };
        if !paused {
            host::resume_request();
        }
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
