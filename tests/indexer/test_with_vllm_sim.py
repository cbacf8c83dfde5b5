"""The indexer fed by the project's simulated vLLM pods (integration/vllm-sim):
real requests produce KV events over ZMQ; the feed must hold kvroute's hashes of
the prompt blocks, the pods' load, and follow a cache flush. The indexer starts
after a pod has already published (if those batches are lost, the indexer
replays the pod's history from seq 0)."""

import json
import sys
import urllib.request

import indexer_harness as h
from indexer_harness import wait_for

sys.path.insert(0, str(h.REPO / "integration"))
from simcluster import SimCluster  # noqa: E402


def complete(url: str, model: str, prompt: list[int]) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_vllm_sim_pods_feed_the_index():
    zport = h.free_port()
    with SimCluster(pods=2, kv_events_endpoint=f"tcp://127.0.0.1:{zport}", kv_events_replay=True,
                    time_scale=0.05, num_gpu_blocks=2000) as sim:
        assert sim.model == h.MODEL
        # Pod 0 caches tokens 0..63 before any indexer listens: those events are lost on the PUB side.
        prompt = list(range(64)) + list(range(70000, 70010))
        complete(sim.urls[0], sim.model, prompt)
        flags = ["--scrape-interval-ms", "200"]
        for addr, rport in zip(sim.addresses, sim.replay_ports):
            flags += ["--pod", f"{addr}@{sim.model}", "--replay-endpoint", f"{addr}=tcp://127.0.0.1:{rport}"]
        with h.Indexer(*flags, zmq_port=zport) as ix:
            feed = ix.feed()
            # More traffic on pod 0: its first event seen has seq > 0 -> replay from 0 fetches the history.
            pod0 = sim.addresses[0]

            n = iter(range(1000))

            def has_prefix():
                # A new prompt each time, so that each request stores new blocks (an event).
                start = 100_000 + 200 * next(n)
                complete(sim.urls[0], sim.model, list(range(start, start + 100)))
                got = feed.of(pod0)
                return all(x in got for x in h.KEYS_0_63_QWEN)

            wait_for(has_prefix, timeout=20, what="prompt blocks of pod 0 in the feed")
            assert all(feed.of(pod0)[x] == "gpu" for x in h.KEYS_0_63_QWEN)
            assert not any(x in feed.of(sim.addresses[1]) for x in h.KEYS_0_63_QWEN)
            assert ix.metric("kvroute_indexer_decode_errors_total") == 0
            assert ix.metric("kvroute_indexer_stored_unknown_parent_total") == 0
            # The pre-indexer batches either reached the indexer once it bound (the PUB
            # queues while connecting) or were lost (joined mid-stream, or a gap while the
            # subscription was in flight) and replayed: every loss was replayed.
            losses = ix.metric("kvroute_indexer_joined_midstream_total") + ix.metric("kvroute_indexer_seq_gaps_total")
            assert ix.metric("kvroute_indexer_replays_total", result="ok") == losses
            assert ix.metric("kvroute_indexer_seq_gaps_unrecovered_total") == 0

            def loaded():
                feed.poll()
                return all(p["capacity_blocks"] == 2000 for p in feed.pods)

            wait_for(loaded, what="scraped capacity")
            # A cache flush (AllBlocksCleared) empties the pod in the feed.
            sim.flush()
            wait_for(lambda: feed.of(pod0) == {}, what="flush clears pod 0")


def complete_salted(url: str, model: str, prompt: list[int], salt: str) -> dict:
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 2, "cache_salt": salt}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_real_vllm_shapes_from_the_simulator_reach_the_index():
    """The simulated pods publish what real vLLM does with CPU offloading and a hybrid
    (sliding-window) model: offload placeholders inside GPU batches, one event per KV-cache group,
    cache_salt in block 0's extra keys. The indexer decodes all of it, routes the full-attention
    group only, and scopes salted blocks apart from unsalted ones."""
    zport, port = h.free_port(), h.free_port()
    pod = f"127.0.0.1:{port}"
    # The indexer binds first: the simulator's publisher connects once, at start.
    with h.Indexer("--pod", f"{pod}@{h.MODEL}", zmq_port=zport) as ix:
        with SimCluster(pods=1, port=port, kv_events_endpoint=f"tcp://127.0.0.1:{zport}", time_scale=0.05,
                        num_gpu_blocks=64, kv_offload_cpu_blocks=256, sliding_window_groups=[32]) as sim:
            assert sim.addresses == [pod]
            feed = ix.feed()
            # A salted prompt of tokens 0..63 first: its blocks must not be the unsalted ones.
            n = iter(range(1000))

            def salted_stored():
                complete_salted(sim.urls[0], sim.model, list(range(64)) + [90000 + next(n)], "tenant-a")
                return ix.metric("kvroute_indexer_blocks_not_routed_total") > 0 and len(feed.of(pod)) >= 4
            wait_for(salted_stored, timeout=20, what="salted blocks and window-group events")
            assert not any(x in feed.of(pod) for x in h.KEYS_0_63_QWEN)

            def unsalted_stored():
                complete(sim.urls[0], sim.model, list(range(64)) + [95000 + next(n)])
                return all(x in feed.of(pod) for x in h.KEYS_0_63_QWEN)
            wait_for(unsalted_stored, timeout=20, what="unsalted prompt blocks in the feed")

            # Evictions under 64 GPU blocks move blocks to the CPU tier: placeholders arrive.
            def offloaded():
                start = 200_000 + 500 * next(n)
                complete(sim.urls[0], sim.model, list(range(start, start + 400)))
                return ix.metric("kvroute_indexer_placeholder_blocks_total", result="applied") > 0
            wait_for(offloaded, timeout=30, what="offload placeholders applied")
            assert ix.metric("kvroute_indexer_decode_errors_total") == 0
            assert ix.metric("kvroute_indexer_events_skipped_total") == 0
