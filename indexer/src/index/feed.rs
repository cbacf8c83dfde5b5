//! `GET /v1/feed`: deltas from the log, a snapshot in pages, and the pod list
//! or the load only when the consumer's version of it is stale (wire format:
//! `kvroute_core::feed`; the consumer: `kvroute_core::feed_client`).
//!
//! Pages: the pods in key order, each pod's entries whole while they fit the
//! page's `feed_max_hashes`; a pod that does not fit is cut in ascending hash
//! order, and the page token (pod key, last hash sent) resumes it. A pod's
//! entries are gathered from the records its sources and learned entries
//! refer to, not by a pass over the whole block map (which made paging a
//! 1,000-pod snapshot cost pages × map). Pages are
//! read from the live state, each at its own moment: the consumer then
//! replays the deltas from the cursor of the first page, which brings every
//! (pod, hash) to its latest state whatever page it came in.

use std::collections::HashMap;

use kvroute_core::feed::{self, BlockOp, FeedKind, FeedMessage, PageToken, PodInfo, PodLoad, Tier};
use kvroute_core::feed_client::FeedRequest;

use super::blocks::BlockId;
use super::feed_log::Op;
use super::keys::{BlockHash, PodKey};
use super::pods::Pod;
use super::sources::SourceEntry;
use super::Index;

impl Index {
    fn pod_infos(&self) -> (Vec<PodInfo>, HashMap<PodKey, u32>) {
        let mut infos = Vec::with_capacity(self.pods.len());
        let mut idx = HashMap::with_capacity(self.pods.len());
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
    pub fn feed(&self, request: &FeedRequest) -> FeedMessage {
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
                let (ops, next) = self.snapshot_page(Some(token), &idx);
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
                let (ops, next) = self.snapshot_page(None, &idx);
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
    fn deltas(&self, cursor: u64, idx: &HashMap<PodKey, u32>) -> (Vec<BlockOp>, u64) {
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

    /// One page of the snapshot from `from` (the start when None): at most
    /// `feed_max_hashes` entries, and the token of the next page.
    fn snapshot_page(
        &self,
        from: Option<PageToken>,
        idx: &HashMap<PodKey, u32>,
    ) -> (Vec<BlockOp>, Option<PageToken>) {
        let room = self.cfg.feed_max_hashes.max(1);
        let after_of = |key: PodKey| {
            from.filter(|t| t.pod == key.get())
                .and_then(|t| t.after)
                .map(BlockHash::new)
        };
        // The pods this page may cover: in key order until their entry counts
        // (an upper bound for a pod resumed part-way) fill the page.
        let mut order = Vec::new();
        let mut counted = 0usize;
        // The first pod left for the next page.
        let mut beyond = None;
        let first = PodKey::new(from.map_or(0, |t| t.pod));
        for (&key, p) in self.pods.range(first..) {
            let held = p.held.total();
            if held == 0 || !idx.contains_key(&key) {
                continue;
            }
            if counted >= room {
                beyond = Some(key);
                break;
            }
            counted += held;
            order.push(key);
        }
        let mut left = room;
        let mut ops = Vec::new();
        for key in order {
            let (Some(&pod), Some(p)) = (idx.get(&key), self.pods.get(&key)) else {
                continue;
            };
            let mut entries = self.pod_entries(key, p, after_of(key));
            if entries.is_empty() {
                continue;
            }
            if left == 0 {
                return (
                    ops,
                    Some(PageToken {
                        pod: key.get(),
                        after: after_of(key).map(BlockHash::get),
                    }),
                );
            }
            let mut next = None;
            if entries.len() > left {
                // Cut in hash order, so that the rest is "every hash above the last sent".
                entries.sort_unstable_by_key(|e| e.0);
                entries.truncate(left);
                next = entries.last().map(|e| PageToken {
                    pod: key.get(),
                    after: Some(e.0.get()),
                });
            }
            left -= entries.len();
            let mut by_tier: [Vec<u64>; 4] = Default::default();
            for (h, t) in entries {
                by_tier[t.code() as usize].push(h.get());
            }
            for (code, hashes) in (0u8..).zip(by_tier) {
                if let (false, Some(tier)) = (hashes.is_empty(), Tier::from_code(code)) {
                    ops.push(BlockOp::Stored { pod, tier, hashes });
                }
            }
            if next.is_some() {
                return (ops, next);
            }
        }
        let next = beyond.map(|pod| PageToken {
            pod: pod.get(),
            after: None,
        });
        (ops, next)
    }

    /// A pod's (kvroute hash, best tier) entries in the block map with a
    /// hash above `after`: found from the records its sources and learned
    /// entries refer to, so a page costs its pods' entries, not the map.
    fn pod_entries(
        &self,
        key: PodKey,
        pod: &Pod,
        after: Option<BlockHash>,
    ) -> Vec<(BlockHash, Tier)> {
        let mut ids: Vec<BlockId> = Vec::with_capacity(pod.held.total());
        for group in pod.sources.values().flat_map(|s| s.groups.values()) {
            ids.extend(group.blocks.iter().map(SourceEntry::block));
            ids.extend(group.heads.values().flatten());
        }
        ids.extend(pod.learned.keys().filter_map(|&kv| self.blocks.find(kv)));
        // A record can be referred to by several ranks, groups or a learned entry.
        ids.sort_unstable();
        ids.dedup();
        ids.into_iter()
            .filter_map(|id| {
                let kv = self.blocks.kv(id);
                if after.is_some_and(|a| kv <= a) {
                    return None;
                }
                Some((kv, self.blocks.tier_on(id, key)?))
            })
            .collect()
    }
}

/// The feed carries kvroute hashes as u64.
fn wire_hashes(hashes: &[BlockHash]) -> Vec<u64> {
    hashes.iter().map(|h| h.get()).collect()
}
