"""Sidecars without an index (issue 10): four Envoys, each with kvroute configured with
`remote_index` and nothing else (no endpoint list, no feed), share three vllm-sim pods that
publish KV events to the real kvroute-indexer. Every prompt is looked up at the indexer
(POST /v1/lookup), so a prefix sent through any sidecar lands on the pod that holds it; with the
indexer gone every request is still served, by Envoy's own load balancer."""

import contextlib
import signal

import pytest
import requests

from e2elib import MODEL, POD, decision, require_wasm, wait_for
from envoyctl import EnvoyProcess
from indexerctl import IndexerProcess
from mesh_lookup import render_sidecar
from simcluster import SimCluster, free_port_range

SIDECARS = 4
PODS = 3
CAPACITY = 512


@pytest.fixture(scope="module")
def mesh():
    require_wasm()
    port = free_port_range(PODS)
    addresses = [f"127.0.0.1:{port + i}" for i in range(PODS)]
    with contextlib.ExitStack() as stack:
        # The indexer first: the pods' first events already reach it.
        indexer = stack.enter_context(IndexerProcess(addresses, "--scrape-interval-ms=200"))
        sims = stack.enter_context(SimCluster(pods=PODS, port=port, time_scale=0.2, num_gpu_blocks=CAPACITY,
                                              kv_events_endpoint=indexer.zmq_endpoint))
        sidecars = [stack.enter_context(EnvoyProcess(render_sidecar(addresses, indexer.address)))
                    for _ in range(SIDECARS)]
        for envoy in sidecars:
            envoy.wait_for_peers()
        yield sims, indexer, sidecars


def tokens(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 100 for i in range(blocks * 16)]


def completion(url: str, ids: list[int]) -> requests.Response:
    # A fresh connection per request, so requests land on both Envoy workers.
    with requests.Session() as s:
        r = s.post(url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text
    return r



def stat(envoy, name: str) -> int:
    return envoy.stats("wasmcustom." + name).get("wasmcustom." + name, 0)


def test_a_prefix_sent_through_any_sidecar_lands_on_the_pod_that_holds_it(mesh):
    sims, indexer, sidecars = mesh
    for pod in range(PODS):
        ids = tokens(100 + pod, 20)
        before = indexer.blocks(sims.addresses[pod])
        completion(sims.urls[pod], ids)  # only the pod's KV events can tell anyone
        wait_for("indexer sees the blocks", lambda: indexer.blocks(sims.addresses[pod]) >= before + 20)
        for n, envoy in enumerate(sidecars):
            d = decision(completion(envoy.url, ids + tokens(900 + n, 1)))
            assert (d["pod"], d["matched"], d["domain"]) == (sims.addresses[pod], 20, "tokens"), d["raw"]
            assert d["raw"].endswith("; lookup=remote"), d["raw"]


def test_where_one_sidecar_sent_a_prefix_the_others_follow(mesh):
    sims, indexer, sidecars = mesh
    ids = tokens(200, 24)
    first = decision(completion(sidecars[0].url, ids))
    assert first["matched"] == 0, first["raw"]
    chosen = first["pod"]
    wait_for("indexer sees the blocks", lambda: indexer.blocks(chosen) >= 24)
    for n, envoy in enumerate(sidecars[1:]):
        d = decision(completion(envoy.url, ids + tokens(950 + n, 1)))
        assert (d["pod"], d["matched"]) == (chosen, 24), d["raw"]
    answered = sum(stat(e, "kvroute.remote_lookup.answered") for e in sidecars)
    assert answered >= PODS * SIDECARS + SIDECARS
    assert indexer.metric("kvroute_indexer_lookups_total", result="answered") >= answered


def test_short_prompts_are_decided_locally(mesh):
    sims, indexer, sidecars = mesh
    r = completion(sidecars[0].url, tokens(300, 2))  # 2 blocks < min_blocks 4
    assert r.headers[POD] in sims.addresses
    assert r.headers["x-kvroute-decision"] == "fallback=no_endpoints; lookup=local (below min_blocks)"


def test_without_the_indexer_every_request_is_still_served(mesh):
    """Runs last: it stops the indexer."""
    sims, indexer, sidecars = mesh
    failed_before = sum(stat(e, "kvroute.remote_lookup.failed") for e in sidecars)
    indexer.stop(signal.SIGKILL)
    served = set()
    for i in range(12):
        r = completion(sidecars[i % SIDECARS].url, tokens(400 + i, 8))
        served.add(r.headers[POD])
        # Envoy answers the call itself: 503, the indexer refuses connections.
        assert r.headers["x-kvroute-decision"] == "fallback=no_endpoints; lookup=local (status 503)"
    assert served <= set(sims.addresses)
    assert sum(stat(e, "kvroute.remote_lookup.failed") for e in sidecars) == failed_before + 12
