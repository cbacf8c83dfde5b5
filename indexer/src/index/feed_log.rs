//! The feed delta log: ops collected per message, retained up to
//! `feed_log_hashes` (served by `Index::feed`, in `feed`).

use kvroute_core::feed::Tier;

use super::keys::{BlockHash, PodKey};
use super::Index;

#[derive(Debug, Clone, PartialEq)]
pub(super) enum Op {
    Stored(Tier, Vec<BlockHash>),
    Removed(Vec<BlockHash>),
    Cleared,
}

impl Op {
    pub(super) fn hashes(&self) -> usize {
        match self {
            Op::Stored(_, h) | Op::Removed(h) => h.len(),
            Op::Cleared => 0,
        }
    }
}

#[derive(Debug, Clone)]
pub(super) struct LogOp {
    pub(super) pod: PodKey,
    pub(super) op: Op,
}

/// Collects ops, merging consecutive ones of the same pod, kind and tier.
#[derive(Default)]
pub(super) struct Sink {
    ops: Vec<LogOp>,
}

impl Sink {
    pub(super) fn stored(&mut self, pod: PodKey, tier: Tier, h: BlockHash) {
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

    pub(super) fn removed(&mut self, pod: PodKey, h: BlockHash) {
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

    pub(super) fn cleared(&mut self, pod: PodKey) {
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
}
