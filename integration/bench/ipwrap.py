"""Run inference-perf with the few patches below; first, seeded Poisson arrivals.

inference-perf 0.7.0 seeds its prompt order (`data.shared_prefix.seed`) but its
PoissonLoadTimer / ConstantLoadTimer draw inter-arrival gaps from
`np.random.default_rng()` with no seed, so two runs of the same config send the
same prompts at different instants. The benchmark compares routers on *the
same* request sequence, so this launcher replaces those two generators with
ones drawn from `SeedSequence(KVROUTE_BENCH_ARRIVAL_SEED)`, in creation order
(the timers are created in the main process, one per stage, in stage order, so
the order is deterministic). Beyond the patches this docstring lists,
inference-perf is the released code: the workers, the HTTP client, TTFT timing
and the report generator.

Usage: python ipwrap.py -c config.yaml   (same arguments as `inference-perf`)
The arrival schedule actually produced is written to
$KVROUTE_BENCH_SCHEDULE_OUT (JSON lines: stage timer index, offset seconds) so
the harness can prove every strategy saw the same schedule.

With $KVROUTE_BENCH_CRITICAL_SHARE (a fraction) and $KVROUTE_BENCH_PRIORITY_HEADER
set, every request carries that header: `critical` for the share of prompts
`priority_of` picks (a hash of the prompt text, so the same requests for every
strategy), `sheddable` for the rest. Routers that know no priority ignore it.

With $KVROUTE_BENCH_CLIENT=k/K (the mesh scenario: K load generators, one
router each), this client keeps item k, k + K, k + 2K, ... of the data
generator's sequence, so the K clients together send the requests one client
would have sent, and a group's prompts reach different clients. With
$KVROUTE_BENCH_STAGE_BARRIER (a directory) as well, a client starts each stage
only when all K have finished the previous one (a file per client and stage),
so the K clients' stages begin together, as one client's would; a client that
dies leaves the others waiting until the harness's time limit stops them.

Output tokens (`_install_server_output_count`): for a streamed answer whose final
chunk reports `usage.completion_tokens`, that number is the request's output
token count; inference-perf 0.7.0 re-tokenizes the whole answer text for it.
Both give the same count on these pods (every request of a run counted 1,000
either way), but re-tokenizing was 31 % of a client worker's CPU in the full
profile, and on a 2-core machine shared with the pods and the router that CPU
delays the client's dispatches and its reading of first tokens. An answer
without usage is still re-tokenized.

Multi-turn data (`conversation_replay`): inference-perf 0.7.0 clears its
sessions between stages and re-primes each with its system prompt as context
but not as `system_prompt`; with a tokenizer configured, a turn's prompt is
built from `system_prompt` and the history only, so from the second stage on
every turn would be sent as its bare user message, without its conversation.
`_install_conversation_reprime_fix` passes the system prompt as both, as the
generator does when it first builds a session.
"""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import json
import os
import sys
import threading

import numpy as np


def _install_seeded_timers(seed: int, schedule_out: str | None) -> None:
    from inference_perf.loadgen import load_timer

    root = np.random.SeedSequence(seed)
    lock = threading.Lock()
    counter = {"n": 0}

    def next_rng() -> np.random.Generator:
        with lock:
            n = counter["n"]
            counter["n"] += 1
        # spawn_key makes child n independent of how many were drawn before.
        child = np.random.SeedSequence(entropy=root.entropy, spawn_key=(n,))
        return np.random.default_rng(child)

    orig_poisson_init = load_timer.PoissonLoadTimer.__init__
    orig_constant_init = load_timer.ConstantLoadTimer.__init__

    def poisson_init(self, rate, duration):  # type: ignore[no-untyped-def]
        orig_poisson_init(self, rate, duration)
        self._rand = next_rng()

    def constant_init(self, rate, duration):  # type: ignore[no-untyped-def]
        orig_constant_init(self, rate, duration)
        self._rand = next_rng()

    load_timer.PoissonLoadTimer.__init__ = poisson_init  # type: ignore[method-assign]
    load_timer.ConstantLoadTimer.__init__ = constant_init  # type: ignore[method-assign]

    if schedule_out:
        # Record the offsets (relative to the stage's start) the Poisson timer yields.
        orig_start = load_timer.PoissonLoadTimer.start_timer
        fh = open(schedule_out, "a", buffering=1)
        stage_idx = {"n": 0}

        def start_timer(self, initial=None):  # type: ignore[no-untyped-def]
            idx = stage_idx["n"]
            stage_idx["n"] += 1
            gen = orig_start(self, initial)
            base = initial
            for t in gen:
                if base is None:
                    base = t
                fh.write(json.dumps({"timer": idx, "rate": self._rate, "t": round(t - base, 6)}) + "\n")
                yield t

        load_timer.PoissonLoadTimer.start_timer = start_timer  # type: ignore[method-assign]


def priority_of(prompt: str, critical_share: float) -> str:
    """`critical` for a `critical_share` of prompts, by the hash of their text; else `sheddable`."""
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big")
    return "critical" if h / 2**64 < critical_share else "sheddable"


def _install_priority_header(header: str, critical_share: float) -> None:
    from inference_perf.client.modelserver import openai_client

    session = openai_client.openAIModelServerClientSession
    orig = session.process_request

    async def process_request(self, data, *args, **kwargs):  # type: ignore[no-untyped-def]
        prompt = getattr(data, "prompt", "")
        data.headers = {**(data.headers or {}), header: priority_of(str(prompt), critical_share)}
        return await orig(self, data, *args, **kwargs)

    session.process_request = process_request  # type: ignore[method-assign]


def client_of(spec: str) -> tuple[int, int]:
    """(k, K) from "k/K" with 0 <= k < K."""
    k, _, n = spec.partition("/")
    k_i, n_i = int(k), int(n)
    if not 0 <= k_i < n_i:
        raise ValueError(f"client {spec!r}: expected k/K with 0 <= k < K")
    return k_i, n_i


def _install_client_split(k: int, clients: int) -> None:
    from inference_perf.datagen.replay.conversation_replay_datagen import ConversationReplayDataGenerator
    from inference_perf.datagen.synthetic.shared_prefix_datagen import SharedPrefixDataGenerator

    for cls in (SharedPrefixDataGenerator, ConversationReplayDataGenerator):
        orig = cls.get_data

        def get_data(self, _orig=orig):  # type: ignore[no-untyped-def]
            for item in _orig(self):
                if item.data_index % clients == k:
                    yield item

        cls.get_data = get_data  # type: ignore[method-assign]


def _install_stage_barrier(directory: str, k: int, clients: int) -> None:
    from inference_perf.loadgen.load_generator import LoadGenerator

    orig = LoadGenerator.run_stage

    async def run_stage(self, stage_id, *args, **kwargs):  # type: ignore[no-untyped-def]
        mark = os.path.join(directory, "stage{}.client{}")
        open(mark.format(stage_id, k), "w").close()
        while not all(os.path.exists(mark.format(stage_id, j)) for j in range(clients)):
            await asyncio.sleep(0.02)
        return await orig(self, stage_id, *args, **kwargs)

    LoadGenerator.run_stage = run_stage  # type: ignore[method-assign]


def _install_conversation_reprime_fix() -> None:
    from inference_perf.datagen.replay import conversation_replay_datagen as crd

    orig = crd.ConversationReplayDataGenerator._new_session

    def new_session(self, user_session_id, context, system_prompt=""):  # type: ignore[no-untyped-def]
        return orig(self, user_session_id, context, system_prompt or context)

    crd.ConversationReplayDataGenerator._new_session = new_session  # type: ignore[method-assign]


# The answer text `parse_sse_stream` last returned in this task, and the
# server's count of its tokens.
_SERVED_OUTPUT: contextvars.ContextVar[tuple[str, int] | None] = contextvars.ContextVar(
    "served_output", default=None)


def _install_server_output_count() -> None:
    from inference_perf.apis import chat, completion
    from inference_perf.utils.custom_tokenizer import CustomTokenizer

    for module in (chat, completion):
        async def parse(response, *args, _orig=module.parse_sse_stream, **kwargs):  # type: ignore[no-untyped-def]
            parsed = await _orig(response, *args, **kwargs)
            text, usage = parsed[0], parsed[4]
            served = (usage or {}).get("completion_tokens")
            _SERVED_OUTPUT.set((text, served) if isinstance(served, int) else None)
            return parsed

        module.parse_sse_stream = parse  # type: ignore[attr-defined]

    orig_count = CustomTokenizer.count_tokens

    def count_tokens(self, text, *args, **kwargs):  # type: ignore[no-untyped-def]
        served = _SERVED_OUTPUT.get()
        if served is not None and served[0] is text:
            return served[1]
        return orig_count(self, text, *args, **kwargs)

    CustomTokenizer.count_tokens = count_tokens  # type: ignore[method-assign]


def main() -> None:
    seed = int(os.environ.get("KVROUTE_BENCH_ARRIVAL_SEED", "0"))
    _install_seeded_timers(seed, os.environ.get("KVROUTE_BENCH_SCHEDULE_OUT"))
    _install_conversation_reprime_fix()
    _install_server_output_count()
    if os.environ.get("KVROUTE_BENCH_CLIENT"):
        k, clients = client_of(os.environ["KVROUTE_BENCH_CLIENT"])
        _install_client_split(k, clients)
        if os.environ.get("KVROUTE_BENCH_STAGE_BARRIER"):
            _install_stage_barrier(os.environ["KVROUTE_BENCH_STAGE_BARRIER"], k, clients)
    share = float(os.environ.get("KVROUTE_BENCH_CRITICAL_SHARE", "0") or 0)
    if share > 0:
        _install_priority_header(os.environ.get("KVROUTE_BENCH_PRIORITY_HEADER", "x-kvroute-priority"), share)
    from inference_perf.main import main_cli

    sys.argv[0] = "inference-perf"
    main_cli()


if __name__ == "__main__":
    main()
