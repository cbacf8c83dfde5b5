"""Why istio/ inserts the filter with an EnvoyFilter and not a WasmPlugin (docs/operator-guide.md,
section 1): Istio generates a WasmPlugin's Envoy PluginConfig without
allow_on_headers_stop_iteration and without vm_id. With the module's filter configured that way,
Envoy 1.40 never resumes a request kvroute paused in its headers callback: it hangs. The same
config with the two fields (what the EnvoyFilter ships) is served."""

import json

import pytest
import requests
import yaml

import meshlib
from envoyctl import EnvoyProcess, free_port
from simcluster import SimCluster

MODEL = "Qwen/Qwen3-32B"


@pytest.fixture(scope="module")
def sims():
    meshlib.require_module()
    with SimCluster(pods=2, time_scale=0.2) as cluster:
        yield cluster


def filter_only_config(sims, *, as_wasmplugin):
    """envoy/mesh-gateway.yaml's filter with static endpoints (no singleton, no indexer)."""
    (cfg,) = meshlib.load_yaml_docs(meshlib.ENVOY_DIR / "mesh-gateway.yaml")
    del cfg["bootstrap_extensions"]
    cfg["admin"]["address"]["socket_address"]["port_value"] = free_port()
    (listener,) = cfg["static_resources"]["listeners"]
    listener["address"]["socket_address"]["port_value"] = free_port()
    cfg["static_resources"]["clusters"][0]["load_assignment"]["endpoints"] = [{"lb_endpoints": [
        {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": int(a.rsplit(":", 1)[1])}}}}
        for a in sims.addresses]}]
    hcm = listener["filter_chains"][0]["filters"][0]["typed_config"]
    wasm = hcm["http_filters"][0]["typed_config"]["config"]
    plugin = json.loads(wasm["configuration"]["value"])
    del plugin["indexer"]
    plugin["endpoints"] = [{"address": a} for a in sims.addresses]
    wasm["configuration"]["value"] = json.dumps(plugin)
    if as_wasmplugin:  # what Istio generates for a WasmPlugin
        del wasm["allow_on_headers_stop_iteration"]
        del wasm["vm_config"]["vm_id"]
    return yaml.safe_dump(cfg, sort_keys=False).replace("target/wasm32-wasip1/release/kvroute.wasm", str(meshlib.WASM_PATH))


def post(envoy, timeout):
    body = {"model": MODEL, "prompt": "hello there " * 50, "max_tokens": 1}
    with requests.Session() as s:
        return s.post(envoy.url + "/v1/completions", json=body, timeout=timeout)


def test_envoyfilter_config_is_served(sims):
    with EnvoyProcess(filter_only_config(sims, as_wasmplugin=False)) as envoy:
        r = post(envoy, 30)
        assert r.status_code == 200
        assert r.headers["x-vllm-sim-pod"] in sims.addresses
        assert "x-kvroute-decision" in r.headers


def test_wasmplugin_generated_config_hangs(sims):
    with EnvoyProcess(filter_only_config(sims, as_wasmplugin=True)) as envoy:
        with pytest.raises(requests.exceptions.ReadTimeout):
            post(envoy, 4)
        assert envoy.settled_stats("kvroute").get("wasmcustom.kvroute.requests") == 1, "the filter saw it, then it stalled"
