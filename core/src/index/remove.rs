//! Removals: blocks a pod evicted, and learned entries a refusal takes back.

use super::bucket::{key_of, slot_of, slot_set};
use super::member::is_precise;
use super::{BlockIndex, Member, PodId, Tier};
use crate::hash::IndexKey;

impl BlockIndex {
    /// Forgets blocks of `pod` (vLLM evicted them), any tier.
    pub fn remove<K: Copy + Into<IndexKey>>(&mut self, pod: PodId, hashes: &[K]) {
        self.remove_where(pod, hashes, |_| true);
    }

    /// Forgets the learned entries of `pod` among `hashes` (a request the pod
    /// refused taught them); its precise entries stay.
    pub fn remove_learned<K: Copy + Into<IndexKey>>(&mut self, pod: PodId, hashes: &[K]) {
        self.remove_where(pod, hashes, |tier| !is_precise(tier));
    }

    fn remove_where<K: Copy + Into<IndexKey>>(
        &mut self,
        pod: PodId,
        hashes: &[K],
        applies: impl Fn(Tier) -> bool,
    ) {
        for &hash in hashes {
            self.remove_key(pod, key_of(hash.into()), &applies);
        }
    }

    /// Forgets `pod`'s entry under slot key `key` if its tier `applies`.
    pub(super) fn remove_key(&mut self, pod: PodId, key: u64, applies: impl Fn(Tier) -> bool) {
        // Removals carry no clock: members expired by the newest write go too.
        let epoch = self.latest_epoch;
        let b = self.bucket_of(key);
        self.load(b);
        let Ok(i) = self.buckets[b].find(key) else {
            return;
        };
        let old = slot_set(self.buckets[b].slots[i]);
        let members = self.sets.get(old);
        if !members.iter().any(|m| m.pod() == pod && applies(m.tier())) {
            return;
        }
        let rest: Vec<Member> = members
            .iter()
            .copied()
            .filter(|&m| m.pod() != pod && self.is_current(m, epoch))
            .collect();
        self.touched(b);
        if rest.is_empty() {
            self.buckets[b].delete_at(i);
            self.blocks -= 1;
            self.sets.release(old);
            return;
        }
        match self.sets.intern(&rest) {
            Some(new) => {
                let bucket = &mut self.buckets[b];
                bucket.slots[i] = slot_of(key, new);
                self.sets.release(old);
            }
            // No room for the smaller set: forget the block for every pod
            // rather than keep claiming it for this one.
            None => {
                self.buckets[b].delete_at(i);
                self.blocks -= 1;
                self.sets.release(old);
                self.dropped += 1;
            }
        }
    }
}
