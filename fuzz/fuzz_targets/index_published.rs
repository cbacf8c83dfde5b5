//! The routing index as the singleton publishes it in shared data: a worker
//! reads keys another VM wrote, so every decoder (head, pod table, bucket,
//! set chunk, change log) must return on any bytes, never panic or loop; a lookup over
//! garbled keys is a miss, counted. The singleton's write-through index
//! reads its buckets back from the same keys: whatever they hold, its
//! writes and lookups must not panic or loop either.
#![no_main]

use kvroute_core::hash::BlockHash;
use kvroute_core::index::changes::ChangeLog;
use kvroute_core::index::published::{
    find_in_bucket, find_in_chunk, Head, KeyReader, KeyStore, PodTable, PublishedView, HEAD_KEY,
    PODS_KEY,
};
use kvroute_core::index::{match_lengths, BlockIndex, MatchRules, Tier};
use libfuzzer_sys::fuzz_target;
use std::rc::Rc;

/// Shared data cut from the fuzzer's bytes: the first two bytes give the
/// lengths of the head and the pod table; every other key reads the rest.
struct Garbage<'a> {
    head: &'a [u8],
    pods: &'a [u8],
    rest: &'a [u8],
}

impl<'a> Garbage<'a> {
    fn cut(data: &'a [u8]) -> Garbage<'a> {
        let (lengths, body) = data.split_at(data.len().min(2));
        let head_len = lengths
            .first()
            .map_or(0, |&n| usize::from(n))
            .min(body.len());
        let (head, body) = body.split_at(head_len);
        let pods_len = lengths
            .get(1)
            .map_or(0, |&n| usize::from(n))
            .min(body.len());
        let (pods, rest) = body.split_at(pods_len);
        Garbage { head, pods, rest }
    }
}

impl KeyReader for Garbage<'_> {
    fn read(&self, key: &str) -> Option<Vec<u8>> {
        Some(match key {
            HEAD_KEY => self.head.to_vec(),
            PODS_KEY => self.pods.to_vec(),
            _ => self.rest.to_vec(),
        })
    }
}

/// Shared data where every bucket key reads the fuzzer's bytes and writes
/// go nowhere: what a write-through writer reads back is garbage.
struct Overwritten(Vec<u8>);

impl KeyReader for Overwritten {
    fn read(&self, _key: &str) -> Option<Vec<u8>> {
        Some(self.0.clone())
    }
}

impl KeyStore for Overwritten {
    fn write(&self, _key: &str, _value: &[u8]) -> bool {
        true
    }
}

/// A write-through index that publishes (so it reads its buckets back),
/// then writes and looks up over buckets that hold `data`.
fn write_through_over(data: &[u8], hashes: &[BlockHash], rules: &MatchRules) {
    let budget = BlockIndex::min_budget_bytes() * 4;
    let mut index =
        BlockIndex::new(budget, 60).write_through(Rc::new(Overwritten(data.to_vec())), 2);
    let Some(pod) = index.add_pod() else {
        return;
    };
    index.touch_chain(pod, hashes, Tier::Gpu, 1);
    index.publish(usize::MAX, 1, 0, &|_| None);
    index.touch_chain(pod, hashes, Tier::Learned, 2);
    index.remove(pod, &hashes[..hashes.len() / 2]);
    let mut out = Vec::new();
    index.match_lengths(hashes, 2, rules, &mut out);
    assert!(out.iter().all(|m| m.blocks <= hashes.len()));
    assert!(index.memory_bytes() <= budget);
}

fuzz_target!(|data: &[u8]| {
    let key = data
        .iter()
        .take(8)
        .fold(0u64, |k, &b| k << 8 | u64::from(b))
        & ((1 << 40) - 1);
    let _ = Head::decode(data);
    let _ = PodTable::decode(data);
    let _ = find_in_bucket(data, key);
    let _ = find_in_chunk(data, key as u32);
    if let Ok(log) = ChangeLog::decode(data) {
        let listed = log.between(key, key.wrapping_add(1));
        assert!(listed.map_or(0, Iterator::count) <= data.len());
    }
    let rules = MatchRules {
        trust_precise: true,
        cpu_credit: 0.5,
        disk_credit: 0.25,
    };
    let hashes: Vec<BlockHash> = (0..64)
        .map(|i| BlockHash::new(key.wrapping_mul(i + 1)))
        .collect();
    let reader = Garbage::cut(data);
    let mut view = PublishedView::default();
    if view.refresh(&reader, u64::MAX, u64::MAX).is_ok() {
        let source = view.source(&reader).expect("a refreshed view is a source");
        let mut out = Vec::new();
        match_lengths(&source, &hashes, 1, &rules, &mut out);
        assert!(out.iter().all(|m| m.blocks <= hashes.len()));
        // The writer's next publication: the view reads the change log
        // (here the same garbage as every other key) to keep what it read.
        if let Ok(mut head) = Head::decode(reader.head) {
            head.publication = head.publication.wrapping_add(1);
            let next = head.encode();
            let reader = Garbage {
                head: &next,
                ..reader
            };
            if view.refresh(&reader, u64::MAX, u64::MAX).is_ok() {
                let source = view.source(&reader).expect("a refreshed view is a source");
                out.clear();
                match_lengths(&source, &hashes, 1, &rules, &mut out);
                assert!(out.iter().all(|m| m.blocks <= hashes.len()));
            }
        }
    }
    write_through_over(data, &hashes, &rules);
});
