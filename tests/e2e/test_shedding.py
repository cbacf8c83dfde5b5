"""Priority and shedding at saturation, through the real Envoy (issue 15): when every pod is
saturated, a sheddable request gets the proxy's own 429 with Retry-After, counted and explained,
while a critical one is routed; with room again, sheddable requests route."""

import time

import pytest
import requests

from e2elib import DECISION, LOAD_BATCH_WAIT_S, MODEL, POD, chat, gateway, unique_system
from simcluster import SimCluster

PRIORITY = "x-kvroute-priority"


@pytest.fixture(scope="module")
def pods():
    # Slow pods (a quarter of the default speed) at real time: a long answer stays in flight
    # for many seconds, holding its pod saturated while the test asks.
    with SimCluster(pods=2, speed=0.25) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def envoy(pods):
    # Approximate mode: a pod is saturated with one request in flight (the in-flight test alone);
    # requests without the header are sheddable.
    plugin = {"priority": {"header": PRIORITY, "default_class": "batch",
                           "classes": {"batch": "sheddable", "interactive": "critical"},
                           "saturation": {"max_inflight_requests": 1, "max_waiting": 0, "max_kv_usage": 0},
                           "retry_after_seconds": 7}}
    with gateway(pods.addresses, plugin) as proxy:
        yield proxy


def open_stream(envoy, system: str):
    """A critical streamed request that stays in flight, once its first bytes arrived: the
    response and its chunk iterator (dropping the iterator would close the stream)."""
    body = {"model": MODEL, "max_tokens": 4000, "stream": True,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": "go"}]}
    r = requests.post(envoy.url + "/v1/chat/completions", json=body, stream=True, timeout=60,
                      headers={PRIORITY: "interactive"})
    assert r.status_code == 200, r.text
    chunks = r.iter_content(chunk_size=None)
    next(chunks)
    return r, chunks


def shed_count(envoy) -> int:
    return envoy.stats("kvroute.shed").get("wasmcustom.kvroute.shed", 0)


def test_sheddable_requests_get_429_at_saturation_and_critical_ones_route(envoy, pods):
    # Room everywhere: a sheddable request routes as without priorities.
    assert chat(envoy, unique_system(), "q").status_code == 200
    streams = []
    try:
        for _ in range(2):
            streams.append(open_stream(envoy, unique_system()))
            time.sleep(LOAD_BATCH_WAIT_S)  # both workers count it
        # Ties go to the pod with fewer requests in flight: one stream on each pod.
        assert {r.headers[POD] for r, _ in streams} == set(pods.addresses)
        before = shed_count(envoy)
        for headers in ({}, {PRIORITY: "batch"}, {PRIORITY: "no-such-class"}):
            r = chat(envoy, unique_system(), "q", headers=headers)
            assert r.status_code == 429, (headers, r.status_code, r.headers.get(DECISION))
            assert r.headers["retry-after"] == "7"
            assert POD not in r.headers, "answered by the proxy, never by a pod"
            assert r.headers[DECISION].startswith("shed=sheddable; pod="), r.headers[DECISION]
            assert "saturated=2/2 (inflight=2)" in r.headers[DECISION]
        assert shed_count(envoy) == before + 3
        critical = chat(envoy, unique_system(), "q", headers={PRIORITY: "interactive"})
        assert critical.status_code == 200, critical.text
        assert critical.headers[POD] in pods.addresses
        assert "saturated=2/2" in critical.headers[DECISION]
        assert shed_count(envoy) == before + 3
    finally:
        for r, _ in streams:
            r.close()
    # The closed streams release their pods (Envoy sees the resets); sheddable requests route again.
    deadline = time.monotonic() + 30
    while True:
        r = chat(envoy, unique_system(), "q")
        if r.status_code == 200 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert r.status_code == 200, r.headers.get(DECISION)
    assert "saturated" not in r.headers[DECISION]
