//! The VMs of one proxy find each other through a registry in shared data:
//! each worker VM registers its own shared queue and heartbeats its line;
//! senders enqueue to every queue whose heartbeat is fresh. Queues are
//! unbounded in Envoy, so a queue whose VM is gone (stale heartbeat) gets
//! nothing more.
//!
//! A line also says whether its VM serves requests. Envoy runs a copy of
//! the filter's VM on the main thread that never does. Every VM starts as
//! serving; one that has served nothing after `QUIET_AFTER_MS` goes quiet
//! and gets no more per-request messages (routed, finished) until its first
//! request. Indexer feed updates (pods and their load) go to every VM, so
//! that a worker knows the pods before its first request. What routed
//! prompts teach goes only to the singleton, the index's one writer.

use crate::host;

const REGISTRY_KEY: &str = "kvroute/peers/v1";
/// The singleton's queue, where workers send what their routed prompts teach.
pub const SINGLETON_QUEUE: &str = "kvroute/singleton";
/// A peer silent for longer is not sent to.
const LIVE_FOR_S: u32 = 10;
/// A peer silent for longer is dropped from the registry.
const FORGET_AFTER_S: u32 = 60;
const CAS_ATTEMPTS: usize = 8;
/// How often a VM rewrites its registry line.
const HEARTBEAT_MS: u64 = 1000;
/// A VM that has served no request this long after joining goes quiet.
const QUIET_AFTER_MS: u64 = 10_000;

/// Who a message is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Audience {
    /// Every live VM (indexer feed updates).
    All,
    /// VMs that serve requests (routing decisions and their end).
    Serving,
    /// No worker: only the singleton, when asked (reports for the indexer).
    None,
}

/// One registry line: `<queue name> <last heartbeat, epoch s> <serving 0|1>`.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    name: String,
    seen_s: u32,
    serving: bool,
}

/// This VM's view of its peers.
#[derive(Debug, Default)]
pub struct Peers {
    vm_id: String,
    own_name: Option<String>,
    own_queue: Option<u32>,
    serving: bool,
    /// Set by the first request this VM serves.
    served_any: bool,
    joined_ms: u64,
    /// Resolved queues of live peers (not this VM), with their serving flag.
    live: Vec<(u32, bool)>,
    singleton: Option<u32>,
    /// CAS token of the registry when last resolved.
    seen_cas: u32,
    last_heartbeat_ms: u64,
}

impl Peers {
    /// Joins as a worker VM: registers a uniquely named queue and its line.
    pub fn join(vm_id: &str, now_s: u32, now_ms: u64) -> Peers {
        let name = format!("kvroute/q/{:016x}", host::random_u64());
        let own_queue = host::queue_register(&name);
        let mut peers = Peers {
            vm_id: vm_id.to_string(),
            serving: own_queue.is_some(),
            joined_ms: now_ms,
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

    /// Records that this VM serves a request; a quiet VM takes per-request
    /// messages again.
    pub fn start_serving(&mut self, now_s: u32) {
        self.served_any = true;
        if self.serving || self.own_name.is_none() {
            return;
        }
        self.serving = true;
        self.heartbeat(now_s);
    }

    pub fn is_serving(&self) -> bool {
        self.serving
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

    /// Live peers that serve requests.
    pub fn serving_count(&self) -> usize {
        self.live.iter().filter(|(_, serving)| *serving).count()
    }

    /// Called on every tick: heartbeats once a second, and in between
    /// re-resolves the live peers when the registry changed (one shared-data
    /// read), so a VM that starts later is known to the others within a tick.
    pub fn tick(&mut self, now_s: u32, now_ms: u64) {
        if self.serving
            && !self.served_any
            && now_ms.saturating_sub(self.joined_ms) >= QUIET_AFTER_MS
        {
            self.serving = false;
            self.last_heartbeat_ms = 0;
        }
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
        let own = self.own_name.clone().map(|name| Entry {
            name,
            seen_s: now_s,
            serving: self.serving,
        });
        let entries = update_registry(|entries| {
            entries.retain(|e| now_s.saturating_sub(e.seen_s) <= FORGET_AFTER_S);
            if let Some(own) = &own {
                match entries.iter_mut().find(|e| e.name == own.name) {
                    Some(entry) => *entry = own.clone(),
                    None => entries.push(own.clone()),
                }
            }
        });
        if let Some(entries) = entries {
            self.resolve(&entries, now_s);
        }
    }

    fn resolve(&mut self, entries: &[Entry], now_s: u32) {
        let own = self.own_name.as_ref();
        self.live = entries
            .iter()
            .filter(|e| Some(&e.name) != own && now_s.saturating_sub(e.seen_s) <= LIVE_FOR_S)
            .filter_map(|e| host::queue_resolve(&self.vm_id, &e.name).map(|q| (q, e.serving)))
            .collect();
        self.singleton = host::queue_resolve(&self.vm_id, SINGLETON_QUEUE);
    }

    /// Sends to the live peers of `audience` (and the singleton when asked);
    /// returns how many queues took it.
    pub fn broadcast(&self, message: &[u8], audience: Audience, to_singleton: bool) -> usize {
        let singleton = self.singleton.filter(|_| to_singleton);
        self.live
            .iter()
            .filter(|(_, serving)| match audience {
                Audience::All => true,
                Audience::Serving => *serving,
                Audience::None => false,
            })
            .map(|(q, _)| q)
            .chain(singleton.iter())
            .filter(|&&q| host::queue_enqueue(q, message))
            .count()
    }
}

/// Read-modify-write of the registry with CAS retries; returns the entries
/// as written.
fn update_registry(change: impl Fn(&mut Vec<Entry>)) -> Option<Vec<Entry>> {
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

fn parse(raw: &[u8]) -> Vec<Entry> {
    String::from_utf8_lossy(raw)
        .lines()
        .filter_map(|line| {
            let mut fields = line.split(' ');
            let name = fields.next()?.to_string();
            let seen_s = fields.next()?.parse().ok()?;
            let serving = fields.next() == Some("1");
            Some(Entry {
                name,
                seen_s,
                serving,
            })
        })
        .collect()
}

fn render(entries: &[Entry]) -> String {
    entries
        .iter()
        .map(|e| format!("{} {} {}\n", e.name, e.seen_s, u8::from(e.serving)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn registry_lines_round_trip_and_skip_garbage() {
        let entries = vec![
            Entry {
                name: "kvroute/q/1".into(),
                seen_s: 5,
                serving: true,
            },
            Entry {
                name: "kvroute/q/2".into(),
                seen_s: 7,
                serving: false,
            },
        ];
        assert_eq!(parse(render(&entries).as_bytes()), entries);
        let parsed = parse(b"bad\nq 12\nq x 1\n\xff 3 1\n");
        assert_eq!(
            parsed,
            vec![
                Entry {
                    name: "q".into(),
                    seen_s: 12,
                    serving: false
                },
                Entry {
                    name: "\u{fffd}".into(),
                    seen_s: 3,
                    serving: true
                },
            ]
        );
    }
}
