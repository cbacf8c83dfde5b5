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
    assert!(first.new_pod_list);
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
    // Later pages carry no pod list: their ops name pods of the kept one,
    // which the update does not repeat.
    let second = answer(&mut c, 2, &page(7, 1, Some(12), None)).unwrap();
    assert!(!second.update.snapshot && !second.new_pod_list);
    assert!(second.update.pods_unchanged && second.update.pods.is_empty());
    assert_eq!(c.pods(), list);
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
fn an_idle_poll_repeats_no_list_and_a_load_change_carries_the_load_alone() {
    let mut c = synced();
    c.on_tick(100).unwrap();
    let got = answer(&mut c, 101, &delta(7, 60, false)).unwrap();
    assert!(got.update.pods_unchanged && got.update.pods.is_empty());
    assert_eq!(c.pods(), pods(2));
    assert_eq!(got.update.cursor, 60);
    let mut loaded = pods(2);
    loaded[1].waiting = 4;
    loaded[1].kv_usage = 0.5;
    let mut m = delta(7, 60, false);
    m.load_version = load_version(&loaded);
    m.load = Some(loaded.iter().map(PodInfo::load).collect());
    c.on_tick(200).unwrap();
    let got = answer(&mut c, 201, &m).unwrap();
    assert!(got.update.pods_unchanged && got.update.pods.is_empty());
    assert_eq!(got.update.load, m.load);
    assert_eq!(got.update.pods_version, pods_version(&pods(2)));
    assert_eq!(c.pods(), loaded);
    assert!(!got.new_pod_list, "a load change is the kept list");
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
