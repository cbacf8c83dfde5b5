//! Reading the index the singleton publishes: a decision's matches (the
//! published index and this VM's recent routes), the published pod ids
//! mapped to this VM's pods, and the log line when the index goes or comes back.

use super::Worker;
use crate::host::{self, Now, SharedData};
use kvroute_core::config::Config;
use kvroute_core::hash::BlockHash;
use kvroute_core::index::published::Unpublished;
use kvroute_core::index::{match_lengths, LookupCost, PodMatch};
use kvroute_core::router::{Decision, HashedPrompt, LocalMatch, NoRoute};
use proxy_wasm::types::LogLevel;

/// An index whose head (rewritten at every flush) is older than this is not
/// read: its writer stopped, and the VM routes on load only.
const STALE_AFTER_MS: u64 = 5000;

/// A VM reads the index's head (a host call) at most this often: a view up
/// to this much behind the writer's flushes (every 100 ms) costs nothing,
/// and its recent routes cover what it sent meanwhile.
const HEAD_REREAD_MS: u64 = 10;

impl Worker {
    /// Picks the pod for `prompt`: the published index's matches and this
    /// VM's own recent decisions, ranked with the pods' load. Without a
    /// published index, on load only, and the reason.
    pub fn decide(
        &mut self,
        config: &Config,
        prompt: &HashedPrompt,
        now: Now,
    ) -> (Result<Decision, NoRoute>, Option<Unpublished>) {
        if self.cluster.is_empty() {
            // Nothing to route to, whatever the index says (a sidecar's local fallback).
            return (Err(NoRoute::NoEndpoints), None);
        }
        self.read_peer_load(now.millis);
        let seed = self.next_tie_seed();
        self.taught_for = prompt.hashes.first().copied();
        let (matches, lookup, unpublished) = self.index_matches(config, &prompt.hashes, true, now);
        self.note_index_state(unpublished);
        let decision = self
            .cluster
            .decide_on(config, prompt, now.secs, seed, &matches, lookup);
        (decision, unpublished)
    }

    /// The most leading blocks of `hashes` any pod is known to hold (the
    /// published index and this VM's recent decisions); 0 without an index.
    pub fn longest_known(&mut self, config: &Config, hashes: &[BlockHash], now: Now) -> usize {
        let (matches, ..) = self.index_matches(config, hashes, false, now);
        matches.iter().map(|m| m.blocks).max().unwrap_or(0)
    }

    /// Every pod's leading blocks of `hashes` in the published index and in
    /// this VM's recent decisions. With `for_decision`, also notes which
    /// blocks the index showed taught this epoch (see [`Worker::routed`]).
    fn index_matches(
        &mut self,
        config: &Config,
        hashes: &[BlockHash],
        for_decision: bool,
        now: Now,
    ) -> (Vec<LocalMatch>, LookupCost, Option<Unpublished>) {
        let (now_s, now_ms) = (now.secs, now.millis);
        let mut matches: Vec<LocalMatch> = Vec::new();
        let mut lookup = LookupCost::default();
        if for_decision {
            self.taught_this_epoch.clear();
        }
        let head_is_recent = self
            .head_read_ms
            .is_some_and(|read| now_ms.saturating_sub(read) < HEAD_REREAD_MS);
        if !head_is_recent {
            if let Err(why) = self.index.refresh(&SharedData, now_ms, STALE_AFTER_MS) {
                self.head_read_ms = None;
                self.metrics.index_unpublished.inc();
                return (matches, lookup, Some(why));
            }
            self.head_read_ms = Some(now_ms);
        }
        self.refresh_positions();
        if let Some(source) = self.index.source(&SharedData) {
            let rules = self.cluster.match_rules(config, now_s);
            let mut found: Vec<PodMatch> = Vec::new();
            lookup = match_lengths(&source, hashes, now_s, &rules, &mut found);
            let m = &self.metrics;
            let (reads, reused) = source.reads();
            m.index_unreadable.add(source.unreadable());
            m.index_lookup_reads.add(reads);
            m.index_lookup_reused.add(reused);
            for m in &found {
                let Some(&Some(pod)) = self.positions.get(m.pod.slot()) else {
                    continue;
                };
                matches.push(LocalMatch {
                    pod,
                    blocks: m.blocks,
                    credit: m.credit,
                });
                if for_decision && m.taught_this_epoch > 0 {
                    self.taught_this_epoch.push((pod, m.taught_this_epoch));
                }
            }
        }
        // The flush gap: what this VM routed and the index may not show yet.
        for (pod, blocks) in self.recent.matches(hashes, now_ms) {
            if let Some(pod) = self.cluster.position(pod) {
                LocalMatch::merge_learned(&mut matches, pod, blocks);
            }
        }
        (matches, lookup, None)
    }

    /// Logs when the published index becomes unusable and when it is back.
    fn note_index_state(&mut self, now: Option<Unpublished>) {
        if now == self.unpublished {
            return;
        }
        match now {
            Some(why) => host::log(
                LogLevel::Warn,
                &format!(
                    "kvroute: no routing index published ({}): routing on load only until the \
                     singleton (bootstrap wasm_service, same vm_id) publishes one",
                    why.name()
                ),
            ),
            None => host::log(
                LogLevel::Info,
                "kvroute: routing index published; reading it",
            ),
        }
        self.unpublished = now;
    }

    /// Maps published pod ids to this VM's pods when either side changed.
    fn refresh_positions(&mut self) {
        let key = (self.index.pods_version(), self.cluster.pods_version());
        if key == self.positions_of {
            return;
        }
        let table = self.index.pods();
        self.positions = vec![None; table.id_span()];
        for (id, address) in table.addresses() {
            self.positions[id.slot()] = self.cluster.position(address);
        }
        self.positions_of = key;
    }
}
