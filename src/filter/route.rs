//! Routing one request: parse its body, hash its prompt, decide (locally or
//! through a remote lookup) and apply the decision: destination header, load,
//! teaching, stats; or shed it when every candidate pod is saturated.

use super::tokenizer::PendingTokenize;
use super::RequestFilter;
use crate::host::{self, Now};
use crate::metrics::FailOpen;
use crate::remote::{self, PendingLookup};
use crate::worker::{RoutedRequest, Taught};
use kvroute_core::admission::sheds;
use kvroute_core::config::Config;
use kvroute_core::hash::{BlockHash, Domain};
use kvroute_core::lookup::LookupError;
use kvroute_core::request::{self, PromptRequest};
use kvroute_core::router::{hash_prompt, serving_model, Decision, HashedPrompt, NoRoute};
use proxy_wasm::types::LogLevel;

impl RequestFilter {
    /// Parses the buffered body and routes it, or starts a tokenizer call.
    /// Returns true when the request must stay paused for the call.
    pub(super) fn on_body(&mut self, body: &[u8]) -> bool {
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
    pub(super) fn route_on_bytes(
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
    pub(super) fn route_hashed(
        &mut self,
        request: PromptRequest,
        hashed: HashedPrompt,
        started: Now,
    ) -> bool {
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
    pub(super) fn on_lookup_answer(
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
        if let Some(salt) = request
            .cache_salt
            .as_deref()
            .filter(|_| config.tenant_header.is_some())
        {
            w.charge_client(
                &decision.pod,
                salt,
                decision.matched_blocks,
                &mut hashes,
                started,
            );
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
        w.metrics.decided(
            decision.matched_blocks,
            decision.total_blocks,
            started.elapsed_us(),
        );
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
