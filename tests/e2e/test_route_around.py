"""Routing around a saturated pod, through the real Envoy: with `saturation.route_around`, a request
whose prefix one pod holds goes to a pod with room while that one is saturated (counted, and
explained in the decision header), and is routed on its cached prefix again once the pod has room."""

import time

import pytest

from e2elib import DECISION, LOAD_BATCH_WAIT_S, POD, chat, decision, gateway, open_stream, unique_system, wait_for
from simcluster import SimCluster

ROUTED_AROUND = "kvroute.routed_around_saturated"


@pytest.fixture(scope="module")
def pods():
    # Slow pods at real time: a long answer stays in flight, holding its pod saturated.
    with SimCluster(pods=2, speed=0.25) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def envoy(pods):
    # Approximate mode: one request in flight saturates a pod (the in-flight test alone).
    plugin = {"saturation": {"route_around": True, "max_inflight_requests": 1,
                             "max_waiting": 0, "max_kv_usage": 0}}
    with gateway(pods.addresses, plugin) as proxy:
        yield proxy


def routed_around(envoy) -> int:
    return envoy.stats(ROUTED_AROUND).get("wasmcustom." + ROUTED_AROUND, 0)


def test_a_cached_prefix_on_a_saturated_pod_goes_to_a_pod_with_room(envoy, pods):
    system = unique_system()
    first = chat(envoy, system, "q")
    assert first.status_code == 200, first.text
    home = first.headers[POD]
    envoy.wait_for_index_flush()  # both workers know the prefix is on `home`
    response, _chunks = open_stream(envoy, system)
    try:
        assert response.headers[POD] == home, response.headers[DECISION]
        assert decision(response)["matched"] > 0
        assert "passed over" not in response.headers[DECISION]
        time.sleep(LOAD_BATCH_WAIT_S)  # both workers count it
        before = routed_around(envoy)
        around = chat(envoy, system, "q2")
        assert around.status_code == 200, around.text
        d = decision(around)
        assert around.headers[POD] != home, d["raw"]
        assert around.headers[POD] in pods.addresses
        assert d["matched"] == 0, d["raw"]
        assert d["raw"].endswith("; passed over 1 saturated"), d["raw"]
        assert routed_around(envoy) == before + 1
    finally:
        response.close()

    # The closed stream releases `home`: the prompt routes on its cached prefix, passing nobody over.
    def routed_on_the_prefix() -> bool:
        d = decision(chat(envoy, system, "q3"))
        return d["matched"] > 0 and "passed over" not in d["raw"]

    wait_for("a routing decision on the cached prefix, nobody passed over", routed_on_the_prefix, timeout=30)
