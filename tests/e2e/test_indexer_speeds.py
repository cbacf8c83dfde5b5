"""Pod speeds from the indexer (issue 15.1) with the real Envoy in precise mode: the indexer's
pod sources state each pod's relative speed (`--pod ADDRESS@MODEL,speed=S`), the feed carries it
in the pod list, and the filter divides the cost of a pod its plugin config does not list by that
speed; a pod the config lists keeps its configured `speed`."""

import pytest
import requests

from e2elib import MODEL, decision, require_wasm, wait_for
from envoyctl import GATEWAY_PRECISE, EnvoyProcess, render_gateway
from indexerctl import IndexerProcess
from simcluster import SimCluster

CAPACITY = 256


@pytest.fixture(scope="module")
def stack():
    require_wasm()
    indexer = IndexerProcess((), "--scrape-interval-ms=200")
    with SimCluster(pods=2, time_scale=0.2, num_gpu_blocks=CAPACITY, kv_events_endpoint=indexer.zmq_endpoint) as sims:
        listed, unlisted = sims.addresses
        # The indexer states both speeds; the plugin config lists only the first pod, at its own speed.
        indexer.flags += [f"--pod={listed}@{MODEL},speed=4", f"--pod={unlisted}@{MODEL},speed=0.5"]
        with indexer:
            plugin = {"default_capacity_blocks": CAPACITY, "endpoints": [{"address": listed, "speed": 2.0}]}
            config = render_gateway(sims.addresses, plugin, template=GATEWAY_PRECISE, indexer=indexer.address)
            with EnvoyProcess(config) as envoy:
                envoy.wait_for_peers()
                yield sims, indexer, envoy


def tokens(seed: int, blocks: int) -> list[int]:
    return [(seed * 7919 + i * 31) % 50000 + 100 for i in range(blocks * 16)]


def completion(url: str, ids: list[int]) -> requests.Response:
    r = requests.post(url + "/v1/completions", json={"model": MODEL, "prompt": ids, "max_tokens": 1}, timeout=30)
    assert r.status_code == 200, r.text
    return r


def test_a_pod_the_config_does_not_list_takes_its_speed_from_the_indexer(stack):
    sims, indexer, envoy = stack
    listed, unlisted = sims.addresses
    speeds = {a: p.get("speed") for a, p in indexer.pods_debug().items()}
    assert speeds == {listed: 4.0, unlisted: 0.5}
    for pod, seed, speed in [(unlisted, 1, "0.5"), (listed, 2, "2")]:
        ids = tokens(seed, 20)
        completion(sims.urls[sims.addresses.index(pod)], ids)  # only the KV events tell Envoy
        wait_for("indexer sees the blocks", lambda: indexer.blocks(pod) >= 20)
        # The decision names the pod's speed once the feed has carried both the pod list
        # and the blocks (the first requests may route before the singleton's next poll).
        def routed_with_speed() -> bool:
            d = decision(completion(envoy.url, ids + [1, 2, 3]))
            return d["pod"] == pod and d["matched"] == 20 and f" at speed {speed};" in d["raw"]
        wait_for(f"{pod} routed at speed {speed}", routed_with_speed)
