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
