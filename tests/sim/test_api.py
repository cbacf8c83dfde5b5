"""vllm-sim HTTP interface: OpenAI endpoints, tokenize/render, models, errors, metrics, pod header."""

import concurrent.futures
import json

import openai
import pytest
import requests
from prometheus_client.parser import text_string_to_metric_families

import simcluster

MODEL = "Qwen/Qwen3-32B"


@pytest.fixture(scope="module")
def cluster(sim_bin):
    with simcluster.SimCluster(pods=2, time_scale=0.02, max_model_len=1000, num_gpu_blocks=512,
                               served_model_name=[MODEL, "alias"]) as c:
        yield c


def post(url, path, body, **kw):
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return requests.post(url + path, data=data, headers={"content-type": "application/json"}, timeout=30, **kw)


def test_health_models_and_pod_header(cluster):
    for url, addr in zip(cluster.urls, cluster.addresses):
        r = requests.get(url + "/health", timeout=5)
        assert r.status_code == 200 and r.headers["x-vllm-sim-pod"] == addr
        m = requests.get(url + "/v1/models", timeout=5)
        assert m.headers["x-vllm-sim-pod"] == addr
        ids = [d["id"] for d in m.json()["data"]]
        assert ids == [MODEL, "alias"]
        assert m.json()["data"][0]["max_model_len"] == 1000
        nf = requests.get(url + "/nope", timeout=5)
        assert nf.status_code == 404 and nf.headers["x-vllm-sim-pod"] == addr


def test_chat_usage_agrees_with_tokenize_and_render(cluster):
    url = cluster.urls[0]
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name three colours."}]
    tok = post(url, "/tokenize", {"model": MODEL, "messages": msgs}).json()
    assert tok["count"] == len(tok["tokens"]) > 10 and tok["max_model_len"] == 1000
    render = post(url, "/v1/chat/completions/render", {"messages": msgs}).json()
    assert render["token_ids"] == tok["tokens"]
    r = post(url, "/v1/chat/completions", {"model": "alias", "messages": msgs, "max_tokens": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "alias"
    assert body["usage"]["prompt_tokens"] == tok["count"]
    assert body["usage"]["completion_tokens"] == 7
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"].strip()
    # Parts content renders like a plain string.
    parts = [{"role": "system", "content": [{"type": "text", "text": "You are terse."}]}, msgs[1]]
    assert post(url, "/tokenize", {"messages": parts}).json()["tokens"] == tok["tokens"]
    # Prompt as text: /tokenize prompt and completions usage agree.
    t2 = post(url, "/tokenize", {"prompt": "one two three"}).json()
    c = post(url, "/v1/completions", {"prompt": "one two three", "max_tokens": 2}).json()
    assert c["usage"]["prompt_tokens"] == t2["count"]


def test_pretokenized_requests_use_ids_and_hit_cache(cluster):
    url = cluster.urls[1]
    ids = list(range(5000, 5100))
    a = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 1}).json()
    assert a["usage"]["prompt_tokens"] == 100 and a["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    # Chat with prompt_token_ids: the ids are used as given (and hit the blocks the first request cached).
    b = post(url, "/v1/chat/completions", {"messages": [{"role": "user", "content": "ignored"}],
                                           "prompt_token_ids": ids[:80] + [1, 2, 3], "max_tokens": 1}).json()
    assert b["usage"]["prompt_tokens"] == 83
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 80
    # Several prompts (list of id lists) → one choice each.
    m = post(url, "/v1/completions", {"prompt": [ids[:20], ids[:40]], "max_tokens": 3}).json()
    assert [ch["index"] for ch in m["choices"]] == [0, 1]
    assert m["usage"]["prompt_tokens"] == 60 and m["usage"]["completion_tokens"] == 6
    render = post(url, "/v1/completions/render", {"prompt": [ids[:5], ids[:7]]}).json()
    assert [r["token_ids"] for r in render] == [ids[:5], ids[:7]]


def test_stream_framing_raw(cluster):
    url = cluster.urls[0]
    r = post(url, "/v1/completions", {"prompt": [1] * 40, "max_tokens": 40, "stream": True,
                                      "stream_options": {"include_usage": True}}, stream=True)
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers["x-vllm-sim-pod"] == cluster.addresses[0]
    raw = r.content.decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events)
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 40
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    # stream interval 16: first token alone, then coarse chunks.
    texts = [c["choices"][0]["text"] for c in chunks[:-2]]
    assert len(texts) < 10 and len(texts[0].split()) == 1
    assert sum(len(t.split()) for t in texts) == 40


def test_openai_client_streaming_and_plain(cluster):
    client = openai.OpenAI(base_url=cluster.urls[0] + "/v1", api_key="sk-none", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=33,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    text, usage, finish, roles = "", None, None, []
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.role:
                roles.append(ch.delta.role)
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert roles == ["assistant"]
    assert usage.completion_tokens == 33 and finish == "length"
    assert len(text.split()) == 33
    comp = client.completions.create(model=MODEL, prompt="tell me", max_tokens=5, stream=True)
    pieces = [c.choices[0].text for c in comp if c.choices]
    assert len("".join(pieces).split()) == 5
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert plain.usage.completion_tokens == 4 and plain.choices[0].message.role == "assistant"
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL, "alias"]
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])


BAD = [
    ("/v1/chat/completions", b'{"model": "x"', 400, "BadRequestError"),
    ("/v1/chat/completions", b"[1, 2]", 400, "BadRequestError"),
    ("/v1/chat/completions", {"model": MODEL}, 400, "BadRequestError"),
    ("/v1/chat/completions", {"model": MODEL, "messages": "hi"}, 400, "BadRequestError"),
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, 400, "BadRequestError"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"content": "no role"}]}, 400, "BadRequestError"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": "5"}, 400, "BadRequestError"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": -1}, 400, "BadRequestError"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, 400, "BadRequestError"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream": "yes"}, 400, "BadRequestError"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "stream_options": {"include_usage": True}}, 400, "BadRequestError"),
    ("/v1/chat/completions", {"model": "gpt-4", "messages": [{"role": "user", "content": "x"}]}, 404, "NotFoundError"),
    ("/v1/chat/completions", {"model": 5, "messages": [{"role": "user", "content": "x"}]}, 400, "BadRequestError"),
    ("/v1/completions", {"model": MODEL}, 400, "BadRequestError"),
    ("/v1/completions", {"model": MODEL, "prompt": 12}, 400, "BadRequestError"),
    ("/v1/completions", {"model": MODEL, "prompt": [1, -2]}, 400, "BadRequestError"),
    ("/v1/completions", {"model": MODEL, "prompt": []}, 400, "BadRequestError"),
    ("/v1/completions", {"model": MODEL, "prompt": list(range(1200))}, 400, "BadRequestError"),
    ("/v1/completions", {"model": MODEL, "prompt": list(range(900)), "max_tokens": 200}, 400, "BadRequestError"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "NotFoundError"),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "n": 2}, 400, "BadRequestError"),
    ("/tokenize", {"model": MODEL}, 400, "BadRequestError"),
    ("/tokenize", b"not json", 400, "BadRequestError"),
]


@pytest.mark.parametrize("path,body,status,kind", BAD)
def test_bad_input_gets_openai_error(cluster, path, body, status, kind):
    r = post(cluster.urls[0], path, body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] == kind and err["code"] == status and err["message"]
    assert r.headers["x-vllm-sim-pod"] == cluster.addresses[0]


def test_bad_requests_do_not_disturb_others(cluster):
    url = cluster.urls[0]

    def good():
        return post(url, "/v1/completions", {"prompt": [7] * 50, "max_tokens": 60}).json()["usage"]["completion_tokens"]

    def bad(i):
        return post(url, "/v1/completions", BAD[i % len(BAD)][1] if BAD[i % len(BAD)][0] == "/v1/completions" else b"{").status_code

    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        goods = [ex.submit(good) for _ in range(4)]
        bads = [ex.submit(bad, i) for i in range(40)]
        assert all(f.result() in (400, 404) for f in bads)
        assert [f.result() for f in goods] == [60] * 4
    # A client that disconnects mid-stream is aborted; the pod keeps serving.
    r = post(url, "/v1/completions", {"prompt": [3] * 30, "max_tokens": 500, "stream": True}, stream=True)
    next(r.iter_content(64))
    r.close()
    assert good() == 60
    assert requests.get(url + "/health", timeout=5).status_code == 200


def test_metrics_parse_as_prometheus(cluster):
    url = cluster.urls[1]
    post(url, "/v1/completions", {"prompt": list(range(64)), "max_tokens": 3})
    post(url, "/v1/completions", {"prompt": list(range(64)), "max_tokens": 3})
    r = requests.get(url + "/metrics", timeout=5)
    assert r.headers["content-type"].startswith("text/plain")
    fams = {f.name: f for f in text_string_to_metric_families(r.text)}
    for name, typ in [("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                      ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:prefix_cache_queries", "counter"),
                      ("vllm:prefix_cache_hits", "counter"), ("vllm:generation_tokens", "counter"),
                      ("vllm:time_to_first_token_seconds", "histogram"), ("vllm:num_preemptions", "counter")]:
        assert fams[name].type == typ, name
    samples = {(s.name, s.labels.get("le")): s.value for f in fams.values() for s in f.samples}
    assert samples[("vllm:time_to_first_token_seconds_count", None)] >= 2
    assert samples[("vllm:time_to_first_token_seconds_bucket", "+Inf")] == samples[("vllm:time_to_first_token_seconds_count", None)]
    assert samples[("vllm:prefix_cache_hits_total", None)] >= 48  # second request hit 3 of its 4 blocks
    assert samples[("vllm:num_requests_running", None)] == 0
    labels = fams["vllm:num_requests_running"].samples[0].labels
    assert labels["model_name"] == MODEL


def test_flush_resets_counters_and_cache(cluster):
    url = cluster.urls[0]
    ids = list(range(7000, 7064))
    post(url, "/v1/completions", {"prompt": ids, "max_tokens": 1})
    again = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 1}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 48
    f = requests.post(url + "/admin/flush", timeout=5)
    assert f.status_code == 200 and f.json()["flushed"] is True
    m = requests.get(url + "/metrics", timeout=5).text
    assert 'vllm:prefix_cache_queries_total{engine="0",model_name="Qwen/Qwen3-32B"} 0.0' in m
    assert 'vllm:time_to_first_token_seconds_count{engine="0",model_name="Qwen/Qwen3-32B"} 0' in m
    cold = post(url, "/v1/completions", {"prompt": ids, "max_tokens": 1}).json()
    assert cold["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
