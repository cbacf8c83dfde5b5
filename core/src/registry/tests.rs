use super::*;

/// Envoy's shared data for the registry key: a set under a CAS token
/// other than the current one fails; 0 sets whatever it is.
#[derive(Default)]
struct SharedValue {
    value: Option<Vec<u8>>,
    cas: u32,
}

impl SharedValue {
    fn get(&self) -> Option<(Vec<u8>, u32)> {
        self.value.clone().map(|v| (v, self.cas))
    }

    fn set(&mut self, value: &[u8], cas: u32) -> bool {
        if cas != 0 && cas != self.cas {
            return false;
        }
        self.cas += 1;
        self.value = Some(value.to_vec());
        true
    }

    fn lines(&self) -> Vec<Entry> {
        parse(self.value.as_deref().unwrap_or_default())
    }

    fn line(&self, name: &str) -> Option<Entry> {
        self.lines().into_iter().find(|e| e.name == name)
    }
}

/// One proxy: the registry and the shared queues (a queue's id is its
/// position), each holding what was enqueued to it.
#[derive(Default)]
struct Proxy {
    registry: SharedValue,
    queues: Vec<(String, Vec<String>)>,
}

impl Proxy {
    fn register(&mut self, name: &str) -> u32 {
        self.queues.push((name.to_owned(), Vec::new()));
        self.queues.len() as u32 - 1
    }

    fn resolve(&self, name: &str) -> Option<u32> {
        self.queues
            .iter()
            .position(|(n, _)| n == name)
            .map(|q| q as u32)
    }

    /// Takes what queue `q` received.
    fn take(&mut self, q: u32) -> Vec<String> {
        std::mem::take(&mut self.queues[q as usize].1)
    }
}

/// A simulated VM: the registry driven the way src/peers.rs drives it.
struct Vm {
    registry: Registry,
    queue: Option<u32>,
}

const T0_MS: u64 = 1_700_000_000_000;

fn secs(ms: u64) -> u32 {
    (ms / 1000) as u32
}

impl Vm {
    fn join(proxy: &mut Proxy, random: u64, now_ms: u64) -> Vm {
        let name = queue_name(random);
        let queue = proxy.register(&name);
        Vm::start(
            proxy,
            Registry::join(Some(name), now_ms),
            Some(queue),
            now_ms,
        )
    }

    /// The singleton: an observer that also owns the singleton's queue.
    fn singleton(proxy: &mut Proxy, now_ms: u64) -> Vm {
        let queue = proxy.register(SINGLETON_QUEUE);
        Vm::start(proxy, Registry::observer(), Some(queue), now_ms)
    }

    fn start(proxy: &mut Proxy, registry: Registry, queue: Option<u32>, now_ms: u64) -> Vm {
        let mut vm = Vm { registry, queue };
        let heartbeat = vm.registry.heartbeat(secs(now_ms));
        assert!(vm.write(proxy, heartbeat));
        vm
    }

    fn tick(&mut self, proxy: &mut Proxy, now_ms: u64) {
        match self.registry.on_tick(secs(now_ms), now_ms) {
            TickStep::Heartbeat(heartbeat) => {
                assert!(self.write(proxy, heartbeat));
            }
            TickStep::Refresh => {
                if let Some((value, cas)) = proxy.registry.get() {
                    if let Some(live) = self.registry.on_read(&value, cas, secs(now_ms)) {
                        self.resolve(proxy, &live);
                    }
                }
            }
        }
    }

    /// Drives a heartbeat's CAS attempts; false when all of them lost.
    fn write(&mut self, proxy: &mut Proxy, mut heartbeat: Heartbeat) -> bool {
        loop {
            let (value, cas) = proxy.registry.get().unwrap_or_default();
            let Some(write) = heartbeat.attempt(&value, cas) else {
                return false;
            };
            if proxy.registry.set(write.value.as_bytes(), write.cas) {
                let live = self.registry.on_written(write);
                self.resolve(proxy, &live);
                return true;
            }
        }
    }

    fn resolve(&mut self, proxy: &Proxy, live: &[Entry]) {
        let queues = live
            .iter()
            .filter_map(|e| proxy.resolve(&e.name).map(|q| (q, e.serving)))
            .collect();
        self.registry
            .resolved(queues, proxy.resolve(SINGLETON_QUEUE));
    }

    fn serve(&mut self, proxy: &mut Proxy, now_ms: u64) {
        if self.registry.start_serving() {
            let heartbeat = self.registry.heartbeat(secs(now_ms));
            assert!(self.write(proxy, heartbeat));
        }
    }

    /// Sends `message`; the queues it went to.
    fn broadcast(
        &self,
        proxy: &mut Proxy,
        message: &str,
        audience: Audience,
        to_singleton: bool,
    ) -> Vec<u32> {
        let to: Vec<u32> = self.registry.recipients(audience, to_singleton).collect();
        for &q in &to {
            proxy.queues[q as usize].1.push(message.to_owned());
        }
        to
    }

    fn queue(&self) -> u32 {
        self.queue.unwrap()
    }
}

fn sorted(mut queues: Vec<u32>) -> Vec<u32> {
    queues.sort_unstable();
    queues
}

/// Ticks every VM every 250 ms from `from_ms` until `until_ms`.
fn run(proxy: &mut Proxy, vms: &mut [&mut Vm], from_ms: u64, until_ms: u64) {
    let mut now = from_ms;
    while now <= until_ms {
        for vm in vms.iter_mut() {
            vm.tick(proxy, now);
        }
        now += 250;
    }
}

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
    assert_eq!(queue_name(0xab), "kvroute/q/00000000000000ab");
}

#[test]
fn vms_find_each_other_within_a_tick_and_messages_reach_their_audience() {
    let mut proxy = Proxy::default();
    let mut singleton = Vm::singleton(&mut proxy, T0_MS);
    let mut a = Vm::join(&mut proxy, 1, T0_MS);
    let b = Vm::join(&mut proxy, 2, T0_MS + 10);
    // B joined after A: B knows A at once, A from its next tick.
    assert_eq!(
        b.broadcast(&mut proxy, "x", Audience::Serving, false),
        [a.queue()]
    );
    assert!(a
        .broadcast(&mut proxy, "x", Audience::Serving, false)
        .is_empty());
    a.tick(&mut proxy, T0_MS + 100);
    assert_eq!(
        a.broadcast(&mut proxy, "x", Audience::Serving, false),
        [b.queue()]
    );
    assert_eq!(a.registry.serving_count(), 1);
    // The singleton takes what it is sent only when asked, and a worker
    // gets nothing meant for the singleton alone.
    assert_eq!(
        a.broadcast(&mut proxy, "learned", Audience::None, true),
        [singleton.queue()]
    );
    assert_eq!(
        a.broadcast(&mut proxy, "failed", Audience::Serving, true),
        [b.queue(), singleton.queue()]
    );
    assert_eq!(proxy.take(singleton.queue()), ["learned", "failed"]);
    assert_eq!(proxy.take(b.queue()), ["x", "failed"]);
    // The singleton has no line and reaches every worker.
    singleton.tick(&mut proxy, T0_MS + 100);
    let names: Vec<String> = proxy.registry.lines().into_iter().map(|e| e.name).collect();
    assert_eq!(names, [queue_name(1), queue_name(2)]);
    assert_eq!(
        sorted(singleton.broadcast(&mut proxy, "feed", Audience::All, false)),
        [a.queue(), b.queue()]
    );
    // No VM sends to itself.
    for vm in [&a, &b] {
        let to = vm.broadcast(&mut proxy, "x", Audience::All, true);
        assert!(!to.contains(&vm.queue()));
    }
}

#[test]
fn conflicting_writers_retry_until_both_lines_land() {
    let mut proxy = Proxy::default();
    let mut a = Vm::join(&mut proxy, 1, T0_MS);
    let mut b = Vm::join(&mut proxy, 2, T0_MS);
    let now = T0_MS + 5_000;
    // A reads; B writes in between; A's write under the old token fails.
    let TickStep::Heartbeat(mut heartbeat) = a.registry.on_tick(secs(now), now) else {
        panic!("a heartbeat is due");
    };
    let (value, cas) = proxy.registry.get().unwrap();
    let stale = heartbeat.attempt(&value, cas).unwrap();
    b.tick(&mut proxy, now);
    assert!(!proxy.registry.set(stale.value.as_bytes(), stale.cas));
    // Its next attempt starts from B's write and keeps B's line.
    assert!(a.write(&mut proxy, heartbeat));
    let lines = proxy.registry.lines();
    assert_eq!(lines.len(), 2);
    assert!(lines.iter().all(|e| e.seen_s == secs(now)), "{lines:?}");
    assert_eq!(a.registry.serving_count(), 1);
}

#[test]
fn a_heartbeat_that_keeps_losing_gives_up_after_its_attempts() {
    let mut proxy = Proxy::default();
    let mut a = Vm::join(&mut proxy, 1, T0_MS);
    let mut b = Vm::join(&mut proxy, 2, T0_MS);
    let now = T0_MS + 5_000;
    let mut heartbeat = a.registry.heartbeat(secs(now));
    for _ in 0..CAS_ATTEMPTS {
        let (value, cas) = proxy.registry.get().unwrap();
        let write = heartbeat.attempt(&value, cas).unwrap();
        // Another VM writes every time in between.
        let rival = b.registry.heartbeat(secs(now));
        assert!(b.write(&mut proxy, rival));
        assert!(!proxy.registry.set(write.value.as_bytes(), write.cas));
    }
    assert_eq!(heartbeat.attempt(b"", 0), None);
    // The registry is B's last write: A's line as it was at joining.
    let a_line = proxy.registry.line(&queue_name(1));
    assert_eq!(a_line.map(|e| e.seen_s), Some(secs(T0_MS)));
    // The next tick's heartbeat tries again and lands.
    a.tick(&mut proxy, now);
    let a_line = proxy.registry.line(&queue_name(1));
    assert_eq!(a_line.map(|e| e.seen_s), Some(secs(now)));
}

#[test]
fn a_silent_vm_goes_unsent_to_then_forgotten() {
    let mut proxy = Proxy::default();
    let mut singleton = Vm::singleton(&mut proxy, T0_MS);
    let mut a = Vm::join(&mut proxy, 1, T0_MS);
    let mut b = Vm::join(&mut proxy, 2, T0_MS);
    let mut gone = Vm::join(&mut proxy, 3, T0_MS);
    for vm in [&mut a, &mut b, &mut gone] {
        vm.serve(&mut proxy, T0_MS);
    }
    run(
        &mut proxy,
        &mut [&mut singleton, &mut a, &mut b, &mut gone],
        T0_MS,
        T0_MS + 2_000,
    );
    let last_seen_ms = T0_MS + 2_000;
    assert_eq!(
        sorted(a.broadcast(&mut proxy, "x", Audience::Serving, false)),
        [b.queue(), gone.queue()]
    );
    // `gone` ticks no more. Still sent to while its line is fresh enough.
    let live_until_ms = (u64::from(secs(last_seen_ms)) + u64::from(LIVE_FOR_S)) * 1000 + 999;
    run(
        &mut proxy,
        &mut [&mut singleton, &mut a, &mut b],
        last_seen_ms + 250,
        live_until_ms,
    );
    assert!(a
        .broadcast(&mut proxy, "x", Audience::Serving, false)
        .contains(&gone.queue()));
    // A second later, nobody sends to it, not even the feed.
    run(
        &mut proxy,
        &mut [&mut singleton, &mut a, &mut b],
        live_until_ms + 1,
        live_until_ms + 1_000,
    );
    for vm in [&a, &b, &singleton] {
        let to = vm.broadcast(&mut proxy, "x", Audience::All, true);
        assert!(!to.contains(&gone.queue()), "{to:?}");
    }
    assert_eq!(a.registry.serving_count(), 1);
    assert!(proxy.registry.line(&queue_name(3)).is_some());
    // Its line is dropped once it is silent past FORGET_AFTER_S.
    let kept_until_ms = (u64::from(secs(last_seen_ms)) + u64::from(FORGET_AFTER_S)) * 1000 + 999;
    run(
        &mut proxy,
        &mut [&mut singleton, &mut a, &mut b],
        live_until_ms + 1_250,
        kept_until_ms,
    );
    assert!(proxy.registry.line(&queue_name(3)).is_some());
    run(
        &mut proxy,
        &mut [&mut singleton, &mut a, &mut b],
        kept_until_ms + 1,
        kept_until_ms + 1_000,
    );
    let names: Vec<String> = proxy.registry.lines().into_iter().map(|e| e.name).collect();
    assert_eq!(names, [queue_name(1), queue_name(2)]);
    assert_eq!(
        sorted(a.broadcast(&mut proxy, "x", Audience::Serving, false)),
        [b.queue()]
    );
}

#[test]
fn a_vm_that_serves_nothing_goes_quiet_and_wakes_on_its_first_request() {
    let mut proxy = Proxy::default();
    let mut singleton = Vm::singleton(&mut proxy, T0_MS);
    let mut a = Vm::join(&mut proxy, 1, T0_MS);
    // Like Envoy's main-thread copy of the filter's VM, B serves nothing.
    let mut b = Vm::join(&mut proxy, 2, T0_MS);
    a.serve(&mut proxy, T0_MS + 500);
    let quiet_at = T0_MS + QUIET_AFTER_MS;
    // Heartbeats at T0 + 0.5 s, + 1.5 s, ..., + 9.5 s.
    run(
        &mut proxy,
        &mut [&mut singleton, &mut a, &mut b],
        T0_MS + 500,
        quiet_at - 250,
    );
    assert!(b.registry.is_serving());
    assert_eq!(
        a.broadcast(&mut proxy, "x", Audience::Serving, false),
        [b.queue()]
    );
    // At QUIET_AFTER_MS B says so at once (a heartbeat off its cadence);
    // A, which served, stays serving.
    b.tick(&mut proxy, quiet_at);
    assert!(!b.registry.is_serving() && a.registry.is_serving());
    let b_line = proxy.registry.line(&queue_name(2));
    assert_eq!(b_line.map(|e| e.serving), Some(false));
    a.tick(&mut proxy, quiet_at);
    singleton.tick(&mut proxy, quiet_at);
    assert!(a
        .broadcast(&mut proxy, "routed", Audience::Serving, false)
        .is_empty());
    assert_eq!(a.registry.serving_count(), 0);
    // It still gets the feed's pods and load, from the singleton.
    assert_eq!(
        sorted(singleton.broadcast(&mut proxy, "feed", Audience::All, false)),
        [a.queue(), b.queue()]
    );
    assert_eq!(proxy.take(b.queue()), ["x", "feed"]);
    // Staying quiet, it keeps heartbeating as quiet and stays live.
    run(
        &mut proxy,
        &mut [&mut singleton, &mut a, &mut b],
        quiet_at + 250,
        quiet_at + 30_000,
    );
    assert!(!b.registry.is_serving());
    assert_eq!(
        singleton
            .broadcast(&mut proxy, "feed", Audience::All, false)
            .len(),
        2
    );
    assert!(a
        .broadcast(&mut proxy, "x", Audience::Serving, false)
        .is_empty());
    // Its first request: its line says serving at once, and A sends to
    // it again from its next tick.
    let woke_at = quiet_at + 30_100;
    b.serve(&mut proxy, woke_at);
    assert!(b.registry.is_serving());
    a.tick(&mut proxy, woke_at + 100);
    assert_eq!(
        a.broadcast(&mut proxy, "x", Audience::Serving, false),
        [b.queue()]
    );
    // Having served, it never goes quiet again.
    run(
        &mut proxy,
        &mut [&mut singleton, &mut a, &mut b],
        woke_at + 250,
        woke_at + 2 * QUIET_AFTER_MS,
    );
    assert!(b.registry.is_serving());
    assert_eq!(a.registry.serving_count(), 1);
}

#[test]
fn a_worker_finds_a_singleton_queue_that_registers_after_it() {
    let mut proxy = Proxy::default();
    let mut a = Vm::join(&mut proxy, 1, T0_MS);
    // Its first tick heartbeats, the next reads what that wrote.
    a.tick(&mut proxy, T0_MS + 100);
    a.tick(&mut proxy, T0_MS + 200);
    assert!(a
        .broadcast(&mut proxy, "learned", Audience::None, true)
        .is_empty());
    // The queue registers without the registry changing; as long as
    // the singleton's queue is unknown, a read resolves again.
    let singleton = proxy.register(SINGLETON_QUEUE);
    let cas = proxy.registry.cas;
    a.tick(&mut proxy, T0_MS + 300);
    assert_eq!(proxy.registry.cas, cas, "a read, no write");
    assert_eq!(
        a.broadcast(&mut proxy, "learned", Audience::None, true),
        [singleton]
    );
}

#[test]
fn garbage_lines_are_skipped_then_dropped() {
    let mut proxy = Proxy::default();
    let valid = format!("{} {} 1\n", queue_name(9), secs(T0_MS));
    proxy.register(&queue_name(9));
    proxy
        .registry
        .set(format!("junk\n\u{1} 2\n{valid}q nan 1\n").as_bytes(), 0);
    let mut a = Vm::join(&mut proxy, 1, T0_MS);
    assert_eq!(a.registry.serving_count(), 1);
    let kept = String::from_utf8(proxy.registry.value.clone().unwrap()).unwrap();
    assert_eq!(
        kept,
        format!("{valid}{} {} 1\n", queue_name(1), secs(T0_MS))
    );
    // Garbage written later by someone else does not hide the others.
    let (value, _) = proxy.registry.get().unwrap();
    let mut garbled = b"\xff\xfe\n".to_vec();
    garbled.extend_from_slice(&value);
    proxy.registry.set(&garbled, 0);
    a.tick(&mut proxy, T0_MS + 1_000);
    assert_eq!(a.registry.serving_count(), 1);
}

#[test]
fn a_vm_whose_queue_did_not_register_only_sends() {
    let mut proxy = Proxy::default();
    let mut b = Vm::join(&mut proxy, 2, T0_MS);
    let mut a = Vm::start(&mut proxy, Registry::join(None, T0_MS), None, T0_MS);
    assert!(!a.registry.is_serving());
    assert!(!a.registry.start_serving(), "no line to say it serves");
    assert_eq!(
        a.broadcast(&mut proxy, "x", Audience::Serving, false),
        [b.queue()]
    );
    b.tick(&mut proxy, T0_MS + 1_000);
    assert_eq!(proxy.registry.lines().len(), 1);
    assert_eq!(b.registry.serving_count(), 0);
}

/// Whatever bytes the registry holds, nothing panics: a heartbeat
/// writes back its own line and, besides, only lines that parse and
/// are recent enough; the live peers are recent lines of others.
#[test]
fn arbitrary_registry_bytes_never_panic() {
    let now_s = secs(T0_MS);
    let own = queue_name(1);
    let seed = render(&[
        Entry {
            name: queue_name(2),
            seen_s: now_s - 3,
            serving: true,
        },
        Entry {
            name: own.clone(),
            seen_s: now_s - 1,
            serving: false,
        },
        Entry {
            name: queue_name(3),
            seen_s: now_s - FORGET_AFTER_S + 1,
            serving: true,
        },
    ])
    .into_bytes();
    let mut registry = Registry::join(Some(own.clone()), T0_MS);
    let mut rng = 0x2545_f491_4f6c_dd1du64;
    for cas in 1..20_000 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let mut bytes = seed.clone();
        let at = (rng as usize) % bytes.len();
        bytes[at] ^= (rng >> 40) as u8;
        if rng % 3 == 0 {
            bytes.truncate(at);
        }
        let mut heartbeat = registry.heartbeat(now_s);
        let write = heartbeat.attempt(&bytes, cas).unwrap();
        assert_eq!(write.cas, cas);
        let written = parse(write.value.as_bytes());
        assert_eq!(render(&written), write.value, "a stable rewrite");
        let own_line = Entry {
            name: own.clone(),
            seen_s: now_s,
            serving: true,
        };
        assert!(written.contains(&own_line));
        let read = parse(&bytes);
        for e in written.iter().filter(|&e| *e != own_line) {
            assert!(read.contains(e), "{e:?} was not in {bytes:?}");
            assert!(now_s.saturating_sub(e.seen_s) <= FORGET_AFTER_S);
        }
        for e in registry.on_read(&bytes, cas, now_s).unwrap() {
            assert_ne!(e.name, own);
            assert!(now_s.saturating_sub(e.seen_s) <= LIVE_FOR_S);
        }
    }
}
