//! The registry through which the VMs of one proxy find each other, sans IO:
//! each worker VM registers its own shared queue and heartbeats its line in
//! one shared-data value; senders enqueue to every queue whose heartbeat is
//! fresh. Queues are unbounded in Envoy, so a queue whose VM is gone (stale
//! heartbeat) gets nothing more, and a line silent for longer still is
//! dropped from the registry.
//!
//! A line also says whether its VM serves requests. Envoy runs a copy of
//! the filter's VM on the main thread that never does. Every VM starts as
//! serving; one that has served nothing after [`QUIET_AFTER_MS`] goes quiet
//! and gets no more per-request messages (tenant charges, failed pods), nor
//! do the others read its load, until its first request. Indexer feed updates (pods and their load) go to every VM, so
//! that a worker knows the pods before its first request. What routed
//! prompts teach goes only to the singleton, the index's one writer, which
//! looks on as an observer: it sends, and registers no line.
//!
//! The host (src/peers.rs) does the calls and hands their results here:
//! - on every tick, [`Registry::on_tick`] says whether to heartbeat or only
//!   to re-read the registry ([`Registry::on_read`]);
//! - a heartbeat is a read-modify-write under the registry's CAS token:
//!   [`Heartbeat::attempt`] says what to write over the value just read, at
//!   most [`CAS_ATTEMPTS`] times, and a write that landed goes to
//!   [`Registry::on_written`];
//! - both answer with the live peers, whose queue names the host resolves
//!   and hands back with the singleton's queue ([`Registry::resolved`]);
//! - [`Registry::recipients`] says which queues a message goes to.

/// The shared-data key of the registry.
pub const REGISTRY_KEY: &str = "kvroute/peers/v1";
/// The singleton's queue, where workers send what their routed prompts teach.
pub const SINGLETON_QUEUE: &str = "kvroute/singleton";
/// A peer silent for longer is not sent to.
pub const LIVE_FOR_S: u32 = 10;
/// A peer silent for longer is dropped from the registry.
pub const FORGET_AFTER_S: u32 = 60;
/// Tries of one heartbeat's read-modify-write before it waits for the next.
pub const CAS_ATTEMPTS: usize = 8;
/// How often a VM rewrites its registry line.
pub const HEARTBEAT_MS: u64 = 1000;
/// A VM that has served no request this long after joining goes quiet.
pub const QUIET_AFTER_MS: u64 = 10_000;

/// The name of a worker VM's queue, from 64 random bits: two VMs configured
/// in the same instant must not pick the same one.
pub fn queue_name(random: u64) -> String {
    format!("kvroute/q/{random:016x}")
}

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
pub struct Entry {
    pub name: String,
    pub seen_s: u32,
    pub serving: bool,
}

/// The registry's lines; lines that do not parse are skipped (and dropped
/// by the next heartbeat's write).
pub fn parse(raw: &[u8]) -> Vec<Entry> {
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

pub fn render(entries: &[Entry]) -> String {
    entries
        .iter()
        .map(|e| format!("{} {} {}\n", e.name, e.seen_s, u8::from(e.serving)))
        .collect()
}

/// What a tick asks of the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TickStep {
    /// Rewrite this VM's line: drive the heartbeat's CAS attempts.
    Heartbeat(Heartbeat),
    /// Read the registry and hand it to [`Registry::on_read`].
    Refresh,
}

/// One heartbeat: a read-modify-write of the registry that refreshes this
/// VM's line and forgets long-silent ones, tried at most [`CAS_ATTEMPTS`]
/// times.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heartbeat {
    own: Option<Entry>,
    now_s: u32,
    attempts_left: usize,
}

/// A registry value to write if the registry's CAS token is still `cas`
/// (0: whatever it is, as when the registry does not exist yet).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CasWrite {
    pub value: String,
    pub cas: u32,
    entries: Vec<Entry>,
    now_s: u32,
}

impl Heartbeat {
    /// What to write over the registry's `current` value (empty when it
    /// does not exist) read under `cas`; `None` once the attempts are used
    /// up (another VM kept writing in between: the next tick tries again).
    pub fn attempt(&mut self, current: &[u8], cas: u32) -> Option<CasWrite> {
        self.attempts_left = self.attempts_left.checked_sub(1)?;
        let now_s = self.now_s;
        let mut entries = parse(current);
        entries.retain(|e| now_s.saturating_sub(e.seen_s) <= FORGET_AFTER_S);
        if let Some(own) = &self.own {
            match entries.iter_mut().find(|e| e.name == own.name) {
                Some(entry) => entry.clone_from(own),
                None => entries.push(own.clone()),
            }
        }
        Some(CasWrite {
            value: render(&entries),
            cas,
            entries,
            now_s,
        })
    }
}

/// This VM's view of its peers: see the module documentation.
#[derive(Debug, Clone, Default)]
pub struct Registry {
    /// This VM's queue and line; none for the observer.
    own_name: Option<String>,
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

impl Registry {
    /// A worker VM whose queue the host registered as `own_name` (`None`
    /// when that failed: it then only sends). Its first heartbeat is due.
    pub fn join(own_name: Option<String>, now_ms: u64) -> Registry {
        Registry {
            serving: own_name.is_some(),
            own_name,
            joined_ms: now_ms,
            ..Registry::default()
        }
    }

    /// A sender only (the singleton): it registers no line.
    pub fn observer() -> Registry {
        Registry::default()
    }

    pub fn own_name(&self) -> Option<&str> {
        self.own_name.as_deref()
    }

    pub fn is_serving(&self) -> bool {
        self.serving
    }

    /// Live peers that serve requests.
    pub fn serving_count(&self) -> usize {
        self.live.iter().filter(|(_, serving)| *serving).count()
    }

    /// Records that this VM serves a request. True when it was quiet: its
    /// line must say at once that it takes per-request messages again and
    /// that its load is to be read ([`Registry::heartbeat`]).
    pub fn start_serving(&mut self) -> bool {
        self.served_any = true;
        if self.serving || self.own_name.is_none() {
            return false;
        }
        self.serving = true;
        true
    }

    /// Called on every tick: a heartbeat once a second (and at once when
    /// this VM goes quiet), else one read to re-resolve the live peers when
    /// the registry changed, so a VM that starts later is known to the
    /// others within a tick.
    pub fn on_tick(&mut self, now_s: u32, now_ms: u64) -> TickStep {
        if self.serving
            && !self.served_any
            && now_ms.saturating_sub(self.joined_ms) >= QUIET_AFTER_MS
        {
            self.serving = false;
            self.last_heartbeat_ms = 0;
        }
        if now_ms.saturating_sub(self.last_heartbeat_ms) >= HEARTBEAT_MS {
            self.last_heartbeat_ms = now_ms;
            TickStep::Heartbeat(self.heartbeat(now_s))
        } else {
            TickStep::Refresh
        }
    }

    /// A heartbeat now (on joining, or when this VM starts serving again).
    pub fn heartbeat(&self, now_s: u32) -> Heartbeat {
        Heartbeat {
            own: self.own_name.clone().map(|name| Entry {
                name,
                seen_s: now_s,
                serving: self.serving,
            }),
            now_s,
            attempts_left: CAS_ATTEMPTS,
        }
    }

    /// The registry as read on a tick without heartbeat: the live peers to
    /// resolve again when it changed since last resolved, or while the
    /// singleton's queue is unknown (it may register after this VM).
    pub fn on_read(&mut self, value: &[u8], cas: u32, now_s: u32) -> Option<Vec<Entry>> {
        if cas == self.seen_cas && self.singleton.is_some() {
            return None;
        }
        self.seen_cas = cas;
        Some(self.live_peers(parse(value), now_s))
    }

    /// A heartbeat's write landed: the live peers to resolve.
    pub fn on_written(&self, write: CasWrite) -> Vec<Entry> {
        self.live_peers(write.entries, write.now_s)
    }

    fn live_peers(&self, mut entries: Vec<Entry>, now_s: u32) -> Vec<Entry> {
        let own = self.own_name.as_ref();
        entries.retain(|e| Some(&e.name) != own && now_s.saturating_sub(e.seen_s) <= LIVE_FOR_S);
        entries
    }

    /// The queues the host resolved: those of the live peers it could
    /// resolve, with their serving flag, and the singleton's.
    pub fn resolved(&mut self, live: Vec<(u32, bool)>, singleton: Option<u32>) {
        self.live = live;
        self.singleton = singleton;
    }

    /// The queues a message for `audience` goes to (and the singleton's when
    /// asked).
    pub fn recipients(
        &self,
        audience: Audience,
        to_singleton: bool,
    ) -> impl Iterator<Item = u32> + '_ {
        let singleton = self.singleton.filter(|_| to_singleton);
        self.live
            .iter()
            .filter(move |(_, serving)| match audience {
                Audience::All => true,
                Audience::Serving => *serving,
                Audience::None => false,
            })
            .map(|(q, _)| *q)
            .chain(singleton)
    }
}

#[cfg(test)]
mod tests;
