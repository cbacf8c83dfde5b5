//! Learned reports: the workers' confirmed decisions kept and posted to the
//! indexer, which shares them with every other proxy (with the bearer token
//! named by `indexer.token_env`, when `indexer.share_learned`).

use super::{first_failure_level, Singleton};
use crate::host;
use kvroute_core::config::IndexerSettings;
use kvroute_core::feed;
use kvroute_core::hash::BlockHash;
use proxy_wasm::types::LogLevel;

/// Learned hashes waiting to be reported; beyond this they are dropped
/// (the indexer is slow or down, and the queue must stay bounded).
const MAX_PENDING_LEARNED: usize = 1 << 16;

impl Singleton {
    /// Keeps a confirmed decision for the next report, when this proxy
    /// shares what it learns and the pending reports have room.
    pub(super) fn keep_for_report(&mut self, pod: String, hashes: Vec<BlockHash>) {
        let sharing = self.indexer.as_ref().is_some_and(|i| i.share_learned);
        if !sharing || self.pending_hashes + hashes.len() > MAX_PENDING_LEARNED {
            return;
        }
        self.pending_hashes += hashes.len();
        self.pending.entries.push((pod, hashes));
    }

    /// Posts the confirmed decisions kept since the last report (one call
    /// in flight at most).
    pub(super) fn send_learned_report(&mut self, indexer: &IndexerSettings) {
        if self.learned_call.is_some() || self.pending.entries.is_empty() {
            return;
        }
        let batch = std::mem::take(&mut self.pending);
        self.pending_hashes = 0;
        let body = feed::encode_learned(&batch);
        let headers: Vec<(&str, &str)> = self
            .authorization
            .as_deref()
            .map(|a| ("authorization", a))
            .into_iter()
            .collect();
        match host::http_call_with_headers(
            &indexer.cluster,
            &indexer.authority,
            "POST",
            &indexer.learned_path,
            Some(&body),
            indexer.timeout_ms,
            &headers,
        ) {
            Ok(token) => {
                self.learned_call = Some(token);
                self.metrics.learned_sent.add(batch.entries.len() as u64);
            }
            Err(status) => self.learned_failed(&format!("not sent: {status:?}")),
        }
    }

    /// The indexer answered a learned report.
    pub(super) fn on_learned_answer(&mut self, num_headers: usize) {
        match host::http_call_status(num_headers) {
            Some(200) => {
                if self.learned_failing {
                    self.learned_failing = false;
                    host::log(
                        LogLevel::Info,
                        "kvroute singleton: learned reports are accepted again",
                    );
                }
            }
            Some(401) => self.learned_failed(
                "refused (401): the token of indexer.token_env is not one the indexer's \
                 --learned-token-file accepts",
            ),
            Some(403) => self.learned_failed(
                "refused (403): the indexer or the mesh policy takes no learned entries \
                 from this proxy (set indexer.share_learned to false to stop reporting)",
            ),
            status => self.learned_failed(&format!("answered {status:?}")),
        }
    }

    /// Counts a learned report that failed; logs when reports start failing.
    /// Routing does not depend on it: this proxy keeps its own decisions.
    fn learned_failed(&mut self, why: &str) {
        self.metrics.learned_refused.inc();
        host::log(
            first_failure_level(&mut self.learned_failing),
            &format!("kvroute singleton: learned report {why}; other proxies do not see this one's decisions"),
        );
    }
}
