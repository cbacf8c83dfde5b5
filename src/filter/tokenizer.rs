//! The tokenizer call-out of precise mode: a text prompt's token ids from
//! the memo or from a pod's `/tokenize`, and routing once the answer is in.

use super::RequestFilter;
use crate::host::{self, Now};
use kvroute_core::hash::Domain;
use kvroute_core::request::{self, Prompt, PromptRequest};
use kvroute_core::router::{hash_prompt, serving_model, HashedPrompt};
use kvroute_core::token_memo::PromptText;
use proxy_wasm::types::LogLevel;

/// A request waiting for its tokenizer call-out.
pub(super) struct PendingTokenize {
    pub(super) token: u32,
    pub(super) request: PromptRequest,
    pub(super) started_us: u64,
    /// The prompt's text, for the token memo to learn with the answer.
    pub(super) text: PromptText,
}

impl RequestFilter {
    /// A text prompt's chunks, when precise mode wants its token ids.
    pub(super) fn text_for_tokenizer(&self, request: &PromptRequest) -> Option<PromptText> {
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
    pub(super) fn recall_tokens(
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
    pub(super) fn start_tokenizer(&self, body: &[u8]) -> Option<u32> {
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

    /// The call-out answered (or failed): route on the token blocks, or on
    /// the byte chunks when there are none, and resume unless that pauses.
    pub(super) fn on_tokenizer_answer(
        &mut self,
        pending: PendingTokenize,
        num_headers: usize,
        body_size: usize,
    ) {
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
