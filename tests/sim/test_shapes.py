"""Real vLLM event shapes behind flags, end to end through the binary: CPU-offload placeholders,
cache_salt, image parts (extra_keys), sliding-window KV-cache groups."""

import queue

import requests

import simcluster

MODEL = "Qwen/Qwen3-32B"


def post(url, path, body):
    r = requests.post(url + path, json={"model": MODEL, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def subscribed(c, sub):
    """Waits until the pod's publisher reaches the SUB (a connecting PUB drops what it sends before that), then
    flushes the pod and drains up to its AllBlocksCleared, so the test starts cold and receives every later batch."""
    for attempt in range(100):
        post(c.urls[0], "/v1/completions", {"prompt": [7 + attempt] * 17, "max_tokens": 1})
        try:
            sub.get(timeout=0.2)
            break
        except queue.Empty:
            continue
    assert requests.post(c.urls[0] + "/admin/flush", timeout=10).status_code == 200
    sub.events(lambda got: any(e["type"] == "AllBlocksCleared" for e in got))


def cached(resp):
    return resp["usage"]["prompt_tokens_details"]["cached_tokens"]


def stored(events, medium="GPU", group=None):
    return [e for e in events if e["type"] == "BlockStored" and e["medium"] == medium
            and (group is None or e.get("group_idx") == group)]


def hashes(events):
    return [h for e in events for h in e["block_hashes"]]


def test_offload_placeholders_join_gpu_batches(sim_bin, sub):
    with simcluster.SimCluster(pods=1, time_scale=0.02, max_num_batched_tokens=32, kv_offload_cpu_blocks=4,
                               kv_events_endpoint=sub.endpoint) as c:
        subscribed(c, sub)
        post(c.urls[0], "/v1/completions", {"prompt": list(range(1000, 1100)), "max_tokens": 1})
        evs, msgs = sub.events(lambda got: len(hashes(stored(got, "CPU"))) >= 6)
        gpu, cpu = stored(evs), stored(evs, "CPU")
        for e in cpu:
            assert list(e) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                               "medium", "lora_name"]
            assert e["token_ids"] == [] and e["block_size"] == 0 and e["parent_block_hash"] is None
        # Placeholders name blocks the GPU stored earlier, by hash only, in the same batches as GPU events.
        assert hashes(cpu) == hashes(gpu)
        assert any(stored(b[1]) and stored(b[1], "CPU") for _, _, b in msgs)
        # The 4-block CPU tier evicted the first two offloaded blocks: CPU removals without a group.
        removed = [e for e in evs if e["type"] == "BlockRemoved"]
        assert all(list(e) == ["type", "block_hashes", "medium"] and e["medium"] == "CPU" for e in removed)
        assert hashes(removed) == hashes(gpu)[:2]


def test_cache_salt_isolates_tenants(sim_bin, sub):
    prompt = list(range(2000, 2100))
    with simcluster.SimCluster(pods=1, time_scale=0.02, kv_events_endpoint=sub.endpoint) as c:
        subscribed(c, sub)
        url = c.urls[0]
        assert cached(post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "cache_salt": "a"})) == 0
        evs, _ = sub.events(lambda got: len(hashes(stored(got))) >= 6)
        keys = stored(evs)[0]["extra_keys"]
        assert keys[0] == ["a"] and all(k is None for k in keys[1:])
        assert list(stored(evs)[0])[8] == "extra_keys"
        assert cached(post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "cache_salt": "b"})) == 0
        assert cached(post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1})) == 0
        assert cached(post(url, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "cache_salt": "a"})) == 96
        msgs = [{"role": "user", "content": "same words for every tenant " * 8}]
        assert cached(post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "cache_salt": "a"})) == 0
        assert cached(post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1, "cache_salt": "b"})) == 0
        bad = requests.post(url + "/v1/completions", json={"prompt": prompt, "cache_salt": ""}, timeout=10)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"


def test_image_parts_key_their_blocks(sim_bin, sub):
    text = "Describe the picture below in plain words, " * 6

    def chat(url, image):
        msgs = [{"role": "user", "content": [{"type": "text", "text": text},
                                             {"type": "image_url", "image_url": {"url": image}}]}]
        return post(url, "/v1/chat/completions", {"messages": msgs, "max_tokens": 1})

    with simcluster.SimCluster(pods=1, time_scale=0.02, kv_events_endpoint=sub.endpoint) as c:
        subscribed(c, sub)
        url = c.urls[0]
        first = chat(url, "https://example.com/cat.png")
        n = first["usage"]["prompt_tokens"]
        evs, _ = sub.events(lambda got: len(hashes(stored(got))) >= n // 16)
        keys = [k for e in stored(evs) for k in e["extra_keys"]]
        with_image = [k for k in keys if k is not None]
        # 64 placeholder tokens span 4-5 blocks, each keyed by the image's identifier.
        assert 4 <= len(with_image) <= 5 and len({tuple(k) for k in with_image}) == 1
        same = cached(chat(url, "https://example.com/cat.png"))
        other = cached(chat(url, "https://example.com/dog.png"))
        assert same == (n - 1) // 16 * 16
        # The text before the image still hits; the blocks of a different image do not.
        assert 0 < other < same and other % 16 == 0


def test_sliding_window_group_events(sim_bin, sub):
    with simcluster.SimCluster(pods=1, time_scale=0.02, max_num_batched_tokens=32, sliding_window_groups=[32],
                               kv_events_endpoint=sub.endpoint) as c:
        subscribed(c, sub)
        post(c.urls[0], "/v1/completions", {"prompt": list(range(3000, 3100)), "max_tokens": 1})
        evs, _ = sub.events(lambda got: len(hashes(stored(got, group=1))) >= 6)
        full, sliding = stored(evs, group=0), stored(evs, group=1)
        assert all(e["kv_cache_spec_kind"] == "full_attention" and "kv_cache_spec_sliding_window" not in e
                   for e in full)
        assert all(e["kv_cache_spec_kind"] == "sliding_window" and e["kv_cache_spec_sliding_window"] == 32
                   for e in sliding)
        assert hashes(full) == hashes(sliding)
        # Blocks that left the 32-token window go from group 1 only; group 0 keeps them all.
        removed = [e for e in evs if e["type"] == "BlockRemoved"]
        assert removed and all(e["group_idx"] == 1 for e in removed)
        assert set(hashes(removed)) < set(hashes(full))
