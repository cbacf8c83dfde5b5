//! The pods serving each model in load order (waiting + running, then KV
//! usage): `POST /v1/lookup` takes its least-loaded candidates from the front
//! instead of visiting every pod. Kept in step when a pod comes or goes and
//! when its load or models change.

use std::collections::{BTreeSet, HashMap};
use std::iter::Peekable;

use super::keys::PodKey;

/// Load of a pod, from its `/metrics`.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Load {
    pub capacity_blocks: u32,
    pub waiting: u32,
    pub running: u32,
    pub kv_usage: f32,
}

/// A pod's place in the order: fewer requests queued and running first,
/// then lower KV usage, then the pod key (one place per pod).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) struct LoadRank {
    busy: u32,
    /// `kv_usage` bits mapped so that unsigned order is `f32::total_cmp`'s.
    kv_usage: u32,
    pod: PodKey,
}

impl LoadRank {
    pub(super) fn new(load: &Load, pod: PodKey) -> LoadRank {
        let bits = load.kv_usage.to_bits();
        let kv_usage = if bits >> 31 == 1 {
            !bits
        } else {
            bits | 1 << 31
        };
        LoadRank {
            busy: load.waiting.saturating_add(load.running),
            kv_usage,
            pod,
        }
    }
}

#[derive(Default)]
pub(super) struct LeastLoaded {
    by_model: HashMap<String, BTreeSet<LoadRank>>,
    /// Pods that name no model: they serve every model.
    any_model: BTreeSet<LoadRank>,
}

impl LeastLoaded {
    pub(super) fn insert(&mut self, models: &[String], rank: LoadRank) {
        if models.is_empty() {
            self.any_model.insert(rank);
        }
        for model in models {
            self.by_model.entry(model.clone()).or_default().insert(rank);
        }
    }

    pub(super) fn remove(&mut self, models: &[String], rank: LoadRank) {
        if models.is_empty() {
            self.any_model.remove(&rank);
        }
        for model in models {
            if let Some(ranks) = self.by_model.get_mut(model.as_str()) {
                ranks.remove(&rank);
                if ranks.is_empty() {
                    self.by_model.remove(model.as_str());
                }
            }
        }
    }

    /// Keys of the pods serving `model`, least loaded first: the pods naming
    /// it merged with those naming none.
    pub(super) fn serving<'a>(&'a self, model: &str) -> impl Iterator<Item = PodKey> + 'a {
        Merge {
            a: self.by_model.get(model).into_iter().flatten().peekable(),
            b: self.any_model.iter().peekable(),
        }
        .map(|rank| rank.pod)
    }
}

/// Two ascending iterators as one.
struct Merge<A: Iterator, B: Iterator> {
    a: Peekable<A>,
    b: Peekable<B>,
}

impl<'a, A, B> Iterator for Merge<A, B>
where
    A: Iterator<Item = &'a LoadRank>,
    B: Iterator<Item = &'a LoadRank>,
{
    type Item = &'a LoadRank;

    fn next(&mut self) -> Option<&'a LoadRank> {
        match (self.a.peek(), self.b.peek()) {
            (Some(a), Some(b)) if b < a => self.b.next(),
            (Some(_), _) => self.a.next(),
            (None, _) => self.b.next(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(load: Load, pod: u64) -> LoadRank {
        LoadRank::new(&load, PodKey::new(pod))
    }

    fn keys(order: &LeastLoaded, model: &str) -> Vec<u64> {
        order.serving(model).map(PodKey::get).collect()
    }

    fn load(waiting: u32, running: u32, kv_usage: f32) -> Load {
        Load {
            waiting,
            running,
            kv_usage,
            ..Load::default()
        }
    }

    #[test]
    fn orders_by_requests_then_kv_usage_and_merges_pods_of_every_model() {
        let mut order = LeastLoaded::default();
        let m = |names: &[&str]| names.iter().map(|s| s.to_string()).collect::<Vec<_>>();
        order.insert(&m(&["a"]), rank(load(1, 1, 0.1), 1));
        order.insert(&m(&["a", "b"]), rank(load(0, 1, 0.9), 2));
        order.insert(&m(&[]), rank(load(0, 1, 0.5), 3));
        order.insert(&m(&["b"]), rank(load(0, 0, 0.0), 4));
        order.insert(&m(&[]), rank(load(5, 0, -0.0), 5));
        assert_eq!(keys(&order, "a"), [3, 2, 1, 5]);
        assert_eq!(keys(&order, "b"), [4, 3, 2, 5]);
        assert_eq!(keys(&order, "c"), [3, 5]);
        order.remove(&m(&["a", "b"]), rank(load(0, 1, 0.9), 2));
        order.remove(&m(&[]), rank(load(0, 1, 0.5), 3));
        assert_eq!(keys(&order, "a"), [1, 5]);
        order.remove(&m(&["a"]), rank(load(1, 1, 0.1), 1));
        assert!(!order.by_model.contains_key("a"), "an empty model goes");
        // KV usage orders as f32::total_cmp does, negative values included.
        let ranks: Vec<LoadRank> = [0.5f32, -1.0, 0.0, -0.0, 1.0]
            .iter()
            .map(|&k| rank(load(0, 0, k), 0))
            .collect();
        let mut sorted = ranks.clone();
        sorted.sort();
        let mut expected = [0.5f32, -1.0, 0.0, -0.0, 1.0];
        expected.sort_by(f32::total_cmp);
        let want: Vec<LoadRank> = expected.iter().map(|&k| rank(load(0, 0, k), 0)).collect();
        assert_eq!(sorted, want);
    }
}
