//! What routed requests teach the index about pods, and what refusals and
//! failures take back.

use super::Cluster;
use crate::budget::ClientKey;
use crate::feed::Tier;
use crate::hash::BlockHash;

impl Cluster {
    /// A request went to `address`: count its load and learn its blocks
    /// (provisionally: a failed answer takes them back, see
    /// [`Cluster::forget_learned`]).
    pub fn record_routed(
        &mut self,
        address: &str,
        prompt_blocks: u32,
        hashes: &[BlockHash],
        now_s: u32,
    ) {
        let policy = self.policy;
        let Some(i) = self.by_address.get(address).copied() else {
            return;
        };
        let blocks = u64::from(prompt_blocks);
        self.update_own_load(i, |own| {
            own.requests = own.requests.saturating_add(1);
            own.pending_blocks = own.pending_blocks.saturating_add(blocks);
            own.active_blocks = own.active_blocks.saturating_add(blocks);
        });
        let pod = &self.pods[i];
        let learned = pod.learnable(hashes, &policy);
        if let Some(index) = &mut self.index {
            index.touch_chain(pod.id, learned, Tier::Learned, now_s);
        }
    }

    /// The leading blocks of `hashes` one request may teach `address`
    /// (`index.max_learn_share` of its capacity).
    pub fn learnable<'h>(&self, address: &str, hashes: &'h [BlockHash]) -> &'h [BlockHash] {
        match self.pod(address) {
            Some(pod) => pod.learnable(hashes, &self.policy),
            None => &[],
        }
    }

    /// The writer learns `hashes` on `address` as a worker sent them (the
    /// worker already cut them to the pod's share); an unknown pod is added
    /// unless discovery owns the pod set.
    pub fn learn_as_told(&mut self, address: &str, hashes: &[BlockHash], now_s: u32) {
        let Some(id) = self.ensure_pod(address).map(|p| p.id) else {
            return;
        };
        if let Some(index) = &mut self.index {
            index.touch_chain(id, hashes, Tier::Learned, now_s);
        }
    }

    /// How many leading blocks of a `want`-block prompt `client` may teach
    /// `address` now (its budget: `index.max_client_share` of the pod's
    /// capacity per `index.ttl_seconds`); what it may teach is charged.
    pub fn client_allowance(
        &mut self,
        address: &str,
        client: ClientKey,
        want: usize,
        now_s: u32,
    ) -> usize {
        let policy = self.policy;
        let Some(pod) = self.pod_mut(address) else {
            return want;
        };
        let limit = (f64::from(pod.spec.capacity_blocks) * policy.max_client_share).ceil() as u64;
        pod.client_budgets
            .charge(client, want, limit, now_s, policy.client_window_seconds)
    }

    /// A peer VM charged `client` `blocks` of its budget on `address`: the
    /// same charge here, so the budget holds for the whole proxy.
    pub fn charge_client(&mut self, address: &str, client: ClientKey, blocks: usize, now_s: u32) {
        let window = self.policy.client_window_seconds;
        if let Some(pod) = self.pod_mut(address) {
            pod.client_budgets
                .charge(client, blocks, u64::MAX, now_s, window);
        }
    }

    /// A request routed to `address` was refused: the blocks it taught
    /// the index are not cached there after all.
    pub fn forget_learned(&mut self, address: &str, hashes: &[BlockHash]) {
        let id = self.pod(address).map(|p| p.id);
        if let (Some(id), Some(index)) = (id, &mut self.index) {
            index.remove_learned(id, hashes);
        }
    }

    /// `address` failed a request (5xx, reset, or Envoy had to serve it
    /// elsewhere): it may have restarted with an empty cache, so what was
    /// learned about it goes, and other pods are preferred for a while.
    pub fn record_failure(&mut self, address: &str, now_s: u32) {
        let cooldown = self.policy.failure_cooldown_seconds;
        if let Some(pod) = self.pod_mut(address) {
            pod.passed_over_until_s = now_s.saturating_add(cooldown);
            let id = pod.id;
            if let Some(index) = &mut self.index {
                index.clear_learned(id);
            }
        }
    }
}
