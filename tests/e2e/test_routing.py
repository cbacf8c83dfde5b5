"""kvroute in the real Envoy at --concurrency 2 in front of 4 simulated vLLM pods (issue 2)."""

import json
import threading
import time
from contextlib import contextmanager

import requests

from e2elib import MODEL, POD, chat, decision, gateway, unique_system


def test_shared_prefix_sticks_to_one_pod_across_workers(gateway):
    system = unique_system()
    pods = []
    for i in range(16):
        r = chat(gateway, system, f"question {i}")
        assert r.status_code == 200, r.text
        d = decision(r)
        assert d["pod"] == r.headers[POD], "the pod kvroute chose is the pod that answered"
        pods.append(d["pod"])
        if i > 0:
            assert d["matched"] >= d["total"] - 2, d["raw"]
        else:
            # The singleton publishes what the first taught; every worker reads it there.
            gateway.wait_for_index_flush()
    assert len(set(pods)) == 1, pods
    # Both workers' VMs (and the main thread's) see each other's load.
    assert gateway.stats("wasmcustom.kvroute.peers")["wasmcustom.kvroute.peers"] >= 1


def test_one_worker_sticks_before_the_flush(sims):
    """On one connection (one worker), a prefix routed a moment ago sticks before the singleton's
    flush publishes it (index.flush_ms at its 1 s maximum here): the worker keeps its recent
    decisions for two flush periods."""
    with gateway(sims.addresses, {"index": {"flush_ms": 1000}}) as envoy:
        system = unique_system()
        with requests.Session() as one_connection:
            def ask(question):
                body = {"model": MODEL, "max_tokens": 2,
                        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}
                r = one_connection.post(envoy.url + "/v1/chat/completions", json=body, timeout=30)
                assert r.status_code == 200, r.text
                return decision(r)
            first = ask("one")
            again = ask("two")
        assert (again["pod"], again["matched"] >= again["total"] - 2) == (first["pod"], True), again["raw"]


def test_decisions_are_logged_at_debug_level_only(sims):
    """Each decision's log line names the model and the pod when Envoy logs at debug level; at
    info the filter neither formats nor writes it (it reads the proxy's level every duty tick)."""
    for level, logged in (("debug", True), ("info", False)):
        with gateway(sims.addresses, log_level=level) as envoy:
            r = chat(envoy, unique_system(), "q")
            assert r.status_code == 200, r.text
            line = f"model {MODEL} → pod={decision(r)['pod']}; matched="
            envoy.stop()  # Envoy flushes its log file on exit
            assert (line in envoy.log_text()) == logged, (level, envoy.log_tail())


def test_distinct_prefixes_spread_over_pods(gateway):
    pods = {decision(chat(gateway, unique_system(), "q"))["pod"] for _ in range(24)}
    assert len(pods) >= 3, pods


def test_hot_pod_sheds_new_prefixes(gateway, sims):
    """A long stream keeps its pod loaded; new prefixes go elsewhere meanwhile."""
    with long_stream(gateway, unique_system(words=400)) as hot_pod:
        seen = [decision(chat(gateway, unique_system(words=20), "q")) for _ in range(8)]
    others = [d["pod"] for d in seen]
    assert hot_pod not in others, (hot_pod, [d["raw"] for d in seen])


def test_four_workers_share_their_load_through_the_singletons_sum(sims):
    """From four serving workers the singleton sums their load into one key, which a deciding
    worker reads instead of its three peers' keys. What it finds there is right: every worker
    counts the long stream another one routed, and a finished stream's load is released. Once
    nothing is in flight, the singleton stops rewriting the sum."""
    with gateway(sims.addresses, {"max_body_bytes": 262144}, concurrency=4) as envoy:
        hot_system = unique_system(words=400)
        with long_stream(envoy, hot_system) as hot_pod:
            envoy.wait_for_index_flush()
            seen = [decision(chat(envoy, hot_system, f"q{i}")) for i in range(8)]
        on_hot = [d for d in seen if d["pod"] == hot_pod]
        assert len(on_hot) >= 6, seen
        # Probes are sequential: what a probe's worker counts in flight there is the stream.
        assert all(d["inflight_requests"] >= 1 for d in on_hot), [d["raw"] for d in on_hot]
        assert_released(envoy, hot_system, "after the stream")
        sum_reads = envoy.settled_stats("wasmcustom.kvroute.peer").get("wasmcustom.kvroute.peer.sum_reads", 0)
        assert sum_reads > 0
        # Idle, the singleton writes no sum: the last one said no load anywhere. Before, it
        # rewrote that sum every 200 ms. Its counted snapshots go stale within 1 s of the last
        # request (one write each), so the count starts after that.
        def sums_written() -> int:
            return envoy.stats("kvroute.peer.sums_written").get("wasmcustom.kvroute.peer.sums_written", 0)

        time.sleep(1.5)
        before = sums_written()
        assert before > 0
        time.sleep(2)
        assert sums_written() - before <= 1


@contextmanager
def long_stream(gateway, system: str):
    """A 400-token stream with this system prompt, in flight on its pod (yielded) while the block
    runs."""
    done = threading.Event()
    holder = {}

    def stream():
        body = {"model": MODEL, "max_tokens": 400, "stream": True, "ignore_eos": True,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": "write"}]}
        with requests.post(gateway.url + "/v1/chat/completions", json=body, stream=True, timeout=60) as r:
            holder["pod"] = r.headers[POD]
            for _ in r.iter_lines():
                pass
        done.set()

    t = threading.Thread(target=stream)
    t.start()
    deadline = time.monotonic() + 10
    while "pod" not in holder and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "pod" in holder, "the long stream never started"
    yield holder["pod"]
    still_streaming = not done.is_set()
    t.join(timeout=60)
    assert still_streaming, "the long stream ended before the probes: not a test of its load"


def test_pretokenized_requests_route_on_token_blocks(gateway):
    base = list(range(1000, 1000 + 16 * 20))
    first = None
    for tail in range(5):
        body = {"model": MODEL, "prompt": base + [7, tail], "max_tokens": 2}
        r = requests.post(gateway.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        d = decision(r)
        assert d["domain"] == "tokens"
        assert d["total"] == 20
        if first is None:
            first = d["pod"]
            gateway.wait_for_index_flush()
        else:
            assert (d["pod"], d["matched"]) == (first, 20), d["raw"]


def test_streaming_passes_through_and_releases_load(gateway):
    system = unique_system()
    body = {"model": MODEL, "max_tokens": 40, "stream": True, "stream_options": {"include_usage": True},
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "stream please"}]}
    with requests.post(gateway.url + "/v1/chat/completions", json=body, stream=True, timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[len(b"data: "):]) for e in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 40
    # The stream ended: its pod shows nothing in flight for the next request with that prefix.
    assert_released(gateway, system, "again")


def assert_released(gateway, system: str, question: str) -> None:
    """The pod holding `system` soon shows no request in flight, on whichever worker decides: the
    other worker hears of the release in the deciding worker's next load share (<= 20 ms)."""
    deadline = time.monotonic() + 5
    while True:
        d = decision(chat(gateway, system, question))
        if d["inflight_requests"] == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert d["inflight_requests"] == 0, d["raw"]


def test_client_abort_mid_stream_releases_load(gateway):
    system = unique_system()
    body = {"model": MODEL, "max_tokens": 300, "stream": True, "ignore_eos": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "long"}]}
    r = requests.post(gateway.url + "/v1/chat/completions", json=body, stream=True, timeout=30)
    next(r.iter_lines())
    r.close()  # reset mid-stream
    assert_released(gateway, system, "after abort")


def test_forged_destination_header_is_ignored(gateway, sims):
    system = unique_system()
    home = decision(chat(gateway, system, "first"))["pod"]
    gateway.wait_for_index_flush()
    forged = next(a for a in sims.addresses if a != home)
    for i in range(6):
        r = chat(gateway, system, f"q{i}", headers={"x-gateway-destination-endpoint": forged})
        assert r.headers[POD] == home
    # On paths kvroute does not route, the forged value is stripped too: Envoy's LB spreads.
    seen = set()
    for _ in range(24):
        r = requests.get(gateway.url + "/v1/models", headers={"x-gateway-destination-endpoint": forged}, timeout=10)
        assert r.status_code == 200
        seen.add(r.headers[POD])
    assert len(seen) >= 2, seen


def fallback(gateway, cause):
    return gateway.stats(f"wasmcustom.kvroute.fallback.{cause}").get(f"wasmcustom.kvroute.fallback.{cause}", 0)


def test_malformed_bodies_fail_open(gateway):
    url = gateway.url + "/v1/chat/completions"
    before = fallback(gateway, "malformed")
    r = requests.post(url, data=b"{not json", headers={"content-type": "application/json"}, timeout=10)
    assert POD in r.headers and r.status_code == 400, "served by a pod, which rejects it as vLLM would"
    assert r.headers["x-kvroute-decision"] == "fallback=malformed"
    r = requests.post(url, data="\udcff".encode("utf-8", "surrogatepass"), timeout=10)
    assert POD in r.headers
    r = requests.post(url, json={"model": MODEL, "messages": "not a list"}, timeout=10)
    assert POD in r.headers
    assert fallback(gateway, "malformed") >= before + 3
    before_prompt = fallback(gateway, "no_prompt")
    r = requests.post(url, json={"model": MODEL}, timeout=10)
    assert POD in r.headers
    assert fallback(gateway, "no_prompt") == before_prompt + 1


def test_oversize_body_fails_open_and_is_served(gateway):
    before = fallback(gateway, "body_too_large")
    big = "x " * 200_000  # 400 KB > max_body_bytes 256 KiB in this gateway
    r = chat(gateway, big, "q", max_tokens=1)
    assert POD in r.headers
    assert r.status_code in (200, 400), r.text[:200]
    assert r.headers["x-kvroute-decision"] == "fallback=body_too_large"
    assert fallback(gateway, "body_too_large") == before + 1


def test_unknown_model_fails_open(gateway):
    r = requests.post(gateway.url + "/v1/completions", json={"model": "nope", "prompt": "hi"}, timeout=10)
    # Every pod serves every model in this config, so kvroute routes it; the pod answers 404.
    assert r.status_code == 404 and POD in r.headers


def test_stats_explain_decisions(gateway):
    stats = gateway.settled_stats("wasmcustom.kvroute")
    for name in ["requests", "decision.prefix", "decision.load", "blocks.matched", "blocks.total",
                 "index.blocks", "index.bytes", "fallback.malformed"]:
        assert f"wasmcustom.kvroute.{name}" in stats, name
    assert stats["wasmcustom.kvroute.requests"] > 0
    assert stats["wasmcustom.kvroute.blocks.matched"] > 0
