//! `GET /v1/feed`: deltas from the log, a snapshot in pages, and the pod list
//! or the load only when the consumer's version of it is stale (wire format:
//! `kvroute_core::feed`; the consumer: `kvroute_core::feed_client`).
//!
//! Pages: ascending ranges of the 40-bit index key, each carrying every
//! (pod, key, best tier) whose key falls in it, as runs per pod and tier; the
//! page token holds the first key of the next range. A consumer's index puts
//! a key's bucket by the key's top bits, so a range lands on a contiguous run
//! of its buckets: each bucket is touched by one page (pages by pod touched
//! nearly every bucket on every page). The records' ids are grouped by key
//! range over a window of keys (`key_ranges.rs`: two passes over the block
//! table per window, one window for a 1,000-pod snapshot), and each page
//! costs a visit of its range's records and a sort of its blocks.
//! Pages are read from the live state, each at its own moment: the consumer
//! then replays the deltas from the cursor of the first page, which brings
//! every (pod, key) to its latest state whatever page it came in. So a page
//! may read through a grouping taken at that cursor or later (a block stored
//! after the grouping comes in those deltas), not one taken before it.

use kvroute_core::feed::{self, BlockOp, FeedKind, FeedMessage, PageToken, PodInfo, PodLoad, Tier};
use kvroute_core::feed_client::FeedRequest;

use kvroute_core::hash::IndexKey;

use super::block_table::SetId;
use super::feed_log::Op;
use super::hashing::Map;
use super::keys::{BlockHash, PodKey, KEY_END};
use super::Index;

impl Index {
    fn pod_infos(&self) -> (Vec<PodInfo>, Map<PodKey, u32>) {
        let mut infos = Vec::with_capacity(self.pods.len());
        let mut idx = Map::with_capacity_and_hasher(self.pods.len(), Default::default());
        for (i, (k, p)) in self.pods.iter().enumerate() {
            idx.insert(*k, i as u32);
            infos.push(PodInfo {
                address: p.address.clone(),
                models: p.models.clone(),
                capacity_blocks: p.load.capacity_blocks,
                speed: p.speed,
                waiting: p.load.waiting,
                running: p.load.running,
                kv_usage: p.load.kv_usage,
            });
        }
        (infos, idx)
    }

    /// The answer to `GET /v1/feed`: the next page of the snapshot `request`
    /// is paging; else deltas after its cursor when that is in the retained
    /// log of this epoch; else the first page of a new snapshot (also when
    /// the pod list changed while paging: page numbers index into one list).
    pub fn feed(&mut self, request: &FeedRequest) -> FeedMessage {
        let (infos, idx) = self.pod_infos();
        let pods_version = feed::pods_version(&infos);
        let load_version = feed::load_version(&infos);
        let head = self.cursor();
        let in_log = request.epoch == self.epoch
            && request.cursor >= self.log_start
            && request.cursor <= head;
        let (kind, cursor, ops) = match request.page {
            Some((number, token))
                if number > 0 && in_log && request.pods_version == pods_version =>
            {
                self.metrics.feed_request("snapshot_page");
                let (ops, next) = self.snapshot_page(Some(token), request.cursor, &idx);
                (FeedKind::Page { number, next }, request.cursor, ops)
            }
            None if in_log => {
                let (ops, at) = self.deltas(request.cursor, &idx);
                self.metrics
                    .feed_lag_ops
                    .set(i64::try_from(head - request.cursor).unwrap_or(i64::MAX));
                self.metrics.feed_request("delta");
                (FeedKind::Delta { more: at < head }, at, ops)
            }
            _ => {
                self.metrics.feed_request("snapshot");
                let (ops, next) = self.snapshot_page(None, head, &idx);
                (FeedKind::Page { number: 0, next }, head, ops)
            }
        };
        let first_page = matches!(kind, FeedKind::Page { number: 0, .. });
        let (pods, load) = if first_page || request.pods_version != pods_version {
            (Some(infos), None)
        } else if request.load_version != load_version {
            (
                None,
                Some(infos.iter().map(PodInfo::load).collect::<Vec<PodLoad>>()),
            )
        } else {
            (None, None)
        };
        FeedMessage {
            epoch: self.epoch,
            cursor,
            pods_version,
            load_version,
            kind,
            pods,
            load,
            ops,
        }
    }

    /// Ops after `cursor`, at most `feed_max_hashes` hashes (but at least one
    /// op), and the cursor after them.
    fn deltas(&self, cursor: u64, idx: &Map<PodKey, u32>) -> (Vec<BlockOp>, u64) {
        let mut ops = Vec::new();
        let mut hashes = 0usize;
        let mut at = cursor;
        let skip = usize::try_from(cursor - self.log_start).unwrap_or(usize::MAX);
        for op in self.log.iter().skip(skip) {
            if hashes > 0 && hashes + op.op.hashes() > self.cfg.feed_max_hashes {
                break;
            }
            at += 1;
            let Some(&pod) = idx.get(&op.pod) else {
                continue; // pod gone: absent from the pod list, so dropped by the consumer
            };
            hashes += op.op.hashes();
            ops.push(match &op.op {
                Op::Stored(tier, h) => BlockOp::Stored {
                    pod,
                    tier: *tier,
                    hashes: wire_hashes(h),
                },
                Op::Removed(h) => BlockOp::Removed {
                    pod,
                    hashes: wire_hashes(h),
                },
                Op::Cleared => BlockOp::Cleared { pod },
            });
        }
        (ops, at)
    }

    /// One page of the snapshot from `from` (the start when None): every
    /// (pod, key, best tier) whose index key lies in the page's key range, and
    /// the token of the next range. The range's width is sized from the
    /// entries held so that it carries about 15/16 of `feed_max_hashes`
    /// (keys are hashes, so entries spread evenly over them); a range that
    /// holds more is cut after the last key that fits, and the next page
    /// starts at the first key left. A key is never split: a page carries at
    /// least one key, even when its holders outnumber `feed_max_hashes`.
    /// `since`: the cursor of the snapshot's first page.
    fn snapshot_page(
        &mut self,
        from: Option<PageToken>,
        since: u64,
        idx: &Map<PodKey, u32>,
    ) -> (Vec<BlockOp>, Option<PageToken>) {
        let room = self.cfg.feed_max_hashes.max(1);
        let start = from.map_or(0, |t| t.start).min(KEY_END);
        let entries: usize = self.pods.values().map(|p| p.held.total()).sum();
        let width = match entries {
            0 => KEY_END,
            n => {
                let aim = u128::from(KEY_END) * (room as u128) * 15 / 16 / (n as u128);
                u64::try_from(aim).unwrap_or(KEY_END).max(1)
            }
        };
        let end = start.saturating_add(width).min(KEY_END);
        let head = self.cursor();
        let found = self.blocks.in_key_range(start..end, since, head);
        // Per pod (index into the pod list) and tier, the range's keys.
        let mut runs: Vec<[Vec<u64>; 4]> = vec![Default::default(); idx.len()];
        let holders = |set: SetId| {
            self.blocks
                .set_holders(set)
                .filter_map(|(pod, tier)| Some((*idx.get(&pod)?, tier)))
        };
        let mut sent = 0usize;
        for &(key, set) in &found {
            for (pod, tier) in holders(set) {
                if let Some(run) = runs.get_mut(pod as usize) {
                    run[tier.code() as usize].push(key);
                    sent += 1;
                }
            }
        }
        let mut next = (end < KEY_END).then_some(end);
        if sent > room {
            // Rare (the range aims below the room): cut after the last key that fits.
            let mut by_key = found;
            by_key.sort_unstable_by_key(|&(key, _)| key);
            let mut kept = 0usize;
            let cut = by_key.iter().find_map(|&(key, set)| {
                let n = holders(set).count();
                kept += n;
                (kept > n && kept > room).then_some(key)
            });
            if let Some(cut) = cut {
                for run in runs.iter_mut().flatten() {
                    run.retain(|&key| key < cut);
                }
                next = Some(cut);
            }
        }
        let mut ops = Vec::new();
        for (pod, by_tier) in (0u32..).zip(runs) {
            for (code, mut hashes) in (0u8..).zip(by_tier) {
                if let (false, Some(tier)) = (hashes.is_empty(), Tier::from_code(code)) {
                    hashes.sort_unstable();
                    let hashes = hashes.into_iter().map(IndexKey::new).collect();
                    ops.push(BlockOp::Stored { pod, tier, hashes });
                }
            }
        }
        if next.is_none() {
            self.blocks.forget_key_ranges();
        }
        let next = next.map(|start| PageToken { start, after: None });
        (ops, next)
    }
}

/// The feed carries the index keys of kvroute hashes.
fn wire_hashes(hashes: &[BlockHash]) -> Vec<IndexKey> {
    hashes.iter().map(|h| h.index_key()).collect()
}
