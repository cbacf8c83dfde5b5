//! Messages between this VM and its peers and the singleton: sent in batches
//! over the proxy's shared queues, and applied when they arrive.

use super::Worker;
use crate::host::{self, Now};
use crate::peers::Audience;
use kvroute_core::feed;
use kvroute_core::outbox::Pushed;
use kvroute_core::wire::{self, PeerMessage};
use proxy_wasm::types::LogLevel;

/// Precise entries stay trusted this long after the last feed update when
/// no indexer poll period is configured.
const DEFAULT_TRUST_S: u32 = 5;

impl Worker {
    /// Tells the serving peers about a budget charge, in the next batch
    /// (within [`CHARGE_BATCH_MS`](super::CHARGE_BATCH_MS)): every queue message wakes each peer's VM.
    pub fn tell_peers(&mut self, message: PeerMessage, now: Now) {
        if self.peers.serving_count() == 0 {
            return;
        }
        if self.outbox.push(message, now.millis) == Pushed::Armed {
            self.ticker.set_period(self.outbox.delay_ms());
        }
    }

    pub(super) fn send(&self, message: PeerMessage, audience: Audience, to_singleton: bool) {
        self.send_all(&[message], audience, to_singleton);
    }

    pub(super) fn send_all(
        &self,
        messages: &[PeerMessage],
        audience: Audience,
        to_singleton: bool,
    ) {
        match wire::encode_batch(messages) {
            Ok(bytes) => {
                self.peers.broadcast(&bytes, audience, to_singleton);
            }
            Err(e) => host::log(
                LogLevel::Warn,
                &format!("kvroute: peer message not sent: {e}"),
            ),
        }
    }

    /// Applies what peers sent to this VM's queue.
    pub fn drain_queue(&mut self) {
        let Some(queue) = self.peers.own_queue() else {
            return;
        };
        let now_s = host::now().secs;
        while let Some(bytes) = host::queue_dequeue(queue) {
            match wire::decode_batch(&bytes) {
                Ok(messages) => messages.into_iter().for_each(|m| self.apply(m, now_s)),
                Err(e) => {
                    self.metrics.peer_errors.inc();
                    host::log(
                        LogLevel::Warn,
                        &format!("kvroute: dropped a peer message: {e}"),
                    );
                }
            }
        }
    }

    fn apply(&mut self, message: PeerMessage, now_s: u32) {
        match message {
            // Only the singleton takes these (it writes the index).
            PeerMessage::Routed { .. }
            | PeerMessage::Learned { .. }
            | PeerMessage::Unlearned { .. } => {}
            PeerMessage::Failed { pod } => self.cluster.record_failure(&pod, now_s),
            PeerMessage::Charged {
                pod,
                client,
                blocks,
            } => self
                .cluster
                .charge_client(&pod, client, blocks as usize, now_s),
            PeerMessage::Feed(bytes) => match feed::decode(&bytes) {
                Ok(update) => {
                    let trust_s = self.config.indexer.as_ref().map_or(DEFAULT_TRUST_S, |i| {
                        (i.poll_ms.saturating_mul(30) / 1000).max(DEFAULT_TRUST_S)
                    });
                    self.cluster.apply_feed(&update, now_s, trust_s);
                }
                Err(e) => {
                    self.metrics.peer_errors.inc();
                    host::log(
                        LogLevel::Warn,
                        &format!("kvroute: dropped a feed update: {e}"),
                    );
                }
            },
        }
    }
}
