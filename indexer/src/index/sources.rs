//! A publisher's blocks: BlockStored (re-hashed with kvroute's chained
//! hash), placeholders, BlockRemoved and AllBlocksCleared, applied to its
//! KV-cache groups and, through them, to the pod's block map.

use kvroute_core::feed::Tier;
use kvroute_core::hash::{
    extra_keys_digest, keyed_token_block_hashes, root_hash, Domain, ExtraKey,
};

use crate::vllm_wire::{BlockRemoved, BlockStored, EventBatch, KvEvent, Medium};

use super::block_table::BlockId;
use super::blocks::{adjust_block, tier_bit, Blocks, Held};
use super::feed_log::Sink;
use super::hashing::{map_bytes, Map};
use super::keys::{BlockHash, PodKey, VllmHash};
use super::source_table::{Fingerprint, SourceEntry, SourceTable};
use super::Index;

/// KV-cache spec kinds whose blocks hold the prompt's whole prefix, so a hit
/// means the pod can skip that prefill. Sliding-window and mamba groups keep
/// only a window or a state: not routed on. No kind (vLLM before hybrid
/// groups, or a plain model): full attention.
pub(super) fn routed_spec_kind(kind: Option<&str>) -> bool {
    matches!(
        kind,
        None | Some("full_attention" | "mla_attention" | "sink_full_attention")
    )
}

/// The blocks of one KV-cache group of a publisher. Hybrid models store
/// each block once per group under the same vLLM hash, and each group evicts
/// on its own.
#[derive(Default)]
pub(super) struct Group {
    /// vLLM hash (its fingerprint) → entry.
    pub(super) blocks: SourceTable,
    /// vLLM hash (its fingerprint) → records of the parts before the entry's
    /// `block`, for blocks of a multiple of the configured block size (kept
    /// apart so the common entry stays small).
    pub(super) heads: Map<Fingerprint, Box<[BlockId]>>,
}

impl Group {
    /// A group whose table has room for `blocks` before it grows.
    fn with_room_for(blocks: usize) -> Group {
        Group {
            blocks: SourceTable::with_room_for(blocks),
            heads: Map::default(),
        }
    }

    pub(super) fn memory_bytes(&self) -> usize {
        self.blocks.memory_bytes()
            + map_bytes(&self.heads)
            + self
                .heads
                .values()
                .map(|h| std::mem::size_of_val::<[BlockId]>(h))
                .sum::<usize>()
    }

    /// Takes every block out of the group and the block map.
    pub(super) fn drain_into(
        &mut self,
        blocks: &mut Blocks,
        sink: &mut Sink,
        held: &mut Held,
        pod: PodKey,
    ) -> usize {
        let drained = self.blocks.len();
        for entry in self.blocks.take_all() {
            let head = self.heads.remove(&entry.fp());
            drop_block(blocks, sink, held, pod, entry, head.as_deref());
        }
        drained
    }
}

/// The records of a vLLM block's kvroute parts (head, as `kvroute_core::hash`
/// computed them, and last), added to the block map when new; `None` when it
/// holds [`MAX_BLOCKS`] already.
fn acquire_parts(
    blocks: &mut Blocks,
    kv: BlockHash,
    head: Option<&[BlockHash]>,
) -> Option<(BlockId, Option<Box<[BlockId]>>)> {
    let head = match head {
        Some(h) => Some(
            h.iter()
                .map(|&part| blocks.acquire(part))
                .collect::<Option<Box<[BlockId]>>>()?,
        ),
        None => None,
    };
    Some((blocks.acquire(kv)?, head))
}

/// Drops every tier count a block holds.
pub(super) fn drop_block(
    blocks: &mut Blocks,
    sink: &mut Sink,
    held: &mut Held,
    pod: PodKey,
    entry: SourceEntry,
    head: Option<&[BlockId]>,
) {
    for t in [Tier::Gpu, Tier::Cpu, Tier::Disk] {
        if entry.has(tier_bit(t)) {
            adjust_block(blocks, sink, held, pod, entry.block(), head, t, false);
        }
    }
}

/// A block's extra keys without the LoRA adapter, which vLLM lists first and
/// kvroute already has in the chain's root.
/// The kvroute hash a stored chain without a parent starts from: the model's,
/// scoped by the LoRA adapter the event names.
fn chain_root(e: &BlockStored, model: &str) -> BlockHash {
    match (&e.lora_name, e.lora_id) {
        (Some(name), _) => root_hash(Domain::Tokens, model, Some(name)),
        // Older vLLM names no adapter, only its id: scope the chain by the id
        // so that it can never pass for the base model's blocks.
        (None, Some(id)) => root_hash(Domain::Tokens, model, Some(&format!("#lora-id:{id}"))),
        (None, None) => root_hash(Domain::Tokens, model, None),
    }
}

/// The digest of each kvroute block's extra keys, for `n` vLLM blocks of
/// `span` kvroute blocks each: a vLLM block's keys belong to its first
/// kvroute block. Empty when the event carries none.
fn extra_key_digests(e: &BlockStored, n: usize, span: usize) -> Vec<Option<u64>> {
    let mut extra = Vec::new();
    if let Some(keys) = &e.extra_keys {
        extra.resize(n * span, None);
        for (i, block_keys) in keys.iter().take(n).enumerate() {
            if let Some(block_keys) = block_keys {
                extra[i * span] = extra_keys_digest(without_lora(block_keys, e));
            }
        }
    }
    extra
}

pub(super) fn without_lora<'a>(keys: &'a [ExtraKey], e: &BlockStored) -> &'a [ExtraKey] {
    let is_lora = match (keys.first(), &e.lora_name, e.lora_id) {
        (Some(ExtraKey::Str(k)), Some(name), _) => k == name,
        (Some(ExtraKey::Int(k)), None, Some(id)) => *k == i128::from(id),
        _ => false,
    };
    if is_lora {
        &keys[1..]
    } else {
        keys
    }
}

impl Index {
    pub(super) fn apply_batch(
        &mut self,
        key: PodKey,
        rank: i64,
        batch: &EventBatch,
        sink: &mut Sink,
    ) {
        for ev in &batch.events {
            match ev {
                KvEvent::BlockStored(e) => {
                    self.metrics.event("BlockStored");
                    if e.is_placeholder() {
                        self.placeholder(key, rank, e, sink);
                    } else {
                        self.stored(key, rank, e, sink);
                    }
                }
                KvEvent::BlockRemoved(e) => {
                    self.metrics.event("BlockRemoved");
                    self.removed(key, rank, e, sink);
                }
                KvEvent::AllBlocksCleared => {
                    self.metrics.event("AllBlocksCleared");
                    self.clear_source_into(key, rank, sink);
                }
                KvEvent::Unknown { .. } => self.metrics.event("Unknown"),
            }
        }
    }

    /// kvroute blocks per vLLM block of `block_size` tokens, `None` when
    /// that size cannot be re-hashed into the filters' blocks.
    fn span(&self, block_size: u32) -> Option<usize> {
        match self.cfg.block_size {
            _ if block_size == 0 => None,
            0 => Some(1),
            b if block_size % b == 0 => Some((block_size / b) as usize),
            _ => None,
        }
    }

    /// Grows the block table when it is full enough, and rewrites the record
    /// ids the pods' source entries and head parts hold (growing renumbers
    /// the records). Called before anything that adds records.
    ///
    /// A growth makes room at once for what the pods report they can hold
    /// (each pod's KV capacity, at most `max_blocks_per_pod`), unless
    /// `grow_on_demand`: every growth rewrites every id the pods hold, so
    /// filling an index by eighths costs ~9 such passes per record (issue
    /// 10's fill rate), and the last one briefly holds two arrays.
    pub(super) fn make_block_room(&mut self) {
        let (pods, cfg) = (&self.pods, &self.cfg);
        let expected = || match cfg.grow_on_demand {
            true => 0,
            false => pods
                .values()
                .map(|p| (p.load.capacity_blocks as usize).min(cfg.max_blocks_per_pod))
                .sum(),
        };
        let Some(new_ids) = self.blocks.grow_if_full(expected) else {
            return;
        };
        let new_id = |id: BlockId| new_ids.get(id as usize).copied().unwrap_or(BlockId::MAX);
        let groups = self
            .pods
            .values_mut()
            .flat_map(|p| p.sources.values_mut())
            .flat_map(|s| s.groups.values_mut());
        for group in groups {
            group.blocks.remap_blocks(new_id);
            for id in group.heads.values_mut().flat_map(|h| h.iter_mut()) {
                *id = new_id(*id);
            }
        }
    }

    fn stored(&mut self, key: PodKey, rank: i64, e: &BlockStored, sink: &mut Sink) {
        self.make_block_room();
        let group_idx = e.group_idx.unwrap_or(0);
        let span = self.span(e.block_size);
        let Some(pod) = self.pods.get_mut(&key) else {
            return;
        };
        let source = pod.sources.entry(rank).or_default();
        let unrouted_at = source.unrouted_groups.iter().position(|g| *g == group_idx);
        if !routed_spec_kind(e.kv_cache_spec_kind.as_deref()) {
            if unrouted_at.is_none() {
                source.unrouted_groups.push(group_idx);
            }
            self.metrics
                .blocks_not_routed
                .inc_by(e.block_hashes.len() as u64);
            return;
        }
        // A group's kind changes only when the pod restarts with another model.
        if let Some(i) = unrouted_at {
            source.unrouted_groups.swap_remove(i);
        }
        let Some(span) = span else {
            self.metrics.stored_block_size_mismatch.inc();
            return;
        };
        let model = match pod.models.first().or(self.cfg.default_model.as_ref()) {
            Some(m) => m,
            None => {
                self.metrics.rejected("no_model");
                return;
            }
        };
        let n = e.block_hashes.len();
        let bs = e.block_size as usize;
        let Some(need) = n.checked_mul(bs).filter(|&need| need <= e.token_ids.len()) else {
            self.metrics.stored_token_mismatch.inc();
            return;
        };
        // The pod's first table is sized for what the pod reports it can
        // hold (as the block table is): growing by quarters from empty moved
        // each entry ~5 times while a pod filled. Further ranks' and groups'
        // tables grow on demand (the reported capacity is the pod's total).
        let room = match self.cfg.grow_on_demand {
            false if pod.sources.values().all(|s| s.groups.is_empty()) => {
                (pod.load.capacity_blocks as usize).min(self.cfg.max_blocks_per_pod)
            }
            _ => 0,
        };
        let group = pod
            .sources
            .entry(rank)
            .or_default()
            .groups
            .entry(group_idx)
            .or_insert_with(|| Group::with_room_for(room));
        let parent_kv = match e.parent_block_hash {
            None => chain_root(e, model),
            Some(p) => match group.blocks.get(Fingerprint::of(VllmHash::new(p))) {
                Some(entry) => self.blocks.kv(entry.block()),
                None => {
                    self.metrics.stored_unknown_parent.inc();
                    return;
                }
            },
        };
        let extra = extra_key_digests(e, n, span);
        let kvs =
            keyed_token_block_hashes(parent_kv, &e.token_ids[..need], bs / span, n * span, &extra);
        let tier = Medium::tier(e.medium.as_ref());
        let bit = tier_bit(tier);
        let blocks = &mut self.blocks;
        let held = &mut pod.held;
        let mut applied = 0u64;
        let vhs = e.block_hashes.iter().map(|&h| VllmHash::new(h));
        // Every probe of the event announced first: the misses overlap.
        for (vh, parts) in vhs.clone().zip(kvs.chunks_exact(span)) {
            group.blocks.prefetch(Fingerprint::of(vh));
            if let Some(&kv) = parts.last() {
                blocks.prefetch(kv);
            }
        }
        for (vh, parts) in vhs.zip(kvs.chunks_exact(span)) {
            let Some((&kv, head)) = parts.split_last() else {
                continue;
            };
            let head = (!head.is_empty()).then_some(head);
            let fp = Fingerprint::of(vh);
            match group.blocks.find(fp) {
                Some(slot) => {
                    let Some(mut entry) = group.blocks.at(slot) else {
                        continue;
                    };
                    if blocks.kv(entry.block()) != kv {
                        // Same vLLM hash (or fingerprint), other content (e.g. other
                        // LoRA scope): replace. The old block goes first: its records
                        // may be freed.
                        let old = group.heads.remove(&fp);
                        drop_block(blocks, sink, held, key, entry, old.as_deref());
                        let Some((id, head_ids)) = acquire_parts(blocks, kv, head) else {
                            group.blocks.remove_at(slot);
                            pod.source_blocks = pod.source_blocks.saturating_sub(1);
                            self.metrics.blocks_refused_capacity.inc();
                            break;
                        };
                        entry = SourceEntry::new(fp, id, 0);
                        if let Some(head_ids) = head_ids {
                            group.heads.insert(fp, head_ids);
                        }
                    }
                    if !entry.has(bit) {
                        entry.add(bit);
                        let head_ids = group.heads.get(&fp).map(|h| &h[..]);
                        let id = entry.block();
                        adjust_block(blocks, sink, held, key, id, head_ids, tier, true);
                    }
                    group.blocks.set(slot, entry);
                }
                None => {
                    if pod.source_blocks >= self.cfg.max_blocks_per_pod {
                        self.metrics.blocks_refused_capacity.inc();
                        break;
                    }
                    let Some((id, head_ids)) = acquire_parts(blocks, kv, head) else {
                        self.metrics.blocks_refused_capacity.inc();
                        break;
                    };
                    group.blocks.insert(SourceEntry::new(fp, id, bit));
                    pod.source_blocks += 1;
                    adjust_block(blocks, sink, held, key, id, head_ids.as_deref(), tier, true);
                    if let Some(head_ids) = head_ids {
                        group.heads.insert(fp, head_ids);
                    }
                }
            }
            applied += 1;
        }
        self.metrics.blocks_stored.inc_by(applied);
    }

    /// A CPU-offload placeholder names blocks by hash only: they now also
    /// reside in its medium. Blocks this publisher never stored with tokens
    /// cannot be re-hashed, so they are counted and skipped.
    fn placeholder(&mut self, key: PodKey, rank: i64, e: &BlockStored, sink: &mut Sink) {
        let Some(pod) = self.pods.get_mut(&key) else {
            return;
        };
        let group = pod
            .sources
            .get_mut(&rank)
            .and_then(|s| s.groups.get_mut(&e.group_idx.unwrap_or(0)));
        let Some(group) = group else {
            self.metrics
                .placeholder_blocks("unknown", e.block_hashes.len() as u64);
            return;
        };
        let tier = Medium::tier(e.medium.as_ref());
        let bit = tier_bit(tier);
        let (mut applied, mut unknown) = (0, 0);
        for fp in e
            .block_hashes
            .iter()
            .map(|&h| Fingerprint::of(VllmHash::new(h)))
        {
            let Some((slot, mut entry)) = group
                .blocks
                .find(fp)
                .and_then(|slot| Some((slot, group.blocks.at(slot)?)))
            else {
                unknown += 1;
                continue;
            };
            if !entry.has(bit) {
                entry.add(bit);
                group.blocks.set(slot, entry);
                let head = group.heads.get(&fp).map(|h| &h[..]);
                let id = entry.block();
                adjust_block(
                    &mut self.blocks,
                    sink,
                    &mut pod.held,
                    key,
                    id,
                    head,
                    tier,
                    true,
                );
            }
            applied += 1;
        }
        self.metrics.placeholder_blocks("applied", applied);
        self.metrics.placeholder_blocks("unknown", unknown);
    }

    fn removed(&mut self, key: PodKey, rank: i64, e: &BlockRemoved, sink: &mut Sink) {
        let Some(pod) = self.pods.get_mut(&key) else {
            return;
        };
        let group_idx = e.group_idx.unwrap_or(0);
        let source = pod.sources.entry(rank).or_default();
        if source.unrouted_groups.contains(&group_idx) {
            self.metrics
                .blocks_not_routed
                .inc_by(e.block_hashes.len() as u64);
            return;
        }
        let Some(group) = source.groups.get_mut(&group_idx) else {
            self.metrics
                .removed_unknown
                .inc_by(e.block_hashes.len() as u64);
            return;
        };
        let tier = Medium::tier(e.medium.as_ref());
        let bit = tier_bit(tier);
        let mut removed = 0u64;
        let fps = e
            .block_hashes
            .iter()
            .map(|&h| Fingerprint::of(VllmHash::new(h)));
        // Every probe of the event announced first: the misses overlap.
        for fp in fps.clone() {
            group.blocks.prefetch(fp);
        }
        for fp in fps {
            let found = group
                .blocks
                .find(fp)
                .and_then(|slot| Some((slot, group.blocks.at(slot)?)));
            let Some((slot, mut entry)) = found.filter(|(_, entry)| entry.has(bit)) else {
                self.metrics.removed_unknown.inc();
                continue;
            };
            let gone = entry.remove(bit);
            let id = entry.block();
            if gone {
                group.blocks.remove_at(slot);
                pod.source_blocks = pod.source_blocks.saturating_sub(1);
            } else {
                group.blocks.set(slot, entry);
            }
            let head = if gone {
                group.heads.remove(&fp)
            } else {
                group.heads.get(&fp).cloned()
            };
            let held = &mut pod.held;
            adjust_block(
                &mut self.blocks,
                sink,
                held,
                key,
                id,
                head.as_deref(),
                tier,
                false,
            );
            removed += 1;
        }
        self.metrics.blocks_removed.inc_by(removed);
    }

    pub(super) fn clear_source(&mut self, key: PodKey, rank: i64) {
        let mut sink = Sink::default();
        self.clear_source_into(key, rank, &mut sink);
        self.commit(sink);
    }

    /// Drops a publisher's blocks; when it was the pod's only holder of
    /// entries, the pod's learned entries go too (its cache is gone) and one
    /// `Cleared` op replaces the per-hash removals.
    fn clear_source_into(&mut self, key: PodKey, rank: i64, sink: &mut Sink) {
        let Some(pod) = self.pods.get_mut(&key) else {
            return;
        };
        let others = pod
            .sources
            .iter()
            .any(|(r, s)| *r != rank && s.groups.values().any(|g| !g.blocks.is_empty()));
        if !pod.sources.contains_key(&rank) {
            return;
        }
        if !others {
            let learned = pod.release_blocks(&mut self.blocks, key);
            self.learned_total = self.learned_total.saturating_sub(learned);
            if let Some(source) = pod.sources.get_mut(&rank) {
                source.groups.clear();
            }
            sink.cleared(key);
            return;
        }
        let Some(source) = pod.sources.get_mut(&rank) else {
            return;
        };
        for (_, mut group) in std::mem::take(&mut source.groups) {
            let drained = group.drain_into(&mut self.blocks, sink, &mut pod.held, key);
            pod.source_blocks = pod.source_blocks.saturating_sub(drained);
        }
    }
}
