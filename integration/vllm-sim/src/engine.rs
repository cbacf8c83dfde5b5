//! The engine: vLLM V1's scheduler over the paged KV cache, with a cost model
//! for step time.
//!
//! Each step (`schedule`): a token budget (`max_num_batched_tokens`) is shared
//! first by running requests in order (a decode needs 1 token; a request still
//! prefilling takes what is left of its prompt, chunked to the budget), then by
//! waiting requests in FCFS order while fewer than `max_num_seqs` run. A waiting
//! request first takes its longest cached prefix (full blocks, at most
//! `len - 1` tokens so one token is always computed). When blocks run out for
//! a running request, the last running request is preempted: its blocks are
//! freed (they stay cached), its progress is reset and it goes back to the
//! front of the waiting queue (recomputed later, mostly from cache). No new
//! request is admitted in a step that preempted.
//! As vLLM V1 (`allocate_slots` → `cache_blocks`), the full blocks a step will
//! compute enter the prefix cache when the step is *scheduled* (BlockStored in
//! that step's batch), so a same-prefix request admitted later in the same step
//! hits them. After the step's time (`CostModel`) has passed (`complete`):
//! computed tokens are committed and every request whose tokens are all
//! computed samples one token.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use tokio::sync::mpsc;

use crate::events::{Group, KvEvent, Medium};
use crate::hash::{extend_chain, BlockHash};
use crate::kv::BlockPool;
use crate::metrics::Counters;

mod cost_model;
mod offload;

pub use cost_model::CostModel;
use offload::CpuTier;

/// When prefix-cache queries and hits are counted (see README "Metrics").
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum PrefixStats {
    /// vLLM up to the mid-2026 fix (PR 48860): every lookup counts, so a head-of-line
    /// request blocked for KV is counted again on each step it is looked up.
    Lookup,
    /// vLLM with that fix: once, when the request is admitted.
    Admission,
}

#[derive(Debug, Clone)]
pub struct EngineConfig {
    pub block_size: usize,
    pub num_gpu_blocks: usize,
    pub max_num_seqs: usize,
    pub max_num_batched_tokens: usize,
    pub max_model_len: usize,
    /// Tokens per streamed chunk after the first (vLLM's `--stream-interval`).
    pub stream_interval: usize,
    pub cost: CostModel,
    /// Wall seconds per simulated second (< 1 runs faster than real time).
    pub time_scale: f64,
    pub prefix_stats: PrefixStats,
    /// CPU blocks of an emulated OffloadingConnector (0 = none): its events only.
    pub offload_cpu_blocks: usize,
    /// Windows (tokens) of sliding-window KV-cache groups beside the full-attention group 0.
    pub sliding_windows: Vec<u32>,
}

/// Final accounting of a request.
#[derive(Debug, Clone, PartialEq)]
pub struct Finish {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    pub cached_tokens: usize,
    pub reason: &'static str,
}

#[derive(Debug, Clone, PartialEq)]
pub enum Out {
    /// Newly generated token ids.
    Tokens(Vec<u32>),
    Done(Finish),
}

/// Where a request's output goes: `(choice index, message)`.
#[derive(Debug, Clone)]
pub struct Sink {
    pub idx: usize,
    pub tx: mpsc::UnboundedSender<(usize, Out)>,
}

impl Sink {
    fn send(&self, out: Out) -> bool {
        self.tx.send((self.idx, out)).is_ok()
    }
}

/// A multimodal item of a prompt: its identifier (vLLM's mm hash) and the placeholder
/// tokens it occupies, `[offset, offset + len)`.
#[derive(Debug, Clone, PartialEq)]
pub struct MmItem {
    pub identifier: String,
    pub offset: usize,
    pub len: usize,
}

/// What besides the tokens enters a request's block hashes (vLLM's extra keys).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HashKeys {
    /// `cache_salt`: an extra key of block 0, so salted prefixes never meet unsalted ones.
    pub cache_salt: Option<String>,
    pub mm: Vec<MmItem>,
}

impl HashKeys {
    /// vLLM's `generate_block_hash_extra_keys` for block `b`: multimodal identifiers of the
    /// items overlapping the block, then the cache salt on block 0 (no LoRA here).
    fn block_keys(&self, b: usize, block_size: usize) -> Vec<String> {
        let (start, end) = (b * block_size, (b + 1) * block_size);
        let mut keys: Vec<String> = self
            .mm
            .iter()
            .filter(|m| m.offset < end && m.offset + m.len > start)
            .map(|m| m.identifier.clone())
            .collect();
        if b == 0 {
            keys.extend(self.cache_salt.iter().cloned());
        }
        keys
    }
}

pub struct NewRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub keys: HashKeys,
    pub sink: Sink,
}

struct Req {
    tokens: Vec<u32>,
    prompt_len: usize,
    max_tokens: usize,
    num_output: usize,
    num_computed: usize,
    block_ids: Vec<u32>,
    hashes: Vec<BlockHash>,
    keys: HashKeys,
    /// Blocks registered in the prefix cache (hits included).
    num_cached_blocks: usize,
    /// Per KV-cache group, leading blocks already out of its sliding window.
    num_out_of_window: Vec<usize>,
    num_preemptions: u32,
    cached_tokens: Option<usize>,
    /// Picks this request's output tokens: sampled outputs differ between requests, so
    /// their blocks never coincide (identical outputs would fake duplicate blocks).
    output_seed: u64,
    arrival: Instant,
    first_token: bool,
    unsent: Vec<u32>,
    sink: Sink,
}

/// One scheduled step: `(request id, context before, new tokens, is decode)`.
#[derive(Debug, Default)]
pub struct Plan {
    pub items: Vec<(u64, usize, usize, bool)>,
    pub seconds: f64,
}

pub struct Engine {
    pub cfg: EngineConfig,
    pub pool: BlockPool,
    reqs: HashMap<u64, Req>,
    waiting: VecDeque<u64>,
    running: Vec<u64>,
    next_id: u64,
    output_ids: Vec<u32>,
    cpu: Option<CpuTier>,
    pub counters: Counters,
}

/// SplitMix64: the per-request output token stream.
fn mix(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

impl Engine {
    pub fn new(cfg: EngineConfig, output_ids: Vec<u32>) -> Self {
        let groups = if cfg.sliding_windows.is_empty() {
            vec![Group::PLAIN]
        } else {
            std::iter::once(Group {
                idx: 0,
                kind: Some("full_attention"),
                sliding_window: None,
            })
            .chain(cfg.sliding_windows.iter().zip(1..).map(|(w, idx)| Group {
                idx,
                kind: Some("sliding_window"),
                sliding_window: Some(*w),
            }))
            .collect()
        };
        let pool = BlockPool::new(cfg.num_gpu_blocks, groups);
        let output_ids = if output_ids.is_empty() {
            vec![1000]
        } else {
            output_ids
        };
        let cpu = (cfg.offload_cpu_blocks > 0).then(|| CpuTier::new(cfg.offload_cpu_blocks));
        Self {
            cfg,
            pool,
            reqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            output_ids,
            cpu,
            counters: Counters::default(),
        }
    }

    pub fn num_running(&self) -> usize {
        self.running.len()
    }

    pub fn num_waiting(&self) -> usize {
        self.waiting.len()
    }

    pub fn add(&mut self, r: NewRequest, now: Instant) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let prompt_len = r.prompt.len();
        let bs = self.cfg.block_size.max(1);
        let mut hashes = Vec::with_capacity(prompt_len / bs + 1);
        extend_chain(&mut hashes, &r.prompt, bs, |b| r.keys.block_keys(b, bs));
        self.reqs.insert(
            id,
            Req {
                tokens: r.prompt,
                prompt_len,
                max_tokens: r.max_tokens.max(1),
                num_output: 0,
                num_computed: 0,
                block_ids: Vec::new(),
                hashes,
                keys: r.keys,
                num_cached_blocks: 0,
                num_out_of_window: vec![0; self.pool.groups().len()],
                num_preemptions: 0,
                cached_tokens: None,
                output_seed: mix(id ^ 0x5EED),
                arrival: now,
                first_token: false,
                unsent: Vec::new(),
                sink: r.sink,
            },
        );
        self.waiting.push_back(id);
        id
    }

    /// Drops requests whose client went away (vLLM aborts them).
    fn reap_aborted(&mut self) {
        let reqs = &self.reqs;
        let dead: Vec<u64> = self
            .running
            .iter()
            .chain(self.waiting.iter())
            .copied()
            .filter(|id| match reqs.get(id) {
                Some(r) => r.sink.tx.is_closed(),
                None => true,
            })
            .collect();
        for id in dead {
            self.running.retain(|x| *x != id);
            self.waiting.retain(|x| *x != id);
            if let Some(r) = self.reqs.remove(&id) {
                self.pool.free_blocks(&r.block_ids);
                self.counters.requests_aborted += 1;
            }
        }
    }

    fn preempt_last(&mut self) -> Option<u64> {
        let id = self.running.pop()?;
        if let Some(r) = self.reqs.get_mut(&id) {
            self.pool.free_blocks(&r.block_ids);
            r.block_ids.clear();
            r.num_computed = 0;
            r.num_cached_blocks = 0;
            r.num_out_of_window.fill(0);
            r.num_preemptions += 1;
        }
        self.waiting.push_front(id);
        self.counters.preemptions += 1;
        Some(id)
    }

    /// Gives request `id` room for `n` more tokens (after `hits`, blocks of a cached prefix).
    fn allocate_slots(&mut self, id: u64, n: usize, hits: &[u32]) -> bool {
        let bs = self.cfg.block_size;
        let Some(r) = self.reqs.get(&id) else {
            return false;
        };
        let need = (r.num_computed + n).div_ceil(bs);
        let have = r.block_ids.len() + hits.len();
        let fresh = need.saturating_sub(have);
        if fresh + self.pool.count_free(hits) > self.pool.num_free() {
            return false;
        }
        self.pool.touch(hits);
        let Some(new_ids) = self.pool.allocate(fresh) else {
            return false;
        };
        if let Some(r) = self.reqs.get_mut(&id) {
            r.block_ids.extend_from_slice(hits);
            r.block_ids.extend(new_ids);
        }
        true
    }

    /// vLLM's `cache_blocks` at allocation: registers the blocks that are full once the
    /// first `upto` tokens are computed (capped at the tokens known), one BlockStored per
    /// group; sliding-window groups drop the blocks that left their window.
    fn register_blocks(&mut self, id: u64, upto: usize) {
        let bs = self.cfg.block_size;
        let Some(r) = self.reqs.get_mut(&id) else {
            return;
        };
        let full = (upto.min(r.tokens.len()) / bs).min(r.block_ids.len());
        if full > r.num_cached_blocks {
            let keys = &r.keys;
            extend_chain(&mut r.hashes, &r.tokens[..full * bs], bs, |b| {
                keys.block_keys(b, bs)
            });
            let first = r.num_cached_blocks;
            let (ids, hashes) = (&r.block_ids[first..full], &r.hashes[first..full]);
            for (bid, h) in ids.iter().zip(hashes) {
                self.pool.cache_block(*bid, *h);
            }
            let per_block: Vec<Option<Vec<String>>> = (first..full)
                .map(|b| Some(r.keys.block_keys(b, bs)).filter(|k| !k.is_empty()))
                .collect();
            let extra_keys = per_block.iter().any(Option::is_some).then_some(per_block);
            let parent = first.checked_sub(1).and_then(|p| r.hashes.get(p)).copied();
            for g in self.pool.groups().to_vec() {
                self.pool.push_event(KvEvent::BlockStored {
                    block_hashes: hashes.to_vec(),
                    parent_block_hash: parent,
                    token_ids: r.tokens[first * bs..full * bs].to_vec(),
                    block_size: bs as u32,
                    lora_id: None,
                    lora_name: None,
                    medium: Medium::Gpu,
                    extra_keys: extra_keys.clone(),
                    group: Some(g),
                });
            }
            if let Some(cpu) = &mut self.cpu {
                cpu.computed(hashes);
            }
            r.num_cached_blocks = full;
        }
        // vLLM's remove_skipped_blocks: tokens before `num_computed - window` are no longer read.
        let computed = r.num_computed;
        for (gi, g) in self.pool.groups().to_vec().into_iter().enumerate() {
            let (Some(window), Some(done)) = (g.sliding_window, r.num_out_of_window.get_mut(gi))
            else {
                continue;
            };
            let out = (computed.saturating_sub(window as usize) / bs).min(r.num_cached_blocks);
            for b in *done..out {
                if let Some(bid) = r.block_ids.get(b) {
                    self.pool.leave_window(*bid, g.idx);
                }
            }
            *done = (*done).max(out);
        }
    }

    fn record_prefix_stats(&mut self, id: u64, hit_tokens: usize) {
        let Some(r) = self.reqs.get(&id) else {
            return;
        };
        let queries = r.tokens.len() as u64;
        let c = &mut self.counters;
        if r.num_preemptions > 0 {
            c.preempted_prefix_queries += queries;
            c.preempted_prefix_hits += hit_tokens as u64;
        } else {
            c.prefix_queries += queries;
            c.prefix_hits += hit_tokens as u64;
        }
    }

    pub fn schedule(&mut self) -> Plan {
        self.reap_aborted();
        if let Some(cpu) = &mut self.cpu {
            cpu.offload(&mut self.pool);
        }
        let mut plan = Plan::default();
        let mut budget = self.cfg.max_num_batched_tokens;
        let mut preempted = false;
        let mut i = 0;
        while i < self.running.len() && budget > 0 {
            let id = self.running[i];
            let Some(r) = self.reqs.get(&id) else {
                i += 1;
                continue;
            };
            let n = (r.tokens.len() - r.num_computed).min(budget);
            let (ctx, decode) = (r.num_computed, r.num_computed >= r.prompt_len);
            if n == 0 {
                i += 1;
                continue;
            }
            let mut scheduled = false;
            loop {
                if self.allocate_slots(id, n, &[]) {
                    scheduled = true;
                    break;
                }
                preempted = true;
                match self.preempt_last() {
                    Some(v) if v == id => break,
                    Some(_) => {}
                    None => break,
                }
            }
            if !scheduled {
                break;
            }
            self.register_blocks(id, ctx + n);
            plan.items.push((id, ctx, n, decode));
            budget -= n;
            i += 1;
        }
        if !preempted {
            self.schedule_waiting(&mut plan, budget);
        }
        plan.seconds = self
            .cfg
            .cost
            .step_seconds(plan.items.iter().map(|(_, c, n, d)| (*c, *n, *d)));
        plan
    }

    /// Admits waiting requests FCFS while budget, sequence slots and KV allow.
    fn schedule_waiting(&mut self, plan: &mut Plan, mut budget: usize) {
        let bs = self.cfg.block_size;
        while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
            let Some(&id) = self.waiting.front() else {
                break;
            };
            let Some(r) = self.reqs.get_mut(&id) else {
                self.waiting.pop_front();
                continue;
            };
            // New and preempted requests (nothing computed) look up the cache; a resumed
            // request's hashes cover its output blocks too.
            let lookup = r.num_computed == 0;
            let hits = if lookup {
                let keys = &r.keys;
                extend_chain(&mut r.hashes, &r.tokens, bs, |b| keys.block_keys(b, bs));
                let max_hit_blocks = r.tokens.len().saturating_sub(1) / bs;
                self.pool
                    .cached_prefix(&r.hashes[..max_hit_blocks.min(r.hashes.len())])
            } else {
                Vec::new()
            };
            let hit_tokens = hits.len() * bs;
            if lookup && self.cfg.prefix_stats == PrefixStats::Lookup {
                self.record_prefix_stats(id, hit_tokens);
            }
            let Some(r) = self.reqs.get_mut(&id) else {
                break;
            };
            let n = (r.tokens.len() - r.num_computed - hit_tokens).min(budget);
            // allocate_slots counts from num_computed: account for the hits first.
            r.num_computed += hit_tokens;
            if !self.allocate_slots(id, n, &hits) {
                if let Some(r) = self.reqs.get_mut(&id) {
                    r.num_computed -= hit_tokens;
                }
                break;
            }
            if lookup && self.cfg.prefix_stats == PrefixStats::Admission {
                self.record_prefix_stats(id, hit_tokens);
            }
            self.waiting.pop_front();
            self.running.push(id);
            let Some(r) = self.reqs.get_mut(&id) else {
                break;
            };
            r.num_cached_blocks = hits.len();
            r.cached_tokens.get_or_insert(hit_tokens);
            let ctx = r.num_computed;
            plan.items.push((id, ctx, n, false));
            self.register_blocks(id, ctx + n);
            budget -= n;
        }
    }

    /// Commits a step scheduled by `schedule` once its time has passed; `now` is the
    /// step's end on the simulated clock.
    pub fn complete(&mut self, plan: &Plan, now: Instant) {
        let scale = if self.cfg.time_scale > 0.0 {
            self.cfg.time_scale
        } else {
            1.0
        };
        let mut finished = Vec::new();
        for &(id, _, n, _) in &plan.items {
            let Some(r) = self.reqs.get_mut(&id) else {
                continue;
            };
            r.num_computed += n;
            if r.num_computed < r.tokens.len() {
                continue; // chunked prefill not finished: nothing sampled
            }
            let pick = mix(r.output_seed ^ r.num_output as u64) as usize;
            let tok = self.output_ids[pick % self.output_ids.len()];
            r.tokens.push(tok);
            r.num_output += 1;
            r.unsent.push(tok);
            self.counters.generation_tokens += 1;
            let first = !r.first_token;
            if first {
                r.first_token = true;
                // vLLM counts a request's prompt tokens with its first output token.
                self.counters.prompt_tokens += r.prompt_len as u64;
                self.counters
                    .ttft
                    .observe(now.saturating_duration_since(r.arrival).as_secs_f64() / scale);
            }
            let done = r.num_output >= r.max_tokens;
            if first || done || r.unsent.len() >= self.cfg.stream_interval {
                let toks = std::mem::take(&mut r.unsent);
                if !r.sink.send(Out::Tokens(toks)) {
                    finished.push((id, None));
                    continue;
                }
            }
            if done {
                let fin = Finish {
                    prompt_tokens: r.prompt_len,
                    completion_tokens: r.num_output,
                    cached_tokens: r.cached_tokens.unwrap_or(0),
                    reason: "length",
                };
                self.counters
                    .e2e
                    .observe(now.saturating_duration_since(r.arrival).as_secs_f64() / scale);
                finished.push((id, Some(fin)));
            }
        }
        for (id, fin) in finished {
            self.running.retain(|x| *x != id);
            if let Some(r) = self.reqs.remove(&id) {
                self.pool.free_blocks(&r.block_ids);
                match fin {
                    Some(f) => {
                        self.counters.requests_finished += 1;
                        let _ = r.sink.send(Out::Done(f));
                    }
                    None => self.counters.requests_aborted += 1,
                }
            }
        }
    }

    /// Admin flush, as vLLM's `reset_prefix_cache`: refused (false) while any request holds
    /// blocks; otherwise drops the prefix cache (AllBlocksCleared) and resets the counters.
    pub fn flush(&mut self) -> bool {
        self.reap_aborted();
        if self.reqs.values().any(|r| !r.block_ids.is_empty()) {
            return false;
        }
        self.pool.reset_prefix_cache();
        if let Some(cpu) = &mut self.cpu {
            cpu.clear();
        }
        self.counters = Counters::default();
        true
    }
}

#[cfg(test)]
mod tests;
