"""Model behaviour through the HTTP interface: cost model (cold vs warm TTFT), queueing, real tokenizer."""

import concurrent.futures
import random
import time

import pytest
import requests

import simcluster

SCALE = 0.2  # wall seconds per simulated second


def test_cold_vs_warm_ttft_matches_cost_model(sim_bin):
    # Defaults: Qwen3-32B on 2×H100 cost model. Cold 7,200-token prompt ≈ 0.6 s (one 7,200-token step:
    # 13 ms + 7,200 × 73.7 µs + attention 7,200 × 3,600 × 2.36 ns); warm (6,000 cached) ≈ 0.12 s.
    rng = random.Random(1)
    system = [rng.randrange(1000, 100000) for _ in range(6000)]
    q1 = [rng.randrange(1000, 100000) for _ in range(1200)]
    q2 = [rng.randrange(1000, 100000) for _ in range(1200)]
    with simcluster.SimCluster(pods=1, time_scale=SCALE) as c:
        cold = pod_ttft(c, system + q1)
        warm = pod_ttft(c, system + q2)
    assert 0.55 <= cold <= 0.75, cold
    assert 0.10 <= warm <= 0.20, warm


def pod_ttft(cluster, prompt):
    """Simulated seconds to first token as the pod reports it (vllm:time_to_first_token_seconds,
    taken on the simulated clock): a busy client machine does not inflate it."""
    name = "vllm:time_to_first_token_seconds"
    before = cluster.metric(0, name + "_sum")
    r = requests.post(cluster.urls[0] + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200
    return cluster.metric(0, name + "_sum") - before


def test_queueing_when_max_num_seqs_reached(sim_bin):
    # Each pair of requests decodes for 2,000 steps (≈ 1.3 s wall at this scale), so the queue
    # is still full when scraped.
    with simcluster.SimCluster(pods=1, time_scale=0.05, max_num_seqs=2) as c:
        url = c.urls[0]
        with concurrent.futures.ThreadPoolExecutor(6) as ex:
            futs = [ex.submit(requests.post, url + "/v1/completions",
                              json={"prompt": [i + 1] * 32, "max_tokens": 2000}, timeout=60) for i in range(6)]
            time.sleep(0.3)
            m = requests.get(url + "/metrics", timeout=5).text
            for f in futs:
                assert f.result().status_code == 200
        line = lambda n: next(l for l in m.splitlines() if l.startswith(n + "{"))  # noqa: E731
        assert float(line("vllm:num_requests_running").rsplit(" ", 1)[1]) == 2
        assert float(line("vllm:num_requests_waiting").rsplit(" ", 1)[1]) == 4
        assert float(line("vllm:kv_cache_usage_perc").rsplit(" ", 1)[1]) > 0


def test_per_pod_capacities(sim_bin):
    with simcluster.SimCluster(pods=2, time_scale=0.02, num_gpu_blocks=[64, 8]) as c:
        assert c.capacities == [64, 8]
        for url, blocks in zip(c.urls, c.capacities):
            m = requests.get(url + "/metrics", timeout=5).text
            assert f'num_gpu_blocks="{blocks}"' in m
        big = {"prompt": list(range(200)), "max_tokens": 10}  # 210 tokens = 14 blocks
        assert requests.post(c.urls[0] + "/v1/completions", json=big, timeout=10).status_code == 200
        r = requests.post(c.urls[1] + "/v1/completions", json=big, timeout=10)
        assert r.status_code == 400 and "KV blocks" in r.json()["error"]["message"]


@pytest.fixture(scope="module")
def tokenizer_path():
    return simcluster.ensure_tokenizer()


def test_real_tokenizer_matches_huggingface_and_chat_agrees(sim_bin, tokenizer_path):
    tokenizers = pytest.importorskip("tokenizers")
    hf = tokenizers.Tokenizer.from_file(str(tokenizer_path))
    texts = ["Hello world, this is a test.", "  leading spaces\nand\ttabs", "Ünïcödé — 日本語のテキスト 🙂",
             "def f(x):\n    return x ** 2  # code"]
    with simcluster.SimCluster(pods=1, time_scale=0.02, tokenizer=str(tokenizer_path)) as c:
        url = c.urls[0]
        for text in texts:
            tok = requests.post(url + "/tokenize", json={"prompt": text}, timeout=10).json()
            assert tok["tokens"] == hf.encode(text).ids, text
        msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "How many tokens is this?"}]
        t = requests.post(url + "/tokenize", json={"messages": msgs}, timeout=10).json()
        rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHow many tokens is this?<|im_end|>\n" \
                   "<|im_start|>assistant\n"
        assert t["tokens"] == hf.encode(rendered, add_special_tokens=False).ids
        r = requests.post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 3}, timeout=10).json()
        assert r["usage"]["prompt_tokens"] == t["count"]
        again = requests.post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 3}, timeout=10).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == (t["count"] - 1) // 16 * 16
        assert r["choices"][0]["message"]["content"].strip()
