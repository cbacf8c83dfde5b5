//! Interned, reference-counted pod sets: a block's holders are stored once
//! per distinct set, whatever the number of blocks that share it.

use super::bucket::REF_MASK;
use super::member::{is_precise, Member};
use super::published;
use crate::hash::splitmix64;
use hashbrown::HashTable;

/// Accounted bytes of one interned set besides its members (its entry in the
/// member, reference and lookup tables).
const SET_OVERHEAD: usize = std::mem::size_of::<Box<[Member]>>() + 1 + 4 + 8;

/// Interned pod sets (members sorted by pod, one member per pod).
#[derive(Debug, Clone, Default)]
pub(super) struct PodSets {
    members: Vec<Box<[Member]>>,
    /// Per set: some member is a pod's own report (eviction spares it longer).
    precise: Vec<bool>,
    refs: Vec<u32>,
    lookup: HashTable<u32>,
    free: Vec<u32>,
    bytes: usize,
    budget: usize,
    /// Sets interned since the last publication (a set id is written once
    /// when interned: its members never change; a released id is rewritten
    /// when reused).
    fresh: Vec<u32>,
}

fn hash_members(members: &[Member]) -> u64 {
    members
        .iter()
        .fold(0x243f_6a88_85a3_08d3, |h, m| splitmix64(h ^ m.bits()))
}

fn set_cost(members: usize) -> usize {
    SET_OVERHEAD + members * std::mem::size_of::<Member>()
}

impl PodSets {
    /// No sets, within `budget` bytes.
    pub(super) fn with_budget(budget: usize) -> PodSets {
        PodSets {
            budget,
            ..PodSets::default()
        }
    }

    pub(super) fn get(&self, id: u32) -> &[Member] {
        self.members.get(id as usize).map_or(&[], |m| m)
    }

    /// A reference to the set `members` (non-empty, sorted by pod), or `None`
    /// when it would take the sets past their budget.
    pub(super) fn intern(&mut self, members: &[Member]) -> Option<u32> {
        let hash = hash_members(members);
        let all = &self.members;
        if let Some(&id) = self.lookup.find(hash, |&id| *all[id as usize] == *members) {
            self.refs[id as usize] += 1;
            return Some(id);
        }
        let cost = set_cost(members.len());
        if self.bytes + cost > self.budget {
            return None;
        }
        let precise = members.iter().any(|m| is_precise(m.tier()));
        let id = match self.free.pop() {
            Some(id) => {
                self.members[id as usize] = members.into();
                self.precise[id as usize] = precise;
                self.refs[id as usize] = 1;
                id
            }
            None => {
                if self.members.len() > REF_MASK as usize {
                    return None;
                }
                self.members.push(members.into());
                self.precise.push(precise);
                self.refs.push(1);
                (self.members.len() - 1) as u32
            }
        };
        self.bytes += cost;
        self.fresh.push(id);
        let all = &self.members;
        self.lookup
            .insert_unique(hash, id, |&i| hash_members(&all[i as usize]));
        Some(id)
    }

    /// The chunks of the sets interned since the last publication, each once.
    pub(super) fn fresh_chunks(&mut self) -> Vec<u32> {
        let mut chunks: Vec<u32> = self
            .fresh
            .drain(..)
            .map(|id| id / published::SETS_PER_CHUNK)
            .collect();
        chunks.sort_unstable();
        chunks.dedup();
        chunks
    }

    /// Queues `chunks` (from [`PodSets::fresh_chunks`]) for the next
    /// publication again: their writes did not land.
    pub(super) fn requeue_chunks(&mut self, chunks: &[u32]) {
        self.fresh
            .extend(chunks.iter().map(|c| c * published::SETS_PER_CHUNK));
    }

    /// True when `id` names an interned set (some slot holds a reference).
    pub(super) fn is_live(&self, id: u32) -> bool {
        self.refs.get(id as usize).is_some_and(|&refs| refs > 0)
    }

    pub(super) fn has_precise(&self, id: u32) -> bool {
        self.precise.get(id as usize).copied().unwrap_or(false)
    }

    pub(super) fn retain(&mut self, id: u32) {
        self.refs[id as usize] += 1;
    }

    /// Drops one reference; true when the set is gone (its id may be reused).
    pub(super) fn release(&mut self, id: u32) -> bool {
        let refs = &mut self.refs[id as usize];
        *refs -= 1;
        if *refs > 0 {
            return false;
        }
        let members = std::mem::take(&mut self.members[id as usize]);
        let hash = hash_members(&members);
        if let Ok(entry) = self.lookup.find_entry(hash, |&i| i == id) {
            entry.remove();
        }
        self.bytes -= set_cost(members.len());
        self.free.push(id);
        true
    }

    pub(super) fn memory_bytes(&self) -> usize {
        self.bytes
    }

    pub(super) fn len(&self) -> usize {
        self.members.len() - self.free.len()
    }
}
