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

use std::collections::{HashMap, HashSet, VecDeque};
use std::time::Instant;

use tokio::sync::mpsc;

use crate::events::{Group, KvEvent, Medium};
use crate::hash::{extend_chain, BlockHash};
use crate::kv::BlockPool;
use crate::metrics::Counters;

/// Step-time model; see README.md "Cost model" for the derivation of the defaults.
#[derive(Debug, Clone, Copy)]
pub struct CostModel {
    /// Fixed cost of every step: reading the weights once (ms).
    pub step_overhead_ms: f64,
    /// Linear prefill cost per prompt token (µs): 2 × params FLOPs at the achieved rate.
    pub prefill_us_per_token: f64,
    /// Attention cost per (new token × context token) pair during prefill (ns).
    pub attn_ns_per_pair: f64,
    /// Decode cost per context token of each decoding sequence: KV bytes / effective bandwidth (ns).
    pub kv_read_ns_per_token: f64,
    /// Relative speed of this pod's accelerator (1.0: the constants above; 0.5: every step
    /// takes twice as long, prefill and decode alike).
    pub speed: f64,
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            step_overhead_ms: 13.0,
            prefill_us_per_token: 73.7,
            attn_ns_per_pair: 2.36,
            kv_read_ns_per_token: 91.0,
            speed: 1.0,
        }
    }
}

impl CostModel {
    /// Seconds for a step that computes, per scheduled request, `n` new tokens over `ctx`
    /// already-computed ones, on a pod of `speed`.
    pub fn step_seconds(&self, work: impl Iterator<Item = (usize, usize, bool)>) -> f64 {
        let mut s = self.step_overhead_ms * 1e-3;
        for (ctx, n, decode) in work {
            let (ctx, n) = (ctx as f64, n as f64);
            if decode {
                s += (ctx + n) * self.kv_read_ns_per_token * 1e-9;
            } else {
                s += n * self.prefill_us_per_token * 1e-6
                    + n * (ctx + n / 2.0) * self.attn_ns_per_pair * 1e-9;
            }
        }
        s / self.speed
    }
}

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

/// The CPU tier of an emulated OffloadingConnector: which hashes it holds, oldest first.
/// It only produces vLLM's events (placeholder stores, CPU removals); requests never load from it.
struct CpuTier {
    capacity: usize,
    order: VecDeque<BlockHash>,
    held: HashSet<BlockHash>,
    /// Blocks computed in the last step, offloaded (and published) with the next step.
    pending: Vec<BlockHash>,
}

impl CpuTier {
    fn offload(&mut self, pool: &mut BlockPool) {
        let mut stored = Vec::new();
        for h in std::mem::take(&mut self.pending) {
            if !self.held.insert(h) {
                continue;
            }
            if self.order.len() >= self.capacity {
                if let Some(old) = self.order.pop_front() {
                    self.held.remove(&old);
                    pool.push_event(KvEvent::BlockRemoved {
                        block_hashes: vec![old],
                        medium: Medium::Cpu,
                        group: None,
                    });
                }
            }
            self.order.push_back(h);
            stored.push(h);
        }
        if !stored.is_empty() {
            pool.push_event(KvEvent::cpu_placeholder(stored));
        }
    }
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
        let cpu = (cfg.offload_cpu_blocks > 0).then(|| CpuTier {
            capacity: cfg.offload_cpu_blocks,
            order: VecDeque::new(),
            held: HashSet::new(),
            pending: Vec::new(),
        });
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
                cpu.pending.extend_from_slice(hashes);
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
            cpu.order.clear();
            cpu.held.clear();
            cpu.pending.clear();
        }
        self.counters = Counters::default();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(blocks: usize, budget: usize, seqs: usize) -> EngineConfig {
        EngineConfig {
            block_size: 16,
            num_gpu_blocks: blocks,
            max_num_seqs: seqs,
            max_num_batched_tokens: budget,
            max_model_len: 4096,
            stream_interval: 1,
            cost: CostModel::default(),
            time_scale: 1.0,
            prefix_stats: PrefixStats::Lookup,
            offload_cpu_blocks: 0,
            sliding_windows: Vec::new(),
        }
    }

    type Rx = mpsc::UnboundedReceiver<(usize, Out)>;

    fn req(e: &mut Engine, prompt: Vec<u32>, max_tokens: usize) -> (u64, Rx) {
        let (tx, rx) = mpsc::unbounded_channel();
        let id = e.add(
            NewRequest {
                prompt,
                max_tokens,
                keys: HashKeys::default(),
                sink: Sink { idx: 0, tx },
            },
            Instant::now(),
        );
        (id, rx)
    }

    fn run_to_idle(e: &mut Engine) -> usize {
        let mut steps = 0;
        loop {
            let p = e.schedule();
            if p.items.is_empty() {
                return steps;
            }
            e.complete(&p, Instant::now());
            steps += 1;
            assert!(steps < 10_000);
        }
    }

    fn drain(rx: &mut Rx) -> (usize, Option<Finish>) {
        let mut toks = 0;
        let mut fin = None;
        while let Ok((_, o)) = rx.try_recv() {
            match o {
                Out::Tokens(t) => toks += t.len(),
                Out::Done(f) => fin = Some(f),
            }
        }
        (toks, fin)
    }

    #[test]
    fn chunked_prefill_and_decode_step_accounting() {
        let mut e = Engine::new(cfg(100, 64, 8), vec![5]);
        let (_, mut rx) = req(&mut e, (0..150).collect(), 3);
        // 150 prompt tokens with a 64-token budget: 64, 64, 22 (+ first token), then 2 decodes.
        let p1 = e.schedule();
        assert_eq!(p1.items.iter().map(|i| i.2).collect::<Vec<_>>(), vec![64]);
        e.complete(&p1, Instant::now());
        assert_eq!(drain(&mut rx).0, 0);
        let p2 = e.schedule();
        assert_eq!((p2.items[0].1, p2.items[0].2), (64, 64));
        e.complete(&p2, Instant::now());
        let p3 = e.schedule();
        assert_eq!(
            (p3.items[0].1, p3.items[0].2, p3.items[0].3),
            (128, 22, false)
        );
        e.complete(&p3, Instant::now());
        assert_eq!(drain(&mut rx).0, 1);
        let p4 = e.schedule();
        assert_eq!(
            (p4.items[0].1, p4.items[0].2, p4.items[0].3),
            (150, 1, true)
        );
        e.complete(&p4, Instant::now());
        let p5 = e.schedule();
        e.complete(&p5, Instant::now());
        let (toks, fin) = drain(&mut rx);
        assert_eq!(toks, 2);
        assert_eq!(
            fin.unwrap(),
            Finish {
                prompt_tokens: 150,
                completion_tokens: 3,
                cached_tokens: 0,
                reason: "length"
            }
        );
        assert!(e.schedule().items.is_empty());
        // 152 tokens computed (150 + 2 decoded) → 9 full blocks cached, all blocks free again.
        assert_eq!(e.pool.num_cached(), 9);
        assert_eq!(e.pool.num_free(), 100);
        assert_eq!(e.counters.generation_tokens, 3);
    }

    #[test]
    fn budget_is_shared_decodes_first_then_waiting() {
        let mut e = Engine::new(cfg(100, 40, 8), vec![5]);
        let (_, _rx1) = req(&mut e, (0..20).collect(), 10);
        let p = e.schedule();
        e.complete(&p, Instant::now());
        let (_, _rx2) = req(&mut e, (1000..1100).collect(), 10);
        let p = e.schedule();
        // decode of request 1 (1 token) first, then 39 tokens of request 2's prefill.
        assert_eq!(
            p.items.iter().map(|i| (i.2, i.3)).collect::<Vec<_>>(),
            vec![(1, true), (39, false)]
        );
    }

    #[test]
    fn max_num_seqs_limits_running() {
        let mut e = Engine::new(cfg(100, 1000, 2), vec![5]);
        let _rx: Vec<_> = (0..3).map(|i| req(&mut e, vec![i; 10], 5).1).collect();
        let p = e.schedule();
        assert_eq!(p.items.len(), 2);
        assert_eq!((e.num_running(), e.num_waiting()), (2, 1));
    }

    #[test]
    fn prefix_hit_skips_cached_blocks_and_counts() {
        let mut e = Engine::new(cfg(100, 8192, 8), vec![5]);
        let prompt: Vec<u32> = (0..100).collect();
        let (_, mut rx) = req(&mut e, prompt.clone(), 1);
        run_to_idle(&mut e);
        assert_eq!(drain(&mut rx).1.unwrap().cached_tokens, 0);
        // Same 96-token prefix, different tail: 6 blocks hit.
        let mut p2 = prompt[..96].to_vec();
        p2.extend([7, 7, 7, 7, 7]);
        let (_, mut rx2) = req(&mut e, p2, 1);
        let plan = e.schedule();
        assert_eq!((plan.items[0].1, plan.items[0].2), (96, 5));
        e.complete(&plan, Instant::now());
        assert_eq!(drain(&mut rx2).1.unwrap().cached_tokens, 96);
        assert_eq!(e.counters.prefix_queries, 201);
        assert_eq!(e.counters.prefix_hits, 96);
        // A fully cached prompt (exactly 6 blocks) still computes its last block's tail: hits capped at len-1.
        let (_, mut rx3) = req(&mut e, prompt[..96].to_vec(), 1);
        let plan = e.schedule();
        assert_eq!((plan.items[0].1, plan.items[0].2), (80, 16));
        e.complete(&plan, Instant::now());
        assert_eq!(drain(&mut rx3).1.unwrap().cached_tokens, 80);
        // Warm prefill is cheaper than cold.
        let cold = e
            .cfg
            .cost
            .step_seconds([(0usize, 7200usize, false)].into_iter());
        let warm = e
            .cfg
            .cost
            .step_seconds([(6000usize, 1200usize, false)].into_iter());
        assert!(cold > 4.0 * warm, "cold {cold} warm {warm}");
        // A half-speed pod takes twice as long for every kind of step.
        let half = CostModel {
            speed: 0.5,
            ..e.cfg.cost
        };
        for work in [(0usize, 7200usize, false), (7000, 1, true)] {
            let full = e.cfg.cost.step_seconds([work].into_iter());
            let slow = half.step_seconds([work].into_iter());
            assert!(
                (slow - 2.0 * full).abs() < 1e-12,
                "{work:?}: {slow} vs {full}"
            );
        }
    }

    #[test]
    fn stored_events_chain_parents() {
        let mut e = Engine::new(cfg(100, 32, 8), vec![5]);
        let (_, _rx) = req(&mut e, (0..70).collect(), 1);
        let mut stored = Vec::new();
        loop {
            let p = e.schedule();
            if p.items.is_empty() {
                break;
            }
            e.complete(&p, Instant::now());
            stored.extend(e.pool.take_events());
        }
        // 70 tokens in chunks of 32: blocks 0-1, 2-3, then block 4 (tokens 64..69 stay partial + 1 sampled token).
        let mut parents = Vec::new();
        let mut all = Vec::new();
        for ev in &stored {
            if let KvEvent::BlockStored {
                block_hashes,
                parent_block_hash,
                token_ids,
                ..
            } = ev
            {
                assert_eq!(token_ids.len(), block_hashes.len() * 16);
                parents.push(*parent_block_hash);
                all.extend(block_hashes.clone());
            }
        }
        assert_eq!(all.len(), 4);
        let expect = crate::hash::chain(&(0..64).collect::<Vec<u32>>(), 16);
        assert_eq!(all, expect);
        assert_eq!(parents, vec![None, Some(expect[1])]);
    }

    #[test]
    fn preemption_when_kv_exhausted() {
        // 6 blocks; two requests of 40 prompt tokens (3 blocks each) that grow.
        let mut e = Engine::new(cfg(6, 1000, 8), vec![5]);
        let (_, mut rx1) = req(&mut e, (0..40).collect(), 30);
        let (_, mut rx2) = req(&mut e, (100..140).collect(), 30);
        let p = e.schedule();
        assert_eq!(p.items.len(), 2);
        assert_eq!(e.pool.num_free(), 0);
        run_to_idle(&mut e);
        assert!(e.counters.preemptions >= 1, "expected a preemption");
        let (t1, f1) = drain(&mut rx1);
        let (t2, f2) = drain(&mut rx2);
        assert_eq!((t1, t2), (30, 30));
        assert!(f1.is_some() && f2.is_some());
        assert_eq!(e.pool.num_free(), 6);
    }

    #[test]
    fn aborted_requests_free_their_blocks() {
        let mut e = Engine::new(cfg(20, 1000, 8), vec![5]);
        let (_, rx) = req(&mut e, (0..40).collect(), 100);
        let p = e.schedule();
        e.complete(&p, Instant::now());
        assert!(e.pool.num_free() < 20);
        drop(rx);
        assert!(e.schedule().items.is_empty());
        assert_eq!(e.pool.num_free(), 20);
        assert_eq!(e.counters.requests_aborted, 1);
    }

    #[test]
    fn flush_clears_cache_and_counters() {
        let mut e = Engine::new(cfg(20, 1000, 8), vec![5]);
        let (_, _rx) = req(&mut e, (0..40).collect(), 1);
        run_to_idle(&mut e);
        assert!(e.pool.num_cached() > 0);
        e.pool.take_events();
        assert!(e.flush());
        assert_eq!(e.pool.num_cached(), 0);
        assert_eq!(e.counters.generation_tokens, 0);
        assert_eq!(e.pool.take_events(), vec![KvEvent::AllBlocksCleared]);
    }

    /// Replays events as an indexer does, counting live copies per (group, hash): stores of
    /// a live hash, removals of an unknown one, stores whose parent is unknown.
    #[derive(Default, Debug)]
    struct Ledger {
        live: HashMap<(u32, BlockHash), u32>,
        dup_stores: usize,
        unknown_removals: usize,
        /// In the full-attention group 0.
        unknown_parents: usize,
        /// In sliding-window groups, where a parent that left the window is gone by design
        /// (vLLM's own stream has these too: indexers route on the full-attention group).
        sliding_unknown_parents: usize,
        stored_blocks: usize,
    }

    impl Ledger {
        /// No stores of a block already stored, no removals of unknown blocks, no
        /// full-attention stores with an unknown parent.
        fn assert_no_artefacts(&self) {
            assert_eq!(
                (self.dup_stores, self.unknown_removals, self.unknown_parents),
                (0, 0, 0),
                "{self:?}"
            );
        }

        fn apply(&mut self, evs: &[KvEvent]) {
            for ev in evs {
                match ev {
                    KvEvent::BlockStored {
                        block_hashes,
                        parent_block_hash,
                        medium: Medium::Gpu,
                        group,
                        ..
                    } => {
                        let g = group.map_or(0, |g| g.idx);
                        if let Some(p) = parent_block_hash {
                            if !self.live.contains_key(&(g, *p)) {
                                match g {
                                    0 => self.unknown_parents += 1,
                                    _ => self.sliding_unknown_parents += 1,
                                }
                            }
                        }
                        for h in block_hashes {
                            let n = self.live.entry((g, *h)).or_default();
                            if *n > 0 {
                                self.dup_stores += 1;
                            }
                            *n += 1;
                            self.stored_blocks += 1;
                        }
                    }
                    KvEvent::BlockRemoved {
                        block_hashes,
                        medium: Medium::Gpu,
                        group,
                    } => {
                        let g = group.map_or(0, |g| g.idx);
                        for h in block_hashes {
                            match self.live.get_mut(&(g, *h)) {
                                Some(n) if *n > 1 => *n -= 1,
                                Some(_) => {
                                    self.live.remove(&(g, *h));
                                }
                                None => self.unknown_removals += 1,
                            }
                        }
                    }
                    KvEvent::AllBlocksCleared => self.live.clear(),
                    _ => {}
                }
            }
        }
    }

    /// A deterministic random workload under KV pressure (preemptions, evictions): 40
    /// groups sharing prefixes, prompts not block-aligned, requests arriving mid-run.
    fn pressured_run(e: &mut Engine, seed: u64) -> (Ledger, Vec<Rx>) {
        let mut rng = seed;
        let mut next = || {
            rng = mix(rng);
            rng
        };
        let systems: Vec<Vec<u32>> = (0..40u32)
            .map(|g| (0..96).map(|i| g * 1000 + i).collect())
            .collect();
        let mut ledger = Ledger::default();
        let mut rxs = Vec::new();
        for step in 0..3000 {
            if step % 3 == 0 && rxs.len() < 300 {
                let mut p = systems[(next() % 40) as usize].clone();
                let q = 5 + (next() % 40) as usize;
                p.extend((0..q).map(|_| 500_000 + (next() % 1000) as u32));
                let (_, rx) = req(e, p, 1 + (next() % 40) as usize);
                rxs.push(rx);
            }
            let plan = e.schedule();
            ledger.apply(&e.pool.take_events());
            if plan.items.is_empty() && rxs.len() >= 300 {
                break;
            }
            e.complete(&plan, Instant::now());
        }
        (ledger, rxs)
    }

    #[test]
    fn event_stream_has_no_duplicate_block_artefacts() {
        let mut e = Engine::new(cfg(48, 256, 16), (10..26).collect());
        let (ledger, mut rxs) = pressured_run(&mut e, 1);
        assert!(e.counters.preemptions > 0, "workload must preempt");
        assert!(ledger.stored_blocks > 1000, "{ledger:?}");
        ledger.assert_no_artefacts();
        assert!(rxs.iter_mut().all(|rx| drain(rx).1.is_some()));
        // What the index believes is exactly what the pool holds.
        assert_eq!(ledger.live.len(), e.pool.num_cached());
    }

    #[test]
    fn block_aligned_repeat_stores_its_last_block_again_as_vllm_does() {
        // A fully cached, block-aligned prompt recomputes its last block (hits stop at len-1)
        // into a new block: vLLM does not deduplicate it, so its hash is stored twice.
        let mut e = Engine::new(cfg(100, 8192, 8), vec![5]);
        let mut ledger = Ledger::default();
        for _ in 0..2 {
            let (_, _rx) = req(&mut e, (0..96).collect(), 1);
            run_to_idle(&mut e);
            ledger.apply(&e.pool.take_events());
        }
        assert_eq!((ledger.dup_stores, ledger.unknown_parents), (1, 0));
    }

    #[test]
    fn same_prefix_admitted_in_the_same_step_hits() {
        let mut e = Engine::new(cfg(100, 8192, 8), vec![5]);
        let system: Vec<u32> = (0..160).collect();
        let a = [system.clone(), vec![900; 20]].concat();
        let b = [system.clone(), vec![901; 20]].concat();
        let (_, mut rxa) = req(&mut e, a, 1);
        let (_, mut rxb) = req(&mut e, b, 1);
        let plan = e.schedule();
        // A computes all 180 tokens; B finds A's 10 system blocks registered at schedule time.
        assert_eq!(
            plan.items.iter().map(|i| (i.1, i.2)).collect::<Vec<_>>(),
            vec![(0, 180), (160, 20)]
        );
        let evs = e.pool.take_events();
        let stored: Vec<usize> = evs
            .iter()
            .filter_map(|ev| match ev {
                KvEvent::BlockStored { block_hashes, .. } => Some(block_hashes.len()),
                _ => None,
            })
            .collect();
        assert_eq!(
            stored,
            vec![11, 1],
            "B stores only its own block, after A's"
        );
        e.complete(&plan, Instant::now());
        assert_eq!(drain(&mut rxa).1.unwrap().cached_tokens, 0);
        assert_eq!(drain(&mut rxb).1.unwrap().cached_tokens, 160);
    }

    #[test]
    fn prefix_stats_count_blocked_lookups_and_preempted_requests_apart() {
        // 10 blocks: A (100 tokens, 7 blocks) runs 3 steps; B (60 tokens, 4 blocks) is looked
        // up and blocked in each of them, then admitted in the 4th.
        for (mode, b_lookups) in [(PrefixStats::Lookup, 4u64), (PrefixStats::Admission, 1)] {
            let mut c = cfg(10, 1000, 8);
            c.prefix_stats = mode;
            let mut e = Engine::new(c, vec![5]);
            let (_, _rxa) = req(&mut e, (0..100).collect(), 3);
            let (_, _rxb) = req(&mut e, (1000..1060).collect(), 1);
            run_to_idle(&mut e);
            assert_eq!(e.counters.prefix_queries, 100 + 60 * b_lookups, "{mode:?}");
            assert_eq!(e.counters.preempted_prefix_queries, 0);
        }
        // A request preempted and resumed is counted apart, with its output tokens.
        let mut e = Engine::new(cfg(6, 1000, 8), vec![5]);
        let (_, _r1) = req(&mut e, (0..40).collect(), 30);
        let (_, _r2) = req(&mut e, (100..140).collect(), 30);
        run_to_idle(&mut e);
        assert!(e.counters.preemptions >= 1);
        assert_eq!(e.counters.prefix_queries, 80);
        assert!(e.counters.preempted_prefix_queries > 40);
        assert!(e.counters.preempted_prefix_hits > 0);
    }

    #[test]
    fn cache_salt_isolates_and_images_key_their_blocks() {
        let mut e = Engine::new(cfg(100, 8192, 8), vec![5]);
        let prompt: Vec<u32> = (0..100).collect();
        let salted = |s: &str| HashKeys {
            cache_salt: Some(s.into()),
            mm: Vec::new(),
        };
        let run = |e: &mut Engine, keys: HashKeys| {
            let (tx, mut rx) = mpsc::unbounded_channel();
            e.add(
                NewRequest {
                    prompt: prompt.clone(),
                    max_tokens: 1,
                    keys,
                    sink: Sink { idx: 0, tx },
                },
                Instant::now(),
            );
            run_to_idle(e);
            drain(&mut rx).1.unwrap().cached_tokens
        };
        assert_eq!(run(&mut e, salted("tenant-a")), 0);
        assert_eq!(run(&mut e, salted("tenant-a")), 96);
        assert_eq!(run(&mut e, salted("tenant-b")), 0);
        assert_eq!(run(&mut e, HashKeys::default()), 0);
        let first_salted = e.pool.take_events().into_iter().find_map(|ev| match ev {
            KvEvent::BlockStored { extra_keys, .. } => extra_keys,
            _ => None,
        });
        let mut expect = vec![None; 6];
        expect[0] = Some(vec!["tenant-a".to_string()]);
        assert_eq!(first_salted, Some(expect));
        // Same placeholder ids, different images: blocks 1-2 (tokens 20..44) differ.
        let image = |id: &str| HashKeys {
            cache_salt: None,
            mm: vec![MmItem {
                identifier: id.into(),
                offset: 20,
                len: 24,
            }],
        };
        // Block 0 (no image) is the unsalted prompt's: it hits.
        assert_eq!(run(&mut e, image("img-1")), 16);
        assert_eq!(run(&mut e, image("img-1")), 96);
        assert_eq!(run(&mut e, image("img-2")), 16);
        let keys: Vec<ExtraKeysOf> = e
            .pool
            .take_events()
            .into_iter()
            .filter_map(|ev| match ev {
                KvEvent::BlockStored { extra_keys, .. } => Some(extra_keys),
                _ => None,
            })
            .collect();
        let img2 = keys.last().cloned().flatten().unwrap();
        assert_eq!(img2[0], Some(vec!["img-2".to_string()]));
        assert_eq!(img2[1], Some(vec!["img-2".to_string()]));
        assert!(img2[2..].iter().all(Option::is_none));
    }

    type ExtraKeysOf = crate::events::ExtraKeys;

    #[test]
    fn offload_placeholders_follow_gpu_stores_in_the_next_batch() {
        let mut c = cfg(100, 32, 8);
        c.offload_cpu_blocks = 3;
        let mut e = Engine::new(c, vec![5]);
        let (_, _rx) = req(&mut e, (0..70).collect(), 1);
        let mut batches = Vec::new();
        loop {
            let p = e.schedule();
            batches.push(e.pool.take_events());
            if p.items.is_empty() {
                break;
            }
            e.complete(&p, Instant::now());
        }
        let gpu = |b: &Vec<KvEvent>| -> Vec<BlockHash> {
            b.iter()
                .filter_map(|ev| match ev {
                    KvEvent::BlockStored {
                        block_hashes,
                        medium: Medium::Gpu,
                        ..
                    } => Some(block_hashes.clone()),
                    _ => None,
                })
                .flatten()
                .collect()
        };
        let cpu_stored = |b: &Vec<KvEvent>| -> Vec<BlockHash> {
            b.iter()
                .filter_map(|ev| match ev {
                    KvEvent::BlockStored {
                        block_hashes,
                        medium: Medium::Cpu,
                        token_ids,
                        block_size: 0,
                        group: None,
                        ..
                    } if token_ids.is_empty() => Some(block_hashes.clone()),
                    _ => None,
                })
                .flatten()
                .collect()
        };
        // Step 2's batch holds its own GPU stores and the CPU placeholders of step 1's.
        assert_eq!(cpu_stored(&batches[1]), gpu(&batches[0]));
        assert!(!gpu(&batches[1]).is_empty());
        // A 3-block CPU tier: the 4th offloaded block evicts the first (CPU removal, no group).
        let all_gpu: Vec<BlockHash> = batches.iter().flat_map(gpu).collect();
        let cpu_removed: Vec<BlockHash> = batches
            .iter()
            .flatten()
            .filter_map(|ev| match ev {
                KvEvent::BlockRemoved {
                    block_hashes,
                    medium: Medium::Cpu,
                    group: None,
                } => Some(block_hashes[0]),
                _ => None,
            })
            .collect();
        assert_eq!(all_gpu.len(), 4);
        assert_eq!(cpu_removed, vec![all_gpu[0]]);
    }

    #[test]
    fn sliding_window_group_drops_blocks_full_attention_keeps() {
        let mut c = cfg(48, 256, 16);
        c.sliding_windows = vec![32, 64];
        let mut e = Engine::new(c, (10..26).collect());
        let (ledger, _rxs) = pressured_run(&mut e, 2);
        ledger.assert_no_artefacts();
        // Both groups store every block; the window group holds far fewer at the end.
        let held = |g: u32| ledger.live.keys().filter(|(x, _)| *x == g).count();
        assert_eq!(held(0), e.pool.num_cached());
        assert!(
            held(1) < held(2) && held(2) < held(0),
            "{} {} {}",
            held(0),
            held(1),
            held(2)
        );
        let groups = e.pool.groups();
        assert_eq!(groups[0].kind, Some("full_attention"));
        assert_eq!(
            (groups[1].idx, groups[1].kind, groups[1].sliding_window),
            (1, Some("sliding_window"), Some(32))
        );
    }
}
