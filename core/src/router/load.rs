//! Requests in flight per pod, this VM's and its peers', and the
//! least-loaded order they keep.

use super::pod::Pod;
use super::Cluster;
use crate::hash::splitmix64;
use crate::peer_load::PodLoad;
use std::collections::HashMap;

impl Cluster {
    /// A request routed to `address` started answering: its prefill is done.
    pub fn record_prefill_done(&mut self, address: &str, prompt_blocks: u32) {
        if let Some(i) = self.by_address.get(address).copied() {
            self.update_own_load(i, |own| {
                own.pending_blocks = own.pending_blocks.saturating_sub(u64::from(prompt_blocks));
            });
        }
    }

    /// A request routed to `address` ended; `prompt_blocks` are those not
    /// yet released by [`Cluster::record_prefill_done`].
    pub fn record_finished(&mut self, address: &str, prompt_blocks: u32) {
        if let Some(i) = self.by_address.get(address).copied() {
            self.update_own_load(i, |own| {
                own.requests = own.requests.saturating_sub(1);
                own.pending_blocks = own.pending_blocks.saturating_sub(u64::from(prompt_blocks));
            });
        }
    }

    /// A request routed to `address` with `prompt_blocks` uncached blocks
    /// ended: the KV it held there is free again.
    pub fn record_released(&mut self, address: &str, prompt_blocks: u32) {
        if let Some(i) = self.by_address.get(address).copied() {
            self.update_own_load(i, |own| {
                own.active_blocks = own.active_blocks.saturating_sub(u64::from(prompt_blocks));
            });
        }
    }

    /// This VM's load per pod (the pods it has requests on), for its peers.
    pub fn own_load(&self) -> Vec<(String, PodLoad)> {
        self.pods
            .iter()
            .filter(|pod| !pod.own.is_zero())
            .map(|pod| (pod.spec.address.clone(), pod.own))
            .collect()
    }

    /// The peers' load per pod as they last published it (see
    /// [`crate::peer_load`]); pods missing from `peers` have none.
    /// Visits only the pods loaded before or now, not the whole fleet.
    pub fn set_peer_load(&mut self, peers: &HashMap<String, PodLoad>) {
        let before = std::mem::take(&mut self.peer_loaded);
        for address in before.iter().filter(|a| !peers.contains_key(*a)) {
            self.set_peers_of(address, PodLoad::default());
        }
        for (address, &load) in peers {
            if self.set_peers_of(address, load) && !load.is_zero() {
                self.peer_loaded.push(address.clone());
            }
        }
    }

    /// False when `address` is not a pod of this cluster.
    fn set_peers_of(&mut self, address: &str, load: PodLoad) -> bool {
        let Some(i) = self.by_address.get(address).copied() else {
            return false;
        };
        if self.pods[i].peers != load {
            self.update_load(i, |pod| pod.peers = load);
        }
        true
    }

    pub(super) fn update_own_load(&mut self, i: usize, change: impl FnOnce(&mut PodLoad)) {
        self.update_load(i, |pod| change(&mut pod.own));
    }

    /// Changes pod `i`'s load and moves it in the least-loaded order (to a
    /// new place among pods of equal load).
    pub(super) fn update_load(&mut self, i: usize, change: impl FnOnce(&mut Pod)) {
        let Some(pod) = self.pods.get_mut(i) else {
            return;
        };
        self.load_order.remove(&pod.load_key(i));
        change(pod);
        pod.shuffle = splitmix64(pod.shuffle);
        self.load_order.insert(pod.load_key(i));
    }
}
