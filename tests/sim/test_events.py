"""KV events of real requests, received by a pyzmq SUB (both bind directions) and the replay ROUTER."""

import json
import time

import requests
import zmq

import simcluster
from vllmsim_zmq import Sub, decode

MODEL = "Qwen/Qwen3-32B"
STORED_KEYS = ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
               "lora_name", "group_idx"]


def complete(url, prompt, max_tokens=1):
    r = requests.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": max_tokens},
                      timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def stored(events):
    return [e for e in events if e["type"] == "BlockStored"]


def n_stored_blocks(evs):
    return sum(len(e["block_hashes"]) for e in stored(evs))


def test_events_describe_cached_blocks(sim_bin, sub):
    with simcluster.SimCluster(pods=1, time_scale=0.02, max_num_batched_tokens=32,
                               kv_events_endpoint=sub.endpoint) as c:
        url, topic = c.urls[0], c.topics[0]
        assert topic == f"kv@{c.addresses[0]}@{MODEL}"
        prompt = list(range(1000, 1100))  # 100 tokens: 6 full blocks, computed in chunks of 32
        complete(url, prompt)
        evs, msgs = sub.events(lambda got: n_stored_blocks(got) >= 6)
        assert all(t == topic for t, _, _ in msgs)
        assert [s for _, s, _ in msgs] == list(range(len(msgs)))  # seq from 0, one batch per step
        assert all(isinstance(b[0], float) and b[2] == 0 for _, _, b in msgs)
        st = stored(evs)
        for e in st:
            assert list(e.keys()) == STORED_KEYS
            assert e["block_size"] == 16 and e["medium"] == "GPU" and e["lora_name"] is None
            assert e["lora_id"] is None and e["group_idx"] == 0
            assert len(e["token_ids"]) == 16 * len(e["block_hashes"])
            assert all(0 <= h < 2**64 for h in e["block_hashes"])
        # token_ids concatenate to the prompt's full blocks; parents chain the events.
        assert sum((e["token_ids"] for e in st), []) == prompt[:96]
        assert st[0]["parent_block_hash"] is None
        for prev, cur in zip(st, st[1:]):
            assert cur["parent_block_hash"] == prev["block_hashes"][-1]
        chain = sum((e["block_hashes"] for e in st), [])
        assert len(set(chain)) == 6

        # A consumer that learnt the chain predicts the hit the pod reports.
        second = prompt[:64] + list(range(2000, 2040))
        r = complete(url, second)
        assert r["usage"]["prompt_tokens_details"]["cached_tokens"] == 64
        evs2, _ = sub.events(lambda got: n_stored_blocks(got) >= 2)
        st2 = stored(evs2)
        assert st2[0]["parent_block_hash"] == chain[3]
        assert st2[0]["token_ids"][:16] == second[64:80]
        # Same tokens after a different prefix hash differently (chained hashes).
        assert not set(sum((e["block_hashes"] for e in st2), [])) & set(chain)

        # Flush → AllBlocksCleared, then the same prompt is cold.
        assert requests.post(url + "/admin/flush", timeout=5).status_code == 200
        evs3, _ = sub.events(lambda got: any(e["type"] == "AllBlocksCleared" for e in got))
        assert evs3[-1] == {"type": "AllBlocksCleared"}
        assert complete(url, prompt)["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_eviction_events_tail_first_lru(sim_bin, sub):
    # 8 blocks only: a second 100-token prompt evicts the first one's blocks, tail first.
    with simcluster.SimCluster(pods=1, time_scale=0.02, num_gpu_blocks=8, kv_events_endpoint=sub.endpoint) as c:
        url = c.urls[0]
        a = list(range(100, 200))
        b = list(range(300, 400))
        complete(url, a)
        evs_a, _ = sub.events(lambda got: n_stored_blocks(got) >= 6)
        chain_a = sum((e["block_hashes"] for e in stored(evs_a)), [])
        complete(url, b)
        evs_b, _ = sub.events(lambda got: n_stored_blocks(got) >= 6)
        removed = [h for e in evs_b if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        for e in evs_b:
            if e["type"] == "BlockRemoved":
                assert list(e.keys()) == ["type", "block_hashes", "medium", "group_idx"] and e["medium"] == "GPU"
        # 7 blocks needed; the free queue holds 1 never-used block, then A's blocks tail first.
        assert removed == [chain_a[5], chain_a[4], chain_a[3], chain_a[2], chain_a[1]]
        # A's first block survived: the pod reports exactly that hit.
        assert complete(url, a)["usage"]["prompt_tokens_details"]["cached_tokens"] == 16


def test_sim_binds_and_sub_connects_per_pod(sim_bin, tmp_path):
    # ipc:// makes vLLM bind (as '*' and '::' do) without opening a network port; pod i binds PATH-i.
    path = tmp_path / "kv"
    with simcluster.SimCluster(pods=2, time_scale=0.02, kv_events_endpoint=f"ipc://{path}") as c:
        s = Sub(bind=False, connect=f"ipc://{path}-1")
        try:
            time.sleep(0.5)  # PUB/SUB join
            complete(c.urls[1], list(range(40)))
            topic, seq, batch = s.get(timeout=5)
            assert topic == c.topics[1] and seq == 0
            assert batch[1][0]["type"] == "BlockStored"
            # Pod 0 publishes on its own port, so nothing from it arrives here.
            complete(c.urls[0], list(range(40)))
            time.sleep(0.3)
            assert s.q.empty()
        finally:
            s.close()


def test_replay_returns_missed_batches(sim_bin):
    # Publish to an endpoint nobody listens on: every batch is missed, and the replay socket has them.
    dead = f"tcp://127.0.0.1:{simcluster.free_port()}"
    with simcluster.SimCluster(pods=1, time_scale=0.02, max_num_batched_tokens=32, kv_events_endpoint=dead,
                               kv_events_replay=True) as c:
        complete(c.urls[0], list(range(100)))  # prefill 32+32+32+4: 3 steps fill blocks → seq 0..2
        ctx = zmq.Context()
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.LINGER, 0)
        d.connect(f"tcp://127.0.0.1:{c.replay_ports[0]}")
        try:
            def replay(start):
                d.send_multipart([b"", start.to_bytes(8, "big")])
                out = []
                while True:
                    assert d.poll(5000), "replay timed out"
                    frames = d.recv_multipart()
                    assert len(frames) == 4 and frames[0] == b""
                    seq = int.from_bytes(frames[2], "big")
                    if seq == 0xFFFFFFFFFFFFFFFF:
                        assert frames[1] == b"" and frames[3] == b""
                        return out
                    assert frames[1].decode() == c.topics[0]
                    out.append((seq, decode(frames[3])))

            full = replay(0)
            assert [s for s, _ in full] == [0, 1, 2]
            toks = sum((e["token_ids"] for _, b in full for e in b[1] if e["type"] == "BlockStored"), [])
            assert toks == list(range(96))
            assert [s for s, _ in replay(2)] == [2]
            assert replay(99) == []
        finally:
            d.close()
            ctx.term()


def test_metrics_prefix_counters_match_events(sim_bin, sub):
    with simcluster.SimCluster(pods=1, time_scale=0.02, kv_events_endpoint=sub.endpoint) as c:
        url = c.urls[0]
        complete(url, list(range(64)))
        complete(url, list(range(64)) + [9] * 16)
        m = requests.get(url + "/metrics", timeout=5).text
        vals = {line.split("{")[0]: float(line.rsplit(" ", 1)[1]) for line in m.splitlines()
                if line and not line.startswith("#") and "_bucket" not in line}
        assert vals["vllm:prefix_cache_queries_total"] == 64 + 80
        assert vals["vllm:prefix_cache_hits_total"] == 0 + 64
        assert json.loads(json.dumps(vals))  # plain numbers


def test_bytes_hashes_when_vllm_env_says_so(sim_bin, sub):
    # VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0: hashes are 32-byte bins whose last 8 bytes are the int form.
    with simcluster.SimCluster(pods=1, time_scale=0.02, kv_events_endpoint=sub.endpoint,
                               env={"VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES": "0"}) as c:
        complete(c.urls[0], list(range(50)))
        evs, _ = sub.events(lambda got: n_stored_blocks(got) >= 3)
        st = stored(evs)
        hs = sum((e["block_hashes"] for e in st), [])
        assert all(isinstance(h, bytes) and len(h) == 32 for h in hs)
        assert st[0]["parent_block_hash"] is None
        for prev, cur in zip(st, st[1:]):
            assert cur["parent_block_hash"] == prev["block_hashes"][-1]
    with simcluster.SimCluster(pods=1, time_scale=0.02, kv_events_endpoint=sub.endpoint) as c:
        complete(c.urls[0], list(range(50)))
        evs, _ = sub.events(lambda got: n_stored_blocks(got) >= 3)
        ints = sum((e["block_hashes"] for e in stored(evs)), [])
        assert [int.from_bytes(h[-8:], "big") for h in hs] == ints
