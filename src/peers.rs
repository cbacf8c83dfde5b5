//! The host calls of the VM registry: shared-data reads and CAS writes,
//! queue registration, resolution and enqueueing. What they mean (lines,
//! liveness, the quiet rule, who gets a message, when to heartbeat) is
//! decided in `kvroute_core::registry`, which documents it and tests it
//! natively.

use crate::host;
use kvroute_core::peer_load;
use kvroute_core::registry::{self, Entry, Heartbeat, Registry, TickStep, REGISTRY_KEY};
pub use kvroute_core::registry::{Audience, SINGLETON_QUEUE};

/// This VM's view of its peers.
#[derive(Debug)]
pub struct Peers {
    vm_id: String,
    registry: Registry,
    own_queue: Option<u32>,
    /// The keys of this VM's published load and of its live serving peers'
    /// (named after their queues).
    own_load_key: Option<String>,
    serving_load_keys: Vec<String>,
}

impl Peers {
    /// Joins as a worker VM: registers a uniquely named queue and its line.
    pub fn join(vm_id: &str, now_s: u32, now_ms: u64) -> Peers {
        let name = registry::queue_name(host::random_u64());
        let own_queue = host::queue_register(&name);
        Peers::start(
            vm_id,
            Registry::join(own_queue.map(|_| name), now_ms),
            own_queue,
            now_s,
        )
    }

    /// Looks on as a sender only (the singleton): registers nothing.
    pub fn observer(vm_id: &str, now_s: u32) -> Peers {
        Peers::start(vm_id, Registry::observer(), None, now_s)
    }

    fn start(vm_id: &str, registry: Registry, own_queue: Option<u32>, now_s: u32) -> Peers {
        let own_load_key = registry.own_name().map(peer_load::key_of);
        let mut peers = Peers {
            vm_id: vm_id.to_string(),
            registry,
            own_queue,
            own_load_key,
            serving_load_keys: Vec::new(),
        };
        peers.write(peers.registry.heartbeat(now_s));
        peers
    }

    /// Records that this VM serves a request; a quiet VM takes per-request
    /// messages again.
    pub fn start_serving(&mut self, now_s: u32) {
        if self.registry.start_serving() {
            self.write(self.registry.heartbeat(now_s));
        }
    }

    pub fn is_serving(&self) -> bool {
        self.registry.is_serving()
    }

    /// Registers this VM's queue again from the current root context, which
    /// then receives its `on_queue_ready` callbacks.
    pub fn reclaim_queue(&mut self) {
        if let Some(name) = self.registry.own_name() {
            self.own_queue = host::queue_register(name).or(self.own_queue);
        }
    }

    pub fn own_queue(&self) -> Option<u32> {
        self.own_queue
    }

    pub fn own_load_key(&self) -> Option<&str> {
        self.own_load_key.as_deref()
    }

    pub fn serving_load_keys(&self) -> &[String] {
        &self.serving_load_keys
    }

    /// Live peers that serve requests.
    pub fn serving_count(&self) -> usize {
        self.registry.serving_count()
    }

    /// Called on every tick: a heartbeat, or one shared-data read.
    pub fn tick(&mut self, now_s: u32, now_ms: u64) {
        match self.registry.on_tick(now_s, now_ms) {
            TickStep::Heartbeat(heartbeat) => self.write(heartbeat),
            TickStep::Refresh => {
                let Some((value, cas)) = host::shared_get(REGISTRY_KEY) else {
                    return;
                };
                if let Some(live) = self.registry.on_read(&value, cas, now_s) {
                    self.resolve(&live);
                }
            }
        }
    }

    /// Reads and writes the registry under its CAS token until the write
    /// lands or the heartbeat's attempts run out.
    fn write(&mut self, mut heartbeat: Heartbeat) {
        loop {
            let (value, cas) = host::shared_get(REGISTRY_KEY).unwrap_or_default();
            let Some(write) = heartbeat.attempt(&value, cas) else {
                return;
            };
            if host::shared_set(REGISTRY_KEY, write.value.as_bytes(), write.cas) {
                let live = self.registry.on_written(write);
                self.resolve(&live);
                return;
            }
        }
    }

    fn resolve(&mut self, live: &[Entry]) {
        self.serving_load_keys = live
            .iter()
            .filter(|e| e.serving)
            .map(|e| peer_load::key_of(&e.name))
            .collect();
        let queues = live
            .iter()
            .filter_map(|e| host::queue_resolve(&self.vm_id, &e.name).map(|q| (q, e.serving)))
            .collect();
        let singleton = host::queue_resolve(&self.vm_id, SINGLETON_QUEUE);
        self.registry.resolved(queues, singleton);
    }

    /// The queues of the live peers of `audience`.
    pub fn recipients(&self, audience: Audience) -> Vec<u32> {
        self.registry.recipients(audience, false).collect()
    }

    /// Sends to the live peers of `audience` (and the singleton when asked);
    /// returns how many queues took it.
    pub fn broadcast(&self, message: &[u8], audience: Audience, to_singleton: bool) -> usize {
        self.registry
            .recipients(audience, to_singleton)
            .filter(|&q| host::queue_enqueue(q, message))
            .count()
    }
}
