//! What a routed request teaches: its blocks sent to the singleton (but for
//! those already taught in this epoch), and, once its response is judged,
//! confirmed, taken back, or moved to the pod that served it.

use super::{RoutedRequest, Taught, Worker};
use crate::host::{self, Now, SharedData};
use crate::peers::Audience;
use kvroute_core::budget::client_key;
use kvroute_core::hash::BlockHash;
use kvroute_core::index::{epoch_start_s, match_lengths, PodMatch};
use kvroute_core::outcome::Outcome;
use kvroute_core::wire::PeerMessage;
use proxy_wasm::types::LogLevel;

impl Worker {
    /// A request went to `pod` (just decided on `hashes`): its load is
    /// counted here and by the peers, and the blocks it teaches go to the
    /// singleton (and the recent decisions, until the singleton's flush
    /// shows them), except the leading ones the decision's lookup found
    /// already taught to `pod` in this epoch, or this VM sent in it:
    /// teaching them again would change nothing but cost the singleton
    /// their buckets' reads. Returns how many leading blocks were skipped.
    pub fn routed(
        &mut self,
        pod: &str,
        prompt_blocks: u32,
        hashes: &[BlockHash],
        now: Now,
    ) -> usize {
        self.cluster
            .record_routed(pod, prompt_blocks, &[], now.secs);
        self.note_load_change();
        let position = self.cluster.position(pod);
        let in_index = match self.taught_for.take() {
            Some(first) if hashes.first() == Some(&first) => self
                .taught_this_epoch
                .iter()
                .find(|&&(p, _)| Some(p) == position)
                .map_or(0, |&(_, blocks)| blocks),
            _ => 0,
        };
        self.taught_this_epoch.clear();
        let already_taught = in_index.max(self.sent_this_epoch(pod, hashes, now));
        self.teach(pod, hashes, already_taught, now.millis);
        already_taught
    }

    /// Leading `hashes` the published index (as the request's decision read
    /// it) shows taught to `pod` in this epoch.
    fn taught_in_index(&self, pod: &str, hashes: &[BlockHash], now: Now) -> usize {
        let (Some(position), Some(source)) =
            (self.cluster.position(pod), self.index.source(&SharedData))
        else {
            return 0;
        };
        let rules = self.cluster.match_rules(&self.config, now.secs);
        let mut found: Vec<PodMatch> = Vec::new();
        match_lengths(&source, hashes, now.secs, &rules, &mut found);
        found
            .iter()
            .find(|m| self.positions.get(m.pod.slot()) == Some(&Some(position)))
            .map_or(0, |m| m.taught_this_epoch)
    }

    /// Leading `hashes` this VM sent for `pod` in this epoch, which the index
    /// may not show yet (the flush gap).
    fn sent_this_epoch(&self, pod: &str, hashes: &[BlockHash], now: Now) -> usize {
        let epoch_start_ms =
            u64::from(epoch_start_s(self.config.index.ttl_seconds, now.secs)) * 1000;
        self.recent
            .taught_since(pod, hashes, epoch_start_ms, now.millis)
    }

    /// With tenant isolation the tenant's salt names the client: beyond the
    /// `matched` blocks the pod already holds, its prompt teaches only the
    /// client's budget. Cuts `hashes` to what may be taught and tells the
    /// peers what was charged.
    pub fn charge_client(
        &mut self,
        pod: &str,
        salt: &str,
        matched: usize,
        hashes: &mut Vec<BlockHash>,
        now: Now,
    ) {
        let new = hashes.len().saturating_sub(matched);
        let client = client_key(salt);
        let allowed = self.cluster.client_allowance(pod, client, new, now.secs);
        hashes.truncate(matched + allowed);
        if allowed > 0 {
            let blocks = u32::try_from(allowed).unwrap_or(u32::MAX);
            let pod = pod.to_owned();
            self.tell_peers(
                PeerMessage::Charged {
                    pod,
                    client,
                    blocks,
                },
                now,
            );
        }
    }

    /// Teaches a token-routed prompt's byte chunks on `pod` (see
    /// [`RoutedRequest::fallback`]), but for the leading ones the index
    /// shows taught to it in this epoch, or this VM sent in it. The decision
    /// looked up the token blocks only: this second lookup costs a few
    /// probes of the chain, where teaching and reporting every chunk again
    /// would cost the singleton and the indexer a write each.
    pub fn teach_byte_fallback(&mut self, pod: &str, hashes: Vec<BlockHash>, now: Now) -> Taught {
        // A prompt this VM sent whole in the epoch (a repeated one) needs no
        // lookup: the index cannot show more.
        let sent = self.sent_this_epoch(pod, &hashes, now);
        let already_taught = if sent == hashes.len() {
            sent
        } else {
            self.taught_in_index(pod, &hashes, now).max(sent)
        };
        self.teach(pod, &hashes, already_taught, now.millis);
        Taught {
            hashes,
            already_taught,
        }
    }

    /// Sends what `pod` holds (cut to its share) to the singleton, but for
    /// its first `already_taught` blocks.
    fn teach(&mut self, pod: &str, hashes: &[BlockHash], already_taught: usize, now_ms: u64) {
        let learned = self.cluster.learnable(pod, hashes);
        if learned.is_empty() {
            return;
        }
        self.recent.record(pod, learned, now_ms);
        let skipped = already_taught.min(learned.len());
        self.metrics.blocks_already_taught.add(skipped as u64);
        if skipped == learned.len() {
            return;
        }
        let message = PeerMessage::Routed {
            pod: pod.to_string(),
            hashes: learned[skipped..].to_vec(),
        };
        self.send(message, Audience::None, true);
    }

    /// Hands confirmed blocks to the singleton, which reports them to the
    /// indexer as learned entries (when this proxy shares what it learns);
    /// the singleton learned them when they were routed.
    pub fn report_learned(&self, pod: &str, hashes: &[BlockHash]) {
        let sharing = self
            .config
            .indexer
            .as_ref()
            .is_some_and(|i| i.share_learned);
        if sharing && !hashes.is_empty() {
            let message = PeerMessage::Learned {
                pod: pod.to_string(),
                hashes: hashes.to_vec(),
            };
            self.send(message, Audience::None, true);
        }
    }

    /// Settles a routed request by its response: confirms or takes back what
    /// it taught, passes over a pod that failed. `report` says whether its
    /// blocks are shared with the indexer (byte chunks: token blocks come
    /// from the pods' own events). A request reports only the blocks it
    /// taught: the request that taught the leading ones in this epoch
    /// reported them, and the indexer's learned entries outlive an epoch.
    pub fn settle(&mut self, request: &RoutedRequest, outcome: Outcome, request_id: &str) {
        self.metrics.outcome(&outcome);
        let chosen = &request.pod;
        match outcome {
            Outcome::Confirmed => {
                if request.report {
                    self.report_learned(chosen, request.taught.own());
                }
                self.report_learned(chosen, request.fallback.own());
            }
            Outcome::Refused => {
                let hashes = &request.taught.hashes;
                let taught = hashes.get(request.matched_blocks..).unwrap_or(&[]);
                self.recent.forget(chosen);
                let messages: Vec<PeerMessage> = [taught, request.fallback.own()]
                    .into_iter()
                    .filter(|hashes| !hashes.is_empty())
                    .map(|hashes| PeerMessage::Unlearned {
                        pod: chosen.clone(),
                        hashes: hashes.to_vec(),
                    })
                    .collect();
                self.send_all(&messages, Audience::None, true);
            }
            Outcome::Failed | Outcome::ServedElsewhere { .. } => {
                self.cluster.record_failure(chosen, host::now().secs);
                self.recent.forget(chosen);
                // Peers pass the pod over; the singleton clears what was learned on it.
                let message = PeerMessage::Failed {
                    pod: chosen.clone(),
                };
                self.send(message, Audience::Serving, true);
                host::log(
                    LogLevel::Warn,
                    &format!(
                        "kvroute: request {request_id}: pod {chosen} failed ({}); passed over for {} s",
                        outcome.name(),
                        self.config.failure_cooldown_seconds
                    ),
                );
            }
        }
        if let Outcome::ServedElsewhere { pod, success: true } = outcome {
            let hashes = &request.taught.hashes;
            self.teach(pod, hashes, 0, host::now().millis);
            if request.report {
                self.report_learned(pod, hashes);
            }
            let bytes = &request.fallback.hashes;
            if !bytes.is_empty() {
                self.teach(pod, bytes, 0, host::now().millis);
                self.report_learned(pod, bytes);
            }
        }
    }
}
