"""Benchmark profiles: the reference replica (`full`) and a small `quick` one.

`full` is the llm-d "73-capacity" experiment as described in
docs/benchmark-method.md: 8 pods × 307,328 KV tokens (19,208 blocks of 16),
inference-perf shared_prefix 150 groups × 5 prompts, 6,000-token system
prompt, 1,200-token question, 1,000 output tokens (ignore_eos), streaming,
Poisson warm-up 15 QPS × 50 s then 16 stages 3 → 60 QPS of 20–38 s. The
per-stage durations inside 20–38 s are not published in what we could find;
we use 38 s at 3 QPS falling linearly to 20 s at 60 QPS (the 37-capacity
sibling experiment also shortens stages as the rate grows). The client caps
requests in flight (inference-perf workers × per-worker concurrency) at 640,
the cap that docs/benchmark-method.md's cross-check found the published numbers imply.

`sim.time_scale` (wall seconds per simulated second, as vllm-sim's
--time-scale) runs a profile faster than real time: the pods compute in
s × their modelled time, and the load is compressed the same way — each stage
keeps its request count N = int(rate × duration), over round(duration × s)
wall seconds (≥ 1). Every time the report prints is converted back to
simulated seconds (TTFT ÷ s, tok/s × s), so a scaled run reads like the
reference. kvroute's timers (feed polling, learned-entry TTL, snapshot
interval, the indexer's load scrape) are scaled alike (strategies.kvroute_timers); the peers' own
wall-clock timers (tree-eviction intervals) run 1/s times slower relative to
the pods. `full` at s = 0.25 takes ~3 hours
for all 9 strategies on 2 cores (measured: 15–18 min per prefix-aware strategy,
~24 min per cache-blind one); at s = 1, four times that.

`quick` keeps the shape that makes routing matter — the resident prefix set
is ~73% of cluster KV, about three times one pod — at a size that runs in
about two minutes per strategy on 2 shared cores: 4 pods, prompts and KV
scaled down together (same 5:1 prefix:question ratio), 100-token outputs,
three 15-second stages into overload, the same 80-per-pod in-flight cap.
"""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Tuple


@dataclass
class SimSpec:
    pods: int = 8
    model: str = "Qwen/Qwen3-32B"
    served_model_name: str = "Qwen/Qwen3-32B"
    block_size: int = 16
    num_gpu_blocks: int = 19208  # 307,328 tokens per pod
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 40960
    time_scale: float = 1.0  # wall seconds per simulated second (vllm-sim --time-scale)
    extra_args: List[str] = field(default_factory=list)
    # Unequal pods (issue 15): one KV capacity / one relative speed per pod (vllm-sim --num-gpu-blocks,
    # --speed); empty: every pod has num_gpu_blocks and speed 1.
    pod_blocks: List[int] = field(default_factory=list)
    pod_speeds: List[float] = field(default_factory=list)
    # A pod restart (the `restart` profile; run.py PodRestart): pod `restart_pod` (index; -1: none) is killed
    # `restart_after` simulated seconds into stage `restart_stage` (0 = warm-up) and started again on its
    # address `restart_down` simulated seconds later, with an empty cache. Each pod then runs in its own process.
    restart_pod: int = -1
    restart_stage: int = 1
    restart_after: float = 0.0
    restart_down: float = 0.0

    def capacities(self) -> List[int]:
        return list(self.pod_blocks) if self.pod_blocks else [self.num_gpu_blocks] * self.pods

    def speeds(self) -> List[float]:
        return list(self.pod_speeds) if self.pod_speeds else [1.0] * self.pods


@dataclass
class WorkloadSpec:
    groups: int = 150
    prompts_per_group: int = 5
    system_prompt_len: int = 6000
    question_len: int = 1200
    output_len: int = 1000
    seed: int = 42  # prompt text and order (data.shared_prefix.seed)
    arrival_seed: int = 42  # Poisson gaps (ipwrap.py) and inference-perf base_seed
    # Share of requests sent with the priority header `critical` (the rest `sheddable`); 0: no header.
    # Which requests is a function of the prompt text (ipwrap.priority_of), the same for every strategy.
    critical_share: float = 0.0


@dataclass
class ConversationSpec:
    """Multi-turn conversations (inference-perf's `conversation_replay` data) instead of shared_prefix.

    Turn t of a conversation sends its system prompt, every earlier user message and answer, and a
    new user message: each turn's prompt is the previous prompt + the previous answer + a new
    message. Request i of a stage is turn i // conversations of conversation i % conversations, so
    the conversations are interleaved and each turn waits for the previous one's answer. Each stage
    starts new conversations (inference-perf gives every stage its own shared system prompt)."""
    conversations: int = 64
    turns: int = 6
    shared_system_prompt_len: int = 100  # one system prompt every conversation of a stage starts with
    system_prompt_len: int = 1000  # then one of its own (a document, a persona)
    user_len: int = 200  # tokens of each new user message
    output_len: int = 32  # tokens of each answer (ignore_eos)
    seed: int = 42  # text of every prompt and message (conversation_replay.seed)

    def final_context(self) -> int:
        """Tokens of a conversation after its last answer: what a pod holds for it."""
        return self.shared_system_prompt_len + self.system_prompt_len + self.turns * (self.user_len + self.output_len)


@dataclass
class LoadSpec:
    warmup: Tuple[float, int] = (15.0, 50)  # (QPS, seconds) — stage 0, excluded from the table
    stages: List[Tuple[float, int]] = field(default_factory=list)
    num_workers: int = 2  # inference-perf worker processes
    worker_max_concurrency: int = 320  # in-flight cap = workers × this
    request_timeout: float = 900.0  # per request, seconds; a timeout is a counted failure
    stage_teardown_grace_seconds: float = 120.0
    interval: float = 1.0  # seconds between stages (inference-perf load.interval)
    # Load generators, each with its own router (the mesh scenario: one proxy per client, as sidecars).
    # Client k sends at rate / clients with arrival seed arrival_seed + k and every clients-th request
    # of the data set from the k-th (ipwrap.py), so together they send what one client would.
    clients: int = 1

    @property
    def inflight_cap(self) -> int:
        return self.clients * self.num_workers * self.worker_max_concurrency


@dataclass
class Profile:
    name: str
    sim: SimSpec
    workload: WorkloadSpec
    load: LoadSpec
    description: str = ""
    conversation: Optional[ConversationSpec] = None  # multi-turn data instead of workload's shared_prefix
    # Plugin-config values merged over every kvroute strategy's config (nested; run.py --kvroute-set).
    kvroute_overrides: Dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> Dict[str, Any]:
        d = asdict(self)
        if not self.kvroute_overrides:
            del d["kvroute_overrides"]
        d["load"]["inflight_cap"] = self.load.inflight_cap
        if self.sim.time_scale != 1.0:
            d["load"]["wall_stages"] = self.wall_stages()
        return d

    def wall_stages(self) -> List[Tuple[float, int]]:
        """Stages as sent, warm-up first: (rate, duration) compressed by sim.time_scale.

        Each stage keeps its request count N (inference-perf sends int(rate × duration));
        the +0.5 keeps float rounding from losing the last request."""
        s = self.sim.time_scale
        out = []
        for (rate, dur), n in zip([self.load.warmup] + list(self.load.stages), self.expected_requests()):
            if s == 1.0:
                out.append((float(rate), int(dur)))
                continue
            wall = max(1, int(round(dur * s)))
            out.append(((n + 0.5) / wall, wall))
        return out

    def wall_seconds(self, simulated: float) -> float:
        return simulated * self.sim.time_scale

    def expected_requests(self) -> List[int]:
        """Requests inference-perf sends per stage: int(rate × duration), warm-up first (with several
        clients: the sum of theirs, each sending int(rate / clients × duration))."""
        stages = [self.load.warmup] + list(self.load.stages)
        k = self.load.clients
        return [k * int(r / k * d) for r, d in stages]

    def client_stages(self) -> List[Tuple[float, int]]:
        """One client's stages as sent, warm-up first: wall_stages() at 1 / clients of the rate,
        each client sending its int(rate / clients × duration) requests."""
        k = self.load.clients
        if k == 1:
            return self.wall_stages()
        out = []
        for (rate, dur), n in zip([self.load.warmup] + list(self.load.stages), self.expected_requests()):
            if self.sim.time_scale == 1.0:
                out.append((rate / k, int(dur)))
            else:
                wall = max(1, int(round(dur * self.sim.time_scale)))
                out.append(((n // k + 0.5) / wall, wall))
        return out

    def resident_fraction(self) -> float:
        """Resident prefix set / cluster KV tokens: groups × (system + prompts × question), or for
        conversations every conversation of a stage at its full length."""
        w, s = self.workload, self.sim
        if self.conversation:
            resident = self.conversation.conversations * self.conversation.final_context()
        else:
            resident = w.groups * (w.system_prompt_len + w.prompts_per_group * w.question_len)
        return resident / (sum(s.capacities()) * s.block_size)


_FULL_RATES = [3, 10, 15, 20, 22, 25, 30, 35, 40, 43, 46, 49, 52, 55, 57, 60]


def _full_stages() -> List[Tuple[float, int]]:
    n = len(_FULL_RATES)
    return [(float(r), int(round(38 - (38 - 20) * i / (n - 1)))) for i, r in enumerate(_FULL_RATES)]


def full() -> Profile:
    return Profile(
        name="full",
        description="llm-d 73-capacity replica: 8 pods, 150x5 prompts, 6000+1200 -> 1000 tokens, 3->60 QPS",
        sim=SimSpec(),
        workload=WorkloadSpec(),
        load=LoadSpec(warmup=(15.0, 50), stages=_full_stages(), num_workers=2, worker_max_concurrency=320),
    )


def quick() -> Profile:
    # 4 pods × 3,072 blocks × 16 = 196,608 KV tokens in the cluster.
    # Resident set 48 groups × (1,500 + 5 × 300) = 144,000 tokens = 73%.
    # One pod holds 49,152 tokens: ~16 of the 48 prefixes, so random routing
    # thrashes while prefix-aware routing can keep each group on one pod.
    # Stages: 15 QPS (every strategy keeps up), 30 and 45 QPS (beyond what 4
    # pods serve without prefix reuse: random's queues grow, prefix-aware
    # routing's need not). Cap 320 in flight = the reference's 80 per pod.
    return Profile(
        name="quick",
        description="4 pods, 48x5 prompts, 1500+300 -> 100 tokens, 73% resident, Poisson 15/30/45 QPS x 15 s",
        sim=SimSpec(pods=4, num_gpu_blocks=3072, max_model_len=8192),
        workload=WorkloadSpec(groups=48, prompts_per_group=5, system_prompt_len=1500, question_len=300, output_len=100),
        load=LoadSpec(
            warmup=(10.0, 15),
            stages=[(15.0, 15), (30.0, 15), (45.0, 15)],
            num_workers=1,
            worker_max_concurrency=320,
            request_timeout=300.0,
            stage_teardown_grace_seconds=60.0,
        ),
    )


# The scenarios' pods run at an eighth of vllm-sim's default speed (2 × H100 constants): the same
# shapes at an eighth of the request rate, so inference-perf, Envoy and the peers fit on 2 shared
# cores. Speeds the routers are told are relative to the fast pods (1.0 and 0.5).
SCENARIO_SPEED = 0.125


def mixed() -> Profile:
    # 8 pods: 4 fast (3,072 blocks), 4 at half speed with three quarters of the KV (2,304 blocks):
    # 344,064 KV tokens. 96 groups × (1,500 + 5 × 300) = 288,000 resident tokens = 84%. The fleet
    # serves ~6 fast pods' worth: at SCENARIO_SPEED one fast pod sustains ~5 QPS of this workload
    # (overload calibration: 4 pods, 20 QPS), so ~30 QPS; a router blind to speed gives each slow
    # pod 1/8 of the load and saturates them from ~20 QPS. Stages just below that and near ~30.
    # The warm-up (12 QPS x 40 s: 480 requests) sends nearly every group (96 x e^-5 < 1 unseen), as
    # the other profiles' warm-ups do. At 15 s (180 requests) ~15 groups went unseen, and the first
    # measured stage's p90 was their cold prefills: docs/results/2026-12-02-mixed-warm40-6318206.
    fast, slow = 3072, 2304
    return Profile(
        name="mixed",
        description="8 pods (4 at half speed and 3/4 KV), 96x5 prompts, 1500+300 -> 100 tokens, 84% resident, "
                    "Poisson 18/28 QPS x 15 s, 60 s request timeout",
        sim=SimSpec(pods=8, num_gpu_blocks=fast, max_model_len=8192,
                    pod_blocks=[fast] * 4 + [slow] * 4,
                    pod_speeds=[SCENARIO_SPEED] * 4 + [SCENARIO_SPEED / 2] * 4),
        workload=WorkloadSpec(groups=96, prompts_per_group=5, system_prompt_len=1500, question_len=300, output_len=100),
        load=LoadSpec(
            warmup=(12.0, 40),
            stages=[(18.0, 15), (28.0, 15)],
            num_workers=1,
            worker_max_concurrency=320,
            # Cache-blind routers fall far behind at 1/8 speed; the timeout bounds their drain so
            # nine strategies fit in ~40 minutes. A timed-out request is a counted error.
            request_timeout=60.0,
            stage_teardown_grace_seconds=30.0,
        ),
    )


def overload() -> Profile:
    # The quick cluster (4 pods, 3,072 blocks, 73% resident) at SCENARIO_SPEED: half its sustainable
    # rate, then twice it, 20% of requests critical and 80% sheddable (priority header).
    # OVERLOAD_SUSTAINABLE_QPS: the highest rate kvroute precise was measured to serve with no pod
    # queue growing (below). The warm-up (half load, 20 s: 200 requests) sends nearly every group.
    r = OVERLOAD_SUSTAINABLE_QPS
    return Profile(
        name="overload",
        description=f"4 pods, 48x5 prompts, 1500+300 -> 100 tokens, 73% resident, Poisson {r / 2:g} QPS (half load) "
                    f"then {2 * r:g} QPS (2x sustainable) x 20 s, 20% critical / 80% sheddable, 60 s request timeout",
        sim=SimSpec(pods=4, num_gpu_blocks=3072, max_model_len=8192, pod_speeds=[SCENARIO_SPEED] * 4),
        workload=WorkloadSpec(groups=48, prompts_per_group=5, system_prompt_len=1500, question_len=300, output_len=100,
                              critical_share=0.2),
        load=LoadSpec(
            warmup=(r / 2, 20),
            stages=[(r / 2, 20), (2 * r, 20)],
            num_workers=1,
            worker_max_concurrency=320,
            request_timeout=60.0,  # as in mixed(): bounds the cache-blind routers' drain
            stage_teardown_grace_seconds=30.0,
        ),
    )


# Measured (kvroute precise, no priority, stages 8/12/16/20 QPS x 20 s at SCENARIO_SPEED): at 20 QPS
# the pods' longest queue stayed at 0-4 and ended at 0, KV use 61%, TTFT p90 0.40 s; the highest
# rate measured, so the sustainable rate is at least this.
OVERLOAD_SUSTAINABLE_QPS = 20.0

def oversub() -> Profile:
    # Issue 11, "pods evict what approximate mode believes cached": the overload cluster (4 pods × 3,072
    # blocks × 16 = 196,608 KV tokens, SCENARIO_SPEED) under twice quick's prompt set: 98 groups ×
    # (1,500 + 5 × 300) = 294,000 resident tokens = 150 % of cluster KV, so even a perfect partition of
    # the groups over the pods (~24.5 groups = 73,500 tokens per pod against 49,152) must evict.
    # inference-perf walks one seeded permutation of the 490 prompts from its start in every stage;
    # stages of ≥ 240 requests reach ~95 of the 98 groups (a group is missed with (250/490)^5 ≈ 3.5 %),
    # so the prefixes a stage needs are ~1.5 × what one pod's share of KV holds. Rates OVERSUB_RATES
    # (measured, below). Time: 30 + 60 + 60 s of arrivals, + start-up and each stage's drain (a request
    # takes ~10-20 s on these pods), bounded by the 60 s request timeout for a router that falls behind:
    # measured 3.7 min per prefix-aware strategy, so 9 strategies ≈ 35 min.
    low, high = OVERSUB_RATES
    return Profile(
        name="oversub",
        description=f"4 pods, 98x5 prompts, 1500+300 -> 100 tokens, 150% resident, Poisson {low:g} / {high:g} QPS x 60 s, "
                    "60 s request timeout",
        sim=SimSpec(pods=4, num_gpu_blocks=3072, max_model_len=8192, pod_speeds=[SCENARIO_SPEED] * 4),
        workload=WorkloadSpec(groups=98, prompts_per_group=5, system_prompt_len=1500, question_len=300, output_len=100),
        load=LoadSpec(
            warmup=(low, 30),
            stages=[(low, 60), (high, 60)],
            num_workers=1,
            worker_max_concurrency=320,
            request_timeout=60.0,  # as in mixed(): bounds the cache-blind routers' drain
            stage_teardown_grace_seconds=30.0,
        ),
    )


# Calibration, kvroute precise on this profile's cluster and prompts (build/bench runs, 2 shared cores):
# new prompts only at 5 QPS (a 20-s warm-up) held ~25 sequences and 70 % KV per pod with no queue; at
# 6 QPS (warm-up 6 × 40 s, stages 6 QPS × 82 s and 9 QPS × 55 s) every pod's KV stayed at 97-100 %,
# queues reached 24-46, TTFT p90 12.8 s at 6 QPS and 29.5 s at 9 QPS, hit rate 46 % / 41 %. So 4 QPS is
# below what precise sustains and 5 QPS at its edge, where which pod still holds a prefix decides.
# This profile as committed (kvroute precise / approximate): at 4 QPS TTFT p90 1.29 / 1.28 s, hit rate
# 82 % / 82 %; at 5 QPS 1.49 / 1.96 s, 69 % / 63 %, longest queue 5 / 7, KV use up to ~0.9.
OVERSUB_RATES = (4.0, 5.0)


def restart() -> Profile:
    # Issue 11, "one pod restarts mid-run and its cache is gone": the overload cluster (4 pods × 3,072
    # blocks, SCENARIO_SPEED, 48 groups: 73 % resident) at 10 QPS, half the rate it sustains
    # (OVERLOAD_SUSTAINABLE_QPS), the overload profile's half-load stage, where the prefix-aware routers
    # ran at TTFT p90 0.3-0.6 s (docs/results/2026-11-30-overload-b57dbd9; the cache-blind ones are over
    # capacity there already, p90 32-37 s). Stage 1 is the steady state; 8 s into stage 2 pod 0 is killed
    # (SIGKILL) and started again on its address 5 s later, empty; stage 3 is the recovery. The warm-up
    # (200 requests) sends nearly every group, and every stage walks the shuffled 240-prompt set from its
    # first prompt, so the prefixes pod 0 held come back within each stage. Time: 20 + 15 + 25 + 15 s of
    # arrivals, + start-up and each stage's drain, bounded by the 60 s request timeout: measured 3.1 min
    # for kvroute approximate, 5.2 min for Envoy round robin, so 9 strategies ≈ 35 min.
    rate = OVERLOAD_SUSTAINABLE_QPS / 2
    return Profile(
        name="restart",
        description=f"4 pods, 48x5 prompts, 1500+300 -> 100 tokens, 73% resident, Poisson {rate:g} QPS in 3 stages: "
                    "steady, one pod restarted (see Pod restart), recovery; 60 s request timeout",
        sim=SimSpec(pods=4, num_gpu_blocks=3072, max_model_len=8192, pod_speeds=[SCENARIO_SPEED] * 4,
                    restart_pod=0, restart_stage=2, restart_after=8.0, restart_down=5.0),
        workload=WorkloadSpec(groups=48, prompts_per_group=5, system_prompt_len=1500, question_len=300, output_len=100),
        load=LoadSpec(
            warmup=(rate, 20),
            stages=[(rate, 15), (rate, 25), (rate, 15)],
            num_workers=1,
            worker_max_concurrency=320,
            request_timeout=60.0,
            stage_teardown_grace_seconds=30.0,
        ),
    )


def multiturn() -> Profile:
    # The quick cluster (4 pods × 3,072 blocks = 196,608 KV tokens) at SCENARIO_SPEED. 48 conversations
    # of 5 turns: 100 shared + 1,000 own system tokens, then per turn a 200-token message and a
    # 32-token answer; a conversation ends at 1,100 + 5 × 232 = 2,260 tokens, the 48 of a stage at
    # 108,480 = 55 % of the cluster's KV (one pod holds ~21 conversations: 12 each when balanced, all
    # 48 spread over every pod when placed blind). A turn that reaches the pod holding its
    # conversation computes ~250 new tokens, elsewhere its whole prompt (up to ~2,000); a first turn
    # ~1,200. Each stage is 240 requests = the 48 conversations' 5 turns, so no conversation is
    # replayed; a conversation's next turn comes 48 / rate s after the previous one (12 s at 4 QPS,
    # 6 s at 8), longer than a turn takes when its prefix is found (~4-5 s: 32 decode steps of ~0.12 s).
    # Measured with 64 conversations at 5 / 10 QPS: kvroute precise TTFT p90 2.15 / 5.71 s (10 QPS was
    # past its capacity: achieved 7.0), random 6.47 / 11.67 s at ~3 QPS achieved (each turn waits for
    # the previous answer); random took 4.4 min, too long for nine strategies in ~30 min. 8 QPS here
    # asks ~3.5k prefill tokens/s of the pods' ~6.8k when every prefix is found. Measured at this size:
    # precise 0.95 / 2.40 s, 2.7 min; random 3.82 / 5.63 s, 3.6 min.
    conv = ConversationSpec(conversations=48, turns=5, shared_system_prompt_len=100, system_prompt_len=1000,
                            user_len=200, output_len=32)
    n = conv.conversations * conv.turns
    return Profile(
        name="multiturn",
        description=f"4 pods, {conv.conversations} interleaved conversations x {conv.turns} turns, "
                    f"{conv.shared_system_prompt_len}+{conv.system_prompt_len} system tokens, "
                    f"+{conv.user_len} -> {conv.output_len} tokens per turn, 55% resident, Poisson 4/8 QPS "
                    f"({n} requests per stage), 60 s request timeout",
        sim=SimSpec(pods=4, num_gpu_blocks=3072, max_model_len=8192, pod_speeds=[SCENARIO_SPEED] * 4),
        workload=WorkloadSpec(groups=0, prompts_per_group=0, system_prompt_len=0, question_len=0,
                              output_len=conv.output_len),
        conversation=conv,
        load=LoadSpec(
            warmup=(4.0, 12),  # 48 requests: every conversation's first turn (warm-up has its own conversations)
            stages=[(4.0, n // 4), (8.0, n // 8)],
            num_workers=1,
            worker_max_concurrency=320,
            request_timeout=60.0,  # as in mixed(): bounds the cache-blind routers' drain
            stage_teardown_grace_seconds=30.0,
        ),
    )


def mesh() -> Profile:
    # The quick cluster and workload (4 pods × 3,072 blocks, 48 groups × 5 prompts, 73 % resident) at
    # SCENARIO_SPEED, sent by 4 clients, each through its own router (one Envoy per client as a
    # sidecar; one peer router process per client). A group's 5 prompts reach different clients, so
    # a router that learns only from its own decisions sees a quarter of each group's traffic and
    # places the rest blind; the pods' KV events (kvroute precise, one indexer feeding every Envoy)
    # show every router where each prefix is. Stages at 0.4 and 0.8 of the single-gateway sustainable
    # rate (OVERLOAD_SUSTAINABLE_QPS = 20): 2 and 4 QPS per client. Measured at 10 / 20 QPS (build/bench,
    # not published): kvroute precise TTFT p90 0.27 / 4.03 s (20 QPS is its capacity here), 2.8 min;
    # Envoy random 24.2 / 28.5 s with 24 + 149 of 600 requests timed out, 5.0 min: nine strategies
    # would take ~40 min. At 8 / 16 QPS (warm-up 8 × 20 s): TTFT p90 precise 0.26 / 1.20 s, approximate
    # 3.41 / 28.2 s, random 27.8 / 16.1 s (186 of 320 timed out at 16); random 4.3 min, approximate 3.75,
    # precise 2.6. With the 12 s warm-up: random 4.1 min, sglang-router 3.2: ~34 min for nine.
    return Profile(
        name="mesh",
        description="4 pods, 48x5 prompts, 1500+300 -> 100 tokens, 73% resident, 4 clients each with its own "
                    "router, Poisson 8/16 QPS in all x 20 s, 60 s request timeout",
        sim=SimSpec(pods=4, num_gpu_blocks=3072, max_model_len=8192, pod_speeds=[SCENARIO_SPEED] * 4),
        workload=WorkloadSpec(groups=48, prompts_per_group=5, system_prompt_len=1500, question_len=300, output_len=100),
        load=LoadSpec(
            warmup=(8.0, 12),  # 96 of the 240 prompts: all but ~4 of the 48 groups seen (0.6^5 unseen)
            stages=[(8.0, 20), (16.0, 20)],
            num_workers=1,
            worker_max_concurrency=80,  # per client: 320 in flight in all, as the other quick-sized profiles
            request_timeout=60.0,
            stage_teardown_grace_seconds=30.0,
            clients=4,
        ),
    )


PROFILES = {"quick": quick, "full": full, "mixed": mixed, "overload": overload, "oversub": oversub,
            "restart": restart, "multiturn": multiturn, "mesh": mesh}


def get(name: str, overrides: List[str] | None = None) -> Profile:
    """Profile by name, with `section.field=JSON` overrides (e.g. load.stages=[[5,10]])."""
    if name not in PROFILES:
        raise SystemExit(f"unknown profile {name!r}; known: {', '.join(PROFILES)}")
    p = PROFILES[name]()
    for ov in overrides or []:
        key, _, raw = ov.partition("=")
        section, _, fld = key.partition(".")
        target = getattr(p, section, None)
        if target is None or not fld or not hasattr(target, fld):
            raise SystemExit(f"bad override {ov!r}: expected section.field=value "
                             "(sections: sim, workload, load; conversation in the multiturn profile)")
        try:
            val = json.loads(raw)
        except json.JSONDecodeError:
            val = raw
        if fld in ("stages",):
            val = [tuple(x) for x in val]
        if fld == "warmup":
            val = tuple(val)
        setattr(target, fld, copy.deepcopy(val))
    if not (isinstance(p.sim.time_scale, (int, float)) and 0 < p.sim.time_scale <= 1):
        raise SystemExit(f"sim.time_scale must be in (0, 1], got {p.sim.time_scale!r}")
    p.sim.time_scale = float(p.sim.time_scale)
    if not (isinstance(p.load.clients, int) and p.load.clients >= 1):
        raise SystemExit(f"load.clients must be an integer >= 1, got {p.load.clients!r}")
    if p.conversation and p.conversation.conversations % p.load.clients:
        # Client k keeps every clients-th request (ipwrap.py): whole conversations only when they divide evenly.
        raise SystemExit(f"conversation.conversations ({p.conversation.conversations}) must be a multiple of "
                         f"load.clients ({p.load.clients})")
    if p.sim.restart_pod >= p.sim.pods or (p.sim.restart_pod >= 0 and not 0 <= p.sim.restart_stage <= len(p.load.stages)):
        raise SystemExit(f"sim.restart_pod {p.sim.restart_pod} / sim.restart_stage {p.sim.restart_stage}: the pod must be "
                         f"one of the {p.sim.pods} and the stage 0 (warm-up) .. {len(p.load.stages)}")
    return p
