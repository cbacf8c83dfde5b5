//! The VMs of one proxy find each other through a registry in shared data:
//! each worker VM registers its own shared queue and heartbeats its line;
//! senders enqueue to every queue whose heartbeat is fresh. Queues are
//! unbounded in Envoy, so a queue whose VM is gone (stale heartbeat) gets
//! nothing more.

use crate::host;

const REGISTRY_KEY: &str = "kvroute/peers/v1";
/// The singleton's queue, where workers send their routing decisions.
pub const SINGLETON_QUEUE: &str = "kvroute/singleton";
/// A peer silent for longer is not sent to.
const LIVE_FOR_S: u32 = 10;
/// A peer silent for longer is dropped from the registry.
const FORGET_AFTER_S: u32 = 60;
const CAS_ATTEMPTS: usize = 8;
/// How often a VM rewrites its registry line.
const HEARTBEAT_MS: u64 = 1000;

/// This VM's view of its peers.
#[derive(Debug, Default)]
pub struct Peers {
    vm_id: String,
    own_name: Option<String>,
    own_queue: Option<u32>,
    /// Resolved queues of live peers (not this VM).
    live: Vec<u32>,
    singleton: Option<u32>,
    /// CAS token of the registry when last resolved.
    seen_cas: u32,
    last_heartbeat_ms: u64,
}

impl Peers {
    /// Joins as a worker: registers a uniquely named queue and its line.
    pub fn join(vm_id: &str, now_s: u32) -> Peers {
        let name = format!(
            "kvroute/q/{:016x}",
            host::entropy() ^ u64::from(now_s).rotate_left(32)
        );
        let own_queue = host::queue_register(&name);
        let mut peers = Peers {
            vm_id: vm_id.to_string(),
            own_name: own_queue.map(|_| name),
            own_queue,
            ..Peers::default()
        };
        peers.heartbeat(now_s);
        peers
    }

    /// Looks on as a sender only (the singleton): registers nothing.
    pub fn observer(vm_id: &str, now_s: u32) -> Peers {
        let mut peers = Peers {
            vm_id: vm_id.to_string(),
            ..Peers::default()
        };
        peers.heartbeat(now_s);
        peers
    }

    /// Registers this VM's queue again from the current root context, which
    /// then receives its `on_queue_ready` callbacks.
    pub fn reclaim_queue(&mut self) {
        if let Some(name) = &self.own_name {
            self.own_queue = host::queue_register(name).or(self.own_queue);
        }
    }

    pub fn own_queue(&self) -> Option<u32> {
        self.own_queue
    }

    pub fn name(&self) -> &str {
        self.own_name.as_deref().unwrap_or("")
    }

    pub fn live_count(&self) -> usize {
        self.live.len()
    }

    /// Called on every tick: heartbeats once a second, and in between
    /// re-resolves the live peers when the registry changed (one shared-data
    /// read), so a VM that starts later is known to the others within a tick.
    pub fn tick(&mut self, now_s: u32, now_ms: u64) {
        if now_ms.saturating_sub(self.last_heartbeat_ms) >= HEARTBEAT_MS {
            self.last_heartbeat_ms = now_ms;
            self.heartbeat(now_s);
        } else {
            self.refresh(now_s);
        }
    }

    fn refresh(&mut self, now_s: u32) {
        let Some((raw, cas)) = host::shared_get(REGISTRY_KEY) else {
            return;
        };
        if cas != self.seen_cas || self.singleton.is_none() {
            self.seen_cas = cas;
            self.resolve(&parse(&raw), now_s);
        }
    }

    /// Refreshes this VM's line, forgets long-silent peers and re-resolves
    /// the live ones.
    fn heartbeat(&mut self, now_s: u32) {
        let own = self.own_name.clone();
        let entries = update_registry(|entries| {
            entries.retain(|(_, seen)| now_s.saturating_sub(*seen) <= FORGET_AFTER_S);
            if let Some(own) = &own {
                match entries.iter_mut().find(|(name, _)| name == own) {
                    Some(entry) => entry.1 = now_s,
                    None => entries.push((own.clone(), now_s)),
                }
            }
        });
        if let Some(entries) = entries {
            self.resolve(&entries, now_s);
        }
    }

    fn resolve(&mut self, entries: &[(String, u32)], now_s: u32) {
        let own = self.own_name.as_ref();
        self.live = entries
            .iter()
            .filter(|(name, seen)| Some(name) != own && now_s.saturating_sub(*seen) <= LIVE_FOR_S)
            .filter_map(|(name, _)| host::queue_resolve(&self.vm_id, name))
            .collect();
        self.singleton = host::queue_resolve(&self.vm_id, SINGLETON_QUEUE);
    }

    /// Sends to every live peer (and the singleton when asked); returns how
    /// many queues took it.
    pub fn broadcast(&self, message: &[u8], to_singleton: bool) -> usize {
        let singleton = self.singleton.filter(|_| to_singleton);
        self.live
            .iter()
            .chain(singleton.iter())
            .filter(|&&q| host::queue_enqueue(q, message))
            .count()
    }
}

/// Read-modify-write of the registry with CAS retries; returns the entries
/// as written.
fn update_registry(change: impl Fn(&mut Vec<(String, u32)>)) -> Option<Vec<(String, u32)>> {
    for _ in 0..CAS_ATTEMPTS {
        let (raw, cas) = host::shared_get(REGISTRY_KEY).unwrap_or_default();
        let mut entries = parse(&raw);
        change(&mut entries);
        if host::shared_set(REGISTRY_KEY, render(&entries).as_bytes(), cas) {
            return Some(entries);
        }
    }
    None
}

/// Registry lines: `<queue name> <last heartbeat, epoch seconds>`.
fn parse(raw: &[u8]) -> Vec<(String, u32)> {
    String::from_utf8_lossy(raw)
        .lines()
        .filter_map(|line| {
            let (name, seen) = line.split_once(' ')?;
            Some((name.to_string(), seen.parse().ok()?))
        })
        .collect()
}

fn render(entries: &[(String, u32)]) -> String {
    entries
        .iter()
        .map(|(name, seen)| format!("{name} {seen}\n"))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_lines_round_trip_and_skip_garbage() {
        let entries = vec![
            ("kvroute/q/1".to_string(), 5),
            ("kvroute/q/2".to_string(), 7),
        ];
        assert_eq!(parse(render(&entries).as_bytes()), entries);
        assert_eq!(
            parse(b"bad\nq 12\nq x\n\xff 3\n"),
            vec![("q".to_string(), 12), ("\u{fffd}".to_string(), 3)]
        );
    }
}
