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
//! After the step's time (`CostModel`) has passed (`complete`): computed
//! tokens are committed, newly full blocks are cached (BlockStored), and every
//! request whose tokens are all computed samples one token.

use std::collections::{HashMap, VecDeque};
use std::time::Instant;

use tokio::sync::mpsc;

use crate::events::KvEvent;
use crate::hash::{extend_chain, BlockHash};
use crate::kv::BlockPool;
use crate::metrics::Histogram;

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
}

impl Default for CostModel {
    fn default() -> Self {
        Self {
            step_overhead_ms: 13.0,
            prefill_us_per_token: 73.7,
            attn_ns_per_pair: 2.36,
            kv_read_ns_per_token: 119.0,
        }
    }
}

impl CostModel {
    /// Seconds for a step that computes, per scheduled request, `n` new tokens over `ctx` already-computed ones.
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
        s
    }
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

pub struct NewRequest {
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
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
    num_cached_blocks: usize,
    cached_tokens: Option<usize>,
    arrival: Instant,
    first_token: bool,
    unsent: Vec<u32>,
    sink: Sink,
}

/// Counters exported on /metrics (reset by /admin/flush).
#[derive(Debug, Clone)]
pub struct Counters {
    pub prefix_queries: u64,
    pub prefix_hits: u64,
    pub prompt_tokens: u64,
    pub generation_tokens: u64,
    pub preemptions: u64,
    pub requests_finished: u64,
    pub requests_aborted: u64,
    pub ttft: Histogram,
    pub e2e: Histogram,
}

impl Default for Counters {
    fn default() -> Self {
        Self {
            prefix_queries: 0,
            prefix_hits: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            preemptions: 0,
            requests_finished: 0,
            requests_aborted: 0,
            ttft: Histogram::new(crate::metrics::TTFT_BUCKETS),
            e2e: Histogram::new(crate::metrics::E2E_BUCKETS),
        }
    }
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
    pub counters: Counters,
}

impl Engine {
    pub fn new(cfg: EngineConfig, output_ids: Vec<u32>) -> Self {
        let pool = BlockPool::new(cfg.num_gpu_blocks);
        let output_ids = if output_ids.is_empty() {
            vec![1000]
        } else {
            output_ids
        };
        Self {
            cfg,
            pool,
            reqs: HashMap::new(),
            waiting: VecDeque::new(),
            running: Vec::new(),
            next_id: 0,
            output_ids,
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
        let mut hashes = Vec::with_capacity(prompt_len / self.cfg.block_size.max(1) + 1);
        extend_chain(&mut hashes, &r.prompt, self.cfg.block_size, None);
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
                num_cached_blocks: 0,
                cached_tokens: None,
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

    pub fn schedule(&mut self) -> Plan {
        self.reap_aborted();
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
            plan.items.push((id, ctx, n, decode));
            budget -= n;
            i += 1;
        }
        if !preempted {
            while budget > 0 && self.running.len() < self.cfg.max_num_seqs {
                let Some(&id) = self.waiting.front() else {
                    break;
                };
                let Some(r) = self.reqs.get(&id) else {
                    self.waiting.pop_front();
                    continue;
                };
                let bs = self.cfg.block_size;
                let max_hit_blocks = (r.tokens.len().saturating_sub(1)) / bs;
                let hits = if r.num_computed == 0 {
                    self.pool
                        .cached_prefix(&r.hashes[..max_hit_blocks.min(r.hashes.len())])
                } else {
                    Vec::new()
                };
                let hit_tokens = hits.len() * bs;
                let n = (r.tokens.len() - r.num_computed - hit_tokens).min(budget);
                // allocate_slots counts from num_computed: account for the hits first.
                if let Some(r) = self.reqs.get_mut(&id) {
                    r.num_computed += hit_tokens;
                }
                if !self.allocate_slots(id, n, &hits) {
                    if let Some(r) = self.reqs.get_mut(&id) {
                        r.num_computed -= hit_tokens;
                    }
                    break;
                }
                self.waiting.pop_front();
                self.running.push(id);
                if let Some(r) = self.reqs.get_mut(&id) {
                    r.num_cached_blocks = hits.len();
                    if r.cached_tokens.is_none() {
                        r.cached_tokens = Some(hit_tokens);
                        self.counters.prefix_queries += r.tokens.len() as u64;
                        self.counters.prefix_hits += hit_tokens as u64;
                        self.counters.prompt_tokens += r.prompt_len as u64;
                    }
                    plan.items.push((id, r.num_computed, n, false));
                }
                budget -= n;
            }
        }
        plan.seconds = self
            .cfg
            .cost
            .step_seconds(plan.items.iter().map(|(_, c, n, d)| (*c, *n, *d)));
        plan
    }

    /// Commits a step scheduled by `schedule` once its time has passed.
    pub fn complete(&mut self, plan: &Plan, now: Instant) {
        let bs = self.cfg.block_size;
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
            // Cache the blocks that became full.
            let full = (r.num_computed / bs).min(r.block_ids.len());
            if full > r.num_cached_blocks {
                extend_chain(&mut r.hashes, &r.tokens[..full * bs], bs, None);
                let first = r.num_cached_blocks;
                let mut ev_hashes = Vec::with_capacity(full - first);
                for b in first..full {
                    let (Some(&bid), Some(&h)) = (r.block_ids.get(b), r.hashes.get(b)) else {
                        break;
                    };
                    self.pool.cache_block(bid, h);
                    ev_hashes.push(h);
                }
                let parent = if first > 0 {
                    r.hashes.get(first - 1).copied()
                } else {
                    None
                };
                self.pool.push_event(KvEvent::BlockStored {
                    block_hashes: ev_hashes,
                    parent_block_hash: parent,
                    token_ids: r.tokens[first * bs..full * bs].to_vec(),
                    block_size: bs as u32,
                    lora_id: None,
                    lora_name: None,
                });
                r.num_cached_blocks = full;
            }
            if r.num_computed < r.tokens.len() {
                continue; // chunked prefill not finished: nothing sampled
            }
            let tok = self.output_ids[r.num_output % self.output_ids.len()];
            r.tokens.push(tok);
            r.num_output += 1;
            r.unsent.push(tok);
            self.counters.generation_tokens += 1;
            let first = !r.first_token;
            if first {
                r.first_token = true;
                self.counters
                    .ttft
                    .observe(now.duration_since(r.arrival).as_secs_f64() / scale);
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
                    .observe(now.duration_since(r.arrival).as_secs_f64() / scale);
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

    /// Admin flush: drop the prefix cache (AllBlocksCleared) and reset counters.
    pub fn flush(&mut self) {
        self.pool.reset_prefix_cache();
        self.counters = Counters::default();
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
        }
    }

    type Rx = mpsc::UnboundedReceiver<(usize, Out)>;

    fn req(e: &mut Engine, prompt: Vec<u32>, max_tokens: usize) -> (u64, Rx) {
        let (tx, rx) = mpsc::unbounded_channel();
        let id = e.add(
            NewRequest {
                prompt,
                max_tokens,
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
        let expect = crate::hash::chain(&(0..64).collect::<Vec<u32>>(), 16, None);
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
        e.flush();
        assert_eq!(e.pool.num_cached(), 0);
        assert_eq!(e.counters.generation_tokens, 0);
        assert_eq!(e.pool.take_events(), vec![KvEvent::AllBlocksCleared]);
    }
}
