//! The indexer feed: the calls `kvroute_core::feed_client` asks for (a poll
//! per `indexer.poll_ms`, snapshot pages and waiting deltas at once), their
//! answers applied to the index (each page as it comes, on its own run of
//! buckets: pages are ranges of the index key), and the pods and their load
//! forwarded to the workers.

use super::{first_failure_level, Singleton};
use crate::host;
use crate::peers::Audience;
use kvroute_core::config::IndexerSettings;
use kvroute_core::feed::{self, FeedUpdate, Lists};
use kvroute_core::feed_client::{FeedRequest, FeedResponse, Received};
use kvroute_core::feed_forward::{Forward, PodsChanged};
use kvroute_core::wire::{self, PeerMessage};
use proxy_wasm::types::LogLevel;

/// The tick that applies a feed answer after its callback returned.
const APPLY_AFTER_MS: u64 = 1;

impl Singleton {
    /// The indexer answered a feed call sent at `started_ms`.
    pub(super) fn on_feed_answer(&mut self, started_ms: u64, num_headers: usize, body_size: usize) {
        let answered = host::now();
        let now_ms = answered.millis;
        self.metrics
            .latency_ms
            .record(now_ms.saturating_sub(started_ms));
        // Envoy's async client refuses bodies above its buffer limit (no
        // response); the indexer keeps every answer far below it (pages).
        let body;
        let response = match host::http_call_status(num_headers) {
            Some(200) => {
                body = host::http_call_body(num_headers, body_size).unwrap_or_default();
                FeedResponse::Body(&body)
            }
            Some(status) => FeedResponse::Status(u32::from(status)),
            None => FeedResponse::NoResponse,
        };
        let outcome = self.feed.on_response(now_ms, response);
        self.metrics.apply_us.add(answered.elapsed_us());
        // The next page (or waiting deltas) is asked for at once. Envoy sends
        // the call only once this callback returns, so the answer is applied
        // at a tick a millisecond later: the indexer then prepares the next
        // answer while the index takes this one, instead of after it.
        let mut asked = false;
        if let Some(request) = self.feed.follow_up(now_ms) {
            if let Some(indexer) = self.indexer.clone() {
                asked = self.send_feed(&indexer, request, now_ms);
            }
        }
        match outcome {
            Ok(received) => {
                self.metrics.bytes.add(body_size as u64);
                if let Some(earlier) = self.unapplied.take() {
                    self.apply(earlier);
                }
                if asked {
                    self.unapplied = Some(received);
                    self.ticker.set_period(APPLY_AFTER_MS);
                } else {
                    self.apply(received);
                }
            }
            Err(fault) => self.failed(&fault.to_string()),
        }
    }

    /// Sends a feed call; true when it left.
    pub(super) fn send_feed(
        &mut self,
        indexer: &IndexerSettings,
        request: FeedRequest,
        now_ms: u64,
    ) -> bool {
        let path = format!("{}?{}", indexer.feed_path, request.query());
        match host::http_call(
            &indexer.cluster,
            &indexer.authority,
            "GET",
            &path,
            None,
            indexer.timeout_ms,
        ) {
            Ok(token) => {
                self.feed_call = Some((token, now_ms));
                true
            }
            Err(status) => {
                let fault = self.feed.on_response(now_ms, FeedResponse::NotSent);
                if let Err(fault) = fault {
                    self.failed(&format!("{fault}: {status:?}"));
                }
                false
            }
        }
    }

    /// Applies a feed answer, timed (`kvroute.feed.apply_us`).
    pub(super) fn apply(&mut self, received: Received) {
        let started = host::now();
        self.received(received);
        self.metrics.apply_us.add(started.elapsed_us());
    }

    /// Counts an applied feed answer and passes its update on.
    fn received(&mut self, received: Received) {
        self.metrics.ok.inc();
        self.metrics.pods.record(self.feed.pods().len() as u64);
        if received.new_pod_list {
            self.note_refused_pods(&received.update);
        }
        if received.page.is_some() {
            self.metrics.pages.inc();
        }
        if received.snapshot_complete {
            self.metrics.snapshots.inc();
        }
        if self.failing {
            self.failing = false;
            host::log(LogLevel::Info, "kvroute singleton: indexer feed is back");
        }
        self.forward(&received.update);
        // The singleton decides nothing: trusting precise entries is the
        // workers' call, from when the feed last reached them.
        self.cluster
            .apply_feed(&received.update, host::now().secs, 0);
    }

    /// Counts and logs the pods every VM skips for their address
    /// (`kvroute_core::feed::PodInfo::has_pod_address`).
    fn note_refused_pods(&self, update: &FeedUpdate) {
        let mut refused = update.pods.iter().filter(|p| !p.has_pod_address());
        let Some(first) = refused.next() else {
            return;
        };
        let count = 1 + refused.count();
        self.metrics.pods_refused.add(count as u64);
        host::log(
            LogLevel::Warn,
            &format!(
                "kvroute singleton: indexer feed names {count} pod(s) whose address is not \
                 host:port, skipped (first: {:?})",
                first.address
            ),
        );
    }

    /// Every worker VM gets the pods and their load when it may lack them,
    /// their load alone when only that changed, and otherwise word once a
    /// second that the feed is alive, which renews its trust in precise
    /// entries (see `kvroute_core::feed_forward`).
    fn forward(&mut self, update: &FeedUpdate) {
        let recipients = self.peers.recipients(Audience::All);
        let carried = update.lists();
        let changed = match carried {
            Lists::Pods(_) => PodsChanged::List,
            Lists::Load(_) => PodsChanged::Load,
            Lists::None => PodsChanged::Nothing,
        };
        let what = self
            .list_forwarding
            .due(changed, &recipients, host::now().millis);
        let lists = match (what, carried) {
            (Forward::Nothing, _) => return,
            (Forward::List, _) => {
                self.metrics.forwarded_lists.inc();
                Lists::Pods(self.feed.pods())
            }
            (Forward::Load, Lists::Load(load)) => {
                self.metrics.forwarded_loads.inc();
                Lists::Load(load)
            }
            (Forward::Alive | Forward::Load, _) => Lists::None,
        };
        let forwarded = feed::encode_forward(
            update.epoch,
            update.cursor,
            update.snapshot,
            update.pods_version,
            lists,
        );
        match wire::encode_batch(&[PeerMessage::Feed(forwarded)]) {
            Ok(message) => {
                self.peers.broadcast(&message, Audience::All, false);
            }
            Err(e) => host::log(
                LogLevel::Warn,
                &format!("kvroute singleton: feed not forwarded: {e}"),
            ),
        }
    }

    /// Counts a failure; logs when the feed goes from healthy to failing.
    fn failed(&mut self, why: &str) {
        self.metrics.errors.inc();
        host::log(
            first_failure_level(&mut self.failing),
            &format!("kvroute singleton: {why}; filters keep routing on what they have"),
        );
    }
}
