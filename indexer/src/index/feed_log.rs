//! The feed delta log: ops collected per message, retained up to
//! `feed_log_hashes`, and `Index::feed` (deltas after a cursor, or a snapshot).

use std::collections::HashMap;

use kvroute_core::feed::{BlockOp, FeedUpdate, PodInfo, Tier};

use super::Index;

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Op {
    Stored(Tier, Vec<u64>),
    Removed(Vec<u64>),
    Cleared,
}

impl Op {
    fn hashes(&self) -> usize {
        match self {
            Op::Stored(_, h) | Op::Removed(h) => h.len(),
            Op::Cleared => 0,
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct LogOp {
    pod: u64,
    op: Op,
}

/// Collects ops, merging consecutive ones of the same pod, kind and tier.
#[derive(Default)]
pub(super) struct Sink {
    ops: Vec<LogOp>,
}

impl Sink {
    pub(super) fn stored(&mut self, pod: u64, tier: Tier, h: u64) {
        if let Some(LogOp {
            pod: p,
            op: Op::Stored(t, hs),
        }) = self.ops.last_mut()
        {
            if *p == pod && *t == tier {
                hs.push(h);
                return;
            }
        }
        self.ops.push(LogOp {
            pod,
            op: Op::Stored(tier, vec![h]),
        });
    }

    pub(super) fn removed(&mut self, pod: u64, h: u64) {
        if let Some(LogOp {
            pod: p,
            op: Op::Removed(hs),
        }) = self.ops.last_mut()
        {
            if *p == pod {
                hs.push(h);
                return;
            }
        }
        self.ops.push(LogOp {
            pod,
            op: Op::Removed(vec![h]),
        });
    }

    pub(super) fn cleared(&mut self, pod: u64) {
        // Earlier ops of the pod in this batch are moot.
        self.ops.retain(|o| o.pod != pod);
        self.ops.push(LogOp {
            pod,
            op: Op::Cleared,
        });
    }
}

impl Index {
    pub(super) fn commit(&mut self, sink: Sink) {
        for op in sink.ops {
            self.log_hashes += op.op.hashes();
            self.log.push_back(op);
        }
        while self.log_hashes > self.cfg.feed_log_hashes {
            let Some(old) = self.log.pop_front() else {
                break;
            };
            self.log_hashes -= old.op.hashes();
            self.log_start += 1;
        }
    }

    fn pod_infos(&self) -> (Vec<PodInfo>, HashMap<u64, u32>) {
        let mut infos = Vec::with_capacity(self.pods.len());
        let mut idx = HashMap::with_capacity(self.pods.len());
        for (i, (k, p)) in self.pods.iter().enumerate() {
            idx.insert(*k, i as u32);
            infos.push(PodInfo {
                address: p.address.clone(),
                models: p.models.clone(),
                capacity_blocks: p.load.capacity_blocks,
                waiting: p.load.waiting,
                running: p.load.running,
                kv_usage: p.load.kv_usage,
            });
        }
        (infos, idx)
    }

    /// The answer to `GET /v1/feed?epoch=&cursor=`: deltas after `cursor`
    /// when it is in the retained log of this epoch, else a snapshot.
    pub fn feed(&self, epoch: u64, cursor: u64) -> FeedUpdate {
        let (pods, idx) = self.pod_infos();
        let head = self.cursor();
        if epoch == self.epoch && cursor >= self.log_start && cursor <= head {
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
                    continue; // pod gone: absent from `pods`, so dropped by the consumer
                };
                hashes += op.op.hashes();
                ops.push(match &op.op {
                    Op::Stored(t, h) => BlockOp::Stored {
                        pod,
                        tier: *t,
                        hashes: h.clone(),
                    },
                    Op::Removed(h) => BlockOp::Removed {
                        pod,
                        hashes: h.clone(),
                    },
                    Op::Cleared => BlockOp::Cleared { pod },
                });
            }
            self.metrics
                .feed_lag_ops
                .set(i64::try_from(head - cursor).unwrap_or(i64::MAX));
            self.metrics.feed_request("delta");
            return FeedUpdate {
                epoch: self.epoch,
                cursor: at,
                snapshot: false,
                pods,
                ops,
            };
        }
        self.metrics.feed_request("snapshot");
        FeedUpdate {
            epoch: self.epoch,
            cursor: head,
            snapshot: true,
            pods,
            ops: self.snapshot_ops(&idx),
        }
    }

    fn snapshot_ops(&self, idx: &HashMap<u64, u32>) -> Vec<BlockOp> {
        // Per pod (in `idx` order) and tier, the hashes whose best tier it is.
        let mut by_pod: Vec<[Vec<u64>; 4]> = vec![Default::default(); idx.len()];
        self.blocks.for_each_held(|kv, pod, tier| {
            if let Some(tiers) = idx.get(&pod).and_then(|&i| by_pod.get_mut(i as usize)) {
                tiers[tier.code() as usize].push(kv);
            }
        });
        let mut ops = Vec::new();
        for (pod, by_tier) in by_pod.into_iter().enumerate() {
            for (i, hashes) in by_tier.into_iter().enumerate() {
                if hashes.is_empty() {
                    continue;
                }
                if let Some(tier) = Tier::from_code(i as u8) {
                    let pod = pod as u32;
                    ops.push(BlockOp::Stored { pod, tier, hashes });
                }
            }
        }
        ops
    }
}
