//! Where a new proxy's time to route goes: the issue-10 fleet's snapshot
//! (1,000 pods × 13,445 blocks, no block shared) in the indexer's pages of
//! at most 2¹⁹ hashes, cut by pod as before (26 pages, pods in order) and by
//! index-key range as now (28 pages of ≈ 15/16 of 2¹⁹), taken the way the
//! singleton takes it: each page decoded from the wire, applied bucket by bucket to the
//! write-through index (working set of 2,048 buckets over an in-memory
//! store), then published (flushes of at most 8,192 keys until nothing is
//! deferred). Prints per phase the time and the bucket reads and writes,
//! for the resident index too (no store: the cost of the write-through),
//! and for pages applied two at a time (what the singleton did for pages by pod).
//!
//! Native, so every figure is below the wasm singleton's (where a shared-data
//! read or write also copies the bucket across the VM boundary).
//!
//! Run: `cargo bench -p kvroute-core --bench snapshot_load`

// A benchmark, not shipped code: a failed setup should stop it loudly.
#![allow(clippy::expect_used)]

use kvroute_core::config::DEFAULT_INDEX_BUDGET_BYTES;
use kvroute_core::feed::{self, BlockOp, FeedKind, FeedMessage, PodInfo, Tier};
use kvroute_core::hash::{splitmix64, BlockHash, IndexKey, INDEX_KEY_BITS};
use kvroute_core::index::published::{KeyReader, KeyStore};
use kvroute_core::index::{BlockIndex, IndexOp, MatchRules, PodId, PodMatch};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::time::{Duration, Instant};

const PODS: usize = 1000;
/// 70 % of 19,208 blocks.
const BLOCKS_PER_POD: usize = 13_445;
/// The indexer's default `--feed-max-hashes`.
const PAGE_HASHES: usize = 1 << 19;
/// The singleton's bounds (src/singleton.rs).
const MAX_RESIDENT_BYTES: usize = 9 << 20;
const MAX_FLUSH_WRITES: usize = 8192;

/// Shared data as a map, counting reads and writes.
#[derive(Default)]
struct MapStore {
    map: RefCell<HashMap<String, Vec<u8>>>,
    reads: Cell<u64>,
    writes: Cell<u64>,
}

impl KeyReader for MapStore {
    fn read(&self, key: &str) -> Option<Vec<u8>> {
        self.reads.set(self.reads.get() + 1);
        self.map.borrow().get(key).cloned()
    }
}

impl KeyStore for MapStore {
    fn write(&self, key: &str, value: &[u8]) -> bool {
        self.writes.set(self.writes.get() + 1);
        self.map
            .borrow_mut()
            .insert(key.to_string(), value.to_vec());
        true
    }
}

/// How the indexer cuts its snapshot into pages.
#[derive(Clone, Copy, Debug)]
enum Paging {
    /// Before: pods in order, a pod cut where a page is full.
    ByPod,
    /// Now: ascending ranges of the index key, each sized to about 15/16 of
    /// a page (the indexer's aim), every pod's keys of the range in it.
    ByKeyRange,
}

/// The snapshot's pages as the indexer sends them.
fn pages(paging: Paging) -> Vec<Vec<u8>> {
    let pods: Vec<PodInfo> = (0..PODS)
        .map(|p| PodInfo {
            address: format!("10.0.{}.{}:8000", p / 256, p % 256),
            models: vec!["m".into()],
            capacity_blocks: 19_208,
            speed: 1.0,
            ..PodInfo::default()
        })
        .collect();
    let pod_hashes = |p: usize| {
        (0..BLOCKS_PER_POD).map(move |i| BlockHash::new(splitmix64(((p as u64) << 32) | i as u64)))
    };
    let mut pages_ops: Vec<Vec<BlockOp>> = Vec::new();
    match paging {
        Paging::ByPod => {
            let mut ops: Vec<BlockOp> = Vec::new();
            let mut in_page = 0;
            for p in 0..PODS {
                let mut hashes: Vec<IndexKey> = pod_hashes(p).map(|h| h.index_key()).collect();
                while !hashes.is_empty() {
                    let take = hashes.len().min(PAGE_HASHES - in_page);
                    let rest = hashes.split_off(take);
                    ops.push(BlockOp::Stored {
                        pod: p as u32,
                        tier: Tier::Gpu,
                        hashes,
                    });
                    hashes = rest;
                    in_page += take;
                    if in_page == PAGE_HASHES {
                        pages_ops.push(std::mem::take(&mut ops));
                        in_page = 0;
                    }
                }
            }
            if !ops.is_empty() {
                pages_ops.push(ops);
            }
        }
        Paging::ByKeyRange => {
            let entries = (PODS * BLOCKS_PER_POD) as u64;
            let width = (1u64 << INDEX_KEY_BITS) * 15 / 16 / entries * PAGE_HASHES as u64;
            let ranges = (1u64 << INDEX_KEY_BITS).div_ceil(width) as usize;
            // Per range, per pod, the hashes whose key falls in the range.
            let mut by_range: Vec<Vec<Vec<IndexKey>>> = vec![vec![Vec::new(); PODS]; ranges];
            for p in 0..PODS {
                for key in pod_hashes(p).map(|h| h.index_key()) {
                    if let Some(run) = by_range[(key.get() / width) as usize].get_mut(p) {
                        run.push(key);
                    }
                }
            }
            for range in by_range {
                let ops = (0u32..)
                    .zip(range)
                    .filter(|(_, hashes)| !hashes.is_empty())
                    .map(|(pod, hashes)| BlockOp::Stored {
                        pod,
                        tier: Tier::Gpu,
                        hashes,
                    })
                    .collect();
                pages_ops.push(ops);
            }
        }
    }
    (0u32..)
        .zip(pages_ops)
        .map(|(number, ops)| {
            feed::encode_message(&FeedMessage {
                epoch: 1,
                cursor: 1,
                kind: FeedKind::Page { number, next: None },
                pods: (number == 0).then(|| pods.clone()),
                ops,
                ..FeedMessage::default()
            })
        })
        .collect()
}

#[derive(Default)]
struct Phases {
    decode: Duration,
    apply: Duration,
    publish: Duration,
}

/// Loads `pages`, `group` pages per application; returns the phases' times
/// and the store's counters.
fn load(pages: &[Vec<u8>], group: usize, write_through: bool) -> (Phases, u64, u64, BlockIndex) {
    let store = Rc::new(MapStore::default());
    let mut index = BlockIndex::new(DEFAULT_INDEX_BUDGET_BYTES, 600);
    if write_through {
        index = index.write_through(store.clone(), MAX_RESIDENT_BYTES);
    }
    let pods: Vec<PodId> = (0..PODS)
        .map(|_| index.add_pod().expect("pod id"))
        .collect();
    let mut phases = Phases::default();
    for chunk in pages.chunks(group) {
        let start = Instant::now();
        let messages: Vec<FeedMessage> = chunk
            .iter()
            .map(|bytes| feed::decode_message(bytes).expect("page"))
            .collect();
        phases.decode += start.elapsed();
        let start = Instant::now();
        let ops: Vec<IndexOp> = messages
            .iter()
            .flat_map(|m| &m.ops)
            .filter_map(|op| match op {
                BlockOp::Stored { pod, tier, hashes } => {
                    Some(IndexOp::Stored(pods[*pod as usize], *tier, hashes))
                }
                _ => None,
            })
            .collect();
        index.apply_ops(&ops, 1);
        phases.apply += start.elapsed();
        let start = Instant::now();
        loop {
            let publication = index.publish(MAX_FLUSH_WRITES, 1, 0, &|_| Some("pod".into()));
            for (key, value) in &publication.writes {
                store.write(key, value);
            }
            if publication.deferred == 0 {
                break;
            }
        }
        phases.publish += start.elapsed();
    }
    (phases, store.reads.get(), store.writes.get(), index)
}

fn main() {
    let rules = MatchRules {
        trust_precise: true,
        cpu_credit: 0.5,
        disk_credit: 0.25,
    };
    println!("| paging | index | pages per apply | decode s | apply s | publish s | total s | bucket reads | key writes | early write-backs | blocks |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for paging in [Paging::ByPod, Paging::ByKeyRange] {
        let start = Instant::now();
        let pages = pages(paging);
        let bytes: usize = pages.iter().map(Vec::len).sum();
        eprintln!(
            "snapshot {paging:?}: {PODS} pods x {BLOCKS_PER_POD} blocks, {} pages, {:.1} MB on the wire ({:.1} s to build)",
            pages.len(),
            bytes as f64 / 1e6,
            start.elapsed().as_secs_f64()
        );
        for (write_through, group) in [(false, 1), (true, 1), (true, 2)] {
            let (phases, reads, writes, index) = load(&pages, group, write_through);
            let stats = index.stats();
            // It measured a complete load: every pod's first and last block matches.
            let mut out: Vec<PodMatch> = Vec::new();
            for p in [0, PODS / 2, PODS - 1] {
                let last =
                    BlockHash::new(splitmix64(((p as u64) << 32) | (BLOCKS_PER_POD - 1) as u64));
                index.match_lengths(&[last], 1, &rules, &mut out);
                assert_eq!(out.len(), 1, "pod {p}: {out:?}");
            }
            assert_eq!(
                stats.evicted + stats.dropped + stats.unloadable,
                0,
                "{stats:?}"
            );
            let total = phases.decode + phases.apply + phases.publish;
            println!(
                "| {paging:?} | {} | {group} | {:.2} | {:.2} | {:.2} | {:.2} | {reads} | {writes} | {} | {} |",
                if write_through {
                    "write-through"
                } else {
                    "resident"
                },
                phases.decode.as_secs_f64(),
                phases.apply.as_secs_f64(),
                phases.publish.as_secs_f64(),
                total.as_secs_f64(),
                stats.written_back_early,
                stats.blocks,
            );
        }
    }
}
