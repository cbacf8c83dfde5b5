//! The singleton's indexer feed client, sans IO: which `GET /v1/feed` to send
//! and when, and what an answer (or its absence) means. The singleton only
//! sends the requests this returns and hands it what came back; everything
//! here is tested natively.
//!
//! - Cadence: one request per tick (`indexer.poll_ms`) while none is in
//!   flight; at once ([`FeedClient::follow_up`]) after a page that has a next
//!   page or a delta that says more are waiting.
//! - State it keeps: epoch and cursor, the last pod list with its
//!   `pods_version` and `load_version` (the indexer sends a list only when the
//!   consumer's version is stale), and the paging state of a snapshot.
//! - Snapshots come in pages. The first page replaces all state; the next ones
//!   add to it, so state is rebuilt page by page (routing meanwhile uses the
//!   part loaded, and fails open to load for the rest). A snapshot is complete
//!   after the last page; deltas then continue from the cursor of its first
//!   page (ops the pages already reflect are replayed, which is harmless: each
//!   op sets or clears state).
//! - Failures (not sent, no response, a status other than 200, a body that
//!   does not decode): the same request is retried after a backoff that
//!   doubles from `poll_ms` up to [`MAX_BACKOFF_MS`]. An answer that does not
//!   follow from the state (a delta of another epoch, a page out of order, a
//!   list missing for a new version, an op naming no pod) starts over with a
//!   snapshot. An epoch change (the indexer restarted) is answered by the
//!   indexer with a snapshot. Nothing here panics.

use crate::feed::{self, FeedError, FeedKind, FeedMessage, FeedUpdate, PageToken, PodInfo};
use std::fmt;

/// Longest wait between two attempts after consecutive failures.
pub const MAX_BACKOFF_MS: u64 = 10_000;

/// One `GET /v1/feed`: what the consumer holds, and the page it asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct FeedRequest {
    pub epoch: u64,
    pub cursor: u64,
    /// Version of the pod list held (0: none).
    pub pods_version: u64,
    /// Version of the load held (0: none).
    pub load_version: u64,
    /// The snapshot page asked for: its number and the token the previous page gave.
    pub page: Option<(u32, PageToken)>,
}

impl FeedRequest {
    /// The query string: `epoch=&cursor=&pods=&load=`, then for a page
    /// `&page=&page_pod=` and `&page_after=` when the token has one
    /// (`page_pod` carries [`PageToken::start`]: the name is that of the
    /// per-pod paging of earlier releases, kept so that either release's
    /// filter and indexer understand each other).
    pub fn query(&self) -> String {
        let mut q = format!(
            "epoch={}&cursor={}&pods={}&load={}",
            self.epoch, self.cursor, self.pods_version, self.load_version
        );
        if let Some((number, token)) = self.page {
            q.push_str(&format!("&page={number}&page_pod={}", token.start));
            if let Some(after) = token.after {
                q.push_str(&format!("&page_after={after}"));
            }
        }
        q
    }

    /// Parses [`FeedRequest::query`]; absent numbers are 0, unknown keys are
    /// ignored. The error names the parameter.
    pub fn parse(query: Option<&str>) -> Result<FeedRequest, String> {
        let mut r = FeedRequest::default();
        let (mut page, mut page_pod, mut page_after) = (None, None, None);
        for pair in query.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
            let number = || {
                value
                    .parse::<u64>()
                    .map_err(|_| format!("bad {key}: {value:?}"))
            };
            match key {
                "epoch" => r.epoch = number()?,
                "cursor" => r.cursor = number()?,
                "pods" => r.pods_version = number()?,
                "load" => r.load_version = number()?,
                "page" => {
                    let n = number()?;
                    page = Some(u32::try_from(n).map_err(|_| format!("bad page: {value:?}"))?);
                }
                "page_pod" => page_pod = Some(number()?),
                "page_after" => page_after = Some(number()?),
                _ => {}
            }
        }
        r.page = match (page, page_pod) {
            (Some(number), Some(start)) => Some((
                number,
                PageToken {
                    start,
                    after: page_after,
                },
            )),
            (None, None) if page_after.is_none() => None,
            _ => return Err("page, page_pod and page_after go together".to_owned()),
        };
        Ok(r)
    }
}

/// What became of a request.
#[derive(Debug, Clone, Copy)]
pub enum FeedResponse<'a> {
    /// The host refused to send it.
    NotSent,
    /// It ended without a response (reset, timeout, or a body over the host's buffer).
    NoResponse,
    /// A status other than 200.
    Status(u32),
    /// A 200 with this body.
    Body(&'a [u8]),
}

/// Why an answer was not applied.
#[derive(Debug, Clone, PartialEq)]
pub enum FeedFault {
    NotSent,
    NoResponse,
    Status(u32),
    Undecodable(FeedError),
    /// An answer that does not follow from the client's state: it starts over with a snapshot.
    Inconsistent(&'static str),
}

impl fmt::Display for FeedFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FeedFault::NotSent => write!(f, "feed call not sent"),
            FeedFault::NoResponse => write!(
                f,
                "feed call ended without a response (reset, timeout, or an answer over \
                 Envoy's async-client buffer)"
            ),
            FeedFault::Status(s) => write!(f, "feed answered {s}"),
            FeedFault::Undecodable(e) => write!(f, "feed undecodable: {e}"),
            FeedFault::Inconsistent(why) => {
                write!(
                    f,
                    "feed answer inconsistent ({why}); starting over with a snapshot"
                )
            }
        }
    }
}

/// An applied answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Received {
    /// The state change, with the complete pod list.
    pub update: FeedUpdate,
    /// The snapshot page number, when the answer was a page.
    pub page: Option<u32>,
    /// True when this was the last page of a snapshot.
    pub snapshot_complete: bool,
}

/// See the module documentation.
#[derive(Debug, Clone)]
pub struct FeedClient {
    poll_ms: u64,
    epoch: u64,
    cursor: u64,
    pods: Vec<PodInfo>,
    pods_version: u64,
    load_version: u64,
    /// The page to ask for next while a snapshot is being paged.
    next_page: Option<(u32, PageToken)>,
    in_flight: bool,
    /// The last answer asked to be followed at once.
    ask_now: bool,
    not_before_ms: u64,
    failures: u32,
}

impl FeedClient {
    pub fn new(poll_ms: u32) -> FeedClient {
        FeedClient {
            poll_ms: u64::from(poll_ms.max(1)),
            epoch: 0,
            cursor: 0,
            pods: Vec::new(),
            pods_version: 0,
            load_version: 0,
            next_page: None,
            in_flight: false,
            ask_now: false,
            not_before_ms: 0,
            failures: 0,
        }
    }

    pub fn set_poll_ms(&mut self, poll_ms: u32) {
        self.poll_ms = u64::from(poll_ms.max(1));
    }

    /// True while a snapshot is being paged in.
    pub fn is_paging(&self) -> bool {
        self.next_page.is_some()
    }

    /// The request of this tick, unless one is in flight or a backoff runs.
    pub fn on_tick(&mut self, now_ms: u64) -> Option<FeedRequest> {
        if self.in_flight || now_ms < self.not_before_ms {
            return None;
        }
        Some(self.send())
    }

    /// The request to send at once after an answer that asked for it (the
    /// next snapshot page, or more waiting deltas).
    pub fn follow_up(&mut self, now_ms: u64) -> Option<FeedRequest> {
        if !self.ask_now {
            return None;
        }
        self.on_tick(now_ms)
    }

    fn send(&mut self) -> FeedRequest {
        self.in_flight = true;
        self.ask_now = false;
        FeedRequest {
            epoch: self.epoch,
            cursor: self.cursor,
            pods_version: self.pods_version,
            load_version: self.load_version,
            page: self.next_page,
        }
    }

    /// What came of the request in flight: the update to apply, or why there is none.
    pub fn on_response(
        &mut self,
        now_ms: u64,
        response: FeedResponse<'_>,
    ) -> Result<Received, FeedFault> {
        self.in_flight = false;
        let result = match response {
            FeedResponse::NotSent => Err(FeedFault::NotSent),
            FeedResponse::NoResponse => Err(FeedFault::NoResponse),
            FeedResponse::Status(s) => Err(FeedFault::Status(s)),
            FeedResponse::Body(body) => match feed::decode_message(body) {
                Err(e) => Err(FeedFault::Undecodable(e)),
                Ok(m) => self.accept(m).map_err(|why| {
                    self.start_over();
                    FeedFault::Inconsistent(why)
                }),
            },
        };
        match &result {
            Ok(_) => {
                self.failures = 0;
                self.not_before_ms = now_ms;
            }
            Err(_) => {
                self.failures = self.failures.saturating_add(1);
                self.ask_now = false;
                self.not_before_ms = now_ms.saturating_add(self.backoff_ms());
            }
        }
        result
    }

    /// `poll_ms` doubled per consecutive failure, at most [`MAX_BACKOFF_MS`]
    /// (never below one poll period).
    fn backoff_ms(&self) -> u64 {
        let doubled = self.poll_ms.saturating_mul(1 << self.failures.min(20));
        doubled.min(MAX_BACKOFF_MS).max(self.poll_ms)
    }

    /// Forgets the epoch, the lists and the paging: the next request asks for a snapshot.
    fn start_over(&mut self) {
        self.epoch = 0;
        self.cursor = 0;
        self.pods_version = 0;
        self.load_version = 0;
        self.next_page = None;
        self.ask_now = false;
    }

    fn accept(&mut self, m: FeedMessage) -> Result<Received, &'static str> {
        let (snapshot, page, next) = match m.kind {
            FeedKind::Page { number: 0, next } => {
                if m.pods.is_none() {
                    return Err("the first page of a snapshot has no pod list");
                }
                self.epoch = m.epoch;
                self.cursor = m.cursor;
                (true, Some(0), next)
            }
            FeedKind::Page { number, next } => {
                if self.next_page.map(|(n, _)| n) != Some(number) || m.epoch != self.epoch {
                    return Err("a snapshot page out of order");
                }
                (false, Some(number), next)
            }
            FeedKind::Delta { more } => {
                if self.next_page.is_some() {
                    return Err("a delta while a snapshot is being paged");
                }
                if self.epoch == 0 || m.epoch != self.epoch || m.cursor < self.cursor {
                    return Err("a delta that does not continue this epoch's cursor");
                }
                self.cursor = m.cursor;
                self.ask_now = more;
                (false, None, None)
            }
        };
        self.take_lists(&m)?;
        if m.ops.iter().any(|op| op.pod() as usize >= self.pods.len()) {
            return Err("an op names a pod outside the pod list");
        }
        if let Some(number) = page {
            self.next_page = next.map(|token| (number.saturating_add(1), token));
            self.ask_now = next.is_some();
        }
        Ok(Received {
            update: FeedUpdate {
                epoch: self.epoch,
                cursor: self.cursor,
                snapshot,
                pods: self.pods.clone(),
                pods_unchanged: m.pods.is_none() && m.load.is_none(),
                ops: m.ops,
            },
            page,
            snapshot_complete: page.is_some() && next.is_none(),
        })
    }

    /// Adopts the pod list or the load the message carries; refuses a message
    /// that carries none for a version the client does not hold.
    fn take_lists(&mut self, m: &FeedMessage) -> Result<(), &'static str> {
        if let Some(pods) = &m.pods {
            self.pods.clone_from(pods);
            self.pods_version = m.pods_version;
            self.load_version = m.load_version;
            return Ok(());
        }
        if m.pods_version != self.pods_version {
            return Err("no pod list for a pods version the client does not hold");
        }
        match &m.load {
            Some(load) => {
                if load.len() != self.pods.len() {
                    return Err("a load list of another length than the pod list");
                }
                for (pod, l) in self.pods.iter_mut().zip(load) {
                    pod.set_load(*l);
                }
                self.load_version = m.load_version;
            }
            None if m.load_version != self.load_version => {
                return Err("no load for a load version the client does not hold");
            }
            None => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::feed::{encode_message, load_version, pods_version, BlockOp, PodLoad, Tier};
    use crate::hash::keys;

    const POLL: u32 = 100;

    fn pods(n: usize) -> Vec<PodInfo> {
        (0..n)
            .map(|i| PodInfo {
                address: format!("10.0.0.{i}:8000"),
                capacity_blocks: 100,
                ..PodInfo::default()
            })
            .collect()
    }

    fn stored(pod: u32, hashes: &[u64]) -> BlockOp {
        BlockOp::Stored {
            pod,
            tier: Tier::Gpu,
            hashes: keys(hashes),
        }
    }

    fn page(epoch: u64, number: u32, next: Option<u64>, list: Option<&[PodInfo]>) -> FeedMessage {
        let all = pods(2);
        FeedMessage {
            epoch,
            cursor: 50,
            pods_version: pods_version(&all),
            load_version: load_version(&all),
            kind: FeedKind::Page {
                number,
                next: next.map(|start| PageToken { start, after: None }),
            },
            pods: list.map(<[PodInfo]>::to_vec),
            load: None,
            ops: vec![stored(number % 2, &[u64::from(number) + 1])],
        }
    }

    fn delta(epoch: u64, cursor: u64, more: bool) -> FeedMessage {
        let all = pods(2);
        FeedMessage {
            epoch,
            cursor,
            pods_version: pods_version(&all),
            load_version: load_version(&all),
            kind: FeedKind::Delta { more },
            ops: vec![BlockOp::Removed {
                pod: 1,
                hashes: keys(&[2]),
            }],
            ..FeedMessage::default()
        }
    }

    fn answer(c: &mut FeedClient, now: u64, m: &FeedMessage) -> Result<Received, FeedFault> {
        c.on_response(now, FeedResponse::Body(&encode_message(m)))
    }

    /// A client that has loaded a one-page snapshot of epoch 7 at cursor 50.
    fn synced() -> FeedClient {
        let mut c = FeedClient::new(POLL);
        c.on_tick(0).unwrap();
        answer(&mut c, 1, &page(7, 0, None, Some(&pods(2)))).unwrap();
        c
    }

    #[test]
    fn a_fresh_client_asks_for_a_snapshot_once_per_tick() {
        let mut c = FeedClient::new(POLL);
        assert_eq!(c.on_tick(0), Some(FeedRequest::default()));
        assert_eq!(c.on_tick(100), None, "one request in flight at a time");
        assert_eq!(c.follow_up(100), None);
    }

    #[test]
    fn a_paged_snapshot_is_requested_page_by_page_then_deltas_follow() {
        let mut c = FeedClient::new(POLL);
        c.on_tick(0).unwrap();
        let list = pods(2);
        let first = answer(&mut c, 1, &page(7, 0, Some(11), Some(&list))).unwrap();
        assert!(first.update.snapshot && !first.snapshot_complete);
        assert_eq!(first.page, Some(0));
        assert_eq!(first.update.pods, list);
        assert!(c.is_paging());
        // The next page at once, without waiting for the tick.
        let next = c.follow_up(1).unwrap();
        assert_eq!(
            next.page,
            Some((
                1,
                PageToken {
                    start: 11,
                    after: None
                }
            ))
        );
        assert_eq!((next.epoch, next.cursor), (7, 50));
        assert_eq!(next.pods_version, pods_version(&list));
        // Later pages carry no pod list: the client fills in the one it keeps.
        let second = answer(&mut c, 2, &page(7, 1, Some(12), None)).unwrap();
        assert!(!second.update.snapshot);
        assert_eq!(second.update.pods, list);
        assert_eq!(second.update.ops, vec![stored(1, &[2])]);
        c.follow_up(2).unwrap();
        let last = answer(&mut c, 3, &page(7, 2, None, None)).unwrap();
        assert!(last.snapshot_complete && !c.is_paging());
        assert_eq!(c.follow_up(3), None, "nothing more to ask at once");
        // Then deltas from the cursor of the first page.
        let poll = c.on_tick(100).unwrap();
        assert_eq!((poll.epoch, poll.cursor, poll.page), (7, 50, None));
    }

    #[test]
    fn an_idle_poll_or_a_load_change_completes_the_kept_list() {
        let mut c = synced();
        c.on_tick(100).unwrap();
        let got = answer(&mut c, 101, &delta(7, 60, false)).unwrap();
        assert_eq!(got.update.pods, pods(2));
        assert_eq!(got.update.cursor, 60);
        let mut loaded = pods(2);
        loaded[1].waiting = 4;
        loaded[1].kv_usage = 0.5;
        let mut m = delta(7, 60, false);
        m.load_version = load_version(&loaded);
        m.load = Some(loaded.iter().map(PodInfo::load).collect());
        c.on_tick(200).unwrap();
        let got = answer(&mut c, 201, &m).unwrap();
        assert_eq!(got.update.pods, loaded);
        assert_eq!(c.on_tick(300).unwrap().load_version, load_version(&loaded));
    }

    #[test]
    fn more_waiting_deltas_are_asked_for_at_once() {
        let mut c = synced();
        c.on_tick(100).unwrap();
        answer(&mut c, 101, &delta(7, 60, true)).unwrap();
        assert_eq!(c.follow_up(101).map(|r| r.cursor), Some(60));
        answer(&mut c, 102, &delta(7, 70, false)).unwrap();
        assert_eq!(c.follow_up(102), None);
    }

    #[test]
    fn a_new_epoch_snapshot_replaces_the_old_state() {
        let mut c = synced();
        c.on_tick(100).unwrap();
        // The indexer restarted: it answers the stale epoch with a snapshot.
        let got = answer(&mut c, 101, &page(8, 0, None, Some(&pods(1)))).unwrap();
        assert!(got.update.snapshot);
        assert_eq!(got.update.pods, pods(1));
        assert_eq!(c.on_tick(200).unwrap().epoch, 8);
    }

    #[test]
    fn failures_back_off_doubling_and_retry_the_same_request() {
        let mut c = synced();
        let asked = c.on_tick(100).unwrap();
        assert_eq!(
            c.on_response(100, FeedResponse::Status(503)),
            Err(FeedFault::Status(503))
        );
        assert_eq!(c.on_tick(299), None, "200 ms after one failure");
        assert_eq!(c.on_tick(300), Some(asked));
        c.on_response(300, FeedResponse::NoResponse).unwrap_err();
        assert_eq!(c.on_tick(699), None, "400 ms after two");
        c.on_tick(700).unwrap();
        // Garbage is a failure too, and changes no state.
        assert!(matches!(
            c.on_response(700, FeedResponse::Body(b"junk")),
            Err(FeedFault::Undecodable(_))
        ));
        assert_eq!(c.on_tick(1499), None);
        assert_eq!(c.on_tick(1500), Some(asked));
        for i in 0..20 {
            c.on_response(10_000 * i, FeedResponse::NotSent)
                .unwrap_err();
            c.on_tick(10_000 * (i + 1)).unwrap();
        }
        // Capped at MAX_BACKOFF_MS.
        c.on_response(1_000_000, FeedResponse::NotSent).unwrap_err();
        assert_eq!(c.on_tick(1_000_000 + MAX_BACKOFF_MS - 1), None);
        assert!(c.on_tick(1_000_000 + MAX_BACKOFF_MS).is_some());
        // A success resets the backoff.
        answer(&mut c, 2_000_000, &delta(7, 60, false)).unwrap();
        assert!(c.on_tick(2_000_000).is_some());
    }

    #[test]
    fn inconsistent_answers_start_over_with_a_snapshot() {
        let list = pods(2);
        let cases: Vec<(FeedClient, FeedMessage)> = vec![
            // A delta of another epoch.
            (synced(), delta(9, 60, false)),
            // A delta behind the cursor.
            (synced(), delta(7, 40, false)),
            // A page nobody asked for.
            (synced(), page(7, 3, None, None)),
            // A new pods version without the list.
            (synced(), {
                let mut m = delta(7, 60, false);
                m.pods_version += 1;
                m
            }),
            // A new load version without the load.
            (synced(), {
                let mut m = delta(7, 60, false);
                m.load_version += 1;
                m
            }),
            // A load list of the wrong length.
            (synced(), {
                let mut m = delta(7, 60, false);
                m.load = Some(vec![PodLoad::default()]);
                m
            }),
            // An op naming a pod beyond the kept list.
            (synced(), {
                let mut m = delta(7, 60, false);
                m.ops = vec![BlockOp::Cleared { pod: 2 }];
                m
            }),
            // A first page without the pod list.
            (FeedClient::new(POLL), page(7, 0, None, None)),
            // A delta to a client that holds no snapshot.
            (FeedClient::new(POLL), delta(7, 60, false)),
        ];
        for (i, (mut c, m)) in cases.into_iter().enumerate() {
            c.on_tick(100).unwrap();
            let got = answer(&mut c, 100, &m);
            assert!(
                matches!(got, Err(FeedFault::Inconsistent(_))),
                "case {i}: {got:?}"
            );
            let retry = c.on_tick(100 + 2 * u64::from(POLL)).unwrap();
            assert_eq!(retry, FeedRequest::default(), "case {i}");
        }
        // A delta while paging.
        let mut c = FeedClient::new(POLL);
        c.on_tick(0).unwrap();
        answer(&mut c, 0, &page(7, 0, Some(1), Some(&list))).unwrap();
        c.follow_up(0).unwrap();
        assert!(matches!(
            answer(&mut c, 0, &delta(7, 60, false)),
            Err(FeedFault::Inconsistent(_))
        ));
        assert!(!c.is_paging());
    }

    #[test]
    fn queries_roundtrip_and_bad_ones_name_the_parameter() {
        let requests = [
            FeedRequest::default(),
            FeedRequest {
                epoch: 1,
                cursor: 2,
                pods_version: u64::MAX,
                load_version: 4,
                page: Some((
                    5,
                    PageToken {
                        start: 6,
                        after: Some(7),
                    },
                )),
            },
            FeedRequest {
                page: Some((1, PageToken::default())),
                ..FeedRequest::default()
            },
        ];
        for r in requests {
            assert_eq!(FeedRequest::parse(Some(&r.query())), Ok(r));
        }
        assert_eq!(FeedRequest::parse(None), Ok(FeedRequest::default()));
        assert_eq!(
            FeedRequest::parse(Some("epoch=1&cursor=2&x=y")).map(|r| (r.epoch, r.cursor)),
            Ok((1, 2))
        );
        assert_eq!(
            FeedRequest::parse(Some("epoch=x")),
            Err("bad epoch: \"x\"".to_owned())
        );
        assert!(FeedRequest::parse(Some("page=1")).is_err());
        assert!(FeedRequest::parse(Some("page=4294967296&page_pod=1")).is_err());
    }

    /// Arbitrary bytes and mutated answers never panic the client, and it
    /// always gets back to asking.
    #[test]
    fn arbitrary_answers_never_panic() {
        let seeds: Vec<Vec<u8>> = [
            page(7, 0, Some(3), Some(&pods(2))),
            page(7, 1, None, None),
            delta(7, 60, true),
        ]
        .iter()
        .map(encode_message)
        .collect();
        let mut c = FeedClient::new(POLL);
        let mut rng = 0x2545_f491_4f6c_dd1du64;
        let mut now = 0;
        for i in 0..20_000 {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            let mut b = seeds[i % seeds.len()].clone();
            let at = (rng as usize) % b.len();
            b[at] ^= (rng >> 40) as u8;
            if rng % 3 == 0 {
                b.truncate(at);
            }
            now += MAX_BACKOFF_MS;
            assert!(c.on_tick(now).is_some() || c.follow_up(now).is_some());
            let _ = c.on_response(now, FeedResponse::Body(&b));
        }
    }
}
