"""Fail open for real, through the real Envoy with the shipped gateway config (envoy/gateway.yaml):
bodies far beyond max_body_bytes are served as Envoy alone serves them, a killed pod costs no
request, refused requests teach the index nothing, and the pod that really served is reported."""

import http.server
import json
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import yaml

from e2elib import MODEL, POD, SERVED, chat, decision, gateway, require_wasm, unique_system, wait_for
from envoyctl import GATEWAY_PRECISE, EnvoyProcess, drop_route_response_headers, render_gateway
from simcluster import PodFleet

MiB = 1 << 20


@pytest.fixture(scope="module")
def pods():
    """Four pods, one process each, so that one can be killed and restarted alone."""
    with PodFleet(pods=4, time_scale=0.2) as fleet:
        yield fleet


@pytest.fixture(scope="module")
def envoy(pods):
    # The shipped configuration as it is (buffer limits, retries, outlier detection), only the
    # ports and pods are this test's.
    with gateway(pods.addresses) as proxy:
        yield proxy


def big_body(megabytes: int) -> bytes:
    # A field vLLM ignores carries the bulk, so the pod answers quickly.
    head = f'{{"model": "{MODEL}", "max_tokens": 2, "messages": [{{"role": "user", "content": "hi"}}], "pad": "'
    return head.encode() + b"x" * (megabytes * MiB) + b'"}'


def background_load(envoy, stop: threading.Event) -> threading.Thread:
    """Small routed requests on two connections while a test runs: Envoy then reads big bodies
    in large slices, which is when buffering used to overflow."""
    def loop():
        with requests.Session() as s:
            while not stop.is_set():
                try:
                    s.post(envoy.url + "/v1/chat/completions", timeout=10,
                           json={"model": MODEL, "max_tokens": 2,
                                 "messages": [{"role": "user", "content": "load " * 200}]})
                except requests.RequestException:
                    pass
    threads = [threading.Thread(target=loop, daemon=True) for _ in range(2)]
    for t in threads:
        t.start()
    return threads


@pytest.mark.parametrize("megabytes", [9, 20, 50, 200])
def test_bodies_beyond_max_body_bytes_are_served_as_without_kvroute(envoy, megabytes):
    body = big_body(megabytes)
    too_large_before = envoy.stats("downstream_rq_too_large").get("http.llm_gateway.downstream_rq_too_large", 0)
    skipped_before = envoy.stats("kvroute.fallback.body_too_large").get(
        "wasmcustom.kvroute.fallback.body_too_large", 0)
    stop = threading.Event()
    threads = background_load(envoy, stop)
    results = []
    try:
        for encoding in ("content-length", "chunked"):
            data = body if encoding == "content-length" else (
                body[i:i + 256 * 1024] for i in range(0, len(body), 256 * 1024))
            r = requests.post(envoy.url + "/v1/chat/completions", data=data, timeout=120,
                              headers={"content-type": "application/json"})
            results.append((encoding, r.status_code, r.headers.get("x-kvroute-decision")))
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert [status for _, status, _ in results] == [200, 200], results
    assert all(d == "fallback=body_too_large" for _, _, d in results), results
    stats = envoy.stats("downstream_rq_too_large")
    assert stats.get("http.llm_gateway.downstream_rq_too_large", 0) == too_large_before
    skipped = envoy.stats("kvroute.fallback.body_too_large")["wasmcustom.kvroute.fallback.body_too_large"]
    assert skipped - skipped_before == 2


def test_a_body_larger_than_one_read_but_within_max_body_bytes_is_routed(envoy):
    """3 MiB: above the listener's 1 MiB buffer, below max_body_bytes (4 MiB). Buffering it is
    allowed by the route's request_body_buffer_limit, so kvroute routes it, sent either way."""
    body = big_body(3)
    for data in (body, (body[i:i + 256 * 1024] for i in range(0, len(body), 256 * 1024))):
        r = requests.post(envoy.url + "/v1/chat/completions", data=data, timeout=60,
                          headers={"content-type": "application/json"})
        assert r.status_code == 200
        assert decision(r)["pod"] == r.headers[POD]


def test_the_served_pod_is_reported(envoy):
    r = chat(envoy, unique_system(), "who serves?")
    assert r.status_code == 200
    assert r.headers[SERVED] == r.headers[POD] == decision(r)["pod"]


def test_without_the_routes_header_the_served_pod_comes_from_the_upstream_address(pods):
    """The shipped route sets the served header and kvroute reads it (served_header_from_route).
    A route that does not: kvroute reads Envoy's upstream.address and adds the header, once."""
    require_wasm()
    cfg = yaml.safe_load(render_gateway(pods.addresses, {"served_header_from_route": False}))
    assert drop_route_response_headers(cfg) == [SERVED]
    with EnvoyProcess(yaml.safe_dump(cfg)) as proxy:
        proxy.wait_for_peers()
        r = chat(proxy, unique_system(), "who serves?")
        assert r.status_code == 200
        assert r.headers[SERVED] == r.headers[POD] == decision(r)["pod"]


def test_a_refused_request_teaches_the_index_nothing(envoy):
    """An unknown model gets the pod's 404: its prompt must not stick to that pod."""
    system = unique_system(400)
    refused = []
    for i in range(3):
        r = chat(envoy, system, f"probe {i}", model="no-such-model")
        assert r.status_code == 404
        refused.append(decision(r))
        envoy.wait_for_index_flush()  # every worker would see what it taught
    # Nothing was learned, so no later request matched what the first one sent.
    assert all(d["matched"] == 0 for d in refused), refused
    ok = chat(envoy, system, "real")
    assert ok.status_code == 200
    assert decision(ok)["matched"] == 0


def test_a_killed_pod_costs_no_request_and_routing_returns_when_it_is_back(envoy, pods):
    groups = [unique_system(120) for _ in range(8)]
    address = pods.addresses[0]
    log = []  # (seconds since start, status, chosen, served)
    started = time.monotonic()

    def send(i: int, fresh: bool = False):
        try:
            r = chat(envoy, unique_system(120) if fresh else groups[i % len(groups)], f"question {i}")
            chosen = decision(r)["pod"] if "x-kvroute-decision" in r.headers else None
            log.append((time.monotonic() - started, r.status_code, chosen, r.headers.get(SERVED)))
        except requests.RequestException as e:
            log.append((time.monotonic() - started, repr(e), None, None))

    def run_for(seconds: float, rate: float = 20.0, first: int = 0, fresh: bool = False) -> int:
        i = first
        with ThreadPoolExecutor(max_workers=16) as pool:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                pool.submit(send, i, fresh)
                i += 1
                time.sleep(1 / rate)
        return i

    n = run_for(4.0)
    # New prefixes go to the least-loaded pods: if none of the groups landed on the victim, more
    # groups until one does (the kill must cut a group off its pod).
    for _ in range(24):
        if any(served == address for *_, served in log):
            break
        groups.append(unique_system(120))
        n = run_for(1.0, first=n)
    assert any(served == address for *_, served in log), (
        f"the victim {address} served nothing before the kill; served by: "
        f"{Counter(served for *_, served in log)}; chosen: {Counter(chosen for _, _, chosen, _ in log)}; "
        f"kvroute stats: {envoy.stats('kvroute')}")
    killed = pods.kill(0)
    killed_at = time.monotonic() - started
    n = run_for(6.0, first=n)
    after_kill = [e for e in log if e[0] > killed_at]
    failed = [e for e in log if e[1] != 200]
    assert not failed, f"{len(failed)} of {len(log)} requests failed: {failed[:5]}"
    assert not any(served == address for *_, served in after_kill)
    # Requests routed to the victim right after the kill were retried by Envoy on another pod,
    # and their response names the pod that really served them.
    retried = [e for e in after_kill if e[2] == address]
    assert retried, "no request was routed to the victim after the kill"
    assert all(served and served != address for *_, served in retried), retried
    # Within a second the victim is passed over; it is tried again only when its cooldown ends
    # (3 s by default, then Envoy's retry serves the request elsewhere).
    chosen_late = [e for e in after_kill if e[0] > killed_at + 1.0 and e[2] == address]
    late = [e for e in after_kill if e[0] > killed_at + 1.0]
    assert len(chosen_late) <= max(2, len(late) // 10), chosen_late
    print(f"\nkill: {len(after_kill)} requests after the kill, 0 failed, {len(retried)} retried elsewhere; "
          f"victim chosen {len(chosen_late)} of {len(late)} times after the first second")
    # Back on the same address with an empty cache: new prompts go there again once Envoy stops
    # ejecting it (outlier detection: 5 s, longer after repeated ejections) and its cooldown ends.
    pods.start_again(0, killed)
    back_at = time.monotonic() - started
    deadline = time.monotonic() + 40
    while time.monotonic() < deadline:
        n = run_for(1.0, first=n, fresh=True)
        if any(e[0] > back_at and e[3] == address for e in log):
            break
    served_again = [e for e in log if e[0] > back_at and e[3] == address]
    assert served_again, "routing never returned to the restarted pod"
    print(f"returned {served_again[0][0] - back_at:.1f} s after the restart")
    assert not [e for e in log if e[1] != 200]


def raw_post(envoy, body: bytes, extra_header: bytes) -> bytes:
    """A request written byte for byte: HTTP allows header bytes above 0x7f (obs-text)."""
    with socket.create_connection(("127.0.0.1", envoy.listener_port), timeout=30) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: gateway\r\nconnection: close\r\n"
                     b"content-type: application/json\r\n" + extra_header + b"\r\n"
                     b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    return answer


def test_header_bytes_that_are_not_utf8_neither_fail_the_request_nor_stop_routing(envoy):
    """The SDK's string header getter unwraps UTF-8: one such byte used to panic the worker's VM
    (the request got a 503 and the worker stopped routing)."""
    body = json.dumps({"model": MODEL, "max_tokens": 2,
                       "messages": [{"role": "user", "content": unique_system()}]}).encode()
    for _ in range(4):  # fresh connections: both workers see one
        answer = raw_post(envoy, body, b"x-request-id: caf\xe9-\xff\xfe")
        assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        assert b"x-kvroute-decision: pod=" in answer, answer[:600]
    # Both workers' VMs are alive: every request on fresh connections is still routed.
    for i in range(4):
        after = chat(envoy, unique_system(), f"still routed? {i}")
        assert after.status_code == 200
        assert decision(after)["pod"] == after.headers[POD]


class HugeFeed(http.server.BaseHTTPRequestHandler):
    """An 'indexer' whose feed answer is over Envoy's 32 MiB async-client limit."""

    def do_GET(self):  # noqa: N802 (http.server's naming)
        body = b"\0" * (40 << 20)
        self.send_response(200)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_feed_answer_over_envoys_limit_fails_open_without_a_panic(pods, monkeypatch):
    """Envoy resets a call whose response passes its buffer limit and hands the module a call
    with no response at all; reading one used to panic the singleton."""
    require_wasm()
    monkeypatch.setenv("KVROUTE_INDEXER_TOKEN", "t" * 32)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), HugeFeed)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        config = render_gateway(pods.addresses, template=GATEWAY_PRECISE,
                                indexer=f"127.0.0.1:{server.server_address[1]}")
        with EnvoyProcess(config) as proxy:
            proxy.wait_for_peers()
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline and proxy.stats("kvroute.feed.errors").get(
                    "wasmcustom.kvroute.feed.errors", 0) < 3:
                time.sleep(0.2)
            assert proxy.stats("kvroute.feed.errors")["wasmcustom.kvroute.feed.errors"] >= 3
            r = chat(proxy, unique_system(), "routed while the feed fails?")
            assert r.status_code == 200
            proxy.stop()  # Envoy flushes its log file on exit
            log = proxy.log_text()
            assert "panicked" not in log
            assert "feed call ended without a response" in log
    finally:
        server.shutdown()


def test_one_tenant_teaches_a_pod_only_its_budget(pods):
    """With tenant isolation the tenant names the client: a tenant's prompts teach each pod at most
    index.max_client_share of its table per ttl_seconds, whatever their size; other tenants keep
    their own budget."""
    plugin = {"tenant_header": "x-tenant", "max_blocks": 4096,
              "index": {"max_learn_share": 1.0, "max_client_share": 0.05},
              # one pod, 800 blocks: a budget of 40 blocks per tenant
              "endpoints": [{"address": pods.addresses[1], "capacity_blocks": 800}]}
    with gateway([pods.addresses[1]], plugin) as proxy:

        def twice(tenant: str, system: str) -> tuple[int, int]:
            first = chat(proxy, system, "q", headers={"x-tenant": tenant})
            proxy.wait_for_index_flush()  # the other worker sees what the first taught
            again = chat(proxy, system, "q", headers={"x-tenant": tenant})
            assert first.status_code == again.status_code == 200
            d = decision(again)
            return d["matched"], d["total"]

        matched, total = twice("tenant-a", unique_system(400))
        assert total > 100 and matched == 40, (matched, total)
        # The same tenant's next prompt finds its budget spent.
        matched, total = twice("tenant-a", unique_system(400))
        assert matched == 0, (matched, total)
        # Another tenant has a budget of its own.
        matched, total = twice("tenant-b", unique_system(40))
        assert 0 < total <= 40 and matched == total, (matched, total)


def test_without_a_singleton_the_filter_routes_on_load_only(pods):
    """The index lives in the singleton: a gateway configured without it still serves every
    request, decided on load only, counted, explained in the decision header and logged once."""
    require_wasm()
    config = yaml.safe_load(render_gateway(pods.addresses))
    del config["bootstrap_extensions"]
    with EnvoyProcess(yaml.safe_dump(config, sort_keys=False)) as proxy:
        proxy.wait_for_peers()
        system = unique_system()
        decisions = []
        for i in range(6):
            r = chat(proxy, system, f"q{i}")
            assert r.status_code == 200, r.text
            decisions.append(decision(r))
        assert all(d["matched"] == 0 and "index=absent (load only)" in d["raw"] for d in decisions), decisions
        unpublished = proxy.stats("kvroute.index.unpublished")["wasmcustom.kvroute.index.unpublished"]
        assert unpublished == len(decisions)
        logged = "no routing index published (absent)"
        wait_for("the log line (Envoy flushes its log file every 10 s)", lambda: logged in proxy.log_text(), 20)
        assert proxy.log_text().count(logged) <= proxy.concurrency, "once per worker VM"
